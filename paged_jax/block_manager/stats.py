"""A ``BlockManager``'s statistics (pages used, shared, cached; KV utilization; prefix
hits) and its invariant check, which recounts everything from the block tables: read
from the manager's parts (``rows``, ``pool``, ``prefix``, ``host``). No JAX."""

from __future__ import annotations

import numpy as np

from ._common import _DROPPED_SLOT, NULL_PAGE


def stats(bm) -> dict[str, float]:
    """Pages used / free / cached / referenced, KV utilization, sharing, prefix counters
    of block manager ``bm``.

    ``kv_utilization`` = tokens stored / (pages in use * page_size), a shared page's
    tokens counted once.
    """
    P, r, pool, prefix = bm.page_size, bm.rows, bm.pool, bm.prefix
    # From the row arrays, not page by page in Python (the engine samples these every
    # few steps; 256 sequences of 1k tokens hold 16k pages). A page's tokens are the
    # most any sequence holding it has written there.
    rows = np.fromiter(r.ids.values(), np.intp, len(r.ids))
    live = rows[~r.swapped[rows]]
    ns = r.ntok[live]
    widths = -(-ns // P)
    referenced = int((widths - r.dropped[live]).sum())
    stored = 0
    if len(live):
        cols = np.arange(int(widths.max()))
        pages = r.table[live, : len(cols)]
        fills = np.minimum(P, ns[:, None] - cols * P)
        held = (cols < widths[:, None]) & (pages != NULL_PAGE) & (fills > 0)
        most = np.zeros(bm.num_pages, np.int64)
        np.maximum.at(most, pages[held], fills[held])
        stored = int(most.sum())
    refcount = pool.refcount
    used = len(refcount) - refcount.count(0)
    return {
        "pages_total": bm.num_pages - 1,
        "pages_used": used,
        "pages_free": len(pool.free),
        "pages_cached": len(prefix.page_key),
        "pages_cached_unused": len(pool.evictable),
        "pages_shared": used - refcount.count(1),
        # Sum of block-table lengths: the pages an unshared layout would need.
        "pages_referenced": referenced,
        "tokens_stored": stored,
        "kv_utilization": stored / (used * P) if used else 1.0,
        "prefix_queries": prefix.queries,
        "prefix_hits": prefix.hits,
        "prefix_hit_rate": prefix.hits / prefix.queries if prefix.queries else 0.0,
        "evictions": prefix.evictions,
        "host_pages_used": bm.num_host_pages - len(bm.host.free),
        "num_seqs": len(r.ids),
    }


def check_invariants(bm) -> None:
    """Recounts everything of block manager ``bm`` from its block tables; raises
    AssertionError on any drift. For tests and debugging (cost linear in pages and
    tokens)."""
    r, pool, prefix = bm.rows, bm.pool, bm.prefix
    counts = [0] * bm.num_pages
    host_counts = [0] * bm.num_host_pages
    for row in r.ids.values():
        n, dropped = int(r.ntok[row]), int(r.dropped[row])
        pages = r.table[row, : r.npages(row)].tolist()
        swapped = bool(r.swapped[row])
        gone = NULL_PAGE if not swapped else _DROPPED_SLOT
        assert all(p == gone for p in pages[:dropped]), "dropped entry reused"
        assert gone not in pages[dropped:], "live entry dropped"
        w = int(r.win[row])
        if w:
            dead = (int(r.ncomp[row]) - w + 1) // bm.page_size
            assert dropped == max(dead, 0), "window drop drift"
        else:
            assert dropped == 0
        for p in pages[dropped:]:
            if swapped:
                host_counts[p] += 1
            else:
                counts[p] += 1
        assert not r.table[row, len(pages) :].any(), "tables() row tail not zero"
        assert r.ncomp[row] <= n <= r.tok.shape[1]
        assert (r.tok[row, n:] == -1).all(), "a cell past the tokens not -1"
        assert r.resv[row] < n, "reserved mark past the tokens"
        assert r.nhash[row] <= r.ncomp[row] // bm.page_size, "hashed drift"
    assert counts == pool.refcount, "refcount != block-table references"
    rows = list(r.ids.values())
    assert sorted(rows + r.free_rows) == list(range(r.table.shape[0])), "row drift"
    assert not r.table[r.free_rows].any(), "a free row of tables() not zero"
    assert (r.tok[r.free_rows] == -1).all(), "a free row's token ids not -1"
    assert host_counts == bm.host.refcount, "host refcount drift"
    assert counts[NULL_PAGE] == 0 and NULL_PAGE not in pool.free, "null page handed out"
    free = set(pool.free)
    assert len(free) == len(pool.free), "page twice in the free list"
    for p in range(1, bm.num_pages):
        in_free, in_evict = p in free, p in pool.evictable
        in_deferred = p in pool.deferred
        assert (counts[p] == 0) == (in_free or in_evict or in_deferred), (
            f"page {p}: free/used mismatch"
        )
        assert in_deferred <= (p in pool.pending_src), f"page {p}: deferred for no copy"
        assert not (in_free and in_evict), f"page {p}: both free and evictable"
        assert in_evict <= (p in prefix.page_key), f"page {p}: evictable but not cached"
        assert not (in_free and p in prefix.page_key), f"page {p}: free but still cached"
    assert len(prefix.cached) == len(prefix.page_key) == len(prefix.page_tokens)
    for key, p in prefix.cached.items():
        assert prefix.page_key[p] == key
    assert set(bm.host.free) == {s for s in range(bm.num_host_pages) if host_counts[s] == 0}
    for dst, src in pool.pending.items():
        assert counts[dst] > 0, f"pending copy into unreferenced page {dst}"
        assert src not in free and src not in pool.evictable, f"copy source {src} reusable"
