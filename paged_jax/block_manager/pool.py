"""``PagePool``: the device pool's pages and what holds them. A page is *free* (refcount
0, holding nothing reusable), *in use* (refcount = block-table references), or *cached*
(refcount 0 but a full page of a known prefix, reusable by a prefix hit until evicted,
least recently used first, when no free page is left). The pool also queues the
copy-on-write copies of a step and keeps the pages a pending copy still reads until the
step boundary. The ``BlockManager``'s part; no JAX."""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque

import numpy as np

from .prefix import PrefixCache


class PagePool:
    """Pages ``1 .. num_pages - 1`` of a pool (page 0, the null page, is never handed
    out), their reference counts, the free stack (``pop()`` takes the lowest id first on
    a fresh pool, then the most recently freed page), the cached pages nobody holds
    (``evictable``, least recently used first; ``prefix`` says which pages are cached),
    and the step's pending copies."""

    def __init__(self, num_pages: int, prefix: PrefixCache):
        self.num_pages = num_pages
        self.prefix = prefix
        self.refcount = [0] * num_pages
        self.free = list(range(num_pages - 1, 0, -1))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # refcount-0 cached, LRU first
        self.pending: dict[int, int] = {}  # copy-on-write: dst page -> src page
        self.pending_src: dict[int, int] = {}  # src page -> number of pending copies from it
        # Pages released while a pending copy still reads them: reused only after the
        # step boundary, so nothing (a swap-in, the step's writes) overwrites them first.
        self.deferred: list[int] = []

    @property
    def num_free(self) -> int:
        """Pages that can be handed out now: free plus evictable cached pages."""
        return len(self.free) + len(self.evictable)

    def take(self) -> int:
        """A page for a new use (refcount 1): a free one, else the least recently used
        cached one, evicted."""
        if self.free:
            page = self.free.pop()
        else:
            page, _ = self.evictable.popitem(last=False)  # least recently used
            self.prefix.forget(page)
        self.refcount[page] = 1
        return page

    def take_many(self, total: int) -> list[int]:
        """``total`` pages, as ``total`` calls of ``take`` would give them (from the free
        stack in one slice when it holds enough)."""
        free = self.free
        if len(free) < total:  # the prefix cache gives up pages too
            return [self.take() for _ in range(total)]
        taken = free[: -total - 1 : -1]
        del free[-total:]
        # refcount[page] = 1 for each, the loop run in C (deque drops the Nones)
        deque(map(self.refcount.__setitem__, taken, itertools.repeat(1)), maxlen=0)
        return taken

    def ref(self, page: int) -> None:
        """One more reference to ``page`` (a cached page nobody held comes back)."""
        if self.refcount[page] == 0:
            del self.evictable[page]
        self.refcount[page] += 1

    def unref(self, page: int) -> None:
        """One reference to ``page`` less; at none it is released (after the step, if a
        pending copy still reads it)."""
        rc = self.refcount[page] - 1
        self.refcount[page] = rc
        if rc:
            return
        src = self.pending.pop(page, None)  # a copy into a page nobody holds is moot
        if src is not None:
            self._drop_pending_src(src)
        if page in self.pending_src:
            self.deferred.append(page)
        else:
            self._release(page)

    def copy_on_write(self, old: int) -> int:
        """A private copy of shared page ``old`` for one of its holders: a new page, the
        copy queued for the step (``take_copies``), ``old`` unreferenced."""
        new = self.take()
        # `old` holds only K/V of earlier steps: fork refuses parents with unwritten
        # K/V, so a page written this step is never shared, and copies never chain.
        self.pending[new] = old
        self.pending_src[old] = self.pending_src.get(old, 0) + 1
        self.unref(old)
        return new

    def take_copies(self) -> tuple[np.ndarray, np.ndarray]:
        """The copies queued since the last call, ``(src i32[n], dst i32[n])``; the pages
        they read are released if nobody holds them (a step boundary)."""
        src = np.fromiter(self.pending.values(), np.int32, len(self.pending))
        dst = np.fromiter(self.pending.keys(), np.int32, len(self.pending))
        self.pending.clear()
        self.pending_src.clear()
        for page in self.deferred:
            self._release(page)
        self.deferred.clear()
        return src, dst

    def _release(self, page: int) -> None:
        if self.prefix.holds(page):
            self.evictable[page] = None
        else:
            self.free.append(page)

    def _drop_pending_src(self, src: int) -> None:
        left = self.pending_src[src] - 1
        if left:
            self.pending_src[src] = left
            return
        del self.pending_src[src]
        if self.refcount[src] == 0 and src in self.deferred:
            self.deferred.remove(src)
            self._release(src)


class HostSlots:
    """Host (CPU memory) page slots for swapped-out sequences: their reference counts and
    the free stack."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.refcount = [0] * num_slots
        self.free = list(range(num_slots - 1, -1, -1))

    def take(self) -> int:
        return self.free.pop()

    def unref(self, slot: int) -> None:
        self.refcount[slot] -= 1
        if self.refcount[slot] == 0:
            self.free.append(slot)
