"""Tensor and data parallelism on a device mesh: the paged cache split along KV heads
(``"tp"``) and into one pool per replica (``"dp"``), attention run per shard under
``jax.shard_map``.

A mesh with a ``"tp"`` axis, set with ``jax.set_mesh(mesh)`` around the jitted step,
switches ``paged_self_attention`` to its sharded form: each device writes and attends
with its own query and KV heads (the K and V of a head live on the same device, in the
cache's interleaved ``2K`` axis), while block tables and metadata are replicated (page
ids are global: every device holds its heads of every page). Nothing else in the step
changes: the model's weights carry ``NamedSharding``s (Megatron-style, see
``paged_jax.models.sharding``) and XLA's partitioner inserts the two all-reduces per
layer. No collective touches the cache.

Host code (the block manager, the scheduler) is unchanged.

A ``"dp"`` axis adds data parallelism: the pool's page axis is split into one pool per
replica, each with its own block manager and scheduler on the host and page ids local to
it (page 0 of every replica is its null page). A step's arrays are the replicas'
batches, each padded to the same shapes and concatenated (``paged_jax.concat_batches``):
token rows, sequence rows and copy lists split evenly along ``"dp"``. Row-wise work (the
projections, the MLP, sampling) needs no communication; attention, cache writes and
copy-on-write copies run per replica on its own pages. ``logits_indices`` are global
rows, so a model's ``x[metadata.logits_indices]`` needs no change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from paged_jax._hugepages import use_huge_pages
from paged_jax.cache import PagedKVCache

TENSOR_AXIS = "tp"
DATA_AXIS = "dp"


def _specs(dp: str | None) -> tuple[P, P, P]:
    """PartitionSpecs of q/k/v ``[T, heads, D]``, kv_pages ``[L, N, P, 2K, D]`` and
    kv_scales ``[L, N, P, 2K]``; ``dp``: the data-parallel axis, if the mesh has one."""
    return (
        P(dp, TENSOR_AXIS, None),
        P(None, dp, None, TENSOR_AXIS, None),
        P(None, dp, None, TENSOR_AXIS),
    )


def _data_axis(mesh) -> str | None:
    return DATA_AXIS if DATA_AXIS in mesh.axis_names else None


def tensor_parallel_mesh(size: int, devices=None) -> Mesh:
    """The mesh of tensor-parallel size ``size`` over the first ``size`` of ``devices``
    (default: all devices of every process, ``jax.devices()``): ``parallel_mesh(size)``,
    whose ``"dp"`` axis has size 1, so it equals the mesh ``LLM(tensor_parallel_size=
    size)`` builds."""
    return parallel_mesh(size, 1, devices)


def parallel_mesh(tensor_parallel_size: int = 1, data_parallel_size: int = 1, devices=None):
    """A ``("dp", "tp")`` mesh over the first ``dp * tp`` of ``devices`` (default: all
    devices of every process, ``jax.devices()``): ``data_parallel_size`` replicas, each
    split over ``tensor_parallel_size`` consecutive devices."""
    devices = list(jax.devices() if devices is None else devices)
    for name, v in (
        ("tensor_parallel_size", tensor_parallel_size),
        ("data_parallel_size", data_parallel_size),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= len(devices):
            raise ValueError(
                f"{name}: expected an int in [1, {len(devices)}] (the devices available), got {v!r}"
            )
    n = tensor_parallel_size * data_parallel_size
    if n > len(devices):
        raise ValueError(
            f"data_parallel_size x tensor_parallel_size: {data_parallel_size} x "
            f"{tensor_parallel_size} = {n} devices, {len(devices)} are available"
        )
    grid = np.array(devices[:n]).reshape(data_parallel_size, tensor_parallel_size)
    return Mesh(grid, (DATA_AXIS, TENSOR_AXIS))


def _axis_size(axis: str, mesh) -> int:
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if mesh is None or mesh.empty or axis not in mesh.axis_names:
        return 1
    kind = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))[axis]
    if kind == jax.sharding.AxisType.Manual:  # inside a shard_map over it: one shard
        return 1
    return int(mesh.shape[axis])


def tensor_parallel_size(mesh=None) -> int:
    """The size of the ``"tp"`` axis of ``mesh`` (default: the mesh set with
    ``jax.set_mesh``), 1 without one."""
    return _axis_size(TENSOR_AXIS, mesh)


def data_parallel_size(mesh=None) -> int:
    """The size of the ``"dp"`` axis of ``mesh`` (default: the mesh set with
    ``jax.set_mesh``), 1 without one."""
    return _axis_size(DATA_AXIS, mesh)


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
    """The ``NamedSharding`` of each array of ``cache`` on ``mesh`` (split along KV heads,
    and along pages into one pool per replica when the mesh has a ``"dp"`` axis), as a
    ``PagedKVCache`` of shardings (for ``jax.jit``'s ``out_shardings``)."""
    _, pages, scales = _specs(_data_axis(mesh))
    scales = None if cache.kv_scales is None else NamedSharding(mesh, scales)
    return dataclasses.replace(cache, kv_pages=NamedSharding(mesh, pages), kv_scales=scales)


def shard_cache(cache: PagedKVCache, mesh: Mesh) -> PagedKVCache:
    """``cache`` placed on ``mesh``, split along KV heads (each device: its heads of every
    page of every layer; ``kv_pages.nbytes / tp`` per device) and, on a ``"dp"`` axis,
    along pages (replica r: pages ``[r * N / dp, (r + 1) * N / dp)``). When the
    tensor-parallel size exceeds the KV heads, each head is first repeated
    (``kv_head_replicas``)."""
    tp = tensor_parallel_size(mesh)
    _check_pages(cache.num_pages, data_parallel_size(mesh))
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

    _check_pages(jax.eval_shape(make).num_pages, data_parallel_size(mesh))
    cache = jax.jit(build, out_shardings=cache_shardings(jax.eval_shape(build), mesh))()
    use_huge_pages(cache.kv_pages)  # on CPU devices: 2 MiB pages for each shard
    return cache


def _check_pages(num_pages: int, dp: int) -> None:
    if num_pages % dp:
        raise ValueError(
            f"num_pages: {num_pages} pages do not split into data_parallel_size={dp} equal pools"
        )


def sharded_attention(attend, q, k, v, cache: PagedKVCache, layer, metadata, tp: int, sinks=None):
    """Runs ``attend(q, k, v, cache, layer, metadata, sinks) -> (o, cache)`` per shard of the
    mesh set with ``jax.set_mesh``: q ``[T, H, D]``, k and v ``[T, K, D]`` and the cache
    split along heads (``"tp"``); on a ``"dp"`` axis also the token rows, the cache's
    pages and every metadata array along its first axis (each replica's batch, page ids
    local to its pool), else ``metadata`` replicated; ``layer`` replicated. A cache with
    more KV heads than ``k`` (``replicate_kv_heads``) gets each of ``k``'s and ``v``'s
    heads repeated to match. ``sinks`` (``f32[H]`` or None) split along heads as q is.
    Returns ``(o [T, H, D], cache)`` split the same way."""
    check_divides(q.shape[1], k.shape[1], tp)
    if cache.num_kv_heads != k.shape[1]:  # KV heads replicated: one copy per device
        replicas = cache.num_kv_heads // k.shape[1]
        k, v = jnp.repeat(k, replicas, axis=1), jnp.repeat(v, replicas, axis=1)
    dp = _data_axis(jax.sharding.get_abstract_mesh())
    heads, pages_spec, scales_spec = _specs(dp)
    scales_spec = None if cache.kv_scales is None else scales_spec

    def local(q, k, v, pages, scales, layer, md, sinks):
        part = dataclasses.replace(
            cache, kv_pages=pages, kv_scales=scales, num_kv_heads=cache.num_kv_heads // tp
        )
        o, part = attend(q, k, v, part, layer, md, sinks)
        return o, part.kv_pages, part.kv_scales

    sinks_spec = None if sinks is None else P(TENSOR_AXIS)
    o, pages, scales = jax.shard_map(
        local,
        in_specs=(heads, heads, heads, pages_spec, scales_spec, P(), P(dp), sinks_spec),
        out_specs=(heads, pages_spec, scales_spec),
        check_vma=False,  # the Pallas kernels' outputs carry no varying-axis types
    )(q, k, v, cache.kv_pages, cache.kv_scales, layer, metadata, sinks)
    return o, dataclasses.replace(cache, kv_pages=pages, kv_scales=scales)


def per_replica(fn, cache: PagedKVCache, *args):
    """``fn(cache, *args)`` on each replica's pool when the mesh set with ``jax.set_mesh``
    has a ``"dp"`` axis (else called as it is): the cache split as ``cache_shardings``
    says; each of ``args`` is page ids ``i32[n]`` (split along ``n``: replica r's ids,
    local to its pool, one after the other), page contents ``[L, n, P, 2K(, D)]`` (split
    along ``n`` and heads) or None. ``fn`` returns a ``PagedKVCache`` (split the same
    way) or page contents."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or DATA_AXIS not in mesh.axis_names:
        return fn(cache, *args)
    _, pages_spec, scales_spec = _specs(DATA_AXIS)
    scales_spec = None if cache.kv_scales is None else scales_spec
    out_cache = isinstance(jax.eval_shape(fn, cache, *args), PagedKVCache)
    kv_heads = cache.num_kv_heads // tensor_parallel_size(mesh)

    def local(pages, scales, *args):
        out = fn(
            dataclasses.replace(cache, kv_pages=pages, kv_scales=scales, num_kv_heads=kv_heads),
            *args,
        )
        return (out.kv_pages, out.kv_scales) if out_cache else out

    rows = P(None, DATA_AXIS, None, TENSOR_AXIS)  # [L, n, P, 2K(, D)]: page contents
    specs = tuple(None if a is None else P(DATA_AXIS) if a.ndim == 1 else rows for a in args)
    out = jax.shard_map(
        local,
        in_specs=(pages_spec, scales_spec) + specs,
        out_specs=(pages_spec, scales_spec) if out_cache else rows,
        check_vma=False,
    )(cache.kv_pages, cache.kv_scales, *args)
    if out_cache:
        return dataclasses.replace(cache, kv_pages=out[0], kv_scales=out[1])
    return out
