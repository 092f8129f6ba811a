"""KV scale handling shared by the GPU kernels' wrappers."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def prepare_scales(q: jax.Array, k_scale, v_scale):
    """Splits the scales into what the kernels read and what the wrapper applies.

    Per-token scales (``f32[N, P, K]`` arrays) are read by the kernels beside the pages.
    A per-tensor float scale (JAX's convention) never touches the pool: K's is folded into
    the queries (``q . (s k) = (s q) . k``; ``q`` then travels as f32 so it is rounded only
    once), V's multiplies the output (``sum p (s v) = s sum p v``).

    Returns ``(q, k_scale_array | None, v_scale_array | None, v_multiplier | None)``.
    """
    scalar = lambda s: s is not None and jnp.ndim(s) == 0  # noqa: E731
    if scalar(k_scale):
        q = q.astype(jnp.float32) * jnp.asarray(k_scale, jnp.float32)
    v_mul = jnp.asarray(v_scale, jnp.float32) if scalar(v_scale) else None
    array = lambda s: None if s is None or scalar(s) else jnp.asarray(s, jnp.float32)  # noqa: E731
    return q, array(k_scale), array(v_scale), v_mul
