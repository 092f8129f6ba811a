"""Rotary position embeddings: the inverse frequencies (with Llama 3's, linear or YaRN
scaling) and their rotation of queries and keys, half-split convention."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ..config import LinearRopeScaling, RopeScalings, YarnRopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScalings | None) -> jax.Array:
    """``f32[D/2]`` inverse frequencies, with Llama-3, linear or YaRN scaling applied if
    given (YaRN's attention factor: ``rope_attention_factor``)."""
    inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv
    if isinstance(scaling, LinearRopeScaling):
        return inv / scaling.factor
    if isinstance(scaling, YarnRopeScaling):
        return _yarn_inv_freq(inv, head_dim, theta, scaling)
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


def _yarn_inv_freq(inv, head_dim: int, theta: float, s: YarnRopeScaling) -> jax.Array:
    """YaRN's blend of the frequencies kept (``inv``) and slowed (``inv / factor``): the
    dimension where a frequency turns ``n`` times over the original context is
    ``D * ln(L / (2 pi n)) / (2 ln theta)``; below ``beta_fast``'s dimension they are
    kept, above ``beta_slow``'s slowed, linearly between."""

    def dim_of(turns: float) -> float:
        return (
            head_dim
            * math.log(s.original_max_position_embeddings / (turns * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # (a band of no width: a step)
    ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    return inv / s.factor * ramp + inv * (1 - ramp)


def rope_attention_factor(scaling: RopeScalings | None) -> float:
    """The factor queries' and keys' rotations are scaled by (YaRN's; 1 otherwise)."""
    return scaling.attention_factor if isinstance(scaling, YarnRopeScaling) else 1.0


def apply_rope(
    x_THD: jax.Array, positions_T: jax.Array, inv_freq: jax.Array, scale: float = 1.0
) -> jax.Array:
    """Rotary embedding, half-split convention (dims i and i + D/2 rotate together); the
    rotation's cosines and sines times ``scale`` (``rope_attention_factor``)."""
    freqs_TF = positions_T.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos = jnp.cos(freqs_TF)[:, None, :]
    sin = jnp.sin(freqs_TF)[:, None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    x = x_THD.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_THD.dtype)
