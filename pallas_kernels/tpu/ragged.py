"""Ragged paged attention for TPU (Pallas, Mosaic): prefill chunks and decode tokens of many
sequences in one launch, pages fetched by double-buffered DMA through the block table.

The wrapper cuts every sequence's new tokens into blocks of ``tokens_per_block`` and
gathers each block's query rows into an aligned ``[W, bq, H, D]`` layout (W = cdiv(T, bq)
+ S, spare blocks do nothing); the kernel's grid is one program per block ("parallel").
A program reads its sequence's length and first token by scalar prefetch, copies block
table chunks into SMEM, fetches the pages up to the causal end of its last token (from
the first page inside its sliding window) into two VMEM buffers, one ``[P, 2K, D]`` DMA
per page, the next block in flight while the current one is computed, and folds them
into an online softmax in f32 with a causal mask per row. The wrapper scatters the rows
back; padding tokens come out 0. The gather/scatter moves T * H * D elements, small next
to the K/V bytes.

KV dtypes as the decode kernel: f32, bf16, f16, int8 / fp8 with per-token or per-tensor
scales.

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
from .._worklist import work_list
from ._pages import (
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
from .decode import check_table_chunk, split_scales


def _kernel(
    seq_ref,
    start_ref,
    live_ref,
    lens_ref,
    cu_ref,
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
    tokens_per_block,
    has_sinks=False,
):
    sinks_ref = refs[1] if has_sinks else None  # after the queries: f32[K, bq G, 1]
    refs = (refs[0], *refs[2:]) if has_sinks else refs
    q_ref, o_ref, parts = split_refs(refs, quantized)
    w = pl.program_id(0)
    bp, P, K = pages_per_block, page_size, num_kv_heads
    _, _, R, D = q_ref.shape  # R = bq * G rows: token t's query heads of kv head h at t G..
    G = R // tokens_per_block
    C = bp * P
    seq, q_start, live = seq_ref[w], start_ref[w], live_ref[w]
    kv_len = lens_ref[seq]
    q_end = cu_ref[seq + 1]
    # a token's position in its sequence: kv_len - q_end + its index in the batch
    any_row = (live > 0) & (q_start < q_end)
    last_tok = jnp.minimum(q_start + tokens_per_block, q_end) - 1
    last_pos = jnp.where(any_row, kv_len - q_end + last_tok, -1)
    used = jnp.minimum(pl.cdiv(last_pos + 1, P), pl.cdiv(kv_len, P))
    first_page = 0
    if sliding_window is not None:
        first_pos = jnp.where(any_row, kv_len - q_end + q_start, kv_len)
        first_page = (jnp.maximum(first_pos - sliding_window + 1, 0) // P) // bp * bp
    num_blocks = pl.cdiv(jnp.maximum(used - first_page, 0), bp)
    pipe = PagePipeline(seq, first_page, used, *parts, bp, table_chunk, interpret)
    row_tok = q_start + jax.lax.broadcasted_iota(jnp.int32, (R, C), 0) // G
    row_ok = (row_tok < q_end) & (live > 0)
    pos = kv_len - q_end + row_tok

    def body(j, carry):
        slot = j % 2

        @pl.when(j + 1 < num_blocks)
        def _():
            pipe.start(j + 1, 1 - slot)

        pipe.wait(j, slot)
        first = (first_page + j * bp) * P
        # Only pages below `used` were fetched: a block of early query tokens of a long
        # prefill stops at its own causal end, so later slots in the buffer are stale
        # (NaN in interpret mode) and must not reach p @ v even with p = 0.
        limit = jnp.minimum(kv_len, used * P)
        kv_ok = first + jax.lax.broadcasted_iota(jnp.int32, (C, D), 0) < limit
        tok = first + jax.lax.broadcasted_iota(jnp.int32, (R, C), 1)
        mask = (tok <= pos) & row_ok & (tok < limit)
        if sliding_window is not None:
            mask &= pos - tok < sliding_window
        out = []
        for h in range(K):
            k, v = pipe.head(slot, h, k_scale, v_scale, kv_dtype)  # [C, D] each
            k = jnp.where(kv_ok, k, 0.0)
            v = jnp.where(kv_ok, v, 0.0)
            q = q_ref[0, h].astype(jnp.float32) * sm_scale
            s = scores(q, k, precision)
            out.append(fold_rows(s, mask, carry[h], v, soft_cap, precision))
        return tuple(out)

    @pl.when(num_blocks > 0)
    def _():
        pipe.start(0, 0)

    init = empty_folds(K, R, D) if sinks_ref is None else sink_folds(sinks_ref, K, D)
    heads = jax.lax.fori_loop(0, num_blocks, body, init)
    for h, carry in enumerate(heads):
        o_ref[0, h] = finish(carry).astype(o_ref.dtype)


def ragged_paged_attention(
    q: jax.Array,  # [T, H, D]
    kv_pages: jax.Array,  # [N, P, 2K, D]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, M]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: jax.Array | float | None = None,  # f32[N, P, K] or a float
    v_scale: jax.Array | float | None = None,
    sinks: jax.Array | None = None,  # f32[H]
    tokens_per_block: int | None = None,
    pages_per_block: int | None = None,
    table_chunk: int | None = None,
    interpret: bool = False,
) -> jax.Array:  # [T, H, D]
    """Ragged paged attention (see the module docstring); arguments as
    ``paged_jax.ragged_paged_attention`` (``sinks``: each query head's sink starts its
    rows' softmax). Knobs: ``tokens_per_block`` (query rows per
    program; default 16), ``pages_per_block`` (pages per DMA buffer; default ~512 KiB of
    K/V), ``table_chunk`` (block-table entries per SMEM copy)."""
    check_table_chunk(pages_per_block, table_chunk, interpret)
    floats, arrays = split_scales(k_scale, v_scale)
    return _ragged(
        q,
        kv_pages,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        arrays,
        sinks,
        sm_scale=float(sm_scale),
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=floats[0],
        v_scale=floats[1],
        tokens_per_block=tokens_per_block,
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
        "tokens_per_block",
        "pages_per_block",
        "table_chunk",
        "interpret",
    ),
)
def _ragged(
    q,
    kv_pages,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    scale_arrays,
    sinks,
    *,
    sm_scale,
    sliding_window,
    soft_cap,
    k_scale,
    v_scale,
    tokens_per_block,
    pages_per_block,
    table_chunk,
    interpret,
):
    T, H, D = q.shape
    N, P, combined, _ = kv_pages.shape
    M = page_indices.shape[1]
    out_dtype = q.dtype
    kv_pages, kv_dtype = as_kernel_pool(kv_pages)
    if q.dtype == jnp.float16:  # v5e has no 16-bit float vectors: f16 rows go in as f32
        q = q.astype(jnp.float32)
    bq = tokens_per_block or 16
    bp = pages_per_block or default_pages_per_block(P, combined, D, kv_pages.dtype.itemsize)
    ch = table_chunk or default_table_chunk(bp)
    check_layout(combined, D, kv_pages.dtype)
    seq, start, valid = work_list(cu_q_lens, num_seqs, T, bq)
    W = seq.shape[0]
    rows = start[:, None] + jnp.arange(bq)[None, :]  # [W, bq] token of each row
    q_blocks = jnp.take(q, jnp.minimum(rows, T - 1).reshape(-1), axis=0).reshape(W, bq, H, D)
    K, G = combined // 2, H // (combined // 2)
    # head-major for the kernel: [W, K, bq G, D], kv head h's query rows in token order
    q_blocks = q_blocks.reshape(W, bq, K, G, D).transpose(0, 2, 1, 3, 4).reshape(W, K, bq * G, D)
    width = pl.cdiv(M + bp, ch) * ch
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
        tokens_per_block=bq,
        precision=jax.lax.Precision.HIGHEST if out_dtype == jnp.float32 else None,
        k_scale=k_scale,
        v_scale=v_scale,
        quantized=quantized,
        kv_dtype=kv_dtype,
        interpret=interpret,
        has_sinks=sinks is not None,
    )
    sink_rows = rows_of_sinks(sinks, K, G, bq)  # [K, bq G, 1]
    sink_spec = [] if sinks is None else [pl.BlockSpec((K, bq * G, 1), lambda w, *_: (0, 0, 0))]
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    out_blocks = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(W,),
            in_specs=[
                pl.BlockSpec((1, K, bq * G, D), lambda w, *_: (w, 0, 0, 0)),
                *sink_spec,
                hbm,
                hbm,
            ]
            + ([hbm, hbm] if quantized else []),
            out_specs=pl.BlockSpec((1, K, bq * G, D), lambda w, *_: (w, 0, 0, 0)),
            scratch_shapes=scratch_shapes(bp, P, combined, D, kv_pages.dtype, ch, quantized),
        ),
        out_shape=jax.ShapeDtypeStruct((W, K, bq * G, D), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="paged_ragged_tpu",
    )(
        seq,
        start,
        valid,
        kv_lens,
        cu_q_lens,
        q_blocks,
        *([] if sinks is None else [sink_rows]),
        table,
        kv_pages,
        *(scale_arrays or ()),
    )
    # Scatter the live rows back; rows of other sequences or past the end are dropped.
    row_end = cu_q_lens[seq + 1][:, None]
    keep = (rows < row_end) & (valid[:, None] > 0)
    target = jnp.where(keep, rows, T).reshape(-1)
    out = jnp.zeros((T, H, D), out_dtype)
    out_blocks = out_blocks.reshape(W, K, bq, G, D).transpose(0, 2, 1, 3, 4)
    out = out.at[target].set(out_blocks.reshape(-1, H, D).astype(out_dtype), mode="drop")
    return out
