"""``BlockManager``: the page pool and the sequences' block tables (allocation on demand,
reference counts, copy-on-write, step boundaries), made of parts it owns: the pool's
pages (``pool.py``, ``PagePool``; the host's slots, ``HostSlots``), the prefix cache
(``prefix.py``), the sequences' rows of arrays (``rows.py``), the per-step operations that
grow sequences and mark their tokens computed (``appends.py``), swap plans
(``swap.py``); statistics and invariants read them all (``stats.py``). No JAX."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import numpy as np

from . import stats as _stats
from ._common import DuplicateSequence, InvalidSequenceState, OutOfPages, SeqRows, _as_tokens
from .appends import Appender
from .events import AllBlocksCleared
from .pool import HostSlots, PagePool
from .prefix import PrefixCache, prefix_root_key
from .rows import SequenceRows
from .swap import Swapper


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

    Parts (attributes): ``rows`` (``SequenceRows``: each sequence's table, token ids and
    counts as a row of arrays, which ``paged_jax.batch`` gathers), ``pool``
    (``PagePool``), ``prefix`` (``PrefixCache``), ``host`` (``HostSlots``),
    ``appender`` (``Appender``) and ``swapper`` (``Swapper``).
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
        self.prefix = PrefixCache(self.page_size, self.enable_prefix_caching)
        self.pool = PagePool(self.num_pages, self.prefix)
        self.rows = SequenceRows(self.page_size)
        self.host = HostSlots(self.num_host_pages)
        self.appender = Appender(self.rows, self.pool, self.prefix)
        self.swapper = Swapper(self.rows, self.pool, self.host, self.appender)

    # ------------------------------------------------------------------ events
    def record_events(self, cleared: bool = False) -> None:
        """From now on, records the prefix cache's pages entered and evicted
        (``events.BlockStored`` / ``BlockRemoved``) for ``take_events``; ``cleared``: the
        first event is ``AllBlocksCleared`` (this manager replaces one whose cache is
        gone). Nothing is recorded without prefix caching."""
        if self.prefix.events is None:
            self.prefix.events = [AllBlocksCleared()] if cleared else []

    def take_events(self) -> list:
        """The events recorded since the last call, oldest first (empty when not recording)."""
        events = self.prefix.events
        if not events:
            return []
        self.prefix.events = []
        return events

    # ------------------------------------------------------------------ queries
    @property
    def num_free_pages(self) -> int:
        """Pages that can be handed out now: free plus evictable cached pages."""
        return self.pool.num_free

    @property
    def num_host_free_pages(self) -> int:
        return len(self.host.free)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self.rows.ids

    @property
    def seq_ids(self) -> list:
        return list(self.rows.ids)

    @property
    def num_seqs(self) -> int:
        """Sequences held (``len(seq_ids)`` without the list)."""
        return len(self.rows.ids)

    def seq_rows(self, seq_ids: Sequence[Hashable]) -> SeqRows:
        """Distinct sequences on the device with their rows, for batched calls made again
        and again for the same sequences (``SeqRows``). Raises as ``append_tokens``."""
        return self.rows.seq_rows(seq_ids)

    def num_tokens(self, seq_id: Hashable) -> int:
        """Tokens of the sequence that have slots (prompt plus appended tokens)."""
        return int(self.rows.ntok[self.rows.row(seq_id)])

    def num_computed_tokens(self, seq_id: Hashable) -> int:
        """Leading tokens whose K/V are on the device (cached or marked computed)."""
        return int(self.rows.ncomp[self.rows.row(seq_id)])

    def token_ids(self, seq_id: Hashable) -> np.ndarray:
        """``i32[num_tokens]``: a copy of the sequence's token ids."""
        row = self.rows.row(seq_id)
        return self.rows.tok[row, : self.rows.ntok[row]].copy()

    def token_buffer(self, seq_id: Hashable) -> np.ndarray:
        """The sequence's token ids as a view of its row (its first ``num_tokens``
        entries; do not modify it; valid until the manager next changes)."""
        return self.rows.tok[self.rows.row(seq_id)]

    def set_token(self, seq_id: Hashable, index: int, token: int) -> None:
        """Replaces token ``index`` of the sequence, one whose K/V is not computed yet.

        For a token appended before its value was known (the engine's overlapped steps
        append a placeholder for the token the running step samples): its page is not
        in the prefix cache until the token is marked computed, so the value it is
        hashed with is this one. Raises ``ValueError`` for a computed or absent index.
        """
        r = self.rows
        row = r.row(seq_id)
        done, n = int(r.ncomp[row]), int(r.ntok[row])
        if not done <= index < n:
            raise ValueError(
                f"index: expected a token not yet computed, in [{done}, {n}), got {index}"
            )
        r.tok[row, index] = token

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The sequence's pages in order (host slots while it is swapped out)."""
        row = self.rows.row(seq_id)
        return self.rows.table[row, : self.rows.npages(row)].tolist()

    def is_swapped(self, seq_id: Hashable) -> bool:
        return bool(self.rows.swapped[self.rows.row(seq_id)])

    def host_slots(self, seq_id: Hashable) -> list[int]:
        """The host slots a swapped-out sequence holds (none while it is on the device)."""
        row = self.rows.row(seq_id)
        return self.rows.live(row) if self.rows.swapped[row] else []

    def refcount(self, page: int) -> int:
        return self.pool.refcount[page]

    def host_refcount(self, slot: int) -> int:
        """Sequences holding host slot ``slot`` (0: free, its swapped data can be dropped)."""
        return self.host.refcount[slot]

    def slots(self, seq_id: Hashable, start: int, stop: int) -> np.ndarray:
        """``i32[stop - start]``: slots (page * page_size + offset) of tokens [start, stop)."""
        r = self.rows
        row = r.device_row(seq_id, "slots")
        n = int(r.ntok[row])
        if not 0 <= start <= stop <= n:
            raise ValueError(
                f"slots: expected 0 <= start <= stop <= num_tokens={n}, got "
                f"start={start}, stop={stop}"
            )
        pos = np.arange(start, stop, dtype=np.int32)
        table = r.table[row, : r.npages(row)]
        return table[pos // self.page_size] * self.page_size + pos % self.page_size

    def pages_np(self, seq_id: Hashable) -> np.ndarray:
        """``i32[num_pages_of_seq]``: the block table as an array, a view of its row of
        ``tables()`` (do not modify it; it follows the table until the array grows)."""
        row = self.rows.device_row(seq_id, "pages_np")
        return self.rows.table[row, : self.rows.npages(row)]

    def tables(self) -> np.ndarray:
        """``i32[R, C]``: every sequence's block table as a row (its pages, host slots
        while swapped out, then zeros); rows of no sequence are zeros. Updated in place as
        tables change, and replaced by a larger array when a table grows past ``C``
        entries or more than ``R`` sequences exist: read it again after changing the
        manager, and never modify it."""
        return self.rows.table

    def table_row(self, seq_id: Hashable) -> int:
        """The sequence's row of ``tables()`` (fixed from its allocation to its ``free``)."""
        return self.rows.row(seq_id)

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
        need = 0
        for seq_id in seq_ids:
            row = self.rows.device_row(seq_id, "can_append")
            need += self.appender.pages_for_append(row, num_tokens)
        return need <= self.num_free_pages

    def cached_tokens(self, token_ids: Sequence[int] | np.ndarray, *, extra_key: Any = None) -> int:
        """Leading tokens of a prompt that ``allocate`` would find cached now (a multiple of
        ``page_size``, smaller than ``len(token_ids)``); changes nothing."""
        tokens = _as_tokens(token_ids)
        root = prefix_root_key(extra_key) if self.enable_prefix_caching else b""
        hits, _ = self.prefix.lookup(tokens, root, max(len(tokens) - 1, 0) // self.page_size)
        return len(hits) * self.page_size

    def _check_new_id(self, seq_id: Hashable, op: str) -> None:
        if seq_id in self.rows.ids:
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
        hits, key = self.prefix.lookup(tokens, root, limit)
        pool = self.pool
        # hits on cached pages nobody holds (they leave the evictable set)
        revived = sum(1 for page in hits if pool.refcount[page] == 0)
        fresh = self.pages_needed(n) - len(hits)
        reusable = len(pool.free) + len(pool.evictable) - revived
        if fresh > reusable:
            raise OutOfPages(
                f"allocate: seq_id {seq_id!r} needs {fresh} new pages for {n} tokens "
                f"({len(hits)} pages cached), {reusable} available"
            )
        if self.enable_prefix_caching:
            self.prefix.queries += (n - 1) // P
            self.prefix.hits += len(hits)
        for page in hits:
            pool.ref(page)
        pages = hits + [pool.take() for _ in range(fresh)]
        r = self.rows
        row = r.add(seq_id, tokens, pages, root, sliding_window or 0)
        r.ncomp[row] = len(hits) * P
        r.nhash[row] = len(hits)
        r.key[row] = key
        self.appender.drop_out_of_window(row)  # hits no prompt token reads
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
        r = self.rows
        row = r.device_row(seq_id, "append_slots")
        P = self.page_size
        n = int(r.ntok[row])
        last = int(r.last[row])
        # (tokens of earlier steps are computed, whether or not this append fits)
        self.appender.first_appends(np.array([row], np.intp))
        fill = n % P
        # Fast path (a decode step): one token into an exclusively owned, partially
        # filled page that has room in the token ids' row.
        if (
            fill
            and type(token_ids) in (list, tuple)
            and len(token_ids) == 1
            and type(token_ids[0]) is int
            and n < r.tok.shape[1]
        ):
            page = int(r.table[row, n // P])
            if self.pool.refcount[page] == 1:
                r.tok[row, n] = token_ids[0]
                r.ntok[row] = n + 1
                return np.array([page * P + fill], np.int32)
        tokens = _as_tokens(token_ids)
        num_new = len(tokens)
        need = self.appender.pages_for_append(row, num_new)
        if need > self.num_free_pages:
            r.last[row] = last  # nothing appended this step (swap_out may take it)
            raise OutOfPages(
                f"append_slots: seq_id {seq_id!r} needs {need} pages for {num_new} tokens, "
                f"{self.num_free_pages} available"
            )
        self.appender.grow(row, tokens)
        return self.slots(seq_id, n, n + num_new)

    def mark_computed(self, seq_id: Hashable, num_tokens: int) -> None:
        """Declares the K/V of the sequence's first ``num_tokens`` tokens written.

        Call after each prefill chunk; their full pages become prefix-cache entries that
        later prompts can share. (``append_slots`` does this for all earlier tokens.)
        """
        row = self.rows.device_row(seq_id, "mark_computed")
        n = int(self.rows.ntok[row])
        if not 0 <= num_tokens <= n:
            raise ValueError(f"num_tokens: expected 0 <= num_tokens <= {n}, got {num_tokens}")
        self.appender.mark_computed(row, num_tokens)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """The child shares every page of the parent (reference counts only, no copy).

        The parent's K/V must all be written: fork after the step that computed its
        tokens (a prompt: after ``mark_computed``), before appending this step's token.
        """
        r = self.rows
        prow = r.device_row(parent_id, "fork")
        self._check_new_id(child_id, "fork")
        self.appender.sync_computed(prow)
        n, done = int(r.ntok[prow]), int(r.ncomp[prow])
        if done < n:
            # A later copy-on-write of a shared page would copy it as it was before the
            # step, without the K/V this step is about to write: refuse instead.
            raise InvalidSequenceState(
                f"fork: seq_id {parent_id!r} has {n - done} tokens whose K/V are not "
                f"written yet ({done} of {n} computed); fork before appending, or after "
                "the step that computes them (mark_computed for a prompt)"
            )
        dropped = int(r.dropped[prow])
        pages = r.table[prow, : r.npages(prow)].tolist()
        for page in pages[dropped:]:
            self.pool.ref(page)
        tokens = r.tok[prow, :n].copy()
        row = r.add(child_id, tokens, pages, r.root[prow], int(r.win[prow]))
        for name in ("ncomp", "resv", "last", "nhash", "dropped"):
            a = getattr(r, name)
            a[row] = a[prow]
        r.key[row] = r.key[prow]

    def free(self, seq_id: Hashable) -> None:
        """Releases the sequence's pages (device or host). Full cached pages stay cached.

        Pages are released last first, so a chain's tail is evicted before its head.
        """
        r = self.rows
        row = r.row(seq_id)
        live = r.live(row)
        swapped = bool(r.swapped[row])
        r.drop(seq_id, row)
        if swapped:
            for slot in live:
                self.host.unref(slot)
            return
        for page in reversed(live):
            self.pool.unref(page)

    def take_copies(self) -> tuple[np.ndarray, np.ndarray]:
        """Copy-on-write copies queued since the last call: ``(src i32[n], dst i32[n])``.

        Marks a step boundary: call it exactly once per engine step, after scheduling
        (``build_batch`` does), and apply the copies with ``PagedKVCache.copy_pages`` before
        the step's K/V writes. The step must write the K/V of every token appended since
        the previous boundary.
        """
        copies = self.pool.take_copies()
        self.rows.step += 1
        return copies

    # ------------------------------------------------------------------ the parts'
    def append_tokens(self, seq_ids, tokens: Sequence[int]) -> bool:
        """One token appended to each of ``seq_ids``, all or none (``Appender``)."""
        return self.appender.append_tokens(seq_ids, tokens)

    def reserve_tokens(self, seq_ids, counts: Sequence[int]) -> bool:
        """Placeholders for a multi-step launch's samples, all or none (``Appender``)."""
        return self.appender.reserve_tokens(seq_ids, counts)

    def fill_reserved(self, seq_ids, starts, tokens, *, counts=None) -> None:
        """Reserved tokens given their values and marked computed (``Appender``)."""
        self.appender.fill_reserved(seq_ids, starts, tokens, counts=counts)

    def truncate(self, seq_id: Hashable, num_tokens: int, *, computed: bool = False) -> None:
        """The sequence's tokens from ``num_tokens`` on dropped (``Appender``)."""
        self.appender.truncate(seq_id, num_tokens, computed=computed)

    def can_swap_out(self, seq_ids: Iterable[Hashable]) -> bool:
        return self.swapper.can_swap_out(seq_ids)

    def can_swap_in(self, seq_ids: Iterable[Hashable]) -> bool:
        return self.swapper.can_swap_in(seq_ids)

    def swap_out(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """A group moved to host slots, all or nothing (``Swapper.swap_out``)."""
        return self.swapper.swap_out(seq_ids)

    def swap_in(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """A swapped-out group brought back, all or nothing (``Swapper.swap_in``)."""
        return self.swapper.swap_in(seq_ids)

    def stats(self) -> dict[str, float]:
        """Pages used / free / cached / referenced, KV utilization, sharing, prefix
        counters (``stats.stats``)."""
        return _stats.stats(self)

    def check_invariants(self) -> None:
        """Recounts everything from the block tables; raises AssertionError on any drift
        (``stats.check_invariants``)."""
        _stats.check_invariants(self)
