"""Quantized weights of the model layer: the formats and the arithmetic of turning float
weights into them (``LlamaForCausalLM.quantize``; ``paged_jax.models.load(...,
quantization=)``).

``int8`` (weights; the activations as the backend computes: see below): a linear weight
``w [(L,) in, out]`` (an embedding table ``[V, E]``: its ``E`` plays ``in``) is held as
``q = round(w / scale)``, int8 in ``[-127, 127]``, with f32 scales of one of two shapes:

- where the weights will be computed on the CPU (``int8_group``), one scale per output
  channel and group of ``INT8_GROUP`` (32) inputs, ``scale [(L,) in / 32, out]`` (a
  table's ``[V, E / 32]``): the group's largest magnitude over 127, as GGUF's Q8_0
  blocks (a Q8_0 tensor loads as exactly these);
- on a GPU or TPU, and where 32 does not divide the inputs, one scale per output channel,
  ``scale [(L,) out]`` (a table's ``[V]``): XLA's products then scale each output once,
  after the dot.

XLA's products compute ``x @ (q * scale)`` with activations in the model's dtype
(W8A16; per channel: ``(x @ q) * scale``); the CPU's C kernel quantizes each row of
``x`` to int8 in blocks of 32 inputs, a scale each, and sums them by integer dot
products (W8A8, as llama.cpp's Q8_0 x Q8_0: ``paged_jax.kernels.cpu.reference_quantized``
defines it). Each dequantized weight is within half a scale of the float one. The
weights take a quarter of f32's bytes, plus an f32 per group (1.125 bytes a weight) or
per channel. Groups halve the weights' error where a channel's largest weight sets
every other's step (SmolLM2-135M, next-token KL divergence from f32 over an 812-token
text: 0.016 per channel, 0.0075 in groups, with float rows; with the C kernel's rows
quantized too, 0.026 and 0.021), for about 7% more time in the kernel's products. A GGUF
file's other 8-bit blocks kept as they are (``load_gguf``) are int8 groups too: Q6_K's
of 16, and Q5_1 / Q5_K blocks with a minimum per group (``zero``, the same shape: the
weights ``scale * q + zero``, q in [0, 31]).

Where the groups are for the CPU, the weights are also **rotated** first (``rotated``
on the module; ``paged_jax.linear.rotate``): ``w`` becomes ``R w``, ``R`` the orthonormal
Hadamard matrix of order 32 applied to each block of 32 inputs, and the C kernel
rotates each row of ``x`` the same way before quantizing it (``R`` is symmetric and its
own inverse: ``(x R)(R w) = x w``). The rotation spreads a block's outlier, in the
weights and in the rows, over its 32 entries, so the block's scale stops rounding its
other entries to nothing: SmolLM2's next-token KL from f32 halved, for about 1% more
time in the products (the rows' 80 additions and 32 multiplies per 32 inputs,
vectorized; docs/DECISIONS.md, "Rotated int8 groups"). Only weights quantized from
float are rotated: a GGUF file's blocks kept as they are (and a weight some of whose
layers keep them) are not, nor is the embedding table (rotating a tied head changed
nothing measurable).

``int4`` (weight-only, 4-bit groups as GGUF's Q4_1): along the input axis (``in`` of a
linear weight, ``E`` of an embedding table), each group of ``GROUP`` (32) weights of one
output channel gets a scale ``d = (max - min) / 15`` and its minimum ``m``; a weight is
held as ``q = round((w - m) / d)`` in ``[0, 15]``, two of them a byte (the even index of
the axis in the low nibble), and stands for ``d * q + m``, within half a scale of the
float one. An eighth of f32's bytes, plus two f32 per group (a quarter more): 0.75 bytes
a weight. The CPU's C kernel multiplies the groups by rows quantized to int8 in the same
groups (as llama.cpp's Q4 x Q8); XLA dequantizes them before its product.

``fp8`` (W8A16, weight-only): as ``int8`` with float8 e4m3 values instead of integers
(``ml_dtypes.float8_e4m3fn``, JAX's ``jnp.float8_e4m3fn``): one f32 scale per output
channel, its largest magnitude over 448 (e4m3's largest finite value), and the weight
held as ``w / scale`` rounded to e4m3 (3 mantissa bits: within 1/16 of itself, relative,
above e4m3's smallest normal 2**-6; below it, within half a step of 2**-9, times the
scale). A byte a weight, as int8; the format public FP8 checkpoints (compressed-tensors'
``float-quantized``) hold, with a per-channel or per-tensor scale. Every product widens
the weight to the activations' dtype (``(x @ q) * scale``), except on GPUs with fp8
units, where ``hold_for_accelerator`` holds it for fp8 by fp8 products (W8A8,
``Linear.hold_fp8_activations``).
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

FORMATS = ("int8", "int4", "fp8")
FP8 = ml_dtypes.float8_e4m3fn  # the fp8 format's values (numpy; jnp.float8_e4m3fn alike)
FP8_MAX = 448.0  # e4m3's largest finite magnitude
GROUP = 32  # weights of one channel sharing a 4-bit scale and minimum
INT8_GROUP = 32  # inputs of one channel sharing an int8 scale, for the CPU


def check_format(quantization) -> str | None:
    """``quantization`` if it names a format (or is None); ValueError naming the
    formats otherwise."""
    if quantization is None or quantization in FORMATS:
        return quantization
    raise ValueError(
        f"quantization: expected one of {', '.join(map(repr, FORMATS))} or None, got "
        f"{quantization!r}"
    )


def _on_accelerator(w) -> bool:
    """Whether ``w`` is a JAX array on a device other than the CPU (a GPU or TPU): its
    quantization then runs there, jitted, instead of in numpy on the host."""
    import jax

    if isinstance(w, jax.core.Tracer):  # traced (eval_shape, jit): no device of its own
        return False
    return isinstance(w, jax.Array) and any(d.platform != "cpu" for d in w.devices())


def _target_platform() -> str:
    """Where computations go (``paged_jax.attention._default_platform``: the platform of
    ``jax.default_device`` where one is set, else JAX's default backend), what decides
    the layout of a traced weight."""
    from paged_jax.attention import _default_platform

    return _default_platform()


def _way(fn):
    """``fn(w, axis, ..., xp)`` as a quantizer of float ``w``: in numpy on the host (no
    XLA program per weight shape) for numpy and CPU arrays, and for an array on an
    accelerator in ``jax.numpy``, jitted on its device (a 16 GB model's weights are
    not copied to the host and back). The two agree but for the last bit of a scale
    (a compiler may divide by a reciprocal), so at most a value on a rounding boundary
    lands one step over."""

    @functools.wraps(fn)
    def quantize(w, axis: int, *args):
        import jax

        if isinstance(w, jax.core.Tracer):  # (a model built from shapes: nnx.eval_shape)
            import jax.numpy as jnp

            return fn(w, axis, *args, xp=jnp)
        if _on_accelerator(w):
            import jax
            import jax.numpy as jnp

            key = (fn, len(args))
            jitted = _JITTED.get(key)
            if jitted is None:  # every argument but the weight is static
                jitted = _JITTED[key] = jax.jit(
                    functools.partial(fn, xp=jnp), static_argnums=tuple(range(1, 2 + len(args)))
                )
            return jitted(w, axis, *args)
        return fn(w, axis, *args, xp=np)

    return quantize


_JITTED: dict = {}


def int8_group(w, axis: int) -> int | None:
    """The ``group`` the loaders and ``quantize`` give ``quantize_int8`` for float ``w``:
    ``INT8_GROUP`` where the weights will be computed on the CPU (a JAX array on the CPU,
    or a numpy or traced array while computations go to the CPU: ``jax.default_device``,
    else JAX's default backend) and it divides ``w.shape[axis]``; None (a scale per
    channel) for a GPU or TPU, whose XLA products scale each output once after the dot,
    or an axis 32 does not divide."""
    if w.shape[axis] % INT8_GROUP:
        return None
    import jax

    if isinstance(w, jax.Array) and not isinstance(w, jax.core.Tracer):
        return None if _on_accelerator(w) else INT8_GROUP
    return INT8_GROUP if _target_platform() == "cpu" else None


@_way
def quantize_int8(w, axis: int, group: int | None = None, *, xp=np) -> tuple[np.ndarray, ...]:
    """``(q int8, scale f32)`` of float ``w``, ``q = round(w / scale)`` in ``[-127,
    127]``, sharing each scale along ``axis`` (``in`` of a ``[in, out]`` kernel, ``E`` of
    a ``[V, E]`` table): ``group`` None, one scale per slice along every other axis,
    ``scale = max |w| / 127`` over ``axis`` (``w``'s shape without ``axis``); ``group``
    G, one per G consecutive entries of ``axis`` (which G must divide), ``w``'s shape with
    ``axis`` divided by G. A scale of 0 becomes 1. In numpy on the host, or on the device
    of an accelerator's array (``jax.Array`` results)."""
    w = xp.asarray(w, xp.float32)
    if group is None:
        scale = xp.max(xp.abs(w), axis=axis) / 127.0
        scale = xp.where(scale > 0, scale, 1.0).astype(xp.float32)
        q = xp.clip(xp.rint(w / xp.expand_dims(scale, axis)), -127, 127).astype(xp.int8)
        return q, scale
    w = xp.moveaxis(w, axis, -1)
    n = w.shape[-1]
    if n % group:
        raise ValueError(f"w: expected an axis {axis} of a multiple of {group}, got {n}")
    g = w.reshape(*w.shape[:-1], n // group, group)
    scale = xp.max(xp.abs(g), axis=-1) / 127.0
    scale = xp.where(scale > 0, scale, 1.0).astype(xp.float32)
    q = xp.clip(xp.rint(g / scale[..., None]), -127, 127).astype(xp.int8).reshape(w.shape)
    return xp.moveaxis(q, -1, axis), xp.moveaxis(scale, -1, axis)


@_way
def quantize_fp8(w, axis: int, *, xp=np) -> tuple[np.ndarray, np.ndarray]:
    """``(q float8_e4m3fn, scale f32)`` of float ``w``, one scale per slice along every
    axis but ``axis`` (as ``quantize_int8``): ``scale = max |w| / 448`` over ``axis`` (1
    where that is 0), ``q = w / scale`` rounded to the nearest e4m3 value. In numpy on
    the host, or on the device of an accelerator's array."""
    w = xp.asarray(w, xp.float32)
    scale = xp.max(xp.abs(w), axis=axis) / FP8_MAX
    scale = xp.where(scale > 0, scale, 1.0).astype(xp.float32)
    q = xp.clip(w / xp.expand_dims(scale, axis), -FP8_MAX, FP8_MAX).astype(FP8)
    return q, scale


@_way
def quantize_int4(w, axis: int, group: int = GROUP, *, xp=np) -> tuple[np.ndarray, ...]:
    """``(packed uint8, scale f32, zero f32)`` of float ``w`` in 4-bit groups of ``group``
    along ``axis`` (whose length must be a multiple of ``group``, an even number):
    ``packed`` has ``w``'s shape with ``axis`` halved (entry i of the axis holds indices
    2i, low nibble, and 2i + 1); ``scale`` and ``zero`` (each group's minimum) have it
    divided by ``group``. In numpy on the host, or on the device of an accelerator's
    array."""
    w = xp.moveaxis(xp.asarray(w, xp.float32), axis, -1)
    n = w.shape[-1]
    if group % 2 or n % group:
        raise ValueError(
            f"w: expected an axis {axis} of a multiple of {group} for 4-bit groups, got {n}"
        )
    g = w.reshape(*w.shape[:-1], n // group, group)
    lo, hi = g.min(-1), g.max(-1)
    scale = ((hi - lo) / 15.0).astype(xp.float32)
    safe = xp.where(scale > 0, scale, 1.0)
    q = xp.clip(xp.rint((g - lo[..., None]) / safe[..., None]), 0, 15).astype(xp.uint8)
    q = q.reshape(*w.shape)
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    return (
        xp.moveaxis(packed, -1, axis),
        xp.moveaxis(scale, -1, axis),
        xp.moveaxis(lo.astype(xp.float32), -1, axis),
    )


def dequantize_int4(packed, scale, zero, axis: int, dtype=None, high=None, offset: int = 0):
    """The float weights ``quantize_int4`` held as ``packed``, ``scale``, ``zero`` (the
    group size is the axis' length over ``scale``'s), in jnp (traceable; ``dtype``
    default f32). A GGUF file's blocks kept (``gguf_blocks.Nibbles``) may add ``high``
    (uint8, ``[.., in bits / 8, ..]`` along ``axis``: 1 or 2 bits above each value) and
    come without ``zero``: the weights ``scale * (q - offset)``; their scales may be
    float16."""
    import jax.numpy as jnp

    dtype = jnp.float32 if dtype is None else dtype
    p = jnp.moveaxis(packed, axis, -1)
    q = jnp.stack([p & 15, p >> 4], axis=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])
    if high is not None:
        h = jnp.moveaxis(high, axis, -1)
        bits = h.shape[-1] * 8 // q.shape[-1]
        shifts = (jnp.arange(8 // bits, dtype=jnp.uint8) * bits).reshape((1,) * h.ndim + (-1,))
        h = ((h[..., None] >> shifts) & ((1 << bits) - 1)).reshape(q.shape)
        q = q | (h << 4)
    d = jnp.moveaxis(scale, axis, -1).astype(dtype)
    group = q.shape[-1] // d.shape[-1]
    q = q.reshape(*q.shape[:-1], d.shape[-1], group).astype(dtype)
    if zero is None:
        w = (q - offset) * d[..., None] if offset else q * d[..., None]
    else:
        w = q * d[..., None] + jnp.moveaxis(zero, axis, -1).astype(dtype)[..., None]
    return jnp.moveaxis(w.reshape(*p.shape[:-1], 2 * p.shape[-1]), -1, axis)
