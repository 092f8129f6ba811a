"""A ``BlockManager``'s statistics (pages used, shared, cached; KV utilization; prefix
hits) and its invariant check, which recounts everything from the block tables.
``Statistics`` is that part of the manager (a mixin over its state). No JAX."""

from __future__ import annotations

import numpy as np

from ._common import _DROPPED_SLOT, NULL_PAGE


class Statistics:
    """``BlockManager``'s ``stats`` and ``check_invariants``."""

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
