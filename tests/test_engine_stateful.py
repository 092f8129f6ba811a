"""A seeded random driver of the engine's public API: valid and invalid ``add_request``,
``step`` (some with an injected fault), ``abort``, id reuse, on a pool small enough to
preempt by swap. After every call it checks what a user relies on; at the end every
accepted request has been delivered exactly once, each finished one with the tokens it
gets alone (f32: exact), and the engine holds nothing (the engine-reliability issue)."""

import numpy as np
import pytest

import paged_jax as pj
from paged_jax import models

# every test here makes engine steps fail on purpose
pytestmark = pytest.mark.failing_steps

VOCAB = 256


class Fault(Exception):
    pass


def _engine(speculative=None):
    return pj.LLM(
        *models.load("tiny-llama"),
        num_pages=14,
        page_size=8,
        max_num_seqs=6,
        max_num_batched_tokens=40,
        preemption="swap",
        num_host_pages=48,
        watermark=0.0,
        speculative=speculative,
    )


def _params(rng) -> pj.SamplingParams:
    kind = int(rng.integers(0, 7))
    common = dict(max_tokens=int(rng.integers(1, 9)), ignore_eos=True)
    seed = int(rng.integers(0, 2**31))
    banned = {int(t): -100.0 for t in rng.integers(0, VOCAB, 3)}
    return pj.SamplingParams(
        **common,
        **(
            {},  # greedy
            dict(temperature=0.9, top_p=0.9, seed=seed),
            dict(temperature=1.0, n=2, seed=seed),
            dict(temperature=0.7, top_k=20, repetition_penalty=1.3, seed=seed),
            dict(beam_width=2),
            dict(prompt_logprobs=2),  # scored prompt: rows of its own in its steps
            dict(
                temperature=0.8,
                seed=seed,
                logit_bias=banned,
                prompt_logprobs=0,
                stop_token_ids=(int(rng.integers(0, VOCAB)),),
                min_tokens=common["max_tokens"] // 2,
            ),
        )[kind],
    )


def _bad_request(rng, live_ids):
    """(request_id, prompt, params) that add_request must refuse."""
    pick = int(rng.integers(0, 5))
    if pick == 0:
        return "bad", [], pj.SamplingParams()
    if pick == 1:
        return "bad", [1, 2, 9999], pj.SamplingParams()
    if pick == 2 and live_ids:
        return sorted(live_ids)[0], [1, 2], pj.SamplingParams()  # id in use
    if pick == 3:
        return "bad", [1, 2.5], pj.SamplingParams()
    return "bad", [1, 2], pj.SamplingParams(n=7, temperature=1.0)  # wider than a step


def _alone(prompt, params, prompt_logprobs: bool = False):
    """The request's tokens alone (each sample's), or with ``prompt_logprobs`` its
    prompt's log-probs alone."""
    key = (tuple(prompt), params)
    if key not in _ALONE:
        out = _ALONE_ENGINE[0].generate([prompt], params, progress=False)[0]
        _ALONE[key] = ([o.token_ids for o in out.outputs], out.prompt_logprobs)
    return _ALONE[key][1 if prompt_logprobs else 0]


_ALONE: dict = {}


class _Guesses:
    """A proposer that knows the continuations of the requests added so far (their
    tokens alone) and proposes them, or with even odds a corrupted copy (a wrong token
    somewhere), so that steps accept all, some or none of their proposals."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.known: list[list[int]] = []

    def propose(self, requests):
        out = []
        for r in requests:
            t = r.tokens.tolist()
            ref = next((s for s in self.known if s[: len(t)] == t), None)
            d = [] if ref is None else ref[len(t) : len(t) + r.max_tokens]
            if d and self.rng.random() < 0.5:
                j = int(self.rng.integers(0, len(d)))
                d[j] = (d[j] + 1) % VOCAB
            out.append(d)
        return out


_ALONE_ENGINE = []


def drive(seed: int, num_ops: int, speculative=None):
    """``speculative``: the engine under test decodes speculatively, its proposals
    ``_Guesses`` (right, or wrong somewhere); the tokens it must give are still those of
    the engine without it."""
    if not _ALONE_ENGINE:
        _ALONE_ENGINE.append(_engine())
    rng = np.random.default_rng(seed)
    llm = _engine(speculative)
    if speculative is not None:
        llm.engine.speculator.proposer = _Guesses(seed)
    real_run = llm.runner.step_fn
    fault = {"armed": False}

    class Run:
        def __call__(self, *a, **k):
            if fault["armed"]:
                fault["armed"] = False
                raise Fault("injected")
            return real_run(*a, **k)

        def _cache_size(self):
            return real_run._cache_size()

    llm.runner.step_fn = Run()
    accepted = {}  # request id -> (prompt, params), while unfinished
    delivered = {}  # (request id, generation) -> output
    generation = {}  # request id -> times it was used
    counts = dict(add=0, refused=0, steps=0, faults=0, aborts=0)
    since_fault = 5

    def deliver(out):
        rid = out.request_id
        key = (rid, generation[rid])
        assert key not in delivered, f"{rid!r} delivered twice"
        delivered[key] = (out, accepted.pop(rid))

    for _ in range(num_ops):
        op = rng.random()
        if op < 0.3:
            rid = f"r{int(rng.integers(0, 12))}"  # a small id space: ids are reused
            if rid in accepted:
                continue
            prompt = rng.integers(0, VOCAB, int(rng.integers(2, 20))).tolist()
            params = _params(rng)
            if speculative is not None:
                llm.engine.speculator.proposer.known += [prompt + r for r in _alone(prompt, params)]
            llm.add_request(rid, prompt, params)
            generation[rid] = generation.get(rid, 0) + 1
            accepted[rid] = (prompt, params)
            counts["add"] += 1
        elif op < 0.4:
            rid, prompt, params = _bad_request(rng, set(accepted))
            before = (len(accepted), llm.bm.stats()["pages_used"])
            with pytest.raises((ValueError, TypeError)):
                llm.add_request(rid, prompt, params)
            assert (len(accepted), llm.bm.stats()["pages_used"]) == before
            counts["refused"] += 1
        elif op < 0.47 and accepted:
            rid = sorted(accepted)[int(rng.integers(0, len(accepted)))]
            out = llm.abort(rid)
            assert out is not None and out.finished
            deliver(out)
            counts["aborts"] += 1
        else:
            # One-off faults, at least 4 steps apart: two faults while one suspect is
            # isolated would (rightly) fail it (tests/test_engine_faults.py covers that).
            since_fault += 1
            fault["armed"] = since_fault > 4 and rng.random() < 0.15
            try:
                outs = llm.step()
            except Fault:
                counts["faults"] += 1
                since_fault = 0
                outs = []
            fault["armed"] = False
            counts["steps"] += 1
            for out in outs:
                deliver(out)
    # Drain.
    for _ in range(500):
        if not llm.has_unfinished():
            break
        for out in llm.step():
            deliver(out)
    assert not llm.has_unfinished() and not accepted, "an accepted request never finished"
    assert llm.metrics.failed_steps == counts["faults"]  # only the injected ones failed
    # Nothing is left behind.
    assert llm.bm.stats()["pages_used"] == 0
    assert llm.bm.num_host_free_pages == llm.bm.num_host_pages
    assert not len(llm.engine.swapper) and not len(llm.engine.requests)
    assert not llm.has_unfinished()
    # Every finished request has its tokens alone; an aborted one a prefix of them.
    mismatches = 0
    for out, (prompt, params) in delivered.values():
        assert out.error is None, out.error
        ref = _alone(prompt, params)
        got = [o.token_ids for o in out.outputs]
        reasons = {o.finish_reason for o in out.outputs}
        if "abort" in reasons:
            if not params.use_beam_search:  # beams are re-ranked: only samples are prefixes
                # (an n = 2 request aborted before its prompt sampled has one sequence)
                mismatches += sum(g != r[: len(g)] for g, r in zip(got, ref, strict=False))
        else:
            mismatches += got != ref
            if params.prompt_logprobs is not None:  # every position scored, as alone
                want = _alone(prompt, params, prompt_logprobs=True)
                assert out.prompt_logprobs[0] is None and None not in out.prompt_logprobs[1:]
                np.testing.assert_allclose(out.prompt_logprobs[1:], want[1:], atol=1e-5)
            if params.logit_bias:
                banned = {t for t, _ in params.logit_bias}
                assert not banned & {t for g in got for t in g}
    assert mismatches == 0
    if speculative is not None:
        counts["proposed"] = llm.metrics.spec_draft_tokens
        counts["accepted"] = llm.metrics.spec_accepted_tokens
    return counts, len(delivered)


@pytest.mark.parametrize(
    "seed,num_ops", [(0, 60), *(pytest.param(s, 120, marks=pytest.mark.slow) for s in (1, 2))]
)
def test_random_use_of_the_engine_keeps_every_promise(seed, num_ops):
    counts, finished = drive(seed, num_ops=num_ops)
    print(seed, counts, finished)
    assert counts["add"] >= 10 and counts["faults"] >= 1 and finished == counts["add"]


def test_random_use_of_a_speculative_engine_keeps_every_promise():
    spec = {"num_speculative_tokens": 3}
    counts, finished = drive(3, num_ops=60, speculative=spec)
    print(counts, finished)
    assert counts["add"] >= 10 and counts["faults"] >= 1 and finished == counts["add"]
    assert counts["proposed"] > 10 and 0 < counts["accepted"] < counts["proposed"]


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(10, 16))
def test_random_use_of_the_engine_long_runs(seed):
    counts, finished = drive(seed, num_ops=600)
    print(seed, counts, finished)
    assert finished == counts["add"]
