"""Tensor parallelism on a device mesh: the paged cache split along KV heads, and
attention run per shard under ``jax.shard_map``.

A mesh with a ``"tp"`` axis, set with ``jax.set_mesh(mesh)`` around the jitted step,
switches ``paged_self_attention`` to its sharded form: each device writes and attends
with its own query and KV heads (the K and V of a head live on the same device, in the
cache's interleaved ``2K`` axis), while block tables and metadata are replicated (page
ids are global: every device holds its heads of every page). Nothing else in the step
changes: the model's weights carry ``NamedSharding``s (Megatron-style, see
``paged_jax.models.sharding``) and XLA's partitioner inserts the two all-reduces per
layer. No collective touches the cache.

Host code (the block manager, the scheduler) is unchanged.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from paged_jax.cache import PagedKVCache

TENSOR_AXIS = "tp"
_HEADS = P(None, TENSOR_AXIS, None)  # [T, heads, D]
_PAGES = P(None, None, None, TENSOR_AXIS, None)  # [L, N, P, 2K, D]
_SCALES = P(None, None, None, TENSOR_AXIS)  # [L, N, P, 2K]


def tensor_parallel_mesh(size: int, devices=None) -> Mesh:
    """A one-axis mesh (``"tp"``) over the first ``size`` of ``devices`` (default: all)."""
    devices = list(jax.devices() if devices is None else devices)
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= len(devices):
        raise ValueError(
            f"tensor_parallel_size: expected an int in [1, {len(devices)}] (the devices "
            f"available), got {size!r}"
        )
    return Mesh(np.array(devices[:size]), (TENSOR_AXIS,))


def tensor_parallel_size(mesh=None) -> int:
    """The size of the ``"tp"`` axis of ``mesh`` (default: the mesh set with
    ``jax.set_mesh``), 1 without one."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if mesh is None or mesh.empty or TENSOR_AXIS not in mesh.axis_names:
        return 1
    kind = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))[TENSOR_AXIS]
    if kind == jax.sharding.AxisType.Manual:  # inside a shard_map over it: one shard
        return 1
    return int(mesh.shape[TENSOR_AXIS])


def check_divides(num_heads: int, num_kv_heads: int, tp: int) -> None:
    """Raises ValueError naming the numbers unless ``tp`` divides both head counts."""
    if num_kv_heads % tp or num_heads % tp:
        raise ValueError(
            f"tensor_parallel_size: {tp} must divide num_kv_heads={num_kv_heads} and "
            f"num_heads={num_heads} (replicating KV heads when the tensor-parallel size "
            "exceeds them is not built yet)"
        )


def shard_cache(cache: PagedKVCache, mesh: Mesh) -> PagedKVCache:
    """``cache`` placed on ``mesh``, split along KV heads (each device: its heads of every
    page of every layer; ``kv_pages.nbytes / tp`` per device)."""
    tp = tensor_parallel_size(mesh)
    if cache.num_kv_heads % tp:
        raise ValueError(
            f"tensor_parallel_size: {tp} must divide the cache's num_kv_heads={cache.num_kv_heads}"
        )
    pages = jax.device_put(cache.kv_pages, NamedSharding(mesh, _PAGES))
    scales = cache.kv_scales
    if scales is not None:
        scales = jax.device_put(scales, NamedSharding(mesh, _SCALES))
    return dataclasses.replace(cache, kv_pages=pages, kv_scales=scales)


def sharded_attention(attend, q, k, v, cache: PagedKVCache, layer, metadata, tp: int):
    """Runs ``attend(q, k, v, cache, layer, metadata) -> (o, cache)`` per shard of the
    ``"tp"`` axis: q ``[T, H, D]``, k and v ``[T, K, D]`` and the cache split along heads,
    ``layer`` and ``metadata`` replicated. Returns ``(o [T, H, D], cache)`` split the
    same way."""
    check_divides(q.shape[1], cache.num_kv_heads, tp)
    scales_spec = None if cache.kv_scales is None else _SCALES

    def local(q, k, v, pages, scales, layer, md):
        part = dataclasses.replace(
            cache, kv_pages=pages, kv_scales=scales, num_kv_heads=cache.num_kv_heads // tp
        )
        o, part = attend(q, k, v, part, layer, md)
        return o, part.kv_pages, part.kv_scales

    o, pages, scales = jax.shard_map(
        local,
        in_specs=(_HEADS, _HEADS, _HEADS, _PAGES, scales_spec, P(), P()),
        out_specs=(_HEADS, _PAGES, scales_spec),
        check_vma=False,  # the Pallas kernels' outputs carry no varying-axis types
    )(q, k, v, cache.kv_pages, cache.kv_scales, layer, metadata)
    return o, dataclasses.replace(cache, kv_pages=pages, kv_scales=scales)
