"""Linear layers: ``Linear``, an ``nnx.Linear`` whose weight may be quantized (int8 per
channel or in groups, 4-bit groups, fp8), held per layer, packed for the CPU's C kernel
or transposed for fp8 activations, each product taking the way its weight and platform
call for (XLA's dot, the C kernel, a Pallas kernel: ``kernels.KERNELS``); fusing
projections that read the same input (``fuse_linears``); and the context a forward pass
sets while it runs its layers (``LAYER``, ``ROWS``)."""

from __future__ import annotations

import contextvars

import jax
import jax.numpy as jnp
from flax import nnx

from paged_jax import linear
from paged_jax._quant import quantize_rows

from .. import lora as _lora
from ..quantization import (
    check_format,
    dequantize_int4,
    int8_group,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)
from .kernels import grouped_by_kernel, kernel_platform, w8a16_by_kernel

# The traced index of the layer being computed, while a forward pass runs the layers of
# a model whose linear weights are held per layer (placement.split_layer_weights).
LAYER: contextvars.ContextVar = contextvars.ContextVar("paged_jax_layer")
# While a forward pass runs its layers: (T, the step's real tokens as a traced i32
# scalar). Packed products on [T, in] inputs then compute those rows only, not the
# padding up to the bucket's T (whose results are 0; nothing reads them).
ROWS: contextvars.ContextVar = contextvars.ContextVar("paged_jax_rows", default=None)


def layer_value(var: nnx.Variable) -> jax.Array:
    """A layer's value of ``var``: the array itself, or where it is held as a tuple of
    per-layer arrays (``placement.hold_for_accelerator``'s experts, routers and sinks)
    the one of the layer being computed (``LAYER``: a Python int in an unrolled loop;
    a traced index picks by ``lax.switch``)."""
    value = var.get_value()
    if not isinstance(value, tuple):
        return value
    layer = LAYER.get()
    if isinstance(layer, int):
        return value[layer]
    return jax.lax.switch(layer, [lambda v=v: v for v in value])


class Packed(nnx.Param):
    """A linear kernel packed for the CPU kernel (``paged_jax.linear.pack``): ``[P, in,
    NR]``, or ``[L, P, in, NR]`` for the layers' stack, which the forward pass hands whole
    to each layer's product with the layer's index (never a slice of it)."""


class Linear(nnx.Linear):
    """``nnx.Linear`` whose kernel (and bias) may be held for the CPU:

    - a tuple of per-layer arrays (``placement.split_layer_weights``): the layer
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
    # scale and zero f32 [(L,) in / 32, out]; a GGUF file's blocks kept, gguf_blocks.
    # Nibbles: scale (and zero) perhaps f16 [(L,) in / G, out], G 32 or 16, zero perhaps
    # absent (weights scale * (q - offset)), and high uint8 [(L,) in * high_bits / 8, out]
    # perhaps, 1 or 2 bits above each value)
    quantized = None
    high_bits = 0  # int4 from a GGUF file's 5- or 6-bit blocks: the bits in ``high``
    offset = 0  # int4 without zero: the weights are scale * (q - offset)
    # A GGUF file's blocks kept by default (int4, or int8 groups): packed products
    # dequantize each panel and multiply the rows as they are (paged_jax.linear.matmul's
    # float_rows: the float weights' very sums), rather than quantizing the rows (W8A8)
    float_rows = False
    # quantize sets it for int8 groups made for the CPU (and the GGUF loader where it
    # quantizes so): the kernel is R w, w rotated along its inputs in blocks of 32
    # (paged_jax.linear.rotate), and each product rotates its rows likewise
    rotated = False
    # hold_fp8_activations sets it: an fp8 kernel held [(L,) out, in], each product fp8 by
    # fp8 with the rows quantized too (W8A8)
    fp8_activations = False
    # hold_for_accelerator sets it for q/k/v, o and down (W8A8): their rows quantized by
    # one Pallas kernel where kernels.KERNELS["fp8_rows"] says (q/k/v's with its norm)
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
        held = (self.bias, *(getattr(self, a, None) for a in ("scale", "zero", "high")))
        for var in held:
            if var is not None and isinstance(var.get_value(), tuple):
                var.set_value(jnp.stack(var.get_value()))
        if self.quantized == "int4":  # the groups' panels, as the weight's
            self.scale = Packed(linear.pack(self.scale.get_value()))
            if zero_of(self) is not None:
                self.zero = Packed(linear.pack(self.zero.get_value()))
            if self.high_bits:
                self.high = Packed(linear.pack_high(self.high.get_value(), self.high_bits))
        elif self.quantized and grouped(kernel, self.scale.get_value()):  # int8 groups
            self.scale = Packed(linear.pack(self.scale.get_value()))
            if zero_of(self) is not None:  # and their minimums
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
        first = first_of(kernel)
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
        every call; docs/DECISIONS.md, "fp8 weights held [out, in]"). Returns the module.
        Idempotent. After
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
        scale, zero = self.scale.get_value(), zero_of(self)
        if self.quantized == "int4":
            high = high_of(self)
            if self.packed:
                scale = linear.unpack(scale, self.out_features)
                zero = None if zero is None else linear.unpack(zero, self.out_features)
                if high is not None:
                    high = linear.unpack_high(high, self.out_features, self.high_bits)
            if isinstance(kernel, tuple):
                n = len(kernel)
                return tuple(
                    dequantize_int4(k, s, z, -2, None, h, self.offset)
                    for k, s, z, h in zip(
                        kernel, scale, zero or (None,) * n, high or (None,) * n, strict=True
                    )
                )
            return dequantize_int4(kernel, scale, zero, -2, None, high, self.offset)
        if self.packed and grouped(self.kernel.get_value(), scale):  # int8 groups
            scale = linear.unpack(scale, self.out_features)
            if zero is not None:
                zero = linear.unpack(zero, self.out_features)
        elif self.packed:
            scale = scale[..., : self.out_features]
        back = (lambda w: linear.rotate(w, -2)) if self.rotated else (lambda w: w)
        if isinstance(kernel, tuple):
            zeros = zero if zero is not None else (None,) * len(kernel)
            return tuple(
                back(dequantize8(k, s, z)) for k, s, z in zip(kernel, scale, zeros, strict=True)
            )
        return back(dequantize8(kernel, scale, zero))

    def __call__(self, inputs: jax.Array | None, rows=None) -> jax.Array:
        """``inputs [..., in] @ w`` (and the active adapters' delta). ``rows``: an fp8
        module's inputs quantized already (``(q [T, in] float8_e4m3fn, scale f32 [T])``,
        ``paged_jax.linear.fp8_rows``), ``inputs`` then None (no adapters active)."""
        y = self._product(inputs, rows)
        if self.lora_targets and _lora.current_mask() is not None:  # rows with adapters
            d = _lora.delta(self.lora_targets, inputs, LAYER.get(), self.precision)
            y = y + d.astype(y.dtype)
        return y

    def _product(self, inputs: jax.Array | None, rows=None) -> jax.Array:
        kernel = self.kernel.get_value()
        bias = None if self.bias is None else self.bias.get_value()
        scale = self.scale.get_value() if self.quantized else None
        zero, high = zero_of(self), high_of(self)

        def add_bias(y, b):
            return y if b is None else y + jnp.reshape(b, (1,) * (y.ndim - 1) + (-1,))

        def pick(w, i):
            return None if w is None else w[i]

        if self.packed:  # a stack is indexed by the layer being computed
            layer = LAYER.get() if kernel.ndim == 4 else None
            step = ROWS.get()
            rows = step[1] if step is not None and inputs.shape[:-1] == (step[0],) else None
            x = inputs.astype(jnp.float32)
            kept = {}  # a GGUF file's blocks kept: only what they need, named
            if high is not None:
                kept["high"] = high
            if self.offset:
                kept["offset"] = self.offset
            if self.float_rows:
                kept["float_rows"] = True
            y = linear.matmul(
                x,
                kernel,
                self.out_features,
                layer,
                rows,
                scales=scale,
                mins=zero,
                rotated=self.rotated,
                **kept,
            )
            return add_bias(y.astype(self.dtype or y.dtype), bias)
        if not isinstance(kernel, tuple):
            if scale is None:
                return super().__call__(inputs)
            return dot_layer(self, inputs, kernel, bias, scale, zero, rows, high)
        layer = LAYER.get()
        if isinstance(layer, int):  # an unrolled layer loop: this layer's own arrays
            w = (kernel[layer], pick(bias, layer), pick(scale, layer), pick(zero, layer))
            return dot_layer(self, inputs, *w, rows, pick(high, layer))

        def one(i):
            w = (kernel[i], pick(bias, i), pick(scale, i), pick(zero, i))
            h = pick(high, i)
            return lambda operand: dot_layer(self, operand[0], *w, operand[1], h)

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


def grouped(kernel, scale) -> bool:
    """Whether an int8 module's ``scale`` is per group of inputs (``[(L,) in / G, out]``;
    packed: ``[(L,) P, in / G, NR]``) rather than per output channel (``[(L,) out]``;
    packed: ``[(L,) P * NR]``), as the module holds both (per-layer tuples alike)."""
    k = kernel[0] if isinstance(kernel, tuple) else kernel
    s = scale[0] if isinstance(scale, tuple) else scale
    return s.ndim == k.ndim


def zero_of(module):
    """A quantized module's minimums (``zero``: 4-bit groups, or int8 groups kept from a
    GGUF's Q5_1 / Q5_K blocks), as held, or None."""
    zero = getattr(module, "zero", None) if module.quantized else None
    return None if zero is None else zero.get_value()


def high_of(module):
    """An int4 module's high bits (``high``: a GGUF file's 5- or 6-bit blocks kept), as
    held, or None."""
    high = getattr(module, "high", None) if module.high_bits else None
    return None if high is None else high.get_value()


def dequantize8(q, scale, zero=None):
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


def dot_layer(
    module: Linear,
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None,
    scale: jax.Array | None = None,
    zero: jax.Array | None = None,
    rows=None,
    high: jax.Array | None = None,
):
    """``x @ kernel + bias`` as ``nnx.Linear`` computes it, for one layer's own arrays;
    an int8 ``kernel`` is widened to the compute dtype and its product times ``scale``
    (with scales per group, and ``zero``: dequantized first); a 4-bit one (with
    ``zero``, or the module's ``offset``, and ``high`` bits where the module has them) is
    dequantized to the compute dtype first. ``rows``: an fp8 module's rows
    quantized already (``Linear.__call__``), ``x`` then None."""
    if module.fp8_activations:  # W8A8: fp8 rows by the fp8 kernel held [out, in]
        out_dtype = module.dtype or (jnp.bfloat16 if x is None else x.dtype)
        if rows is not None:
            xq, xs = rows
        elif module.fp8_rows_kernel and (platform := kernel_platform("fp8_rows")):
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
    four = module.quantized == "int4"
    if four and high is None:  # the GPU's 4-bit kernel: f32 scales and minimums (a GGUF
        # file's float16 ones widened, an offset as -offset * scale: small arrays)
        s32 = scale.astype(jnp.float32)
        z32 = -float(module.offset) * s32 if zero is None else zero.astype(jnp.float32)
        y = grouped_by_kernel(module, x, kernel, s32, z32, 4)
        if y is not None:
            return y if bias is None else y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    elif not four and scale is not None and grouped(kernel, scale):  # int8 groups
        y = grouped_by_kernel(module, x, kernel, scale, zero, 8)
        if y is not None:
            return y if bias is None else y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    if scale is not None and not four and not grouped(kernel, scale):
        y = w8a16_by_kernel(module, x, kernel, scale)
        if y is not None:
            return y if bias is None else y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    if four:
        dtype = module.dtype or x.dtype
        kernel = dequantize_int4(kernel, scale, zero, -2, dtype, high, module.offset)
        scale = None
    elif scale is not None and grouped(kernel, scale):  # int8 groups: dequantized first
        kernel = dequantize8(kernel, scale, zero).astype(module.dtype or x.dtype)
        scale = None
    if module.rotated:  # (x R)(R w) = x w
        x = linear.rotate(x, -1).astype(x.dtype)
    x, kernel, bias = module.promote_dtype((x, kernel, bias), dtype=module.dtype)
    y = module.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=module.precision)
    if scale is not None:
        y = y * jnp.reshape(scale.astype(y.dtype), (1,) * (y.ndim - 1) + (-1,))
    return y if bias is None else y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))


# The modules fuse_projections makes, and the ones each replaces (in output order).
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fuse_linears(linears: list[Linear]) -> Linear | None:
    """One ``Linear`` computing what ``linears`` (the same input) compute, their outputs
    side by side: the kernel, bias, and a quantized format's scales and minimums
    concatenated along the output axis, one product instead of several. Weights per
    layer (``split_layer_weights``) are concatenated layer by layer; stacked ``[L, ...]``
    ones (``hold_for_cpu``, before packing) whole. Fewer, wider products read the same
    bytes with fewer launches (GPU) or calls of the C kernel (CPU; docs/DECISIONS.md,
    "fused projections"). The first module becomes the fused one (returned); ``parts``
    on it names each part's width, in order. Returns None, changing nothing, where the
    modules do not fit together: some per layer and some stacked, packed, of different
    formats or dtypes, with scales or minimums of different groups (a GGUF file's Q6_K
    and Q8_0 blocks), or with a bias on some only."""
    first = linears[0]
    kernels = [m.kernel.get_value() for m in linears]
    if len({isinstance(k, tuple) for k in kernels}) != 1 or any(m.packed for m in linears):
        return None
    kinds = {
        (m.quantized, m.rotated, dtype_of(k), m.high_bits, m.offset, m.float_rows)
        + ((dtype_of(m.scale.get_value()),) if m.quantized else ())
        for m, k in zip(linears, kernels, strict=True)
    }
    if len(kinds) != 1:  # (a GGUF file's kept blocks: the same bits, offset, scale dtype)
        return None
    if len({m.bias is None for m in linears}) != 1:
        return None

    if len({zero_of(m) is None for m in linears}) != 1:  # minimums in some parts only
        return None
    del kernels
    names = ["kernel", "bias"] + (["scale"] if first.quantized else [])
    if zero_of(first) is not None:
        names.append("zero")
    if first.high_bits:
        names.append("high")
    for name in names[2:]:  # the same groups of inputs (or none) in every part
        shapes = {first_of(getattr(m, name).get_value()).shape[:-1] for m in linears}
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


def make_linear(cfg_in: int, out: int, bias: bool, *, rngs, dtype, param_dtype) -> Linear:
    """A ``Linear`` ``[cfg_in, out]`` at the highest precision."""
    return Linear(
        cfg_in,
        out,
        use_bias=bias,
        dtype=dtype,
        param_dtype=param_dtype,
        precision=jax.lax.Precision.HIGHEST,
        rngs=rngs,
    )


def dtype_of(w):
    """The dtype of an array, or of a tuple of per-layer arrays."""
    return first_of(w).dtype


def first_of(w):
    """An array, or the first of a tuple of per-layer arrays."""
    return w[0] if isinstance(w, tuple) else w
