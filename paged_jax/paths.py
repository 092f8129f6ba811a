"""Where paged-jax keeps what it downloads or builds (``cache_root``): the kernels'
definition (``paged_jax.kernels._paths``), for the model layer and the engine, which
reach the kernels only through the core."""

from paged_jax.kernels._paths import CACHE_ENV, cache_root

__all__ = ["CACHE_ENV", "cache_root"]
