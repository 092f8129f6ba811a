"""Pallas GPU kernels (Triton lowering). No kernel is built yet: ``paged_jax`` raises
NotImplementedError for ``backend="pallas_gpu"`` until one is."""
