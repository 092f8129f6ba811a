"""Few-row matrix products streaming the weight in its own dtype (Pallas, Triton
lowering): the products of a decode step on an NVIDIA GPU, as an instrument.

Each program takes a ``block_n``-wide column panel of the weight (and with ``split_k`` >
1 a slice of its rows), streams it in ``block_k``-row chunks, widens 8-bit chunks in
registers, and keeps every row's partial sums in registers. ``x [M, K] @ w [K, N]``
(times ``scale [N]`` for an 8-bit ``w``), accumulated in f32, returned in ``x``'s dtype.
Runs under ``interpret=True`` on CPU (the tests) and lowers through Triton on GPU.

Measured, not used by the models (``python -m benchmarks products --pallas ...``; H200,
``benchmarks/results/products_gpu_h200_pallas*.json``, ``products_chain_h200.json``): at
64 rows the Llama-3-8B shape's 32 fused layers took 5.52 ms against XLA's 5.67 (bf16),
at 256 rows 11.8 against 7.5; 8-bit weights widened here took 7.4-7.6 ms at 64 rows, the
widening keeping the weight off the tensor cores' asynchronous path. What holds XLA's
products to about 2.5 TB/s at 64 rows is not the product's inner loop: chained in one
call, each product costs about 9 us beyond its bytes at 4.8 TB/s, whichever kernel runs
it (a 34 MB weight 15.9 us, a 235 MB one 61 us, 3.85 TB/s). Fewer, larger kernels per
step, not a better product, are what the decode step's weights need next.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _kernel(x_ref, w_ref, s_ref, o_ref, *, block_k, steps, compute):
    # x_ref [M, K / split_k], w_ref [K / split_k, BN], s_ref [BN] or None, o_ref [M, BN]
    rows = x_ref.shape[0]

    def body(i, acc):
        xs = x_ref[:, pl.ds(i * block_k, block_k)].astype(compute)
        ws = w_ref[pl.ds(i * block_k, block_k), :].astype(compute)
        return acc + jnp.dot(xs, ws, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((rows, w_ref.shape[1]), jnp.float32))
    if s_ref is not None:
        acc = acc * s_ref[...][None, :]
    o_ref[...] = acc.astype(o_ref.dtype)


def _kernel_without_scale(x_ref, w_ref, o_ref, **kw):  # a float weight: no scale operand
    _kernel(x_ref, w_ref, None, o_ref, **kw)


def default_split_k(m: int, k: int, n: int, w_bytes: int, block_n: int, block_k: int) -> int:
    """K's slices a product of ``m`` rows by a ``[k, n]`` weight of ``w_bytes`` a value
    takes: doubled while the programs (``n / block_n`` panels times slices) fill less than
    two waves of an H100/H200's 132 SMs, each slice keeps at least 4 chunks of
    ``block_k``, and the slices' f32 partial sums (written and read back) stay under a
    quarter of the weight's bytes."""
    split = 1
    while (
        n // block_n * split < 2 * 132
        and k % (2 * split * block_k) == 0
        and k // (2 * split) >= 4 * block_k
        and 2 * split * m * n * 4 * 2 <= k * n * w_bytes // 4
    ):
        split *= 2
    return split


def _check(x, w, scale, block_n, block_k, split_k):
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"x, w: expected [M, K] and [K, N], got {x.shape} and {w.shape}")
    if jnp.dtype(w.dtype).itemsize == 1 and scale is None:
        raise ValueError(f"scale: an 8-bit w ({w.dtype}) needs its f32[N] scale")
    if scale is not None and scale.shape != (w.shape[1],):
        raise ValueError(f"scale: expected shape ({w.shape[1]},), got {scale.shape}")
    M, K, N = x.shape[0], *w.shape
    if M < 16 or M & (M - 1):
        raise ValueError(f"x: expected a power of two >= 16 rows, got {M}")
    for name, v in (("block_n", block_n), ("block_k", block_k), ("split_k", split_k)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name}: expected a power of two, got {v}")
    if N % block_n or K % (block_k * split_k):
        raise ValueError(
            f"w: expected N a multiple of block_n={block_n} and K of block_k * split_k="
            f"{block_k * split_k}, got [{K}, {N}]"
        )


@functools.partial(
    jax.jit,
    static_argnames=("block_n", "block_k", "split_k", "num_warps", "num_stages", "interpret"),
)
def matmul(
    x: jax.Array,
    w: jax.Array,
    scale: jax.Array | None = None,
    *,
    block_n: int = 64,
    block_k: int = 128,
    split_k: int = 1,
    num_warps: int = 4,
    num_stages: int = 3,
    interpret: bool = False,
) -> jax.Array:
    """``x @ w`` (``* scale`` per column): ``x`` bf16/f32 ``[M, K]`` with M a power of two
    >= 16; ``w`` ``[K, N]`` in ``x``'s dtype, or int8 / float8_e4m3fn with ``scale``
    f32 ``[N]``; returns ``[M, N]`` in ``x``'s dtype. A program per ``block_n`` columns
    (times ``split_k`` slices of K, summed after in f32). Raises ``ValueError`` for
    shapes the blocks do not divide."""
    _check(x, w, scale, block_n, block_k, split_k)
    M, K, N = x.shape[0], *w.shape
    ks = K // split_k
    compute = x.dtype
    kernel = functools.partial(
        _kernel if scale is not None else _kernel_without_scale,
        block_k=block_k,
        steps=ks // block_k,
        compute=compute,
    )
    out_dtype = jnp.float32 if split_k > 1 else x.dtype
    in_specs = [
        pl.BlockSpec((M, ks), lambda j, s: (0, s)),
        pl.BlockSpec((ks, block_n), lambda j, s: (s, j)),
    ]
    args = [x, w]
    if scale is not None:
        in_specs.append(pl.BlockSpec((block_n,), lambda j, s: (j,)))
        args.append(scale.astype(jnp.float32))
    out = pl.pallas_call(
        kernel,
        grid=(N // block_n, split_k),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, M, block_n), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((split_k, M, N), out_dtype),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="few_row_matmul",
    )(*args)
    return out[0] if split_k == 1 else out.sum(0).astype(x.dtype)
