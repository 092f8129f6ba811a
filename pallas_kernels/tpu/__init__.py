"""Pallas TPU kernels (scalar-prefetched block tables, manual DMA). No kernel is built yet:
``paged_jax`` raises NotImplementedError for ``backend="pallas_tpu"`` until one is."""
