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


def _kernel(x_ref, q_ref, s_ref, *, width, block, act, dtype):
    # x_ref: the row [W] (act None) or [2 W] (gate | up); q_ref [W] fp8; s_ref [1] f32
    cols = jnp.arange(block)
    keep = cols < width
    zero = pl.program_id(0) * 0  # traced: a block past the row's end is masked, not refused

    def load(start):
        return plgpu.load(x_ref.at[pl.ds(zero + start, block)], mask=keep, other=0.0)

    if act is None:
        x = load(0).astype(jnp.float32)
    else:  # act(gate) * up in f32, rounded once to the input dtype (as XLA fuses the MLP's)
        g, up = load(0).astype(jnp.float32), load(width).astype(jnp.float32)
        a = g * jax.nn.sigmoid(g) if act == "silu" else jax.nn.gelu(g, approximate=True)
        x = (a * up).astype(dtype).astype(jnp.float32)
    amax = jnp.max(jnp.where(keep, jnp.abs(x), 0.0))
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    plgpu.store(q_ref.at[pl.ds(zero, block)], (x / scale).astype(q_ref.dtype), mask=keep)
    s_ref[0] = scale


@functools.partial(jax.jit, static_argnames=("act", "num_warps", "interpret"))
def fp8_rows(
    x: jax.Array,
    *,
    act: str | None = None,
    num_warps: int | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """``(q float8_e4m3fn [M, W], scale f32 [M])`` of rows ``x [M, W]`` (bf16/f16/f32),
    as ``paged_jax._quant.quantize_rows(x, float8_e4m3fn)`` defines them; with ``act``
    (``"silu"`` or ``"gelu_tanh"``) of ``act(gate) * up`` for ``x = [gate | up]`` ``[M,
    2 W]``, computed in ``x``'s dtype as the MLP does. One program a row. Raises
    ``ValueError`` for an ``act`` it does not know or an odd width with one."""
    if x.ndim != 2:
        raise ValueError(f"x: expected [M, W], got shape {x.shape}")
    if act is not None and act not in ACTIVATIONS:
        raise ValueError(f"act: expected None or one of {ACTIVATIONS}, got {act!r}")
    M, W2 = x.shape
    if act is not None and W2 % 2:
        raise ValueError(f"x: expected [M, 2 W] (gate | up) with act, got width {W2}")
    width = W2 // 2 if act is not None else W2
    block = pl.next_power_of_2(width)
    warps = num_warps or (4 if block <= 4096 else 8)
    q, scale = pl.pallas_call(
        functools.partial(_kernel, width=width, block=block, act=act, dtype=x.dtype),
        grid=(M,),
        in_specs=[pl.BlockSpec((None, W2), lambda i: (i, 0))],
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
    )(x)
    return q, scale[:, 0]
