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

import hashlib
from collections import OrderedDict
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


class _Tokens:
    """A growable int32 buffer of a sequence's token ids."""

    __slots__ = ("buf", "n")

    def __init__(self, tokens: np.ndarray):
        self.n = len(tokens)
        self.buf = np.empty(max(16, 2 * self.n), np.int32)
        self.buf[: self.n] = tokens

    def extend(self, tokens: np.ndarray | int) -> None:
        """Appends ``tokens``, or that many placeholders (-1) for an int."""
        m = self.n + (tokens if isinstance(tokens, int) else len(tokens))
        if m > len(self.buf):
            new = np.empty(2 * m, np.int32)
            new[: self.n] = self.buf[: self.n]
            self.buf = new
        self.buf[self.n : m] = -1 if isinstance(tokens, int) else tokens
        self.n = m

    def copy(self) -> _Tokens:
        return _Tokens(self.buf[: self.n])


class _Seq:
    __slots__ = (
        "pages",
        "tokens",
        "num_computed",
        "root",
        "last_key",
        "num_hashed",
        "swapped",
        "last_append_step",
        "reserved",
        "window",
        "dropped",
        "row",
    )

    def __init__(self, pages: list[int], tokens: _Tokens, root: bytes, window: int | None):
        # device pages, or host slots while swapped; the first `dropped` entries are
        # NULL_PAGE (host: _DROPPED_SLOT), pages no future token reads (sliding window)
        self.pages = pages
        self.tokens = tokens
        self.num_computed = 0  # leading tokens whose K/V are on the device
        self.root = root
        self.last_key = root  # key of page num_hashed - 1 (root when none)
        self.num_hashed = 0  # leading full pages whose keys are known
        self.swapped = False
        self.last_append_step = -1  # step of the latest append_slots (-1: never)
        # first reserved token not yet filled (reserve_tokens), or None: it and every
        # token after it are not computed, whatever step boundaries passed
        self.reserved: int | None = None
        self.window = window  # keys each token attends to (None: all)
        self.dropped = 0
        self.row = -1  # its row of BlockManager.tables() (-1: none)

    def filled(self) -> int:
        """Tokens before the first reserved one not yet filled (all of them if none)."""
        return self.tokens.n if self.reserved is None else self.reserved


def _as_tokens(token_ids, name: str = "token_ids") -> np.ndarray:
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name}: expected integer token ids, got dtype {arr.dtype}")
    return arr.astype(np.int32, copy=False)


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
        self._seqs: dict[Hashable, _Seq] = {}
        # Every sequence's block table is also a row of one array (_Seq.row), kept equal
        # to its pages (zeros after them) as they change: a step's tables are one gather
        # (build_batch, advance_batch), not one list per sequence. Rows and columns double
        # when a sequence or a table needs more.
        self._table = np.zeros((8, 8), np.int32)
        self._free_rows = list(range(7, -1, -1))
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

    def _seq(self, seq_id: Hashable) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequence(
                f"seq_id {seq_id!r}: unknown (never allocated, or already freed)"
            ) from None

    def _device_seq(self, seq_id: Hashable, op: str) -> _Seq:
        seq = self._seq(seq_id)
        if seq.swapped:
            raise InvalidSequenceState(f"{op}: seq_id {seq_id!r} is swapped out; swap_in first")
        return seq

    def num_tokens(self, seq_id: Hashable) -> int:
        """Tokens of the sequence that have slots (prompt plus appended tokens)."""
        return self._seq(seq_id).tokens.n

    def num_computed_tokens(self, seq_id: Hashable) -> int:
        """Leading tokens whose K/V are on the device (cached or marked computed)."""
        return self._seq(seq_id).num_computed

    def token_ids(self, seq_id: Hashable) -> np.ndarray:
        """``i32[num_tokens]``: a copy of the sequence's token ids."""
        seq = self._seq(seq_id)
        return seq.tokens.buf[: seq.tokens.n].copy()

    def set_token(self, seq_id: Hashable, index: int, token: int) -> None:
        """Replaces token ``index`` of the sequence, one whose K/V is not computed yet.

        For a token appended before its value was known (the engine's overlapped steps
        append a placeholder for the token the running step samples): its page is not
        in the prefix cache until the token is marked computed, so the value it is
        hashed with is this one. Raises ``ValueError`` for a computed or absent index.
        """
        seq = self._seq(seq_id)
        if not seq.num_computed <= index < seq.tokens.n:
            raise ValueError(
                f"index: expected a token not yet computed, in [{seq.num_computed}, "
                f"{seq.tokens.n}), got {index}"
            )
        seq.tokens.buf[index] = token

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The sequence's pages in order (host slots while it is swapped out)."""
        return list(self._seq(seq_id).pages)

    def is_swapped(self, seq_id: Hashable) -> bool:
        return self._seq(seq_id).swapped

    def host_slots(self, seq_id: Hashable) -> list[int]:
        """The host slots a swapped-out sequence holds (none while it is on the device)."""
        seq = self._seq(seq_id)
        return list(seq.pages[seq.dropped :]) if seq.swapped else []

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def host_refcount(self, slot: int) -> int:
        """Sequences holding host slot ``slot`` (0: free, its swapped data can be dropped)."""
        return self._host_refcount[slot]

    def slots(self, seq_id: Hashable, start: int, stop: int) -> np.ndarray:
        """``i32[stop - start]``: slots (page * page_size + offset) of tokens [start, stop)."""
        seq = self._device_seq(seq_id, "slots")
        if not 0 <= start <= stop <= seq.tokens.n:
            raise ValueError(
                f"slots: expected 0 <= start <= stop <= num_tokens={seq.tokens.n}, got "
                f"start={start}, stop={stop}"
            )
        pos = np.arange(start, stop, dtype=np.int32)
        table = self._table[seq.row, : len(seq.pages)]
        return table[pos // self.page_size] * self.page_size + pos % self.page_size

    def pages_np(self, seq_id: Hashable) -> np.ndarray:
        """``i32[num_pages_of_seq]``: the block table as an array, a view of its row of
        ``tables()`` (do not modify it; it follows the table until the array grows)."""
        seq = self._device_seq(seq_id, "pages_np")
        return self._table[seq.row, : len(seq.pages)]

    def tables(self) -> np.ndarray:
        """``i32[R, C]``: every sequence's block table as row ``_Seq.row`` (its pages,
        host slots while swapped out, then zeros); rows of no sequence are zeros. Updated
        in place as tables change, and replaced by a larger array when a table grows past
        ``C`` entries or more than ``R`` sequences exist: read it again after changing
        the manager, and never modify it."""
        return self._table

    def _add_row(self, seq: _Seq) -> None:
        """Gives a new sequence its row of ``tables()`` and writes its pages there."""
        if not self._free_rows:
            rows = self._table.shape[0]
            self._table = np.pad(self._table, ((0, rows), (0, 0)))
            self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
        seq.row = self._free_rows.pop()
        self._pages_changed(seq)

    def _drop_row(self, seq: _Seq) -> None:
        self._table[seq.row, : len(seq.pages)] = 0
        self._free_rows.append(seq.row)
        seq.row = -1

    def _pages_changed(self, seq: _Seq, start: int = 0) -> None:
        """``seq.pages`` changed from entry ``start`` on (grew, or entries replaced): its
        row of ``tables()`` follows."""
        pages = seq.pages
        n = len(pages)
        if n > self._table.shape[1]:
            width = 1 << (n - 1).bit_length()
            self._table = np.pad(self._table, ((0, 0), (0, width - self._table.shape[1])))
        if n - start == 1:  # the common change, one new page: a scalar write is 5x faster
            self._table[seq.row, start] = pages[start]
        elif start < n:
            self._table[seq.row, start:n] = pages[start:]

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
            need += self._pages_for_append(self._device_seq(seq_id, "can_append"), num_tokens)
        return need

    def _pages_for_append(self, seq: _Seq, num_new: int) -> int:
        n, P = seq.tokens.n, self.page_size
        fill = n % P
        need = self.pages_needed(n + num_new) - len(seq.pages)
        if fill and num_new and self._refcount[seq.pages[-1]] > 1:
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
        seq = _Seq(
            pages, _Tokens(tokens), root, None if sliding_window is None else int(sliding_window)
        )
        seq.num_computed = len(hits) * P
        seq.num_hashed = len(hits)
        seq.last_key = key
        self._seqs[seq_id] = seq
        self._add_row(seq)
        self._drop_out_of_window(seq)  # hits no prompt token reads
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
        seq = self._device_seq(seq_id, "append_slots")
        P = self.page_size
        toks = seq.tokens
        n = toks.n
        self._first_append(seq)
        pages = seq.pages
        fill = n % P
        # Fast path (a decode step): one token into an exclusively owned, partially
        # filled page that has room in the token buffer.
        if (
            fill
            and type(token_ids) in (list, tuple)
            and len(token_ids) == 1
            and type(token_ids[0]) is int
            and n < len(toks.buf)
            and self._refcount[pages[-1]] == 1
        ):
            toks.buf[n] = token_ids[0]
            toks.n = n + 1
            return np.array([pages[-1] * P + fill], np.int32)
        tokens = _as_tokens(token_ids)
        num_new = len(tokens)
        need = self._pages_for_append(seq, num_new)
        if need > self.num_free_pages:
            raise OutOfPages(
                f"append_slots: seq_id {seq_id!r} needs {need} pages for {num_new} tokens, "
                f"{self.num_free_pages} available"
            )
        self._grow(seq, tokens)
        return self.slots(seq_id, n, n + num_new)

    def _first_append(self, seq: _Seq) -> None:
        """At a sequence's first append of a step, every token it had before was computed
        by an earlier step (tokens appended within this step are not)."""
        if seq.last_append_step != self._step:
            seq.last_append_step = self._step
            done = seq.filled()
            if done > seq.num_computed:
                self._mark_computed(seq, done)

    def _grow(self, seq: _Seq, tokens: np.ndarray | int) -> None:
        """Appends ``tokens`` (an int: that many placeholders, -1) to ``seq``, whose pages
        for them were counted free: a shared partially filled last page is first replaced
        by a private copy (copy-on-write), then new pages are taken as the tokens need
        them."""
        pages, n = seq.pages, seq.tokens.n
        num_new = tokens if isinstance(tokens, int) else len(tokens)
        start = len(pages)  # the first entry that changes
        if n % self.page_size and num_new and self._refcount[pages[-1]] > 1:
            old = pages[-1]
            new = self._take_page()
            # `old` holds only K/V of earlier steps: fork refuses parents with unwritten
            # K/V, so a page written this step is never shared, and copies never chain.
            self._pending[new] = old
            self._pending_src[old] = self._pending_src.get(old, 0) + 1
            self._unref(old)
            pages[-1] = new
            start -= 1
        for _ in range(self.pages_needed(n + num_new) - len(pages)):
            pages.append(self._take_page())
        self._pages_changed(seq, start)
        seq.tokens.extend(tokens)

    def append_tokens(self, seq_ids: Sequence[Hashable], tokens: Sequence[int]) -> bool:
        """Appends ``tokens[i]`` to sequence ``seq_ids[i]``, all of them or none: returns
        False, changing nothing, when the pages they need together are not free.

        A decode step's appends in one call (``can_append`` and ``append_slots`` of one
        token each, without the slot arrays): the engine's scheduler runs this for every
        decoding group of every step.
        """
        if len(seq_ids) != len(tokens):
            raise ValueError(
                f"tokens: expected one per sequence ({len(seq_ids)}), got {len(tokens)}"
            )
        table, P, refcount = self._seqs, self.page_size, self._refcount
        seqs, need = [], 0
        for seq_id in seq_ids:
            seq = table.get(seq_id)
            if seq is None or seq.swapped:
                seq = self._device_seq(seq_id, "append_tokens")  # raises the typed error
            seqs.append(seq)
            if not seq.tokens.n % P or refcount[seq.pages[-1]] > 1:  # a new page, or CoW
                need += self._pages_for_append(seq, 1)
        if need > self.num_free_pages:
            return False
        for seq, token in zip(seqs, tokens, strict=True):
            self._first_append(seq)
            toks = seq.tokens
            n = toks.n
            if n % P and n < len(toks.buf) and refcount[seq.pages[-1]] == 1:
                toks.buf[n] = token  # the common case: room in an exclusively owned page
                toks.n = n + 1
            else:  # a new page, or a private copy of a shared last page
                self._grow(seq, np.array([token], np.int32))
        return True

    def reserve_tokens(self, seq_ids: Sequence[Hashable], counts: Sequence[int]) -> bool:
        """Appends ``counts[i]`` placeholder tokens (-1) to sequence ``seq_ids[i]``, all of
        them or none: returns False, changing nothing, when the pages they need together
        are not free.

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
        table, seqs, need = self._seqs, [], 0
        P, refcount = self.page_size, self._refcount
        ks = []
        # Runs for every row of every multi-step launch: _pages_for_append, _first_append
        # and _grow inlined for the common row, whose last page is its own or full, and the
        # new table entries written in one go at the end.
        for seq_id, k in zip(seq_ids, counts, strict=True):
            if type(k) is not int or k < 0:  # a plain int >= 0 passes on one check
                if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
                    raise ValueError(f"counts: expected ints >= 0, got {k!r} for {seq_id!r}")
                k = int(k)
            seq = table.get(seq_id)
            if seq is None or seq.swapped:
                seq = self._device_seq(seq_id, "reserve_tokens")  # raises the typed error
            seqs.append(seq)
            ks.append(k)
            n = seq.tokens.n
            if n % P and k and refcount[seq.pages[-1]] > 1:
                need += self._pages_for_append(seq, k)  # a copy-on-write too
            else:
                more = -(-(n + k) // P) - len(seq.pages)
                if more > 0:
                    need += more
        if need > self.num_free_pages:
            return False
        step, free = self._step, self._free
        at_row, at_col, new_pages = [], [], []  # table entries of the common rows' new pages
        for seq, k in zip(seqs, ks, strict=True):
            if not k:
                continue
            toks, pages = seq.tokens, seq.pages
            n = toks.n
            if seq.last_append_step != step:  # _first_append
                seq.last_append_step = step
                done = n if seq.reserved is None else seq.reserved
                if done > seq.num_computed:
                    self._mark_computed(seq, done)
            if seq.reserved is None:
                seq.reserved = n
            if (n % P and refcount[pages[-1]] > 1) or n + k > len(toks.buf):
                self._grow(seq, k)  # a copy-on-write, or a larger token buffer
                continue
            start = len(pages)
            for col in range(start, -(-(n + k) // P)):
                page = free.pop() if free else self._take_page()
                refcount[page] = 1
                pages.append(page)
                at_row.append(seq.row)
                at_col.append(col)
                new_pages.append(page)
            toks.buf[n : n + k] = -1
            toks.n = n + k
        if new_pages:
            width = max(at_col) + 1
            if width > self._table.shape[1]:  # as _pages_changed grows it
                grown = 1 << (width - 1).bit_length()
                self._table = np.pad(self._table, ((0, 0), (0, grown - self._table.shape[1])))
            self._table[at_row, at_col] = new_pages
        return True

    def fill_reserved(
        self,
        seq_ids: Sequence[Hashable],
        starts: Sequence[int],
        tokens: Sequence[np.ndarray] | np.ndarray,
        *,
        counts: Sequence[int] | None = None,
    ) -> None:
        """For each sequence, tokens ``[starts[i], starts[i] + c)`` (none of them computed
        yet) replaced by the first ``c = counts[i]`` of ``tokens[i]`` (all of them when
        ``counts`` is None; ``set_token`` for each), then every token up to them marked
        computed (``mark_computed``): a multi-step launch's reserved tokens
        (``reserve_tokens``), once it returned. ``tokens``: an int array per sequence, or
        ``i32[S, J]`` (row i sequence i's)."""
        if len(starts) != len(seq_ids) or len(tokens) != len(seq_ids):
            raise ValueError(
                f"starts, tokens: expected one per sequence ({len(seq_ids)}), got "
                f"{len(starts)} and {len(tokens)}"
            )
        if counts is None:
            counts = [len(t) for t in tokens]
        elif len(counts) != len(seq_ids):
            raise ValueError(
                f"counts: expected one per sequence ({len(seq_ids)}), got {len(counts)}"
            )
        table = self._seqs
        for seq_id, start, row, c in zip(seq_ids, starts, tokens, counts, strict=True):
            seq = table.get(seq_id)
            if seq is None or seq.swapped:
                seq = self._device_seq(seq_id, "fill_reserved")  # raises the typed error
            stop = start + c
            toks = seq.tokens
            if not seq.num_computed <= start <= stop <= toks.n or not 0 <= c <= len(row):
                if not 0 <= c <= len(row):
                    raise ValueError(
                        f"counts: expected 0 to {len(row)} (the tokens given) for "
                        f"{seq_id!r}, got {c}"
                    )
                raise ValueError(
                    f"starts: expected tokens not yet computed, within [{seq.num_computed}, "
                    f"{toks.n}) for {seq_id!r}, got [{start}, {stop})"
                )
            toks.buf[start:stop] = row[:c]
            if seq.reserved is not None and stop > seq.reserved:
                seq.reserved = stop if stop < toks.n else None
            self._mark_computed(seq, stop)

    def mark_computed(self, seq_id: Hashable, num_tokens: int) -> None:
        """Declares the K/V of the sequence's first ``num_tokens`` tokens written.

        Call after each prefill chunk; their full pages become prefix-cache entries that
        later prompts can share. (``append_slots`` does this for all earlier tokens.)
        """
        seq = self._device_seq(seq_id, "mark_computed")
        if not 0 <= num_tokens <= seq.tokens.n:
            raise ValueError(
                f"num_tokens: expected 0 <= num_tokens <= {seq.tokens.n}, got {num_tokens}"
            )
        self._mark_computed(seq, num_tokens)

    def _sync_computed(self, seq: _Seq) -> None:
        """Tokens appended in earlier steps are computed once a step boundary passed."""
        done = seq.filled()
        if 0 <= seq.last_append_step < self._step and seq.num_computed < done:
            self._mark_computed(seq, done)

    def _mark_computed(self, seq: _Seq, num_tokens: int) -> None:
        if num_tokens <= seq.num_computed:
            return
        seq.num_computed = num_tokens
        self._register(seq, num_tokens)
        self._drop_out_of_window(seq)

    def _drop_out_of_window(self, seq: _Seq) -> None:
        """Releases the leading pages no token from ``num_computed`` on can read: page i's
        last key ``(i + 1) P - 1`` lies before the window of position ``num_computed``."""
        if seq.window is None:
            return
        dead = (seq.num_computed - seq.window + 1) // self.page_size
        if dead <= seq.dropped:
            return
        pages, start = seq.pages, seq.dropped
        for i in range(start, dead):
            page, pages[i] = pages[i], NULL_PAGE
            self._unref(page)
        seq.dropped = dead
        self._pages_changed(seq, start)

    def _register(self, seq: _Seq, num_tokens: int) -> None:
        """Enters the sequence's full computed pages in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        P = self.page_size
        full = num_tokens // P
        if seq.num_hashed >= full:
            return
        buf = seq.tokens.buf
        key = seq.last_key
        for i in range(seq.num_hashed, full):
            chunk = buf[i * P : (i + 1) * P].tobytes()
            key = page_key(key, chunk)
            page = seq.pages[i]
            if page == NULL_PAGE:  # dropped outside the window (the chain goes on)
                continue
            if key not in self._cached and page not in self._page_key:
                self._cached[key] = page
                self._page_key[page] = key
                self._page_tokens[page] = chunk
            # else: an identical page is cached already (or this page is a hit); keep one.
        seq.last_key = key
        seq.num_hashed = full

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """The child shares every page of the parent (reference counts only, no copy).

        The parent's K/V must all be written: fork after the step that computed its
        tokens (a prompt: after ``mark_computed``), before appending this step's token.
        """
        parent = self._device_seq(parent_id, "fork")
        self._check_new_id(child_id, "fork")
        self._sync_computed(parent)
        if parent.num_computed < parent.tokens.n:
            # A later copy-on-write of a shared page would copy it as it was before the
            # step, without the K/V this step is about to write: refuse instead.
            raise InvalidSequenceState(
                f"fork: seq_id {parent_id!r} has {parent.tokens.n - parent.num_computed} "
                f"tokens whose K/V are not written yet ({parent.num_computed} of "
                f"{parent.tokens.n} computed); fork before appending, or after the step "
                "that computes them (mark_computed for a prompt)"
            )
        for page in parent.pages[parent.dropped :]:
            self._ref(page)
        child = _Seq(list(parent.pages), parent.tokens.copy(), parent.root, parent.window)
        child.dropped = parent.dropped
        child.num_computed = parent.num_computed
        child.last_key = parent.last_key
        child.num_hashed = parent.num_hashed
        child.last_append_step = parent.last_append_step
        child.reserved = parent.reserved
        self._seqs[child_id] = child
        self._add_row(child)

    def free(self, seq_id: Hashable) -> None:
        """Releases the sequence's pages (device or host). Full cached pages stay cached.

        Pages are released last first, so a chain's tail is evicted before its head.
        """
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        self._drop_row(seq)
        if seq.swapped:
            for slot in seq.pages[seq.dropped :]:
                self._host_refcount[slot] -= 1
                if self._host_refcount[slot] == 0:
                    self._host_free.append(slot)
            return
        for page in reversed(seq.pages[seq.dropped :]):
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
    def _group(self, seq_ids: Iterable[Hashable], swapped: bool, op: str) -> list[_Seq]:
        ids = list(dict.fromkeys(seq_ids))
        seqs = [self._seq(s) for s in ids]
        for s, seq in zip(ids, seqs, strict=True):
            if seq.swapped != swapped:
                where = "swapped out" if seq.swapped else "on the device"
                raise InvalidSequenceState(f"{op}: seq_id {s!r} is {where}")
        return seqs

    def can_swap_out(self, seq_ids: Iterable[Hashable]) -> bool:
        seqs = self._group(seq_ids, False, "can_swap_out")
        return len({p for seq in seqs for p in seq.pages[seq.dropped :]}) <= len(self._host_free)

    def can_swap_in(self, seq_ids: Iterable[Hashable]) -> bool:
        seqs = self._group(seq_ids, True, "can_swap_in")
        return len({p for seq in seqs for p in seq.pages[seq.dropped :]}) <= self.num_free_pages

    def swap_out(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """Moves a group of sequences to host slots, all or nothing.

        Returns ``[(device_page, host_slot), ...]``: read each device page to its host
        slot (``PagedKVCache.read_pages``) after this step's copies, before any write.
        A page shared inside the group goes to one host slot and comes back as one page.
        Raises ``OutOfPages`` when the host has too few free slots (nothing changes).
        """
        seqs = self._group(seq_ids, False, "swap_out")
        for seq_id, seq in zip(dict.fromkeys(seq_ids), seqs, strict=True):
            if seq.last_append_step == self._step:
                raise InvalidSequenceState(
                    f"swap_out: seq_id {seq_id!r} appended tokens this step whose K/V are "
                    "not written yet; preempt a sequence before appending to it"
                )
        distinct = list(dict.fromkeys(p for seq in seqs for p in seq.pages[seq.dropped :]))
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
        for seq in seqs:
            live = seq.pages[seq.dropped :]
            for page in live:
                self._host_refcount[to_host[page]] += 1
            seq.pages = [to_host[p] for p in seq.pages]
            seq.swapped = True
            self._pages_changed(seq)
            for page in reversed(live):
                self._unref(page)
        return plan

    def swap_in(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """Brings a swapped-out group back, all or nothing: ``[(host_slot, device_page)]``.

        Write each host slot's data into its device page (``PagedKVCache.write_pages``)
        before the step's model writes. Raises ``OutOfPages`` when the device lacks pages.
        """
        seqs = self._group(seq_ids, True, "swap_in")
        distinct = list(dict.fromkeys(s for seq in seqs for s in seq.pages[seq.dropped :]))
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
        for seq in seqs:
            for slot in seq.pages[seq.dropped :]:
                self._refcount[to_device[slot]] += 1
                self._host_refcount[slot] -= 1
                if self._host_refcount[slot] == 0:
                    self._host_free.append(slot)
            seq.pages = [to_device[s] for s in seq.pages]
            seq.swapped = False
            self._pages_changed(seq)
            # Re-register the restored full pages (their old device copies may be gone).
            seq.last_key, seq.num_hashed = seq.root, 0
            self._register(seq, seq.num_computed)
        return plan

    # ------------------------------------------------------------------ statistics
    def stats(self) -> dict[str, float]:
        """Pages used / free / cached / referenced, KV utilization, sharing, prefix counters.

        ``kv_utilization`` = tokens stored / (pages in use * page_size), a shared page's
        tokens counted once.
        """
        P = self.page_size
        # From the block-table array, not page by page in Python (the engine samples these
        # every few steps; 256 sequences of 1k tokens hold 16k pages). A page's tokens are
        # the most any sequence holding it has written there.
        live = [seq for seq in self._seqs.values() if not seq.swapped]
        referenced = sum(len(seq.pages) - seq.dropped for seq in live)
        stored = 0
        if live:
            rows = np.fromiter((seq.row for seq in live), np.intp, len(live))
            ns = np.fromiter((seq.tokens.n for seq in live), np.int64, len(live))
            widths = np.fromiter((len(seq.pages) for seq in live), np.int64, len(live))
            cols = np.arange(int(widths.max()))
            pages = self._table[rows, : len(cols)]
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
        for seq in self._seqs.values():
            gone = NULL_PAGE if not seq.swapped else _DROPPED_SLOT
            assert all(p == gone for p in seq.pages[: seq.dropped]), "dropped entry reused"
            assert gone not in seq.pages[seq.dropped :], "live entry dropped"
            if seq.window is not None:
                dead = (seq.num_computed - seq.window + 1) // self.page_size
                assert seq.dropped == max(dead, 0), "window drop drift"
            else:
                assert seq.dropped == 0
            if seq.swapped:
                for s in seq.pages[seq.dropped :]:
                    host_counts[s] += 1
            else:
                for p in seq.pages[seq.dropped :]:
                    counts[p] += 1
            assert len(seq.pages) == self.pages_needed(seq.tokens.n), "table length drift"
            row = self._table[seq.row]
            assert row[: len(seq.pages)].tolist() == seq.pages, "tables() row drift"
            assert not row[len(seq.pages) :].any(), "tables() row tail not zero"
            assert seq.num_computed <= seq.tokens.n
        assert counts == self._refcount, "refcount != block-table references"
        rows = [seq.row for seq in self._seqs.values()]
        assert sorted(rows + self._free_rows) == list(range(self._table.shape[0])), "row drift"
        assert not self._table[self._free_rows].any(), "a free row of tables() not zero"
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

    def num_tokens(self, seq_id: Hashable) -> int:
        return self.inner.num_tokens(self._each(seq_id)[0])

    def num_computed_tokens(self, seq_id: Hashable) -> int:
        return min(self.inner.num_computed_tokens(i) for i in self._each(seq_id))

    def token_ids(self, seq_id: Hashable) -> np.ndarray:
        return self.inner.token_ids(self._each(seq_id)[0])

    def token_buffer(self, seq_id: Hashable) -> np.ndarray:
        """The sequence's token buffer (its first ``num_tokens`` entries; do not modify)."""
        return self.inner._seqs[(seq_id, 0)].tokens.buf

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
        fresh = G * (inner.pages_needed(len(tokens)) - cached // self.page_size)
        if fresh > inner.num_free_pages:  # revived cached hits are counted as free
            raise OutOfPages(
                f"allocate: seq_id {seq_id!r} needs {fresh} new pages for {len(tokens)} tokens "
                f"in {G} layer groups ({cached} tokens cached), {inner.num_free_pages} available"
            )
        done = []
        try:
            for g, w in enumerate(self.group_windows):
                inner.allocate(
                    (seq_id, g),
                    tokens,
                    extra_key=self._root(extra_key, g),
                    sliding_window=w,
                    max_cached_tokens=cached,
                )
                done.append((seq_id, g))
        except OutOfPages:  # a revived hit counted twice above: undo the groups done
            for i in done:
                inner.free(i)
            raise
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

    def append_tokens(self, seq_ids: Sequence[Hashable], tokens: Sequence[int]) -> bool:
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
