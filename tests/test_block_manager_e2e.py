"""BlockManager driving a real PagedKVCache and ragged_paged_attention, step by step.

Each sequence's K/V history is kept on the host; after every step, attention through the
pages must equal dense attention over exactly that history.
"""

import jax
import jax.numpy as jnp
import numpy as np
from paged_cases import dense_attention

import paged_jax as pj
from paged_jax.batch import ScheduledSeq, build_batch
from paged_jax.block_manager import BlockManager

P, K, H, D = 4, 2, 4, 8


class Harness:
    def __init__(self, num_pages=24, **kw):
        self.bm = BlockManager(num_pages, P, watermark=0.0, **kw)
        self.cache = pj.PagedKVCache.create(1, num_pages, P, K, D, dtype=jnp.float32)
        self.kv = {}  # seq_id -> f64[n, 2, K, D] K/V history as written
        self.rng = np.random.default_rng(0)

    def new_kv(self, n):
        return self.rng.standard_normal((n, 2, K, D))

    def step(self, scheduled, new_kv):
        """Applies copies, writes each scheduled sequence's new tokens, attends, checks."""
        batch = build_batch(self.bm, scheduled)
        self.cache = _apply_copies(
            self.cache, jnp.asarray(batch.copy_src), jnp.asarray(batch.copy_dst)
        )
        T = batch.token_ids.shape[0]
        k = np.zeros((T, K, D))
        v = np.zeros((T, K, D))
        for i, s in enumerate(scheduled):
            a, b = batch.cu_q_lens[i], batch.cu_q_lens[i + 1]
            k[a:b], v[a:b] = new_kv[s.seq_id][:, 0], new_kv[s.seq_id][:, 1]
        self.cache = _write(
            self.cache,
            jnp.asarray(k, jnp.float32),
            jnp.asarray(v, jnp.float32),
            jnp.asarray(batch.slot_mapping),
        )
        q = self.rng.standard_normal((T, H, D))
        kv_pages, _, _ = self.cache.layer(0)
        args = (
            jnp.asarray(q, jnp.float32),
            kv_pages,
            jnp.asarray(batch.kv_lens),
            jnp.asarray(batch.page_indices),
            jnp.asarray(batch.cu_q_lens),
            jnp.asarray(batch.num_seqs),
        )
        pj.validate_inputs(*args)
        out = np.asarray(pj.ragged_paged_attention(*args, sm_scale=0.3))
        for i, s in enumerate(scheduled):
            # Block-table rows reach only the sequence's own pages (and padding page 0).
            assert set(batch.page_indices[i].tolist()) <= set(self.bm.block_table(s.seq_id)) | {0}
            hist = self.kv[s.seq_id][: s.stop]
            a, b = batch.cu_q_lens[i], batch.cu_q_lens[i + 1]
            ref = dense_attention(
                q[a:b], hist[:, 0], hist[:, 1], np.arange(s.start, s.stop), sm_scale=0.3
            )
            np.testing.assert_allclose(out[a:b], ref, atol=2e-5, err_msg=str(s.seq_id))


@jax.jit
def _apply_copies(cache, src, dst):
    return cache.copy_pages(src, dst)


@jax.jit
def _write(cache, k, v, slots):
    return cache.write(0, k, v, slots)


def _prefill(h, seq_id, n):
    h.bm.allocate(seq_id, list(range(n)))
    h.kv[seq_id] = h.new_kv(n)
    h.step([ScheduledSeq(seq_id, 0, n)], {seq_id: h.kv[seq_id]})
    h.bm.mark_computed(seq_id, n)


def test_forked_branches_read_exactly_their_own_kv():
    h = Harness()
    _prefill(h, "p", 6)  # page 2 half full: shared by the fork, then copied on write
    h.bm.fork("p", "c")
    h.kv["c"] = h.kv["p"].copy()
    copies_seen = 0
    for _ in range(7):  # cross two page boundaries with different tokens per branch
        new = {}
        for sid in ("p", "c"):
            h.bm.append_slots(sid, [1])
            new[sid] = h.new_kv(1)
            h.kv[sid] = np.concatenate([h.kv[sid], new[sid]])
        copies_seen += len(h.bm.pool.pending)  # (count before build_batch takes them)
        n = h.bm.num_tokens("p")
        h.step([ScheduledSeq("p", n - 1, n), ScheduledSeq("c", n - 1, n)], new)
    assert copies_seen == 1, "exactly one copy-on-write: the shared partial page"
    shared = set(h.bm.block_table("p")) & set(h.bm.block_table("c"))
    assert len(shared) == 1  # the full first page is still shared
    h.bm.check_invariants()


def test_reused_page_is_never_readable_past_its_new_owners_tokens():
    # Tenant A fills two pages and leaves; tenant B's short prompt gets one of A's pages
    # back. B's attention must only ever see B's tokens (A's stale K/V stays masked).
    h = Harness(num_pages=4, enable_prefix_caching=False)
    _prefill(h, "A", 8)
    pages_a = set(h.bm.block_table("A"))
    h.bm.free("A")
    _prefill(h, "B", 3)
    assert set(h.bm.block_table("B")) & pages_a, "test setup: B must reuse a page of A"
    h.bm.append_slots("B", [5])
    new = {"B": h.new_kv(1)}
    h.kv["B"] = np.concatenate([h.kv["B"], new["B"]])
    h.step([ScheduledSeq("B", 3, 4)], new)


def test_prefix_hit_reads_the_earlier_prompts_pages():
    h = Harness()
    _prefill(h, "a", 10)
    # b shares a's first two pages: its K/V history there is a's.
    cached = h.bm.allocate("b", list(range(10)) + [99, 98])
    assert cached == 8
    tail = h.new_kv(4)
    h.kv["b"] = np.concatenate([h.kv["a"][:8], tail])
    h.step([ScheduledSeq("b", 8, 12)], {"b": tail})


def test_swapped_group_comes_back_intact():
    h = Harness(num_host_pages=16)
    _prefill(h, "p", 7)
    h.bm.fork("p", "c")
    h.kv["c"] = h.kv["p"].copy()
    new = {}
    for sid in ("p", "c"):
        h.bm.append_slots(sid, [1])
        new[sid] = h.new_kv(1)
        h.kv[sid] = np.concatenate([h.kv[sid], new[sid]])
    h.step([ScheduledSeq("p", 7, 8), ScheduledSeq("c", 7, 8)], new)
    build_batch(h.bm, [])  # an empty step: the boundary after which the tokens count
    plan = h.bm.swap_out(["p", "c"])
    host = np.asarray(h.cache.read_pages(jnp.array([d for d, _ in plan], jnp.int32)))
    slot_of = {s: i for i, (_, s) in enumerate(plan)}
    # Another sequence takes over (and overwrites) the freed device pages meanwhile.
    _prefill(h, "x", 20)
    h.bm.free("x")
    back = h.bm.swap_in(["p", "c"])
    rows = [slot_of[s] for s, _ in back]
    h.cache = h.cache.write_pages(
        jnp.array([d for _, d in back], jnp.int32), jnp.asarray(host[:, rows])
    )
    new = {}
    for sid in ("p", "c"):
        h.bm.append_slots(sid, [2])
        new[sid] = h.new_kv(1)
        h.kv[sid] = np.concatenate([h.kv[sid], new[sid]])
    h.step([ScheduledSeq("p", 8, 9), ScheduledSeq("c", 8, 9)], new)
    h.bm.check_invariants()
