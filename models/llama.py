"""The decoder (Llama 2/3, Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3) in Flax NNX, on the
paged KV cache.

One forward pass serves a ragged batch: T new tokens of S sequences, each a prefill chunk
or a decode token. Per layer the tokens' K/V are written into the ``PagedKVCache`` by
slot mapping, then ``paged_jax.ragged_paged_attention`` reads them back with every
earlier token of each sequence (``paged_jax.paged_attention``, the decode kernel, when the
metadata says ``decode_only``). Shape suffixes: T tokens, E hidden size, F MLP size,
H/K query/kv heads, D head dim, V vocabulary, R logits rows.
"""

from __future__ import annotations

import contextvars
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

import paged_jax as pj
from paged_jax import linear
from paged_jax._quant import quantize_rows
from paged_jax.cache import PagedKVCache
from paged_jax.invariant import rowwise
from paged_jax.metadata import AttentionMetadata

from . import lora as _lora
from .config import LayerKind, LinearRopeScaling, LlamaConfig, RopeScaling
from .quantization import (
    check_format,
    dequantize_int4,
    int8_group,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)


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


def _norm(cfg: LlamaConfig, dim: int, kw: dict) -> RMSNorm:
    return RMSNorm(dim, cfg.rms_norm_eps, unit_offset=cfg.norm_unit_offset, **kw)


def _soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    return x if cap is None else cap * jnp.tanh(x / cap)


# The traced index of the layer being computed, while a forward pass runs the layers of
# a model whose linear weights are held per layer (LlamaForCausalLM.split_layer_weights).
_LAYER: contextvars.ContextVar = contextvars.ContextVar("paged_jax_layer")
# While a forward pass runs its layers: (T, the step's real tokens as a traced i32
# scalar). Packed products on [T, in] inputs then compute those rows only, not the
# padding up to the bucket's T (whose results are 0; nothing reads them).
_ROWS: contextvars.ContextVar = contextvars.ContextVar("paged_jax_rows", default=None)


class Packed(nnx.Param):
    """A linear kernel packed for the CPU kernel (``paged_jax.linear.pack``): ``[P, in,
    NR]``, or ``[L, P, in, NR]`` for the layers' stack, which the forward pass hands whole
    to each layer's product with the layer's index (never a slice of it)."""


class Linear(nnx.Linear):
    """``nnx.Linear`` whose kernel (and bias) may be held for the CPU:

    - a tuple of per-layer arrays (``LlamaForCausalLM.split_layer_weights``): the layer
      being computed picks its own by a ``lax.switch``, so its weights are read where they
      lie instead of copied out of a stacked ``[L, ...]`` array;
    - packed for the CPU kernel (``hold_packed``), a stack of them read in place by index.
    """

    packed = False  # hold_packed sets it on the instance (a static attribute)
    # fuse_linears sets it on a fused module: its parts' output widths, in order
    parts: tuple[int, ...] | None = None
    # The projection a LoRA adapter names it by ("q_proj", ...: models.lora.TARGETS), or
    # a fused module's parts' names; None: no adapter reaches it (the LM head)
    lora_targets: tuple[str, ...] = ()
    # quantize sets it: "int8" (kernel int8, scale f32 [(L,) out], or [(L,) in / G, out]:
    # a scale per group of G inputs, as quantize gives for the CPU (G 32) and a GGUF's
    # Q8_0 / Q6_K blocks kept hold; with a GGUF's Q5_1 / Q5_K blocks a minimum too, zero
    # f32 [(L,) in / 32, out]: weights scale * q + zero), "fp8" (kernel float8_e4m3fn,
    # scale f32 [(L,) out]) or "int4" (kernel uint8 [(L,) in / 2, out], two rows a byte;
    # scale and zero f32 [(L,) in / 32, out])
    quantized = None
    # quantize sets it for int8 groups made for the CPU (and the GGUF loader where it
    # quantizes so): the kernel is R w, w rotated along its inputs in blocks of 32
    # (paged_jax.linear.rotate), and each product rotates its rows likewise
    rotated = False
    # hold_fp8_activations sets it: an fp8 kernel held [(L,) out, in], each product fp8 by
    # fp8 with the rows quantized too (W8A8)
    fp8_activations = False
    # hold_for_accelerator sets it for q/k/v, o and down (W8A8): their rows quantized by
    # one Pallas kernel where FP8_ROWS_KERNEL_PLATFORMS says (q/k/v's with its norm)
    fp8_rows_kernel = False

    def quantize(self, fmt: str = "int8") -> Linear:
        """In place: the float kernel ``[(L,) in, out]`` becomes ``fmt`` (``"int8"``:
        int8 with f32 scales ``self.scale``, ``[(L,) in / 32, out]`` for the CPU and
        ``[(L,) out]`` elsewhere, ``models.quantization.int8_group``, the groups' weights
        rotated first, ``self.rotated``; ``"int4"``: 4-bit
        groups of 32 inputs with a scale and a minimum each, ``self.scale`` and
        ``self.zero``; see ``models.quantization``); returns the module. Idempotent.
        Before ``hold_packed`` and ``split_layer_weights`` (raises ``ValueError`` after
        them)."""
        check_format(fmt)
        if self.quantized:
            return self
        kernel = self.kernel.get_value()
        if self.packed or isinstance(kernel, tuple):
            raise ValueError("kernel: quantize before packing or splitting the weights")
        if fmt == "int4":
            q, scale, zero = quantize_int4(kernel, axis=-2)
            self.zero = nnx.Param(jnp.asarray(zero))
        elif fmt == "int8":
            group = int8_group(kernel, -2)
            if group is not None:  # for the CPU: rotated, then in groups
                kernel = linear.rotate(kernel, -2)
                self.rotated = True
            q, scale = quantize_int8(kernel, -2, group)
        else:
            q, scale = quantize_fp8(kernel, axis=-2)
        self.kernel.set_value(jnp.asarray(q))
        self.scale = nnx.Param(jnp.asarray(scale))
        self.quantized = fmt
        return self

    def hold_packed(self) -> Linear:
        """In place: the f32 (bf16, int8, 4-bit) kernel ``[in, out]`` or ``[L, in, out]``
        (or a tuple of per-layer ones, stacked again) becomes a ``Packed`` ``[(L,) P, in,
        NR]``, which ``paged_jax.linear.matmul`` multiplies by; a tuple of biases is
        stacked again too.
        Returns the module. Idempotent. Raises ``ValueError`` for another dtype or where
        the CPU kernels are not available. An fp8 kernel is packed as bf16 (every e4m3
        value is one: the same weights at 2 bytes, which the kernel multiplies by rows
        rounded to bf16)."""
        if self.packed:
            return self
        self.check_packable()
        kernel = self.kernel.get_value()
        if isinstance(kernel, tuple):
            kernel = jnp.stack(kernel)
        if self.quantized == "fp8":
            kernel = kernel.astype(jnp.bfloat16)
        self.kernel = Packed(linear.pack(kernel))
        for var in (self.bias, getattr(self, "scale", None), getattr(self, "zero", None)):
            if var is not None and isinstance(var.get_value(), tuple):
                var.set_value(jnp.stack(var.get_value()))
        if self.quantized == "int4":  # the groups' panels, as the weight's
            self.scale = Packed(linear.pack(self.scale.get_value()))
            self.zero = Packed(linear.pack(self.zero.get_value()))
        elif self.quantized and _grouped(kernel, self.scale.get_value()):  # int8 groups
            self.scale = Packed(linear.pack(self.scale.get_value()))
            if _zero_of(self) is not None:  # and their minimums
                self.zero = Packed(linear.pack(self.zero.get_value()))
        elif self.quantized:  # read whole with the packed stack, by the layer's index
            self.scale = Packed(linear.pack_scales(self.scale.get_value()))
        self.packed = True
        return self

    def check_packable(self) -> None:
        """Raises ``ValueError`` where ``hold_packed`` cannot pack the kernel: not an f32
        (int8, 4-bit, fp8) ``[(L,) in, out]`` array or tuple of per-layer ones, or fp8
        held for fp8 activations (``[out, in]``, an accelerator's)."""
        if self.packed:
            return
        if self.fp8_activations:
            raise ValueError("kernel: held for fp8 activations ([out, in]), an accelerator's")
        kernel = self.kernel.get_value()
        first = _first(kernel)
        ndim = first.ndim + isinstance(kernel, tuple)
        want = {None: jnp.float32, "int8": jnp.int8, "int4": jnp.uint8, "fp8": jnp.float8_e4m3fn}[
            self.quantized
        ]
        if not self.quantized and first.dtype == jnp.bfloat16:  # bf16 panels
            want = jnp.bfloat16
        if ndim not in (2, 3) or first.dtype != want:
            shape = [len(kernel), *first.shape] if isinstance(kernel, tuple) else first.shape
            raise ValueError(
                f"kernel: expected a {jnp.dtype(want)} [(L,) in, out] array, got "
                f"{first.dtype}{list(shape)}"
            )

    def hold_fp8_activations(self) -> Linear:
        """In place: an fp8 module's products become fp8 by fp8 (W8A8): each row of the
        input is quantized to e4m3 with a scale of its own (``paged_jax._quant.
        quantize_rows``: its largest magnitude over 448), multiplied by the fp8 weight in
        f32, and the result scaled by the row's and the channel's scales. The kernel is
        held transposed, ``[(L,) out, in]``, the contracted axis last, as the fp8 GEMMs of
        Hopper and Ada read both operands (with ``[in, out]`` XLA transposed the weight on
        every call: 47 against 5.0 ms for the Llama-3-8B shape's fused products at 64 rows
        on an H200, ``benchmarks/results/products_gpu_h200_8bit.json``; held ``[out, in]``
        they took 5.0 and 5.8 ms at 64 and 256 rows against bf16's 5.5 and 7.1, and the
        widening W8A16 5.6 and 12.4). Returns the module. Idempotent. After
        ``split_layer_weights`` and ``fuse_linears``; raises ``ValueError`` for a module
        that is not fp8 or is packed for the CPU kernels."""
        if self.fp8_activations:
            return self
        if self.quantized != "fp8" or self.packed:
            raise ValueError(
                f"kernel: fp8 activations need an fp8 module not packed for the CPU "
                f"kernels, got {self.quantized or 'float'}{' (packed)' if self.packed else ''}"
            )
        kernel = self.kernel.get_value()
        if isinstance(kernel, tuple):
            self.kernel.set_value(tuple(jnp.swapaxes(k, -1, -2) for k in kernel))
        else:
            self.kernel.set_value(jnp.swapaxes(kernel, -1, -2))
        self.fp8_activations = True
        return self

    def weight(self) -> jax.Array | tuple:
        """The kernel as ``nnx.Linear`` holds it, ``[(L,) in, out]`` (a tuple of
        ``[in, out]`` for per-layer weights), whichever way it lies."""
        kernel = self.kernel.get_value()
        if self.fp8_activations:  # held [(L,) out, in]
            if isinstance(kernel, tuple):
                kernel = tuple(jnp.swapaxes(k, -1, -2) for k in kernel)
            else:
                kernel = jnp.swapaxes(kernel, -1, -2)
        if self.packed:
            kernel = linear.unpack(kernel, self.out_features)
        if not self.quantized:
            return kernel
        scale, zero = self.scale.get_value(), _zero_of(self)
        if self.quantized == "int4":
            if self.packed:
                scale = linear.unpack(scale, self.out_features)
                zero = linear.unpack(zero, self.out_features)
            if isinstance(kernel, tuple):
                return tuple(
                    dequantize_int4(k, s, z, axis=-2)
                    for k, s, z in zip(kernel, scale, zero, strict=True)
                )
            return dequantize_int4(kernel, scale, zero, axis=-2)
        if self.packed and _grouped(self.kernel.get_value(), scale):  # int8 groups
            scale = linear.unpack(scale, self.out_features)
            if zero is not None:
                zero = linear.unpack(zero, self.out_features)
        elif self.packed:
            scale = scale[..., : self.out_features]
        back = (lambda w: linear.rotate(w, -2)) if self.rotated else (lambda w: w)
        if isinstance(kernel, tuple):
            zeros = zero if zero is not None else (None,) * len(kernel)
            return tuple(
                back(_dequantize8(k, s, z)) for k, s, z in zip(kernel, scale, zeros, strict=True)
            )
        return back(_dequantize8(kernel, scale, zero))

    def __call__(self, inputs: jax.Array | None, rows=None) -> jax.Array:
        """``inputs [..., in] @ w`` (and the active adapters' delta). ``rows``: an fp8
        module's inputs quantized already (``(q [T, in] float8_e4m3fn, scale f32 [T])``,
        ``paged_jax.linear.fp8_rows``), ``inputs`` then None (no adapters active)."""
        y = self._product(inputs, rows)
        if self.lora_targets and _lora.current_mask() is not None:  # rows with adapters
            d = _lora.delta(self.lora_targets, inputs, _LAYER.get(), self.precision)
            y = y + d.astype(y.dtype)
        return y

    def _product(self, inputs: jax.Array | None, rows=None) -> jax.Array:
        kernel = self.kernel.get_value()
        bias = None if self.bias is None else self.bias.get_value()
        scale = self.scale.get_value() if self.quantized else None
        zero = _zero_of(self)

        def add_bias(y, b):
            return y if b is None else y + jnp.reshape(b, (1,) * (y.ndim - 1) + (-1,))

        def pick(w, i):
            return None if w is None else w[i]

        if self.packed:  # a stack is indexed by the layer being computed
            layer = _LAYER.get() if kernel.ndim == 4 else None
            step = _ROWS.get()
            rows = step[1] if step is not None and inputs.shape[:-1] == (step[0],) else None
            x = inputs.astype(jnp.float32)
            y = linear.matmul(
                x,
                kernel,
                self.out_features,
                layer,
                rows,
                scales=scale,
                mins=zero,
                rotated=self.rotated,
            )
            return add_bias(y.astype(self.dtype or y.dtype), bias)
        if not isinstance(kernel, tuple):
            if scale is None:
                return super().__call__(inputs)
            return _dot_layer(self, inputs, kernel, bias, scale, zero, rows)
        layer = _LAYER.get()
        if isinstance(layer, int):  # an unrolled layer loop: this layer's own arrays
            w = (kernel[layer], pick(bias, layer), pick(scale, layer), pick(zero, layer))
            return _dot_layer(self, inputs, *w, rows)

        def one(i):
            w = (kernel[i], pick(bias, i), pick(scale, i), pick(zero, i))
            return lambda operand: _dot_layer(self, operand[0], *w, operand[1])

        return jax.lax.switch(layer, [one(i) for i in range(len(kernel))], (inputs, rows))


def fp8_units(device=None) -> bool:
    """Whether ``device`` (default: JAX's first) multiplies fp8 by fp8 in hardware: an
    NVIDIA GPU of compute capability 8.9 (Ada) or more (Hopper, Blackwell)."""
    device = jax.devices()[0] if device is None else device
    if device.platform != "gpu":
        return False
    try:
        return float(getattr(device, "compute_capability", 0) or 0) >= 8.9
    except (TypeError, ValueError):
        return False


def _grouped(kernel, scale) -> bool:
    """Whether an int8 module's ``scale`` is per group of inputs (``[(L,) in / G, out]``;
    packed: ``[(L,) P, in / G, NR]``) rather than per output channel (``[(L,) out]``;
    packed: ``[(L,) P * NR]``), as the module holds both (per-layer tuples alike)."""
    k = kernel[0] if isinstance(kernel, tuple) else kernel
    s = scale[0] if isinstance(scale, tuple) else scale
    return s.ndim == k.ndim


def _zero_of(module):
    """A quantized module's minimums (``zero``: 4-bit groups, or int8 groups kept from a
    GGUF's Q5_1 / Q5_K blocks), as held, or None."""
    zero = getattr(module, "zero", None) if module.quantized else None
    return None if zero is None else zero.get_value()


def _dequantize8(q, scale, zero=None):
    """An 8-bit weight ``[..., in, out]`` times its scales, f32: one per output channel
    (``scale [..., out]``) or per channel and group of ``in / scale.shape[-2]`` inputs
    (``scale [..., in / G, out]``, and with ``zero [..., in / G, out]`` plus each group's
    minimum)."""
    q = q.astype(jnp.float32)
    if scale.ndim == q.ndim:
        g = q.shape[-2] // scale.shape[-2]
        w = q * jnp.repeat(scale, g, axis=-2)
        return w if zero is None else w + jnp.repeat(zero, g, axis=-2)
    return q * jnp.expand_dims(scale, -2)


def _dot_layer(
    module: Linear,
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None,
    scale: jax.Array | None = None,
    zero: jax.Array | None = None,
    rows=None,
):
    """``x @ kernel + bias`` as ``nnx.Linear`` computes it, for one layer's own arrays;
    an int8 ``kernel`` is widened to the compute dtype and its product times ``scale``
    (with scales per group, and ``zero``: dequantized first); a 4-bit one (with
    ``zero``) is dequantized to the compute dtype first. ``rows``: an fp8 module's rows
    quantized already (``Linear.__call__``), ``x`` then None."""
    if module.fp8_activations:  # W8A8: fp8 rows by the fp8 kernel held [out, in]
        out_dtype = module.dtype or (jnp.bfloat16 if x is None else x.dtype)
        if rows is not None:
            xq, xs = rows
        elif module.fp8_rows_kernel and (platform := _kernel_platform(FP8_ROWS_KERNEL_PLATFORMS)):
            lead = x.shape[:-1]
            xq, xs = linear.fp8_rows(x.reshape(-1, x.shape[-1]), interpret=platform != "gpu")
            xq, xs = xq.reshape(*lead, -1), xs.reshape(lead)
        else:
            xq, xs = quantize_rows(x, jnp.float8_e4m3fn)
        dims = (((xq.ndim - 1,), (1,)), ((), ()))
        y = jax.lax.dot_general(xq, kernel, dims, preferred_element_type=jnp.float32)
        y = y * xs[..., None] * jnp.reshape(scale, (1,) * (y.ndim - 1) + (-1,))
        y = y.astype(out_dtype)
        return y if bias is None else y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    four = zero is not None and module.quantized == "int4"
    if four or (scale is not None and _grouped(kernel, scale)):  # groups along the inputs
        y = _grouped_by_kernel(module, x, kernel, scale, zero, 4 if four else 8)
        if y is not None:
            return y if bias is None else y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    if scale is not None and not four and not _grouped(kernel, scale):
        y = _w8a16_by_kernel(module, x, kernel, scale)
        if y is not None:
            return y if bias is None else y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    if four:
        kernel = dequantize_int4(kernel, scale, zero, axis=-2, dtype=module.dtype or x.dtype)
        scale = None
    elif scale is not None and _grouped(kernel, scale):  # int8 groups: dequantized first
        kernel = _dequantize8(kernel, scale, zero).astype(module.dtype or x.dtype)
        scale = None
    if module.rotated:  # (x R)(R w) = x w
        x = linear.rotate(x, -1).astype(x.dtype)
    x, kernel, bias = module.promote_dtype((x, kernel, bias), dtype=module.dtype)
    y = module.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=module.precision)
    if scale is not None:
        y = y * jnp.reshape(scale.astype(y.dtype), (1,) * (y.ndim - 1) + (-1,))
    return y if bias is None else y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))


# Platforms (``paged_jax.attention._default_platform``) where a weight quantized in groups
# along its inputs (4-bit always; int8 as a GGUF file's kept blocks) is multiplied by a
# Pallas kernel that reads it as it lies (``paged_jax.kernels.gpu.matmul.matmul_int4``,
# ``matmul_int8_groups``), not dequantized first: XLA:GPU makes a bf16 copy of such a
# weight for every product of a step (a 4-bit weight: 4.5 bytes moved where bf16 moves 2;
# ``python -m benchmarks step_kernels --variants int4``). Not yet timed on a GPU. Tests
# add "cpu" to run the kernels interpreted.
GROUPED_KERNEL_PLATFORMS: tuple[str, ...] = ("gpu",)
# Platforms where an fp8-by-fp8 product's rows (W8A8: o's and down's inputs, which no
# norm's kernel quantizes) are quantized by one Pallas kernel
# (``paged_jax.kernels.gpu.rows.fp8_rows``; with SiLU times up for down's) instead of
# XLA's two or three (``python -m benchmarks step_kernels --variants fp8``). Not yet
# timed on a GPU. Tests add "cpu".
FP8_ROWS_KERNEL_PLATFORMS: tuple[str, ...] = ("gpu",)


# Platforms where an 8-bit weight with a scale per output channel multiplies 16-bit rows
# (W8A16: int8, and fp8 held weight-only) through the few-row Pallas product
# (``paged_jax.linear.few_row_matmul``: each chunk of the weight widened in registers, the
# next one loaded ahead) instead of XLA's dot on the widened weight, for up to
# ``FEW_ROWS`` rows. Off until a GPU times it: on an H200 XLA's W8A16 products took as long
# as bf16's at 64 rows (5.54 ms against 5.48 for the Llama-3-8B shape's 32 layers,
# ``products_gpu_h200_8bit.json``), half the bytes buying nothing, and compiled for sm_90
# Triton loads such a weight's chunk only in the step that multiplies it
# (``pallas_kernels/gpu/matmul.py``). ``python -m benchmarks engine --w8a16-kernel off on``
# runs the engine each way. Tests add "cpu" to run the kernel interpreted.
W8A16_KERNEL_PLATFORMS: tuple[str, ...] = ()


def _kernel_platform(platforms: tuple[str, ...]) -> str | None:
    """The platform computations go to (``models.quantization._target_platform``) where it
    is one of ``platforms`` and no mesh splits them (a Pallas call is not partitioned:
    XLA's way stays there), else None."""
    from paged_jax import sharding

    from .quantization import _target_platform

    platform = _target_platform()
    if platform not in platforms:
        return None
    if sharding.tensor_parallel_size() > 1 or sharding.data_parallel_size() > 1:
        return None
    return platform


def _grouped_by_kernel(module, x, q, scale, zero, bits: int):
    """``x @ w`` for one layer's ``w`` in groups along its inputs (``bits`` 4: ``q`` u8
    ``[in / 2, out]``; 8: int8 ``[in, out]``; ``scale`` and ``zero`` (None: none)
    ``[in / G, out]``) by the GPU's kernels (``paged_jax.linear.grouped_matmul``), in the
    module's dtype; None where the platform is not in ``GROUPED_KERNEL_PLATFORMS``, on a
    mesh, or where no block fits."""
    platform = _kernel_platform(GROUPED_KERNEL_PLATFORMS)
    if platform is None or q.ndim != 2 or scale.ndim != 2:
        return None
    k = q.shape[0] * (2 if bits == 4 else 1)
    return _rows_by_kernel(
        module,
        x,
        k,
        module.dtype or x.dtype,
        lambda x2: linear.grouped_matmul(x2, q, scale, zero, bits, interpret=platform != "gpu"),
    )


def _rows_by_kernel(module, x, k: int, dtype, product):
    """``product`` (a kernel's ``[M, k] -> [M, out]`` or None) of ``x [..., k]`` as rows,
    rotated first where the module's weight is (``(x R)(R w) = x w``), in ``dtype``;
    ``[..., out]``, or None where the kernel gave None."""
    x2 = x.reshape(math.prod(x.shape[:-1]), k)
    if module.rotated:
        x2 = linear.rotate(x2, -1).astype(x.dtype)
    y = product(x2.astype(dtype))
    return None if y is None else y.reshape(*x.shape[:-1], y.shape[-1])


def _w8a16_by_kernel(module, x, q, scale):
    """``x @ (q * scale)`` for one layer's 8-bit ``q [in, out]`` with a scale per output
    channel ``[out]`` by the GPU's few-row product (``paged_jax.linear.few_row_matmul``),
    in the module's dtype; None where the platform is not in ``W8A16_KERNEL_PLATFORMS``,
    on a mesh, for a weight of another kind or f32 rows, past its rows or where no block
    fits."""
    platform = _kernel_platform(W8A16_KERNEL_PLATFORMS)
    dtype = jnp.dtype(module.dtype or x.dtype)
    if platform is None or q.ndim != 2 or scale.ndim != 1 or q.dtype.itemsize != 1:
        return None
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return None  # f32 rows keep XLA's dot at the module's precision (Triton's: TF32)
    return _rows_by_kernel(
        module,
        x,
        q.shape[0],
        dtype,
        lambda x2: linear.few_row_matmul(x2, q, scale, interpret=platform != "gpu"),
    )


class Embed(nnx.Embed):
    """``nnx.Embed`` whose table may be held transposed, ``[E, V]`` instead of ``[V, E]``
    (``hold_transposed``), or packed for the CPU kernel as the weight ``[E, V]`` is
    (``hold_packed``: ``[P, E, NR]``). A tied LM head (``attend``) then multiplies by the
    table as it lies; lookups gather its columns."""

    transposed = False  # hold_transposed / hold_packed set them on the instance (static)
    packed = False
    # quantize sets it: "int8" or "fp8" (table int8 or float8_e4m3fn, scale f32 [V], one
    # a token; int8 for the CPU or kept from a GGUF's Q8_0 blocks: scale [V, E / 32],
    # groups along E, and from Q5_1 / Q5_K blocks zero [V, E / 32] too, their minimums)
    # or "int4" (table uint8 [V, E / 2], scale and zero f32 [V, E / 32]: groups along E)
    quantized = None

    def quantize(self, fmt: str = "int8") -> Embed:
        """In place: the float table ``[V, E]`` becomes ``fmt`` (``"int8"``: int8 with f32
        scales ``self.scale``, ``[V, E / 32]`` for the CPU and one a token, ``[V]``,
        elsewhere, ``models.quantization.int8_group``; ``"int4"``: 4-bit groups of 32
        along E with a scale and a minimum each, ``self.scale`` and ``self.zero``);
        returns the module. Idempotent. Before ``hold_transposed`` / ``hold_packed``
        (raises ``ValueError`` after them)."""
        check_format(fmt)
        if self.quantized:
            return self
        if self.transposed or self.packed:
            raise ValueError("embedding: quantize before transposing or packing the table")
        table = self.embedding.get_value()
        if fmt == "int4":
            q, scale, zero = quantize_int4(table, axis=-1)
            self.zero = nnx.Param(jnp.asarray(zero))
        elif fmt == "int8":
            q, scale = quantize_int8(table, -1, int8_group(table, -1))
        else:
            q, scale = quantize_fp8(table, axis=-1)
        self.embedding.set_value(jnp.asarray(q))
        self.scale = nnx.Param(jnp.asarray(scale))
        self.quantized = fmt
        return self

    def _groups(self) -> bool:
        """Whether an int8 table's scales are per group of E (``[V, E / G]``, a GGUF's
        Q8_0 blocks kept; packed ``[P, E / G, NR]``) rather than one per token."""
        if self.quantized != "int8":
            return False
        table, scale = self.embedding.get_value(), self.scale.get_value()
        return scale.ndim == table.ndim

    def hold_transposed(self) -> Embed:
        """In place: the table becomes ``[E, V]``; returns the module. Idempotent. A 4-bit
        table stays ``[V, E / 2]`` (a tied head dequantizes it as it multiplies)."""
        if self.quantized == "int4" or self._groups():
            return self
        if not self.transposed and not self.packed:
            self.embedding.set_value(jnp.asarray(self.embedding.get_value().T))
            self.transposed = True
        return self

    def hold_packed(self) -> Embed:
        """In place: the table becomes ``paged_jax.linear.pack`` of its ``[E, V]``
        transpose, ``[P, E, NR]`` (int8 ones with their scales as ``pack_scales`` lays
        them out, or as a weight's for scales per group of E); returns the module.
        Idempotent. Raises ``ValueError`` for a table that is not f32, bf16 or quantized,
        or where the CPU kernels are not available. An fp8 table is packed as bf16, with its
        per-token scales as int8's (the same values: every e4m3 value is a bf16 one)."""
        if not self.packed:
            raw, groups = self.embedding.get_value(), self._groups()
            if self.quantized == "fp8":
                raw = raw.astype(jnp.bfloat16)
            self.embedding.set_value(linear.pack(raw if self.transposed else raw.T))
            if self.quantized == "int4":  # groups along E: [E / 32, V] packed as a weight
                self.scale.set_value(linear.pack(self.scale.get_value().T))
                self.zero.set_value(linear.pack(self.zero.get_value().T))
            elif groups:  # int8 groups along E: [E / G, V] packed as a weight
                self.scale.set_value(linear.pack(self.scale.get_value().T))
                if _zero_of(self) is not None:
                    self.zero.set_value(linear.pack(self.zero.get_value().T))
            elif self.quantized:
                self.scale.set_value(linear.pack_scales(self.scale.get_value()))
            self.transposed, self.packed = False, True
        return self

    def table(self) -> jax.Array:
        """The table as ``nnx.Embed`` holds it, ``[V, E]``, whichever way it lies
        (dequantized: f32)."""
        table = self.embedding.get_value()
        if self.packed:
            table = linear.unpack(table, self.num_embeddings).T
        elif self.transposed:
            table = table.T
        if self.quantized == "int4":
            scale, zero = self.scale.get_value(), self.zero.get_value()
            if self.packed:
                scale = linear.unpack(scale, self.num_embeddings).T
                zero = linear.unpack(zero, self.num_embeddings).T
            return dequantize_int4(table, scale, zero, axis=-1)
        if self._groups():
            scale, zero = self.scale.get_value(), _zero_of(self)
            if self.packed:
                scale = linear.unpack(scale, self.num_embeddings).T
                if zero is not None:
                    zero = linear.unpack(zero, self.num_embeddings).T
            return _dequantize8(table.T, scale.T, None if zero is None else zero.T).T
        if self.quantized:
            scale = self.scale.get_value()[: self.num_embeddings]
            return table.astype(jnp.float32) * scale[:, None]
        return table

    def __call__(self, inputs: jax.Array) -> jax.Array:  # int[...] -> [..., E]
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise TypeError(f"inputs: expected an integer array, got {inputs.dtype}")
        if not self.transposed and not self.packed and not self.quantized:
            return super().__call__(inputs)
        table = self.embedding[...]
        if self.packed:  # token v: column v of the head's packed weight
            rows = linear.packed_columns(table, inputs)
        elif self.transposed:
            rows = jnp.moveaxis(jnp.take(table, inputs, axis=1), 0, -1)
        else:
            rows = jnp.take(table, inputs, axis=0)
        if self.quantized == "int4":  # the tokens' groups, dequantized
            scale, zero = self.scale[...], self.zero[...]
            if self.packed:
                scale = linear.packed_columns(scale, inputs)
                zero = linear.packed_columns(zero, inputs)
            else:
                scale, zero = jnp.take(scale, inputs, axis=0), jnp.take(zero, inputs, axis=0)
            rows = dequantize_int4(rows, scale, zero, axis=-1)
        elif self._groups():  # the tokens' groups of E (and their minimums)
            held = [self.scale[...]] + ([] if _zero_of(self) is None else [self.zero[...]])
            if self.packed:
                held = [linear.packed_columns(a, inputs) for a in held]
            else:
                held = [jnp.take(a, inputs, axis=0) for a in held]
            g = rows.shape[-1] // held[0].shape[-1]
            rows = rows.astype(jnp.float32) * jnp.repeat(held[0], g, -1)
            if len(held) == 2:
                rows = rows + jnp.repeat(held[1], g, -1)
        elif self.quantized:  # (a packed scale's entry v is token v's)
            rows = rows.astype(jnp.float32) * self.scale[...][inputs][..., None]
        (rows,) = self.promote_dtype((rows,), dtype=self.dtype, inexact=False)
        return rows

    def attend(self, query: jax.Array) -> jax.Array:  # [..., E] -> [..., V]
        scale = self.scale[...] if self.quantized else None
        zero = _zero_of(self)
        if self.packed:
            x = query.astype(jnp.float32)
            y = linear.matmul(x, self.embedding[...], self.num_embeddings, scales=scale, mins=zero)
            return y.astype(self.dtype or y.dtype)
        if self.quantized == "int4":
            table = dequantize_int4(self.embedding[...], scale, zero, axis=-1, dtype=self.dtype)
            query, table = self.promote_dtype((query, table), dtype=self.dtype)
            return jnp.dot(query, table.T)
        if self._groups():  # int8 groups along E, [V, E]: dequantized first
            z = None if zero is None else zero.T
            table = _dequantize8(self.embedding[...].T, scale.T, z).astype(
                self.dtype or jnp.float32
            )
            query, table = self.promote_dtype((query, table), dtype=self.dtype)
            return jnp.dot(query, table)
        if not self.transposed and not self.quantized:
            return super().attend(query)
        table = self.embedding[...]
        query, table = self.promote_dtype((query, table), dtype=self.dtype)
        y = jnp.dot(query, table) if self.transposed else jnp.dot(query, table.T)
        if scale is None:
            return y
        return y * jnp.reshape(scale.astype(y.dtype), (1,) * (y.ndim - 1) + (-1,))


# The modules fuse_projections makes, and the ones each replaces (in output order).
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fuse_linears(linears: list[Linear]) -> Linear | None:
    """One ``Linear`` computing what ``linears`` (the same input) compute, their outputs
    side by side: the kernel, bias, and a quantized format's scales and minimums
    concatenated along the output axis, one product instead of several. Weights per
    layer (``split_layer_weights``) are concatenated layer by layer; stacked ``[L, ...]``
    ones (``hold_for_cpu``, before packing) whole. On an H200, a Llama-3-8B shape's
    layers took 5.4 against 6.3 ms at 64 rows with q/k/v and gate/up fused, 7.3 against
    8.4 at 256 (``benchmarks/results/products_gpu_h200.json``); on CPU each product is a
    call of the C kernel with a fixed cost, and a quantized one quantizes its rows once
    instead of once a part. The first module becomes the fused one (returned); ``parts``
    on it names each part's width, in order. Returns None, changing nothing, where the
    modules do not fit together: some per layer and some stacked, packed, of different
    formats or dtypes, with scales or minimums of different groups (a GGUF file's Q6_K
    and Q8_0 blocks), or with a bias on some only."""
    first = linears[0]
    kernels = [m.kernel.get_value() for m in linears]
    if len({isinstance(k, tuple) for k in kernels}) != 1 or any(m.packed for m in linears):
        return None
    if (
        len({(m.quantized, m.rotated, _dtype(k)) for m, k in zip(linears, kernels, strict=True)})
        != 1
    ):
        return None
    if len({m.bias is None for m in linears}) != 1:
        return None

    if len({_zero_of(m) is None for m in linears}) != 1:  # minimums in some parts only
        return None
    del kernels
    extra = {"int8": ["scale"], "fp8": ["scale"], "int4": ["scale", "zero"]}
    names = ["kernel", "bias"] + extra.get(first.quantized, [])
    if first.quantized == "int8" and _zero_of(first) is not None:
        names.append("zero")
    for name in names[2:]:  # the same groups of inputs (or none) in every part
        shapes = {_first(getattr(m, name).get_value()).shape[:-1] for m in linears}
        if len(shapes) != 1:
            return None
    for name in names:
        if getattr(first, name, None) is None:
            continue
        if not isinstance(getattr(first, name).get_value(), tuple):  # stacked: whole
            whole = [getattr(m, name).get_value() for m in linears]
            for m in linears:
                getattr(m, name).set_value(None)
            getattr(first, name).set_value(jnp.concatenate(whole, axis=-1))
            del whole
            continue
        # Layer by layer, each part dropped once concatenated: the memory held grows by
        # one layer's weights at most, not by all of them (the modules' own references
        # are dropped first).
        parts = [list(getattr(m, name).get_value()) for m in linears]
        for m in linears:
            getattr(m, name).set_value(())
        fused = []
        for i in range(len(parts[0])):
            fused.append(jnp.concatenate([p[i] for p in parts], axis=-1))
            for p in parts:
                p[i] = None
        getattr(first, name).set_value(tuple(fused))
    first.parts = tuple(m.out_features for m in linears)
    first.out_features = sum(first.parts)
    first.lora_targets = tuple(t for m in linears for t in m.lora_targets)
    return first


def _linear(cfg_in: int, out: int, bias: bool, *, rngs, dtype, param_dtype) -> Linear:
    return Linear(
        cfg_in,
        out,
        use_bias=bias,
        dtype=dtype,
        param_dtype=param_dtype,
        precision=jax.lax.Precision.HIGHEST,
        rngs=rngs,
    )


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = _linear(cfg.hidden_size, H * D, cfg.qkv_bias, **kw)
        self.k_proj = _linear(cfg.hidden_size, K * D, cfg.qkv_bias, **kw)
        self.v_proj = _linear(cfg.hidden_size, K * D, cfg.qkv_bias, **kw)
        self.o_proj = _linear(H * D, cfg.hidden_size, cfg.o_bias, **kw)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(self, name).lora_targets = (name,)
        self.num_heads, self.num_kv_heads, self.head_dim = H, K, D
        scalar = cfg.query_pre_attn_scalar
        self.sm_scale = (D if scalar is None else scalar) ** -0.5
        self.soft_cap = cfg.attn_logit_softcap
        norm = dict(dtype=dtype, param_dtype=param_dtype)
        self.q_norm = _norm(cfg, D, norm) if cfg.qk_norm else None
        self.k_norm = _norm(cfg, D, norm) if cfg.qk_norm else None

    def fuse_projections(self) -> bool:
        """In place: q, k and v in one product (``fuse_linears``; ``qkv_proj`` replaces
        ``q_proj``, ``k_proj`` and ``v_proj``). Returns whether they were fused."""
        if hasattr(self, "qkv_proj"):
            return True
        fused = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        if fused is None:
            return False
        self.qkv_proj = fused
        del self.q_proj, self.k_proj, self.v_proj
        return True

    def project(self, x_TE, positions_T, inv_freq, rows=None):
        """Row-wise: ``(q[T, H, D], k[T, K, D], v[T, K, D])``, RoPE applied. ``rows``: the
        fused q/k/v product's fp8 rows already quantized (``Linear.__call__``), ``x_TE``
        then None."""
        T = x_TE.shape[0] if rows is None else rows[0].shape[0]
        if hasattr(self, "qkv_proj"):  # fuse_projections: one product, split
            qkv = self.qkv_proj(x_TE, rows=rows)
            HD, KD = self.qkv_proj.parts[:2]
            q_THD = qkv[:, :HD].reshape(T, self.num_heads, self.head_dim)
            k_TKD = qkv[:, HD : HD + KD].reshape(T, self.num_kv_heads, self.head_dim)
            v_TKD = qkv[:, HD + KD :].reshape(T, self.num_kv_heads, self.head_dim)
        else:
            q_THD = self.q_proj(x_TE).reshape(T, self.num_heads, self.head_dim)
            k_TKD = self.k_proj(x_TE).reshape(T, self.num_kv_heads, self.head_dim)
            v_TKD = self.v_proj(x_TE).reshape(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # Qwen3, Gemma 3: each head normalized over D, before RoPE
            q_THD, k_TKD = self.q_norm(q_THD), self.k_norm(k_TKD)
        return (
            apply_rope(q_THD, positions_T, inv_freq),
            apply_rope(k_TKD, positions_T, inv_freq),
            v_TKD,
        )

    def output(self, o_THD):
        """Row-wise: ``o_proj`` of the heads' outputs -> ``[T, E]``."""
        return self.o_proj(o_THD.reshape(o_THD.shape[0], self.num_heads * self.head_dim))

    def attend(self, q_THD, k_TKD, v_TKD, layer, cache, md, window, backend, interpret):
        """Writes the step's K/V, then attends (``window``: this layer's sliding window, a
        Python int or None): ``(o[T, H, D], cache)``."""
        return pj.paged_self_attention(
            q_THD,
            k_TKD,
            v_TKD,
            cache,
            layer,
            md,
            sm_scale=self.sm_scale,
            sliding_window=window,
            soft_cap=self.soft_cap,
            backend=backend,
            interpret=interpret,
        )


class MLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.gate_proj = _linear(cfg.hidden_size, cfg.intermediate_size, False, **kw)
        self.up_proj = _linear(cfg.hidden_size, cfg.intermediate_size, False, **kw)
        self.down_proj = _linear(cfg.intermediate_size, cfg.hidden_size, False, **kw)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(self, name).lora_targets = (name,)
        self.gelu = cfg.hidden_act == "gelu_tanh"

    def fuse_projections(self) -> bool:
        """In place: gate and up in one product (``fuse_linears``; ``gate_up_proj``
        replaces ``gate_proj`` and ``up_proj``). Returns whether they were fused."""
        if hasattr(self, "gate_up_proj"):
            return True
        fused = fuse_linears([self.gate_proj, self.up_proj])
        if fused is None:
            return False
        self.gate_up_proj = fused
        del self.gate_proj, self.up_proj
        return True

    def __call__(self, x_TE):
        if hasattr(self, "gate_up_proj"):  # fuse_projections: one product, split
            both = self.gate_up_proj(x_TE)
            F = self.gate_up_proj.parts[0]
            down = self.down_proj
            platform = _kernel_platform(FP8_ROWS_KERNEL_PLATFORMS)
            if down.fp8_rows_kernel and platform and down.dtype is not None and both.ndim == 2:
                if _lora.current_mask() is None:  # (adapters need down's float input)
                    act = "gelu_tanh" if self.gelu else "silu"  # down's fp8 rows, in one kernel
                    rows = linear.fp8_rows(both, act=act, interpret=platform != "gpu")
                    return down(None, rows=rows)
            gate, up = both[:, :F], both[:, F:]
        else:
            gate, up = self.gate_proj(x_TE), self.up_proj(x_TE)
        gate = jax.nn.gelu(gate, approximate=True) if self.gelu else jax.nn.silu(gate)
        return self.down_proj(gate * up)


class DecoderLayer(nnx.Module):
    """One block. Pre-norm (Llama): ``x + attn(norm(x))``, then ``x + mlp(norm(x))`` with
    ``post_attention_layernorm`` as the MLP's norm. With ``sandwich_norms`` (Gemma) each
    block's output is normed as well: ``x + post_attention_layernorm(attn(
    input_layernorm(x)))``, then ``x + post_feedforward_layernorm(mlp(
    pre_feedforward_layernorm(x)))``."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.input_layernorm = _norm(cfg, cfg.hidden_size, kw)
        self.self_attn = Attention(cfg, rngs=rngs, **kw)
        self.post_attention_layernorm = _norm(cfg, cfg.hidden_size, kw)
        self.mlp = MLP(cfg, rngs=rngs, **kw)
        sandwich = cfg.sandwich_norms
        self.pre_feedforward_layernorm = _norm(cfg, cfg.hidden_size, kw) if sandwich else None
        self.post_feedforward_layernorm = _norm(cfg, cfg.hidden_size, kw) if sandwich else None

    def __call__(self, x_TE, positions_T, kind: LayerKind, layer, cache, md, backend, interpret):
        """One block on the step's tokens ``x[T, E]``; ``kind`` (static) gives the layer's
        window and RoPE. Returns ``(x[T, E], cache)``."""
        attn, inv = self.self_attn, md.batch_invariant
        inv_freq = rope_inv_freq(attn.head_dim, kind.rope_theta, kind.rope_scaling)
        # LoRA adapters' rows (models.lora): their mask travels with the rows
        bank, mask = _lora._LORA.get() or (None, None)

        def project(x, pos, m):
            with _lora.rows(bank, m):
                rows = self._fp8_qkv_rows(x)
                if rows is not None:  # q/k/v's fp8 rows, normed and quantized in one kernel
                    return attn.project(None, pos, inv_freq, rows=rows)
                return attn.project(self.input_layernorm(x), pos, inv_freq)

        def after(x, o, m):
            with _lora.rows(bank, m):
                return self._after_attention(x, o)

        q, k, v = rowwise(project, x_TE, positions_T, mask, invariant=inv)
        window = kind.sliding_window
        o_THD, cache = attn.attend(q, k, v, layer, cache, md, window, backend, interpret)
        return rowwise(after, x_TE, o_THD, mask, invariant=inv), cache

    def _fp8_qkv_rows(self, x_TE):
        """q/k/v's fp8 rows (``(q, scale)``) of ``input_layernorm(x_TE)``, normed and
        quantized by one kernel (``paged_jax.linear.fp8_rows``) where W8A8's rows go to it
        (``Linear.fp8_rows_kernel``, ``FP8_ROWS_KERNEL_PLATFORMS``, no adapters active: XLA
        takes two kernels, the rows' scale being read by several); None otherwise."""
        qkv, norm = getattr(self.self_attn, "qkv_proj", None), self.input_layernorm
        if qkv is None or not qkv.fp8_rows_kernel or x_TE.ndim != 2 or norm.dtype is None:
            return None
        platform = _kernel_platform(FP8_ROWS_KERNEL_PLATFORMS)
        if platform is None or _lora.current_mask() is not None:
            return None
        return linear.fp8_rows(
            x_TE,
            norm_weight=norm.weight[...],
            eps=norm.eps,
            unit_offset=norm.unit_offset,
            dtype=norm.dtype,
            interpret=platform != "gpu",
        )

    def _after_attention(self, x_TE, o_THD):
        """Row-wise: the residual, the MLP and its residual."""
        if self.pre_feedforward_layernorm is None:
            x_TE = x_TE + self.self_attn.output(o_THD)
            return x_TE + self.mlp(self.post_attention_layernorm(x_TE))
        x_TE = x_TE + self.post_attention_layernorm(self.self_attn.output(o_THD))
        h = self.mlp(self.pre_feedforward_layernorm(x_TE))
        return x_TE + self.post_feedforward_layernorm(h)


def _make_layers(cfg: LlamaConfig, rngs: nnx.Rngs, kw: dict) -> DecoderLayer:
    """Every layer in one module, each weight with a leading ``[L]`` axis.

    Built by ``nnx.vmap`` over split keys: the constructor is traced once, not once per
    layer (30 traced constructors took 4.6 s of loading SmolLM2).
    """

    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return DecoderLayer(cfg, rngs=rngs, **kw)

    return make(rngs)


class LlamaForCausalLM(nnx.Module):
    """A decoder whose forward pass runs a ragged step on a paged cache.

    ``dtype`` is the compute dtype, ``param_dtype`` the storage dtype of the weights.
    ``layers`` is one ``DecoderLayer`` whose weights are stacked over the layers (a
    leading ``[L]`` axis; ``layer(i)`` gives layer i alone). The forward pass is a
    ``lax.scan`` over them: one compiled layer body whatever the depth, so compile time
    does not grow with the number of layers, and every layer reuses the same temporary
    buffers (30 separately scheduled layers of gathered KV cost SmolLM2 a fresh,
    page-faulted buffer each on CPU: 207 ms of KV gathers per step against 41 ms in a
    scan, measured on this project's 2-core machine). ``split_layer_weights`` keeps the
    scan but holds each linear weight per layer, for XLA:CPU (see there).
    ``hold_for_accelerator`` holds the weights per layer and unrolls the layer loop, for
    GPUs and TPUs (see there).
    """

    unrolled = False  # hold_for_accelerator sets it on the instance (a static attribute)
    lora = None  # enable_lora sets it: a models.lora.LoraBank

    def __init__(
        self, cfg: LlamaConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32
    ):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.config = cfg
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs, **kw)
        self.layers = _make_layers(cfg, rngs, kw)
        self.norm = _norm(cfg, cfg.hidden_size, kw)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else _linear(cfg.hidden_size, cfg.vocab_size, False, rngs=rngs, **kw)
        )
        self.dtype = dtype

    def enable_lora(self, slots: int, rank: int) -> LlamaForCausalLM:
        """In place: ``slots`` LoRA adapter slots of rank up to ``rank`` on every
        projection (``models.lora.LoraBank``, zeros: no adapter in any slot), which
        ``__call__``'s ``adapter_ids`` pick per token; returns the model. Idempotent for
        the same sizes; raises ValueError for other sizes or non-positive ones."""
        for name, v in (("slots", slots), ("rank", rank)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        if self.lora is not None:
            if (self.lora.slots, self.lora.rank) != (slots, rank):
                raise ValueError(
                    f"slots, rank: the model has {self.lora.slots} slots of rank "
                    f"{self.lora.rank} already, asked for {slots} of rank {rank}"
                )
            return self
        dtype = self.embed_tokens.param_dtype
        if not jnp.issubdtype(dtype, jnp.floating):  # (a quantized table's)
            dtype = self.dtype or jnp.float32
        self.lora = _lora.LoraBank(self.config, slots, rank, dtype)
        self.lora.regroup(self._lora_groups())
        if self.unrolled:  # held for an accelerator: the bank per layer, as the weights
            self.lora.pad_for_merge().split_layers()
        return self

    def _lora_groups(self) -> tuple:
        """``LoraBank.regroup``'s groups for the projections as they are now: one a
        target, but one for each fused projection (``fuse_projections``), named as it
        (``FUSED``)."""
        groups = []
        for _, node in nnx.iter_graph(self.layers):
            if isinstance(node, Linear) and node.lora_targets:
                ts = tuple(node.lora_targets)
                if len(ts) == 1:
                    name = ts[0]
                else:
                    name = next((k for k, v in FUSED.items() if tuple(v) == ts), "_".join(ts))
                if (name, ts) not in groups:
                    groups.append((name, ts))
        order = {t: i for i, t in enumerate(_lora.TARGETS)}
        return tuple(sorted(groups, key=lambda g: order[g[1][0]]))

    def load_lora(self, path, name: str | None = None) -> _lora.LoraAdapter:
        """The PEFT LoRA adapter in directory ``path`` for this model's config
        (``models.lora.load_adapter``)."""
        return _lora.load_adapter(path, self.config, name=name)

    def lora_slot_arrays(self, adapter, slot: int, arrays: dict) -> dict:
        """``arrays`` (the bank's, by variable name: ``a_<target>``, ``b_<target>``) with
        slot ``slot`` holding ``adapter`` (None: emptied), as new arrays
        (``models.lora.slot_arrays``)."""
        if self.lora is None:
            raise ValueError("slot: the model has no LoRA slots (enable_lora)")
        bank = self.lora
        return _lora.slot_arrays(
            adapter, bank.slots, bank.rank, slot, arrays, bank.groups, bank.widths
        )

    @property
    def lora_slots(self) -> int:
        """How many LoRA adapters the model holds at once (``enable_lora``; 0: none)."""
        return 0 if self.lora is None else self.lora.slots

    def layer(self, i: int) -> DecoderLayer:
        """Layer ``i`` as its own module (a copy of its slice of the stacked weights)."""
        if not isinstance(i, int) or not 0 <= i < self.config.num_layers:
            raise ValueError(f"i: expected an int in [0, {self.config.num_layers}), got {i!r}")
        graphdef, per_layer, stacked = nnx.split(self.layers, _held_per_layer, ...)
        return nnx.merge(
            graphdef,
            jax.tree.map(lambda w: w[i], per_layer, is_leaf=lambda w: isinstance(w, tuple)),
            jax.tree.map(lambda w: w[i], stacked),
        )

    def split_layer_weights(self) -> LlamaForCausalLM:
        """In place: each linear weight of the layers (``[L, in, out]`` kernels, ``[L, out]``
        biases) becomes a tuple of L separate arrays; returns the model.

        The forward pass then picks a layer's weights with a ``lax.switch`` per matrix
        product and reads them where they lie. With the stacked arrays, XLA:CPU copies
        each layer's slice out of the stack before every product, a copy of all the
        weights every step (18 of 58 ms of a SmolLM2 step at 32 sequences); the copy's
        speed also varied about 2x from one process to the next. The engine does this on
        CPU (``LLM``); other backends read a slice in place. Norm scales stay stacked, and
        packed weights (``Linear.hold_packed``) stay whole.
        Not for a model on a mesh (its shardings are given for the stacked arrays).
        """
        L = self.config.num_layers
        for _, node in nnx.iter_graph(self.layers):
            if not isinstance(node, Linear) or node.packed:  # a packed stack stays whole
                continue
            for var in (
                node.kernel,
                node.bias,
                *(getattr(node, a, None) for a in ("scale", "zero")),
            ):
                w = None if var is None else var.get_value()
                if w is not None and not isinstance(w, tuple):
                    var.set_value(tuple(w[i] for i in range(L)))
        return self

    def quantize(self, fmt: str = "int8") -> LlamaForCausalLM:
        """In place: every linear weight (the layers' projections and an untied LM head)
        and the embedding table (a tied LM head's weight) in quantized format ``fmt``
        (``models.quantization``), but for ``"int4"`` the table in int8 (a tied head is
        the product most hurt by 4 bits: SmolLM2's log-likelihood moved 3.1% with it in
        4 bits); returns the model. Norms stay float. Before the engine
        holds the weights for a device (``hold_for_cpu``, ``hold_for_accelerator``,
        ``shard``), which ``paged_jax.models.load(..., quantization=)`` ensures.
        Idempotent. Raises ``ValueError`` for an unknown format."""
        check_format(fmt)
        for _, node in nnx.iter_graph(self):
            if isinstance(node, Linear):
                node.quantize(fmt)
            elif isinstance(node, Embed):  # int4: the table (a tied head) in int8
                node.quantize("int8" if fmt == "int4" else fmt)
        return self

    def hold_for_accelerator(self, *, fp8_activations: bool | None = None) -> LlamaForCausalLM:
        """In place: the layout a GPU or TPU reads each weight once per step with; returns
        the model. The engine calls it for a model off the CPU without a mesh. Idempotent.

        ``fp8_activations``: whether fp8 weights multiply fp8 rows (W8A8,
        ``Linear.hold_fp8_activations``); default, where the device has fp8 units
        (``fp8_units``: an NVIDIA GPU of compute capability 8.9 or more). A model held
        already keeps the choice made then when called again with the default (as the
        engine calls it), so ``hold_for_accelerator(fp8_activations=False)`` before
        ``LLM`` keeps fp8 weights weight-only.

        Each layer's linear weights become arrays of their own (``split_layer_weights``)
        and the forward pass runs the layers as an unrolled Python loop, so every product
        multiplies by its layer's weight where it lies. q, k and v, and gate and up, are
        fused into one weight each (``Attention.fuse_projections``,
        ``MLP.fuse_projections``: 4 products a layer instead of 7). The scan over stacked
        ``[L, ...]`` weights copied each layer's slices into fresh buffers before multiplying, on
        every step: on an H100 (JAX 0.11.2) XLA counted 2.5x the weight bytes accessed per
        Llama-3-8B decode step, and 32 layers of an 8B MLP at 256 rows took 8.9 ms scanned
        against 3.8 ms looped over per-layer arrays (reading the weights once: 2.2 ms).
        The cost: one traced body per layer, so compile time grows with the depth.
        Norm scales stay stacked (a static slice of a few kilobytes each). A tied
        embedding table is held ``[E, V]`` (``Embed.hold_transposed``), so the LM head
        multiplies by it as it lies on every compiler (XLA:CPU copied the ``[V, E]``
        table's transpose; lookups then gather columns, a few kilobytes a token).
        Not for a model on a mesh (its shardings are given for the stacked arrays).
        Raises ``ValueError`` for a model packed for the CPU kernels (``hold_for_cpu``).
        """
        if any(isinstance(n, (Linear, Embed)) and n.packed for _, n in nnx.iter_graph(self)):
            raise ValueError(
                "model: its weights are packed for the CPU kernels (hold_for_cpu), which "
                "only a CPU computes with; load it again to run it on an accelerator"
            )
        if self.unrolled and fp8_activations is None:  # held already: as it was held
            return self
        self.split_layer_weights()
        self.layers.self_attn.fuse_projections()
        self.layers.mlp.fuse_projections()
        if self.lora is not None:  # a fused projection's adapters in one pair, per layer
            self.lora.regroup(self._lora_groups()).pad_for_merge().split_layers()
        if fp8_activations is None:
            fp8_activations = fp8_units()
        if fp8_activations:  # the layers' products (the LM head's logits stay W8A16)
            for _, node in nnx.iter_graph(self.layers):
                if isinstance(node, Linear) and node.quantized == "fp8":
                    node.hold_fp8_activations()
            attn, mlp = self.layers.self_attn, self.layers.mlp
            for node in (getattr(attn, "qkv_proj", None), attn.o_proj, mlp.down_proj):
                if node is not None:
                    node.fp8_rows_kernel = node.fp8_activations
        if self.lm_head is None:
            self.embed_tokens.hold_transposed()
        self.unrolled = True
        return self

    def hold_for_cpu(self, *, pack: bool | None = None) -> LlamaForCausalLM:
        """In place: the weight layouts the CPU computes with fastest; returns the model.
        The engine calls it for a model on CPU without a mesh (the mesh's shardings are
        given for the loaded layouts). Idempotent.

        ``pack`` (default: where the model computes in f32 with f32, int8, int4 or fp8
        weights, or in bf16 with bf16 ones or those, and ``paged_jax.linear.available()``;
        fp8 ones are packed as bf16; a bf16 model's products take f32 sums of its bf16
        rows' exact products, then round to bf16): every
        linear weight, stacked layers included, and a tied embedding table are packed
        for the C matrix-product kernel (``Linear.hold_packed``, ``Embed.hold_packed``);
        a layer's product reads its weight in the stack by index. SmolLM2-135M f32
        decode on a 2-core CPU: 35-39 against 49-51 ms a step at 32 sequences, 14-16
        against 20-22 at one. Before packing, q, k and v, and gate and up, are fused
        into one product each (``fuse_linears`` on the stacks; ``qkv_proj`` and
        ``gate_up_proj`` replace them, 4 calls of the kernel a layer instead of 7, and
        a quantized product quantizes its rows once): SmolLM2 int8 and int4 at 32
        sequences, 5-8% more tokens/s (7 alternated runs). A LoRA bank stays one pair
        a target (the kernel adds a fused projection's adapters part by part).

        Otherwise, for XLA's products:

        - ``split_layer_weights``: each layer's linear weights in arrays of their own.
        - A tied embedding table held ``[E, V]`` (``Embed.hold_transposed``), so the LM
          head multiplies by it as it lies. XLA:CPU's product with the transpose of the
          ``[V, E]`` table was 2.2-2.5x slower at 8-16 rows with its own dots (SmolLM2's
          head: 9.9 against 4.0 ms at 8 rows) and 10% slower with YNNPACK's; lookups
          gather columns instead of rows (5 ms for 2048 tokens against a prefill step of
          seconds). No weight is copied: the memory held stays the same.
        """
        self.unrolled = False  # the CPU's layouts are read in place by the scanned layers
        if self.lora is not None:  # (held for an accelerator before: stacked again)
            self.lora.join_layers()
        linears = [n for _, n in nnx.iter_graph(self) if isinstance(n, Linear)]
        if pack is None:
            # f32 compute with f32 weights; bf16 compute with bf16 ones (the kernel rounds
            # its rows to bf16: exact for bf16 rows); quantized ones with either
            compute = None if self.dtype is None else jnp.dtype(self.dtype)
            table = self.embed_tokens
            pack = (
                compute in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
                and linear.available()
                and all(
                    n.packed
                    or (n.quantized in ("int8", "int4", "fp8") and not n.fp8_activations)
                    or (not n.quantized and _dtype(n.kernel.get_value()) == compute)
                    for n in linears
                )
                and (
                    self.lm_head is not None
                    or table.packed
                    or bool(table.quantized)
                    or table.embedding.get_value().dtype == compute
                )
            )
        if pack:
            for node in linears:  # (before anything changes)
                node.check_packable()
            # q/k/v and gate/up in one product each, as on accelerators (the C kernel's
            # calls have a fixed cost, and a quantized product quantizes its rows once);
            # a LoRA bank stays one pair a target, which the kernel adds part by part
            self.layers.self_attn.fuse_projections()
            self.layers.mlp.fuse_projections()
            for _, node in nnx.iter_graph(self):
                if isinstance(node, Linear):
                    node.hold_packed()
            if self.lm_head is None:
                self.embed_tokens.hold_packed()
            return self
        self.split_layer_weights()
        if self.lm_head is None:
            self.embed_tokens.hold_transposed()
        return self

    def shard(self, mesh: jax.sharding.Mesh) -> LlamaForCausalLM:
        """Moves the weights into their tensor-parallel shards on ``mesh`` (its ``"tp"``
        axis; ``paged_jax.models.sharding``) and returns the model. The engine calls it
        for a model it is given off the mesh; ``paged_jax.models.load(name, mesh=...)``
        loads straight into the shards instead. Quantized weights (``quantize``) are
        split as their float kernels are, their scales and minimums along (the row-split
        o and down projections' scales whole on every device); they compute by XLA's
        products there (W8A16, weight-only). Raises ``ValueError`` for weights held for
        one device's kernels (``hold_for_cpu``'s packing, fp8 activations), which have
        no split layout."""
        from .sharding import shard_model

        held = sorted(
            {
                "packed for the CPU kernels" if n.packed else "held for fp8 activations"
                for _, n in nnx.iter_graph(self)
                if isinstance(n, (Linear, Embed))
                and (n.packed or getattr(n, "fp8_activations", False))
            }
        )
        if held:
            raise ValueError(
                f"model: weights {' and '.join(held)} cannot be sharded over a mesh; shard "
                "the model as loaded (or as quantized), before the engine holds it for one device"
            )
        return shard_model(self, mesh)

    def preferred_cache_dtype(self):
        """The KV pool's dtype the engine gives this model when none is asked for
        (``LLM(cache_dtype=None)``): ``jnp.bfloat16`` where its linear weights are
        quantized and packed for the CPU's C kernels (``hold_for_cpu``; the pool then
        written and read by the C kernels too, ``cache.narrow_pools_by_cpu_kernels``),
        else None (``make_cache``'s default, the compute dtype). On those weights the
        pool's rounding costs little beside theirs and the decode step reads half the
        bytes: SmolLM2 int4 at 32 sequences, 27.5 against 29.7 ms a step (8 of 8
        alternated rounds); next-token KL from f32 0.0111 against 0.0120 (int8: 0.0196
        against 0.0208; rotated since, 0.0100 on either), where a bf16 pool under f32
        weights adds 0.0002."""
        from paged_jax.cache import narrow_pools_by_cpu_kernels

        quantized = any(
            isinstance(n, Linear) and n.packed and n.quantized for _, n in nnx.iter_graph(self)
        )
        return jnp.bfloat16 if quantized and narrow_pools_by_cpu_kernels() else None

    def make_cache(
        self, num_pages: int, page_size: int, dtype=None, *, hybrid: bool = False
    ) -> PagedKVCache:
        """An empty paged cache shaped for this model (default dtype: the compute dtype).

        ``hybrid``: when some layers have a sliding window, a pool of layer groups
        (``PagedKVCache.create(layer_windows=...)``) whose sliding groups' pages a
        ``HybridBlockManager`` frees once they leave the window; otherwise ignored.
        """
        c = self.config
        windows = tuple(k.sliding_window for k in c.layer_kinds)
        return PagedKVCache.create(
            c.num_layers,
            num_pages,
            page_size,
            c.num_kv_heads,
            c.head_dim,
            dtype=dtype or self.dtype,
            layer_windows=windows if hybrid and any(w is not None for w in windows) else None,
        )

    def __call__(
        self,
        tokens_T: jax.Array,  # i32[T]
        positions_T: jax.Array,  # i32[T]
        cache: PagedKVCache,
        md: AttentionMetadata,
        *,
        backend: str = "auto",
        interpret: bool = False,
        adapter_ids: jax.Array | None = None,  # i32[T]
    ) -> tuple[jax.Array, PagedKVCache]:  # (f32[R, V], cache)
        """Runs one step; returns the logits of rows ``md.logits_indices`` and the cache.

        ``backend`` / ``interpret`` go to ``paged_jax.ragged_paged_attention`` (or
        ``paged_jax.paged_attention`` for ``md.decode_only`` steps). ``adapter_ids``: each
        token's LoRA slot plus one (0: none; ``enable_lora``), or None (no adapters).
        """
        if adapter_ids is None:
            return self._forward(tokens_T, positions_T, cache, md, backend, interpret)
        if self.lora is None:
            raise ValueError("adapter_ids: the model has no LoRA slots (enable_lora)")
        if adapter_ids.shape != tokens_T.shape:
            raise ValueError(
                f"adapter_ids: expected shape {tokens_T.shape} (one a token), got "
                f"{adapter_ids.shape}"
            )
        with _lora.rows(self.lora, _lora.selector(self.lora, adapter_ids)):
            return self._forward(tokens_T, positions_T, cache, md, backend, interpret)

    def hidden_states(
        self,
        tokens_T: jax.Array,  # i32[T]
        positions_T: jax.Array,  # i32[T]
        cache: PagedKVCache,
        md: AttentionMetadata,
        *,
        backend: str = "auto",
        interpret: bool = False,
    ) -> tuple[jax.Array, PagedKVCache]:  # (f32[R, E], cache)
        """Runs one step as ``__call__`` does, but returns the final hidden states (after
        the last norm, before the LM head) of rows ``md.logits_indices`` instead of their
        logits: what embeddings pool (``LLM.embed``)."""
        x_TE, cache = self._layers(tokens_T, positions_T, cache, md, backend, interpret)
        return self.norm(x_TE[md.logits_indices]).astype(jnp.float32), cache

    def _forward(self, tokens_T, positions_T, cache, md, backend, interpret):
        x_TE, cache = self._layers(tokens_T, positions_T, cache, md, backend, interpret)
        logits = rowwise(self._logits, x_TE[md.logits_indices], invariant=md.batch_invariant)
        return logits, cache

    def _layers(self, tokens_T, positions_T, cache, md, backend, interpret):
        """The embedding and every layer: ``(x [T, E] before the last norm, cache)``."""
        cfg = self.config
        x_TE = self.embed_tokens(tokens_T)
        if cfg.scale_embeddings:  # Gemma: sqrt(E), rounded to the compute dtype first
            x_TE = x_TE * jnp.asarray(cfg.hidden_size**0.5, x_TE.dtype)
        # per_layer: weights held as tuples of per-layer arrays (split_layer_weights), each
        # picked by its product; stacked: [L, ...] arrays, sliced per layer
        graphdef, per_layer, stacked = nnx.split(self.layers, _held_per_layer, ...)
        kinds, period = cfg.layer_kinds, cfg.layer_period
        groups, rest = divmod(cfg.num_layers, period)

        def run(x_TE, cache, weights, j, layer):
            """Layer ``layer`` (a traced index), the ``j``-th of its group."""
            block = nnx.merge(graphdef, per_layer, weights)
            token = _LAYER.set(layer)
            try:
                return block(x_TE, positions_T, kinds[j], layer, cache, md, backend, interpret)
            finally:
                _LAYER.reset(token)

        def one_group(carry, xs):  # the same compiled body for every group of layers
            x_TE, cache = carry
            scanned, g = xs  # scanned: this layer's weights when period == 1, else None
            for j in range(period):  # the layers of a group differ in window / RoPE
                i = g * period + j
                # period > 1: sliced here (a reshaped copy of the stack would cost a step)
                weights = (
                    scanned
                    if scanned is not None
                    else jax.tree.map(
                        lambda a, i=i: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), stacked
                    )
                )
                x_TE, cache = run(x_TE, cache, weights, j, i)
            return (x_TE, cache), None

        group_ids = jnp.arange(groups, dtype=jnp.int32)
        xs = (stacked if period == 1 else None, group_ids)
        # (one replica's batch: data-parallel steps concatenate several, padded each)
        real = md.cu_q_lens[md.num_seqs[0]] if md.num_seqs.shape == (1,) else None
        rows = _ROWS.set(None if real is None else (x_TE.shape[0], real))
        try:
            if self.unrolled:  # hold_for_accelerator: layer i's own weights, i a Python int
                for i in range(cfg.num_layers):
                    weights = jax.tree.map(lambda a, i=i: a[i], stacked)
                    x_TE, cache = run(x_TE, cache, weights, i % period, i)
            else:
                (x_TE, cache), _ = jax.lax.scan(one_group, (x_TE, cache), xs)
                for j in range(rest):  # a last, partial group (Gemma 3 1B: 26 = 4 x 6 + 2)
                    i = groups * period + j
                    weights = jax.tree.map(lambda a, i=i: a[i], stacked)
                    x_TE, cache = run(x_TE, cache, weights, j, jnp.int32(i))
        finally:
            _ROWS.reset(rows)
        return x_TE, cache

    def _logits(self, x_RE):
        x_RE = self.norm(x_RE)
        if self.lm_head is None:
            logits = self.embed_tokens.attend(x_RE).astype(jnp.float32)
        else:
            logits = self.lm_head(x_RE).astype(jnp.float32)
        # a vocabulary padded for tensor parallelism (models.sharding.pad_vocab)
        logits = logits[:, : self.config.vocab_size]
        return _soft_cap(logits, self.config.final_logit_softcap)


def _dtype(w):
    """The dtype of an array, or of a tuple of per-layer arrays."""
    return _first(w).dtype


def _first(w):
    """An array, or the first of a tuple of per-layer arrays."""
    return w[0] if isinstance(w, tuple) else w


def _held_per_layer(path, var) -> bool:
    """An ``nnx.split`` filter: the variables a layer reads whole, not as its slice of a
    stack: those ``split_layer_weights`` made tuples, and packed stacks."""
    return isinstance(var, Packed) or (
        isinstance(var, nnx.Variable) and isinstance(var.get_value(), tuple)
    )


def init_model(
    cfg: LlamaConfig,
    *,
    seed: int = 0,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    mesh: jax.sharding.Mesh | None = None,
):
    """A randomly initialized model (fixed seed: the same weights in every process and
    on any mesh). ``mesh``: a mesh with a ``"tp"`` axis; the weights are initialized
    directly in their tensor-parallel shards (``paged_jax.models.sharding``)."""

    def make():
        return LlamaForCausalLM(cfg, rngs=nnx.Rngs(seed), dtype=dtype, param_dtype=param_dtype)

    if mesh is None:
        return make()
    from paged_jax.sharding import tensor_parallel_size

    from .sharding import shard_model, state_shardings

    if cfg.vocab_size % tensor_parallel_size(mesh):  # padded by shard_model
        return shard_model(make(), mesh)

    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    shardings = state_shardings(cfg, abstract, mesh)
    state = jax.jit(lambda: nnx.split(make())[1], out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def make_step(model: LlamaForCausalLM, *, backend: str = "auto", interpret: bool = False):
    """Splits ``model`` and returns ``(step, state)``, where

    ``step(state, tokens i32[T], positions i32[T], cache, metadata) -> (logits f32[R, V],
    cache)`` is jitted, applies the metadata's copy-on-write copies first, and donates
    ``cache`` (the pool is updated in place; do not reuse the cache passed in).
    """
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=(3,))
    def step(state, tokens, positions, cache, md):
        m = nnx.merge(graphdef, state)
        cache = cache.copy_pages(md.copy_src, md.copy_dst)
        return m(tokens, positions, cache, md, backend=backend, interpret=interpret)

    return step, state
