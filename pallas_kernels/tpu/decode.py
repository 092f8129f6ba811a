"""Paged decode attention for TPU (Pallas, Mosaic): block tables in SMEM chunks, pages by
manual double-buffered DMA.

One query token per sequence. Grid ``(B,)`` ("parallel": sequences are independent, so
megacore chips split them across cores). A program computes every query head of its
sequence: a page is fetched as one contiguous ``[P, 2K, D]`` DMA (all kv heads; a head dim
over 128 in 128-lane pieces, a DMA each), so each K/V byte crosses HBM once, and the K/V
of each head serves its whole GQA group, computed a kv head at a time.

* ``kv_lens`` reach the kernel by scalar prefetch. The block table stays in HBM and is
  copied into a small SMEM buffer ``table_chunk`` entries at a time, so tables of any
  length work (a whole big-batch table does not fit in SMEM).
* Pages are fetched ``pages_per_block`` at a time into two VMEM buffers: block j + 1's
  DMAs are in flight while block j is computed. Pages past the sequence's length get no
  DMA; with a sliding window the blocks wholly before the window are skipped.
* Online softmax in f32; f32 KV is computed in f32 (no cast to bf16).

KV dtypes: f32, bf16, f16, and int8 / fp8 with per-token scales (``f32[N, P, K]`` arrays,
fetched by DMA beside their pages) or per-tensor floats.

Status: verified in TPU interpret mode on CPU, and compiled for TPU v5e and v6e through
libtpu on a CPU host (``aot.py``, ``.ci/tpu_compile``); never run on a TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .._table import safe_lens, safe_table
from ._pages import (
    TABLE_DMA_ENTRIES,
    PagePipeline,
    as_kernel_pool,
    check_layout,
    default_pages_per_block,
    default_table_chunk,
    empty_folds,
    finish,
    fold_rows,
    rows_of_sinks,
    scores,
    scratch_shapes,
    sink_folds,
    split_refs,
)

__all__ = ["decode_paged_attention", "default_pages_per_block"]


def _kernel(
    lens_ref,
    *refs,
    sm_scale,
    soft_cap,
    sliding_window,
    pages_per_block,
    table_chunk,
    page_size,
    num_kv_heads,
    precision,
    k_scale,
    v_scale,
    quantized,
    kv_dtype,
    interpret,
    has_sinks=False,
):
    sinks_ref = refs[1] if has_sinks else None  # after the queries: f32[K, G, 1]
    refs = (refs[0], *refs[2:]) if has_sinks else refs
    q_ref, o_ref, parts = split_refs(refs, quantized)
    b = pl.program_id(0)
    bp, P, K = pages_per_block, page_size, num_kv_heads
    _, H, D = q_ref.shape
    G, C = H // K, pages_per_block * page_size
    kv_len = lens_ref[b]
    used = pl.cdiv(kv_len, P)
    first_key = 0
    first_page = 0
    if sliding_window is not None:
        first_key = jnp.maximum(kv_len - sliding_window, 0)
        first_page = (first_key // P) // bp * bp
    num_blocks = pl.cdiv(jnp.maximum(used - first_page, 0), bp)
    pipe = PagePipeline(b, first_page, used, *parts, bp, table_chunk, interpret)
    q = q_ref[0].astype(jnp.float32) * sm_scale  # [H, D]; kv head h's group: rows h G..

    def body(j, carry):
        slot = j % 2

        @pl.when(j + 1 < num_blocks)
        def _():
            pipe.start(j + 1, 1 - slot)

        pipe.wait(j, slot)
        first = (first_page + j * bp) * P
        # skipped pages hold stale data: zero it in K and V, mask it in the scores
        row_tok = first + jax.lax.broadcasted_iota(jnp.int32, (C, D), 0)
        row_ok = (row_tok < kv_len) & (row_tok >= first_key)
        col_tok = first + jax.lax.broadcasted_iota(jnp.int32, (G, C), 1)
        col_ok = (col_tok < kv_len) & (col_tok >= first_key)
        out = []
        for h in range(K):
            k, v = pipe.head(slot, h, k_scale, v_scale, kv_dtype)  # [C, D] each
            k = jnp.where(row_ok, k, 0.0)
            v = jnp.where(row_ok, v, 0.0)
            s = scores(q[h * G : (h + 1) * G], k, precision)
            out.append(fold_rows(s, col_ok, carry[h], v, soft_cap, precision))
        return tuple(out)

    @pl.when(num_blocks > 0)
    def _():
        pipe.start(0, 0)

    init = empty_folds(K, G, D) if sinks_ref is None else sink_folds(sinks_ref, K, D)
    heads = jax.lax.fori_loop(0, num_blocks, body, init)
    for h, carry in enumerate(heads):
        o_ref[0, pl.ds(h * G, G), :] = finish(carry).astype(o_ref.dtype)


def split_scales(k_scale, v_scale):
    """(static float scales, per-token scale arrays) from the public scale arguments."""
    is_arr = lambda s: s is not None and not isinstance(s, (int, float))  # noqa: E731
    if is_arr(k_scale) != is_arr(v_scale):
        raise ValueError("k_scale, v_scale: pass both as arrays or neither")
    if is_arr(k_scale):
        return (None, None), (k_scale.astype(jnp.float32), v_scale.astype(jnp.float32))
    as_float = lambda s: None if s is None else float(s)  # noqa: E731
    return (as_float(k_scale), as_float(v_scale)), None


def check_table_chunk(pages_per_block, table_chunk, interpret: bool):
    if table_chunk is not None and pages_per_block is not None and table_chunk % pages_per_block:
        raise ValueError(
            f"table_chunk: expected a multiple of pages_per_block="
            f"{pages_per_block}, got {table_chunk}"
        )
    if table_chunk is not None and not interpret and table_chunk % TABLE_DMA_ENTRIES:
        raise ValueError(
            f"table_chunk: expected a multiple of {TABLE_DMA_ENTRIES} on a TPU (its DMA "
            f"copies 512-byte runs; interpret mode takes any), got {table_chunk}"
        )


def decode_paged_attention(
    q: jax.Array,  # [B, H, D]
    kv_pages: jax.Array,  # [N, P, 2K, D]
    kv_lens: jax.Array,  # i32[B]
    page_indices: jax.Array,  # i32[B, M]
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: jax.Array | float | None = None,  # f32[N, P, K] or a float
    v_scale: jax.Array | float | None = None,
    sinks: jax.Array | None = None,  # f32[H]
    pages_per_block: int | None = None,
    table_chunk: int | None = None,
    interpret: bool = False,
) -> jax.Array:  # [B, H, D]
    """Decode attention (see the module docstring); arguments as
    ``paged_jax.paged_attention`` (``sinks``: each query head's sink starts its rows'
    softmax). Knobs: ``pages_per_block`` (pages per DMA buffer;
    default ~512 KiB of K/V, from page size, kv heads, head_dim and dtype) and
    ``table_chunk`` (block-table entries per SMEM copy; default 16 blocks' worth)."""
    check_table_chunk(pages_per_block, table_chunk, interpret)
    floats, arrays = split_scales(k_scale, v_scale)
    return _decode(
        q,
        kv_pages,
        kv_lens,
        page_indices,
        arrays,
        sinks,
        sm_scale=float(sm_scale),
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=floats[0],
        v_scale=floats[1],
        pages_per_block=pages_per_block,
        table_chunk=table_chunk,
        interpret=interpret,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "soft_cap",
        "sliding_window",
        "k_scale",
        "v_scale",
        "pages_per_block",
        "table_chunk",
        "interpret",
    ),
)
def _decode(
    q,
    kv_pages,
    kv_lens,
    page_indices,
    scale_arrays,
    sinks,
    *,
    sm_scale,
    sliding_window,
    soft_cap,
    k_scale,
    v_scale,
    pages_per_block,
    table_chunk,
    interpret,
):
    B, H, D = q.shape
    N, P, combined, _ = kv_pages.shape
    M = page_indices.shape[1]
    out_dtype = q.dtype
    kv_pages, kv_dtype = as_kernel_pool(kv_pages)
    if q.dtype == jnp.float16:  # v5e has no 16-bit float vectors: f16 rows go in as f32
        q = q.astype(jnp.float32)
    bp = pages_per_block or default_pages_per_block(P, combined, D, kv_pages.dtype.itemsize)
    ch = table_chunk or default_table_chunk(bp)
    check_layout(combined, D, kv_pages.dtype)
    width = pl.cdiv(M + bp, ch) * ch  # room for a block that starts near the end
    table = safe_table(page_indices, N, width)  # padding and bad ids: the null page
    kv_lens = safe_lens(kv_lens, M * P)
    quantized = scale_arrays is not None
    kernel = functools.partial(
        _kernel,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        pages_per_block=bp,
        table_chunk=ch,
        page_size=P,
        num_kv_heads=combined // 2,
        precision=jax.lax.Precision.HIGHEST if out_dtype == jnp.float32 else None,
        k_scale=k_scale,
        v_scale=v_scale,
        quantized=quantized,
        kv_dtype=kv_dtype,
        interpret=interpret,
        has_sinks=sinks is not None,
    )
    K, G = combined // 2, H // (combined // 2)
    sink_rows = rows_of_sinks(sinks, K, G)  # [K, G, 1]
    sink_spec = [] if sinks is None else [pl.BlockSpec((K, G, 1), lambda b, lens: (0, 0, 0))]
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B,),
            in_specs=[pl.BlockSpec((1, H, D), lambda b, lens: (b, 0, 0)), *sink_spec, hbm, hbm]
            + ([hbm, hbm] if quantized else []),
            out_specs=pl.BlockSpec((1, H, D), lambda b, lens: (b, 0, 0)),
            scratch_shapes=scratch_shapes(bp, P, combined, D, kv_pages.dtype, ch, quantized),
        ),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="paged_decode_tpu",
    )(kv_lens, q, *([] if sinks is None else [sink_rows]), table, kv_pages, *(scale_arrays or ()))
    return out.astype(out_dtype)
