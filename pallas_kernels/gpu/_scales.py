"""KV scale handling shared by the GPU kernels' wrappers."""

from __future__ import annotations

import jax.numpy as jnp


def prepare_scales(kv_pages, k_scale, v_scale, num_kv_heads: int):
    """Returns ``(kv_pages, k_scale, v_scale)`` for a kernel taking per-token scale arrays.

    Per-token scales (``f32[N, P, K]`` arrays) pass through as f32. Per-tensor float scales
    (JAX's convention) are folded into one f32 read of the pool instead, so the kernels
    have a single scale path.
    """
    scalar = lambda s: s is not None and jnp.ndim(s) == 0  # noqa: E731
    if scalar(k_scale) or scalar(v_scale):
        ks = k_scale if scalar(k_scale) else 1.0
        vs = v_scale if scalar(v_scale) else 1.0
        sel = jnp.tile(jnp.asarray([ks, vs], jnp.float32), num_kv_heads)[None, None, :, None]
        kv_pages = kv_pages.astype(jnp.float32) * sel
        k_scale = None if scalar(k_scale) else k_scale
        v_scale = None if scalar(v_scale) else v_scale
    cast = lambda s: None if s is None else jnp.asarray(s, jnp.float32)  # noqa: E731
    return kv_pages, cast(k_scale), cast(v_scale)
