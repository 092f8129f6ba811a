"""``Appender``: a ``BlockManager``'s operations that grow sequences and mark their
tokens computed, for every sequence of every step: the batched ones over the sequences'
rows (``append_tokens``: one decode token each; ``reserve_tokens`` and
``fill_reserved``: a multi-step launch's placeholders, then their values;
``truncate``: rejected speculative tokens), the growth of one row with copy-on-write of
a shared last page (``grow``), and marking tokens computed, which enters full pages in
the prefix cache and drops pages a sliding window has passed. No JAX."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from ._common import NULL_PAGE, SeqRows, _as_tokens, _ragged, _spans, write_spans
from .pool import PagePool
from .prefix import PrefixCache
from .rows import SequenceRows


class Appender:
    """The growing and computing of sequences over the manager's parts (see the module
    docstring): its ``rows``, the ``pool`` their pages come from and the ``prefix``
    cache their computed full pages enter."""

    def __init__(self, rows: SequenceRows, pool: PagePool, prefix: PrefixCache):
        self.rows, self.pool, self.prefix = rows, pool, prefix
        self.page_size = rows.page_size

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def pages_for_append(self, row: int, num_new: int) -> int:
        """Pages row ``row`` needs to append ``num_new`` tokens: new ones, and a copy of a
        shared partial last page."""
        n, P = int(self.rows.ntok[row]), self.page_size
        have = -(-n // P)
        need = self.pages_needed(n + num_new) - have
        if n % P and num_new and self.pool.refcount[self.rows.table[row, have - 1]] > 1:
            need += 1  # copy-on-write of the shared partial last page
        return max(need, 0)

    def first_appends(self, rows: np.ndarray) -> None:
        """At a sequence's first append of a step, every token it had before was computed
        by an earlier step (tokens appended within this step are not): for each of
        ``rows`` (distinct) about to append."""
        stale = rows[self.rows.last[rows] != self.rows.step]
        if len(stale):
            self.rows.last[stale] = self.rows.step
            r = self.rows.resv[stale]
            self.mark_rows(stale, np.where(r < 0, self.rows.ntok[stale], r))

    def grow(self, row: int, tokens: np.ndarray | int) -> None:
        """Appends ``tokens`` (an int: that many placeholders, -1) to the row's sequence,
        whose pages for them were counted free: a shared partially filled last page is
        first replaced by a private copy (copy-on-write), then new pages are taken as the
        tokens need them."""
        P, n = self.page_size, int(self.rows.ntok[row])
        num_new = tokens if isinstance(tokens, int) else len(tokens)
        have = -(-n // P)
        m = n + num_new
        self.rows.fit(self.pages_needed(m), m)
        if n % P and num_new and self.pool.refcount[self.rows.table[row, have - 1]] > 1:
            old = int(self.rows.table[row, have - 1])
            self.rows.table[row, have - 1] = self.pool.copy_on_write(old)
        for col in range(have, self.pages_needed(m)):
            self.rows.table[row, col] = self.pool.take()
        if not isinstance(tokens, int):  # (placeholders: the cells past n are -1)
            self.rows.tok[row, n:m] = tokens
        self.rows.ntok[row] = m

    def append(self, rows: np.ndarray, counts: np.ndarray, values: np.ndarray | None) -> bool:
        """Appends ``counts[i]`` tokens to the sequence of row ``rows[i]`` (distinct rows,
        counts >= 1): ``values[i]`` (one token each), or placeholders (-1) for None. All or
        none: False, changing nothing, when the pages they need together are not free.

        For every row of every step: the new pages are taken in row order and written
        to the table in one assignment, and so are the tokens; only a row whose shared
        last page needs a copy first (copy-on-write) goes through ``grow``."""
        if not len(rows):
            return True
        P = self.page_size
        n = self.rows.ntok[rows]
        m = n + counts
        have, want = -(-n // P), -(-m // P)
        cow = np.zeros(len(rows), bool)
        part = np.flatnonzero(n % P)
        if len(part):
            get = self.pool.refcount.__getitem__
            last = self.rows.table[rows[part], have[part] - 1].tolist()
            if max(map(get, last)) > 1:  # some last page is shared
                cow[part] = [get(p) > 1 for p in last]
        more = want - have
        if int(more.sum()) + int(cow.sum()) > self.pool.num_free:
            return False
        self.first_appends(rows)
        if cow.any():
            for j in np.flatnonzero(cow).tolist():
                self.grow(int(rows[j]), int(counts[j]) if values is None else values[j : j + 1])
            keep = ~cow
            rows, counts, n, m, have, more = (a[keep] for a in (rows, counts, n, m, have, more))
            values = None if values is None else values[keep]
            if not len(rows):
                return True
        self.rows.fit(int(want.max()), int(m.max()))
        total = int(more.sum())
        if total:
            taken = self.pool.take_many(total)
            table = self.rows.table
            if total == int(np.count_nonzero(more)):  # one new page a row at most
                got = more > 0
                table[rows[got], have[got]] = taken
            else:
                table[np.repeat(rows, more), np.repeat(have, more) + _ragged(more)] = taken
        if values is not None:  # (placeholders: the cells past n are -1)
            self.rows.tok[rows, n] = values
        self.rows.ntok[rows] = m
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
        rows = self.rows.device_rows(seq_ids, "append_tokens")
        return self.append(rows, np.ones(len(rows), np.int64), values)

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
        rows = self.rows.device_rows(seq_ids, "reserve_tokens")
        ks = ks.astype(np.int64, copy=False)
        some = ks > 0
        if not some.all():
            rows, ks = rows[some], ks[some]
        before = self.rows.ntok[rows]
        if not self.append(rows, ks, None):
            return False
        r = self.rows.resv[rows]
        self.rows.resv[rows] = np.where(r < 0, before, r)
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
        rows = self.rows.device_rows(seq_ids, "fill_reserved")
        starts = np.asarray(starts, np.int64).reshape(S)
        stops = starts + cs
        done, n = self.rows.ncomp[rows], self.rows.ntok[rows]
        bad = np.flatnonzero((starts < done) | (stops > n))
        if len(bad):
            i = int(bad[0])
            raise ValueError(
                f"starts: expected tokens not yet computed, within [{int(done[i])}, "
                f"{int(n[i])}) for {seq_ids[i]!r}, got [{int(starts[i])}, {int(stops[i])})"
            )
        if values is None:
            write_spans(self.rows.tok, rows, starts, cs, tokens)
        else:
            at = _spans(rows, starts, cs)
            self.rows.tok[at] = values.reshape(at[1].shape)
        r = self.rows.resv[rows]
        past = (r >= 0) & (stops > r)
        if past.any():
            self.rows.resv[rows[past]] = np.where(stops < n, stops, -1)[past]
        self.mark_rows(rows, stops)

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
        row = self.rows.device_row(seq_id, "truncate")
        n, done = int(self.rows.ntok[row]), int(self.rows.ncomp[row])
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)):
            raise TypeError(f"num_tokens: expected an int, got {num_tokens!r}")
        low = int(self.rows.nhash[row]) * self.page_size if computed else done
        if self.rows.dropped[row] and computed:
            low = max(low, done)  # a sliding window dropped pages the tokens need
        if not low <= num_tokens <= n:
            kept = "tokens in cached pages stay" if computed else "computed tokens stay"
            raise ValueError(
                f"num_tokens: expected a count in [{low}, {n}] ({kept}) for "
                f"{seq_id!r}, got {num_tokens}"
            )
        if self.rows.resv[row] >= 0:
            raise ValueError(f"truncate: {seq_id!r} has reserved tokens (fill them first)")
        keep = self.pages_needed(int(num_tokens))
        for col in range(self.rows.npages(row) - 1, keep - 1, -1):  # last first, as free does
            page = int(self.rows.table[row, col])
            self.rows.table[row, col] = 0
            self.pool.unref(page)
        self.rows.tok[row, num_tokens:n] = -1
        self.rows.ntok[row] = num_tokens
        self.rows.ncomp[row] = min(done, num_tokens)

    def mark_rows(self, rows: np.ndarray, num_tokens: np.ndarray) -> None:
        """``mark_computed`` of each of ``rows`` (distinct): the counts as one
        assignment, then the prefix cache and the window for the rows that need them."""
        up = num_tokens > self.rows.ncomp[rows]
        if not up.all():
            rows, num_tokens = rows[up], num_tokens[up]
        if not len(rows):
            return
        self.rows.ncomp[rows] = num_tokens
        if self.prefix.enabled:
            new = num_tokens // self.page_size > self.rows.nhash[rows]
            for row, k in zip(rows[new].tolist(), num_tokens[new].tolist(), strict=True):
                self.register(row, k)
        w = self.rows.win[rows]
        if w.any():
            dead = (num_tokens - w + 1) // self.page_size
            for row in rows[(w > 0) & (dead > self.rows.dropped[rows])].tolist():
                self.drop_out_of_window(row)

    def mark_computed(self, row: int, num_tokens: int) -> None:
        """The row's first ``num_tokens`` tokens computed: their full pages enter the
        prefix cache, pages the window has passed are dropped."""
        if num_tokens <= self.rows.ncomp[row]:
            return
        self.rows.ncomp[row] = num_tokens
        self.register(row, num_tokens)
        self.drop_out_of_window(row)

    def sync_computed(self, row: int) -> None:
        """Tokens appended in earlier steps are computed once a step boundary passed."""
        r = self.rows
        done = r.filled(row)
        if 0 <= r.last[row] < r.step and r.ncomp[row] < done:
            self.mark_computed(row, done)

    def register(self, row: int, num_tokens: int) -> None:
        """Enters the sequence's full computed pages in the prefix cache."""
        if not self.prefix.enabled:
            return
        r, P = self.rows, self.page_size
        full = num_tokens // P
        first = int(r.nhash[row])
        if first >= full:
            return
        chunks = r.tok[row, first * P : full * P].tobytes()
        pages = r.table[row, first:full].tolist()
        r.key[row] = self.prefix.enter(pages, chunks, r.key[row], from_root=first == 0)
        r.nhash[row] = full

    def drop_out_of_window(self, row: int) -> None:
        """Releases the leading pages no token from the computed count on can read: page
        i's last key ``(i + 1) P - 1`` lies before the window of position ``ncomp``."""
        r = self.rows
        w = int(r.win[row])
        if not w:
            return
        dead = (int(r.ncomp[row]) - w + 1) // self.page_size
        start = int(r.dropped[row])
        if dead <= start:
            return
        table = r.table
        for i in range(start, dead):
            page = int(table[row, i])
            table[row, i] = NULL_PAGE
            self.pool.unref(page)
        r.dropped[row] = dead
