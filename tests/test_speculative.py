"""Speculative decoding (``LLM(speculative=...)``): proposals verified as extra query
tokens of a step, kept while they equal the samples, rolled back page by page. Checked
here: the n-gram lookup against a brute-force search; the tokens, log-probs and finish
reasons of a mixed batch equal those of decoding without speculation, whatever the
proposals (n-gram, always right, always wrong), with prefix hits, n = 2, beams,
penalties, stop tokens and a pool tight enough to preempt; every page comes back."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from paged_cases import grid_case

import paged_jax as pj
from paged_jax import models
from paged_jax.engine.speculative import DraftRequest, SpeculativeConfig, accept, lookup


def _brute_lookup(tokens, k, min_n, max_n):
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n :]
        for e in range(L - 2, n - 2, -1):  # latest earlier end first
            if tokens[e - n + 1 : e + 1] == suffix:
                return tokens[e + 1 : e + 1 + k]
    return []


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=0, max_size=40),
    k=st.integers(0, 6),
    sizes=st.tuples(st.integers(1, 5), st.integers(1, 5)).map(sorted),
)
def test_lookup_is_the_latest_match_of_the_longest_suffix(tokens, k, sizes):
    min_n, max_n = sizes
    got = lookup(np.array(tokens, np.int32), k, min_n, max_n)
    assert got == _brute_lookup(tokens, k, min_n, max_n)


def test_lookup_examples():
    t = np.array([5, 6, 7, 8, 9, 1, 5, 6, 7], np.int32)
    assert lookup(t, 3, 2, 4) == [8, 9, 1]  # 3 tokens "5 6 7" matched
    assert lookup(t, 10, 2, 4) == [8, 9, 1, 5, 6, 7]  # up to the end
    assert lookup(np.array([1, 2, 3], np.int32), 4, 1, 3) == []
    assert accept([4, 5, 6], [4, 5, 9, 2]) == 2
    assert accept([4, 5], [4, 5, 7]) == 2 and accept([4], [3, 1]) == 0


@pytest.mark.parametrize(
    "value,exc,msg",
    [
        ({"method": "eagle"}, ValueError, "speculative.method: expected one of"),
        ({"num_speculative_tokens": 0}, ValueError, "num_speculative_tokens: expected an int"),
        ({"num_speculative_tokens": True}, ValueError, "num_speculative_tokens: expected an int"),
        (
            {"prompt_lookup_min": 3, "prompt_lookup_max": 2},
            ValueError,
            "prompt_lookup_min: expected <= prompt_lookup_max=2",
        ),
        ({"k": 3}, ValueError, r"speculative: unknown fields \['k'\]"),
        ("ngram", TypeError, "speculative: expected None, a SpeculativeConfig or a dict"),
    ],
)
def test_bad_configs_are_refused_naming_the_field(value, exc, msg):
    with pytest.raises(exc, match=msg):
        SpeculativeConfig.of(value)


def test_not_with_multi_step_decoding():
    with pytest.raises(ValueError, match="speculative: not with num_scheduler_steps=4"):
        pj.LLM(*models.load("tiny-llama"), num_pages=16, num_scheduler_steps=4, speculative={})


class _Oracle:
    """Proposes the true continuation (from a run without speculation), or, ``wrong``,
    a token that differs from it at every position."""

    def __init__(self, sequences, wrong=False):
        self.sequences = [list(s) for s in sequences]
        self.wrong = wrong
        self.asked = 0

    def propose(self, requests):
        out = []
        for r in requests:
            self.asked += 1
            t = r.tokens.tolist()
            ref = next((s for s in self.sequences if s[: len(t)] == t), None)
            nxt = [] if ref is None else ref[len(t) : len(t) + r.max_tokens]
            out.append([(x + 1) % 256 for x in nxt] if self.wrong else nxt)
        return out


def _requests():
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 256, 20).tolist()
    loop = rng.integers(0, 256, 6).tolist()
    prompts = [
        loop * 4,  # the n-gram proposes from the prompt
        rng.integers(0, 256, 30).tolist(),
        shared + [1, 2],  # prefix hits
        shared + [3],
        rng.integers(0, 256, 12).tolist(),
        loop * 2 + [7],
        rng.integers(0, 256, 17).tolist(),
        rng.integers(0, 256, 3).tolist(),
    ]
    params = [
        pj.SamplingParams(max_tokens=40, ignore_eos=True, logprobs=True),
        pj.SamplingParams(max_tokens=30, temperature=0.9, top_p=0.8, seed=4, logprobs=True),
        pj.SamplingParams(max_tokens=25, ignore_eos=True),
        pj.SamplingParams(max_tokens=20, temperature=1.0, n=2, seed=7, ignore_eos=True),
        pj.SamplingParams(max_tokens=6, beam_width=2, ignore_eos=True),
        pj.SamplingParams(
            max_tokens=10,
            repetition_penalty=1.4,
            presence_penalty=0.3,
            logit_bias={5: -100.0, 9: 2.0},
            stop_token_ids=(11,),
            min_tokens=4,
        ),  # fmt: skip
        pj.SamplingParams(max_tokens=35, stop_token_ids=(3, 17), ignore_eos=True),
        pj.SamplingParams(max_tokens=33, temperature=0.7, top_k=5, seed=1, ignore_eos=True),
    ]
    return prompts, params


def _engine(**kw):
    args = dict(num_pages=64, page_size=8, max_num_seqs=8, max_num_batched_tokens=64)
    args.update(kw)
    return pj.LLM(*models.load("tiny-llama"), deterministic=True, **args)


def _summary(outs):
    """Tokens and finish reasons (exact), log-probs rounded: a prompt whose chunks fall
    differently in a batch computes its K/V in another order, its last bits apart."""
    return [
        [
            (
                c.token_ids,
                c.finish_reason,
                None if c.logprobs is None else np.round(c.logprobs, 4).tolist(),
                round(c.cumulative_logprob, 4),
            )
            for c in o.outputs
        ]
        for o in outs
    ]


@pytest.fixture(scope="module")
def reference():
    prompts, params = _requests()
    outs = _engine().generate(prompts, params, progress=False)
    return prompts, params, outs


_SWAP_POOL = dict(num_pages=14, preemption="swap", num_host_pages=64, watermark=0.0)


# By default each proposer once, the n-gram and the wrong one on the small pool that
# preempts by swap; every proposer on both pools: -m slow.
@pytest.mark.parametrize(
    "proposer, pool",
    [
        grid_case(
            proposer, pool, id=f"{proposer}-pool{i}", by_default=(proposer == "right") == (i == 0)
        )
        for i, pool in enumerate([dict(), _SWAP_POOL])
        for proposer in ("ngram", "right", "wrong")
    ],
)
def test_speculation_changes_no_token(reference, verify_freely, proposer, pool):
    prompts, params, ref = reference
    llm = _engine(speculative={"num_speculative_tokens": 5, "prompt_lookup_min": 1}, **pool)
    if proposer != "ngram":
        full = [p + c.token_ids for p, o in zip(prompts, ref, strict=True) for c in o.outputs]
        llm.engine.speculator.proposer = _Oracle(full, wrong=proposer == "wrong")
    outs = llm.generate(prompts, params, progress=False)
    assert _summary(outs) == _summary(ref)
    m = llm.metrics
    assert m.spec_verify_rows > 0 and m.spec_draft_tokens > 0
    if proposer == "wrong":
        assert m.spec_accepted_tokens == 0
    elif proposer == "right":
        assert m.spec_acceptance_rate == 1.0  # a draft equal to the target: all accepted
        assert m.spec_mean_accepted_length > 4
    else:
        assert m.spec_accepted_tokens > 0
    if pool:
        assert m.preemptions_swap + m.preemptions_recompute > 0
    assert llm.bm.stats()["pages_used"] == 0
    llm.bm.check_invariants()


def test_right_proposals_take_fewer_steps_and_recompute_preemption_keeps_tokens(reference):
    prompts, params, ref = reference
    full = [p + c.token_ids for p, o in zip(prompts, ref, strict=True) for c in o.outputs]
    llm = _engine(
        num_pages=14, watermark=0.0, speculative={"num_speculative_tokens": 4}
    )  # recompute preemption, pages for proposals often short
    llm.engine.speculator.proposer = _Oracle(full)
    plain = _engine(num_pages=14, watermark=0.0)
    want = plain.generate(prompts, params, progress=False)
    outs = llm.generate(prompts, params, progress=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [
        [c.token_ids for c in o.outputs] for o in want
    ]
    assert llm.metrics.preemptions_recompute > 0
    assert llm.metrics.steps < plain.metrics.steps * 0.6
    assert llm.bm.stats()["pages_used"] == 0


def test_rejected_proposals_never_reach_the_prefix_cache():
    """Pages that held only rejected proposals go back to the pool, and a later prompt
    with the rejected tokens finds no cached page of them."""
    llm = _engine(speculative={"num_speculative_tokens": 8})
    prompt = list(range(10, 18)) * 2  # 16 tokens: two full pages
    truth = _engine().generate([prompt], pj.SamplingParams(max_tokens=9), progress=False)
    ids = truth[0].outputs[0].token_ids
    llm.engine.speculator.proposer = _Oracle([prompt + ids], wrong=True)
    out = llm.generate([prompt], pj.SamplingParams(max_tokens=9), progress=False)
    assert out[0].outputs[0].token_ids == ids
    wrong = [(t + 1) % 256 for t in ids[:8]]
    assert llm.bm.cached_tokens(prompt + wrong + [0]) == 16  # the prompt's pages only
    assert llm.bm.cached_tokens(prompt + ids[:8] + [0]) == 24  # the kept tokens' page
    llm.bm.check_invariants()


@pytest.mark.parametrize("overlapped", [False, True])
def test_proposer_interface_gets_each_sequence_its_tokens_and_room(overlapped):
    seen = []

    class Spy:
        def propose(self, requests):
            seen.extend(requests)
            return [[] for _ in requests]

    llm = _engine(speculative={"num_speculative_tokens": 3}, async_scheduling=overlapped)
    llm.engine.speculator.proposer = Spy()
    out = llm.generate(
        [[1, 2, 3]], pj.SamplingParams(max_tokens=5, ignore_eos=True), progress=False
    )
    toks = out[0].outputs[0].token_ids
    assert all(isinstance(r, DraftRequest) for r in seen)
    asked = [(r.tokens.tolist(), r.max_tokens) for r in seen]
    if not overlapped:
        # every decode step but the last asks, with the sequence's tokens so far
        assert asked == [([1, 2, 3] + toks[:j], 3 - j + 1) for j in range(1, 4)]
    else:
        # each step scheduled while the one before runs asks with the tokens before the
        # placeholder, for one more token (its guess of the placeholder, dropped)
        assert asked == [([1, 2, 3] + toks[: j - 1], 3 - j + 2) for j in range(1, 4)]
        assert llm.metrics.overlapped_steps > 0
    assert llm.metrics.spec_verify_rows == 0


@pytest.mark.failing_steps
def test_a_bad_proposal_fails_the_step_not_the_engine():
    class Bad:
        def propose(self, requests):
            return [[10**6] for _ in requests]

    llm = _engine(speculative={})
    llm.engine.speculator.proposer = Bad()
    llm.add_request("a", [1, 2, 3], pj.SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match=r"proposer: token ids must lie in \[0, "):
        for _ in range(3):
            llm.step()


# ---------------------------------------------------------------------- a draft model


@pytest.fixture(scope="module")
def tiny():
    return models.load("tiny-llama")


@pytest.mark.parametrize(
    "pool", [dict(), dict(num_pages=14, preemption="swap", num_host_pages=64, watermark=0.0)]
)
def test_a_draft_model_changes_no_token(reference, tiny, pool):
    prompts, params, ref = reference
    other = models.load("tiny-llama", seed=1)[0]  # other weights: it proposes badly
    for draft in (tiny[0], other):
        spec = {"method": "draft", "draft_model": draft, "num_speculative_tokens": 3}
        llm = _engine(speculative=spec, **pool)
        outs = llm.generate(prompts, params, progress=False)
        assert _summary(outs) == _summary(ref)
        assert llm.metrics.spec_draft_tokens > 0
        draft = llm.engine.speculator.proposer
        assert draft.bm.num_seqs == 0  # every sequence's draft state released
        draft.bm.check_invariants()


def test_a_draft_equal_to_the_target_has_every_greedy_proposal_accepted(tiny):
    model, tok = tiny
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in (5, 17, 30, 9)]
    p = pj.SamplingParams(max_tokens=24, ignore_eos=True)
    spec = {"method": "draft", "draft_model": model, "num_speculative_tokens": 4}
    llm = _engine(speculative=spec)
    outs = llm.generate(prompts, p, progress=False)
    plain = _engine().generate(prompts, p, progress=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    m = llm.metrics
    assert m.spec_acceptance_rate == 1.0 and m.spec_mean_accepted_length > 4
    assert m.steps <= 8  # 24 tokens: the prompt's step, then 5 a step


def test_the_draft_recomputes_what_its_pool_dropped(tiny):
    """A pool too small for two sequences drops the one asked least recently; asked
    again, it is recomputed and proposes what a fresh draft does."""
    from paged_jax.engine.speculative.draft import DraftModelProposer

    model = tiny[0]
    rng = np.random.default_rng(5)
    a, b = (rng.integers(0, 256, 14).astype(np.int32) for _ in range(2))

    def fresh(tokens):
        d = DraftModelProposer(model, vocab_size=320, page_size=4, num_pages=12)
        return d.propose([DraftRequest("x", tokens, 4)])[0]

    d = DraftModelProposer(model, vocab_size=320, page_size=4, num_pages=6)
    first = d.propose([DraftRequest("a", a, 4)])[0]
    assert first == fresh(a) and len(first) == 4
    assert d.propose([DraftRequest("b", b, 4)])[0] == fresh(b)
    assert "a" not in d.bm  # dropped for b
    grown = np.concatenate([a, np.array(first[:2], np.int32)])  # two proposals accepted
    assert d.propose([DraftRequest("a", grown, 3)])[0] == fresh(grown)[:3]
    d.bm.check_invariants()


def test_the_draft_splits_long_steps_and_proposes_what_one_step_does(tiny):
    """With ``max_step_tokens`` 8, 39 prompt tokens go through the draft in steps of at
    most 8 tokens (a prompt split across steps as chunked prefill splits it), and the
    proposals are those of the draft computing them in one step."""
    from paged_jax.engine.speculative.draft import DraftModelProposer

    model = tiny[0]
    rng = np.random.default_rng(6)
    reqs = [DraftRequest(k, rng.integers(0, 256, n).astype(np.int32), 4) for k, n in
            enumerate((14, 20, 5))]  # fmt: skip
    whole = DraftModelProposer(model, vocab_size=320, page_size=4, num_pages=64)
    want = whole.propose(reqs)
    d = DraftModelProposer(model, vocab_size=320, page_size=4, num_pages=64, max_step_tokens=8)
    sizes = []
    run = d._run
    d._run = lambda sch: (sizes.append(sum(s.stop - s.start for s in sch)), run(sch))[1]
    assert d.propose(reqs) == want
    assert sizes[:5] == [8, 8, 8, 8, 7]  # the prompts: 39 tokens
    assert sizes[5:] == []  # then the other proposals in one multi-step launch
    assert d.launches == 1
    d.bm.check_invariants()
    with pytest.raises(ValueError, match="max_step_tokens: expected an int >= 1, got 0"):
        DraftModelProposer(model, vocab_size=320, page_size=4, num_pages=8, max_step_tokens=0)


@pytest.mark.parametrize(
    "value,exc,msg",
    [
        ({"method": "draft"}, ValueError, "speculative.draft_model: expected a model with"),
        ({"method": "ngram", "draft_model": "x"}, ValueError, "speculative.draft_model"),
    ],
)
def test_draft_configs_are_checked(value, exc, msg):
    with pytest.raises(exc, match=msg):
        SpeculativeConfig.of(value)


def test_a_draft_must_be_a_model_with_the_targets_vocabulary(tiny):
    with pytest.raises(TypeError, match="speculative.draft_model: expected a paged-jax model"):
        _engine(speculative={"method": "draft", "draft_model": object()})
    llm = _engine(speculative={"method": "draft", "draft_model": "tiny-llama"})  # a name
    assert llm.engine.speculator.proposer.model.config.vocab_size == tiny[0].config.vocab_size


def test_stop_strings_and_streams_cut_where_decoding_without_it_does(tiny):
    """A verify step appends several tokens at once: a stop string completed by one of
    them ends the text there, and streamed text is the final text."""
    model, tok = tiny
    prompt = "the cat sat on the mat. the cat sat on the mat. the cat"
    free = pj.SamplingParams(max_tokens=40, ignore_eos=True)
    ref = _engine().generate([prompt], free, progress=False)[0].outputs[0].text
    stop = ref[9:12]  # three characters from inside the continuation
    p = pj.SamplingParams(max_tokens=40, ignore_eos=True, stop=(stop,))
    want = _engine().generate([prompt], p, progress=False)[0].outputs[0]
    llm = _engine(speculative={"num_speculative_tokens": 4, "prompt_lookup_min": 1})
    got = llm.generate([prompt], p, progress=False)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason) == (
        want.text,
        want.token_ids,
        want.finish_reason,
    )
    assert got.finish_reason == "stop" and stop not in got.text
    pieces = "".join(piece.text for piece in llm.stream([prompt], p))
    assert pieces == want.text
    assert llm.metrics.spec_draft_tokens > 0


def test_a_biased_row_beside_verifying_rows_keeps_its_bias():
    """A request with a logit bias (and min_tokens) in a step whose other rows verify
    proposals: the proposals' extra rows get neutral biases (they once got none, and the
    step failed on the arrays' shapes)."""
    loop = [9, 4, 7, 1, 3, 8] * 5
    params = [
        pj.SamplingParams(max_tokens=24, ignore_eos=True),
        pj.SamplingParams(
            max_tokens=12,
            logit_bias={5: -100.0, 9: 3.0},
            stop_token_ids=(7,),
            min_tokens=6,
            ignore_eos=True,
        ),  # fmt: skip
    ]
    prompts = [loop, [2, 9, 4, 7]]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    kw = dict(num_pages=64, page_size=8, max_num_seqs=8)
    plain = pj.LLM(*models.load("tiny-llama"), **kw).generate(prompts, params, progress=False)
    llm = pj.LLM(*models.load("tiny-llama"), speculative=spec, **kw)
    got = llm.generate(prompts, params, progress=False)
    # (the engine recovered from those failed steps: the tokens alone could not tell)
    assert llm.metrics.spec_draft_tokens > 0 and llm.metrics.failed_steps == 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    biased = got[1].outputs[0].token_ids
    assert 5 not in biased and 7 not in biased[:6]


def test_the_draft_s_multi_step_launch_proposes_what_one_step_a_token_does(tiny):
    """The proposals after each request's first, decoded in one jitted launch (slots
    reserved, filled after), are those of one draft step a token, for requests asking
    different numbers, after a rollback (the target rejected some), and where the pool
    cannot reserve them (the launch falls back to one step a token)."""
    from paged_jax.engine.speculative.draft import DraftModelProposer

    model = tiny[0]
    rng = np.random.default_rng(11)
    reqs = [
        DraftRequest(k, rng.integers(0, 256, n).astype(np.int32), m)
        for k, (n, m) in enumerate([(9, 4), (17, 2), (5, 1), (12, 3)])
    ]

    def proposer(loop: bool, pages: int = 64):
        d = DraftModelProposer(model, vocab_size=320, page_size=4, num_pages=pages, max_proposals=4)
        if not loop:
            d._decode_rest = lambda live, out: False
        return d

    one, many = proposer(False), proposer(True)
    want, got = one.propose(reqs), many.propose(reqs)
    assert got == want and [len(p) for p in got] == [4, 2, 1, 3]
    assert many.launches == 1 and one.launches == 0
    # the target kept two of request 0's proposals and sampled another token: a rollback
    grown = np.concatenate([reqs[0].tokens, np.array(want[0][:2] + [7], np.int32)])
    again = [DraftRequest(0, grown, 4), reqs[3]]
    assert many.propose(again) == one.propose(again)
    many.bm.check_invariants()
    # a pool with room for the prompts (13 pages of 4) but not for every proposal: one
    # step a token, as far as the pages go
    tight = proposer(True, pages=14)
    assert tight.propose(reqs) == proposer(False, pages=14).propose(reqs)
    assert tight.launches == 0
    tight.bm.check_invariants()


@pytest.mark.parametrize("proposer", ["right", "wrong", "ngram"])
def test_steps_overlap_with_speculation_and_keep_the_tokens(reference, verify_freely, proposer):
    """With overlapped steps, a step that verifies no proposals is left running while the
    next is scheduled, and that next step may verify proposals made from the tokens
    before its placeholders (the first proposal guesses the placeholder, dropped): the
    tokens are those of plain decoding, steps overlapped, and proposals verified in
    steps scheduled that way; a wrong guess costs proposals, not tokens."""
    prompts, params, ref = reference
    llm = _engine(speculative={"num_speculative_tokens": 4, "prompt_lookup_min": 1})
    assert llm.engine.launcher.async_scheduling
    sp = llm.engine.speculator
    if proposer != "ngram":
        full = [p + c.token_ids for p, o in zip(prompts, ref, strict=True) for c in o.outputs]
        oracle = _Oracle(full, wrong=proposer == "wrong")
        calls = []

        class EveryOther:  # a step without proposals, which may overlap, then one with
            def propose(self, requests):
                calls.append(1)
                return oracle.propose(requests) if len(calls) % 2 else [[] for _ in requests]

        sp.proposer = EveryOther()
    pending_drafts = []
    draft = sp.draft

    def spy(schedulers, scheds, pending=False):
        d = draft(schedulers, scheds, pending=pending)
        pending_drafts.append(bool(pending and d))
        return d

    sp.draft = spy
    outs = llm.generate(prompts, params, progress=False)
    assert _summary(outs) == _summary(ref)
    m = llm.metrics
    assert m.overlapped_steps > 0 and any(pending_drafts)
    if proposer == "right":
        assert m.spec_acceptance_rate == 1.0
    elif proposer == "wrong":
        assert m.spec_accepted_tokens == 0
    assert llm.bm.stats()["pages_used"] == 0
    llm.bm.check_invariants()


def _rationed(rates, proposals, calibration=None, frugal=True):
    """``Speculator.ration`` on decode rows of the given rates (one token each), with a
    runner whose tokens cost compute (``frugal``): how many proposals each row verifies."""
    from types import SimpleNamespace as NS

    from paged_jax.engine.speculative.verifier import Speculator

    spec = Speculator(None, None, NS(tokens_cost_compute=frugal), None)
    if calibration is not None:
        spec.foreseen, spec.kept = 100.0, 100.0 * calibration
    work = [NS(start=0, stop=1, sample=True, seq=NS(spec_rate=r)) for r in rates]
    cand = [(j, w, 4) for j, w in enumerate(work)]
    taken = spec.ration(work, cand, proposals, budget=1024)
    got = {j: len(d) for j, _, d in taken}
    return [got.get(j, 0) for j in range(len(rates))]


def test_where_tokens_cost_compute_proposals_grow_the_step_only_when_they_pay():
    # 16 decode rows fill their bucket of 16 tokens: any proposal doubles the tokens the
    # step computes (32), which on a CPU costs about a third more (free-form chat at 16
    # requests ran at 0.86-0.92x with every confident row's proposals verified)
    four = [[1, 2, 3, 4]] * 16
    rates = [0.7, 0.7] + [0.1] * 14  # two confident rows: 5.6 tokens foreseen for 16 more
    assert _rationed(rates, four) == [0] * 16
    rates = [0.95] * 16  # all confident (quoting their prompts): 60.8 foreseen, 112 more
    assert _rationed(rates, four) == [4] * 16
    # rows whose rates foresaw twice what they kept are trusted half as much
    assert _rationed(rates, four, calibration=0.5) == [0] * 16
    # 12 rows: 4 padding tokens go to the most confident rows, whatever the growth rule
    assert _rationed([0.9, 0.8] + [0.1] * 10, [[1, 2, 3, 4]] * 12) == [4] + [0] * 11
    # where tokens do not cost compute, every proposal is verified
    assert _rationed([0.1] * 16, four, frugal=False) == [4] * 16


def test_where_tokens_cost_compute_a_step_verifies_only_what_pays_for_verifying():
    # a verify step costs about 0.15 of a plain one (VERIFY_COST): 15 rows, one padding
    # token, whose row keeps half its proposals: 0.5 foreseen against 2.25 (free-form
    # chat at 16 requests verified such steps at a loss)
    one = [[1, 2, 3, 4]] + [[]] * 14
    assert _rationed([0.5] + [0.1] * 14, one) == [0] * 15
    assert _rationed([0.55] * 15, [[1, 2, 3, 4]] * 15) == [0] * 15  # 1 padding token
    # several rows' padding proposals together pay: 12 rows, 4 padding tokens at 0.6
    assert _rationed([0.59] * 12, [[1]] * 12) == [1] * 4 + [0] * 8
    # 2.36 foreseen < 1.8 of 12 rows once calibration halves it: none
    assert _rationed([0.59] * 12, [[1]] * 12, calibration=0.5) == [0] * 12
    # a sequence alone: one plain step yields one token, so 0.15 of one pays
    assert _rationed([0.2], [[1, 2, 3, 4]]) == [4]
    assert _rationed([0.03], [[1, 2, 3, 4]]) == [0]


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.floats(0.0, 1.0),  # the row's rate
            st.integers(1, 4),  # its room
            st.integers(0, 4),  # the tokens its proposal has (at most the room)
        ),
        min_size=1,
        max_size=20,
    ),
    chunk=st.integers(0, 40),  # a prefill chunk's tokens in the step (0: none)
    calibration=st.one_of(st.none(), st.floats(0.0, 1.5)),
)
def test_the_proposer_is_skipped_only_where_nothing_it_proposes_could_be_verified(
    rows, chunk, calibration
):
    from types import SimpleNamespace as NS

    from paged_jax.engine.speculative.verifier import Speculator

    spec = Speculator(None, None, NS(tokens_cost_compute=True), None)
    if calibration is not None:
        spec.foreseen, spec.kept = 100.0, 100.0 * calibration
    work = [NS(start=0, stop=1, sample=True, seq=NS(spec_rate=r)) for r, _, _ in rows]
    if chunk:
        work.append(NS(start=0, stop=chunk, sample=False, seq=NS(spec_rate=1.0)))
    cand = [(j, work[j], room) for j, (_, room, _) in enumerate(rows)]
    proposals = [list(range(1, 1 + min(n, room))) for _, room, n in rows]
    if not spec.may_pay(work, cand):
        assert spec.ration(work, cand, proposals, budget=1024) == []


def test_the_proposer_is_not_asked_for_a_full_step_no_proposal_would_grow():
    from types import SimpleNamespace as NS

    from paged_jax.engine.speculative.verifier import Speculator

    spec = Speculator(None, None, NS(tokens_cost_compute=True), None)
    work = [NS(start=0, stop=1, sample=True, seq=NS(spec_rate=1.0)) for _ in range(16)]
    cand = [(j, w, 4) for j, w in enumerate(work)]
    assert spec.may_pay(work, cand)  # 64 tokens foreseen: worth growing 16 to 32 or more
    spec.foreseen, spec.kept = 100.0, 10.0  # a tenth of what rates foresaw was kept
    assert not spec.may_pay(work, cand)  # 6.4 against half of 16
    assert spec.may_pay(work[:15], cand[:15])  # a padding token: 6 against 2.25
    spec.runner.tokens_cost_compute = False  # an accelerator verifies whatever comes
    assert spec.may_pay(work, cand)


def test_failed_proposals_are_distrusted_then_tried_again_after_steps_without_any():
    from types import SimpleNamespace as NS

    from paged_jax.engine.speculative.verifier import Speculator

    spec = Speculator(NS(num_speculative_tokens=4), None, NS(tokens_cost_compute=True), None)
    spec.foreseen, spec.kept = 40.0, 4.0  # a tenth of what rows foresaw was kept
    assert spec.calibration == pytest.approx(0.1)
    for _ in range(100):  # steps that verify nothing (no rows here)
        assert spec.draft([], []) is None
    assert spec.calibration == pytest.approx(0.1)  # the same evidence, fainter
    for _ in range(90):
        spec.draft([], [])
    assert spec.foreseen < 1.0 and spec.calibration == 1.0  # no evidence left: trusted
