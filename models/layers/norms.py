"""Norms: RMSNorm (with Gemma's unit offset), and soft-capping."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis, computed in f32. ``unit_offset``: the scale is
    ``1 + weight`` (Gemma; its weights start at 0), else ``weight`` (starting at 1)."""

    def __init__(self, dim: int, eps: float, *, dtype, param_dtype, unit_offset: bool = False):
        init = jnp.zeros if unit_offset else jnp.ones
        self.weight = nnx.Param(init((dim,), param_dtype))
        self.eps = eps
        self.dtype = dtype
        self.unit_offset = unit_offset

    def __call__(self, x_TE: jax.Array) -> jax.Array:
        x = x_TE.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        w = self.weight[...].astype(jnp.float32).reshape((1,) * (x.ndim - 1) + (-1,))
        return ((1.0 + w if self.unit_offset else w) * x).astype(self.dtype)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """``cap * tanh(x / cap)`` (Gemma 2's logit capping), or ``x`` for no cap."""
    return x if cap is None else cap * jnp.tanh(x / cap)
