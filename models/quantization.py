"""Quantized weights of the model layer: the formats and the arithmetic of turning float
weights into them (``LlamaForCausalLM.quantize``; ``paged_jax.models.load(...,
quantization=)``).

``int8`` (W8A16, weight-only): each output channel of a linear weight ``w [(L,) in,
out]`` (each token's row of an embedding table ``[V, E]``) gets one f32 scale, its
largest magnitude over 127; the weight is held as ``q = round(w / scale)``, int8 in
``[-127, 127]``, and every product computes ``(x @ q) * scale`` with activations in the
model's dtype. The weights take a quarter of f32's bytes (plus one f32 per channel), and
each dequantized weight is within half a scale of the float one.
"""

from __future__ import annotations

import numpy as np

FORMATS = ("int8",)


def check_format(quantization) -> str | None:
    """``quantization`` if it names a format (or is None); ValueError naming the
    formats otherwise."""
    if quantization is None or quantization in FORMATS:
        return quantization
    raise ValueError(
        f"quantization: expected one of {', '.join(map(repr, FORMATS))} or None, got "
        f"{quantization!r}"
    )


def quantize_int8(w, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """``(q int8, scale f32)`` of float ``w``, one scale per slice along every axis but
    ``axis`` (the axis the scale is shared over: ``in`` of a ``[in, out]`` kernel, ``E``
    of a ``[V, E]`` table): ``scale = max |w| / 127`` over ``axis`` (1 where that is 0),
    ``q = round(w / scale)``. ``scale`` has ``w``'s shape without ``axis``. In numpy, on
    the host (no XLA program per weight shape)."""
    w = np.asarray(w, np.float32)
    scale = np.max(np.abs(w), axis=axis) / 127.0
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / np.expand_dims(scale, axis)), -127, 127).astype(np.int8)
    return q, scale
