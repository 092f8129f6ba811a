"""Rotary position embeddings: the inverse frequencies (with Llama 3's or linear scaling)
and their rotation of queries and keys, half-split convention."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ..config import LinearRopeScaling, RopeScaling


def rope_inv_freq(
    head_dim: int, theta: float, scaling: RopeScaling | LinearRopeScaling | None
) -> jax.Array:
    """``f32[D/2]`` inverse frequencies, with Llama-3 or linear scaling applied if given."""
    inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv
    if isinstance(scaling, LinearRopeScaling):
        return inv / scaling.factor
    old = scaling.original_max_position_embeddings
    low_wavelen = old / scaling.low_freq_factor
    high_wavelen = old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    scaled = jnp.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (old / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, blended, scaled)


def apply_rope(x_THD: jax.Array, positions_T: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary embedding, half-split convention (dims i and i + D/2 rotate together)."""
    freqs_TF = positions_T.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos = jnp.cos(freqs_TF)[:, None, :]
    sin = jnp.sin(freqs_TF)[:, None, :]
    x = x_THD.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_THD.dtype)
