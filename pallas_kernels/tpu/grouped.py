"""Grouped expert products for TPU (Pallas, Mosaic): a mixture's experts read through a
scalar-prefetched tile table.

``x [M, K]`` holds a step's (token, expert) rows laid out by ``_groups.expert_tiles``:
``block_m``-row tiles, each one expert's. Grid ``(F / block_n, tiles, K / block_k)``: the
tile table and the count of used tiles reach the kernel by scalar prefetch, and the
weight's index map reads ``tile_expert[t]``, so each used tile's program DMAs its own
expert's ``[block_k, block_n]`` blocks and an expert no tile names is never fetched.
Tiles past ``tiles_used`` map every operand to the last used tile's blocks (an unchanged
block index: no DMA) and compute nothing; their output block is the last used tile's,
left as it was, so nothing is written for them either. Sums in f32 in VMEM across the K
steps; an int8 weight is widened in VMEM to ``x``'s dtype and its column scales applied
at the end (W8A16).

Status: verified in TPU interpret mode on CPU, lowered through Mosaic and compiled for
TPU v5e and v6e through libtpu on a CPU host (``aot.py``); never run on a TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .._groups import check_grouped

__all__ = ["grouped_matmul", "min_block_m"]


def min_block_m(dtype) -> int:
    """The fewest rows a tile of ``dtype`` rows may hold: a VMEM tile's sublanes (8 for
    32-bit rows, 16 for 16-bit)."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def _block(dim: int, wanted: int) -> int:
    """The largest of ``wanted``, 256, 128 dividing ``dim`` (lanes of 128), else ``dim``."""
    for b in (wanted, 256, 128):
        if b <= dim and dim % b == 0 and b % 128 == 0:
            return b
    return dim


def _kernel(tile_expert_ref, tiles_used_ref, x_ref, w_ref, *rest, steps, precision, scaled):
    del tile_expert_ref  # read by the index maps
    s_ref, o_ref, acc_ref = rest if scaled else (None, *rest)
    t, k = pl.program_id(1), pl.program_id(2)

    @pl.when(t < tiles_used_ref[0])
    def _():
        @pl.when(k == 0)
        def _():
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        x = x_ref[...]
        acc_ref[...] += jnp.dot(
            x, w_ref[...].astype(x.dtype), precision=precision, preferred_element_type=jnp.float32
        )

        @pl.when(k == steps - 1)
        def _():
            acc = acc_ref[...]
            if s_ref is not None:
                acc = acc * s_ref[...]
            o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "interpret"))
def grouped_matmul(
    x: jax.Array,  # [M, K], M = tiles * block_m, f32 or bf16
    w: jax.Array,  # [X, K, F], x's dtype or int8
    tile_expert: jax.Array,  # i32[tiles]
    tiles_used: jax.Array,  # i32[1]
    scale: jax.Array | None = None,  # f32[X, F] for an int8 w
    *,
    block_m: int,
    block_n: int = 512,
    block_k: int = 512,
    interpret: bool = False,
) -> jax.Array:  # [M, F] in x's dtype
    """Each used tile's ``block_m`` rows of ``x`` times its expert's weight ``w[tile_expert
    [t]]`` (times that expert's column ``scale`` for an int8 ``w``), summed in f32 and
    returned in ``x``'s dtype. Rows of tiles past ``tiles_used`` are not written (hold
    anything). ``block_n`` / ``block_k``: the widest blocks of 128 lanes up to these that
    divide F / K (the whole dimension where none does). ``interpret``: run in TPU
    interpret mode (CPU). Raises ``ValueError`` for shapes the blocks cannot tile."""
    check_grouped(x, w, tile_expert, tiles_used, scale, block_m)
    if block_m % min_block_m(x.dtype):
        raise ValueError(
            f"block_m: expected a multiple of {min_block_m(x.dtype)} for {x.dtype} rows, "
            f"got {block_m}"
        )
    tiles = tile_expert.shape[0]
    _, K, F = w.shape
    bn, bk = _block(F, block_n), _block(K, block_k)
    steps = K // bk
    scaled = scale is not None

    def live(t, k, used):  # a spare tile: the last used tile's blocks, at the last K step
        last = jnp.maximum(used[0] - 1, 0)
        return jnp.minimum(t, last), jnp.where(t < used[0], k, steps - 1)

    def x_map(n, t, k, te, used):
        return live(t, k, used)

    def w_map(n, t, k, te, used):
        return te[t], live(t, k, used)[1], n

    def o_map(n, t, k, te, used):
        return live(t, k, used)[0], n

    in_specs = [
        pl.BlockSpec((block_m, bk), x_map),
        pl.BlockSpec((pl.Squeezed(), bk, bn), w_map),
    ]
    args = [x, w]
    if scaled:
        in_specs.append(pl.BlockSpec((pl.Squeezed(), 1, bn), lambda n, t, k, te, u: (te[t], 0, n)))
        args.append(scale.astype(jnp.float32)[:, None, :])
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    kernel = functools.partial(_kernel, steps=steps, precision=precision, scaled=scaled)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(F // bn, tiles, steps),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((block_m, bn), o_map),
            scratch_shapes=[pltpu.VMEM((block_m, bn), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((x.shape[0], F), x.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")
        ),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="grouped_matmul_tpu",
    )(tile_expert, tiles_used, *args)
