"""The page pipeline shared by the TPU kernels: block-table chunks in SMEM, pages (and
their per-token scales) fetched by double-buffered DMA into VMEM."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def default_pages_per_block(page_size: int, num_combined: int, head_dim: int, itemsize: int):
    """About 512 KiB of K/V per buffer (two buffers in VMEM), at least one page.

    Large enough that each block's DMAs amortize their issue cost and the compute of one
    block hides the fetch of the next; small enough for two buffers plus scales and the
    working set to fit VMEM on every TPU generation (>= 16 MiB).
    """
    page_bytes = page_size * num_combined * head_dim * itemsize
    return max(1, min(32, (512 * 1024) // page_bytes))


# Block-table entries a chunk copies into SMEM come in multiples of this: a TPU's DMA
# moves whole 512-byte runs of the table's row (128 int32).
TABLE_DMA_ENTRIES = 128


def default_table_chunk(pages_per_block: int) -> int:
    """Table entries per SMEM copy: about 16 blocks' worth, a multiple of both the block
    and ``TABLE_DMA_ENTRIES``."""
    unit = math.lcm(pages_per_block, TABLE_DMA_ENTRIES)
    return unit * pl.cdiv(16 * pages_per_block, unit)


def scratch_shapes(
    pages_per_block, page_size, num_combined, head_dim, dtype, table_chunk, quantized: bool
):
    """SMEM table chunk, two VMEM page buffers (+ two scale buffers), DMA semaphores."""
    shapes = [
        pltpu.SMEM((table_chunk,), jnp.int32),
        # a head dim over 128 in pieces of 128 lanes: [pieces, 2, bp, P, 2K, D / pieces]
        pltpu.VMEM(
            (
                pieces(head_dim),
                2,
                pages_per_block,
                page_size,
                num_combined,
                head_dim // pieces(head_dim),
            ),
            dtype,
        ),  # fmt: skip
    ]
    if quantized:
        shapes += [pltpu.VMEM((2, pages_per_block, page_size, num_combined // 2), jnp.float32)] * 2
    shapes.append(pltpu.SemaphoreType.DMA((3, 2)))
    return shapes


def split_refs(refs, quantized: bool):
    """The kernels' shared ref layout -> ``(q_ref, o_ref, parts)``; ``parts`` completes a
    ``PagePipeline(row, first_page, used, *parts, pages_per_block, table_chunk)``.

    Layout: q, table (HBM), pool (HBM), [k scales, v scales (HBM)], output, table chunk
    (SMEM), page buffers, [scale buffers], DMA semaphores.
    """
    if quantized:
        (
            q_ref,
            table_hbm,
            kv_hbm,
            ks_hbm,
            vs_hbm,
            o_ref,
            table_smem,
            kv_buf,
            ks_buf,
            vs_buf,
            sems,
        ) = refs
    else:
        q_ref, table_hbm, kv_hbm, o_ref, table_smem, kv_buf, sems = refs
        ks_hbm = vs_hbm = ks_buf = vs_buf = None
    return (
        q_ref,
        o_ref,
        (table_hbm, kv_hbm, ks_hbm, vs_hbm, table_smem, kv_buf, ks_buf, vs_buf, sems),
    )


@dataclasses.dataclass
class PagePipeline:
    """Fetches block j (``pages_per_block`` pages from ``first_page + j * bp``) of row
    ``row`` of the block table; pages at or past ``used`` are not fetched."""

    row: jax.Array
    first_page: jax.Array
    used: jax.Array
    table_hbm: object
    kv_hbm: object
    ks_hbm: object | None
    vs_hbm: object | None
    table_smem: object
    kv_buf: object
    ks_buf: object | None
    vs_buf: object | None
    sems: object
    pages_per_block: int
    table_chunk: int
    interpret: bool = False  # TPU interpret mode has no reshaped refs: _unpack reads values

    def _load_table_chunk(self, col):
        ch = self.table_chunk
        pltpu.sync_copy(self.table_hbm.at[self.row, pl.ds((col // ch) * ch, ch)], self.table_smem)

    def _copies(self, j, slot):
        out = []
        for i in range(self.pages_per_block):
            col = self.first_page + j * self.pages_per_block + i
            live = col < self.used
            page = jnp.where(live, self.table_smem[col % self.table_chunk], 0)
            n, lanes = self.kv_buf.shape[0], self.kv_buf.shape[-1]
            copies = [  # (a head dim over 128: one DMA a piece of 128 lanes)
                pltpu.make_async_copy(
                    self.kv_hbm.at[page]
                    if n == 1
                    else self.kv_hbm.at[page, :, :, pl.ds(c * lanes, lanes)],
                    self.kv_buf.at[c, slot, i],
                    self.sems.at[0, slot],
                )
                for c in range(n)
            ]
            if self.ks_hbm is not None:
                copies.append(
                    pltpu.make_async_copy(
                        self.ks_hbm.at[page], self.ks_buf.at[slot, i], self.sems.at[1, slot]
                    )
                )
                copies.append(
                    pltpu.make_async_copy(
                        self.vs_hbm.at[page], self.vs_buf.at[slot, i], self.sems.at[2, slot]
                    )
                )
            out.append((live, copies))
        return out

    def start(self, j, slot):
        # Block j's table entries lie in one chunk (the chunk is a multiple of the block).
        first = self.first_page + j * self.pages_per_block

        @pl.when((j == 0) | (first % self.table_chunk == 0))
        def _():
            self._load_table_chunk(first)

        for live, copies in self._copies(j, slot):
            for c in copies:
                pl.when(live)(c.start)

    def wait(self, j, slot):
        for live, copies in self._copies(j, slot):
            for c in copies:
                pl.when(live)(c.wait)

    def head(self, slot, h: int, k_scale: float | None, v_scale: float | None, dtype=None):
        """f32 K and V of kv head ``h`` (a Python int) in the fetched block, ``[bp * P,
        D]`` each, dequantized (``_unpack`` says how they are read). ``dtype``: what the
        pool's bits are, where not its own dtype (an f16 pool travels as bf16 bits:
        ``as_kernel_pool``)."""
        n = self.kv_buf.shape[0]

        def row(j):  # the pieces of a head dim over 128 side by side again
            parts = [_unpack(self.kv_buf.at[c, slot], j, dtype, self.interpret) for c in range(n)]
            return parts[0] if n == 1 else jnp.concatenate(parts, axis=1)

        k, v = row(2 * h), row(2 * h + 1)
        if self.ks_buf is not None:  # per-token scales [bp, P, K]: column h
            C, K = k.shape[0], self.ks_buf.shape[-1]
            if self.interpret:
                k = k * self.ks_buf[slot].reshape(C, K)[:, h : h + 1]
                v = v * self.vs_buf[slot].reshape(C, K)[:, h : h + 1]
            else:
                k = k * self.ks_buf.at[slot].reshape(C, K)[:, pl.ds(h, 1)]
                v = v * self.vs_buf.at[slot].reshape(C, K)[:, pl.ds(h, 1)]
        if k_scale is not None:
            k = k * k_scale
        if v_scale is not None:
            v = v * v_scale
        return k, v


# Lanes of a vreg: the widest buffer row Mosaic loads with a stride.
LANES = 128


def pieces(head_dim: int) -> int:
    """Buffers of at most 128 lanes a head dim is fetched into (a DMA a piece)."""
    return max(1, head_dim // LANES)


def supports(kv_pages) -> bool:
    """Whether the TPU kernels take a pool of this shape and dtype (``check_layout``)."""
    try:
        check_layout(kv_pages.shape[-2], kv_pages.shape[-1], kv_pages.dtype)
    except ValueError:
        return False
    return True


def check_layout(combined: int, head_dim: int, dtype) -> None:
    """Raises ``ValueError`` for a pool ``_unpack`` cannot have Mosaic read: a head dim
    over 128 that is not a multiple of 128 (a strided load needs a buffer at most 128
    lanes wide, so a wider head dim is fetched in 128-lane pieces), or a head axis (2K
    rows a token) that is not a whole number of 32-bit words in 1, 2, 4, 8 or a multiple
    of 8 of them (Mosaic reshapes the buffer to rows only where XLA tiles the axis whole:
    for bf16 K in 1, 2, 4, 8, 16, ...; for f32 K in 1, 2, 4, 8, ...; for 8-bit K in 2, 4,
    8, 16, 32, ...). JAX's own TPU ragged kernel has the same rule."""
    if head_dim > LANES and head_dim % LANES:
        raise ValueError(
            f"kv_pages: the TPU kernels take a head dim up to {LANES} or a multiple of it "
            f"(Mosaic's strided loads), got {head_dim}; the XLA path takes any"
        )
    pack = 4 // jnp.dtype(dtype).itemsize
    words = combined // pack
    if combined % pack or not (words in (1, 2, 4, 8) or words % 8 == 0):
        raise ValueError(
            f"kv_pages: the TPU kernels need each token's {combined} K/V rows of "
            f"{jnp.dtype(dtype).name} to fill 1, 2, 4, 8 or a multiple of 8 32-bit words "
            f"({pack} a word), got {combined / pack:g} ({combined // 2} kv heads); the "
            f"XLA path takes any"
        )


def as_kernel_pool(kv_pages):
    """``(pool, dtype)``: the pool as the kernel takes it and what its bits are. Mosaic
    takes no f16 argument, so an f16 pool goes in as the same bits typed bf16 (a
    bitcast, no copy) and ``_unpack`` decodes them."""
    if kv_pages.dtype == jnp.float16:
        return jax.lax.bitcast_convert_type(kv_pages, jnp.bfloat16), jnp.dtype(jnp.float16)
    return kv_pages, jnp.dtype(kv_pages.dtype)


def _unpack(buf, j: int, dtype=None, interpret: bool = False):
    """Row ``j`` of the head axis (``2h``: head h's K, ``2h + 1``: its V) of every token
    of ``buf`` (a VMEM ref ``[bp, P, 2K, D]``), as f32 ``[bp * P, D]``.

    The head axis is the second-minor axis of a VMEM tile, and Mosaic loads a strided
    run of rows only of 32-bit data (and of a buffer whose rows are 128 lanes or fewer).
    So the buffer is read as rows of 32-bit words: viewed as ``[bp * P * 2K, D]``, then
    bitcast to words that pack ``p = 4 / itemsize`` consecutive rows, the lower row in
    the lower bits. Row j of token c is row ``c 2K + j``: word ``(c 2K + j) // p``, slot
    ``j % p`` for every token (``check_layout``: 2K a multiple of p), a stride of ``2K /
    p`` words from token to token.

    ``interpret``: the same steps on the loaded value (reshape, ``pltpu.bitcast``, a
    strided slice), since TPU interpret mode cannot reshape a ref; the words and their
    packing are the same (``pltpu.bitcast`` packs rows as a ref's bitcast does)."""
    bp, P, combined, D = buf.shape
    C = bp * P
    dtype = jnp.dtype(dtype or buf.dtype)
    pack = 4 // dtype.itemsize
    stride = combined // pack
    m, slot = divmod(j, pack)
    if interpret:
        rows = buf[...].reshape(C * combined, D)
        words = rows if pack == 1 else pltpu.bitcast(rows, jnp.uint32)
        w = words[m : m + (C - 1) * stride + 1 : stride]
    else:
        rows = buf.reshape(C * combined, D)
        words = rows if pack == 1 else rows.bitcast(jnp.uint32)
        w = words[pl.ds(m, C, stride=stride), :]
    return w.astype(jnp.float32) if pack == 1 else _widen(w, slot, dtype)


def _widen(w, slot: int, dtype):
    """The ``dtype`` values in bits ``[slot b, (slot + 1) b)`` of the u32 words ``w`` (b
    = the dtype's width) as f32: shifts and bitcasts Mosaic has on every TPU (v5e has
    no 16-bit float vectors, so an f16 is decoded from its bits)."""
    bits = 8 * dtype.itemsize
    if dtype == jnp.bfloat16:  # a bf16 is the top half of the f32 it widens to
        top = w << 16 if slot == 0 else w & jnp.uint32(0xFFFF0000)
        return pltpu.bitcast(top, jnp.float32)
    x = (w >> (bits * slot)) if slot else w
    if dtype == jnp.float16:
        x = x & jnp.uint32(0xFFFF)
        sign = (x & jnp.uint32(0x8000)) << 16
        exp = (x >> 10) & jnp.uint32(0x1F)
        man = x & jnp.uint32(0x3FF)
        normal = pltpu.bitcast(sign | ((exp + 112) << 23) | (man << 13), jnp.float32)
        special = pltpu.bitcast(sign | jnp.uint32(0x7F800000) | (man << 13), jnp.float32)
        tiny = pltpu.bitcast(man, jnp.int32).astype(jnp.float32) * (2.0**-24)
        tiny = jnp.where(sign != 0, -tiny, tiny)
        return jnp.where(exp == 0, tiny, jnp.where(exp == 31, special, normal))
    return pltpu.bitcast(x.astype(jnp.uint8), dtype).astype(jnp.float32)


def fold_rows(s, mask, carry, v, soft_cap, precision):
    """One block of scores folded into a flash softmax's running ``(acc f32[R, D], m
    f32[R, 1], l f32[R, 1])`` (``m = -inf`` before any key), kept two-dimensional for
    Mosaic: ``s`` f32[R, C] raw scores (scaled), ``mask`` bool[R, C], ``v`` f32[C, D].
    Fully masked rows keep ``m = -inf``, ``l = 0`` and add nothing."""
    acc, m, l = carry
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(mask, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_safe)
    alpha = jnp.exp(m - m_safe)
    pv = jnp.dot(p, v, precision=precision, preferred_element_type=jnp.float32)
    return alpha * acc + pv, m_new, alpha * l + jnp.sum(p, axis=1, keepdims=True)


def empty_folds(heads: int, rows: int, head_dim: int) -> tuple:
    """A ``fold_rows`` carry per kv head before any key: ``(acc 0, m -inf, l 0)``."""
    one = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows, 1), -jnp.inf, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
    )
    return (one,) * heads


def sink_folds(sinks_ref, heads: int, head_dim: int) -> tuple:
    """``empty_folds`` with attention sinks: ``sinks_ref`` ``f32[heads, R, 1]``, each
    kv head's rows' sinks (-inf: none), start the running maximum, and the running sum
    at 1 where one is finite (the sink a key whose value is 0)."""
    folds = []
    for h in range(heads):
        m = sinks_ref[h]  # [R, 1]
        acc = jnp.zeros((m.shape[0], head_dim), jnp.float32)
        folds.append((acc, m, jnp.where(m > -jnp.inf, 1.0, 0.0).astype(jnp.float32)))
    return tuple(folds)


def rows_of_sinks(sinks, heads: int, group: int, tokens: int = 1):
    """``f32[H]`` sinks as the kernels read them: ``f32[heads, tokens * group, 1]``,
    kv head h's query heads' sinks repeated for each of ``tokens`` tokens (rows in token
    order, a token's ``group`` heads together); None stays None."""
    if sinks is None:
        return None
    s = jnp.asarray(sinks, jnp.float32).reshape(heads, 1, group)
    return jnp.broadcast_to(s, (heads, tokens, group)).reshape(heads, tokens * group, 1)


def finish(carry):
    """The attention output ``f32[R, D]`` of a finished ``fold_rows`` carry (rows that
    saw no key: 0)."""
    acc, _, l = carry
    return acc / jnp.where(l > 0, l, 1.0)


def scores(q, k, precision):
    """``q [R, D] @ k [C, D]^T``, f32[R, C]."""
    return jax.lax.dot_general(
        q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )
