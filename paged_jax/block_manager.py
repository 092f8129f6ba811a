"""Host-side owner of "which physical page holds which token". Pure Python + numpy, no JAX.

The ``BlockManager`` hands out pages of a ``PagedKVCache`` pool to sequences on demand,
counts references so sequences can share pages (``fork`` for parallel sampling and beam
search, prefix-cache hits for common prompts), copies a shared page before it is written
(copy-on-write; the copies reach the device through ``take_copies`` and
``PagedKVCache.copy_pages``), keeps freed full pages in a prefix cache evicted
least-recently-used, and plans swaps of whole sequence groups to and from host memory.

Every decision is deterministic: the same calls give the same page ids in any process
(free pages are reused last-freed-first; prefix-cache keys are blake2b digests, never
Python's ``hash()``).

Order of device work within one engine step, which the manager's plans assume:
``cache.copy_pages(*take_copies())``, then swap-out reads, then swap-in writes, then the
model's K/V writes. Copies read pages as they were before the step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import numpy as np

NULL_PAGE = 0  # never handed out; the device-side sink for padding (see paged_jax.cache)
_DROPPED_SLOT = -1  # a swapped-out table's entry for a page dropped outside the window
_DIGEST_BYTES = 16


class BlockManagerError(Exception):
    """Base class of the block manager's errors."""


class OutOfPages(BlockManagerError):
    """Not enough free device (or host) pages; nothing was changed."""


class UnknownSequence(BlockManagerError, KeyError):
    """The seq_id was never allocated, or was already freed."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0])


class DuplicateSequence(BlockManagerError, ValueError):
    """A seq_id that is already live was given to allocate or fork."""


class InvalidSequenceState(BlockManagerError, ValueError):
    """The operation does not fit the sequence's state (e.g. appending while swapped out)."""


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


def _as_tokens(token_ids, name: str = "token_ids") -> np.ndarray:
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name}: expected integer token ids, got dtype {arr.dtype}")
    return arr.astype(np.int32, copy=False)


def _spans(rows: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> tuple:
    """Index arrays of the cells ``[rows[i], starts[i] : starts[i] + counts[i]]`` of a
    2-D array, row after row: for reading or writing them in one operation. When every
    count is the same (a steady launch), ``[S, c]`` arrays, else flat ones."""
    if len(counts) and counts.min() == counts.max():
        cols = starts[:, None] + np.arange(int(counts[0]))
        return rows[:, None], cols
    return np.repeat(rows, counts), np.repeat(starts, counts) + _ragged(counts)


def write_spans(
    dest: np.ndarray, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray, values
) -> None:
    """``dest[rows[i], starts[i] : starts[i] + counts[i]] = values[i, :counts[i]]`` for
    every i, in one assignment (``values``: ``[S, J]`` with ``counts <= J``; distinct
    rows). A slice of ``values`` when every count is the same, else a gather."""
    at = _spans(rows, starts, counts)
    if at[1].ndim == 2:
        dest[at] = values[:, : at[1].shape[1]]
    else:
        S = len(rows)
        dest[at] = values[_spans(np.arange(S), np.zeros(S, np.int64), counts)]


def _ragged(counts: np.ndarray) -> np.ndarray:
    """``int[sum(counts)]``: ``0 .. counts[i] - 1`` for each i in turn (each element's
    place within its row, for writing rows of different lengths in one assignment)."""
    ends = np.cumsum(counts)
    return np.arange(int(ends[-1]) if len(ends) else 0) - np.repeat(ends - counts, counts)


@dataclasses.dataclass(frozen=True, eq=False)
class SeqRows:
    """Distinct sequences of one ``BlockManager`` with their rows, as ``seq_rows`` gave
    them: pass it where a batched call (``append_tokens``, ``reserve_tokens``,
    ``fill_reserved``, ``paged_jax.advance_batch``) takes ``seq_ids``, and the manager
    checks it with two array comparisons instead of looking each sequence up (a
    multi-step launch's rows, reused launch after launch). A sequence freed since then
    (its row given to another) or swapped out is caught, and the call then looks the ids
    up as if they had been given.

    Attributes:
      ids: the sequence ids, in order.
      rows: ``intp[S]`` their rows of ``tables()``.
      serials: ``int64[S]`` the allocation each row held when taken.
    """

    ids: list
    rows: np.ndarray
    serials: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Hashable:
        return self.ids[i]

    def __iter__(self):
        return iter(self.ids)

    def take(self, keep: np.ndarray) -> SeqRows:
        """The sequences at ``keep`` (a bool mask or ``intp`` indices), in order."""
        idx = np.flatnonzero(keep) if keep.dtype == bool else keep
        return SeqRows([self.ids[i] for i in idx.tolist()], self.rows[idx], self.serials[idx])


# Per-sequence state kept in rows of arrays (BlockManager._add_row doubles them all).
_ROW_ARRAYS = (
    "_serial",
    "_table",
    "_tok",
    "_ntok",
    "_ncomp",
    "_resv",
    "_last",
    "_nhash",
    "_win",
    "_dropped",
    "_swapped",
)


class BlockManager:
    """Pages of a paged KV cache, handed out to sequences on demand.

    Args:
      num_pages: pages in the device pool, page 0 included (it is never handed out).
      page_size: tokens per page.
      enable_prefix_caching: share full pages between prompts with the same prefix.
      watermark: fraction of the pool kept free when admitting new sequences
        (``can_allocate``), so running sequences can grow without being preempted at once.
      num_host_pages: host (CPU memory) page slots for ``swap_out``; 0 disables swapping.

    Page accounting: a page is *free* (refcount 0, holding nothing reusable), *in use*
    (refcount = number of block-table references), or *cached* (refcount 0 but holding a
    full page of a known prefix; reusable by a prefix hit until evicted, LRU, when no
    free page is left). ``num_free_pages`` counts free + cached.

    Each sequence owns one row of a few arrays (its block table, token ids, token and
    computed counts, ...), so that the calls made for every sequence of every step
    (``append_tokens``, ``reserve_tokens``, ``fill_reserved``) are array operations over
    the sequences' rows, not a pass over one Python object per sequence.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
        num_host_pages: int = 0,
    ):
        for name, value, minimum in (
            ("num_pages", num_pages, 2),
            ("page_size", page_size, 1),
            ("num_host_pages", num_host_pages, 0),
        ):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
            if value < minimum:
                raise ValueError(f"{name}: expected >= {minimum}, got {value}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark: expected a fraction in [0, 1), got {watermark}")
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.watermark = float(watermark)
        self.watermark_pages = int(watermark * num_pages)
        self.num_host_pages = int(num_host_pages)

        self._refcount = [0] * self.num_pages
        # Stack of free pages: pop() takes the lowest id first on a fresh pool, then the
        # most recently freed page.
        self._free = list(range(self.num_pages - 1, 0, -1))
        self._seqs: dict[Hashable, int] = {}  # seq_id -> its row of the arrays below
        # A sequence's state is row `row` of these arrays (rows double when more sequences
        # exist; the table's and the token ids' columns double as they need more). Its
        # block table has pages_needed(_ntok[row]) entries, then zeros: a step's tables
        # are one gather (build_batch, advance_batch). Rows of no sequence are zeros.
        rows = 8
        self._serial = np.zeros(rows, np.int64)  # allocation count when the row was taken
        self._serials = 0  # rows taken so far
        self._table = np.zeros((rows, 8), np.int32)  # pages (host slots while swapped)
        # token ids (-1: reserved, not known yet); every cell past a row's count is -1, so
        # reserving tokens writes nothing there
        self._tok = np.full((rows, 16), -1, np.int32)
        self._ntok = np.zeros(rows, np.int64)  # tokens with slots (prompt plus appended)
        self._ncomp = np.zeros(rows, np.int64)  # leading tokens whose K/V are on the device
        # First reserved token not yet filled (reserve_tokens), or -1: it and every token
        # after it are not computed, whatever step boundaries passed.
        self._resv = np.zeros(rows, np.int64)
        self._last = np.zeros(rows, np.int64)  # step of the latest append (-1: never)
        self._nhash = np.zeros(rows, np.int64)  # leading full pages whose keys are known
        self._win = np.zeros(rows, np.int64)  # keys each token attends to (0: all)
        # The first _dropped[row] entries are NULL_PAGE (host: _DROPPED_SLOT): pages no
        # future token reads (sliding window).
        self._dropped = np.zeros(rows, np.int64)
        self._swapped = np.zeros(rows, bool)
        self._root: list[bytes] = [b""] * rows  # prefix-cache root key
        self._key: list[bytes] = [b""] * rows  # key of page _nhash - 1 (root when none)
        self._free_rows = list(range(rows - 1, -1, -1))
        # Prefix cache: key -> page, page -> key, page -> its token bytes (for checking).
        self._cached: dict[bytes, int] = {}
        self._page_key: dict[int, bytes] = {}
        self._page_tokens: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # refcount-0 cached, LRU first
        self._pending: dict[int, int] = {}  # copy-on-write: dst page -> src page
        self._pending_src: dict[int, int] = {}  # src page -> number of pending copies from it
        # Pages released while a pending copy still reads them: reused only after the
        # step boundary, so nothing (a swap-in, the step's writes) overwrites them first.
        self._deferred: list[int] = []
        self._step = 0  # step boundaries seen (take_copies calls)
        self._host_refcount = [0] * self.num_host_pages
        self._host_free = list(range(self.num_host_pages - 1, -1, -1))
        self._prefix_queries = 0  # full prompt pages looked up
        self._prefix_hits = 0  # of which found in the cache
        self._evictions = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free_pages(self) -> int:
        """Pages that can be handed out now: free plus evictable cached pages."""
        return len(self._free) + len(self._evictable)

    @property
    def num_host_free_pages(self) -> int:
        return len(self._host_free)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    @property
    def seq_ids(self) -> list:
        return list(self._seqs)

    @property
    def num_seqs(self) -> int:
        """Sequences held (``len(seq_ids)`` without the list)."""
        return len(self._seqs)

    def _row(self, seq_id: Hashable) -> int:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequence(
                f"seq_id {seq_id!r}: unknown (never allocated, or already freed)"
            ) from None

    def _device_row(self, seq_id: Hashable, op: str) -> int:
        row = self._row(seq_id)
        if self._swapped[row]:
            raise InvalidSequenceState(f"{op}: seq_id {seq_id!r} is swapped out; swap_in first")
        return row

    def seq_rows(self, seq_ids: Sequence[Hashable]) -> SeqRows:
        """Distinct sequences on the device with their rows, for batched calls made again
        and again for the same sequences (``SeqRows``). Raises as ``append_tokens``."""
        rows = self._device_rows(seq_ids, "seq_rows")
        return SeqRows(list(seq_ids), rows, self._serial[rows])

    def _device_rows(self, seq_ids: Sequence[Hashable] | SeqRows, op: str) -> np.ndarray:
        """``intp[S]``: the rows of distinct sequences on the device (errors as
        ``_device_row``, and ``ValueError`` for a sequence given twice)."""
        if isinstance(seq_ids, SeqRows):
            rows = seq_ids.rows
            if (self._serial[rows] == seq_ids.serials).all() and not self._swapped[rows].any():
                return rows
            seq_ids = seq_ids.ids  # a row changed hands, or was swapped out
        get = self._seqs.get
        found = [get(s) for s in seq_ids]
        rows = np.array(found, np.intp) if None not in found else None
        if rows is None or self._swapped[rows].any():
            rows = np.array([self._device_row(s, op) for s in seq_ids], np.intp)  # raises
        if len(set(found)) < len(found):
            seen: set = set()
            twice = next(s for s in seq_ids if s in seen or seen.add(s))
            raise ValueError(f"seq_ids: expected distinct sequences, got {twice!r} twice")
        return rows

    def _npages(self, row: int) -> int:
        """Entries of the row's block table (pages of its tokens, dropped ones included)."""
        return -(-int(self._ntok[row]) // self.page_size)

    def _filled(self, row: int) -> int:
        """Tokens before the first reserved one not yet filled (all of them if none)."""
        r = int(self._resv[row])
        return int(self._ntok[row]) if r < 0 else r

    def num_tokens(self, seq_id: Hashable) -> int:
        """Tokens of the sequence that have slots (prompt plus appended tokens)."""
        return int(self._ntok[self._row(seq_id)])

    def num_computed_tokens(self, seq_id: Hashable) -> int:
        """Leading tokens whose K/V are on the device (cached or marked computed)."""
        return int(self._ncomp[self._row(seq_id)])

    def token_ids(self, seq_id: Hashable) -> np.ndarray:
        """``i32[num_tokens]``: a copy of the sequence's token ids."""
        row = self._row(seq_id)
        return self._tok[row, : self._ntok[row]].copy()

    def token_buffer(self, seq_id: Hashable) -> np.ndarray:
        """The sequence's token ids as a view of its row (its first ``num_tokens``
        entries; do not modify it; valid until the manager next changes)."""
        return self._tok[self._row(seq_id)]

    def set_token(self, seq_id: Hashable, index: int, token: int) -> None:
        """Replaces token ``index`` of the sequence, one whose K/V is not computed yet.

        For a token appended before its value was known (the engine's overlapped steps
        append a placeholder for the token the running step samples): its page is not
        in the prefix cache until the token is marked computed, so the value it is
        hashed with is this one. Raises ``ValueError`` for a computed or absent index.
        """
        row = self._row(seq_id)
        done, n = int(self._ncomp[row]), int(self._ntok[row])
        if not done <= index < n:
            raise ValueError(
                f"index: expected a token not yet computed, in [{done}, {n}), got {index}"
            )
        self._tok[row, index] = token

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The sequence's pages in order (host slots while it is swapped out)."""
        row = self._row(seq_id)
        return self._table[row, : self._npages(row)].tolist()

    def is_swapped(self, seq_id: Hashable) -> bool:
        return bool(self._swapped[self._row(seq_id)])

    def host_slots(self, seq_id: Hashable) -> list[int]:
        """The host slots a swapped-out sequence holds (none while it is on the device)."""
        row = self._row(seq_id)
        return self._live(row) if self._swapped[row] else []

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def host_refcount(self, slot: int) -> int:
        """Sequences holding host slot ``slot`` (0: free, its swapped data can be dropped)."""
        return self._host_refcount[slot]

    def slots(self, seq_id: Hashable, start: int, stop: int) -> np.ndarray:
        """``i32[stop - start]``: slots (page * page_size + offset) of tokens [start, stop)."""
        row = self._device_row(seq_id, "slots")
        n = int(self._ntok[row])
        if not 0 <= start <= stop <= n:
            raise ValueError(
                f"slots: expected 0 <= start <= stop <= num_tokens={n}, got "
                f"start={start}, stop={stop}"
            )
        pos = np.arange(start, stop, dtype=np.int32)
        table = self._table[row, : self._npages(row)]
        return table[pos // self.page_size] * self.page_size + pos % self.page_size

    def pages_np(self, seq_id: Hashable) -> np.ndarray:
        """``i32[num_pages_of_seq]``: the block table as an array, a view of its row of
        ``tables()`` (do not modify it; it follows the table until the array grows)."""
        row = self._device_row(seq_id, "pages_np")
        return self._table[row, : self._npages(row)]

    def tables(self) -> np.ndarray:
        """``i32[R, C]``: every sequence's block table as a row (its pages, host slots
        while swapped out, then zeros); rows of no sequence are zeros. Updated in place as
        tables change, and replaced by a larger array when a table grows past ``C``
        entries or more than ``R`` sequences exist: read it again after changing the
        manager, and never modify it."""
        return self._table

    def table_row(self, seq_id: Hashable) -> int:
        """The sequence's row of ``tables()`` (fixed from its allocation to its ``free``)."""
        return self._row(seq_id)

    def _add_row(
        self, seq_id: Hashable, tokens: np.ndarray, pages: Sequence[int], root: bytes, window: int
    ) -> int:
        """A new sequence's row, holding ``tokens`` and ``pages``, nothing computed."""
        if not self._free_rows:
            rows = self._table.shape[0]
            for name in _ROW_ARRAYS:
                a = getattr(self, name)
                fill = -1 if name == "_tok" else 0
                pad = ((0, rows),) + ((0, 0),) * (a.ndim - 1)
                setattr(self, name, np.pad(a, pad, constant_values=fill))
            self._root += [b""] * rows
            self._key += [b""] * rows
            self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
        row = self._free_rows.pop()
        self._serials += 1
        self._serial[row] = self._serials
        n = len(tokens)
        self._fit(len(pages), n)
        self._table[row, : len(pages)] = pages
        self._tok[row, :n] = tokens
        self._ntok[row] = n
        self._ncomp[row] = 0
        self._resv[row] = -1
        self._last[row] = -1
        self._nhash[row] = 0
        self._win[row] = window
        self._dropped[row] = 0
        self._swapped[row] = False
        self._root[row] = self._key[row] = root
        self._seqs[seq_id] = row
        return row

    def _drop_row(self, seq_id: Hashable, row: int) -> None:
        del self._seqs[seq_id]
        self._table[row] = 0
        self._tok[row, : self._ntok[row]] = -1
        self._ntok[row] = 0
        self._free_rows.append(row)

    def _fit(self, pages: int, tokens: int) -> None:
        """Widens the table to ``pages`` columns and the token ids to ``tokens``, if
        they are narrower (to the next power of two, so widening is rare)."""
        if pages > self._table.shape[1]:
            width = 1 << (pages - 1).bit_length()
            self._table = np.pad(self._table, ((0, 0), (0, width - self._table.shape[1])))
        if tokens > self._tok.shape[1]:
            width = 1 << (tokens - 1).bit_length()
            pad = ((0, 0), (0, width - self._tok.shape[1]))
            self._tok = np.pad(self._tok, pad, constant_values=-1)

    # ------------------------------------------------------------------ admission checks
    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_tokens: int) -> bool:
        """True if a new sequence of ``num_tokens`` fits while leaving the watermark free.

        Conservative: prefix-cache hits, which would need fewer pages, are not counted.
        """
        return self.num_free_pages - self.pages_needed(num_tokens) >= self.watermark_pages

    def can_append(self, seq_ids: Iterable[Hashable], num_tokens: int = 1) -> bool:
        """True if each of ``seq_ids`` can append ``num_tokens`` tokens now.

        Counts the new pages and the copy-on-write copies this would need. Running
        sequences may use the watermark's reserve (it exists for them).
        """
        return self._append_need(seq_ids, num_tokens) <= self.num_free_pages

    def _append_need(self, seq_ids: Iterable[Hashable], num_tokens: int) -> int:
        need = 0
        for seq_id in seq_ids:
            need += self._pages_for_append(self._device_row(seq_id, "can_append"), num_tokens)
        return need

    def _pages_for_append(self, row: int, num_new: int) -> int:
        n, P = int(self._ntok[row]), self.page_size
        have = -(-n // P)
        need = self.pages_needed(n + num_new) - have
        if n % P and num_new and self._refcount[self._table[row, have - 1]] > 1:
            need += 1  # copy-on-write of the shared partial last page
        return max(need, 0)

    # ------------------------------------------------------------------ page primitives
    def _take_page(self) -> int:
        if self._free:
            page = self._free.pop()
        else:
            page, _ = self._evictable.popitem(last=False)  # least recently used
            key = self._page_key.pop(page)
            del self._cached[key]
            del self._page_tokens[page]
            self._evictions += 1
        self._refcount[page] = 1
        return page

    def _ref(self, page: int) -> None:
        if self._refcount[page] == 0:
            del self._evictable[page]  # a cached page comes back into use
        self._refcount[page] += 1

    def _unref(self, page: int) -> None:
        rc = self._refcount[page] - 1
        self._refcount[page] = rc
        if rc:
            return
        src = self._pending.pop(page, None)  # a copy into a page nobody holds is moot
        if src is not None:
            self._drop_pending_src(src)
        if page in self._pending_src:
            self._deferred.append(page)
        else:
            self._release(page)

    def _release(self, page: int) -> None:
        if page in self._page_key:
            self._evictable[page] = None
        else:
            self._free.append(page)

    def _drop_pending_src(self, src: int) -> None:
        left = self._pending_src[src] - 1
        if left:
            self._pending_src[src] = left
            return
        del self._pending_src[src]
        if self._refcount[src] == 0 and src in self._deferred:
            self._deferred.remove(src)
            self._release(src)

    def _check_new_id(self, seq_id: Hashable, op: str) -> None:
        if seq_id in self._seqs:
            raise DuplicateSequence(f"{op}: seq_id {seq_id!r} is already live")

    # ------------------------------------------------------------------ lifecycle
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

    def allocate(
        self,
        seq_id: Hashable,
        token_ids: Sequence[int] | np.ndarray,
        *,
        extra_key: Any = None,
        sliding_window: int | None = None,
        max_cached_tokens: int | None = None,
    ) -> int:
        """Pages for a new sequence's prompt; returns how many leading tokens are cached.

        The returned count is a multiple of ``page_size`` and always smaller than
        ``len(token_ids)``, so at least one token is computed (its logits are needed).
        Cached tokens share the pages of an earlier prompt with the same tokens and the
        same ``extra_key`` (e.g. an adapter id or a tenant's cache salt). The remaining
        tokens get fresh pages; their slots are ``slots(seq_id, cached, len(token_ids))``.
        ``max_cached_tokens`` caps the cached count (a ``HybridBlockManager`` makes its
        layer groups agree). With ``sliding_window`` W (each token attends to the W most
        recent keys, itself included), pages no later token can read are dropped from the
        table as tokens get computed: their entries become ``NULL_PAGE`` and the pages go
        back to the pool (a full one stays in the prefix cache).
        Raises ``OutOfPages`` (changing nothing) when the pool cannot hold the prompt.
        """
        self._check_new_id(seq_id, "allocate")
        if sliding_window is not None and (
            isinstance(sliding_window, bool)
            or not isinstance(sliding_window, (int, np.integer))
            or sliding_window < 1
        ):
            raise ValueError(
                f"sliding_window: expected None or an int >= 1, got {sliding_window!r}"
            )
        tokens = _as_tokens(token_ids)
        n, P = len(tokens), self.page_size
        if n == 0:
            raise ValueError("token_ids: expected at least one token, got an empty prompt")
        root = prefix_root_key(extra_key) if self.enable_prefix_caching else b""
        # At most (n - 1) // P pages: the last token always gets computed.
        limit = (n - 1) // P
        if max_cached_tokens is not None:
            limit = min(limit, max(int(max_cached_tokens), 0) // P)
        hits, key = self._lookup(tokens, root, limit)
        # hits on cached pages nobody holds (they leave the evictable set)
        revived = sum(1 for page in hits if self._refcount[page] == 0)
        fresh = self.pages_needed(n) - len(hits)
        reusable = len(self._free) + len(self._evictable) - revived
        if fresh > reusable:
            raise OutOfPages(
                f"allocate: seq_id {seq_id!r} needs {fresh} new pages for {n} tokens "
                f"({len(hits)} pages cached), {reusable} available"
            )
        if self.enable_prefix_caching:
            self._prefix_queries += (n - 1) // P
            self._prefix_hits += len(hits)
        refcount = self._refcount
        evictable = self._evictable
        for page in hits:
            if refcount[page] == 0:
                del evictable[page]
            refcount[page] += 1
        pages = hits + [self._take_page() for _ in range(fresh)]
        row = self._add_row(seq_id, tokens, pages, root, sliding_window or 0)
        self._ncomp[row] = len(hits) * P
        self._nhash[row] = len(hits)
        self._key[row] = key
        self._drop_out_of_window(row)  # hits no prompt token reads
        return len(hits) * P

    def append_slots(self, seq_id: Hashable, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Slots for new tokens of a sequence: ``i32[len(token_ids)]``.

        One token for a decode step, more for a prefill chunk or speculative tokens.
        Allocates pages on demand; if the partially filled last page is shared, first
        moves the sequence to a private copy (copy-on-write, queued for ``take_copies``).
        Tokens the sequence had before its first append of this step are taken as computed
        (an earlier step wrote their K/V), so their full pages become prefix-cache entries;
        the new tokens' K/V must be written by the step that follows (see ``take_copies``).
        Raises ``OutOfPages`` (changing nothing) when pages run out.
        """
        row = self._device_row(seq_id, "append_slots")
        P = self.page_size
        n = int(self._ntok[row])
        self._first_appends(np.array([row], np.intp))
        fill = n % P
        # Fast path (a decode step): one token into an exclusively owned, partially
        # filled page that has room in the token ids' row.
        if (
            fill
            and type(token_ids) in (list, tuple)
            and len(token_ids) == 1
            and type(token_ids[0]) is int
            and n < self._tok.shape[1]
        ):
            page = int(self._table[row, n // P])
            if self._refcount[page] == 1:
                self._tok[row, n] = token_ids[0]
                self._ntok[row] = n + 1
                return np.array([page * P + fill], np.int32)
        tokens = _as_tokens(token_ids)
        num_new = len(tokens)
        need = self._pages_for_append(row, num_new)
        if need > self.num_free_pages:
            raise OutOfPages(
                f"append_slots: seq_id {seq_id!r} needs {need} pages for {num_new} tokens, "
                f"{self.num_free_pages} available"
            )
        self._grow(row, tokens)
        return self.slots(seq_id, n, n + num_new)

    def _first_appends(self, rows: np.ndarray) -> None:
        """At a sequence's first append of a step, every token it had before was computed
        by an earlier step (tokens appended within this step are not): for each of
        ``rows`` (distinct) about to append."""
        stale = rows[self._last[rows] != self._step]
        if len(stale):
            self._last[stale] = self._step
            r = self._resv[stale]
            self._mark_rows(stale, np.where(r < 0, self._ntok[stale], r))

    def _grow(self, row: int, tokens: np.ndarray | int) -> None:
        """Appends ``tokens`` (an int: that many placeholders, -1) to the row's sequence,
        whose pages for them were counted free: a shared partially filled last page is
        first replaced by a private copy (copy-on-write), then new pages are taken as the
        tokens need them."""
        P, n = self.page_size, int(self._ntok[row])
        num_new = tokens if isinstance(tokens, int) else len(tokens)
        have = -(-n // P)
        m = n + num_new
        self._fit(self.pages_needed(m), m)
        if n % P and num_new and self._refcount[self._table[row, have - 1]] > 1:
            old = int(self._table[row, have - 1])
            new = self._take_page()
            # `old` holds only K/V of earlier steps: fork refuses parents with unwritten
            # K/V, so a page written this step is never shared, and copies never chain.
            self._pending[new] = old
            self._pending_src[old] = self._pending_src.get(old, 0) + 1
            self._unref(old)
            self._table[row, have - 1] = new
        for col in range(have, self.pages_needed(m)):
            self._table[row, col] = self._take_page()
        if not isinstance(tokens, int):  # (placeholders: the cells past n are -1)
            self._tok[row, n:m] = tokens
        self._ntok[row] = m

    def _append(self, rows: np.ndarray, counts: np.ndarray, values: np.ndarray | None) -> bool:
        """Appends ``counts[i]`` tokens to the sequence of row ``rows[i]`` (distinct rows,
        counts >= 1): ``values[i]`` (one token each), or placeholders (-1) for None. All or
        none: False, changing nothing, when the pages they need together are not free.

        For every row of every step: the new pages are taken in row order and written
        to the table in one assignment, and so are the tokens; only a row whose shared
        last page needs a copy first (copy-on-write) goes through ``_grow``."""
        if not len(rows):
            return True
        P = self.page_size
        n = self._ntok[rows]
        m = n + counts
        have, want = -(-n // P), -(-m // P)
        cow = np.zeros(len(rows), bool)
        part = np.flatnonzero(n % P)
        if len(part):
            get = self._refcount.__getitem__
            last = self._table[rows[part], have[part] - 1].tolist()
            if max(map(get, last)) > 1:  # some last page is shared
                cow[part] = [get(p) > 1 for p in last]
        more = want - have
        if int(more.sum()) + int(cow.sum()) > self.num_free_pages:
            return False
        self._first_appends(rows)
        if cow.any():
            for j in np.flatnonzero(cow).tolist():
                self._grow(int(rows[j]), int(counts[j]) if values is None else values[j : j + 1])
            keep = ~cow
            rows, counts, n, m, have, more = (a[keep] for a in (rows, counts, n, m, have, more))
            values = None if values is None else values[keep]
            if not len(rows):
                return True
        self._fit(int(want.max()), int(m.max()))
        total = int(more.sum())
        if total:
            free = self._free
            if len(free) >= total:  # pop() order, in one slice
                taken = free[: -total - 1 : -1]
                del free[-total:]
                # refcount[page] = 1 for each, the loop run in C (deque drops the Nones)
                deque(map(self._refcount.__setitem__, taken, itertools.repeat(1)), maxlen=0)
            else:  # the prefix cache gives up pages too
                taken = [self._take_page() for _ in range(total)]
            if total == int(np.count_nonzero(more)):  # one new page a row at most
                got = more > 0
                self._table[rows[got], have[got]] = taken
            else:
                self._table[np.repeat(rows, more), np.repeat(have, more) + _ragged(more)] = taken
        if values is not None:  # (placeholders: the cells past n are -1)
            self._tok[rows, n] = values
        self._ntok[rows] = m
        return True

    def append_tokens(self, seq_ids: Sequence[Hashable] | SeqRows, tokens: Sequence[int]) -> bool:
        """Appends ``tokens[i]`` to sequence ``seq_ids[i]`` (distinct sequences), all of
        them or none: returns False, changing nothing, when the pages they need together
        are not free.

        A decode step's appends in one call (``can_append`` and ``append_slots`` of one
        token each, without the slot arrays): the engine's scheduler runs this for every
        decoding group of every step.
        """
        if len(seq_ids) != len(tokens):
            raise ValueError(
                f"tokens: expected one per sequence ({len(seq_ids)}), got {len(tokens)}"
            )
        values = _as_tokens(tokens, "tokens")
        rows = self._device_rows(seq_ids, "append_tokens")
        return self._append(rows, np.ones(len(rows), np.int64), values)

    def reserve_tokens(self, seq_ids: Sequence[Hashable] | SeqRows, counts: Sequence[int]) -> bool:
        """Appends ``counts[i]`` placeholder tokens (-1) to sequence ``seq_ids[i]``
        (distinct sequences), all of them or none: returns False, changing nothing, when
        the pages they need together are not free.

        For tokens the device will sample within the step that follows (the engine's
        multi-step decoding computes several tokens of a sequence in one launch): give
        them their values with ``fill_reserved``, which also marks them computed, the
        moment their pages enter the prefix cache. Until then they stay uncomputed, step
        boundaries notwithstanding, and more may be reserved after them (the next launch,
        dispatched while this one runs); fill them in order.
        """
        if len(seq_ids) != len(counts):
            raise ValueError(
                f"counts: expected one per sequence ({len(seq_ids)}), got {len(counts)}"
            )
        ks = np.asarray(counts)
        if ks.dtype.kind not in "iu" or (ks < 0).any():
            for seq_id, k in zip(seq_ids, counts, strict=True):
                if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
                    raise ValueError(f"counts: expected ints >= 0, got {k!r} for {seq_id!r}")
        rows = self._device_rows(seq_ids, "reserve_tokens")
        ks = ks.astype(np.int64, copy=False)
        some = ks > 0
        if not some.all():
            rows, ks = rows[some], ks[some]
        before = self._ntok[rows]
        if not self._append(rows, ks, None):
            return False
        r = self._resv[rows]
        self._resv[rows] = np.where(r < 0, before, r)
        return True

    def fill_reserved(
        self,
        seq_ids: Sequence[Hashable] | SeqRows,
        starts: Sequence[int],
        tokens: Sequence[np.ndarray] | np.ndarray,
        *,
        counts: Sequence[int] | None = None,
    ) -> None:
        """For each sequence (distinct), tokens ``[starts[i], starts[i] + c)`` (none of them
        computed yet) replaced by the first ``c = counts[i]`` of ``tokens[i]`` (all of them
        when ``counts`` is None; ``set_token`` for each), then every token up to them
        marked computed (``mark_computed``): a multi-step launch's reserved tokens
        (``reserve_tokens``), once it returned. ``tokens``: an int array per sequence, or
        ``i32[S, J]`` (row i sequence i's)."""
        S = len(seq_ids)
        if len(starts) != S or len(tokens) != S:
            raise ValueError(
                f"starts, tokens: expected one per sequence ({S}), got "
                f"{len(starts)} and {len(tokens)}"
            )
        if counts is None:
            cs = np.fromiter((len(t) for t in tokens), np.int64, S)
            values = (
                np.concatenate([np.asarray(t, np.int32).reshape(-1) for t in tokens])
                if S
                else np.zeros(0, np.int32)
            )
        else:
            if len(counts) != S:
                raise ValueError(f"counts: expected one per sequence ({S}), got {len(counts)}")
            cs = np.asarray(counts, np.int64)
            tokens = np.asarray(tokens)
            width = tokens.shape[1] if tokens.ndim == 2 else 0
            bad = np.flatnonzero((cs < 0) | (cs > width))
            if len(bad):
                i = int(bad[0])
                raise ValueError(
                    f"counts: expected 0 to {width} (the tokens given) for {seq_ids[i]!r}, "
                    f"got {int(cs[i])}"
                )
            values = None  # written below (write_spans)
        rows = self._device_rows(seq_ids, "fill_reserved")
        starts = np.asarray(starts, np.int64).reshape(S)
        stops = starts + cs
        done, n = self._ncomp[rows], self._ntok[rows]
        bad = np.flatnonzero((starts < done) | (stops > n))
        if len(bad):
            i = int(bad[0])
            raise ValueError(
                f"starts: expected tokens not yet computed, within [{int(done[i])}, "
                f"{int(n[i])}) for {seq_ids[i]!r}, got [{int(starts[i])}, {int(stops[i])})"
            )
        if values is None:
            write_spans(self._tok, rows, starts, cs, tokens)
        else:
            at = _spans(rows, starts, cs)
            self._tok[at] = values.reshape(at[1].shape)
        r = self._resv[rows]
        past = (r >= 0) & (stops > r)
        if past.any():
            self._resv[rows[past]] = np.where(stops < n, stops, -1)[past]
        self._mark_rows(rows, stops)

    def mark_computed(self, seq_id: Hashable, num_tokens: int) -> None:
        """Declares the K/V of the sequence's first ``num_tokens`` tokens written.

        Call after each prefill chunk; their full pages become prefix-cache entries that
        later prompts can share. (``append_slots`` does this for all earlier tokens.)
        """
        row = self._device_row(seq_id, "mark_computed")
        n = int(self._ntok[row])
        if not 0 <= num_tokens <= n:
            raise ValueError(f"num_tokens: expected 0 <= num_tokens <= {n}, got {num_tokens}")
        self._mark_computed(row, num_tokens)

    def _sync_computed(self, row: int) -> None:
        """Tokens appended in earlier steps are computed once a step boundary passed."""
        done = self._filled(row)
        if 0 <= self._last[row] < self._step and self._ncomp[row] < done:
            self._mark_computed(row, done)

    def _mark_computed(self, row: int, num_tokens: int) -> None:
        if num_tokens <= self._ncomp[row]:
            return
        self._ncomp[row] = num_tokens
        self._register(row, num_tokens)
        self._drop_out_of_window(row)

    def _mark_rows(self, rows: np.ndarray, num_tokens: np.ndarray) -> None:
        """``_mark_computed`` of each of ``rows`` (distinct): the counts as one
        assignment, then the prefix cache and the window for the rows that need them."""
        up = num_tokens > self._ncomp[rows]
        if not up.all():
            rows, num_tokens = rows[up], num_tokens[up]
        if not len(rows):
            return
        self._ncomp[rows] = num_tokens
        if self.enable_prefix_caching:
            new = num_tokens // self.page_size > self._nhash[rows]
            for row, k in zip(rows[new].tolist(), num_tokens[new].tolist(), strict=True):
                self._register(row, k)
        w = self._win[rows]
        if w.any():
            dead = (num_tokens - w + 1) // self.page_size
            for row in rows[(w > 0) & (dead > self._dropped[rows])].tolist():
                self._drop_out_of_window(row)

    def _drop_out_of_window(self, row: int) -> None:
        """Releases the leading pages no token from the computed count on can read: page
        i's last key ``(i + 1) P - 1`` lies before the window of position ``_ncomp``."""
        w = int(self._win[row])
        if not w:
            return
        dead = (int(self._ncomp[row]) - w + 1) // self.page_size
        start = int(self._dropped[row])
        if dead <= start:
            return
        table = self._table
        for i in range(start, dead):
            page = int(table[row, i])
            table[row, i] = NULL_PAGE
            self._unref(page)
        self._dropped[row] = dead

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

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """The child shares every page of the parent (reference counts only, no copy).

        The parent's K/V must all be written: fork after the step that computed its
        tokens (a prompt: after ``mark_computed``), before appending this step's token.
        """
        prow = self._device_row(parent_id, "fork")
        self._check_new_id(child_id, "fork")
        self._sync_computed(prow)
        n, done = int(self._ntok[prow]), int(self._ncomp[prow])
        if done < n:
            # A later copy-on-write of a shared page would copy it as it was before the
            # step, without the K/V this step is about to write: refuse instead.
            raise InvalidSequenceState(
                f"fork: seq_id {parent_id!r} has {n - done} tokens whose K/V are not "
                f"written yet ({done} of {n} computed); fork before appending, or after "
                "the step that computes them (mark_computed for a prompt)"
            )
        dropped = int(self._dropped[prow])
        pages = self._table[prow, : self._npages(prow)].tolist()
        for page in pages[dropped:]:
            self._ref(page)
        tokens = self._tok[prow, :n].copy()
        row = self._add_row(child_id, tokens, pages, self._root[prow], int(self._win[prow]))
        for name in ("_ncomp", "_resv", "_last", "_nhash", "_dropped"):
            a = getattr(self, name)
            a[row] = a[prow]
        self._key[row] = self._key[prow]

    def free(self, seq_id: Hashable) -> None:
        """Releases the sequence's pages (device or host). Full cached pages stay cached.

        Pages are released last first, so a chain's tail is evicted before its head.
        """
        row = self._row(seq_id)
        live = self._live(row)
        swapped = bool(self._swapped[row])
        self._drop_row(seq_id, row)
        if swapped:
            for slot in live:
                self._host_refcount[slot] -= 1
                if self._host_refcount[slot] == 0:
                    self._host_free.append(slot)
            return
        for page in reversed(live):
            self._unref(page)

    def take_copies(self) -> tuple[np.ndarray, np.ndarray]:
        """Copy-on-write copies queued since the last call: ``(src i32[n], dst i32[n])``.

        Marks a step boundary: call it exactly once per engine step, after scheduling
        (``build_batch`` does), and apply the copies with ``PagedKVCache.copy_pages`` before
        the step's K/V writes. The step must write the K/V of every token appended since
        the previous boundary.
        """
        src = np.fromiter(self._pending.values(), np.int32, len(self._pending))
        dst = np.fromiter(self._pending.keys(), np.int32, len(self._pending))
        self._pending.clear()
        self._pending_src.clear()
        for page in self._deferred:
            self._release(page)
        self._deferred.clear()
        self._step += 1
        return src, dst

    # ------------------------------------------------------------------ swapping
    def _group(self, seq_ids: Iterable[Hashable], swapped: bool, op: str) -> dict[Hashable, int]:
        """The group's distinct sequences and their rows, all on the device (``swapped``
        False) or all swapped out."""
        rows = {s: self._row(s) for s in dict.fromkeys(seq_ids)}
        for s, row in rows.items():
            if self._swapped[row] != swapped:
                where = "swapped out" if self._swapped[row] else "on the device"
                raise InvalidSequenceState(f"{op}: seq_id {s!r} is {where}")
        return rows

    def _live(self, row: int) -> list[int]:
        """The row's table entries not dropped outside the window."""
        return self._table[row, self._dropped[row] : self._npages(row)].tolist()

    def can_swap_out(self, seq_ids: Iterable[Hashable]) -> bool:
        rows = self._group(seq_ids, False, "can_swap_out").values()
        return len({p for row in rows for p in self._live(row)}) <= len(self._host_free)

    def can_swap_in(self, seq_ids: Iterable[Hashable]) -> bool:
        rows = self._group(seq_ids, True, "can_swap_in").values()
        return len({p for row in rows for p in self._live(row)}) <= self.num_free_pages

    def swap_out(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """Moves a group of sequences to host slots, all or nothing.

        Returns ``[(device_page, host_slot), ...]``: read each device page to its host
        slot (``PagedKVCache.read_pages``) after this step's copies, before any write.
        A page shared inside the group goes to one host slot and comes back as one page.
        Raises ``OutOfPages`` when the host has too few free slots (nothing changes).
        """
        group = self._group(seq_ids, False, "swap_out")
        for seq_id, row in group.items():
            if self._last[row] == self._step:
                raise InvalidSequenceState(
                    f"swap_out: seq_id {seq_id!r} appended tokens this step whose K/V are "
                    "not written yet; preempt a sequence before appending to it"
                )
        distinct = list(dict.fromkeys(p for row in group.values() for p in self._live(row)))
        if len(distinct) > len(self._host_free):
            raise OutOfPages(
                f"swap_out: {len(distinct)} host slots needed, {len(self._host_free)} free"
            )
        to_host = {}
        plan = []
        for page in distinct:
            slot = self._host_free.pop()
            to_host[page] = slot
            plan.append((page, slot))
        to_host[NULL_PAGE] = _DROPPED_SLOT
        for row in group.values():
            live = self._live(row)
            for page in live:
                self._host_refcount[to_host[page]] += 1
            entries = self._table[row, : self._npages(row)]
            entries[:] = [to_host[p] for p in entries.tolist()]
            self._swapped[row] = True
            for page in reversed(live):
                self._unref(page)
        return plan

    def swap_in(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """Brings a swapped-out group back, all or nothing: ``[(host_slot, device_page)]``.

        Write each host slot's data into its device page (``PagedKVCache.write_pages``)
        before the step's model writes. Raises ``OutOfPages`` when the device lacks pages.
        """
        group = self._group(seq_ids, True, "swap_in")
        distinct = list(dict.fromkeys(s for row in group.values() for s in self._live(row)))
        if len(distinct) > self.num_free_pages:
            raise OutOfPages(
                f"swap_in: {len(distinct)} device pages needed, {self.num_free_pages} available"
            )
        to_device = {}
        plan = []
        for slot in distinct:
            page = self._take_page()
            self._refcount[page] = 0
            to_device[slot] = page
            plan.append((slot, page))
        to_device[_DROPPED_SLOT] = NULL_PAGE
        for row in group.values():
            for slot in self._live(row):
                self._refcount[to_device[slot]] += 1
                self._host_refcount[slot] -= 1
                if self._host_refcount[slot] == 0:
                    self._host_free.append(slot)
            entries = self._table[row, : self._npages(row)]
            entries[:] = [to_device[s] for s in entries.tolist()]
            self._swapped[row] = False
            # Re-register the restored full pages (their old device copies may be gone).
            self._key[row], self._nhash[row] = self._root[row], 0
            self._register(row, int(self._ncomp[row]))
        return plan

    # ------------------------------------------------------------------ statistics
    def stats(self) -> dict[str, float]:
        """Pages used / free / cached / referenced, KV utilization, sharing, prefix counters.

        ``kv_utilization`` = tokens stored / (pages in use * page_size), a shared page's
        tokens counted once.
        """
        P = self.page_size
        # From the row arrays, not page by page in Python (the engine samples these every
        # few steps; 256 sequences of 1k tokens hold 16k pages). A page's tokens are the
        # most any sequence holding it has written there.
        rows = np.fromiter(self._seqs.values(), np.intp, len(self._seqs))
        live = rows[~self._swapped[rows]]
        ns = self._ntok[live]
        widths = -(-ns // P)
        referenced = int((widths - self._dropped[live]).sum())
        stored = 0
        if len(live):
            cols = np.arange(int(widths.max()))
            pages = self._table[live, : len(cols)]
            fills = np.minimum(P, ns[:, None] - cols * P)
            held = (cols < widths[:, None]) & (pages != NULL_PAGE) & (fills > 0)
            most = np.zeros(self.num_pages, np.int64)
            np.maximum.at(most, pages[held], fills[held])
            stored = int(most.sum())
        refcount = self._refcount
        used = len(refcount) - refcount.count(0)
        return {
            "pages_total": self.num_pages - 1,
            "pages_used": used,
            "pages_free": len(self._free),
            "pages_cached": len(self._page_key),
            "pages_cached_unused": len(self._evictable),
            "pages_shared": used - refcount.count(1),
            # Sum of block-table lengths: the pages an unshared layout would need.
            "pages_referenced": referenced,
            "tokens_stored": stored,
            "kv_utilization": stored / (used * P) if used else 1.0,
            "prefix_queries": self._prefix_queries,
            "prefix_hits": self._prefix_hits,
            "prefix_hit_rate": self._prefix_hits / self._prefix_queries
            if self._prefix_queries
            else 0.0,
            "evictions": self._evictions,
            "host_pages_used": self.num_host_pages - len(self._host_free),
            "num_seqs": len(self._seqs),
        }

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Recounts everything from the block tables; raises AssertionError on any drift.

        For tests and debugging (cost linear in pages and tokens).
        """
        counts = [0] * self.num_pages
        host_counts = [0] * self.num_host_pages
        for row in self._seqs.values():
            n, dropped = int(self._ntok[row]), int(self._dropped[row])
            pages = self._table[row, : self._npages(row)].tolist()
            swapped = bool(self._swapped[row])
            gone = NULL_PAGE if not swapped else _DROPPED_SLOT
            assert all(p == gone for p in pages[:dropped]), "dropped entry reused"
            assert gone not in pages[dropped:], "live entry dropped"
            w = int(self._win[row])
            if w:
                dead = (int(self._ncomp[row]) - w + 1) // self.page_size
                assert dropped == max(dead, 0), "window drop drift"
            else:
                assert dropped == 0
            for p in pages[dropped:]:
                if swapped:
                    host_counts[p] += 1
                else:
                    counts[p] += 1
            assert not self._table[row, len(pages) :].any(), "tables() row tail not zero"
            assert self._ncomp[row] <= n <= self._tok.shape[1]
            assert (self._tok[row, n:] == -1).all(), "a cell past the tokens not -1"
            assert self._resv[row] < n, "reserved mark past the tokens"
            assert self._nhash[row] <= self._ncomp[row] // self.page_size, "hashed drift"
        assert counts == self._refcount, "refcount != block-table references"
        rows = list(self._seqs.values())
        assert sorted(rows + self._free_rows) == list(range(self._table.shape[0])), "row drift"
        assert not self._table[self._free_rows].any(), "a free row of tables() not zero"
        assert (self._tok[self._free_rows] == -1).all(), "a free row's token ids not -1"
        assert host_counts == self._host_refcount, "host refcount drift"
        assert counts[NULL_PAGE] == 0 and NULL_PAGE not in self._free, "null page handed out"
        free = set(self._free)
        assert len(free) == len(self._free), "page twice in the free list"
        for p in range(1, self.num_pages):
            in_free, in_evict = p in free, p in self._evictable
            in_deferred = p in self._deferred
            assert (counts[p] == 0) == (in_free or in_evict or in_deferred), (
                f"page {p}: free/used mismatch"
            )
            assert in_deferred <= (p in self._pending_src), f"page {p}: deferred for no copy"
            assert not (in_free and in_evict), f"page {p}: both free and evictable"
            assert in_evict <= (p in self._page_key), f"page {p}: evictable but not cached"
            assert not (in_free and p in self._page_key), f"page {p}: free but still cached"
        assert len(self._cached) == len(self._page_key) == len(self._page_tokens)
        for key, p in self._cached.items():
            assert self._page_key[p] == key
        assert set(self._host_free) == {
            s for s in range(self.num_host_pages) if host_counts[s] == 0
        }
        for dst, src in self._pending.items():
            assert counts[dst] > 0, f"pending copy into unreferenced page {dst}"
            assert src not in free and src not in self._evictable, f"copy source {src} reusable"


def layer_groups(windows: Sequence[int | None]) -> tuple[tuple[int | None, ...], tuple, tuple]:
    """Splits a decoder's layers into groups that share page tables (a hybrid pool).

    ``windows[l]`` is layer l's sliding window (None: full attention). Every group holds
    ``k`` layers of one window, so a page (``k`` layer slots) serves any group: layers of
    each window, in order, fill groups of ``k`` (the last one may have empty slots).
    ``k`` is the largest divisor of the number of full-attention layers that is no larger
    than the smallest count of any window (so full-attention pages, which grow with the
    context, waste no slot); without full-attention layers, that smallest count.

    Returns ``(group_windows, layer_group, layer_slot)``: each group's window, then each
    layer's group and its slot within a page (``0 <= slot < k``; ``k = max(slot) + 1``).
    """
    windows = tuple(None if w is None else int(w) for w in windows)
    if not windows:
        raise ValueError("windows: expected at least one layer, got none")
    kinds = list(dict.fromkeys(windows))  # in order of first appearance
    counts = {w: windows.count(w) for w in kinds}
    k = min(counts.values())
    full = counts.get(None, 0)
    if full:
        k = max(d for d in range(1, k + 1) if full % d == 0)
    group_windows: list[int | None] = []
    first_group = {}
    for w in kinds:
        first_group[w] = len(group_windows)
        group_windows += [w] * -(-counts[w] // k)
    seen = dict.fromkeys(kinds, 0)
    layer_group, layer_slot = [], []
    for w in windows:
        r = seen[w]
        seen[w] = r + 1
        layer_group.append(first_group[w] + r // k)
        layer_slot.append(r % k)
    return tuple(group_windows), tuple(layer_group), tuple(layer_slot)


class HybridBlockManager:
    """A ``BlockManager`` for a cache whose layers form groups with page tables of their
    own (``layer_groups``): one pool, and per sequence one table per group. A sliding-window
    group's table drops pages once they leave the window, so sliding layers hold about a
    window of pages per sequence instead of the whole context (vLLM's hybrid allocator).

    The methods the engine and scheduler use act on every group of a sequence at once
    and keep them in step: the same tokens, the same computed count (prefix hits are the
    shortest of the groups'), all or nothing. Arrays gain a leading group axis:
    ``pages_np`` is ``i32[G, pages]`` and ``slots`` ``i32[G, n]``. Sequences of the inner
    manager are named ``(seq_id, group)``; ``inner`` is that manager (pool-wide counts).

    Args:
      group_windows: each group's sliding window (None: full attention).
      Others as ``BlockManager``.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        group_windows: Sequence[int | None],
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
        num_host_pages: int = 0,
    ):
        group_windows = tuple(group_windows)
        if not group_windows:
            raise ValueError("group_windows: expected at least one group, got none")
        for w in group_windows:
            if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
                raise ValueError(f"group_windows: expected None or ints >= 1, got {w!r}")
        self.inner = BlockManager(
            num_pages,
            page_size,
            enable_prefix_caching=enable_prefix_caching,
            watermark=watermark,
            num_host_pages=num_host_pages,
        )
        self.group_windows = group_windows
        self.num_groups = len(group_windows)
        self.num_pages = self.inner.num_pages
        self.page_size = self.inner.page_size
        self.enable_prefix_caching = self.inner.enable_prefix_caching
        self.watermark = self.inner.watermark
        self.watermark_pages = self.inner.watermark_pages
        self.num_host_pages = self.inner.num_host_pages
        self._ids: dict[Hashable, None] = {}

    def _each(self, seq_id: Hashable) -> list[tuple]:
        if seq_id not in self._ids:
            raise UnknownSequence(f"seq_id {seq_id!r}: unknown (never allocated, or already freed)")
        return [(seq_id, g) for g in range(self.num_groups)]

    def _all(self, seq_ids: Iterable[Hashable]) -> list[tuple]:
        return [i for s in dict.fromkeys(seq_ids) for i in self._each(s)]

    # ------------------------------------------------------------------ queries
    @property
    def num_free_pages(self) -> int:
        return self.inner.num_free_pages

    @property
    def num_host_free_pages(self) -> int:
        return self.inner.num_host_free_pages

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._ids

    @property
    def seq_ids(self) -> list:
        return list(self._ids)

    @property
    def num_seqs(self) -> int:
        return len(self._ids)

    def num_tokens(self, seq_id: Hashable) -> int:
        return self.inner.num_tokens(self._each(seq_id)[0])

    def num_computed_tokens(self, seq_id: Hashable) -> int:
        return min(self.inner.num_computed_tokens(i) for i in self._each(seq_id))

    def token_ids(self, seq_id: Hashable) -> np.ndarray:
        return self.inner.token_ids(self._each(seq_id)[0])

    def token_buffer(self, seq_id: Hashable) -> np.ndarray:
        """The sequence's token buffer (its first ``num_tokens`` entries; do not modify)."""
        return self.inner.token_buffer((seq_id, 0))

    def set_token(self, seq_id: Hashable, index: int, token: int) -> None:
        """``BlockManager.set_token`` in every group."""
        for i in self._each(seq_id):
            self.inner.set_token(i, index, token)

    def block_table(self, seq_id: Hashable) -> list[list[int]]:
        """Each group's pages in order (host slots while swapped out; dropped pages are
        ``NULL_PAGE``, or -1 while swapped out)."""
        return [self.inner.block_table(i) for i in self._each(seq_id)]

    def host_slots(self, seq_id: Hashable) -> list[int]:
        """The host slots a swapped-out sequence holds, every group's."""
        return [s for i in self._each(seq_id) for s in self.inner.host_slots(i)]

    def is_swapped(self, seq_id: Hashable) -> bool:
        return self.inner.is_swapped(self._each(seq_id)[0])

    def refcount(self, page: int) -> int:
        return self.inner.refcount(page)

    def host_refcount(self, slot: int) -> int:
        return self.inner.host_refcount(slot)

    def slots(self, seq_id: Hashable, start: int, stop: int) -> np.ndarray:
        """``i32[G, stop - start]``: each group's slots of tokens [start, stop)."""
        return np.stack([self.inner.slots(i, start, stop) for i in self._each(seq_id)])

    def pages_np(self, seq_id: Hashable) -> np.ndarray:
        """``i32[G, pages]``: the groups' block tables (dropped entries ``NULL_PAGE``)."""
        return np.stack([self.inner.pages_np(i) for i in self._each(seq_id)])

    # ------------------------------------------------------------------ admission checks
    def pages_needed(self, num_tokens: int) -> int:
        """Pages a new sequence of ``num_tokens`` takes (every group holds the whole prompt
        until its tokens are computed)."""
        return self.num_groups * self.inner.pages_needed(num_tokens)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.num_free_pages - self.pages_needed(num_tokens) >= self.watermark_pages

    def can_append(self, seq_ids: Iterable[Hashable], num_tokens: int = 1) -> bool:
        return self.inner.can_append(self._all(seq_ids), num_tokens)

    # ------------------------------------------------------------------ lifecycle
    def _root(self, extra_key: Any, g: int) -> Any:
        return ("layer group", g, extra_key)  # each group's pages cached apart

    def allocate(
        self, seq_id: Hashable, token_ids: Sequence[int] | np.ndarray, *, extra_key: Any = None
    ) -> int:
        """Allocates every group's pages (``BlockManager.allocate``); returns the cached
        tokens, the fewest any group found. Raises ``OutOfPages`` changing nothing."""
        if seq_id in self._ids:
            raise DuplicateSequence(f"allocate: seq_id {seq_id!r} is already live")
        tokens = _as_tokens(token_ids)
        if len(tokens) == 0:
            raise ValueError("token_ids: expected at least one token, got an empty prompt")
        inner, G = self.inner, self.num_groups
        cached = min(
            inner.cached_tokens(tokens, extra_key=self._root(extra_key, g)) for g in range(G)
        )
        # Every group's hits are held before any group takes a fresh page: a fresh page
        # may come from the LRU of cached pages, and must not be another group's hit
        # (the groups would then disagree on what is computed, and the engine would skip
        # K/V one group never had). Held, they no longer count as free below.
        pinned = [
            page
            for g in range(G)
            for page in inner._lookup(
                tokens, prefix_root_key(self._root(extra_key, g)), cached // self.page_size
            )[0]
        ]
        revived = len({page for page in pinned if inner.refcount(page) == 0})
        fresh = G * (inner.pages_needed(len(tokens)) - cached // self.page_size)
        if fresh > inner.num_free_pages - revived:  # checked before anything changes
            raise OutOfPages(
                f"allocate: seq_id {seq_id!r} needs {fresh} new pages for {len(tokens)} tokens "
                f"in {G} layer groups ({cached} tokens cached), "
                f"{inner.num_free_pages - revived} available"
            )
        for page in pinned:
            inner._ref(page)
        done = []
        try:
            for g, w in enumerate(self.group_windows):
                got = inner.allocate(
                    (seq_id, g),
                    tokens,
                    extra_key=self._root(extra_key, g),
                    sliding_window=w,
                    max_cached_tokens=cached,
                )
                done.append((seq_id, g))
                if got != cached:  # cannot happen with the hits held; never skip unwritten K/V
                    raise RuntimeError(
                        f"allocate: layer group {g} of seq_id {seq_id!r} found {got} cached "
                        f"tokens, the others {cached}"
                    )
        except BaseException:
            for i in done:
                inner.free(i)
            raise
        finally:
            for page in pinned:
                inner._unref(page)
        self._ids[seq_id] = None
        return cached

    def append_slots(self, seq_id: Hashable, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """``i32[G, len(token_ids)]`` slots; every group or none (``OutOfPages``)."""
        ids = self._each(seq_id)
        if not self.inner.can_append(ids, len(token_ids)):
            raise OutOfPages(
                f"append_slots: seq_id {seq_id!r} needs "
                f"{self.inner._append_need(ids, len(token_ids))} pages for "
                f"{len(token_ids)} tokens, {self.num_free_pages} available"
            )
        return np.stack([self.inner.append_slots(i, token_ids) for i in ids])

    def append_tokens(self, seq_ids: Sequence[Hashable] | SeqRows, tokens: Sequence[int]) -> bool:
        """``BlockManager.append_tokens`` in every group: all of them or none."""
        if len(seq_ids) != len(tokens):
            raise ValueError(
                f"tokens: expected one per sequence ({len(seq_ids)}), got {len(tokens)}"
            )
        if not self.can_append(seq_ids):
            return False
        for seq_id, token in zip(seq_ids, tokens, strict=True):
            self.append_slots(seq_id, [int(token)])
        return True

    def mark_computed(self, seq_id: Hashable, num_tokens: int) -> None:
        for i in self._each(seq_id):
            self.inner.mark_computed(i, num_tokens)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        ids = self._each(parent_id)
        if child_id in self._ids:
            raise DuplicateSequence(f"fork: seq_id {child_id!r} is already live")
        for g, i in enumerate(ids):
            self.inner.fork(i, (child_id, g))
        self._ids[child_id] = None

    def free(self, seq_id: Hashable) -> None:
        for i in reversed(self._each(seq_id)):
            self.inner.free(i)
        del self._ids[seq_id]

    def take_copies(self) -> tuple[np.ndarray, np.ndarray]:
        return self.inner.take_copies()

    # ------------------------------------------------------------------ swapping
    def can_swap_out(self, seq_ids: Iterable[Hashable]) -> bool:
        return self.inner.can_swap_out(self._all(seq_ids))

    def can_swap_in(self, seq_ids: Iterable[Hashable]) -> bool:
        return self.inner.can_swap_in(self._all(seq_ids))

    def swap_out(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        return self.inner.swap_out(self._all(seq_ids))

    def swap_in(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        return self.inner.swap_in(self._all(seq_ids))

    # ------------------------------------------------------------------ statistics
    def stats(self) -> dict[str, float]:
        """``BlockManager.stats`` of the pool (tokens and tables counted per group), with
        ``num_seqs`` counting sequences and ``layer_groups`` the number of groups."""
        out = self.inner.stats()
        out["num_seqs"] = len(self._ids)
        out["layer_groups"] = self.num_groups
        return out

    def check_invariants(self) -> None:
        self.inner.check_invariants()
        assert len(self.inner._seqs) == self.num_groups * len(self._ids), "group drift"
        for s in self._ids:
            ids = self._each(s)
            n = {self.inner.num_tokens(i) for i in ids}
            c = {self.inner.num_computed_tokens(i) for i in ids}
            assert len(n) == 1 and len(c) == 1, f"seq {s!r}: groups out of step"
