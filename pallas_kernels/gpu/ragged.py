"""Ragged paged attention for NVIDIA GPUs (Pallas, Triton lowering): prefill chunks and
decode tokens of many sequences in one launch.

The wrapper turns ``cu_q_lens`` into a work list of (sequence, first query token) blocks of
``tokens_per_block`` tokens (a static upper bound of ``cdiv(T, bq) + S`` entries; spare
entries do nothing). Grid ``(work, K)``: a program stacks its tokens' G query heads into
one ``[bq * G, D]`` matrix, walks the sequence's pages through the block table up to the
causal end of its last token (from the first page inside the sliding window), with an
online softmax in f32, and stores only its own rows (masked stores into a zero-initialized
output, so padding rows stay 0).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .._table import safe_lens, safe_table
from .._worklist import work_list
from . import tuning
from ._block import empty_carry, fold_pages, group_sinks, sink_carry, walk
from ._scales import prepare_scales


def _kernel(
    work_seq_ref,
    work_start_ref,
    work_valid_ref,
    lens_ref,
    cu_ref,
    table_ref,
    q_ref,
    k_ref,
    v_ref,
    ks_ref,
    vs_ref,
    v_mul_ref,
    sinks_ref,
    o_in_ref,
    o_ref,
    *,
    sm_scale,
    soft_cap,
    sliding_window,
    tokens_per_block,
    pages_per_block,
    page_size,
    group,
    precision,
    compute_dtype,
    prefetch=False,
):
    del o_in_ref  # aliased with o_ref: the zero-initialized output
    w, h = pl.program_id(0), pl.program_id(1)
    seq, q_start, live = work_seq_ref[w], work_start_ref[w], work_valid_ref[w]
    bq, bp, P, G = tokens_per_block, pages_per_block, page_size, group
    block_tokens = bp * P
    head_dim = q_ref.shape[-1]
    kv_len = lens_ref[seq]
    q_first, q_end = cu_ref[seq], cu_ref[seq + 1]
    tok_row = q_start + jnp.arange(bq)
    row_ok = (tok_row < q_end) & (live > 0)
    pos = kv_len - (q_end - q_first) + (tok_row - q_first)  # absolute position per token
    # Row r of the stacked [bq * G, D] queries is token r // G (iota arithmetic, not repeat).
    tok_of_row = q_start + jnp.arange(bq * G) // G
    pos_rows = kv_len - (q_end - q_first) + (tok_of_row - q_first)
    ok_rows = (tok_of_row < q_end) & (live > 0)
    q = q_ref[pl.ds(q_start, bq), pl.ds(h * G, G), :].reshape(bq * G, head_dim)
    q = (q.astype(jnp.float32) * sm_scale).astype(compute_dtype)
    last_pos = jnp.max(jnp.where(row_ok, pos, -1))
    used_pages = pl.cdiv(kv_len, P)
    end_page = jnp.minimum(pl.cdiv(last_pos + 1, P), used_pages)
    start_page = 0
    if sliding_window is not None:
        first_pos = jnp.min(jnp.where(row_ok, pos, kv_len))
        start_page = (jnp.maximum(first_pos - sliding_window + 1, 0) // P) // bp * bp
    num_blocks = jnp.maximum(pl.cdiv(end_page - start_page, bp), 0)

    def fold(first_page, raw, carry):
        tok = first_page * P + jnp.arange(block_tokens)
        in_seq = tok < kv_len
        mask = (tok[None, :] <= pos_rows[:, None]) & ok_rows[:, None] & in_seq[None, :]
        if sliding_window is not None:
            mask &= pos_rows[:, None] - tok[None, :] < sliding_window
        return fold_pages(
            q,
            raw,
            in_seq,
            mask,
            carry,
            compute_dtype=compute_dtype,
            precision=precision,
            soft_cap=soft_cap,
        )

    if sinks_ref is None:
        init = empty_carry(bq * G, head_dim)
    else:  # this KV head's query heads' sinks, for each of the block's tokens
        sink_rows = jax.lax.broadcast_in_dim(sinks_ref[...], (bq, G), (1,)).reshape(bq * G)
        init = sink_carry(sink_rows, head_dim)
    refs = (k_ref, v_ref, ks_ref, vs_ref)
    acc, _, l = walk(
        refs,
        table_ref,
        seq,
        start_page,
        num_blocks,
        bp,
        used_pages,
        fold,
        init,
        prefetch=prefetch,
    )
    out = acc / jnp.where(l > 0, l, 1.0)[:, None]
    if v_mul_ref is not None:
        out = out * v_mul_ref[0]
    out = out.reshape(bq, G, head_dim)
    plgpu.store(
        o_ref.at[pl.ds(q_start, bq), pl.ds(h * G, G), :],
        out.astype(o_ref.dtype),
        mask=row_ok[:, None, None],
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "soft_cap",
        "sliding_window",
        "tokens_per_block",
        "pages_per_block",
        "batch_invariant",
        "interpret",
        "num_warps",
        "num_stages",
        "prefetch",
    ),
)
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
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
    sinks: jax.Array | None = None,  # f32[H]
    tokens_per_block: int | None = None,
    pages_per_block: int | None = None,
    batch_invariant: bool = False,
    interpret: bool = False,
    num_warps: int = 4,
    num_stages: int | None = None,
    prefetch: bool = False,
) -> jax.Array:  # [T, H, D]
    """Ragged paged attention; arguments as ``paged_jax.ragged_paged_attention``.
    Tuning knobs (defaults in ``tuning.py``; block sizes are powers of two):
    ``tokens_per_block`` (16 KiB of stacked queries, 64 rows of bf16 at D = 128; at least 1
    token), ``pages_per_block`` (16 KiB of K per block), ``num_warps``, ``num_stages``
    (None: 1 with ``prefetch``, else 2), ``prefetch`` (each step of a program's walk loads
    the next block's K/V and the table entries of the one after before it computes: the
    same sums; not yet timed on a GPU, so off).
    ``batch_invariant``: ``pages_per_block`` is not capped by the table width (the only
    size taken from the batch; work items are per sequence). Dot operands and
    accumulation as in ``decode_paged_attention``; ``sinks`` start each program's
    softmax."""
    tuning.check_pow2("tokens_per_block", tokens_per_block)
    tuning.check_pow2("pages_per_block", pages_per_block)
    num_stages = (1 if prefetch else 2) if num_stages is None else num_stages
    (T, H, D), (N, P, combined, _) = q.shape, kv_pages.shape
    K, G0 = combined // 2, H // (combined // 2)
    compute, out_dtype = tuning.compute_dtype(q.dtype), q.dtype
    q, k_sc, v_sc, v_mul = prepare_scales(q, k_scale, v_scale)
    G = pl.next_power_of_2(G0)  # Triton block dims are powers of two: pad the group
    if G != G0:
        q = jnp.pad(q.reshape(T, K, G0, D), ((0, 0), (0, 0), (0, G - G0), (0, 0)))
        q = q.reshape(T, K * G, D)
    M = page_indices.shape[1]
    bq = tokens_per_block or tuning.ragged_tokens_per_block(G, D, compute)
    # batch_invariant: a block size not taken from the table width M (set by the batch).
    bp = pages_per_block or tuning.pages_per_block(
        D, kv_pages.dtype, P, 1 << 20 if batch_invariant else M, compute
    )
    seq, start, valid = work_list(cu_q_lens, num_seqs, T, bq)
    W = seq.shape[0]
    q_pad = jnp.pad(q, ((0, bq), (0, 0), (0, 0)))  # blocks may read past the last token
    table = safe_table(page_indices, N, M + bp)  # and past the last page column
    kv_lens = safe_lens(kv_lens, M * P)
    scales = [k_sc, v_sc]
    v_mul = None if v_mul is None else v_mul.reshape(1)
    sk = group_sinks(sinks, K, G0, G)  # [K, G]: a program's row of it
    head_scale = pl.BlockSpec((N, P, None), lambda w, h: (0, 0, h))
    scale_specs = [None if sc is None else head_scale for sc in scales]
    full = lambda shape: pl.BlockSpec(shape, lambda w, h: (0,) * len(shape))  # noqa: E731
    kernel = functools.partial(
        _kernel,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        tokens_per_block=bq,
        pages_per_block=bp,
        page_size=P,
        group=G,
        precision=tuning.dot_precision(compute, interpret),
        compute_dtype=compute,
        prefetch=bool(prefetch),
    )
    out = pl.pallas_call(
        kernel,
        grid=(W, K),
        in_specs=[
            full((W,)),
            full((W,)),
            full((W,)),
            full(kv_lens.shape),
            full(cu_q_lens.shape),
            full(table.shape),
            full(q_pad.shape),
            pl.BlockSpec((N, P, None, D), lambda w, h: (0, 0, 2 * h, 0)),
            pl.BlockSpec((N, P, None, D), lambda w, h: (0, 0, 2 * h + 1, 0)),
            scale_specs[0],
            scale_specs[1],
            None if v_mul is None else full((1,)),
            None if sk is None else pl.BlockSpec((None, G), lambda w, h: (h, 0)),
            full(q_pad.shape),
        ],
        out_specs=full(q_pad.shape),
        out_shape=jax.ShapeDtypeStruct(q_pad.shape, out_dtype),
        # None inputs (absent scales) are not operands: count the arrays before the output.
        input_output_aliases={9 + sum(x is not None for x in (*scales, v_mul, sk)): 0},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="paged_ragged_attention",
    )(
        seq,
        start,
        valid,
        kv_lens,
        cu_q_lens,
        table,
        q_pad,
        kv_pages,
        kv_pages,
        scales[0],
        scales[1],
        v_mul,
        sk,
        jnp.zeros(q_pad.shape, out_dtype),
    )
    out = out[:T]
    if G != G0:
        out = out.reshape(T, K, G, D)[:, :, :G0].reshape(T, K * G0, D)
    return out
