"""Per-token KV quantization for int8 and fp8 caches.

Scheme: one f32 scale per (token, combined head), i.e. per row of D values, chosen so
the row's largest magnitude maps to the format's largest finite value. Dequantized
value = stored value (as f32) * scale. Per-token scales cost 4 bytes per D values
(3% of an int8 row at D = 128) and keep outliers in one token from crushing the
precision of every other token in the page.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

QUANT_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
FLOAT_KV_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def is_quantized_dtype(dtype) -> bool:
    return jnp.dtype(dtype) in QUANT_DTYPES


def max_representable(dtype) -> float:
    dtype = jnp.dtype(dtype)
    if dtype == jnp.int8:
        return 127.0
    return float(jnp.finfo(dtype).max)


def quantize_rows(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Quantizes ``x: f[..., D]`` row-wise; returns ``(q: dtype[..., D], scale: f32[...])``."""
    dtype = jnp.dtype(dtype)
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1)
    # An all-zero row gets scale 1 so dequantization stays exact (0 * 1).
    scale = jnp.where(amax > 0, amax / max_representable(dtype), 1.0)
    y = x32 / scale[..., None]
    if dtype == jnp.int8:
        y = jnp.clip(jnp.round(y), -127, 127)
    return y.astype(dtype), scale


def dequantize_rows(q: jax.Array, scale: jax.Array | float | None, out_dtype) -> jax.Array:
    """``q: [..., D]`` times ``scale: f32[...]`` (or a scalar) -> ``out_dtype[..., D]``."""
    if scale is None:
        return q.astype(out_dtype)
    scale = jnp.asarray(scale, jnp.float32)
    if scale.ndim:
        scale = scale[..., None]
    return (q.astype(jnp.float32) * scale).astype(out_dtype)


def numpy_dequantize(q: np.ndarray, scale) -> np.ndarray:
    """Host-side dequantization to f64 (used by tests and oracles)."""
    q64 = np.asarray(q.astype(np.float32), np.float64)
    if scale is None:
        return q64
    s = np.asarray(scale, np.float64)
    return q64 * (s[..., None] if s.ndim else s)
