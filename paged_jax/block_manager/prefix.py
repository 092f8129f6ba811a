"""The prefix cache: a full page of computed tokens is entered under a blake2b digest
chained from its parent page's key (the chain's root salted with the request's
``extra_key``), and a new prompt's leading full pages are found by walking the same
chain. ``PrefixCache`` is the ``BlockManager``'s part that holds the maps, walks and
extends the chains; the ``PagePool`` keeps the cached pages nobody holds and evicts
from it. No JAX."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from ._common import NULL_PAGE
from .events import BlockRemoved, BlockStored, external_hash

_DIGEST_BYTES = 16


def prefix_root_key(extra_key: Any = None) -> bytes:
    """Root of a prefix-cache key chain; ``extra_key`` (adapter id, tenant salt) salts it.

    ``extra_key`` must be None, str, bytes, int, or a tuple of those, so that its digest
    is stable across processes.
    """
    h = hashlib.blake2b(b"paged-jax/prefix/v1", digest_size=_DIGEST_BYTES)
    h.update(_stable_bytes(extra_key))
    return h.digest()


def _stable_bytes(x: Any) -> bytes:
    if x is None:
        return b"N"
    if isinstance(x, bool):
        return b"B1" if x else b"B0"
    if isinstance(x, (int, np.integer)):
        return b"I" + str(int(x)).encode()
    if isinstance(x, str):
        return b"S" + len(x.encode()).to_bytes(8, "little") + x.encode()
    if isinstance(x, bytes):
        return b"Y" + len(x).to_bytes(8, "little") + x
    if isinstance(x, tuple):
        return b"T" + len(x).to_bytes(8, "little") + b"".join(_stable_bytes(e) for e in x)
    raise TypeError(
        f"extra_key: expected None, str, bytes, int or a tuple of those, got {type(x).__name__}"
    )


def page_key(parent: bytes, page_tokens: bytes) -> bytes:
    """Key of a full page: blake2b over (parent key, the page's int32 token ids)."""
    return hashlib.blake2b(parent + page_tokens, digest_size=_DIGEST_BYTES).digest()


class PrefixCache:
    """The prefix cache's maps: full computed pages by key (``cached``), each cached
    page's key (``page_key``) and token bytes (``page_tokens``, checked on a hit), and its
    counters (full prompt pages looked up, found, evicted). A ``BlockManager`` owns one;
    its ``PagePool`` keeps the cached pages nobody holds, least recently used first, and
    calls ``forget`` when it evicts one."""

    def __init__(self, page_size: int, enabled: bool):
        self.page_size = page_size
        self.enabled = enabled
        self.cached: dict[bytes, int] = {}  # key -> page
        self.page_key: dict[int, bytes] = {}  # page -> key
        self.page_tokens: dict[int, bytes] = {}  # page -> its token ids' bytes
        self.queries = 0  # full prompt pages looked up
        self.hits = 0  # of which found in the cache
        self.evictions = 0
        # events.BlockStored / BlockRemoved as pages enter and leave; None: not recorded
        self.events: list | None = None

    def holds(self, page: int) -> bool:
        """Whether ``page`` is cached (reusable by a prefix hit until evicted)."""
        return page in self.page_key

    def forget(self, page: int) -> None:
        """``page`` is evicted: no prompt finds it any more."""
        key = self.page_key.pop(page)
        del self.cached[key]
        del self.page_tokens[page]
        self.evictions += 1
        if self.events is not None:
            self.events.append(BlockRemoved([external_hash(key)]))

    def lookup(self, tokens: np.ndarray, root: bytes, limit: int) -> tuple[list[int], bytes]:
        """The cached pages of ``tokens``' leading full pages (at most ``limit`` pages),
        and the key of the last one (``root`` when none)."""
        hits: list[int] = []
        if not self.enabled:
            return hits, root
        # The hot loop of a prefix hit: local names, one digest per page.
        blake2b = hashlib.blake2b
        cached_get = self.cached.get
        page_tokens = self.page_tokens
        step = 4 * self.page_size
        buf = tokens.tobytes()
        last_key = root
        for off in range(0, limit * step, step):
            chunk = buf[off : off + step]
            key = blake2b(last_key + chunk, digest_size=_DIGEST_BYTES).digest()
            page = cached_get(key)
            if page is None or page_tokens[page] != chunk:
                break
            hits.append(page)
            last_key = key
        return hits, last_key

    def enter(self, pages: list[int], chunks: bytes, key: bytes, from_root: bool = False) -> bytes:
        """Enters ``pages`` (consecutive full pages of one sequence, ``chunks`` their
        token bytes, page by page) under the keys chained from ``key`` (their parent's;
        ``from_root``: the chain's root, the first page is the prompt's first); returns
        the last page's key. A page dropped outside a window (``NULL_PAGE``) extends the
        chain and is not entered; of identical pages, one is kept. Recording events, each
        run of pages entered is one ``BlockStored``."""
        step = 4 * self.page_size
        cached, page_key_of = self.cached, self.page_key
        record = self.events is not None
        run: list[bytes] = []  # keys of the current run of pages entered (events)
        first = 0  # the run's first page
        parent = key
        for i, page in enumerate(pages):
            chunk = chunks[i * step : (i + 1) * step]
            prev, key = key, page_key(key, chunk)
            if page != NULL_PAGE and key not in cached and page not in page_key_of:
                cached[key] = page
                page_key_of[page] = key
                self.page_tokens[page] = chunk
                if record:
                    if not run:
                        first, parent = i, prev
                    run.append(key)
            elif run:  # (NULL_PAGE: dropped outside the window, the chain goes on; else an
                # identical page is cached already, or this page is a hit: keep one)
                self._stored(run, None if from_root and first == 0 else parent,
                             chunks[first * step : i * step])  # fmt: skip
                run = []
        if run:
            self._stored(run, None if from_root and first == 0 else parent,
                         chunks[first * step : len(pages) * step])  # fmt: skip
        return key

    def _stored(self, keys: list[bytes], parent: bytes | None, chunks: bytes) -> None:
        self.events.append(
            BlockStored(
                [external_hash(k) for k in keys],
                None if parent is None else external_hash(parent),
                np.frombuffer(chunks, np.int32).tolist(),
                self.page_size,
            )
        )
