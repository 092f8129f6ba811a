"""Where the engine's model and pool live: the mesh from the engine's arguments
(``resolve_mesh``), a model held the way its device reads it fastest
(``hold_for_device``), and how many pages the memory at hand holds (``pool_pages``)."""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from paged_jax.sharding import DATA_AXIS, TENSOR_AXIS, parallel_mesh


def _auto_axes(mesh: Mesh) -> Mesh:
    """``mesh`` with every axis of type ``Auto`` (the same devices and names): the
    engine's steps leave shardings to XLA's propagation, which an ``Explicit`` axis (what
    ``jax.make_mesh`` gives by default) refuses for the embedding's gather, so every
    request failed at its first step."""
    types = getattr(mesh, "axis_types", None)
    auto = jax.sharding.AxisType.Auto
    if types is None or all(t == auto for t in types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(auto,) * len(mesh.axis_names))


def resolve_mesh(tensor_parallel_size: Any, data_parallel_size: Any, mesh: Any) -> Mesh | None:
    """The engine's mesh from its arguments (None: one device), checked."""
    sizes = {TENSOR_AXIS: tensor_parallel_size, DATA_AXIS: data_parallel_size}
    names = {TENSOR_AXIS: "tensor_parallel_size", DATA_AXIS: "data_parallel_size"}
    if mesh is not None:
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
        if not set(sizes) & set(mesh.axis_names):
            raise ValueError(
                f"mesh: expected an axis named {TENSOR_AXIS!r} or {DATA_AXIS!r}, got "
                f"{mesh.axis_names}"
            )
        others = {a: n for a, n in mesh.shape.items() if a not in sizes and n != 1}
        if others:
            raise ValueError(
                f"mesh: axes other than {TENSOR_AXIS!r} and {DATA_AXIS!r} must have size 1, "
                f"got {others}"
            )
        for axis, size in sizes.items():
            if size not in (None, mesh.shape.get(axis, 1)):
                raise ValueError(
                    f"{names[axis]}: {size!r} differs from the mesh's {axis!r} axis, "
                    f"{mesh.shape.get(axis, 1)}"
                )
        mesh = _auto_axes(mesh)
    elif tensor_parallel_size is None and data_parallel_size is None:
        return None
    else:
        tp = 1 if tensor_parallel_size is None else tensor_parallel_size
        dp = 1 if data_parallel_size is None else data_parallel_size
        mesh = parallel_mesh(tp, dp)  # checks the numbers
        if tp * dp == 1:
            return None
    processes = {d.process_index for d in mesh.devices.flat}
    if len(processes) < jax.process_count():
        raise ValueError(
            f"mesh: it spans the devices of {len(processes)} of the {jax.process_count()} "
            f"processes; every process must own some of its devices"
        )
    return mesh


def _on_cpu(model: Any) -> bool:
    """Whether every array of ``model`` lives on CPU devices."""
    from flax import nnx

    arrays = jax.tree.leaves(nnx.state(model))
    return bool(arrays) and all(
        all(d.platform == "cpu" for d in getattr(a, "devices", lambda: ())()) for a in arrays
    )


def hold_for_device(model: Any) -> Any:
    """``model`` (one device's, off a mesh) with its weights held the way its device
    reads them fastest, as the engine holds the model it is given: ``hold_for_cpu`` on a
    CPU (packed for the C kernels where they built, else XLA:CPU's fastest layouts),
    ``hold_for_accelerator`` elsewhere (each weight read where it lies, once per step, no
    copies out of a stack); a model with neither as it is."""
    if _on_cpu(model):
        return model.hold_for_cpu() if hasattr(model, "hold_for_cpu") else model
    return model.hold_for_accelerator() if hasattr(model, "hold_for_accelerator") else model


def _on_mesh(model: Any, mesh: Mesh) -> bool:
    """Whether every array of ``model`` already lives on ``mesh``."""
    from flax import nnx

    arrays = jax.tree.leaves(nnx.state(model))
    return all(
        isinstance(getattr(a, "sharding", None), NamedSharding) and a.sharding.mesh == mesh
        for a in arrays
    )


def mesh_context(mesh: Mesh | None):
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def _free_memory() -> tuple[int | None, str]:
    """Bytes this process's first device can still allocate (None if unknown), and its
    name."""
    dev = jax.local_devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0), dev.device_kind
    try:  # CPU: the host's available memory (Linux)
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "this machine"
    except OSError:
        pass
    return None, "this machine"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


CPU_KV_CACHE_MAX_BYTES = 4 * 2**30


def _default_budget(most_useful: int) -> int:
    """Bytes of KV cache when none is asked for: at most ``most_useful`` (every sequence
    of a full batch at the model's longest context), and on an accelerator half its free
    memory; on CPU a quarter of the machine's available memory, at most 4 GiB
    (``CPU_KV_CACHE_MAX_BYTES``; vLLM's CPU engine also defaults to 4 GiB), 256 MiB if
    the available memory is unknown."""
    free, _ = _free_memory()
    if jax.default_backend() != "cpu":
        cap = int(0.5 * free) if free is not None else 256 * 2**20
    elif free is not None:
        cap = min(CPU_KV_CACHE_MAX_BYTES, free // 4)
    else:
        cap = 256 * 2**20
    return min(cap, most_useful)


def pool_pages(
    num_pages: int | None,
    kv_cache_bytes: int | None,
    *,
    page_size: int,
    token_bytes: int,
    pages_per_seq: int,
    max_num_seqs: int,
    tp: int,
    dp: int,
) -> tuple[int, int]:
    """``(pages, bytes per device)`` of a pool: ``num_pages`` checked (at least two a
    data-parallel replica, a multiple of ``dp``), or when None as many as
    ``kv_cache_bytes`` hold (default: what ``max_num_seqs`` sequences of
    ``pages_per_seq`` pages could use, at most ``_default_budget``); every process takes
    process 0's count. ``token_bytes``: a token's K/V across the mesh. ``ValueError``
    naming ``num_pages`` where the memory at hand cannot hold them."""
    # the devices whose memory holds the pool (fake CPU devices share the host's)
    spread = tp * dp if jax.default_backend() != "cpu" else 1
    if num_pages is None:
        per_page = page_size * token_bytes
        most_useful = dp * (max_num_seqs * pages_per_seq + 1) * per_page
        budget = kv_cache_bytes or spread * _default_budget(most_useful // spread)
        num_pages = max(2, budget // per_page // dp) * dp
        if jax.process_count() > 1:  # free memory differs: every process takes 0's
            from jax.experimental import multihost_utils

            num_pages = int(multihost_utils.broadcast_one_to_all(np.int64(num_pages)))
    elif (
        isinstance(num_pages, bool)
        or not isinstance(num_pages, int)
        or num_pages < 2 * dp
        or num_pages % dp
    ):
        each = (
            f", a multiple of data_parallel_size={dp} (each replica's pool has its own)"
            if dp > 1
            else ""
        )
        raise ValueError(
            f"num_pages: expected an int >= {2 * dp} (page 0 is null){each}, got {num_pages!r}"
        )
    need = num_pages * page_size * token_bytes // spread
    free, where = _free_memory()
    if free is not None and need > free:
        raise ValueError(
            f"num_pages: {num_pages} pages of {page_size} tokens need {_gib(need)} of KV "
            f"cache, {where} has {_gib(free)} free; lower num_pages or kv_cache_bytes"
        )
    return num_pages, need


def where_allocated() -> str:
    """Where a pool is allocated, in words (for an error)."""
    return _free_memory()[1]
