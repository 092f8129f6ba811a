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
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from paged_jax.cache import PagedKVCache

TENSOR_AXIS = "tp"
_HEADS = P(None, TENSOR_AXIS, None)  # [T, heads, D]
_PAGES = P(None, None, None, TENSOR_AXIS, None)  # [L, N, P, 2K, D]
_SCALES = P(None, None, None, TENSOR_AXIS)  # [L, N, P, 2K]


def tensor_parallel_mesh(size: int, devices=None) -> Mesh:
    """A one-axis mesh (``"tp"``) over the first ``size`` of ``devices`` (default: all
    devices of every process, ``jax.devices()``)."""
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


def kv_head_replicas(num_kv_heads: int, tp: int) -> int:
    """How many copies of each KV head the cache holds at tensor-parallel size ``tp``:
    1 when ``tp`` divides the KV heads, else ``tp // num_kv_heads`` (each device then
    holds one copy of the head its query heads read, as vLLM does)."""
    return 1 if num_kv_heads % tp == 0 else tp // num_kv_heads


def check_divides(num_heads: int, num_kv_heads: int, tp: int) -> None:
    """Raises ValueError naming the numbers unless ``tp`` divides the query heads and
    either divides the KV heads or is a multiple of them (KV heads replicated)."""
    if num_heads % tp or (num_kv_heads % tp and tp % num_kv_heads):
        raise ValueError(
            f"tensor_parallel_size: {tp} must divide num_heads={num_heads}, and divide "
            f"num_kv_heads={num_kv_heads} or be a multiple of it"
        )


def replicate_kv_heads(cache: PagedKVCache, replicas: int) -> PagedKVCache:
    """``cache`` with each KV head repeated ``replicas`` times in a row (K and V of a copy
    stay interleaved): ``[L, N, P, 2K, D]`` -> ``[L, N, P, 2K * replicas, D]``."""
    if replicas == 1:
        return cache

    def repeat(x, per_head):  # [L, N, P, 2K(, D)]: heads of `per_head` entries each
        shape = x.shape
        x = x.reshape(*shape[:3], cache.num_kv_heads, per_head, *shape[4:])
        x = jnp.repeat(x, replicas, axis=3)
        return x.reshape(*shape[:3], shape[3] * replicas, *shape[4:])

    scales = None if cache.kv_scales is None else repeat(cache.kv_scales, 2)
    return dataclasses.replace(
        cache,
        kv_pages=repeat(cache.kv_pages, 2),
        kv_scales=scales,
        num_kv_heads=cache.num_kv_heads * replicas,
    )


def cache_shardings(cache: PagedKVCache, mesh: Mesh) -> PagedKVCache:
    """The ``NamedSharding`` of each array of ``cache`` on ``mesh`` (split along KV
    heads), as a ``PagedKVCache`` of shardings (for ``jax.jit``'s ``out_shardings``)."""
    scales = None if cache.kv_scales is None else NamedSharding(mesh, _SCALES)
    return dataclasses.replace(cache, kv_pages=NamedSharding(mesh, _PAGES), kv_scales=scales)


def shard_cache(cache: PagedKVCache, mesh: Mesh) -> PagedKVCache:
    """``cache`` placed on ``mesh``, split along KV heads (each device: its heads of every
    page of every layer; ``kv_pages.nbytes / tp`` per device). When the tensor-parallel
    size exceeds the KV heads, each head is first repeated (``kv_head_replicas``)."""
    tp = tensor_parallel_size(mesh)
    if cache.num_kv_heads % tp and tp % cache.num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size: {tp} must divide the cache's num_kv_heads="
            f"{cache.num_kv_heads} or be a multiple of it"
        )
    cache = replicate_kv_heads(cache, kv_head_replicas(cache.num_kv_heads, tp))
    return jax.device_put(cache, cache_shardings(cache, mesh))


def create_cache(make: Callable[[], PagedKVCache], mesh: Mesh) -> PagedKVCache:
    """The cache ``make()`` builds, created directly in its shards on ``mesh`` (no device
    ever holds the whole pool), KV heads repeated as ``shard_cache`` does."""
    tp = tensor_parallel_size(mesh)

    def build():
        cache = make()
        return replicate_kv_heads(cache, kv_head_replicas(cache.num_kv_heads, tp))

    return jax.jit(build, out_shardings=cache_shardings(jax.eval_shape(build), mesh))()


def sharded_attention(attend, q, k, v, cache: PagedKVCache, layer, metadata, tp: int):
    """Runs ``attend(q, k, v, cache, layer, metadata) -> (o, cache)`` per shard of the
    ``"tp"`` axis: q ``[T, H, D]``, k and v ``[T, K, D]`` and the cache split along heads,
    ``layer`` and ``metadata`` replicated. A cache with more KV heads than ``k``
    (``replicate_kv_heads``) gets each of ``k``'s and ``v``'s heads repeated to match.
    Returns ``(o [T, H, D], cache)`` split the same way."""
    check_divides(q.shape[1], k.shape[1], tp)
    if cache.num_kv_heads != k.shape[1]:  # KV heads replicated: one copy per device
        replicas = cache.num_kv_heads // k.shape[1]
        k, v = jnp.repeat(k, replicas, axis=1), jnp.repeat(v, replicas, axis=1)
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
