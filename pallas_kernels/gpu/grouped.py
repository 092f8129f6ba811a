"""Grouped expert products for NVIDIA GPUs (Pallas, Triton lowering): a mixture's experts
read through a tile table.

``x [M, K]`` holds a step's (token, expert) rows laid out by ``_groups.expert_tiles``:
``block_m``-row tiles, each one expert's. Grid ``(tiles, F / block_n)``: a program loads
its tile's expert from ``tile_expert`` and streams that expert's ``[block_k, block_n]``
weight chunks down K, its rows' sums in registers (f32); an int8 weight's chunk is
widened in registers and the expert's column scales applied at the end (W8A16). A tile
past ``tiles_used`` returns at once: an expert no pair chose is never read, and spare
tiles cost a launch slot each, nothing more. Runs under ``interpret=True`` on CPU (the
tests) and lowers through Triton on GPU (``aot.py`` builds it for sm_90); never timed on
a GPU yet.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .._groups import check_grouped

__all__ = ["grouped_matmul", "MIN_BLOCK_M"]

MIN_BLOCK_M = 16  # the tensor cores' fewest rows


def _block(dim: int, wanted: int) -> int | None:
    """The largest power of two from ``wanted`` down to 16 dividing ``dim``, or None."""
    b = wanted
    while b >= 16:
        if dim % b == 0:
            return b
        b //= 2
    return None


def _kernel(te_ref, used_ref, x_ref, w_ref, s_ref, o_ref, *, block_m, block_k, steps):
    # te_ref i32[tiles], used_ref i32[1], x_ref [M, K], w_ref [X, K, F] (whole: read at
    # the tile's expert), s_ref f32[X, F] or None, o_ref [block_m, block_n]
    t, n = pl.program_id(0), pl.program_id(1)
    bn = o_ref.shape[1]

    @pl.when(t < used_ref[0])
    def _():
        e = te_ref[t]
        compute = x_ref.dtype
        # f32 rows: full f32 products (Triton's default would round them to tf32)
        precision = jax.lax.Precision.HIGHEST if compute == jnp.float32 else None

        def step(i, acc):
            xs = x_ref[pl.ds(t * block_m, block_m), pl.ds(i * block_k, block_k)]
            ws = w_ref[e, pl.ds(i * block_k, block_k), pl.ds(n * bn, bn)].astype(compute)
            return acc + jnp.dot(xs, ws, precision=precision, preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, steps, step, jnp.zeros(o_ref.shape, jnp.float32))
        if s_ref is not None:
            acc = acc * s_ref[e, pl.ds(n * bn, bn)][None, :]
        o_ref[...] = acc.astype(o_ref.dtype)


def _kernel_without_scale(te_ref, used_ref, x_ref, w_ref, o_ref, **kw):
    _kernel(te_ref, used_ref, x_ref, w_ref, None, o_ref, **kw)


@functools.partial(
    jax.jit,
    static_argnames=("block_m", "block_n", "block_k", "num_warps", "num_stages", "interpret"),
)
def grouped_matmul(
    x: jax.Array,  # [M, K], M = tiles * block_m, f32 / bf16 / f16
    w: jax.Array,  # [X, K, F], x's dtype or int8
    tile_expert: jax.Array,  # i32[tiles]
    tiles_used: jax.Array,  # i32[1]
    scale: jax.Array | None = None,  # f32[X, F] for an int8 w
    *,
    block_m: int,
    block_n: int = 64,
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
    interpret: bool = False,
) -> jax.Array:  # [M, F] in x's dtype
    """Each used tile's ``block_m`` rows of ``x`` times its expert's weight ``w[tile_expert
    [t]]`` (times that expert's column ``scale`` for an int8 ``w``), summed in f32 and
    returned in ``x``'s dtype. Rows of tiles past ``tiles_used`` are not written (hold
    anything). ``block_m``: a power of two >= 16; ``block_n`` / ``block_k``: the largest
    powers of two up to these (at least 16) dividing F / K. Raises ``ValueError`` for
    shapes no such block divides."""
    check_grouped(x, w, tile_expert, tiles_used, scale, block_m)
    if block_m < MIN_BLOCK_M or block_m & (block_m - 1):
        raise ValueError(f"block_m: expected a power of two >= {MIN_BLOCK_M}, got {block_m}")
    _, K, F = w.shape
    bn, bk = _block(F, block_n), _block(K, block_k)
    if bn is None or bk is None:
        raise ValueError(f"w: expected K and F multiples of 16, got [{K}, {F}] ({w.shape})")
    tiles = tile_expert.shape[0]
    whole = lambda a: pl.BlockSpec(a.shape, lambda t, n: (0,) * a.ndim)  # noqa: E731
    args = [tile_expert, tiles_used, x, w]
    if scale is not None:
        args.append(scale.astype(jnp.float32))
    kernel = functools.partial(
        _kernel if scale is not None else _kernel_without_scale,
        block_m=block_m,
        block_k=bk,
        steps=K // bk,
    )
    return pl.pallas_call(
        kernel,
        grid=(tiles, F // bn),
        in_specs=[whole(a) for a in args],
        out_specs=pl.BlockSpec((block_m, bn), lambda t, n: (t, n)),
        out_shape=jax.ShapeDtypeStruct((x.shape[0], F), x.dtype),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="grouped_matmul_gpu",
    )(*args)
