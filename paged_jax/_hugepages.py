"""Transparent huge pages for a KV pool on CPU (Linux). No effect elsewhere.

A decode step reads the pool's pages in the order of its block tables, so its reads land
all over the pool. With the kernel's 4 KiB pages, a pool of 1 GiB spans 262,144 of them,
far more than the TLB holds, and the hardware prefetchers stop at every 4 KiB boundary.
Backing the pool with 2 MiB pages (transparent huge pages) removes most of that, a few
per cent of a large decode step (docs/DECISIONS.md, "Huge pages for a CPU pool").

Where the kernel's THP mode is ``madvise`` (the default of many distributions), memory
gets huge pages only when asked. XLA allocates and zero-fills the pool before paged-jax
sees it; ``use_huge_pages`` then asks for huge pages and drops the pool's 4 KiB pages
(``MADV_HUGEPAGE``, ``MADV_DONTNEED``), which the kernel hands back zero-filled, as
huge pages, when they are next touched. So it may only be called on memory that holds
zeros, right after it was created. ``PAGED_JAX_HUGE_PAGES=0`` turns it off.

``lazy_zeros`` goes further for a large pool: XLA's zero-fill writes through every page
(4 GiB, the default CPU pool: seconds of the engine's start-up on a 2-core CPU, page
faults mostly), most of which a run never uses. It takes an unwritten buffer from the C
kernels instead and hands its whole pages straight back (``MADV_DONTNEED``), so each
page is mapped, as zeros, when the engine first writes it.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
import sys

import jax

HUGE_PAGE = 2 << 20  # bytes of a transparent huge page on x86-64 and most arm64 kernels
LAZY_ZEROS_MIN_BYTES = 64 << 20  # smaller pools are zero-filled by XLA as before
_MADV_DONTNEED = 4
_PAGE = mmap.PAGESIZE  # the kernel's page size (4 KiB on x86-64)
_MADV_HUGEPAGE = 14
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.cache
def _madvise():
    """libc's ``madvise``, or None (not Linux, or no libc to call)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        f = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    f.restype = ctypes.c_int
    return f


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode: ``"always"``, ``"madvise"`` or
    ``"never"``; None where it cannot be read (not Linux, no THP support)."""
    try:
        with open(_THP_MODE) as f:
            text = f.read()  # e.g. "always [madvise] never"
    except OSError:
        return None
    start = text.find("[")
    end = text.find("]", start + 1)
    return text[start + 1 : end] if 0 <= start < end else None


def _private_anonymous(start: int, stop: int) -> bool:
    """Whether ``[start, stop)`` lies in one private anonymous mapping of this process
    (there ``MADV_DONTNEED`` leaves zeros behind; in a file or shared mapping it would
    not)."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(v, 16) for v in fields[0].split("-"))
            if lo <= start < hi:
                # fields: range, perms, offset, device, inode[, path]
                return (
                    stop <= hi
                    and fields[1].endswith("p")
                    and fields[4] == "0"
                    and (len(fields) == 5)
                )
    return False


def use_huge_pages(zeros: jax.Array) -> int:
    """Backs the memory of ``zeros`` with transparent huge pages; returns the bytes so
    backed (0: none).

    ``zeros``: a CPU ``jax.Array`` (any shape and dtype, sharded or not) that holds only
    zeros and that nothing else reads or writes meanwhile: a pool just created. Its
    values stay zeros. Of each shard's buffer the whole 2 MiB pages inside it are
    backed. Does nothing (returns 0) unless the platform is Linux, the THP mode is
    ``madvise`` (with ``always`` such a buffer gets huge pages anyway, with ``never``
    none can), the buffer lies in a private anonymous mapping, and
    ``PAGED_JAX_HUGE_PAGES`` is not ``0``.
    """
    if not isinstance(zeros, jax.Array) or isinstance(zeros, jax.core.Tracer):
        raise TypeError(f"zeros: expected a concrete jax.Array, got {type(zeros).__name__}")
    if os.environ.get("PAGED_JAX_HUGE_PAGES", "1") == "0":
        return 0
    madvise = _madvise()
    if madvise is None or thp_mode() != "madvise":
        return 0
    zeros.block_until_ready()
    backed = 0
    for shard in zeros.addressable_shards:
        data = shard.data
        if shard.device.platform != "cpu" or not data.nbytes:
            continue
        ptr = data.unsafe_buffer_pointer()
        start = -(-ptr // HUGE_PAGE) * HUGE_PAGE
        stop = (ptr + data.nbytes) // HUGE_PAGE * HUGE_PAGE
        if stop <= start or not _private_anonymous(start, stop):
            continue
        if madvise(start, stop - start, _MADV_HUGEPAGE) == 0:
            if madvise(start, stop - start, _MADV_DONTNEED) == 0:
                backed += stop - start
    return backed


def lazy_zeros(shape: tuple[int, ...], dtype) -> jax.Array | None:
    """A CPU array of zeros of ``shape`` and ``dtype`` whose pages are mapped when first
    touched; None where that cannot be had (the caller then uses ``jnp.zeros``).

    Taken only eagerly (not under a trace), on the CPU backend, on Linux, for at least
    ``LAZY_ZEROS_MIN_BYTES``, where the C kernels are built (``kernels.cpu.uninitialized``
    gives the unwritten buffer). The buffer's whole 4 KiB pages are handed back with
    ``MADV_DONTNEED`` when they lie in one private anonymous mapping (the kernel then maps
    zero pages on first touch), its partial pages at either end are zeroed here; anywhere
    else the whole buffer is zeroed here. Either way every element reads 0."""
    import jax.numpy as jnp

    dtype = jnp.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    madvise = _madvise()
    if madvise is None or nbytes < LAZY_ZEROS_MIN_BYTES or jax.default_backend() != "cpu":
        return None
    from paged_jax.kernels import cpu

    if not cpu.available():
        return None
    x = cpu.uninitialized(shape, dtype)
    if isinstance(x, jax.core.Tracer):
        return None
    x.block_until_ready()
    ptr = x.unsafe_buffer_pointer()
    start = -(-ptr // _PAGE) * _PAGE
    stop = (ptr + nbytes) // _PAGE * _PAGE
    if stop > start and _private_anonymous(start, stop):
        if madvise(start, stop - start, _MADV_DONTNEED) == 0:
            ctypes.memset(ptr, 0, start - ptr)
            ctypes.memset(stop, 0, ptr + nbytes - stop)
            return x
    ctypes.memset(ptr, 0, nbytes)
    return x
