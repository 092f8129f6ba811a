"""Host memory while a checkpoint loads: arrays made once in buffers JAX takes without a
copy (``_aligned``), a parameter's layers stacked into one as they are dropped
(``_gather``), and the C heap's freed pages handed back (``release_freed_memory``). No
JAX."""

from __future__ import annotations

import functools

import numpy as np


def release_freed_memory() -> None:
    """Hands the C heap's free pages back to the system (glibc's ``malloc_trim``; nothing
    elsewhere). Per-layer tensors are small enough for the heap, and the heap keeps
    what they freed: loading SmolLM2 in f32 peaked 1.0 GB above the process's start and
    kept 440 MB of freed pages after it, for 538 MB of weights."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


def _gather(names, take, stacked: bool, dtype=None) -> tuple[np.ndarray, ...]:
    """The arrays a parameter is made of: ``take(name, transposed)`` gives a tuple of
    arrays for each of ``names`` (``(name, transposed)`` pairs, one a layer if
    ``stacked``); each position's are stacked ``[L, ...]`` into an array made once
    (``dtype``: cast as they are copied in; default each part's), every layer's dropped
    as soon as it is copied, so a load holds a parameter's layers once and one layer
    twice, not all of them twice. Unstacked, the one entry's arrays. Either way in new
    64-byte aligned buffers of their own (``_aligned``), which ``jax.device_put`` hands
    to JAX on a CPU without a copy (a view would keep a file's map or a larger array
    alive)."""
    out = None
    for i, (name, transposed) in enumerate(names):
        parts = take(name, transposed)
        if out is None:
            lead = (len(names),) if stacked else ()
            out = tuple(_aligned((*lead, *x.shape), dtype or x.dtype) for x in parts)
        for o, x in zip(out, parts, strict=True):
            if stacked:
                o[i] = x
            else:
                o[...] = x
        del parts
    return out


def _aligned(shape: tuple, dtype) -> np.ndarray:
    """An uninitialized C-ordered array whose data starts on a 64-byte boundary: JAX's
    CPU client then takes it as a buffer without copying (``jax.device_put``; it copies
    arrays aligned otherwise, as numpy's large ones, 16 bytes past a page, are), so a
    load's weights are not held twice while they move (``jnp.asarray`` made two copies:
    255 MB of RSS for a 128 MB array). The array is handed over: it must not be written
    afterwards. (``jax.dlpack.from_dlpack`` aliases too, but 2 of 6 processes that
    loaded SmolLM2 so hung at exit, in the CPU client's destructor.)"""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(size + 64, np.uint8)
    at = -raw.ctypes.data % 64
    return raw[at : at + size].view(dtype).reshape(shape)
