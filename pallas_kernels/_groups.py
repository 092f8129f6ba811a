"""The grouped expert products' tile table, shared by the GPU and TPU kernels (jax.numpy
only), and their plain-jnp reference.

A step's (token, expert) pairs are laid out expert by expert in rows padded so that every
``block_m``-row tile holds one expert's rows only: expert ``e``'s ``n_e`` pairs take
``cdiv(n_e, block_m)`` whole tiles, the experts in order. ``tile_expert[t]`` names the
expert of tile ``t``; a kernel reads that expert's weights for the tile (TPU: through
scalar prefetch in its weight's index map; GPU: a load from the table), so an expert no
pair chose is never read, and the tiles past ``tiles_used`` (the table has a static
number of tiles, an upper bound) compute nothing.

Shapes: N pairs, X experts, M = tiles * block_m padded rows, K inputs, F outputs.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class ExpertTiles(NamedTuple):
    """Where each pair's row sits in the padded rows, and each tile's expert."""

    rows: jax.Array  # i32[N]: the padded row of pair i; M for a pair of no expert
    tile_expert: jax.Array  # i32[tiles]: tile t's expert (past tiles_used: the last used one's)
    tiles_used: jax.Array  # i32[1]: tiles holding at least one pair


def num_tiles(pairs: int, experts: int, block_m: int) -> int:
    """The static number of tiles ``expert_tiles`` lays ``pairs`` pairs of ``experts``
    experts in: ``sum_e cdiv(n_e, block_m) <= cdiv(pairs, block_m) + min(experts, pairs)``
    (each expert's last tile at most one more than its rows fill)."""
    return -(-pairs // block_m) + min(experts, pairs)


def expert_tiles(ids: jax.Array, num_experts: int, block_m: int) -> ExpertTiles:
    """The tile table of pairs whose experts are ``ids`` (``i32[N]``; an id outside ``[0,
    num_experts)`` is a pair of no expert, laid nowhere: ``rows`` M). Pairs keep their
    order within an expert (a stable sort). ``num_experts`` and ``block_m`` are static."""
    N = ids.shape[0]
    tiles = num_tiles(N, num_experts, block_m)
    ids = ids.astype(jnp.int32)
    valid = (ids >= 0) & (ids < num_experts)
    key = jnp.where(valid, ids, num_experts)  # no expert: after every group
    sizes = jnp.zeros((num_experts + 1,), jnp.int32).at[key].add(1)[:num_experts]
    tiles_of = -(-sizes // block_m)
    tile_end = jnp.cumsum(tiles_of)
    first_row = (tile_end - tiles_of) * block_m
    group_start = jnp.cumsum(sizes) - sizes
    order = jnp.argsort(key, stable=True)
    sorted_key = key[order]
    e = jnp.minimum(sorted_key, num_experts - 1)
    rank = jnp.arange(N, dtype=jnp.int32) - group_start[e]
    dest = jnp.where(sorted_key < num_experts, first_row[e] + rank, tiles * block_m)
    rows = jnp.zeros((N,), jnp.int32).at[order].set(dest.astype(jnp.int32))
    used = tile_end[-1]
    t = jnp.arange(tiles, dtype=jnp.int32)
    last = jnp.maximum(used - 1, 0)
    tile_expert = jnp.searchsorted(tile_end, jnp.minimum(t, last), side="right")
    tile_expert = jnp.minimum(tile_expert, num_experts - 1).astype(jnp.int32)
    return ExpertTiles(rows, tile_expert, jnp.reshape(used, (1,)).astype(jnp.int32))


def check_grouped(x, w, tile_expert, tiles_used, scale, block_m: int) -> None:
    """Trace-time checks both kernels share: ``x [M, K]`` with M = tiles * block_m, ``w
    [X, K, F]`` float in ``x``'s dtype or int8 with ``scale f32[X, F]``."""
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x, w: expected [M, K] and [X, K, F], got {x.shape} and {w.shape}")
    if tile_expert.ndim != 1 or x.shape[0] != tile_expert.shape[0] * block_m:
        raise ValueError(
            f"x: expected {tile_expert.shape[0]} tiles of block_m={block_m} rows "
            f"({tile_expert.shape[0] * block_m}), got {x.shape[0]}"
        )
    if tiles_used.shape != (1,):
        raise ValueError(f"tiles_used: expected shape (1,), got {tiles_used.shape}")
    if w.dtype == jnp.int8:
        if scale is None or scale.shape != (w.shape[0], w.shape[2]):
            got = None if scale is None else scale.shape
            raise ValueError(f"scale: an int8 w needs f32[{w.shape[0]}, {w.shape[2]}], got {got}")
    elif w.dtype != x.dtype:
        raise ValueError(f"w: expected {x.dtype} (x's dtype) or int8, got {w.dtype}")
    elif scale is not None:
        raise ValueError("scale: only an int8 w takes one")


def grouped_matmul_reference(
    x: jax.Array,  # [M, K], M = tiles * block_m
    w: jax.Array,  # [X, K, F], x's dtype or int8
    tile_expert: jax.Array,  # i32[tiles]
    tiles_used: jax.Array,  # i32[1]
    scale: jax.Array | None = None,  # f32[X, F] for an int8 w
    *,
    block_m: int,
) -> jax.Array:  # [M, F] in x's dtype; rows of tiles past tiles_used: 0
    """What the kernels compute, in plain jnp: each used tile's rows times its expert's
    weight (times the expert's column scales), in f32, returned in ``x``'s dtype."""
    tiles = tile_expert.shape[0]
    xt = x.reshape(tiles, block_m, x.shape[1]).astype(jnp.float32)
    wt = w[tile_expert].astype(jnp.float32)  # [tiles, K, F]
    out = jnp.einsum("tmk,tkf->tmf", xt, wt, precision=jax.lax.Precision.HIGHEST)
    if scale is not None:
        out = out * scale[tile_expert][:, None, :]
    live = jnp.arange(tiles) < tiles_used[0]
    out = jnp.where(live[:, None, None], out, 0.0)
    return out.reshape(tiles * block_m, -1).astype(x.dtype)
