"""Writes a step's new K/V rows into the paged pool by slot mapping, in place (TPU).

Grid over blocks of ``tokens_per_block`` tokens. The slot mapping and the layer reach the
kernel by scalar prefetch; the new rows arrive in VMEM blocks; the pool stays in HBM and
is aliased input to output, so the call moves T rows, never the pool. Each row is one DMA
to ``pool[layer, slot // P, slot % P]``; slots outside ``[0, N * P)`` are dropped (as in
``PagedKVCache.write``'s XLA scatter). Works for any row shape: ``[2K, D]`` K/V rows and
``[2K]`` scale rows of int8/fp8 caches alike.

Status: verified in TPU interpret mode on CPU only (no TPU was available to this work).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def _kernel(
    slots_ref,
    layer_ref,
    rows_ref,
    pool_in,
    pool_out,
    sems,
    *,
    tokens_per_block,
    page_size,
    num_slots,
):
    del pool_in  # the same buffer as pool_out
    first = pl.program_id(0) * tokens_per_block
    layer = layer_ref[0]
    copies = []
    for i in range(tokens_per_block):
        slot = slots_ref[first + i]
        ok = (slot >= 0) & (slot < num_slots)
        safe = jnp.where(ok, slot, 0)
        copy = pltpu.make_async_copy(
            rows_ref.at[i], pool_out.at[layer, safe // page_size, safe % page_size], sems.at[0]
        )
        pl.when(ok)(copy.start)
        copies.append((ok, copy))
    for ok, copy in copies:
        pl.when(ok)(copy.wait)


@functools.partial(jax.jit, static_argnames=("tokens_per_block", "interpret"), donate_argnums=(0,))
def write_rows(
    pool: jax.Array,  # [L, N, P, *row]
    rows: jax.Array,  # [T, *row]
    slot_mapping: jax.Array,  # i32[T]
    layer: jax.Array | int,  # i32 scalar
    *,
    tokens_per_block: int = 8,
    interpret: bool = False,
) -> jax.Array:  # [L, N, P, *row], the same buffer (donated)
    """``pool[layer, s // P, s % P] = rows[t]`` for every token t with slot s in range.
    An f16 pool moves as the same bits typed bf16 (Mosaic takes no f16 argument; the
    kernel only copies)."""
    if pool.dtype == jnp.float16:
        bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.bfloat16)  # noqa: E731
        out = write_rows(
            bits(pool),
            bits(rows.astype(jnp.float16)),
            slot_mapping,
            layer,
            tokens_per_block=tokens_per_block,
            interpret=interpret,
        )
        return jax.lax.bitcast_convert_type(out, jnp.float16)
    L, N, P = pool.shape[:3]
    T = rows.shape[0]
    bt = tokens_per_block
    T_pad = pl.cdiv(max(T, 1), bt) * bt
    slots = jnp.pad(slot_mapping.astype(jnp.int32), (0, T_pad - T), constant_values=-1)
    rows = jnp.pad(rows.astype(pool.dtype), [(0, T_pad - T)] + [(0, 0)] * (rows.ndim - 1))
    kernel = functools.partial(_kernel, tokens_per_block=bt, page_size=P, num_slots=N * P)
    row_block = (bt,) + rows.shape[1:]
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(T_pad // bt,),
            in_specs=[
                pl.BlockSpec(row_block, lambda i, *_: (i,) + (0,) * (len(row_block) - 1)),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.SemaphoreType.DMA((1,))],
        ),
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        input_output_aliases={3: 0},  # (slots, layer, rows, pool): the pool is written in place
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="paged_kv_write_tpu",
    )(slots, jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), rows, pool)
