"""The KV pool's rows and pages on the CPU (``cache.c``): a step's K/V rows written in
place (``write_rows``), pages copied, written and read (``copy_pages``,
``write_pages``, ``read_pages``), and a pool left as XLA allocated it
(``uninitialized``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .build import (
    PAGES_TARGET,
    UNINITIALIZED_TARGET,
    WRITE_TARGET,
    require,
)


def write_rows(
    pool: jax.Array,  # [L, N, P, R, D] any dtype
    rows: jax.Array,  # [T, R, D] the pool's dtype
    slots: jax.Array,  # i32[T]
    layer: jax.Array | int,  # i32 scalar
) -> jax.Array:  # [L, N, P, R, D]: the pool, rows written
    """The pool with token t's row written to slot ``slots[t]`` of ``layer`` (page ``slot
    // P``, row ``slot % P``), by ``cache.c``: the result aliases the pool (under donation
    the step writes T rows and nothing else moves); slots outside ``[0, N * P)`` are
    dropped; of two tokens with one slot the later stays. For the 8- and 16-bit pools,
    which XLA:CPU's scatter widens to f32 and back whole. Raises ``ValueError`` for
    mismatched shapes or dtypes, and when the kernels are not available here."""
    require()
    if pool.ndim != 5 or rows.ndim != 3 or rows.shape[1:] != pool.shape[3:]:
        raise ValueError(
            f"rows: expected [T, {pool.shape[3:]}] rows of a [L, N, P, R, D] pool, got "
            f"{list(rows.shape)} and {list(pool.shape)}"
        )
    if rows.dtype != pool.dtype:
        raise ValueError(f"rows: expected the pool's dtype {pool.dtype}, got {rows.dtype}")
    if slots.shape != rows.shape[:1] or slots.dtype != jnp.int32:
        raise ValueError(
            f"slots: expected int32[{rows.shape[0]}], got {slots.dtype}{list(slots.shape)}"
        )
    params = jnp.stack([jnp.asarray(layer, jnp.int32), jnp.int32(pool.dtype.itemsize)])
    call = jax.ffi.ffi_call(
        WRITE_TARGET, jax.ShapeDtypeStruct(pool.shape, pool.dtype), input_output_aliases={0: 0}
    )
    return call(pool, rows, slots, params)


def _page_ids(name: str, ids: jax.Array) -> jax.Array:
    if ids.ndim != 1 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"{name}: expected int32[n] page ids, got {ids.dtype}{list(ids.shape)}")
    return ids.astype(jnp.int32)


def copy_pages(pool: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    """``pool`` (``[L, N, P, R, D]``, any dtype) with page ``src[i]`` copied to ``dst[i]`` in
    every layer, all reads before all writes, by ``cache.c`` (the result aliases the
    pool); a ``dst`` outside ``[0, N)`` is not written, a ``src`` outside it reads page 0.
    Raises ``ValueError`` for mismatched shapes, and when the kernels are not built."""
    require()
    src, dst = _page_ids("src", src), _page_ids("dst", dst)
    if src.shape != dst.shape or pool.ndim != 5:
        raise ValueError(f"dst: expected {list(src.shape)} ids (as src), got {list(dst.shape)}")
    params = jnp.asarray([0, pool.dtype.itemsize], jnp.int32)
    call = jax.ffi.ffi_call(
        PAGES_TARGET, jax.ShapeDtypeStruct(pool.shape, pool.dtype), input_output_aliases={0: 0}
    )
    return call(pool, src, dst, params)


def write_pages(pool: jax.Array, data: jax.Array, dst: jax.Array) -> jax.Array:
    """``pool`` (``[L, N, P, R, D]``) with ``data[:, i]`` (``[L, n, P, R, D]``, the pool's
    dtype) in page ``dst[i]`` of every layer, by ``cache.c`` (aliased; a ``dst`` outside
    ``[0, N)`` is not written). Raises ``ValueError`` for mismatched shapes or dtypes."""
    require()
    dst = _page_ids("dst", dst)
    want = (pool.shape[0], dst.shape[0], *pool.shape[2:])
    if pool.ndim != 5 or data.shape != want or data.dtype != pool.dtype:
        raise ValueError(
            f"data: expected {pool.dtype}{list(want)}, got {data.dtype}{list(data.shape)}"
        )
    params = jnp.asarray([1, pool.dtype.itemsize], jnp.int32)
    call = jax.ffi.ffi_call(
        PAGES_TARGET, jax.ShapeDtypeStruct(pool.shape, pool.dtype), input_output_aliases={0: 0}
    )
    return call(pool, data, dst, params)


def read_pages(pool: jax.Array, src: jax.Array) -> jax.Array:
    """Page ``src[i]`` of every layer of ``pool`` (``[L, N, P, R, D]``): ``[L, n, P, R, D]``,
    by ``cache.c``; a ``src`` outside ``[0, N)`` reads page 0."""
    require()
    src = _page_ids("src", src)
    if pool.ndim != 5:
        raise ValueError(f"pool: expected [L, N, P, R, D], got {list(pool.shape)}")
    params = jnp.asarray([2, pool.dtype.itemsize], jnp.int32)
    shape = (pool.shape[0], src.shape[0], *pool.shape[2:])
    return jax.ffi.ffi_call(PAGES_TARGET, jax.ShapeDtypeStruct(shape, pool.dtype))(
        pool, src, params
    )


def uninitialized(shape: tuple[int, ...], dtype) -> jax.Array:
    """An array of ``shape`` and ``dtype`` whose contents are whatever its freshly
    allocated memory held: nothing writes it. For a caller that fills it at once (the KV
    pool: ``paged_jax._hugepages.lazy_zeros``). Under a trace, a tracer. Raises
    ``ValueError`` when the kernels are not available here."""
    require()
    return jax.ffi.ffi_call(UNINITIALIZED_TARGET, jax.ShapeDtypeStruct(tuple(shape), dtype))()
