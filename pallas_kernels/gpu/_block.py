"""The GPU kernels' page walk (traced inside them): a block of pages gathered through the
block table (``load_pages``), dequantized, zeroed where it does not count and folded into
the online softmax (``fold_pages``), block after block (``walk``: plain, or each next
block loaded ahead)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .._softmax import fold


def empty_carry(rows: int, head_dim: int):
    """The online softmax's state before any key, for ``rows`` query rows: the output
    ``f32[rows, head_dim]`` zeros, the running maximum ``-inf`` and the running sum 0
    (``f32[rows]`` each): ``walk``'s ``init``."""
    return (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


def sink_carry(sinks, head_dim: int):
    """``empty_carry`` with attention sinks: ``sinks`` ``f32[rows]`` (-inf: a row with no
    sink) start the running maximum, and the running sum at 1 where one is finite (the
    sink a key whose value is 0)."""
    rows = sinks.shape[0]
    return (
        jnp.zeros((rows, head_dim), jnp.float32),
        sinks,
        jnp.where(sinks > -jnp.inf, 1.0, 0.0).astype(jnp.float32),
    )


def group_sinks(sinks, num_kv_heads: int, group: int, rows: int):
    """Each KV head's query heads' sinks ``f32[H]`` as ``f32[K, rows]``, rows past the
    group's ``group`` padded with -inf (no sink); None stays None."""
    if sinks is None:
        return None
    s = jnp.asarray(sinks, jnp.float32).reshape(num_kv_heads, group)
    return jnp.pad(s, ((0, 0), (0, rows - group)), constant_values=-jnp.inf)


def load_pages(refs, pages):
    """The raw contents of ``pages`` (``i32[bp]`` ids) from ``refs`` (``(k_ref, v_ref,
    k_scale_ref | None, v_scale_ref | None)`` over the whole pool of one kv head): ``(k,
    v, k_scale | None, v_scale | None)``, K and V ``[bp, P, D]`` in the pool's dtype, the
    scales ``f32[bp, P]``. Nothing depends on the values, so a walk may issue these loads
    a block ahead of the block it computes on (``fold_pages`` takes them)."""
    return tuple(None if ref is None else ref[pages] for ref in refs)


def fold_pages(q, raw, keep, mask, carry, *, compute_dtype, precision, soft_cap):
    """Folds the keys of a loaded block (``load_pages``'s ``raw``) into ``carry``.

    ``q``: ``[R, D]`` queries in ``compute_dtype``, already scaled; ``keep``:
    ``bool[bp * P]``, the slots that may be read (others are zeroed: unwritten slots may
    hold NaN, and a masked score does not protect ``p @ v``); ``mask``: which (row, key)
    scores count, broadcastable to ``[R, bp * P]``; ``carry``: ``(acc, m, l)`` as in
    ``fold``. Dots take ``compute_dtype`` operands and accumulate in f32.
    """
    k_raw, v_raw, ks_raw, vs_raw = raw
    tokens = keep.shape[0]
    head_dim = q.shape[-1]

    def widen(x, scale):
        x = x.reshape(tokens, head_dim)
        if scale is not None:
            x = x.astype(jnp.float32) * scale.reshape(tokens, 1)
        return jnp.where(keep[:, None], x.astype(compute_dtype), 0)

    k, v = widen(k_raw, ks_raw), widen(v_raw, vs_raw)
    dot = functools.partial(
        jax.lax.dot_general, precision=precision, preferred_element_type=jnp.float32
    )
    return fold(
        dot(q, k, (((1,), (1,)), ((), ()))),
        mask,
        carry,
        lambda p: dot(p.astype(compute_dtype), v, (((1,), (0,)), ((), ()))),
        soft_cap,
    )


def walk(
    refs,
    table_ref,
    row,
    start,
    num_blocks,
    pages_per_block,
    used_pages,
    fold,
    init,
    *,
    prefetch=False,
):
    """Folds the blocks of ``pages_per_block`` table columns from ``start`` (``num_blocks``
    of them) of table row ``row`` into ``init``: ``fold(first_page, raw, carry)`` with
    ``raw`` the block's ``load_pages``. Columns at or past ``used_pages`` read the null
    page 0 (never a garbage id).

    ``prefetch``: each step issues the next block's loads and the table entries of the
    block after it before folding the block in hand (loaded by the step before), so
    neither round trip waits on this block's dots; compiled for sm_90, Triton's own
    pipelining of the plain walk issues a block's copies after the previous block's dots
    and waits for them at once. The same blocks folded in the same order (a column past
    ``used_pages`` reads its table entry, which ``safe_table`` keeps inside the pool, and
    its keys are masked by the caller's fold as any past the length). Blocks past the
    walk's end are loaded and dropped; the table's columns are clamped to its width."""
    bp = pages_per_block
    if not prefetch:

        def body(j, carry):
            first_page = start + j * bp
            pages = table_ref[row, pl.ds(first_page, bp)]
            pages = jnp.where(first_page + jnp.arange(bp) < used_pages, pages, 0)
            return fold(first_page, load_pages(refs, pages), carry)

        return jax.lax.fori_loop(0, num_blocks, body, init)
    width = table_ref.shape[1]

    def ids(first_page):
        return table_ref[row, pl.ds(jnp.minimum(first_page, width - bp), bp)]

    def step(j, carry):
        state, raw, next_ids = carry
        first_page = start + j * bp
        raw_next = load_pages(refs, next_ids)
        ids_after = ids(first_page + 2 * bp)
        return fold(first_page, raw, state), raw_next, ids_after

    carry = (init, load_pages(refs, ids(start)), ids(start + bp))
    return jax.lax.fori_loop(0, num_blocks, step, carry)[0]
