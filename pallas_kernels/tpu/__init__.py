"""Pallas TPU kernels (Mosaic; run on CPU under TPU interpret mode).

* ``decode_paged_attention`` (``decode.py``) and ``ragged_paged_attention``
  (``ragged.py``): scalar-prefetched lengths, block tables copied to SMEM in chunks,
  pages fetched by double-buffered DMA.

* ``write_rows`` (``kv_write.py``): a step's new K/V (or scale) rows into the pool by slot
  mapping, in place; ``PagedKVCache.write(..., backend="pallas_tpu")`` uses it.
"""

from .decode import decode_paged_attention
from .kv_write import write_rows
from .ragged import ragged_paged_attention

__all__ = ["decode_paged_attention", "ragged_paged_attention", "write_rows"]
