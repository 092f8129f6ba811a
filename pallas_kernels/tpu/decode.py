"""Paged decode attention for TPU (Pallas, Mosaic): block tables in SMEM chunks, pages by
manual double-buffered DMA.

One query token per sequence. Grid ``(B,)`` ("parallel": sequences are independent, so
megacore chips split them across cores). A program computes every query head of its
sequence: a page is fetched as one contiguous ``[P, 2K, D]`` DMA (all kv heads), so each
K/V byte crosses HBM once, and the K/V of each head serves its whole GQA group.

* ``kv_lens`` reach the kernel by scalar prefetch. The block table stays in HBM and is
  copied into a small SMEM buffer ``table_chunk`` entries at a time, so tables of any
  length work (a whole big-batch table does not fit in SMEM).
* Pages are fetched ``pages_per_block`` at a time into two VMEM buffers: block j + 1's
  DMAs are in flight while block j is computed. Pages past the sequence's length get no
  DMA; with a sliding window the blocks wholly before the window are skipped.
* Online softmax in f32; f32 KV is computed in f32 (no cast to bf16).

Status: verified in TPU interpret mode on CPU only (no TPU was available to this work).
Per-token int8/fp8 scales are not supported here yet (per-tensor float scales are).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._softmax import fold


def default_pages_per_block(page_size: int, num_combined: int, head_dim: int, itemsize: int):
    """About 512 KiB of K/V per buffer (two buffers in VMEM), at least one page."""
    page_bytes = page_size * num_combined * head_dim * itemsize
    return max(1, min(32, (512 * 1024) // page_bytes))


def _kernel(
    lens_ref,  # scalar prefetch (SMEM): i32[B]
    q_ref,
    table_hbm,
    kv_hbm,  # inputs: q block [1, H, D] (VMEM); HBM refs
    o_ref,  # output block [1, H, D]
    table_smem,
    kv_buf,
    sems,  # scratch
    *,
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
):
    b = pl.program_id(0)
    bp, P, CH, K = pages_per_block, page_size, table_chunk, num_kv_heads
    _, H, D = q_ref.shape
    G = H // K
    kv_len = lens_ref[b]
    used = pl.cdiv(kv_len, P)
    first_key = 0
    first_page = 0
    if sliding_window is not None:
        first_key = jnp.maximum(kv_len - sliding_window, 0)
        first_page = (first_key // P) // bp * bp
    num_blocks = pl.cdiv(jnp.maximum(used - first_page, 0), bp)

    def load_table_chunk(col):
        pltpu.sync_copy(table_hbm.at[b, pl.ds((col // CH) * CH, CH)], table_smem)

    def page_copies(j, slot):
        """The DMA descriptors of block j's pages, and whether each page is live."""
        out = []
        for i in range(bp):
            col = first_page + j * bp + i
            live = col < used
            page = jnp.where(live, table_smem[col % CH], 0)
            out.append(
                (live, pltpu.make_async_copy(kv_hbm.at[page], kv_buf.at[slot, i], sems.at[slot]))
            )
        return out

    def start(j, slot):
        # Block j's table entries all lie in one chunk (CH is a multiple of bp).
        @pl.when((first_page + j * bp) % CH == 0)
        def _():
            load_table_chunk(first_page + j * bp)

        for live, copy in page_copies(j, slot):
            pl.when(live)(copy.start)

    def wait(j, slot):
        for live, copy in page_copies(j, slot):
            pl.when(live)(copy.wait)

    q = q_ref[0].astype(jnp.float32).reshape(K, G, D) * sm_scale

    def body(j, carry):
        acc, m, l = carry  # f32[K, G, D], f32[K, G], f32[K, G]
        slot = j % 2

        @pl.when(j + 1 < num_blocks)
        def _():
            start(j + 1, 1 - slot)

        wait(j, slot)
        kv = kv_buf[slot].reshape(bp * P, 2 * K, D).astype(jnp.float32)
        k = kv[:, 0::2, :]  # [C, K, D]
        v = kv[:, 1::2, :]
        if k_scale is not None:
            k = k * k_scale
        if v_scale is not None:
            v = v * v_scale
        tok = (first_page + j * bp) * P + jnp.arange(bp * P)
        valid = (tok < kv_len) & (tok >= first_key)
        k = jnp.where(valid[:, None, None], k, 0.0)
        v = jnp.where(valid[:, None, None], v, 0.0)  # skipped pages hold stale data
        s = jnp.einsum("kgd,ckd->kgc", q, k, precision=precision)
        return fold(
            s,
            valid[None, None, :],
            (acc, m, l),
            lambda p: jnp.einsum("kgc,ckd->kgd", p, v, precision=precision),
            soft_cap,
        )

    @pl.when(num_blocks > 0)
    def _():
        load_table_chunk(first_page)
        start(0, 0)

    init = (
        jnp.zeros((K, G, D), jnp.float32),
        jnp.full((K, G), -jnp.inf, jnp.float32),
        jnp.zeros((K, G), jnp.float32),
    )
    acc, _, l = jax.lax.fori_loop(0, num_blocks, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    o_ref[0] = out.reshape(H, D).astype(o_ref.dtype)


def decode_paged_attention(
    q: jax.Array,  # [B, H, D]
    kv_pages: jax.Array,  # [N, P, 2K, D]
    kv_lens: jax.Array,  # i32[B]
    page_indices: jax.Array,  # i32[B, M]
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    pages_per_block: int | None = None,
    table_chunk: int | None = None,
    interpret: bool = False,
) -> jax.Array:  # [B, H, D]
    """Decode attention (see the module docstring); arguments as
    ``paged_jax.paged_attention``. ``k_scale`` / ``v_scale``: per-tensor floats only.
    Knobs: ``pages_per_block`` (pages per DMA buffer; default ~512 KiB of K/V) and
    ``table_chunk`` (block-table entries per SMEM copy; default 16 blocks' worth)."""
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        if sc is not None and not isinstance(sc, (int, float)):
            raise NotImplementedError(
                f"{name}: the TPU decode kernel takes per-tensor float scales only; "
                "per-token scale arrays are not supported yet (use backend='xla')"
            )
    if table_chunk is not None and pages_per_block is not None and table_chunk % pages_per_block:
        raise ValueError(
            f"table_chunk: expected a multiple of pages_per_block="
            f"{pages_per_block}, got {table_chunk}"
        )
    return _decode(
        q,
        kv_pages,
        kv_lens,
        page_indices,
        sm_scale=float(sm_scale),
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=None if k_scale is None else float(k_scale),
        v_scale=None if v_scale is None else float(v_scale),
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
    bp = pages_per_block or default_pages_per_block(P, combined, D, kv_pages.dtype.itemsize)
    ch = table_chunk or bp * 16
    if ch % bp:
        raise ValueError(f"table_chunk: expected a multiple of pages_per_block={bp}, got {ch}")
    width = pl.cdiv(M + bp, ch) * ch  # room for a block that starts near the end
    table = jnp.pad(page_indices, ((0, 0), (0, width - M)))
    kernel = functools.partial(
        _kernel,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        pages_per_block=bp,
        table_chunk=ch,
        page_size=P,
        num_kv_heads=combined // 2,
        precision=jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B,),
            in_specs=[
                pl.BlockSpec((1, H, D), lambda b, lens: (b, 0, 0)),
                pl.BlockSpec(memory_space=pl.ANY),  # block table stays in HBM
                pl.BlockSpec(memory_space=pl.ANY),  # so does the pool
            ],
            out_specs=pl.BlockSpec((1, H, D), lambda b, lens: (b, 0, 0)),
            scratch_shapes=[
                pltpu.SMEM((ch,), jnp.int32),
                pltpu.VMEM((2, bp, P, combined, D), kv_pages.dtype),
                pltpu.SemaphoreType.DMA((2,)),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="paged_decode_tpu",
    )(kv_lens, q, table, kv_pages)
