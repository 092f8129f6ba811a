"""The page pipeline shared by the TPU kernels: block-table chunks in SMEM, pages (and
their per-token scales) fetched by double-buffered DMA into VMEM."""

from __future__ import annotations

import dataclasses

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


def scratch_shapes(
    pages_per_block, page_size, num_combined, head_dim, dtype, table_chunk, quantized: bool
):
    """SMEM table chunk, two VMEM page buffers (+ two scale buffers), DMA semaphores."""
    shapes = [
        pltpu.SMEM((table_chunk,), jnp.int32),
        pltpu.VMEM((2, pages_per_block, page_size, num_combined, head_dim), dtype),
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

    def _load_table_chunk(self, col):
        ch = self.table_chunk
        pltpu.sync_copy(self.table_hbm.at[self.row, pl.ds((col // ch) * ch, ch)], self.table_smem)

    def _copies(self, j, slot):
        out = []
        for i in range(self.pages_per_block):
            col = self.first_page + j * self.pages_per_block + i
            live = col < self.used
            page = jnp.where(live, self.table_smem[col % self.table_chunk], 0)
            copies = [
                pltpu.make_async_copy(
                    self.kv_hbm.at[page], self.kv_buf.at[slot, i], self.sems.at[0, slot]
                )
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

    def kv(self, slot, k_scale: float | None, v_scale: float | None):
        """f32 K and V of the fetched block, ``[bp * P, K, D]`` each, dequantized."""
        _, bp, P, combined, D = self.kv_buf.shape
        K = combined // 2
        # K and V interleave on the head axis: strided loads from the buffer (Mosaic has no
        # strided slices of vector values).
        k = self.kv_buf[slot, :, :, pl.ds(0, K, stride=2), :]
        v = self.kv_buf[slot, :, :, pl.ds(1, K, stride=2), :]
        k = k.reshape(bp * P, K, D).astype(jnp.float32)
        v = v.reshape(bp * P, K, D).astype(jnp.float32)
        if self.ks_buf is not None:
            k = k * self.ks_buf[slot].reshape(bp * P, combined // 2)[..., None]
            v = v * self.vs_buf[slot].reshape(bp * P, combined // 2)[..., None]
        if k_scale is not None:
            k = k * k_scale
        if v_scale is not None:
            v = v * v_scale
        return k, v
