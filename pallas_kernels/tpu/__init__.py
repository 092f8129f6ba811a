"""Pallas TPU kernels (Mosaic; run on CPU under TPU interpret mode).

* ``decode_paged_attention`` (``decode.py``) and ``ragged_paged_attention``
  (``ragged.py``): scalar-prefetched lengths, block tables copied to SMEM in chunks,
  pages fetched by double-buffered DMA.

Not built yet: a KV-write kernel (K/V are written by ``PagedKVCache.write``'s in-place
XLA scatter), per-token int8/fp8 scales.
"""

from pallas_kernels.tpu.decode import decode_paged_attention
from pallas_kernels.tpu.ragged import ragged_paged_attention

__all__ = ["decode_paged_attention", "ragged_paged_attention"]
