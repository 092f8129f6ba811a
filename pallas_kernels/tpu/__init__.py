"""Pallas TPU kernels (Mosaic; run on CPU under TPU interpret mode).

* ``decode_paged_attention`` (``decode.py``) and ``ragged_paged_attention``
  (``ragged.py``): scalar-prefetched lengths, block tables copied to SMEM in chunks,
  pages fetched by double-buffered DMA. ``supports(kv_pages)``: whether they take a
  pool (head dim up to 128; an 8-bit pool needs an even number of kv heads).

* ``write_rows`` (``kv_write.py``): a step's new K/V (or scale) rows into the pool by slot
  mapping, in place; ``PagedKVCache.write(..., backend="pallas_tpu")`` uses it.
"""

from ._pages import supports
from .decode import decode_paged_attention
from .kv_write import write_rows
from .ragged import ragged_paged_attention

__all__ = ["decode_paged_attention", "ragged_paged_attention", "supports", "write_rows"]
