"""Overlapped steps (``LLM(async_scheduling=True)``, the default): the next step is
scheduled and dispatched while the device runs the current one, its decode tokens read
on the device from the running step's samples. Checked here: the same tokens, log-probs
and finish reasons as steps run one at a time, for every kind of request; no placeholder
ever reaches a user; aborts, stop tokens and a tight pool while a step is in flight."""

import numpy as np
import pytest

import paged_jax as pj
from paged_jax import models


def _engine(overlapped: bool, **kw):
    args = dict(num_pages=64, page_size=8, max_num_seqs=8, max_num_batched_tokens=64)
    args.update(kw)
    return pj.LLM(
        *models.load("tiny-llama"), deterministic=True, async_scheduling=overlapped, **args
    )


def _requests(stop_token: int):
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 256, 20).tolist()
    prompts = [
        rng.integers(0, 256, 5).tolist(),
        rng.integers(0, 256, 30).tolist(),
        shared + [1, 2],
        shared + [3],
        rng.integers(0, 256, 12).tolist(),
        rng.integers(0, 256, 9).tolist(),
        rng.integers(0, 256, 17).tolist(),
        rng.integers(0, 256, 3).tolist(),
    ]
    params = [
        pj.SamplingParams(max_tokens=12, ignore_eos=True),
        pj.SamplingParams(max_tokens=9, temperature=0.9, top_p=0.8, seed=4, logprobs=True),
        pj.SamplingParams(max_tokens=7, ignore_eos=True),
        pj.SamplingParams(max_tokens=11, temperature=1.0, n=2, seed=7, ignore_eos=True),
        pj.SamplingParams(max_tokens=6, beam_width=2, ignore_eos=True),
        pj.SamplingParams(max_tokens=10, repetition_penalty=1.4, presence_penalty=0.3),
        pj.SamplingParams(max_tokens=14, stop_token_ids=(stop_token,), ignore_eos=True),
        pj.SamplingParams(max_tokens=13, temperature=0.7, top_k=5, seed=1, ignore_eos=True),
    ]
    return prompts, params


def _summary(outs):
    return [
        [(c.token_ids, c.finish_reason, c.logprobs, c.cumulative_logprob) for c in o.outputs]
        for o in outs
    ]


@pytest.fixture(scope="module")
def stop_token():
    """A token the stop-token request's greedy continuation reaches after a few tokens."""
    prompts, _ = _requests(0)
    out = _engine(False).generate(
        [prompts[6]], pj.SamplingParams(max_tokens=14, ignore_eos=True), progress=False
    )[0]
    ids = out.outputs[0].token_ids
    return next(t for t in ids[4:] if t not in ids[:4])


@pytest.mark.parametrize(
    "pool", [dict(), dict(num_pages=14, preemption="swap", num_host_pages=64, watermark=0.0)]
)
def test_overlapped_steps_change_no_token(stop_token, pool):
    prompts, params = _requests(stop_token)
    plain = _engine(False, **pool)
    ref = plain.generate(prompts, params, progress=False)
    llm = _engine(True, **pool)
    outs = llm.generate(prompts, params, progress=False)
    assert _summary(outs) == _summary(ref)
    stopped = outs[6].outputs[0]
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) < 14
    assert plain.metrics.overlapped_steps == 0 and llm.metrics.overlapped_steps > 0
    assert llm.metrics.tokens_generated == plain.metrics.tokens_generated
    for e in (plain, llm):
        assert e.bm.stats()["pages_used"] == 0
        e.bm.check_invariants()


def test_an_abort_while_a_step_runs_keeps_only_real_tokens():
    p = pj.SamplingParams(max_tokens=20, ignore_eos=True)
    ref = _engine(False).generate([[5, 6, 7], [8, 9]], p, progress=False)
    llm = _engine(True)
    llm.add_request("a", [5, 6, 7], p)
    llm.add_request("b", [8, 9], p)
    for _ in range(4):
        assert llm.step() == []
        assert llm.engine.in_flight is not None  # (a step is left running)
        # between calls every token a user can see is a sampled one
        assert llm.num_generated("a") == llm.num_generated("b")
    out = llm.abort("a")
    got = out.outputs[0].token_ids
    assert out.outputs[0].finish_reason == "abort" and 1 <= len(got) < 20
    assert got == ref[0].outputs[0].token_ids[: len(got)]
    done = []
    while llm.has_unfinished():
        done += llm.step()
    assert [o.request_id for o in done] == ["b"]
    assert done[0].outputs[0].token_ids == ref[1].outputs[0].token_ids
    assert llm.bm.stats()["pages_used"] == 0
    llm.bm.check_invariants()


def test_streamed_text_never_shows_a_placeholder():
    llm = _engine(True)
    p = pj.SamplingParams(max_tokens=16, ignore_eos=True)
    pieces = {}
    for piece in llm.stream(["Hello", "Paged attention"], p):
        pieces[piece.index] = pieces.get(piece.index, "") + piece.text
    whole = _engine(False).generate(["Hello", "Paged attention"], p, progress=False)
    assert [pieces[k] for k in range(2)] == [o.outputs[0].text for o in whole]
    assert llm.metrics.overlapped_steps > 0


def test_async_scheduling_must_be_a_bool():
    with pytest.raises(TypeError, match="async_scheduling: expected a bool"):
        _engine(1)
