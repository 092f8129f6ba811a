"""BlockManager: unit tests of each operation and error, a stateful property test with a
shadow device, determinism across processes, and the step batch builder."""

import dataclasses
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    precondition,
    rule,
)

from paged_jax.batch import ScheduledSeq, bucket, build_batch
from paged_jax.block_manager import (
    BlockManager,
    DuplicateSequence,
    HybridBlockManager,
    InvalidSequenceState,
    OutOfPages,
    UnknownSequence,
)

P = 4


def _bm(num_pages=32, **kw):
    kw.setdefault("watermark", 0.0)
    return BlockManager(num_pages, P, **kw)


# ---------------------------------------------------------------------- basics


def test_allocate_hands_out_pages_on_demand_never_page_zero():
    bm = _bm(8)
    assert bm.allocate("a", [1, 2, 3, 4, 5]) == 0  # nothing cached yet
    assert bm.block_table("a") == [1, 2]  # ceil(5 / 4) pages, lowest ids first
    # Slot = page * P + offset: tokens 0..3 on page 1, token 4 on page 2.
    np.testing.assert_array_equal(bm.slots("a", 0, 5), [4, 5, 6, 7, 8])
    np.testing.assert_array_equal(bm.append_slots("a", [6, 7, 8]), [9, 10, 11])
    np.testing.assert_array_equal(bm.append_slots("a", [9]), [12])  # page boundary: page 3
    assert bm.block_table("a") == [1, 2, 3] and bm.num_tokens("a") == 9
    assert bm.num_free_pages == 4  # pages 4..7
    bm.free("a")
    assert bm.num_free_pages == 7
    bm.check_invariants()


def test_watermark_reserves_pages_for_running_sequences():
    bm = BlockManager(101, P, watermark=0.1)  # 10 pages kept back from admissions
    assert bm.watermark_pages == 10
    assert bm.can_allocate(90 * P) and not bm.can_allocate(91 * P)
    bm.allocate("a", list(range(90 * P)))
    # Running sequences may grow into the reserve.
    assert bm.can_append(["a"], num_tokens=10 * P) and not bm.can_append(["a"], 10 * P + 1)


def test_append_tokens_is_append_slots_for_every_sequence_all_or_none():
    a, b = _bm(8), _bm(8)
    for bm in (a, b):
        bm.allocate("x", [1, 2, 3])  # a partial page
        bm.allocate("y", [4, 5, 6, 7])  # a full page: its next token takes a new one
        bm.mark_computed("x", 3)
        bm.mark_computed("y", 4)
        bm.fork("x", "z")  # "z" shares x's partial page: its append copies it first
    assert a.append_tokens(["x", "y", "z"], [8, 9, 10])
    for sid, tok in (("x", 8), ("y", 9), ("z", 10)):
        b.append_slots(sid, [tok])
    for sid in ("x", "y", "z"):
        assert a.block_table(sid) == b.block_table(sid)
        np.testing.assert_array_equal(a.token_ids(sid), b.token_ids(sid))
    assert a.take_copies()[0].tolist() == b.take_copies()[0].tolist() != []
    a.check_invariants()
    # 3 pages left: two full-page prompts take 2; both need a new page, 1 is free.
    for k in range(2):
        a.allocate(f"w{k}", [k] * P)
    assert a.num_free_pages == 1
    before = (a.stats(), {s: a.block_table(s) for s in a.seq_ids})
    assert not a.append_tokens(["y", "w0", "w1"], [1, 2, 3])
    assert (a.stats(), {s: a.block_table(s) for s in a.seq_ids}) == before
    assert a.num_tokens("w0") == P
    assert a.append_tokens(["w0"], [3]) and a.num_free_pages == 0
    with pytest.raises(ValueError, match="tokens: expected one per sequence"):
        a.append_tokens(["x"], [1, 2])
    with pytest.raises(UnknownSequence):
        a.append_tokens(["nope"], [1])
    a.check_invariants()


def test_out_of_pages_is_typed_and_changes_nothing():
    bm = _bm(4)  # 3 usable pages
    bm.allocate("a", list(range(8)))
    before = bm.stats()
    with pytest.raises(OutOfPages, match="allocate: seq_id 'b' needs 2 new pages for 5 tokens"):
        bm.allocate("b", list(range(5)))
    assert bm.stats() == before and "b" not in bm
    bm.append_slots("a", [1] * 4)
    with pytest.raises(OutOfPages, match="append_slots: seq_id 'a' needs 1 pages for 1 tokens"):
        bm.append_slots("a", [1])
    assert bm.num_tokens("a") == 12
    bm.check_invariants()


def test_fork_shares_pages_and_copy_on_write_copies_the_partial_page():
    bm = _bm(16)
    bm.allocate("p", list(range(6)))  # pages [1, 2]; page 2 holds 2 of 4 tokens
    bm.mark_computed("p", 6)  # the prefill step wrote the prompt's K/V
    bm.fork("p", "c")
    assert bm.block_table("c") == [1, 2] and bm.refcount(1) == bm.refcount(2) == 2
    assert bm.num_free_pages == 13  # fork allocates nothing
    slot_c = bm.append_slots("c", [100])
    # The child got a private copy of page 2 (page 3) before writing at offset 2.
    assert bm.block_table("c") == [1, 3] and list(slot_c) == [3 * P + 2]
    assert bm.refcount(2) == 1 and bm.refcount(3) == 1
    src, dst = bm.take_copies()
    assert list(src) == [2] and list(dst) == [3]
    assert bm.take_copies()[0].size == 0  # taken once
    # The parent now owns page 2 alone and writes in place, no copy.
    assert list(bm.append_slots("p", [200])) == [2 * P + 2]
    assert bm.take_copies()[0].size == 0
    bm.check_invariants()


def test_fork_refuses_a_parent_with_unwritten_kv():
    # A copy-on-write copy reads its page as it was before the step, so a page holding
    # K/V that this step will write must not become shared.
    bm = _bm(16)
    bm.allocate("p", list(range(6)))
    with pytest.raises(
        InvalidSequenceState,
        match=r"fork: seq_id 'p' has 6 tokens whose K/V "
        r"are not written yet \(0 of 6 computed\)",
    ):
        bm.fork("p", "c")
    bm.mark_computed("p", 6)
    bm.append_slots("p", [7])  # this step's token
    with pytest.raises(InvalidSequenceState, match="fork: seq_id 'p' has 1 tokens"):
        bm.fork("p", "c")
    assert "c" not in bm
    bm.take_copies()  # step boundary: the step wrote token 6
    bm.fork("p", "c")
    assert bm.num_computed_tokens("c") == 7
    bm.check_invariants()


def test_pending_copy_into_a_freed_page_is_dropped():
    bm = _bm(16)
    bm.allocate("p", list(range(6)))
    bm.mark_computed("p", 6)
    bm.fork("p", "c")
    bm.append_slots("c", [7])  # copy 2 -> 3 pending
    bm.free("c")  # page 3 returns to the free list
    bm.allocate("x", list(range(3)))  # reuses page 3 for fresh tokens
    src, dst = bm.take_copies()
    assert dst.size == 0, "a stale copy would overwrite x's page"


def test_copy_source_is_not_reused_before_the_copy_runs():
    # p and c share page 2; c copies it (2 -> 3) and p finishes in the same step: page 2
    # has no holder, but the copy still reads it, so it must not be handed out (to x
    # here, whose writes would land before the copy) until the step boundary.
    bm = _bm(6)  # pages 1..5
    bm.allocate("p", list(range(6)))  # pages 1, 2
    bm.mark_computed("p", 6)
    bm.fork("p", "c")
    bm.append_slots("c", [7])  # c -> [1, 3], copy 2 -> 3 pending
    bm.free("p")  # page 2 now unreferenced
    assert bm.num_free_pages == 2  # pages 4, 5: page 2 is held back
    bm.allocate("x", [9] * 8)  # tokens unlike p's: no prefix hit, two fresh pages
    assert 2 not in bm.block_table("x")
    bm.check_invariants()
    src, dst = bm.take_copies()
    assert (list(src), list(dst)) == ([2], [3])
    assert bm.num_free_pages == 1  # page 2 is back after the boundary
    bm.check_invariants()


def test_prefix_cache_hits_share_full_pages_and_skip_the_last_token():
    bm = _bm(32)
    prompt = list(range(100, 110))  # 10 tokens: 2 full pages + 2 tokens
    assert bm.allocate("a", prompt) == 0
    bm.mark_computed("a", 10)
    assert bm.allocate("b", prompt + [1, 2]) == 8  # both full pages shared
    assert bm.block_table("b")[:2] == bm.block_table("a")[:2]
    assert bm.refcount(bm.block_table("a")[0]) == 2
    # A prompt of exactly 2 pages reuses only 1: its last token must be computed, and it
    # lands on a private page (never written into a shared one).
    assert bm.allocate("c", prompt[:8]) == 4
    assert bm.block_table("c")[1] not in bm.block_table("a")
    # Different tokens in the second page: only the first page is shared.
    assert bm.allocate("d", prompt[:4] + [0, 0, 0, 0, 5]) == 4
    s = bm.stats()
    # Each prompt looks up (len - 1) // P pages: a 2, b 2, c 1, d 2; hits: 0, 2, 1, 1.
    assert (s["prefix_queries"], s["prefix_hits"]) == (2 + 2 + 1 + 2, 0 + 2 + 1 + 1)
    bm.check_invariants()


def test_prefix_cache_needs_computed_pages():
    # Pages are only shareable once their K/V are written (mark_computed or a later
    # append): a prompt still being prefilled in chunks must not be hit.
    bm = _bm(32)
    bm.allocate("a", list(range(12)))
    assert bm.allocate("b", list(range(12))) == 0
    bm.mark_computed("a", 5)  # only page 0 complete
    assert bm.allocate("c", list(range(12))) == 4


def test_extra_key_isolates_tenants():
    bm = _bm(32)
    prompt = list(range(9))
    bm.allocate("a", prompt, extra_key="tenant-1")
    bm.mark_computed("a", 9)
    assert bm.allocate("b", prompt, extra_key="tenant-2") == 0
    assert bm.allocate("c", prompt) == 0  # no salt is a different tenant too
    assert bm.allocate("d", prompt, extra_key="tenant-1") == 8
    assert not set(bm.block_table("b")) & set(bm.block_table("a"))
    assert not set(bm.block_table("c")) & set(bm.block_table("a"))
    with pytest.raises(TypeError, match="extra_key: expected None, str, bytes, int or a tuple"):
        bm.allocate("e", prompt, extra_key=1.5)


def test_freed_full_pages_stay_cached_and_are_evicted_lru_tail_first():
    bm = _bm(8)  # 7 usable pages
    bm.allocate("a", list(range(13)))  # pages 1..4 (3 full)
    bm.mark_computed("a", 13)
    bm.free("a")
    s = bm.stats()
    assert s["pages_cached_unused"] == 3 and s["pages_free"] == 4 and bm.num_free_pages == 7
    # A new unrelated prompt of 6 pages: 4 free pages first, then evicts 2 cached pages,
    # the chain's tail (page 3, then 2) before its head (page 1).
    bm.allocate("b", [7] * 23)
    assert 1 not in bm.block_table("b") and {2, 3} <= set(bm.block_table("b"))
    assert bm.stats()["evictions"] == 2
    # The head is still cached: the original prompt hits one page.
    bm.free("b")
    assert bm.allocate("c", list(range(13))) == 4
    bm.check_invariants()


def test_swap_out_and_in_keeps_group_sharing():
    bm = _bm(16, num_host_pages=8)
    bm.allocate("p", list(range(6)))
    bm.mark_computed("p", 6)
    bm.fork("p", "c")
    bm.append_slots("c", [9])  # c: [1, 3]; p: [1, 2]; page 1 shared
    bm.take_copies()
    plan = bm.swap_out(["p", "c"])
    assert sorted(d for d, _ in plan) == [1, 2, 3]  # shared page 1 copied once
    assert bm.is_swapped("p") and bm.num_free_pages == 15
    with pytest.raises(InvalidSequenceState, match="append_slots: seq_id 'p' is swapped out"):
        bm.append_slots("p", [1])
    back = bm.swap_in(["c", "p"])
    assert len(back) == 3
    assert bm.block_table("p")[0] == bm.block_table("c")[0]  # still one shared page
    assert bm.refcount(bm.block_table("p")[0]) == 2
    assert bm.stats()["host_pages_used"] == 0
    bm.check_invariants()


def test_swap_is_all_or_nothing():
    bm = _bm(16, num_host_pages=2)
    bm.allocate("a", list(range(12)))  # 3 pages > 2 host slots
    with pytest.raises(OutOfPages, match="swap_out: 3 host slots needed, 2 free"):
        bm.swap_out(["a"])
    assert not bm.is_swapped("a") and bm.num_host_free_pages == 2
    bm.check_invariants()


def test_swap_out_refuses_sequences_with_unwritten_kv():
    bm = _bm(16, num_host_pages=8)
    bm.allocate("p", list(range(6)))
    bm.append_slots("p", [9])  # K/V of token 6 are written by this step, not yet
    with pytest.raises(
        InvalidSequenceState, match="swap_out: seq_id 'p' appended tokens this step"
    ):
        bm.swap_out(["p"])
    bm.take_copies()
    assert len(bm.swap_out(["p"])) == 2


@pytest.mark.parametrize(
    "call,exc,msg",
    [
        (
            lambda bm: bm.free("zz"),
            UnknownSequence,
            "seq_id 'zz': unknown (never allocated, or already freed)",
        ),
        (
            lambda bm: (bm.free("a"), bm.free("a")),
            UnknownSequence,
            "seq_id 'a': unknown (never allocated, or already freed)",
        ),
        (lambda bm: bm.append_slots("zz", [1]), UnknownSequence, "seq_id 'zz': unknown"),
        (lambda bm: bm.fork("a", "a"), DuplicateSequence, "fork: seq_id 'a' is already live"),
        (lambda bm: bm.fork("zz", "b"), UnknownSequence, "seq_id 'zz': unknown"),
        (lambda bm: bm.truncate("a", 99), ValueError, "num_tokens: expected a count in"),
        (lambda bm: bm.truncate("a", 1.0), TypeError, "num_tokens: expected an int"),
        (
            lambda bm: bm.allocate("a", [1]),
            DuplicateSequence,
            "allocate: seq_id 'a' is already live",
        ),
        (lambda bm: bm.allocate("b", []), ValueError, "token_ids: expected at least one token"),
        (lambda bm: bm.allocate("b", [[1, 2]]), ValueError, "token_ids: expected a 1-D sequence"),
        (lambda bm: bm.allocate("b", [1.5]), TypeError, "token_ids: expected integer token ids"),
        (
            lambda bm: bm.slots("a", 2, 9),
            ValueError,
            "slots: expected 0 <= start <= stop <= num_tokens=5, got start=2, stop=9",
        ),
        (
            lambda bm: bm.mark_computed("a", 6),
            ValueError,
            "num_tokens: expected 0 <= num_tokens <= 5, got 6",
        ),
        (
            lambda bm: bm.swap_in(["a"]),
            InvalidSequenceState,
            "swap_in: seq_id 'a' is on the device",
        ),
        (lambda bm: BlockManager(1, 4), ValueError, "num_pages: expected >= 2, got 1"),
        (
            lambda bm: BlockManager(8, 4, watermark=1.0),
            ValueError,
            r"watermark: expected a fraction in \[0, 1\), got 1.0",
        ),
    ],
)
def test_errors(call, exc, msg):
    bm = _bm(16)
    bm.allocate("a", [1, 2, 3, 4, 5])
    with pytest.raises(
        exc,
        match=msg.replace("(", r"\(").replace(")", r"\)")
        if exc is not ValueError or "watermark" not in msg
        else msg,
    ):
        call(bm)


def test_unknown_sequence_is_a_key_error_with_a_readable_message():
    bm = _bm()
    with pytest.raises(KeyError) as info:
        bm.free(3)
    assert str(info.value) == "seq_id 3: unknown (never allocated, or already freed)"


def test_stats_kv_utilization_counts_shared_pages_once():
    bm = _bm(32)
    bm.allocate("a", list(range(6)))  # 2 pages, 6 tokens
    bm.mark_computed("a", 6)
    bm.fork("a", "b")  # shares both pages: still 6 tokens in 2 pages
    s = bm.stats()
    assert (s["pages_used"], s["pages_shared"], s["tokens_stored"]) == (2, 2, 6)
    assert s["kv_utilization"] == 6 / 8


# ---------------------------------------------------------------------- stateful model

VOCAB = 3  # a tiny vocabulary makes prefix-cache hits and collisions of pages common


class BlockManagerMachine(RuleBasedStateMachine):
    """Random interleavings of every operation against a shadow device.

    The shadow pool stores token ids where an engine would store K/V: each step applies
    the pending copies, then writes the step's new tokens to their slots; swaps move
    pages through a shadow host pool. After every rule, every sequence must read back
    exactly its own tokens through its block table.
    """

    seqs = Bundle("seqs")

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(24, P, watermark=0.0, num_host_pages=12)
        self.device = np.full((24, P), -1, np.int64)
        self.host = np.full((12, P), -1, np.int64)
        self.tokens: dict[int, list[int]] = {}
        self.next_id = 0
        self.pending_writes: list[tuple[np.ndarray, list[int]]] = []

    def _step(self):
        """Copies first (reading the pool as it was), then the step's writes."""
        src, dst = self.bm.take_copies()
        self.device[dst] = self.device[src].copy()
        for slots, toks in self.pending_writes:
            for s, t in zip(slots, toks, strict=True):
                page = s // P
                assert page != 0, "a token slot on the null page"
                self.device[page, s % P] = t
        self.pending_writes.clear()

    def _new_id(self):
        self.next_id += 1
        return self.next_id

    @rule(
        target=seqs,
        prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=14),
        salt=st.sampled_from([None, "t1"]),
        computed=st.booleans(),
    )
    def allocate(self, prompt, salt, computed):
        sid = self._new_id()
        before = self.bm.stats()
        try:
            cached = self.bm.allocate(sid, prompt, extra_key=salt)
        except OutOfPages:
            assert self.bm.stats() == before
            return multiple()
        assert cached % P == 0 and cached < len(prompt)
        # Prefix hits must hold exactly the prompt's tokens already.
        for i, page in enumerate(self.bm.block_table(sid)[: cached // P]):
            assert list(self.device[page]) == prompt[i * P : (i + 1) * P]
        self.tokens[sid] = list(prompt)
        self.pending_writes.append((self.bm.slots(sid, cached, len(prompt)), prompt[cached:]))
        self._step()
        if computed:
            self.bm.mark_computed(sid, len(prompt))
        return sid

    @rule(data=st.data())
    def decode_step(self, data):
        """A batch step: appends (with forks in between, as beam search does), then writes."""
        live = [s for s in self.tokens if not self.bm.is_swapped(s)]
        if not live:
            return
        for _ in range(data.draw(st.integers(1, 4))):
            sid = data.draw(st.sampled_from(live))
            if data.draw(st.booleans()):
                child = self._new_id()
                try:
                    self.bm.fork(sid, child)
                except InvalidSequenceState:
                    # Only a parent with unwritten K/V may be refused.
                    assert self.bm.num_computed_tokens(sid) < self.bm.num_tokens(sid)
                    assert child not in self.bm
                    continue
                self.tokens[child] = list(self.tokens[sid])
                live.append(child)
                continue
            toks = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5))
            try:
                slots = self.bm.append_slots(sid, toks)
            except OutOfPages:
                continue
            # Copy-on-write happened first: the slots lie in pages this sequence owns
            # alone. (A later fork in the same step may share them again; both then
            # expect these very tokens there, which the content invariant checks.)
            for page in set((slots // P).tolist()):
                assert self.bm.refcount(page) == 1, f"append_slots returned shared page {page}"
            self.tokens[sid] += toks
            self.pending_writes.append((slots, toks))
        self._step()

    @rule(data=st.data())
    def decode_all(self, data):
        """One token for each of several sequences at once (the scheduler's decode pass):
        all appended, each in a page it owns alone, or none and nothing changed."""
        live = sorted(s for s in self.tokens if not self.bm.is_swapped(s))
        if not live:
            return
        group = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=4, unique=True))
        toks = data.draw(
            st.lists(st.integers(0, VOCAB - 1), min_size=len(group), max_size=len(group))
        )
        before = (self.bm.stats(), {s: self.bm.block_table(s) for s in group})
        lens = [self.bm.num_tokens(s) for s in group]
        if not self.bm.append_tokens(group, toks):
            assert (self.bm.stats(), {s: self.bm.block_table(s) for s in group}) == before
            return
        for sid, tok, n in zip(group, toks, lens, strict=True):
            slots = self.bm.slots(sid, n, n + 1)
            assert self.bm.refcount(int(slots[0]) // P) == 1
            self.tokens[sid].append(tok)
            self.pending_writes.append((slots, [tok]))
        self._step()

    @rule(data=st.data())
    def multi_step_launch(self, data):
        """A multi-step launch: placeholders reserved for several sequences at once (all
        or none, each in pages it owns alone), the device writes their tokens, then
        ``fill_reserved`` gives them their values and marks them computed."""
        live = sorted(s for s in self.tokens if not self.bm.is_swapped(s))
        if not live:
            return
        group = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=4, unique=True))
        counts = data.draw(
            st.lists(st.integers(0, 2 * P + 1), min_size=len(group), max_size=len(group))
        )
        before = (self.bm.stats(), {s: self.bm.block_table(s) for s in group})
        lens = [self.bm.num_tokens(s) for s in group]
        if not self.bm.reserve_tokens(group, counts):
            assert (self.bm.stats(), {s: self.bm.block_table(s) for s in group}) == before
            return
        sampled = []
        for sid, k, n in zip(group, counts, lens, strict=True):
            assert self.bm.num_tokens(sid) == n + k
            slots = self.bm.slots(sid, n, n + k)
            for page in set((slots // P).tolist()):
                assert self.bm.refcount(page) == 1, f"reserve_tokens left page {page} shared"
            toks = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=k, max_size=k))
            self.pending_writes.append((slots, toks))
            sampled.append(toks)
        self._step()
        if data.draw(st.booleans(), label="as one array"):  # as the engine: i32[S, J], counts
            width = max(counts) + data.draw(st.integers(0, 2))
            rows = np.full((len(group), width), -7, np.int32)  # -7: never read
            for i, t in enumerate(sampled):
                rows[i, : len(t)] = t
            self.bm.fill_reserved(group, lens, rows, counts=counts)
        else:
            self.bm.fill_reserved(group, lens, [np.array(t, np.int32) for t in sampled])
        for sid, toks in zip(group, sampled, strict=True):
            self.tokens[sid] += toks
            assert self.bm.num_computed_tokens(sid) == len(self.tokens[sid])
            assert list(self.bm.token_ids(sid)) == self.tokens[sid]

    @rule(data=st.data())
    def speculative_step(self, data):
        """A verify step of speculative decoding: a sequence appends its last token and
        k proposals, the device writes all of them, then the rejected tail is dropped
        (``truncate``) and what is kept marked computed. The dropped tokens' pages come
        back, and no prefix-cache page ever holds a rejected token (``allocate``'s hits
        are checked against the shadow pool)."""
        live = sorted(s for s in self.tokens if not self.bm.is_swapped(s))
        if not live:
            return
        sid = data.draw(st.sampled_from(live))
        toks = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=2, max_size=2 * P + 2))
        n = self.bm.num_tokens(sid)
        pages_before = len(self.bm.block_table(sid))
        try:
            slots = self.bm.append_slots(sid, toks)
        except OutOfPages:
            return
        self.pending_writes.append((slots, toks))  # rejected ones too: the step wrote them
        self._step()
        keep = data.draw(st.integers(1, len(toks)), label="tokens kept")
        self.bm.truncate(sid, n + keep)
        self.bm.mark_computed(sid, n + keep)
        self.tokens[sid] += toks[:keep]
        assert list(self.bm.token_ids(sid)) == self.tokens[sid]
        table = self.bm.block_table(sid)
        assert len(table) == max(pages_before, -(-(n + keep) // P))
        for page in set((slots // P).tolist()) - set(table):  # only dropped tokens used it
            assert self.bm.refcount(page) == 0, f"page {page} of rejected tokens kept"

    @rule(sid=consumes(seqs))
    def free(self, sid):
        if sid in self.tokens:
            self.bm.free(sid)
            del self.tokens[sid]

    @rule(data=st.data())
    def free_any(self, data):
        # Forked children are not in the bundle; this frees any live sequence.
        if self.tokens:
            sid = data.draw(st.sampled_from(sorted(self.tokens)))
            self.bm.free(sid)
            del self.tokens[sid]

    @rule(data=st.data())
    def swap_out(self, data):
        live = sorted(s for s in self.tokens if not self.bm.is_swapped(s))
        if not live:
            return
        group = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=3, unique=True))
        try:
            plan = self.bm.swap_out(group)
        except OutOfPages:
            return
        for dev, slot in plan:
            self.host[slot] = self.device[dev]

    @rule(data=st.data())
    def swap_in(self, data):
        swapped = sorted(s for s in self.tokens if self.bm.is_swapped(s))
        if not swapped:
            return
        group = data.draw(st.lists(st.sampled_from(swapped), min_size=1, max_size=3, unique=True))
        try:
            plan = self.bm.swap_in(group)
        except OutOfPages:
            return
        for slot, dev in plan:
            self.device[dev] = self.host[slot]

    @invariant()
    def content_and_counts(self):
        self.bm.check_invariants()
        for sid, toks in self.tokens.items():
            pool = self.host if self.bm.is_swapped(sid) else self.device
            table = self.bm.block_table(sid)
            got = pool[table].reshape(-1)[: len(toks)]
            assert list(got) == toks, f"seq {sid} reads {list(got)}, wrote {toks}"
            assert 0 not in table or self.bm.is_swapped(sid)

    @invariant()
    def stats_agree_with_recount(self):
        s = self.bm.stats()
        rc = [self.bm.refcount(p) for p in range(self.bm.num_pages)]
        assert s["pages_used"] == sum(r > 0 for r in rc)
        assert s["pages_shared"] == sum(r > 1 for r in rc)
        assert s["pages_used"] + self.bm.num_free_pages == self.bm.num_pages - 1
        # tokens stored: each page's most tokens written by any sequence holding it
        fill: dict[int, int] = {}
        for sid, toks in self.tokens.items():
            if not self.bm.is_swapped(sid):
                for i, page in enumerate(self.bm.block_table(sid)):
                    fill[page] = max(fill.get(page, 0), min(P, len(toks) - i * P))
        assert s["tokens_stored"] == sum(fill.values())
        assert s["pages_referenced"] == sum(
            len(self.bm.block_table(sid)) for sid in self.tokens if not self.bm.is_swapped(sid)
        )

    @precondition(lambda self: len(self.tokens) > 0)
    @rule()
    def free_everything_leaks_nothing(self):
        # Occasionally drain the whole manager: every page must come back.
        for sid in list(self.tokens):
            self.bm.free(sid)
        self.tokens.clear()
        assert self.bm.num_free_pages == self.bm.num_pages - 1
        assert self.bm.num_host_free_pages == self.bm.num_host_pages
        assert self.bm.stats()["pages_used"] == 0


class UncachedBlockManagerMachine(BlockManagerMachine):
    """The same interleavings with prefix caching off (the manager's shorter paths: no
    page keys to register when tokens become computed)."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(24, P, watermark=0.0, num_host_pages=12, enable_prefix_caching=False)


class HybridBlockManagerMachine(RuleBasedStateMachine):
    """The hybrid manager (a sliding group and a full one over one pool) under random
    admissions with prefix hits, decode steps, swaps and aborts, against a shadow pool:
    after every rule each group of each sequence reads back its own tokens through its
    table (entries a window dropped excepted), and the groups agree on what is computed.
    A prefix hit one group found and another lost to an eviction wrote nothing where the
    engine then skipped K/V (issue 56, item 1)."""

    def __init__(self):
        super().__init__()
        # a small pool: admissions often take their fresh pages from cached ones
        self.bm = HybridBlockManager(
            12, P, group_windows=(6, None), watermark=0.0, num_host_pages=8
        )
        self.device = np.full((12, P), -1, np.int64)
        self.host = np.full((8, P), -1, np.int64)
        self.tokens: dict[int, list[int]] = {}
        self.next_id = 0

    def _write(self, slots, toks):
        """``slots`` i32[G, n]: every group's slots of the tokens ``toks``."""
        self.bm.take_copies()  # no forks here: never a copy to apply
        for row in np.asarray(slots):
            for slot, tok in zip(row.tolist(), toks, strict=True):
                assert slot // P != 0, "a token slot on the null page"
                self.device[slot // P, slot % P] = tok

    @rule(
        # whole pages half the time: computed and freed, every page of them stays cached,
        # and later admissions take their fresh pages from the cached ones
        prompt=st.one_of(
            st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=14),
            st.sampled_from([P, 2 * P]).flatmap(
                lambda n: st.lists(st.integers(0, 1), min_size=n, max_size=n)
            ),
        ),
        salt=st.sampled_from([None, "t1"]),
        computed=st.booleans(),
    )
    def allocate(self, prompt, salt, computed):
        self.next_id += 1
        sid = self.next_id
        before = self.bm.stats()
        try:
            cached = self.bm.allocate(sid, prompt, extra_key=salt)
        except OutOfPages:
            assert self.bm.stats() == before
            return
        assert cached % P == 0 and cached < len(prompt)
        for g, table in enumerate(self.bm.block_table(sid)):
            assert self.bm.inner.num_computed_tokens((sid, g)) == cached
            for i, page in enumerate(table[: cached // P]):  # hits hold the prompt already
                assert page == 0 or list(self.device[page]) == prompt[i * P : (i + 1) * P]
        self.tokens[sid] = list(prompt)
        self._write(self.bm.slots(sid, cached, len(prompt)), prompt[cached:])
        if computed:
            self.bm.mark_computed(sid, len(prompt))

    @rule(data=st.data())
    def decode_all(self, data):
        live = sorted(s for s in self.tokens if not self.bm.is_swapped(s))
        if not live:
            return
        group = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=4, unique=True))
        toks = data.draw(
            st.lists(st.integers(0, VOCAB - 1), min_size=len(group), max_size=len(group))
        )
        lens = [self.bm.num_tokens(s) for s in group]
        if not self.bm.append_tokens(group, toks):
            return
        for sid, tok, n in zip(group, toks, lens, strict=True):
            self.tokens[sid].append(tok)
            self._write(self.bm.slots(sid, n, n + 1), [tok])

    @rule(data=st.data())
    def abort(self, data):
        if self.tokens:
            sid = data.draw(st.sampled_from(sorted(self.tokens)))
            self.bm.free(sid)
            del self.tokens[sid]

    @rule(data=st.data())
    def swap(self, data):
        live = sorted(s for s in self.tokens if not self.bm.is_swapped(s))
        swapped = sorted(s for s in self.tokens if self.bm.is_swapped(s))
        if live and (not swapped or data.draw(st.booleans())):
            group = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=2, unique=True))
            try:
                for dev, slot in self.bm.swap_out(group):
                    self.host[slot] = self.device[dev]
            except OutOfPages:
                pass
        elif swapped:
            group = data.draw(
                st.lists(st.sampled_from(swapped), min_size=1, max_size=2, unique=True)
            )
            try:
                for slot, dev in self.bm.swap_in(group):
                    self.device[dev] = self.host[slot]
            except OutOfPages:
                pass

    @invariant()
    def groups_read_their_own_tokens(self):
        self.bm.check_invariants()
        for sid, toks in self.tokens.items():
            swapped = self.bm.is_swapped(sid)
            pool = self.host if swapped else self.device
            for table in self.bm.block_table(sid):
                for i, page in enumerate(table):
                    if page == (-1 if swapped else 0):  # dropped by the sliding window
                        continue
                    want = toks[i * P : (i + 1) * P]
                    assert list(pool[page][: len(want)]) == want, (sid, i, page)

    @precondition(lambda self: len(self.tokens) > 0)
    @rule()
    def free_everything_leaks_nothing(self):
        for sid in list(self.tokens):
            self.bm.free(sid)
        self.tokens.clear()
        assert self.bm.num_free_pages == self.bm.num_pages - 1
        assert self.bm.num_host_free_pages == self.bm.num_host_pages


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestHybridBlockManagerMachine = HybridBlockManagerMachine.TestCase
TestHybridBlockManagerMachine.settings = settings(
    settings.default, max_examples=max(100, settings.default.max_examples), stateful_step_count=50
)
TestUncachedBlockManagerMachine = UncachedBlockManagerMachine.TestCase
# Each example is cheap (pure Python): run more, longer interleavings than the suite default.
TestBlockManagerMachine.settings = settings(
    settings.default,
    max_examples=max(150, settings.default.max_examples),
    stateful_step_count=60,
)
TestUncachedBlockManagerMachine.settings = settings(
    settings.default, max_examples=max(60, settings.default.max_examples), stateful_step_count=60
)


# ---------------------------------------------------------------------- determinism

_REPLAY = textwrap.dedent(
    """
    import numpy as np
    from paged_jax.block_manager import BlockManager, OutOfPages
    rng = np.random.default_rng(7)
    bm = BlockManager(64, 4, num_host_pages=16)
    live = []
    for i in range(300):
        op = rng.integers(0, 5)
        if op == 0 or not live:
            prompt = rng.integers(0, 3, rng.integers(1, 20)).tolist()
            try:
                bm.allocate(i, prompt, extra_key=None if i % 3 else "s")
            except OutOfPages:
                continue
            bm.mark_computed(i, len(prompt))
            live.append(i)
        elif op == 1:
            s = live[rng.integers(len(live))]
            if not bm.is_swapped(s):
                try:
                    bm.append_slots(s, [int(rng.integers(0, 3))])
                except OutOfPages:
                    pass
        elif op == 2:
            s = live[rng.integers(len(live))]
            if not bm.is_swapped(s):
                bm.fork(s, 1000 + i)
                live.append(1000 + i)
        elif op == 3:
            bm.free(live.pop(rng.integers(len(live))))
        else:
            s = live[rng.integers(len(live))]
            try:
                (bm.swap_in if bm.is_swapped(s) else bm.swap_out)([s])
            except OutOfPages:
                pass
        bm.take_copies()  # one op per step
    print(sorted((s, bm.block_table(s)) for s in live), bm.stats())
    """
)


def test_same_operations_give_the_same_pages_in_a_new_process():
    outs = []
    for seed in ("0", "12345"):  # different hash seeds: Python's hash() must not matter
        env = {"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"}
        proc = subprocess.run(
            [sys.executable, "-c", _REPLAY],
            capture_output=True,
            text=True,
            env=env | {"PYTHONPATH": ":".join(sys.path)},
            check=True,
        )
        outs.append(proc.stdout)
    assert outs[0] == outs[1] and "kv_utilization" in outs[0]


def test_host_modules_do_not_import_jax():
    code = (
        "import sys, paged_jax, paged_jax.block_manager, paged_jax.batch; "
        "print('jax' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": ":".join(sys.path), "PATH": "/usr/bin:/bin"},
        check=True,
    )
    assert proc.stdout.strip() == "False"


# ---------------------------------------------------------------------- batch builder


def test_bucket():
    assert [bucket(n) for n in (0, 1, 2, 3, 4, 5, 17)] == [1, 1, 2, 4, 4, 8, 32]
    assert bucket(3, minimum=16) == 16


def test_build_batch_mixed_step():
    bm = _bm(32)
    bm.allocate("pre", list(range(10, 20)))  # 10-token prompt, first chunk of 6 this step
    bm.allocate("dec", [1, 2, 3])
    bm.append_slots("dec", [4])  # decode token at position 3
    batch = build_batch(bm, [ScheduledSeq("pre", 0, 6), ScheduledSeq("dec", 3, 4)])
    assert batch.token_ids.shape == (16,) and batch.page_indices.shape == (8, 4)
    assert batch.num_tokens == 7 and list(batch.num_seqs) == [2]
    np.testing.assert_array_equal(batch.cu_q_lens, [0, 6, 7, 7, 7, 7, 7, 7, 7])
    np.testing.assert_array_equal(batch.kv_lens, [6, 4, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch.token_ids[:7], [10, 11, 12, 13, 14, 15, 4])
    np.testing.assert_array_equal(batch.positions[:7], [0, 1, 2, 3, 4, 5, 3])
    np.testing.assert_array_equal(batch.slot_mapping[:6], bm.slots("pre", 0, 6))
    assert batch.slot_mapping[6] == bm.slots("dec", 3, 4)[0]
    assert not batch.slot_mapping[7:].any() and not batch.token_ids[7:].any()
    np.testing.assert_array_equal(batch.page_indices[0, :2], bm.block_table("pre")[:2])
    assert not batch.page_indices[0, 2:].any() and not batch.page_indices[2:].any()
    np.testing.assert_array_equal(batch.logits_indices[:2], [5, 6])
    assert batch.copy_src.shape == (8,) and not batch.copy_src.any()


def test_build_batch_carries_copies_and_validates():
    bm = _bm(32)
    bm.allocate("p", [1, 2, 3, 4, 5, 6])
    bm.mark_computed("p", 6)
    bm.fork("p", "c")
    bm.append_slots("c", [7])
    batch = build_batch(bm, [ScheduledSeq("c", 6, 7)])
    assert (batch.copy_src[0], batch.copy_dst[0]) == (2, 3)
    with pytest.raises(
        ValueError,
        match=r"scheduled\[0\]: expected 0 <= start < stop <= "
        "num_tokens=6 for seq_id 'p', got start=6, stop=7",
    ):
        build_batch(bm, [ScheduledSeq("p", 6, 7)])


def test_concat_batches_gives_each_replica_its_own_padded_rows():
    from paged_jax import concat_batches, validate_batch

    a, b, idle = _bm(32), _bm(32), _bm(32)
    a.allocate("p", list(range(10, 30)))  # a 20-token prefill: T_b 32
    b.allocate("d", [1, 2, 3])
    b.mark_computed("d", 3)
    b.fork("d", "e")  # the two share the prompt's last page: a copy-on-write copy on b
    b.append_slots("d", [4])
    b.append_slots("e", [5])
    parts = [
        build_batch(a, [ScheduledSeq("p", 0, 20)]),
        build_batch(b, [ScheduledSeq("d", 3, 4), ScheduledSeq("e", 3, 4)]),
        build_batch(idle, []),
    ]
    cat = concat_batches(parts)
    T, S, M, C = 32, 8, 8, 8  # a: 32 tokens, 5 pages; b: 16 tokens, 4 pages wide
    assert cat.token_ids.shape == (3 * T,) and cat.page_indices.shape == (3 * S, M)
    assert cat.cu_q_lens.shape == (3 * (S + 1),) and cat.copy_src.shape == (3 * C,)
    assert cat.num_tokens == 22 and list(cat.num_seqs) == [1, 2, 0]
    assert cat.seq_ids == ("p", "d", "e")
    for r, part in enumerate(parts):
        t, n = part.token_ids.shape[0], part.kv_lens.shape[0]
        for name in ("token_ids", "positions", "slot_mapping"):  # local slots, zero-padded
            got = getattr(cat, name)[r * T : (r + 1) * T]
            np.testing.assert_array_equal(got[:t], getattr(part, name))
            assert not got[t:].any()
        rows = cat.page_indices[r * S : (r + 1) * S]
        np.testing.assert_array_equal(rows[:n, : part.page_indices.shape[1]], part.page_indices)
        assert not rows[:, part.page_indices.shape[1] :].any() and not rows[n:].any()
        cu = cat.cu_q_lens[r * (S + 1) : (r + 1) * (S + 1)]
        np.testing.assert_array_equal(cu[: n + 1], part.cu_q_lens)
        assert (cu[n:] == part.num_tokens).all()
        # logits rows are global: replica r's tokens start at r * T
        np.testing.assert_array_equal(
            cat.logits_indices[r * S : r * S + n], part.logits_indices + r * T
        )
        np.testing.assert_array_equal(cat.copy_src[r * C : r * C + 8], part.copy_src)
        # each replica's share is a valid batch of its own pool
        share = dataclasses.replace(
            part,
            **{
                k: getattr(cat, k)[r * w : (r + 1) * w]
                for k, w in (("token_ids", T), ("positions", T), ("slot_mapping", T))
            },
            page_indices=rows,
            kv_lens=cat.kv_lens[r * S : (r + 1) * S],
            cu_q_lens=cu,
            logits_indices=cat.logits_indices[r * S : (r + 1) * S] - r * T,
        )
        validate_batch(share, num_pages=32, page_size=4, vocab_size=64)
    assert (cat.copy_src[C], cat.copy_dst[C]) == (parts[1].copy_src[0], parts[1].copy_dst[0])
    assert concat_batches(parts[:1]) is parts[0]


@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 6)), min_size=1, max_size=12))
def test_build_batch_shapes_depend_only_on_buckets(specs):
    # Any composition with the same bucketed sizes gives the same array shapes, and the
    # arrays satisfy paged_jax.validate_inputs' rules.
    bm = BlockManager(512, 8, watermark=0.0)
    sched = []
    for i, (n, q) in enumerate(specs):
        bm.allocate(i, list(range(n)))
        q = min(q, n)
        sched.append(ScheduledSeq(i, n - q, n))
    b = build_batch(bm, sched)
    T = sum(s.stop - s.start for s in sched)
    assert b.token_ids.shape == (bucket(T, 16),)
    assert b.page_indices.shape == (
        bucket(len(specs), 8),
        bucket(-(-max(n for n, _ in specs) // 8), 4),
    )
    assert np.all(np.diff(b.cu_q_lens) >= 0) and b.cu_q_lens[len(specs)] == T
    q_lens = np.diff(b.cu_q_lens)[: len(specs)]
    assert np.all(q_lens <= b.kv_lens[: len(specs)])
    slots = b.slot_mapping[:T]
    assert len(set(slots.tolist())) == T and np.all(slots >= 8)


def test_batched_calls_keep_every_row_apart_as_the_arrays_grow():
    """append_tokens, reserve_tokens and fill_reserved write many sequences' rows in one
    go: each row gets its own tokens while the rows double past 8 and the token ids widen
    past 16 columns; a sequence named twice is refused before anything changes."""
    bm = BlockManager(200, P, watermark=0.0)
    want = {}
    for i in range(10):  # > 8 rows
        want[i] = list(range(100 * i, 100 * i + 3 + i))
        bm.allocate(i, want[i])
        bm.mark_computed(i, len(want[i]))
    ids = list(range(10))
    assert bm.append_tokens(ids, [1000 + i for i in ids])
    bm.take_copies()
    counts = [i % 4 for i in ids]
    starts = [bm.num_tokens(i) for i in ids]
    assert bm.reserve_tokens(ids, counts)
    bm.take_copies()
    sampled = np.arange(10 * 4, dtype=np.int32).reshape(10, 4) + 2000
    bm.fill_reserved(ids, starts, sampled, counts=counts)
    for i in ids:
        want[i] += [1000 + i] + sampled[i, : counts[i]].tolist()
    bm.append_slots(3, list(range(40)))  # row 3 alone widens the token ids past 16
    want[3] += list(range(40))
    for i in ids:
        assert bm.token_ids(i).tolist() == want[i], i
        assert bm.num_computed_tokens(i) >= len(want[i]) - (40 if i == 3 else 1)
    bm.check_invariants()
    before = (bm.stats(), [bm.token_ids(i).tolist() for i in ids])
    for call in (
        lambda: bm.append_tokens([1, 2, 1], [5, 6, 7]),
        lambda: bm.reserve_tokens([4, 4], [1, 1]),
        lambda: bm.fill_reserved([5, 5], [0, 0], np.zeros((2, 1), np.int32), counts=[0, 0]),
    ):
        with pytest.raises(ValueError, match="expected distinct sequences, got [0-9]+ twice"):
            call()
    assert (bm.stats(), [bm.token_ids(i).tolist() for i in ids]) == before


def test_seq_rows_stand_for_their_sequences_until_a_row_changes_hands():
    """A SeqRows handle works in place of its ids while its rows hold the same
    sequences; once one is freed (its row reused) or swapped out, the call looks the ids
    up and raises the same errors as with plain ids."""
    bm = BlockManager(64, P, watermark=0.0, num_host_pages=16)
    for i in range(4):
        bm.allocate(i, [i] * 3)
        bm.mark_computed(i, 3)
    handle = bm.seq_rows([2, 0, 3])
    assert handle.rows.tolist() == [bm.table_row(i) for i in (2, 0, 3)]
    assert bm.append_tokens(handle, [7, 8, 9])
    assert [bm.token_ids(i)[-1] for i in (2, 0, 3)] == [7, 8, 9]
    part = handle.take(np.array([True, False, True]))
    assert list(part) == [2, 3] and bm.reserve_tokens(part, [2, 1])
    bm.take_copies()
    bm.fill_reserved(part, [4, 4], np.array([[5, 6], [4, 0]], np.int32), counts=[2, 1])
    assert bm.token_ids(2).tolist() == [2, 2, 2, 7, 5, 6]
    bm.free(0)
    bm.allocate("new", [1, 2])  # takes row 0's place
    assert bm.table_row("new") == handle.rows[1]
    with pytest.raises(UnknownSequence, match="seq_id 0: unknown"):
        bm.append_tokens(handle, [1, 1, 1])
    bm.take_copies()
    bm.swap_out([3])
    with pytest.raises(InvalidSequenceState, match="seq_id 3 is swapped out"):
        bm.reserve_tokens(part, [1, 1])
    with pytest.raises(ValueError, match="expected distinct sequences, got 1 twice"):
        bm.seq_rows([1, 1])
    bm.check_invariants()


def test_tables_rows_follow_every_block_table_change():
    """tables(): one row per sequence equal to its block table (zeros after it), through
    appends, a copy-on-write, forks, swaps, a sliding window and frees, and while the
    array grows past its first 8 rows and 8 columns."""
    bm = BlockManager(96, P, watermark=0.0, num_host_pages=48)

    def check():
        bm.check_invariants()  # includes the rows
        t = bm.tables()
        for sid in bm.seq_ids:
            row = t[bm.table_row(sid)] if not bm.is_swapped(sid) else None
            if row is not None:
                n = len(bm.block_table(sid))
                assert row[:n].tolist() == bm.block_table(sid) and not row[n:].any()

    for i in range(10):  # > 8 rows
        bm.allocate(i, list(range(3 + i)))
        bm.mark_computed(i, 3 + i)
    check()
    assert bm.append_tokens(list(range(10)), [7] * 10)
    bm.take_copies()
    bm.fork(3, "3b")  # shares 3's partial last page
    bm.append_slots("3b", [1])  # copy-on-write: its last entry changes
    assert bm.block_table("3b")[-1] != bm.block_table(3)[-1]
    check()
    bm.take_copies()
    bm.append_slots(0, list(range(40)))  # 44 tokens: 11 pages > 8 columns
    assert bm.tables().shape[1] >= 11
    check()
    bm.take_copies()
    bm.mark_computed(0, bm.num_tokens(0))
    bm.swap_out([5])
    check()
    bm.swap_in([5])
    check()
    bm.allocate("w", list(range(20)), sliding_window=6)
    bm.mark_computed("w", 20)  # leading pages dropped: their entries become 0
    assert bm.block_table("w")[0] == 0
    check()
    for sid in [0, "3b", "w", 7]:
        bm.free(sid)
    check()
    assert not bm.tables()[bm.rows.free_rows].any()  # freed rows are zeros again


def test_an_append_that_does_not_fit_leaves_the_sequence_free_to_swap():
    """Found by the state machine under JAX 0.11's run: a failed ``append_slots`` (a verify
    step's proposals without pages) must not count as this step's append, or the
    sequence could not be swapped out in the same step."""
    bm = BlockManager(4, 2, watermark=0.0, num_host_pages=4)
    bm.allocate("a", [1, 2, 3])  # 2 pages
    bm.take_copies()  # the prompt's step
    with pytest.raises(OutOfPages):
        bm.append_slots("a", [4, 5, 6, 7, 8])  # needs 2 more pages, 1 is free
    assert bm.swap_out(["a"])  # no InvalidSequenceState
    bm.check_invariants()
