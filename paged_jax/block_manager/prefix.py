"""The prefix cache's keys and lookups: a full page of computed tokens is entered under a
blake2b digest chained from its parent page's key (the chain's root salted with the
request's ``extra_key``), and a new prompt's leading full pages are found by walking the
same chain. ``PrefixCache`` is the ``BlockManager``'s part that walks and extends it; the
cache's maps (key -> page, page -> key, page -> token bytes) and its LRU of pages nobody
holds live in the manager, whose page primitives evict from it. No JAX."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._common import NULL_PAGE, _as_tokens

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
    """``BlockManager``'s prefix-cache lookups and registration (a mixin: it reads and
    updates the manager's rows and cache maps)."""

    def _lookup(self, tokens: np.ndarray, root: bytes, limit: int) -> tuple[list[int], bytes]:
        """The cached pages of ``tokens``' leading full pages (at most ``limit`` pages),
        and the key of the last one (``root`` when none)."""
        hits: list[int] = []
        if not self.enable_prefix_caching:
            return hits, root
        # The hot loop of a prefix hit: local names, one digest per page.
        blake2b = hashlib.blake2b
        cached_get = self._cached.get
        page_tokens = self._page_tokens
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

    def cached_tokens(self, token_ids: Sequence[int] | np.ndarray, *, extra_key: Any = None) -> int:
        """Leading tokens of a prompt that ``allocate`` would find cached now (a multiple of
        ``page_size``, smaller than ``len(token_ids)``); changes nothing."""
        tokens = _as_tokens(token_ids)
        root = prefix_root_key(extra_key) if self.enable_prefix_caching else b""
        hits, _ = self._lookup(tokens, root, max(len(tokens) - 1, 0) // self.page_size)
        return len(hits) * self.page_size

    def _register(self, row: int, num_tokens: int) -> None:
        """Enters the sequence's full computed pages in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        P = self.page_size
        full = num_tokens // P
        first = int(self._nhash[row])
        if first >= full:
            return
        chunks = self._tok[row, first * P : full * P].tobytes()
        pages = self._table[row, first:full].tolist()
        key = self._key[row]
        cached, page_key_of = self._cached, self._page_key
        for i, page in enumerate(pages):
            chunk = chunks[i * 4 * P : (i + 1) * 4 * P]
            key = page_key(key, chunk)
            if page == NULL_PAGE:  # dropped outside the window (the chain goes on)
                continue
            if key not in cached and page not in page_key_of:
                cached[key] = page
                page_key_of[page] = key
                self._page_tokens[page] = chunk
            # else: an identical page is cached already (or this page is a hit); keep one.
        self._key[row] = key
        self._nhash[row] = full
