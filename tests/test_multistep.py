"""Multi-step decoding (``LLM(num_scheduler_steps=K)``): K decode steps of every running
sequence in one jitted launch. Checked here: the same tokens, log-probs, finish reasons
and texts as single steps for every kind of request (greedy, seeded, n samples, stop
tokens and strings that end a sequence mid-launch, max_tokens that end it short of K);
pages all returned; fallbacks to single steps; the block manager's reserve and fill."""

import numpy as np
import pytest

import paged_jax as pj
from paged_jax import models
from paged_jax.batch import ScheduledSeq, advance_batch, build_batch
from paged_jax.block_manager import BlockManager


def _engine(K: int, **kw):
    args = dict(num_pages=96, page_size=8, max_num_seqs=16, max_num_batched_tokens=128)
    args.update(kw)
    return pj.LLM(*models.load("tiny-llama"), num_scheduler_steps=K, **args)


def _summary(outs):
    return [
        [
            (c.token_ids, c.finish_reason, c.logprobs, c.cumulative_logprob, c.text)
            for c in o.outputs
        ]
        for o in outs
    ]


def _prompts():
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 256, 19).tolist()  # a prefix-cache hit for the second
    return [
        shared + [1, 2],
        shared + [3],
        rng.integers(0, 256, 5).tolist(),
        rng.integers(0, 256, 30).tolist(),
        rng.integers(0, 256, 12).tolist(),
        rng.integers(0, 256, 9).tolist(),
        rng.integers(0, 256, 3).tolist(),
    ]


@pytest.fixture(scope="module")
def requests():
    """Prompts and params whose stop token and stop string fall mid-launch: taken from the
    greedy continuations single steps give."""
    prompts = _prompts()
    free = pj.SamplingParams(max_tokens=24, ignore_eos=True)
    ref = _engine(1).generate([prompts[4], prompts[5]], free, progress=False)
    ids = ref[0].outputs[0].token_ids
    stop_token = next(t for t in ids[5:] if t not in ids[:5])  # first seen at 5 or later
    text = ref[1].outputs[0].text
    # a printable ASCII character first seen late (bytes that are not UTF-8 decode to
    # replacement characters, whose text changes as tokens arrive)
    stop_text = next(
        c
        for i, c in enumerate(text)
        if i >= 5 and c.isalnum() and c.isascii() and c not in text[:i]
    )
    params = [
        pj.SamplingParams(max_tokens=23, ignore_eos=True),
        pj.SamplingParams(max_tokens=17, temperature=0.9, top_p=0.8, seed=4, logprobs=True),
        pj.SamplingParams(max_tokens=3, ignore_eos=True),  # ends short of a launch
        pj.SamplingParams(max_tokens=21, temperature=1.0, n=2, seed=7, ignore_eos=True),
        pj.SamplingParams(max_tokens=24, stop_token_ids=(stop_token,), ignore_eos=True),
        pj.SamplingParams(max_tokens=24, stop=(stop_text,), ignore_eos=True),
        pj.SamplingParams(max_tokens=30, temperature=0.7, top_k=5, seed=1, logprobs=True),
    ]
    return prompts, params


@pytest.mark.parametrize("K, overlapped", [(4, True), (8, True), (4, False)])
def test_multi_step_launches_change_no_token(requests, K, overlapped):
    """Overlapped (the default), each launch after the first of a run goes on from the
    one still running (``StepLauncher.plan_continuation``), rows that stop meanwhile
    dropped."""
    prompts, params = requests
    single = _engine(1)
    ref = single.generate(prompts, params, progress=False)
    llm = _engine(K, async_scheduling=overlapped, checked=True)  # checks lane.cum too
    launcher = llm.engine.launcher
    went_on, plan = [], launcher.plan_continuation
    launcher.plan_continuation = lambda *a: went_on.append(plan(*a)) or went_on[-1]
    outs = llm.generate(prompts, params, progress=False)
    # launches that went on from the one running: overlapped only
    assert sum(f is not None for f in went_on) >= (2 if overlapped else 0)
    assert all(f is None for f in went_on) != overlapped
    assert _summary(outs) == _summary(ref)
    assert outs[4].outputs[0].finish_reason == "stop" and len(outs[4].outputs[0].token_ids) < 24
    assert outs[5].outputs[0].finish_reason == "stop" and len(outs[5].outputs[0].token_ids) < 24
    assert single.metrics.multi_step_launches == 0 and llm.metrics.multi_step_launches > 0
    assert llm.metrics.tokens_generated == single.metrics.tokens_generated
    # fewer launches for the same device steps
    assert llm.metrics.steps >= single.metrics.steps - 1
    for e in (single, llm):
        assert e.bm.stats()["pages_used"] == 0
        e.bm.check_invariants()


def test_generated_pages_enter_the_prefix_cache_with_their_real_tokens():
    """A reserved token is a placeholder until the launch returns: the pages it fills must
    be cached under the sampled tokens, so a prompt that repeats a sequence's output hits
    them."""
    p = pj.SamplingParams(max_tokens=32, ignore_eos=True)
    llm = _engine(8)
    first = llm.generate([[7, 8, 9]], p, progress=False)[0].outputs[0].token_ids
    assert llm.metrics.multi_step_launches > 0
    again = llm.generate([[7, 8, 9, *first]], pj.SamplingParams(max_tokens=1), progress=False)
    assert again[0].metrics.num_cached_tokens == 32  # every full page of prompt and output
    llm.bm.check_invariants()


def test_every_dispatch_after_the_first_overlaps_the_one_before(monkeypatch):
    """With overlapped steps nothing waits for known tokens: the prompts' single steps,
    the first launch (dispatched while the last single step runs, from its placeholders)
    and the launches after it are each dispatched while the one before runs."""
    prompts = _prompts()
    p = pj.SamplingParams(max_tokens=20, ignore_eos=True)
    ref = _engine(1, async_scheduling=False).generate(prompts, p, progress=False)
    llm = _engine(8)
    sent = []  # each dispatch's steps (None: a single step)
    launch = llm.runner.launch
    monkeypatch.setattr(llm.runner, "launch", lambda i: sent.append(i.steps) or launch(i))
    assert _summary(llm.generate(prompts, p, progress=False)) == _summary(ref)
    m = llm.metrics
    assert sent[0] is None and sent[-1] is not None  # a single step first, launches last
    assert m.multi_step_launches == sum(steps is not None for steps in sent) >= 2
    assert m.overlapped_steps == len(sent) - 1
    llm.bm.check_invariants()


def test_a_waiting_request_gets_single_steps_and_the_same_tokens():
    """Requests that do not fit at once: while one waits, steps are single (its prompt
    runs as soon as pages free); outputs as with single steps throughout."""
    prompts = _prompts()
    p = pj.SamplingParams(max_tokens=20, ignore_eos=True)
    # deterministic: batches differ from single steps' here, and log-probs must not
    tight = dict(num_pages=14, max_num_seqs=4, deterministic=True)
    ref = _engine(1, **tight).generate(prompts, p, progress=False)
    llm = _engine(8, **tight)
    assert _summary(llm.generate(prompts, p, progress=False)) == _summary(ref)
    assert llm.metrics.multi_step_launches > 0
    llm.bm.check_invariants()


def test_beams_and_penalties_run_single_steps():
    prompts = _prompts()[:3]
    params = [
        pj.SamplingParams(max_tokens=10, beam_width=2, ignore_eos=True),
        pj.SamplingParams(max_tokens=10, repetition_penalty=1.3, ignore_eos=True),
    ]
    for p in params:
        ref = _engine(1).generate(prompts, p, progress=False)
        llm = _engine(4)
        assert _summary(llm.generate(prompts, p, progress=False)) == _summary(ref)
        assert llm.metrics.multi_step_launches == 0


def test_deterministic_mode_multi_step_matches_single_steps(requests):
    prompts, params = requests
    ref = _engine(1, deterministic=True).generate(prompts, params, progress=False)
    llm = _engine(4, deterministic=True)
    assert _summary(llm.generate(prompts, params, progress=False)) == _summary(ref)
    assert llm.metrics.multi_step_launches > 0


def test_streamed_text_of_launches_is_the_generated_text():
    p = pj.SamplingParams(max_tokens=21, ignore_eos=True)
    llm = _engine(4)
    pieces = {}
    for piece in llm.stream(["Hello", "Paged attention"], p):
        pieces[piece.index] = pieces.get(piece.index, "") + piece.text
    whole = _engine(1).generate(["Hello", "Paged attention"], p, progress=False)
    assert [pieces[k] for k in range(2)] == [o.outputs[0].text for o in whole]
    assert llm.metrics.multi_step_launches > 0


class _Fault(Exception):
    pass


@pytest.mark.failing_steps
@pytest.mark.parametrize("when", ["before", "after"])
def test_a_failed_launch_loses_nothing_and_changes_no_token(requests, when):
    """A fault before the device call, or after it (the cache donated, the reserved tokens
    never filled): the requests are recomputed from their committed tokens."""
    prompts, params = requests
    # deterministic: recomputed requests run in other batches, their log-probs must not
    # change
    ref = _engine(1, deterministic=True).generate(prompts, params, progress=False)
    llm = _engine(4, deterministic=True)
    real, launches = llm.runner.step_fn, []

    class Run:
        def __call__(self, *a, **k):
            multi = k.get("num_steps", 1) > 1
            launches.append(multi)
            fail = multi and launches.count(True) in (1, 3)
            if fail and when == "before":
                raise _Fault("before the launch")
            out = real(*a, **k)
            if fail:
                raise _Fault("after the launch")
            return out

        def _cache_size(self):
            return real._cache_size()

    llm.runner.step_fn = Run()
    for rid, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        llm.add_request(rid, prompt, p)
    done, errors = {}, 0
    while llm.has_unfinished():
        try:
            done.update((o.request_id, o) for o in llm.step())
        except _Fault:
            errors += 1
    assert errors == 2 and launches.count(True) > 3
    assert _summary([done[i] for i in range(len(prompts))]) == _summary(ref)
    assert llm.bm.stats()["pages_used"] == 0
    llm.bm.check_invariants()


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "4"])
def test_num_scheduler_steps_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="num_scheduler_steps: expected an int >= 1"):
        _engine(bad)


# ---------------------------------------------------------------- block manager, batch
P = 4


def test_reserve_tokens_is_all_or_nothing_and_fill_reserved_sets_and_computes():
    bm = BlockManager(8, P, watermark=0.0)  # 7 usable pages
    bm.allocate("a", [1, 2, 3, 4, 5])  # 2 pages
    bm.allocate("b", [6, 7])  # 1 page
    bm.mark_computed("a", 5)
    bm.mark_computed("b", 2)
    free = bm.num_free_pages  # 4
    assert not bm.reserve_tokens(["a", "b"], [8, 11])  # 2 + 3 pages: one short
    assert bm.num_free_pages == free and bm.num_tokens("a") == 5 and bm.num_tokens("b") == 2
    assert bm.reserve_tokens(["a", "b"], [3, 0])
    assert bm.num_tokens("a") == 8 and bm.num_tokens("b") == 2
    assert list(bm.token_ids("a")[5:]) == [-1, -1, -1]
    assert bm.num_free_pages == free  # 8 tokens still fit in 2 pages
    assert bm.reserve_tokens(["a"], [1])
    assert len(bm.block_table("a")) == 3 and bm.num_free_pages == free - 1
    bm.fill_reserved(["a"], [5], [np.array([9, 10, 11], np.int32)])
    assert list(bm.token_ids("a")) == [1, 2, 3, 4, 5, 9, 10, 11, -1]
    assert bm.num_computed_tokens("a") == 8
    with pytest.raises(ValueError, match="starts: expected tokens not yet computed"):
        bm.fill_reserved(["a"], [7], [np.array([0], np.int32)])  # token 7 is computed
    with pytest.raises(ValueError, match=r"counts: expected 0 to 1 \(the tokens given\)"):
        bm.fill_reserved(["a"], [8], np.array([[12]], np.int32), counts=[2])
    with pytest.raises(ValueError, match="counts: expected one per sequence"):
        bm.fill_reserved(["a"], [8], np.array([[12]], np.int32), counts=[1, 1])
    with pytest.raises(ValueError, match="starts, tokens: expected one per sequence"):
        bm.fill_reserved(["a", "b"], [8], np.array([[12]], np.int32))
    bm.fill_reserved(["a"], [8], np.array([[12, 99]], np.int32), counts=[1])  # row's first
    assert list(bm.token_ids("a")) == [1, 2, 3, 4, 5, 9, 10, 11, 12]
    assert bm.num_computed_tokens("a") == 9
    with pytest.raises(ValueError, match="counts: expected ints >= 0"):
        bm.reserve_tokens(["a"], [-1])
    with pytest.raises(ValueError, match="counts: expected one per sequence"):
        bm.reserve_tokens(["a", "b"], [1])
    bm.check_invariants()


def test_reserved_placeholders_read_minus_one_in_a_reused_row_and_fill_keeps_rows_apart():
    """Reserving writes nothing (every cell past a sequence's tokens is -1 already): a row
    freed and handed to another sequence shows placeholders, not its old tokens. Rows that
    take one new page each, or several, get them in row order; filling rows with the same
    count or different counts writes each row's own tokens."""
    bm = BlockManager(32, P, watermark=0.0)
    bm.allocate("old", list(range(1, 4 * P)))  # a long sequence, then gone
    bm.free("old")
    bm.allocate("a", [7, 8])  # takes the freed row
    bm.allocate("b", [5] * (P - 1))
    bm.allocate("c", [6] * P)
    for s in "abc":
        bm.mark_computed(s, bm.num_tokens(s))
    assert bm.reserve_tokens(["c", "a", "b"], [P, 3, 2 * P])  # 1, 1 and 2 new pages
    assert list(bm.token_ids("a")) == [7, 8, -1, -1, -1]
    assert list(bm.token_ids("b")[P - 1 :]) == [-1] * (2 * P)
    assert [len(bm.block_table(s)) for s in "abc"] == [2, 3, 2]
    bm.check_invariants()
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 1000, (3, 2 * P)).astype(np.int32)
    bm.fill_reserved(["b", "c", "a"], [P - 1, P, 2], toks, counts=[P, P, 2])  # different
    assert list(bm.token_ids("a")) == [7, 8, *toks[2, :2], -1]
    assert list(bm.token_ids("b")[P - 1 :]) == [*toks[0, :P], *[-1] * P]
    assert list(bm.token_ids("c")[P:]) == list(toks[1, :P])
    bm.fill_reserved(["a", "b"], [4, 2 * P - 1], toks[:2], counts=[1, 1])  # the same
    assert list(bm.token_ids("a")) == [7, 8, *toks[2, :2], toks[0, 0]]
    assert bm.token_ids("b")[2 * P - 1] == toks[1, 0]
    assert [bm.num_computed_tokens(s) for s in "abc"] == [5, 2 * P, 2 * P]
    bm.check_invariants()


def test_reserve_tokens_copies_a_shared_last_page_first():
    bm = BlockManager(16, P, watermark=0.0)
    bm.allocate("p", [1, 2, 3, 4, 5, 6])  # page 2 holds 2 of 4 tokens
    bm.mark_computed("p", 6)
    bm.fork("p", "c")
    assert bm.reserve_tokens(["c"], [3])
    table = bm.block_table("c")
    assert table[0] == bm.block_table("p")[0] and table[1] != bm.block_table("p")[1]
    src, dst = bm.take_copies()
    assert list(src) == [bm.block_table("p")[1]] and list(dst) == [table[1]]
    assert list(bm.token_ids("p")) == [1, 2, 3, 4, 5, 6]  # the parent is unchanged
    bm.check_invariants()


def test_build_batch_tables_cover_table_tokens():
    bm = BlockManager(32, P, watermark=0.0, enable_prefix_caching=False)
    bm.allocate("a", [1, 2, 3])
    bm.mark_computed("a", 2)
    assert bm.reserve_tokens(["a"], [9])  # 12 tokens: 3 pages
    b = build_batch(bm, [ScheduledSeq("a", 2, 3)], table_tokens=[11])
    assert list(b.page_indices[0, :3]) == bm.block_table("a")
    assert b.kv_lens[0] == 3 and b.num_tokens == 1 and b.positions[0] == 2
    plain = build_batch(bm, [ScheduledSeq("a", 2, 3)])
    assert list(plain.page_indices[0]) == [bm.block_table("a")[0], 0, 0, 0]
    with pytest.raises(ValueError, match=r"table_tokens\[0\]: expected <= num_tokens=12"):
        build_batch(bm, [ScheduledSeq("a", 2, 3)], table_tokens=[13])
    with pytest.raises(ValueError, match="table_tokens: expected one per scheduled sequence"):
        build_batch(bm, [ScheduledSeq("a", 2, 3)], table_tokens=[3, 4])


def test_reserved_tokens_stay_uncomputed_across_steps_until_filled():
    """Overlapped launches reserve the next launch's tokens before the running one's are
    filled: a step boundary (``take_copies``) must not count placeholders computed, or
    their pages would enter the prefix cache under -1."""
    bm = BlockManager(32, P)
    bm.allocate("a", [1, 2, 3])
    bm.take_copies()  # the prompt's step
    assert bm.reserve_tokens(["a"], [5])  # launch 1: tokens 3..7
    bm.take_copies()
    assert bm.reserve_tokens(["a"], [4])  # launch 2, launch 1 still running: 8..11
    assert bm.num_computed_tokens("a") == 3  # the prompt only
    bm.take_copies()
    bm.fill_reserved(["a"], [3], [np.arange(10, 16, dtype=np.int32)])  # launch 1's 6
    assert bm.num_computed_tokens("a") == 9
    assert bm.reserve_tokens(["a"], [2])  # launch 3: 12, 13
    assert bm.num_computed_tokens("a") == 9  # 9..11 are launch 2's, not yet filled
    bm.fill_reserved(["a"], [9], [np.array([16, 17, 18], np.int32)])
    bm.fill_reserved(["a"], [12], [np.array([19, 20], np.int32)])
    assert list(bm.token_ids("a")) == [1, 2, 3, *range(10, 21)]
    assert bm.num_computed_tokens("a") == 14
    bm.check_invariants()


def _advanced_matches_built(bm, prev, rows, advance, reach, scheduled):
    want = build_batch(bm, scheduled, table_tokens=reach, take_copies=False)
    got = advance_batch(bm, prev, np.array(rows), np.array(advance), np.array(reach))
    names = ("positions", "slot_mapping", "page_indices", "kv_lens", "cu_q_lens")
    for name in (*names, "num_seqs", "logits_indices"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    assert got.seq_ids == want.seq_ids and got.num_tokens == want.num_tokens
    assert not got.token_ids.any()  # the caller's to fill
    return got


def test_advance_batch_equals_build_batch_of_the_rows_that_go_on():
    bm = BlockManager(64, P, watermark=0.0)
    lens = {"a": 5, "b": 8, "c": 3, "d": 14}
    for i, (sid, n) in enumerate(lens.items()):
        bm.allocate(sid, list(range(10 * i, 10 * i + n)))
        bm.mark_computed(sid, n)
    bm.fork("c", "e")  # shares c's partial last page: its next append copies it
    bm.take_copies()
    ids, k = list(lens) + ["e"], [6, 3, 5, 7, 2]
    assert bm.reserve_tokens(ids, [x - 1 for x in k])
    start = [bm.num_tokens(s) - x for s, x in zip(ids, k, strict=True)]  # last known token
    prev = build_batch(
        bm,
        [ScheduledSeq(s, a, a + 1) for s, a in zip(ids, start, strict=True)],
        table_tokens=[a + x for a, x in zip(start, k, strict=True)],
    )
    # the next launch: rows 0, 1, 3, 4 go on (c's row is dropped), with 4, 6, 2, 5 steps
    rows, steps = [0, 1, 3, 4], [4, 6, 2, 5]
    go_on = [ids[r] for r in rows]
    assert bm.reserve_tokens(go_on, steps)
    pos = [start[r] + k[r] for r in rows]
    reach = [p + s for p, s in zip(pos, steps, strict=True)]
    got = _advanced_matches_built(
        bm,
        prev,
        rows,
        [k[r] for r in rows],
        reach,
        [ScheduledSeq(s, p, p + 1) for s, p in zip(go_on, pos, strict=True)],
    )
    assert list(got.positions[:4]) == pos and not got.copy_src.any()  # prev took e's copy
    bm.check_invariants()


def test_advance_batch_reads_a_copied_last_page_and_a_windowed_table_again():
    bm = BlockManager(64, P, watermark=0.0)
    bm.allocate("a", [1, 2, 3, 4, 5, 6], sliding_window=6)
    bm.take_copies()
    prev = build_batch(bm, [ScheduledSeq("a", 5, 6)])
    assert bm.reserve_tokens(["a"], [1])
    bm.fill_reserved(["a"], [6], [np.array([7], np.int32)])
    assert bm.reserve_tokens(["a"], [8])  # 15 tokens: page 0 is dropped on a fill
    bm.fill_reserved(["a"], [7], [np.arange(8, dtype=np.int32)])
    assert bm.block_table("a")[0] == 0  # dropped (the null page)
    _advanced_matches_built(bm, prev, [0], [9], [15], [ScheduledSeq("a", 14, 15)])
    # a copy-on-write of prev's last page
    bm.allocate("c", [1, 2, 3, 4, 5, 6])  # page 1 holds 2 of 4 tokens
    bm.mark_computed("c", 6)
    bm.fork("c", "d")  # d's shared partial last page is copied at its first append
    prev_d = build_batch(bm, [ScheduledSeq("d", 5, 6)])
    assert bm.reserve_tokens(["d"], [3])
    got = _advanced_matches_built(bm, prev_d, [0], [3], [9], [ScheduledSeq("d", 8, 9)])
    old, new = prev_d.page_indices[0, 1], got.page_indices[0, 1]  # c's page, d's copy
    assert new != old and (got.copy_src[0], got.copy_dst[0]) == (old, new)  # taken
    bm.check_invariants()
