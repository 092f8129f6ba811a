"""Paged flash-decoding for NVIDIA GPUs (Pallas, Triton lowering).

One query token per sequence. Grid ``(B, K, splits)``: a program takes every query head
of one kv head (the G heads of a GQA group, padded to 16 rows for the tensor cores) and
one split of the sequence's pages, so each K/V byte is read once per group. Pages are
gathered through the block table inside the kernel, ``pages_per_block`` at a time, with
an online softmax in f32; pages past the sequence's length, or wholly before its sliding
window, are never loaded. The splits' partial results are merged with the log-sum-exp
rule outside the kernel; with one split (``B * K`` fills the SMs, or ``batch_invariant``)
each program writes its group's rows normalized into the ``[B, H, D]`` output itself,
reading them from the unpadded queries (masked loads and stores of 16 rows), so a decode
step has no pad, merge or slice around the kernel.

The pool keeps the project's layout ``[N, P, 2K, D]``; two BlockSpecs select combined
head 2h (K) and 2h + 1 (V) of the same array, so nothing is transposed or copied.
Runs under ``interpret=True`` on CPU (the tests) and lowers through Triton on GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .._table import safe_lens, safe_table
from . import tuning
from ._block import empty_carry, fold_pages, group_sinks, sink_carry, walk
from ._scales import prepare_scales

NUM_SMS_GUESS = 132  # H100 SXM; only used to choose the split count
_MIN_ROWS = 16  # tensor-core dot needs >= 16 rows


def default_num_splits(batch: int, num_kv_heads: int, pages: int, pages_per_block: int) -> int:
    """Splits so that batch * heads * splits fills ~2 waves of SMs, without empty splits."""
    blocks = max(1, pages // pages_per_block)
    want = max(1, (2 * NUM_SMS_GUESS) // max(1, batch * num_kv_heads))
    return int(min(blocks, 1 << (want.bit_length() - 1)))


def _kernel(
    lens_ref,
    table_ref,
    q_ref,
    k_ref,
    v_ref,
    ks_ref,
    vs_ref,  # inputs
    o_ref,
    m_ref,
    l_ref,  # outputs
    *,
    sm_scale,
    soft_cap,
    sliding_window,
    pages_per_block,
    pages_per_split,
    page_size,
    precision,
    compute_dtype,
    group,
    rows,
    prefetch=False,
    vm_ref=None,
    sinks_ref=None,
):
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kv_len = lens_ref[b]
    block_tokens = pages_per_block * page_size
    head_dim = q_ref.shape[-1]
    if m_ref is None:  # one split: q_ref is the sequence's [H, D]; this group's G rows
        row = jnp.arange(rows)
        here = q_ref.at[pl.ds(h * group, rows), :]
        q_rows = plgpu.load(here, mask=(row < group)[:, None], other=0.0)
    else:  # q_ref: this group's rows, padded to `rows`
        q_rows = q_ref[...]
    q = (q_rows.astype(jnp.float32) * sm_scale).astype(compute_dtype)
    used_pages = pl.cdiv(kv_len, page_size)
    start = s * pages_per_split
    stop = jnp.minimum(start + pages_per_split, used_pages)
    first_key = 0
    if sliding_window is not None:
        first_key = jnp.maximum(kv_len - sliding_window, 0)
        start = jnp.maximum(start, (first_key // page_size) // pages_per_block * pages_per_block)
    num_blocks = jnp.maximum(pl.cdiv(stop - start, pages_per_block), 0)
    fold_kw = dict(compute_dtype=compute_dtype, precision=precision, soft_cap=soft_cap)

    def fold(first_page, raw, carry):
        tok = first_page * page_size + jnp.arange(block_tokens)
        valid = (tok < kv_len) & (tok >= first_key)
        return fold_pages(q, raw, valid, valid[None, :], carry, **fold_kw)

    # (with sinks: one split only; several splits add them in merge_splits)
    init = (
        empty_carry(rows, head_dim) if sinks_ref is None else sink_carry(sinks_ref[...], head_dim)
    )
    refs = (k_ref, v_ref, ks_ref, vs_ref)
    acc, m, l = walk(
        refs,
        table_ref,
        b,
        start,
        num_blocks,
        pages_per_block,
        used_pages,
        fold,
        init,
        prefetch=prefetch,
    )
    if m_ref is None:  # one split: the normalized rows, written where they belong
        out = acc / jnp.where(l > 0, l, 1.0)[:, None]
        if vm_ref is not None:  # a per-tensor V scale
            out = out * vm_ref[0]
        here = o_ref.at[pl.ds(h * group, rows), :]
        plgpu.store(here, out.astype(o_ref.dtype), mask=(row < group)[:, None])
        return
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def _kernel_one_split(
    lens_ref, table_ref, q_ref, k_ref, v_ref, ks_ref, vs_ref, vm_ref, sinks_ref, o_ref, **kw
):
    """``_kernel`` for a grid of one split: the output ``[H, D]`` of the sequence, each
    program writing its group's rows, normalized (and times ``vm_ref``'s per-tensor V
    scale; with ``sinks_ref``'s ``f32[rows]`` sinks), in the queries' dtype, so nothing
    is merged or sliced after the kernel."""
    _kernel(lens_ref, table_ref, q_ref, k_ref, v_ref, ks_ref, vs_ref, o_ref, None, None,
            vm_ref=vm_ref, sinks_ref=sinks_ref, **kw)  # fmt: skip


def decode_paged_attention(
    q: jax.Array,  # [B, H, D]
    kv_pages: jax.Array,  # [N, P, 2K, D]
    kv_lens: jax.Array,  # i32[B]
    page_indices: jax.Array,  # i32[B, M]
    *,
    prefetch: bool | None = None,
    num_stages: int | None = None,
    **options,
) -> jax.Array:  # [B, H, D], q.dtype
    """Decode attention over a paged cache (flash-decoding). Arguments as
    ``paged_jax.paged_attention``: ``sm_scale``, ``sliding_window``, ``soft_cap``,
    ``k_scale`` / ``v_scale`` (``f32[N, P, K]`` or a float). Tuning knobs (defaults in
    ``tuning.py``): ``pages_per_block`` (a power of two; 8 KiB of K per block when B * K
    fills the SMs, 16 KiB otherwise), ``num_splits`` (from B, K and M: ~2 waves of SMs),
    ``num_warps`` (4), ``num_stages`` (None: 1 with ``prefetch``, else 2), ``prefetch``
    (None: ``tuning.DECODE_PREFETCH``, read at each call, not once per compiled shape;
    each step of a program's walk loads the next block's K/V and the table entries of the
    one after before it computes, the same sums in the same order).
    ``batch_invariant``: one split and a block size not taken from B or M, so a row's
    reduction order never depends on the batch. ``interpret``: run on CPU. ``sinks``
    (``f32[H]``): each query head's attention sink, starting the program's softmax with
    one split, added in the merge of several.
    The dots take 16-bit operands for 16-bit
    queries and f32 otherwise (three TF32 passes on a GPU, exact f32 when interpreted);
    they accumulate in f32, as does the softmax."""
    prefetch = tuning.DECODE_PREFETCH if prefetch is None else bool(prefetch)
    if num_stages is None:
        num_stages = 1 if prefetch else 2
    return _decode(
        q, kv_pages, kv_lens, page_indices, prefetch=prefetch, num_stages=num_stages, **options
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "soft_cap",
        "sliding_window",
        "pages_per_block",
        "num_splits",
        "batch_invariant",
        "interpret",
        "num_warps",
        "num_stages",
        "prefetch",
    ),
)
def _decode(
    q: jax.Array,  # [B, H, D]
    kv_pages: jax.Array,  # [N, P, 2K, D]
    kv_lens: jax.Array,  # i32[B]
    page_indices: jax.Array,  # i32[B, M]
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
    sinks: jax.Array | None = None,  # f32[H]
    pages_per_block: int | None = None,
    num_splits: int | None = None,
    batch_invariant: bool = False,
    interpret: bool = False,
    num_warps: int = 4,
    num_stages: int,
    prefetch: bool,
) -> jax.Array:  # [B, H, D], q.dtype
    """``decode_paged_attention``, jitted, its walk and stages resolved."""
    tuning.check_pow2("pages_per_block", pages_per_block)
    B, H, D = q.shape
    N, P, combined, _ = kv_pages.shape
    K = combined // 2
    G = H // K
    M = page_indices.shape[1]
    if batch_invariant:  # nothing chosen from B or M: one split, a fixed block
        bp = pages_per_block or tuning.pages_per_block(D, kv_pages.dtype, P, 1 << 20, q.dtype)
        splits = 1
    else:
        full_grid = B * K >= NUM_SMS_GUESS
        block_bytes = tuning.FULL_GRID_KV_BLOCK_BYTES if full_grid else tuning.KV_BLOCK_BYTES
        bp = pages_per_block or tuning.pages_per_block(
            D, kv_pages.dtype, P, M, q.dtype, block_bytes
        )
        splits = num_splits or default_num_splits(B, K, M, bp)
    per_split = pl.cdiv(pl.cdiv(M, splits), bp) * bp
    width = per_split * splits
    table = safe_table(page_indices, N, width)  # padding columns and bad ids: page 0
    kv_lens = safe_lens(kv_lens, M * P)
    rows = max(_MIN_ROWS, pl.next_power_of_2(G))
    compute = tuning.compute_dtype(q.dtype)
    q_in, k_sc, v_sc, v_mul = prepare_scales(q, k_scale, v_scale)
    scales = [k_sc, v_sc]
    head_scale = pl.BlockSpec((N, P, None), lambda b, h, s: (0, 0, h))
    scale_specs = [None if sc is None else head_scale for sc in scales]
    full = lambda shape: pl.BlockSpec(shape, lambda b, h, s: (0,) * len(shape))  # noqa: E731
    kernel_kw = dict(
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        pages_per_block=bp,
        pages_per_split=per_split,
        page_size=P,
        precision=tuning.dot_precision(compute, interpret),
        compute_dtype=compute,
        group=G,
        rows=rows,
        prefetch=prefetch,
    )
    in_specs = [
        full((B,)),
        full((B, width)),
        None,  # the queries: per way below
        pl.BlockSpec((N, P, None, D), lambda b, h, s: (0, 0, 2 * h, 0)),  # K of head h
        pl.BlockSpec((N, P, None, D), lambda b, h, s: (0, 0, 2 * h + 1, 0)),  # V of head h
        scale_specs[0],
        scale_specs[1],
    ]
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    if splits == 1:
        # One split (every batch-invariant call, and a batch whose B * K fills the SMs):
        # each program reads its group's rows of the sequence's queries and writes them
        # back normalized, so no padded copy of q, no f32 partials and no merge after.
        seq = pl.BlockSpec((None, H, D), lambda b, h, s: (b, 0, 0))
        in_specs[2] = seq
        vm = None if v_mul is None else jnp.reshape(v_mul, (1,))
        sk = group_sinks(sinks, K, G, rows)  # [K, rows]: a program's row of it
        sink_spec = None if sk is None else pl.BlockSpec((None, rows), lambda b, h, s: (h, 0))
        return pl.pallas_call(
            functools.partial(_kernel_one_split, **kernel_kw),
            grid=(B, K, 1),
            in_specs=[*in_specs, None if vm is None else full((1,)), sink_spec],
            out_specs=seq,
            out_shape=jax.ShapeDtypeStruct((B, H, D), q.dtype),
            interpret=interpret,
            compiler_params=params,
            name="paged_flash_decode",
        )(kv_lens, table, q_in, kv_pages, kv_pages, scales[0], scales[1], vm, sk)
    q4 = jnp.pad(q_in.reshape(B, K, G, D), ((0, 0), (0, 0), (0, rows - G), (0, 0)))
    in_specs[2] = pl.BlockSpec((None, None, rows, D), lambda b, h, s: (b, h, 0, 0))
    acc, m, l = pl.pallas_call(
        functools.partial(_kernel, **kernel_kw),
        grid=(B, K, splits),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, None, rows, D), lambda b, h, s: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, K, splits, rows, D), jnp.float32),
            jax.ShapeDtypeStruct((B, K, splits, rows), jnp.float32),
            jax.ShapeDtypeStruct((B, K, splits, rows), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=params,
        name="paged_flash_decode",
    )(kv_lens, table, q4, kv_pages, kv_pages, scales[0], scales[1])
    sk = group_sinks(sinks, K, G, rows)
    if sk is not None:  # each row's sink as one more split: m = the sink, l = 1, acc = 0
        m = jnp.concatenate([m, jnp.broadcast_to(sk[None, :, None], (B, K, 1, rows))], axis=2)
        l = jnp.concatenate([l, jnp.where(m[:, :, -1:] > -jnp.inf, 1.0, 0.0)], axis=2)
        acc = jnp.concatenate([acc, jnp.zeros((B, K, 1, rows, D), acc.dtype)], axis=2)
    out = merge_splits(acc, m, l)[:, :, :G].reshape(B, H, D)
    if v_mul is not None:
        out = out * v_mul
    return out.astype(q.dtype)


def merge_splits(acc, m, l):
    """Log-sum-exp merge over axis 2: acc f32[B, K, S, R, D], m/l f32[B, K, S, R]."""
    m_max = m.max(axis=2, keepdims=True)
    m_max = jnp.where(m_max == -jnp.inf, 0.0, m_max)
    w = jnp.exp(m - m_max)  # empty splits (m = -inf) weigh 0
    num = (w[..., None] * acc).sum(axis=2)
    den = (w * l).sum(axis=2)
    return num / jnp.where(den > 0, den, 1.0)[..., None]
