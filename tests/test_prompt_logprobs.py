"""Prompt log-probs (``SamplingParams.prompt_logprobs``): each prompt token's log-prob
under the model given the tokens before it, against the model's own logits computed with
no cache at all (``model_helpers.dense_logits``), through chunked prefill, the prefix
cache, preemption, forks and overlapped steps."""

import jax
import numpy as np
import pytest
from model_helpers import dense_logits

import paged_jax as pj
from paged_jax import models

PAGE = 8
# C kernels against XLA's f32 on CPU; a GPU's f32 dots take TF32 (benchmarks/gpu_session.sh
# runs this file in its models stage)
TOL = 2e-4 if jax.default_backend() == "cpu" else 2e-3


@pytest.fixture(scope="module")
def reference():
    """prompt (a tuple) -> log-softmax of every position's logits, f64 ``[T, V]``."""
    model, _ = models.load("tiny-llama")
    memo = {}

    def logp(prompt):
        key = tuple(prompt)
        if key not in memo:
            x = dense_logits(model, list(prompt)).astype(np.float64)
            memo[key] = np.asarray(jax.nn.log_softmax(x, axis=-1))
        return memo[key]

    return logp


def _check(out, reference, k):
    """``out``'s prompt log-probs and top ``k`` equal the reference's."""
    ids = out.prompt_token_ids
    logp = reference(ids)
    lps = out.prompt_logprobs
    assert len(lps) == len(ids) and lps[0] is None
    want = [logp[t - 1, ids[t]] for t in range(1, len(ids))]
    np.testing.assert_allclose(lps[1:], want, atol=TOL)
    if not k:
        assert out.prompt_top_logprobs is None
        return
    tops = out.prompt_top_logprobs
    assert len(tops) == len(ids) and tops[0] == []
    for t in range(1, len(ids)):
        row = logp[t - 1]
        got_ids = [a for a, _ in tops[t]]
        assert len(got_ids) == k
        np.testing.assert_allclose([b for _, b in tops[t]], row[got_ids], atol=TOL)
        # the k most likely, in order (ties within the tolerance may swap)
        np.testing.assert_allclose(sorted(row, reverse=True)[:k], row[got_ids], atol=TOL)
        # a token among its position's top k has the same log-prob bit for bit
        for a, b in tops[t]:
            if a == ids[t]:
                assert b == lps[t]


_ENGINES = []


@pytest.fixture(autouse=True)
def no_failed_steps():
    """``generate`` recovers from a failed step (undone, its requests run again), so
    right outputs alone could hide one: every engine of a test must have had none."""
    _ENGINES.clear()
    yield
    assert [llm.metrics.failed_steps for llm in _ENGINES] == [0] * len(_ENGINES)


def _llm(**kw):
    args = dict(num_pages=256, page_size=PAGE, max_num_seqs=8, max_num_batched_tokens=32)
    llm = pj.LLM(*models.load("tiny-llama"), **(args | kw))
    _ENGINES.append(llm)
    return llm


def test_prompt_logprobs_equal_the_models_own_through_chunked_prefill(reference):
    rng = np.random.default_rng(0)
    prompts = [[5], [3, 9], rng.integers(0, 256, 20).tolist(), rng.integers(0, 256, 75).tolist()]
    llm = _llm()  # 32-token steps: the 75-token prompt takes three, beside the others
    params = [
        pj.SamplingParams(max_tokens=3, prompt_logprobs=k, ignore_eos=True) for k in (0, 5, 1, 3)
    ]
    outs = llm.generate(prompts, params, progress=False)
    for out, p in zip(outs, params, strict=True):
        _check(out, reference, p.prompt_logprobs)
        assert len(out.outputs[0].token_ids) == 3
    plain = llm.generate(prompts[2:], pj.SamplingParams(max_tokens=3), progress=False)
    assert plain[0].prompt_logprobs is None and plain[0].prompt_top_logprobs is None
    # the tokens are those of requests that did not ask
    assert [o.outputs[0].token_ids for o in outs[2:3]] == [plain[0].outputs[0].token_ids]


def test_a_cached_prefix_is_computed_again_for_its_log_probs(reference):
    llm = _llm()
    prompt = list(range(30, 70))  # 5 full pages
    first = llm.generate([prompt], pj.SamplingParams(max_tokens=2), progress=False)[0]
    assert first.prompt_logprobs is None
    again = llm.generate([prompt], pj.SamplingParams(max_tokens=2), progress=False)[0]
    assert again.metrics.num_cached_tokens > 0  # the prefix cache is on, and hit
    scored = llm.generate(
        [prompt], pj.SamplingParams(max_tokens=2, prompt_logprobs=2), progress=False
    )[0]
    assert scored.metrics.num_cached_tokens == 0
    _check(scored, reference, 2)
    assert scored.outputs[0].token_ids == first.outputs[0].token_ids


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preempted_requests_keep_every_prompt_log_prob(reference, preemption):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, int(rng.integers(20, 60))).tolist() for _ in range(12)]
    params = pj.SamplingParams(max_tokens=24, prompt_logprobs=1, ignore_eos=True)
    llm = _llm(num_pages=40, preemption=preemption, max_num_seqs=12)
    outs = llm.generate(prompts, params, progress=False)
    m = llm.metrics
    assert (m.preemptions_recompute if preemption == "recompute" else m.preemptions_swap) > 0
    for out in outs:
        _check(out, reference, 1)
    llm.bm.check_invariants()


@pytest.mark.parametrize(
    "params",
    [
        pj.SamplingParams(max_tokens=4, n=3, temperature=1.0, seed=3, prompt_logprobs=2),
        pj.SamplingParams(max_tokens=4, beam_width=2, prompt_logprobs=2),
    ],
    ids=["n3", "beams"],
)
def test_forks_share_one_set_of_prompt_log_probs(reference, params):
    out = _llm().generate([list(range(100, 137))], params, progress=False)[0]
    _check(out, reference, 2)
    assert len(out.outputs) == (params.n if params.beam_width == 1 else 1)


def test_overlapped_deterministic_and_speculative_engines_give_the_same_log_probs(reference):
    prompts = [list(range(1, 50)), [7, 7, 7, 7, 7, 7, 7, 7, 9, 7, 7, 7]]
    params = pj.SamplingParams(max_tokens=6, prompt_logprobs=2, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    runs = {
        "overlapped": _llm(),
        "one at a time": _llm(async_scheduling=False),
        "deterministic": _llm(deterministic=True),
        "speculative": _llm(speculative=spec),
    }
    base = None
    for name, llm in runs.items():
        outs = llm.generate(prompts, params, progress=False)
        for out in outs:
            _check(out, reference, 2)
        tokens = [o.outputs[0].token_ids for o in outs]
        base = base or tokens
        assert tokens == base, name


def test_stream_carries_the_prompt_log_probs_on_the_first_piece(reference):
    llm = _llm()
    params = pj.SamplingParams(max_tokens=5, prompt_logprobs=0, ignore_eos=True)
    pieces = list(llm.stream(["the prompt's text"], params))
    with_scores = [p for p in pieces if p.prompt_logprobs is not None]
    assert len(with_scores) == 1 and with_scores[0] is pieces[0]
    final = pieces[-1].output
    assert with_scores[0].prompt_logprobs == final.prompt_logprobs
    _check(final, reference, 0)


@pytest.mark.parametrize("value", [-1, 21, True, 2.0, "3"])
def test_prompt_logprobs_is_checked(value):
    with pytest.raises(ValueError, match=r"prompt_logprobs: expected None or an int in \[0, 20\]"):
        pj.SamplingParams(prompt_logprobs=value)


@pytest.mark.parametrize("n", [2, 3, 17, 40])
@pytest.mark.parametrize("context,stride", [(2, 1), (4, 4), (8, 3), (16, 8), (16, 16), (64, 5)])
def test_windows_score_every_token_but_the_first_once(n, context, stride):
    from paged_jax.engine.scoring import windows

    plan = windows(n, context, stride)
    scored = [t for _, e, first in plan for t in range(first, e)]
    assert all(e - b <= context and b < first for b, e, first in plan)
    if stride < context:  # every token after the first, given some token before it
        assert scored == list(range(1, n))
    else:  # disjoint windows: each one's first token has nothing before it
        assert scored == [t for t in range(1, n) if t % context]
    assert [b for b, _, _ in plan] == [k * stride for k in range(len(plan))]


def test_perplexity_sums_each_windows_log_probs_by_the_definition(reference):
    from paged_jax.engine.scoring import perplexity

    rng = np.random.default_rng(2)
    ids = rng.integers(0, 256, 70).tolist()
    llm = _llm()
    got = perplexity(llm, ids, context=24, stride=10, progress=False)
    nll = 0.0
    from paged_jax.engine.scoring import windows

    for b, e, first in windows(len(ids), 24, 10):
        logp = reference(ids[b:e])
        nll -= sum(logp[t - b - 1, ids[t]] for t in range(first, e))
    assert got.tokens == 69 and got.windows == 6
    assert got.nll == pytest.approx(nll, abs=69 * TOL)
    assert got.perplexity == pytest.approx(np.exp(nll / 69), rel=1e-3)
    for kw, message in (
        (dict(context=1), r"context: expected an int in \[2, "),
        (dict(context=24, stride=25), r"stride: expected an int in \[1, context=24\]"),
        (dict(context=10**6), r"\(max_model_len - 1\)"),
    ):
        with pytest.raises(ValueError, match=message):
            perplexity(llm, ids, progress=False, **kw)


def test_perplexity_command_prints_what_the_library_computes(tmp_path):
    import json
    import subprocess
    import sys

    from paged_jax.engine.scoring import perplexity

    text = "Paged attention keeps the KV cache in pages. " * 6
    f = tmp_path / "t.txt"
    f.write_text(text)
    cli = [sys.executable, "-m", "paged_jax.cli", "perplexity", "--model", "tiny-llama"]
    args = ["--file", str(f), "--context", "48", "--stride", "48", "--page-size", "8"]
    proc = subprocess.run([*cli, *args, "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    llm = _llm(max_model_len=49)
    want = perplexity(llm, llm.encode(text), context=48, stride=48, progress=False)
    assert got["tokens"] == want.tokens and got["windows"] == want.windows == 6
    assert got["perplexity"] == pytest.approx(want.perplexity, rel=1e-4)
    bad = subprocess.run([*cli, *args[:4], "--stride", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--stride: expected an int in [1, --context=48]" in bad.stderr
    long = subprocess.run([*cli, *args[:2], "--context", "5000"], capture_output=True, text=True)
    assert long.returncode == 2 and "--context: expected at most 4095" in long.stderr
    gone = subprocess.run([*cli, "--file", str(tmp_path / "none")], capture_output=True, text=True)
    assert gone.returncode == 2 and "--file:" in gone.stderr and "does not exist" in gone.stderr
