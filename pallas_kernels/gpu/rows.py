"""Rows quantized to fp8 in one kernel (Pallas, Triton lowering): what an fp8-by-fp8
product (W8A8) needs of its input on an NVIDIA GPU.

``paged_jax._quant.quantize_rows`` (each row's largest magnitude over 448 its scale, the
row divided by it and rounded to e4m3) is two kernels under XLA:GPU, a reduction and then
the conversion, and for the MLP's down product a third before them, ``silu(gate) * up``
(``python -m benchmarks step_kernels --variants fp8``: 17 kernels a Llama-3-8B layer
against bf16's 12). Here a program takes a row whole (the next power of two of its width,
masked), computes the activation where asked, its largest magnitude, and writes the
quantized row and its scale: one kernel. Runs under ``interpret=True`` on CPU (the tests)
and lowers through Triton on GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value

ACTIVATIONS = ("silu", "gelu_tanh")


def _kernel(x_ref, w_ref, q_ref, s_ref, *, width, block, act, dtype, eps, unit_offset):
    # x_ref: the row [W] (act None) or [2 W] (gate | up); w_ref [W] f32 (or None): an RMS
    # norm's weight, the row normed first; q_ref [W] fp8; s_ref [1] f32
    cols = jnp.arange(block)
    keep = cols < width
    zero = pl.program_id(0) * 0  # traced: a block past the row's end is masked, not refused

    def load(ref, start):
        return plgpu.load(ref.at[pl.ds(zero + start, block)], mask=keep, other=0.0)

    if act is None:
        x = load(x_ref, 0).astype(jnp.float32)
    else:  # act(gate) * up in f32, rounded once to the input dtype (as XLA fuses the MLP's)
        g, up = load(x_ref, 0).astype(jnp.float32), load(x_ref, width).astype(jnp.float32)
        a = g * jax.nn.sigmoid(g) if act == "silu" else jax.nn.gelu(g, approximate=True)
        x = (a * up).astype(dtype).astype(jnp.float32)
    if w_ref is not None:  # models.layers.RMSNorm: in f32, then the norm's dtype
        x = x * jax.lax.rsqrt(jnp.sum(x * x) / width + eps)
        w = load(w_ref, 0)
        x = ((1.0 + w if unit_offset else w) * x).astype(dtype).astype(jnp.float32)
    amax = jnp.max(jnp.where(keep, jnp.abs(x), 0.0))
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    plgpu.store(q_ref.at[pl.ds(zero, block)], (x / scale).astype(q_ref.dtype), mask=keep)
    s_ref[0] = scale


@functools.partial(
    jax.jit, static_argnames=("act", "eps", "unit_offset", "dtype", "num_warps", "interpret")
)
def fp8_rows(
    x: jax.Array,
    *,
    act: str | None = None,
    norm_weight: jax.Array | None = None,
    eps: float = 1e-6,
    unit_offset: bool = False,
    dtype=None,
    num_warps: int | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """``(q float8_e4m3fn [M, W], scale f32 [M])`` of rows ``x [M, W]`` (bf16/f16/f32),
    as ``paged_jax._quant.quantize_rows(x, float8_e4m3fn)`` defines them; with ``act``
    (``"silu"`` or ``"gelu_tanh"``) of ``act(gate) * up`` for ``x = [gate | up]`` ``[M,
    2 W]``, computed in f32 and rounded once to ``x``'s dtype, as XLA fuses the MLP's.
    With ``norm_weight`` (``[W]``) of ``models.layers.RMSNorm``'s output first (in f32: the
    row over its root mean square plus ``eps``, times the weight, ``1 +`` it with
    ``unit_offset``, rounded to ``dtype``, the norm's). One program a row. Raises
    ``ValueError`` for an ``act`` it does not know, an odd width with one, or a norm
    weight of another width or without ``dtype``."""
    if x.ndim != 2:
        raise ValueError(f"x: expected [M, W], got shape {x.shape}")
    if act is not None and act not in ACTIVATIONS:
        raise ValueError(f"act: expected None or one of {ACTIVATIONS}, got {act!r}")
    M, W2 = x.shape
    if act is not None and W2 % 2:
        raise ValueError(f"x: expected [M, 2 W] (gate | up) with act, got width {W2}")
    width = W2 // 2 if act is not None else W2
    if norm_weight is not None and (norm_weight.shape != (width,) or dtype is None):
        raise ValueError(
            f"norm_weight, dtype: expected [{width}] and the norm's dtype, got "
            f"{norm_weight.shape} and {dtype}"
        )
    block = pl.next_power_of_2(width)
    warps = num_warps or (4 if block <= 4096 else 8)
    kernel = functools.partial(
        _kernel,
        width=width,
        block=block,
        act=act,
        dtype=jnp.dtype(x.dtype if dtype is None else dtype),
        eps=float(eps),
        unit_offset=bool(unit_offset),
    )
    w = None if norm_weight is None else norm_weight.astype(jnp.float32)
    q, scale = pl.pallas_call(
        kernel,
        grid=(M,),
        in_specs=[
            pl.BlockSpec((None, W2), lambda i: (i, 0)),
            None if w is None else pl.BlockSpec((width,), lambda i: (0,)),
        ],
        out_specs=[
            pl.BlockSpec((None, width), lambda i: (i, 0)),
            pl.BlockSpec((None, 1), lambda i: (i, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((M, width), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((M, 1), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
        name="fp8_rows",
    )(x, w)
    return q, scale[:, 0]
