"""Paged flash-decoding for Hopper GPUs (Pallas, Mosaic GPU lowering): TMA page loads and
wgmma, beside the Triton kernel in ``decode.py`` with the same signature.

One query token per sequence. Grid ``(B, K, splits)``, one warpgroup per program: it takes
the G query heads of one kv head, padded to the 64 rows of a wgmma, and one split of the
sequence's pages. Each K/V block is ``pages_per_block`` pages, every page a TMA copy from
the pool's own layout ``[N, P, 2K, D]`` (combined head 2h is K, 2h + 1 is V) into one slot
of a ring of ``num_stages`` shared-memory buffers; the copies for block j + num_stages are
issued as soon as block j's are consumed, so the loads of later blocks overlap the dots of
this one. Scores and ``p @ V`` run on the tensor cores (16-bit operands, f32
accumulation) and the online softmax in f32 (``_softmax.fold``). Value rows past the
sequence's length are zeroed in shared memory before ``p @ V`` (an unwritten slot may hold
NaN, and a zero weight does not cancel it). The splits' partial results are merged as in
``decode.py``.

Hopper only (sm_90: TMA and wgmma), 16-bit pools and queries, ``head_dim`` a multiple of
64, ``pages_per_block * page_size`` of 64 or 128 tokens. Runs on CPU under Mosaic GPU's
interpret mode (``interpret=True``), which simulates the shared memory, barriers and
asynchronous copies; ``lower_for_cuda`` checks the lowering without a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .._softmax import fold
from .._table import safe_lens, safe_table
from ._scales import prepare_scales
from .decode import default_num_splits, merge_splits

ROWS = 64  # a wgmma takes 64 rows per warpgroup: the GQA group is padded to it
TILE_COLS = 64  # 128-byte swizzled tiles: 64 columns of a 16-bit dtype
BLOCK_TOKENS = (64, 128)
SMEM_BYTES = 227 * 1024  # the most shared memory one block may have on Hopper
MAX_STAGES = 3


def smem_bytes(head_dim: int, block_tokens: int, num_stages: int, itemsize: int = 2) -> int:
    """Shared memory of one program: queries, the K/V ring, the 16-bit probabilities, the
    f32 output and its (m, l) rows (barriers are a few bytes more)."""
    ring = 2 * num_stages * block_tokens * head_dim * itemsize
    return (
        ROWS * head_dim * itemsize
        + ring
        + ROWS * block_tokens * itemsize
        + (ROWS * head_dim * 4 + 2 * ROWS * 4)
    )


def default_num_stages(head_dim: int, block_tokens: int) -> int:
    """The most K/V blocks in flight (up to ``MAX_STAGES``) whose buffers fit."""
    for stages in range(MAX_STAGES, 1, -1):
        if smem_bytes(head_dim, block_tokens, stages) <= SMEM_BYTES - 1024:
            return stages
    return 1


def _interpret_params():
    """Mosaic GPU's interpret mode: public from JAX 0.11, private in 0.10."""
    try:
        from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams
    except ImportError:  # JAX 0.10
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams(detect_races=False)


def _kernel(
    lens_ref,
    table_ref,
    q_ref,
    kv_ref,  # inputs in GMEM
    acc_ref,
    m_ref,
    l_ref,  # outputs in GMEM
    q_smem,
    k_smem,
    v_smem,
    p_smem,
    o_smem,
    ml_smem,
    q_bar,
    k_bar,
    v_bar,
    *,
    soft_cap,
    sliding_window,
    pages_per_block,
    pages_per_split,
    page_size,
    num_stages,
    interpret,
):
    if interpret:  # layouts are the compiler's business: the interpreter has no rules for them
        iota = functools.partial(lax.broadcasted_iota, jnp.int32)
        laid_out = lambda x, layout: x  # noqa: E731
    else:
        iota = functools.partial(plgpu.broadcasted_iota, jnp.int32, layout=plgpu.Layout.WGMMA)
        laid_out = plgpu.layout_cast
    b, h, s = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")
    P, bp, NS = page_size, pages_per_block, num_stages
    block_tokens = bp * P
    rows, head_dim = q_smem.shape
    kv_len = lens_ref[b]
    used_pages = (kv_len + P - 1) // P
    start = s * pages_per_split
    stop = jnp.minimum(start + pages_per_split, used_pages)
    first_key = jnp.int32(0)
    if sliding_window is not None:
        first_key = jnp.maximum(kv_len - sliding_window, 0)
        start = jnp.maximum(start, (first_key // P) // bp * bp)
    num_blocks = jnp.maximum((stop - start + bp - 1) // bp, 0)

    plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, q_bar.at[0])

    def issue(j, slot):
        """TMA copies of block j's pages into ``slot``: one arrival per page on its barrier."""
        for i in range(bp):
            col = start + j * bp + i
            page = jnp.where(col < used_pages, table_ref[b, col], 0)  # never follow garbage
            dst = pl.ds(i * P, P)
            plgpu.copy_gmem_to_smem(kv_ref.at[page, :, 2 * h], k_smem.at[slot, dst], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(
                kv_ref.at[page, :, 2 * h + 1], v_smem.at[slot, dst], v_bar.at[slot]
            )

    for i in range(NS):
        pl.when(i < num_blocks)(functools.partial(issue, i, i))
    plgpu.barrier_wait(q_bar.at[0])

    def body(j, carry):
        slot = lax.rem(j, NS)
        first_tok = (start + j * bp) * P
        plgpu.barrier_wait(k_bar.at[slot])

        def scores(acc):
            plgpu.wgmma(acc, q_smem, k_smem.at[slot].transpose((1, 0)))
            return acc[...]

        qk = pl.run_scoped(scores, plgpu.ACC((rows, block_tokens), jnp.float32))
        tok = first_tok + iota((rows, block_tokens), 1)
        valid = (tok < kv_len) & (tok >= first_key)
        plgpu.barrier_wait(v_bar.at[slot])

        @pl.when(first_tok + block_tokens > kv_len)
        def _zero_unwritten():  # the block runs past the sequence: its tail may be NaN
            v = v_smem.at[slot][...]
            row_tok = first_tok + iota((block_tokens, head_dim), 0)
            v_smem.at[slot][...] = jnp.where(row_tok < kv_len, v, jnp.zeros_like(v))
            plgpu.commit_smem()

        def pv(p):
            p_smem[...] = p.astype(p_smem.dtype)  # the A operand from shared memory, as
            plgpu.commit_smem()  # the interpreter takes it (its wgmma reads no registers)

            def dot(acc):
                plgpu.wgmma(acc, p_smem, v_smem.at[slot])
                return acc[...]

            return pl.run_scoped(dot, plgpu.ACC((rows, head_dim), jnp.float32))

        carry = fold(qk, valid, carry, pv, soft_cap)

        @pl.when(j + NS < num_blocks)
        def _refill():  # the slot's dots are done: load block j + NS into it
            issue(j + NS, slot)

        return carry

    row = plgpu.Layout.WGMMA.reduce(1)
    init = (
        laid_out(jnp.zeros((rows, head_dim), jnp.float32), plgpu.Layout.WGMMA),
        laid_out(jnp.full((rows,), -jnp.inf, jnp.float32), row),
        laid_out(jnp.zeros((rows,), jnp.float32), row),
    )
    acc, m, l = lax.fori_loop(0, num_blocks, body, init)
    o_smem[...] = acc
    ml_smem[0] = m
    ml_smem[1] = l
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, acc_ref.at[b, h, s])
    plgpu.copy_smem_to_gmem(ml_smem.at[0], m_ref.at[b, h, s])
    plgpu.copy_smem_to_gmem(ml_smem.at[1], l_ref.at[b, h, s])
    plgpu.wait_smem_to_gmem(0)


def check_supported(q_dtype, kv_dtype, head_dim: int, page_size: int, block_tokens: int):
    """Raises ``ValueError`` for what this kernel does not take (see the module docstring)."""
    for name, dt in (("q", q_dtype), ("kv_pages", kv_dtype)):
        if jnp.dtype(dt) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
            raise ValueError(f"{name}: the Mosaic GPU kernel takes bf16 or f16, got {dt}")
    if jnp.dtype(q_dtype) != jnp.dtype(kv_dtype):
        raise ValueError(f"q and kv_pages: one dtype expected, got {q_dtype} and {kv_dtype}")
    if head_dim % TILE_COLS:
        raise ValueError(f"head_dim: expected a multiple of 64, got {head_dim}")
    if page_size % 8:
        raise ValueError(f"page_size: expected a multiple of 8, got {page_size}")
    if block_tokens not in BLOCK_TOKENS:
        raise ValueError(
            f"pages_per_block: pages_per_block * page_size must be one of {BLOCK_TOKENS}, "
            f"got {block_tokens}"
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
        "num_stages",
    ),
)
def decode_paged_attention(
    q: jax.Array,  # [B, H, D] bf16 or f16
    kv_pages: jax.Array,  # [N, P, 2K, D], q's dtype
    kv_lens: jax.Array,  # i32[B]
    page_indices: jax.Array,  # i32[B, M]
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    pages_per_block: int | None = None,
    num_splits: int | None = None,
    batch_invariant: bool = False,
    interpret: bool = False,
    num_stages: int | None = None,
) -> jax.Array:  # [B, H, D], q.dtype
    """Decode attention over a paged cache; arguments as ``paged_jax.paged_attention`` and
    ``gpu.decode_paged_attention`` (Triton), whose results it matches within the rounding
    of 16-bit dot operands. Scales: per-tensor floats only (a quantized pool needs the
    Triton kernel). Knobs: ``pages_per_block`` (64 tokens per block by default; 64 or 128
    tokens), ``num_splits`` (~2 waves of SMs, as the Triton kernel), ``num_stages`` (K/V
    blocks in flight: by default as many as fit in shared memory, at most 3).
    ``batch_invariant``: one split and the default block, so a row's reduction order never
    depends on the batch. ``interpret``: Mosaic GPU's interpret mode (CPU; the tests)."""
    B, H, D = q.shape
    N, P, combined, _ = kv_pages.shape
    K = combined // 2
    G = H // K
    M = page_indices.shape[1]
    if G > ROWS:
        raise ValueError(f"q: at most {ROWS} query heads per kv head, got {G}")
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        if sc is not None and jnp.ndim(sc) != 0:
            raise ValueError(f"{name}: the Mosaic GPU kernel takes a per-tensor float only")
    if num_stages is not None and (not isinstance(num_stages, int) or num_stages < 1):
        raise ValueError(f"num_stages: expected an int >= 1, got {num_stages!r}")
    bp = pages_per_block or max(1, BLOCK_TOKENS[0] // P)
    check_supported(q.dtype, kv_pages.dtype, D, P, bp * P)
    num_stages = num_stages or default_num_stages(D, bp * P)
    if smem_bytes(D, bp * P, num_stages) > SMEM_BYTES - 1024:
        raise ValueError(
            f"num_stages: {num_stages} stages of {bp * P} tokens at head_dim {D} need "
            f"{smem_bytes(D, bp * P, num_stages)} bytes of shared memory, over {SMEM_BYTES}"
        )
    splits = 1 if batch_invariant else (num_splits or default_num_splits(B, K, M, bp))
    per_split = pl.cdiv(pl.cdiv(M, splits), bp) * bp
    width = per_split * splits
    table = safe_table(page_indices, N, width)
    kv_lens = safe_lens(kv_lens, M * P)
    dtype = kv_pages.dtype
    q_in, _, _, v_mul = prepare_scales(q, k_scale, v_scale)
    q_in = (q_in.astype(jnp.float32) * sm_scale).astype(dtype)
    q4 = jnp.pad(q_in.reshape(B, K, G, D), ((0, 0), (0, 0), (0, ROWS - G), (0, 0)))
    block_tokens = bp * P
    swizzled = (plgpu.TilingTransform((8, TILE_COLS)), plgpu.SwizzleTransform(128))
    kernel = functools.partial(
        _kernel,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        pages_per_block=bp,
        pages_per_split=per_split,
        page_size=P,
        num_stages=num_stages,
        interpret=interpret,
    )
    f32 = jnp.float32
    acc, m, l = plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((B, K, splits, ROWS, D), f32),
            jax.ShapeDtypeStruct((B, K, splits, ROWS), f32),
            jax.ShapeDtypeStruct((B, K, splits, ROWS), f32),
        ),
        grid=(B, K, splits),
        grid_names=("b", "h", "s"),
        scratch_types=(
            plgpu.SMEM((ROWS, D), dtype, transforms=swizzled),
            plgpu.SMEM((num_stages, block_tokens, D), dtype, transforms=swizzled),
            plgpu.SMEM((num_stages, block_tokens, D), dtype, transforms=swizzled),
            plgpu.SMEM((ROWS, block_tokens), dtype, transforms=swizzled),
            plgpu.SMEM((ROWS, D), f32),
            plgpu.SMEM((2, ROWS), f32),
            plgpu.Barrier(num_barriers=1),
            plgpu.Barrier(num_arrivals=bp, num_barriers=num_stages),
            plgpu.Barrier(num_arrivals=bp, num_barriers=num_stages),
        ),
        interpret=_interpret_params() if interpret else None,
    )(kv_lens, table, q4, kv_pages)
    out = merge_splits(acc, m, l)[:, :, :G].reshape(B, H, D)
    if v_mul is not None:
        out = out * v_mul
    return out.astype(q.dtype)
