"""Pallas kernels for paged attention; standalone, importing only jax.

``paged_jax.kernels.tpu`` and ``paged_jax.kernels.gpu`` expose ``ragged_paged_attention`` and
``decode_paged_attention`` once their kernels land; ``paged_jax.attention`` discovers
them by those names and falls back to the XLA backend while they are absent.
"""
