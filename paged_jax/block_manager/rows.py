"""A ``BlockManager``'s sequences as rows of arrays (block table, token ids, counts,
marks), grown by doubling, and the batched operations of every engine step over them:
``append_tokens`` (one decode token each), ``reserve_tokens`` and ``fill_reserved``
(a multi-step launch's placeholders, then their values). ``SequenceRows`` is that part of
the manager (a mixin over its arrays and page primitives). No JAX."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Hashable, Sequence

import numpy as np

from ._common import SeqRows, _as_tokens, _ragged, _spans, write_spans

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


class SequenceRows:
    """``BlockManager``'s rows of arrays and the batched operations over them (see the
    module docstring)."""

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

    def truncate(self, seq_id: Hashable, num_tokens: int, *, computed: bool = False) -> None:
        """Drops the sequence's tokens from ``num_tokens`` on, none of them computed: the
        rejected tail of speculative tokens (appended with ``append_slots``, their K/V
        written by a step that also computed what rejects them). Pages only the dropped
        tokens used go back to the pool; a page shared with another sequence is never
        among them (a copy-on-write already gave this one a private last page), and none
        of them was entered in the prefix cache (only computed pages are). Call it after
        the step returned and before the sequence's next append, then ``mark_computed``
        the tokens kept. ``computed=True`` may also drop computed tokens that no
        prefix-cache page holds (a draft model's own proposals, in a pool without prefix
        caching). Raises ``ValueError`` for a count outside ``[computed, num_tokens]`` (with
        ``computed``: ``[tokens in cached pages, num_tokens]``) or for a sequence with
        reserved tokens (``reserve_tokens``)."""
        row = self._device_row(seq_id, "truncate")
        n, done = int(self._ntok[row]), int(self._ncomp[row])
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)):
            raise TypeError(f"num_tokens: expected an int, got {num_tokens!r}")
        low = int(self._nhash[row]) * self.page_size if computed else done
        if self._dropped[row] and computed:
            low = max(low, done)  # a sliding window dropped pages the tokens need
        if not low <= num_tokens <= n:
            kept = "tokens in cached pages stay" if computed else "computed tokens stay"
            raise ValueError(
                f"num_tokens: expected a count in [{low}, {n}] ({kept}) for "
                f"{seq_id!r}, got {num_tokens}"
            )
        if self._resv[row] >= 0:
            raise ValueError(f"truncate: {seq_id!r} has reserved tokens (fill them first)")
        keep = self.pages_needed(int(num_tokens))
        for col in range(self._npages(row) - 1, keep - 1, -1):  # last first, as free does
            page = int(self._table[row, col])
            self._table[row, col] = 0
            self._unref(page)
        self._tok[row, num_tokens:n] = -1
        self._ntok[row] = num_tokens
        self._ncomp[row] = min(done, num_tokens)

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
