"""``BlockManager``: the page pool and the sequences' block tables (allocation on demand,
reference counts, copy-on-write, step boundaries), with parts of its own in their
modules: the sequences' rows of arrays and the batched operations over them
(``rows.py``), prefix-cache lookups (``prefix.py``), swap plans (``swap.py``), statistics
and invariants (``stats.py``). No JAX."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import numpy as np

from ._common import (
    NULL_PAGE,
    DuplicateSequence,
    InvalidSequenceState,
    OutOfPages,
    SeqRows,
    UnknownSequence,
    _as_tokens,
)
from .prefix import PrefixCache, prefix_root_key
from .rows import SequenceRows
from .stats import Statistics
from .swap import Swapping


class BlockManager(SequenceRows, PrefixCache, Swapping, Statistics):
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
        last = int(self._last[row])
        # (tokens of earlier steps are computed, whether or not this append fits)
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
            self._last[row] = last  # nothing appended this step (swap_out may take it)
            raise OutOfPages(
                f"append_slots: seq_id {seq_id!r} needs {need} pages for {num_new} tokens, "
                f"{self.num_free_pages} available"
            )
        self._grow(row, tokens)
        return self.slots(seq_id, n, n + num_new)

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
