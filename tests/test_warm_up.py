"""``LLM.warm_up()``: every step shape a configuration reaches is compiled before real
work, and nothing compiles afterwards, whatever the requests (issue 51, item 1)."""

import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

import paged_jax as pj
from paged_jax import models
from paged_jax.batch import bucket
from paged_jax.engine.shapes import MIN_STEP_TOKENS, StepShape, step_shapes

GOLDEN = pathlib.Path(__file__).resolve().parent / "golden" / "hf"


def _min_seqs(cap: int):
    """The engine's rule (``Launching._min_seqs``) for a ``max_num_seqs`` of ``cap``."""
    return lambda n: max(8, min(bucket(cap, 8), bucket(n, 16) // 16))


@pytest.mark.parametrize("max_num_seqs, max_tokens", [(64, 512), (5, 40), (300, 256), (1, 8)])
def test_step_shapes_are_every_bucket_a_schedule_can_make(max_num_seqs, max_tokens):
    """Every (tokens, sequences) a scheduler may put in a step, bucketed as
    ``build_batch`` buckets them, and nothing else."""
    rule = _min_seqs(max_num_seqs)
    want = set()
    for n in range(1, max_tokens + 1):  # live tokens
        for s in range(1, min(n, max_num_seqs) + 1):  # live sequences, each a token
            T, S = bucket(n, MIN_STEP_TOKENS), bucket(s, rule(n))
            want.add(StepShape(T, S, 32, decode_only=s == n))
    got = step_shapes(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_tokens,
        pages_per_seq=32,
        min_tokens=MIN_STEP_TOKENS,
        min_seqs=rule,
    )
    assert set(got) == want
    assert got == sorted(got) and len(got) == len(want)


def test_step_shapes_for_multi_step_and_deterministic_engines():
    kw = dict(
        max_num_seqs=16,
        max_num_batched_tokens=32,
        pages_per_seq=8,
        min_tokens=8,
        min_seqs=_min_seqs(16),
    )
    plain = step_shapes(**kw)
    multi = step_shapes(**kw, num_scheduler_steps=4)
    assert set(multi) - set(plain) == {StepShape(8, 8, 8, True, 4), StepShape(16, 16, 8, True, 4)}
    det = step_shapes(**kw, deterministic=True)
    assert not any(s.decode_only for s in det)
    assert {(s.tokens, s.seqs) for s in det} == {(s.tokens, s.seqs) for s in plain}


def _engine(model, **kw):
    base = dict(
        num_pages=48,
        page_size=8,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        max_model_len=160,
        compilation_cache=False,
    )
    return pj.LLM(model, **{**base, **kw})


def _requests(rng, n, vocab):
    """Prompts of 1..70 tokens (a few sharing a prefix) and mixed sampling params."""
    shared = rng.integers(1, vocab, 24).tolist()
    prompts, params = [], []
    for k in range(n):
        p = rng.integers(1, vocab, int(rng.integers(1, 70))).tolist()
        prompts.append(shared + p[:20] if k % 3 == 0 else p)
        sampled = k % 2 == 1
        params.append(
            pj.SamplingParams(
                max_tokens=int(rng.integers(1, 40)),
                temperature=0.8 if sampled else 0.0,
                top_p=0.9 if k % 4 == 1 else 1.0,
                top_k=5 if k % 4 == 3 else 0,
                min_p=0.05 if k % 5 == 1 else 0.0,
                seed=k,
                ignore_eos=True,
                logprobs=k % 6 == 0,
            )
        )
    return prompts, params


@pytest.fixture(scope="module")
def tiny():
    model, _ = models.load("tiny-llama")
    return model


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_nothing_compiles_after_warm_up(tiny, async_scheduling, capsys):
    """Random traffic after ``warm_up()``: requests arriving between steps, prefix hits,
    preemption (a small pool), aborts, greedy and sampled rows; no step compiles, and the
    tokens are those of an engine that compiled its buckets as they came."""
    llm = _engine(tiny, async_scheduling=async_scheduling)
    shapes = llm.step_shapes()
    assert all(s.pages_per_seq == bucket(160 // 8) for s in shapes)
    buckets = llm.warm_up()
    assert "warm-up: every step shape ready" in capsys.readouterr().err
    # (engines of one model share compiled steps: a second one compiles none; the extras
    # sampler: one a row count; the widest shape, its prompt-scoring program too)
    assert len(buckets) == len(llm.compiled_buckets) <= len(shapes) + 2
    assert llm.metrics.steps == 0
    ref = _engine(tiny, async_scheduling=async_scheduling, num_pages=200)
    rng = np.random.default_rng(0)
    prompts, params = _requests(rng, 24, tiny.config.vocab_size)
    want = ref.generate(prompts, params, progress=False)
    # the same requests, a few at a time between steps, with aborted ones among them
    got, k, step = {}, 0, 0
    while k < len(prompts) or llm.has_unfinished():
        for _ in range(int(rng.integers(0, 4))):
            if k < len(prompts):
                llm.add_request(k, prompts[k], params[k])
                if k % 7 == 5:
                    llm.add_request(f"abort-{k}", prompts[k], params[k])
                k += 1
        step += 1
        if step % 3 == 0:
            for rid in [f"abort-{j}" for j in range(k)]:
                llm.abort(rid)
        for o in llm.step():
            if o.finished and not str(o.request_id).startswith("abort"):
                got[o.request_id] = o
    assert llm.metrics.preemptions_recompute > 0, "the pool was meant to run short"
    assert len(llm.compiled_buckets) == len(buckets), llm.compiled_buckets[len(buckets) :]
    assert llm.metrics.compilations == 0
    for i, w in enumerate(want):
        assert got[i].outputs[0].token_ids == w.outputs[0].token_ids, i


def test_nothing_compiles_after_warm_up_with_multi_step_launches(tiny):
    llm = _engine(tiny, num_scheduler_steps=4)
    assert any(s.steps == 4 for s in llm.step_shapes())
    n = len(llm.warm_up(progress=False))
    prompts, params = _requests(np.random.default_rng(1), 12, tiny.config.vocab_size)
    llm.generate(prompts, params, progress=False)
    llm.generate(prompts[:1], params[0], progress=False)  # one sequence alone
    assert llm.metrics.multi_step_launches > 0
    assert len(llm.compiled_buckets) == n, llm.compiled_buckets[n:]


def test_nothing_compiles_after_warm_up_with_speculative_decoding(tiny):
    """Verify steps (proposals as extra sampling rows) have one shape per step shape once
    warmed up, and warm-up compiles them: mixed traffic with proposals of every size
    compiles nothing afterwards and keeps the tokens of plain decoding."""
    spec = {"num_speculative_tokens": 2, "prompt_lookup_min": 1}
    llm = _engine(tiny, speculative=spec, num_pages=200)
    n = len(llm.warm_up(progress=False))
    rng = np.random.default_rng(3)
    prompts, params = _requests(rng, 12, tiny.config.vocab_size)
    prompts = [(p * 3)[:60] for p in prompts]  # repeated: the n-gram proposes
    want = _engine(tiny, num_pages=200).generate(prompts, params, progress=False)
    spec_of = llm.engine.speculator
    verify_rows, seen = spec_of.verify_rows, []

    def recorded(placed, drafts, inputs):  # (T_b, S_b, sampling rows) of each verify step
        out = verify_rows(placed, drafts, inputs)
        b = inputs.batch
        seen.append((b.token_ids.shape[0], b.kv_lens.shape[0], b.logits_indices.shape[0]))
        return out

    spec_of.verify_rows = recorded
    got = llm.generate(prompts, params, progress=False)
    assert llm.metrics.spec_verify_rows > 0
    assert len(llm.compiled_buckets) == n, llm.compiled_buckets[n:]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    # a verify step samples at most k (2) rows more a sequence, not a row per token of a
    # step mixing prompts in (each such row is a row of the LM head)
    assert seen and all(rows == s + min(t, 2 * s) for t, s, rows in seen), seen
    assert any(t > 2 * s for t, s, _ in seen), sorted(set(seen))


def test_nothing_compiles_after_warm_up_with_a_draft_model(tiny):
    """A draft model's own steps (speculative decoding) are compiled by warm-up too, at
    the width of ``max_model_len``'s tables: traffic afterwards compiles neither the
    target's steps nor the draft's, and the tokens are those of plain decoding."""
    draft, _ = models.load("tiny-llama", seed=1)  # other weights: proposals get rejected
    spec = {"method": "draft", "draft_model": draft, "num_speculative_tokens": 3}
    llm = _engine(tiny, speculative=spec, num_pages=200)
    buckets = llm.warm_up(progress=False)
    drafts = [b for b in buckets if b.get("draft")]
    draft = llm.engine.speculator.proposer
    # T 8/16/32 x S 8, a decode, and the decode's multi-step launch of the proposals
    assert len(drafts) <= len(draft.step_shapes()) + 1 == 5
    assert any(b.get("steps") == 2 for b in drafts) or len(drafts) < 5
    assert all(b["pages_per_seq"] == llm.runner.table_width for b in drafts)
    rng = np.random.default_rng(4)
    prompts, params = _requests(rng, 12, tiny.config.vocab_size)
    want = _engine(tiny, num_pages=200).generate(prompts, params, progress=False)
    got = llm.generate(prompts, params, progress=False)
    assert llm.metrics.spec_draft_tokens > 0 and llm.engine.speculator.proposer.steps > 0
    assert len(llm.compiled_buckets) == len(buckets), llm.compiled_buckets[len(buckets) :]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_nothing_compiles_after_warm_up_on_a_hybrid_pool():
    model, _ = models.load_hf(GOLDEN / "gemma3", dtype=jnp.float32)
    llm = _engine(model, max_model_len=96, num_pages=200)
    assert llm.hybrid_kv_cache
    n = len(llm.warm_up(progress=False))
    prompts, params = _requests(np.random.default_rng(2), 10, model.config.vocab_size)
    llm.generate(prompts, params, progress=False)
    assert len(llm.compiled_buckets) == n, llm.compiled_buckets[n:]


def test_warm_up_is_refused_while_requests_run_and_names_bad_arguments(tiny):
    llm = _engine(tiny)
    with pytest.raises(ValueError, match="sampling_params: only for a workload"):
        llm.warm_up(sampling_params=pj.SamplingParams())
    with pytest.raises(ValueError, match="prompt_len: expected an int >= 1 .or no workload"):
        llm.warm_up(num_seqs=2, max_tokens=3)
    llm.add_request("r", [1, 2, 3], pj.SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="expected an idle engine"):
        llm.warm_up()
    assert not llm.runner.static_shapes  # refused before anything changed


def test_max_model_len_bounds_sequences_and_tables(tiny):
    with pytest.raises(ValueError, match=r"max_model_len: expected 2 <= max_model_len <= 4096"):
        _engine(tiny, max_model_len=4097)
    with pytest.raises(TypeError, match="max_model_len: expected an int or None, got 1.5"):
        _engine(tiny, max_model_len=1.5)
    llm = _engine(tiny, max_model_len=40)
    assert llm.max_model_len == 40 and llm.step_shapes()[0].pages_per_seq == 8  # 5 -> 8
    with pytest.raises(ValueError, match="40"):
        llm.add_request("long", list(range(1, 41)), pj.SamplingParams(max_tokens=2))
    (out,) = llm.generate([list(range(1, 31))], pj.SamplingParams(max_tokens=50), progress=False)
    assert len(out.outputs[0].token_ids) == 10  # capped at the context


def test_warm_up_counts_each_variant_of_a_shape_as_a_program(tiny, capsys):
    """With adapter slots each step shape compiles twice (with and without adapter rows):
    the summary counts programs, not shapes (it once said "-5 already compiled"), and each
    bucket's line says which variant it is."""
    llm = _engine(tiny, max_num_batched_tokens=16, max_loras=2, max_lora_rank=4)
    shapes = llm.step_shapes()
    # (the extras samplers are cached per process: an earlier test may have compiled them)
    buckets = [b for b in llm.warm_up() if b["tokens"]]
    err = capsys.readouterr().err
    n = len(shapes)  # (and the widest shape's prompt scoring, with adapter rows and not)
    assert f"every step shape ready: {2 * n + 2} programs for {n} shapes" in err
    assert f"({len(buckets)} new to this process)" in err
    scoring = [b for b in buckets if "prompt log-probs" in b["variant"]]
    with_rows = [b for b in buckets if "adapter rows" in b["variant"] and b not in scoring]
    assert len(with_rows) == len(buckets) - len(with_rows) - len(scoring) == n
    assert len(scoring) == 2 and err.count(", adapter rows\n") == n


def test_each_warm_up_line_says_what_sets_its_program_apart(capsys):
    # Issue 87, item 5: "compiled a step bucket ... 8 tokens, 8 sequences, 512 pages per
    # sequence, 8 page copies" printed twice (a decode-only step and a mixed one), next to
    # "23 shapes"; with speculation or adapters each shape has more programs still.
    llm = pj.LLM(
        *models.load("tiny-llama"),
        num_pages=59,  # a pool no other test's engine has: its steps compile here
        max_num_seqs=8,
        max_num_batched_tokens=32,
        compilation_cache=False,
        speculative={"method": "ngram"},
    )
    llm.warm_up()
    lines = [
        line.split(": ", 1)[1]
        for line in capsys.readouterr().err.splitlines()
        if line.startswith("warm-up: compiled a step bucket")
    ]
    shown = [line.split(" s: ", 1)[1] for line in lines]  # (the seconds differ anyway)
    steps = [b for b in llm.compiled_buckets if b.get("variant", ("",))[0] != "the extras sampler"]
    assert len(shown) == len(steps) and len(set(shown)) == len(shown), shown
    assert any("decode rows only" in s for s in shown)
    assert any("speculative verify" in s for s in shown)


def _every_kind(rng, n, vocab):
    """Requests of every kind the server takes beside plain ones, mixed: penalties,
    logit biases, min_tokens, allowed_token_ids, top log-probs, beam search, n > 1
    samples, prompt log-probs (with penalties too), and plain greedy and sampled rows
    among them."""
    kinds = [
        dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2),
        dict(logit_bias={3: 5.0, 7: -100.0}),
        dict(min_tokens=6),
        dict(allowed_token_ids=list(range(10, 60))),
        dict(top_logprobs=3, logprobs=True),
        dict(top_logprobs=20, logprobs=True, temperature=0.7),
        dict(beam_width=2, n=2),
        dict(beam_width=4, n=1),
        dict(n=3, temperature=0.8, top_p=0.9),
        dict(n=2, temperature=0.0, presence_penalty=0.4),
        dict(),
        dict(temperature=0.9, top_p=0.8),
        dict(prompt_logprobs=3),
        dict(prompt_logprobs=0, presence_penalty=0.3, temperature=0.6),
    ]
    prompts, params = [], []
    for k in range(n):
        kw = dict(kinds[k % len(kinds)])
        beam = "beam_width" in kw
        kw.setdefault("temperature", 0.0)
        kw.setdefault("seed", k)
        prompts.append(rng.integers(1, vocab, int(rng.integers(2, 40))).tolist())
        params.append(
            pj.SamplingParams(max_tokens=int(rng.integers(8, 24)), ignore_eos=not beam, **kw)
        )
    return prompts, params


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_requests_of_every_kind_compile_nothing_after_warm_up(tiny, async_scheduling):
    """Penalties, biases, min_tokens, allowed tokens, top log-probs, beams and n > 1,
    mixed with plain rows and arriving between steps: after warm-up their rows sample in the extras
    sampler warm-up compiled, nothing compiles, and every output is the one an engine
    that compiles each variant as it comes gives (tokens, log-probs, top log-probs)."""
    llm = _engine(tiny, async_scheduling=async_scheduling, num_pages=200)
    buckets = llm.warm_up(progress=False)
    sampled = []
    real = llm.runner.extras.sample
    llm.runner.extras.sample = lambda *a: sampled.append(1) or real(*a)
    ref = _engine(tiny, async_scheduling=async_scheduling, num_pages=200)
    rng = np.random.default_rng(5)
    prompts, params = _every_kind(rng, 30, tiny.config.vocab_size)
    ref_sampled = []
    ref_real = ref.runner.extras.sample
    ref.runner.extras.sample = lambda *a: ref_sampled.append(1) or ref_real(*a)
    want = ref.generate(prompts, params, progress=False)
    # the reference (dynamic shapes) samples in its steps' own variants, never apart
    assert not ref.runner.static_shapes and not ref_sampled
    got, k = {}, 0
    while k < len(prompts) or llm.has_unfinished():
        for _ in range(int(rng.integers(0, 4))):
            if k < len(prompts):
                llm.add_request(k, prompts[k], params[k])
                k += 1
        for o in llm.step():
            if o.finished:
                got[o.request_id] = o
    assert len(llm.compiled_buckets) == len(buckets), llm.compiled_buckets[len(buckets) :]
    assert llm.metrics.compilations == 0 and sampled
    for i, w in enumerate(want):
        ours, theirs = got[i].outputs, w.outputs
        assert [c.token_ids for c in ours] == [c.token_ids for c in theirs], (i, params[i])
        for a, b in zip(ours, theirs, strict=True):
            np.testing.assert_allclose(a.cumulative_logprob, b.cumulative_logprob, rtol=1e-5)
            if a.logprobs is not None:
                np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-6)
            if params[i].prompt_logprobs is not None:  # the prompt's scores too
                assert got[i].prompt_logprobs is not None
                np.testing.assert_allclose(
                    [x for x in got[i].prompt_logprobs[1:]],
                    [x for x in w.prompt_logprobs[1:]],
                    rtol=1e-5, atol=1e-6,
                )  # fmt: skip
                assert got[i].prompt_logprobs[0] is None
                if params[i].prompt_logprobs:
                    ids = [[t for t, _ in s] for s in got[i].prompt_top_logprobs]
                    assert ids == [[t for t, _ in s] for s in w.prompt_top_logprobs], i
            if params[i].top_logprobs:
                assert a.top_logprobs and len(a.top_logprobs) == len(a.token_ids)
                ids = [[t for t, _ in step] for step in a.top_logprobs]
                assert ids == [[t for t, _ in step] for step in b.top_logprobs], i
                np.testing.assert_allclose(
                    [v for step in a.top_logprobs for _, v in step],
                    [v for step in b.top_logprobs for _, v in step],
                    rtol=1e-5, atol=1e-6,
                )  # fmt: skip


def test_n_and_beams_over_16_compile_nothing_after_warm_up(tiny):
    """An engine taking 32 sequences a request warms up a second extras sampler a row
    count, of 32 samples and 64 candidates: n = 20 samples and 20 beams then compile
    nothing, and give what an engine compiling their own variants gives."""
    kw = dict(max_num_seqs=32, max_num_batched_tokens=64, max_model_len=64, num_pages=200)
    llm = _engine(tiny, **kw)
    extras = llm.runner.extras
    assert extras.widths == [(16, 32), (32, 64)]
    # The samplers are cached per process: whether warm-up compiles one depends on the
    # tests before it in the worker, so count what it warms (each row count, every width)
    warmed, warm = [], extras.warm
    extras.warm = lambda rows: warmed.append(rows) or warm(rows)
    buckets = llm.warm_up(progress=False)
    assert warmed and sorted(set(warmed)) == sorted(warmed)
    ref = _engine(tiny, **kw)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(1, tiny.config.vocab_size, 9).tolist() for _ in range(3)]
    params = [
        pj.SamplingParams(n=20, temperature=0.8, seed=3, max_tokens=6, ignore_eos=True),
        pj.SamplingParams(beam_width=20, n=2, max_tokens=6),
        pj.SamplingParams(n=17, temperature=0.0, logprobs=True, top_logprobs=5, max_tokens=5,
                          ignore_eos=True),
    ]  # fmt: skip
    want = ref.generate(prompts, params, progress=False)
    got = llm.generate(prompts, params, progress=False)
    assert len(llm.compiled_buckets) == len(buckets), llm.compiled_buckets[len(buckets) :]
    for g, w in zip(got, want, strict=True):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
        np.testing.assert_allclose(
            [c.cumulative_logprob for c in g.outputs],
            [c.cumulative_logprob for c in w.outputs],
            rtol=1e-5,
        )


@pytest.mark.parametrize("seqs, tokens", [(4, 32), (8, 32), (32, 64), (64, 16)])
def test_the_prompt_scoring_shape_is_a_step_shape_warm_up_compiles(tiny, seqs, tokens):
    # a step scoring prompt positions takes the widest shape that prefills; warm-up
    # compiles its scoring program only if that shape is among the step shapes
    llm = _engine(tiny, max_num_seqs=seqs, max_num_batched_tokens=tokens, max_model_len=64)
    T, S = llm.engine.launcher.widest_shape()
    prefill = [(s.tokens, s.seqs) for s in llm.step_shapes() if not s.decode_only]
    assert (T, S) == max(prefill)
