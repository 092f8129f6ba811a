"""Batch-invariant execution: a row's result must not depend on how many rows share the
call. XLA:CPU picks its matmul and row-reduction code from the row count (measured with
jax 0.10.2: a row of ``x @ W`` differs in the last bits between 1, 2-32 and 64 or more
rows, and so does a row mean), so the same token gave different logits alone and in a
batch. ``rowwise`` runs row-wise work on tiles of a fixed row count, one compiled body for
every tile and every step size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ROW_TILE = 8


def fit_rows(x: jax.Array, rows: int) -> jax.Array:
    """``x`` cut or zero-padded along its first axis to ``rows`` rows."""
    if x.shape[0] >= rows:
        return x[:rows]
    return jnp.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


def rowwise(fn, *xs, invariant: bool):
    """``fn(*xs)``, where ``xs`` are arrays or pytrees of arrays sharing their first (row)
    axis and ``fn`` treats rows independently. With ``invariant`` it is applied to tiles
    of ``ROW_TILE`` rows in a ``lax.map`` (rows zero-padded to whole tiles, then cut);
    ``None`` leaves pass through."""
    if not invariant:
        return fn(*xs)
    leaves = [x for x in jax.tree.leaves(xs) if x is not None]
    n = leaves[0].shape[0]
    tiles = -(-n // ROW_TILE)

    def split(x):
        x = fit_rows(x, tiles * ROW_TILE)
        return x.reshape((tiles, ROW_TILE) + x.shape[1:])

    out = jax.lax.map(lambda t: fn(*t), jax.tree.map(split, xs))
    return jax.tree.map(lambda o: o.reshape((tiles * ROW_TILE,) + o.shape[2:])[:n], out)
