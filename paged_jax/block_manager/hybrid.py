"""``HybridBlockManager``: one pool, a block table per layer group per sequence, sliding
groups dropping the pages their window has passed; and ``layer_groups``, which groups a
model's layers by window. No JAX."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import numpy as np

from ._common import DuplicateSequence, OutOfPages, SeqRows, UnknownSequence, _as_tokens
from .manager import BlockManager
from .prefix import prefix_root_key


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
        inner, G, P = self.inner, self.num_groups, self.page_size
        # Each group's cached pages of the prompt; the groups agree on the fewest. Every
        # group's hits are held before any group takes a fresh page: a fresh page may come
        # from the LRU of cached pages, and must not be another group's hit (the groups
        # would then disagree on what is computed, and the engine would skip K/V one group
        # never had). Held, they no longer count as free below.
        caching = inner.enable_prefix_caching
        roots = [prefix_root_key(self._root(extra_key, g)) if caching else b"" for g in range(G)]
        hits = [inner.prefix.lookup(tokens, root, (len(tokens) - 1) // P)[0] for root in roots]
        cached = min(map(len, hits)) * P
        pinned = [page for h in hits for page in h[: cached // P]]
        revived = len({page for page in pinned if inner.refcount(page) == 0})
        fresh = G * (inner.pages_needed(len(tokens)) - cached // self.page_size)
        if fresh > inner.num_free_pages - revived:  # checked before anything changes
            raise OutOfPages(
                f"allocate: seq_id {seq_id!r} needs {fresh} new pages for {len(tokens)} tokens "
                f"in {G} layer groups ({cached} tokens cached), "
                f"{inner.num_free_pages - revived} available"
            )
        for page in pinned:
            inner.pool.ref(page)
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
                inner.pool.unref(page)
        self._ids[seq_id] = None
        return cached

    def append_slots(self, seq_id: Hashable, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """``i32[G, len(token_ids)]`` slots; every group or none (``OutOfPages``)."""
        ids = self._each(seq_id)
        if not self.inner.can_append(ids, len(token_ids)):
            inner = self.inner
            need = sum(
                inner.appender.pages_for_append(inner.rows.row(i), len(token_ids)) for i in ids
            )
            raise OutOfPages(
                f"append_slots: seq_id {seq_id!r} needs {need} pages for "
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

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """``BlockManager.truncate`` in every group."""
        for i in self._each(seq_id):
            self.inner.truncate(i, num_tokens)

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
        assert self.inner.num_seqs == self.num_groups * len(self._ids), "group drift"
        for s in self._ids:
            ids = self._each(s)
            n = {self.inner.num_tokens(i) for i in ids}
            c = {self.inner.num_computed_tokens(i) for i in ids}
            assert len(n) == 1 and len(c) == 1, f"seq {s!r}: groups out of step"
