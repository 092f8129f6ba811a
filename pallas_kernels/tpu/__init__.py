"""Pallas TPU kernels (Mosaic; run on CPU under TPU interpret mode).

* ``decode_paged_attention`` (``decode.py``): scalar-prefetched lengths, block tables in
  SMEM chunks, double-buffered page DMAs.

The ragged (prefill + decode) kernel and a KV-write kernel are not built yet:
``paged_jax.ragged_paged_attention(backend="pallas_tpu")`` raises NotImplementedError.
"""

from pallas_kernels.tpu.decode import decode_paged_attention

__all__ = ["decode_paged_attention"]
