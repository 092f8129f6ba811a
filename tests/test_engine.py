"""The engine: overload without lost requests, preemption that changes no output, n-way
sampling and beam search on shared pages, prefix caching, tenants, sampling, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_helpers import dense_logits

import paged_jax as pj
from paged_jax import models
from paged_jax.engine.sampling import sample_rows

PAGE = 8


@pytest.fixture(scope="module")
def workload():
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, rng.integers(4, 48)).tolist() for _ in range(200)]
    params = [
        pj.SamplingParams(max_tokens=int(rng.integers(4, 16)), ignore_eos=True) for _ in range(200)
    ]
    # Each request alone: one sequence per step, a pool that never runs out.
    alone = pj.LLM(
        *models.load("tiny-llama"),
        num_pages=256,
        page_size=PAGE,
        max_num_seqs=1,
        max_num_batched_tokens=64,
    )
    ref = [o.outputs[0].token_ids for o in alone.generate(prompts, params, progress=False)]
    return prompts, params, ref


@pytest.mark.parametrize(
    "preemption, prefix_caching, overlapped",
    [
        ("recompute", True, True),
        ("recompute", False, True),
        ("swap", True, True),
        ("swap", False, True),
        ("recompute", True, False),
        ("swap", False, False),
    ],
)
def test_overload_loses_nothing_and_changes_no_output(
    workload, preemption, prefix_caching, overlapped
):
    prompts, params, ref = workload
    need = sum(-(-(len(p) + q.max_tokens) // PAGE) for p, q in zip(prompts, params, strict=True))
    llm = pj.LLM(
        *models.load("tiny-llama"),
        num_pages=need // 12,
        page_size=PAGE,
        max_num_seqs=64,
        max_num_batched_tokens=192,
        preemption=preemption,
        enable_prefix_caching=prefix_caching,
        async_scheduling=overlapped,
    )
    outs = llm.generate(prompts, params, progress=False)
    assert len(outs) == 200 and all(o.finished for o in outs)
    got = [o.outputs[0].token_ids for o in outs]
    assert [len(g) for g in got] == [p.max_tokens for p in params]
    assert got == ref, [i for i, (a, b) in enumerate(zip(got, ref, strict=True)) if a != b]
    m = llm.metrics
    preempted = m.preemptions_swap if preemption == "swap" else m.preemptions_recompute
    assert preempted > 0, "the pool was meant to run out"
    if overlapped:  # most steps ran behind the one before; some schedules waited for pages
        assert m.overlapped_steps > m.steps // 2 and m.overlap_stalls > 0
    else:
        assert m.overlapped_steps == 0
    assert llm.bm.stats()["pages_used"] == 0 and llm.bm.num_host_free_pages == llm.bm.num_host_pages
    llm.bm.check_invariants()


def test_parallel_sampling_shares_prompt_pages():
    prompt = list(range(40, 77))  # 37 tokens: 4 full pages + 5 tokens
    params = pj.SamplingParams(max_tokens=8, n=4, temperature=1.0, seed=11, ignore_eos=True)
    llm = pj.LLM(
        *models.load("tiny-llama"), num_pages=64, page_size=PAGE, enable_prefix_caching=False
    )
    out = llm.generate([prompt], params, progress=False)[0]
    # 4 shared full pages + 4 copies of the partial page + one new page per sample.
    assert llm.metrics.max_pages_used == 4 + 4 + 4
    # Right after the fork all 5 prompt pages are shared, the partial one included.
    assert llm.metrics.max_pages_shared == 5
    solo = pj.LLM(
        *models.load("tiny-llama"), num_pages=64, page_size=PAGE, enable_prefix_caching=False
    )
    singles = solo.generate(
        [prompt] * 4,
        [
            pj.SamplingParams(max_tokens=8, temperature=1.0, seed=11 + i, ignore_eos=True)
            for i in range(4)
        ],
        progress=False,
    )
    assert solo.metrics.max_pages_used == 4 * 6  # independent requests: 6 pages each
    # Sample i is the n = 1 run with seed + i, token for token.
    assert [c.token_ids for c in out.outputs] == [s.outputs[0].token_ids for s in singles]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4


def _ref_beam_search(model, prompt, width, max_tokens, eos, length_penalty=1.0):
    """Beam search on a dense (unpaged, cache-free) forward pass, same rules as the engine."""
    beams, done = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        cands = []
        for order, (toks, score) in enumerate(beams):
            logits = dense_logits(model, toks)[-1].astype(np.float64)
            logp = logits - np.logaddexp.reduce(logits)
            for rank, t in enumerate(np.argsort(-logp, kind="stable")[: 2 * width]):
                cands.append((score + logp[t], order, rank, toks, int(t)))
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        new = []
        for score, _, _, toks, t in cands:
            if len(new) == width:
                break
            if t in eos:
                if len(done) < width:
                    done.append((toks + [t], score))
                continue
            new.append((toks + [t], score))
        beams = []
        for toks, score in new:
            (done if len(toks) - len(prompt) >= max_tokens else beams).append((toks, score))
        if len(done) >= width or not beams:
            break
    ranked = sorted(done, key=lambda b: -b[1] / (len(b[0]) - len(prompt)) ** length_penalty)
    return [(b[0][len(prompt) :], b[1]) for b in ranked]


@pytest.mark.parametrize("width", [2, 3])
def test_beam_search_equals_unpaged_reference(width):
    llm = pj.LLM(*models.load("tiny-llama"), num_pages=64, page_size=4)
    prompt = [256, 10, 20, 30, 40, 50]
    out = llm.generate(
        [prompt], pj.SamplingParams(max_tokens=7, beam_width=width, n=width), progress=False
    )[0]
    ref = _ref_beam_search(llm.model, prompt, width, 7, llm.eos_token_ids)
    assert [c.token_ids for c in out.outputs] == [r[0] for r in ref][:width]
    np.testing.assert_allclose(
        [c.cumulative_logprob for c in out.outputs], [r[1] for r in ref][:width], rtol=1e-4
    )
    assert llm.metrics.max_pages_shared >= 1  # beams shared the prompt's pages
    assert llm.bm.stats()["pages_used"] == 0


def test_prefix_cache_skips_shared_prompt_and_salt_isolates():
    system = list(range(100, 132))  # 32 tokens = 4 full pages
    a, b = system + [1, 2, 3], system + [7, 8, 9, 10, 11]
    one = pj.SamplingParams(max_tokens=1, ignore_eos=True)

    def computed(llm, prompt, **kw):
        before = llm.metrics.tokens_computed
        out = llm.generate([prompt], one, progress=False, **kw)[0]
        return llm.metrics.tokens_computed - before, out

    llm = pj.LLM(*models.load("tiny-llama"), num_pages=64, page_size=PAGE)
    assert computed(llm, a)[0] == len(a)
    n_b, out_b = computed(llm, b)
    assert n_b == len(b) - 32 and out_b.metrics.num_cached_tokens == 32
    assert computed(llm, b, cache_salt="tenant-2")[0] == len(b)  # another tenant: no sharing
    assert computed(llm, b, cache_salt="tenant-2")[0] == len(b) - 32  # its own cache works
    off = pj.LLM(
        *models.load("tiny-llama"), num_pages=64, page_size=PAGE, enable_prefix_caching=False
    )
    p8 = pj.SamplingParams(max_tokens=8, ignore_eos=True)
    assert (
        llm.generate([b], p8, progress=False)[0].outputs[0].token_ids
        == off.generate([b], p8, progress=False)[0].outputs[0].token_ids
    )


def test_seeded_sampling_is_independent_of_the_batch():
    p = pj.SamplingParams(
        max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=7, ignore_eos=True, logprobs=True
    )
    llm = pj.LLM(*models.load("tiny-llama"), num_pages=128, page_size=PAGE)
    alone = llm.generate([[256, 1, 2, 3]], p, progress=False)[0].outputs[0]
    others = [
        pj.SamplingParams(max_tokens=5, temperature=t, seed=s)
        for t, s in ((0.0, 1), (1.5, 2), (0.3, 3))
    ]
    batch = llm.generate(
        [[9, 9, 9], [256, 1, 2, 3], [5] * 20, [1, 2]],
        [others[0], p, others[1], others[2]],
        progress=False,
    )
    assert batch[1].outputs[0].token_ids == alone.token_ids
    assert len(alone.logprobs) == 10 and all(lp <= 0 for lp in alone.logprobs)
    np.testing.assert_allclose(batch[1].outputs[0].logprobs, alone.logprobs, atol=1e-5)


def test_sampler_top_k_top_p_hand_worked():
    # probs (1/7, 2/7, 4/7): top_k=1 and top_p=0.5 keep token 2 only; top_p=0.6 keeps
    # tokens 2 and 1 (mass before token 1 is 4/7 < 0.6), renormalized to (1/3, 2/3).
    logits = jnp.log(jnp.array([[1.0, 2.0, 4.0]]))
    n = 4000
    rep = lambda x: jnp.repeat(x, n, axis=0)  # noqa: E731
    seeds = jnp.arange(n, dtype=jnp.uint32)[:, None]
    pos = jnp.zeros(n, jnp.int32)

    def draw(top_k, top_p):
        toks, lp = jax.jit(sample_rows)(
            rep(logits),
            jnp.ones(n),
            jnp.full(n, top_k),
            jnp.full(n, top_p, jnp.float32),
            seeds,
            pos,
        )
        return np.asarray(toks[:, 0]), np.asarray(lp[:, 0])

    assert (draw(1, 1.0)[0] == 2).all() and (draw(0, 0.5)[0] == 2).all()
    toks, lp = draw(0, 0.6)
    assert set(np.unique(toks)) == {1, 2}
    assert abs((toks == 1).mean() - 1 / 3) < 0.03
    np.testing.assert_allclose(lp[toks == 1], np.log(2 / 7), rtol=1e-5)
    toks, _ = draw(0, 1.0)
    np.testing.assert_allclose(np.bincount(toks, minlength=3) / n, [1 / 7, 2 / 7, 4 / 7], atol=0.03)


def test_stop_tokens_abort_and_bad_requests_do_not_disturb_others():
    llm = pj.LLM(*models.load("tiny-llama"), num_pages=64, page_size=PAGE)
    greedy = (
        llm.generate(
            [[256, 5, 6]], pj.SamplingParams(max_tokens=6, ignore_eos=True), progress=False
        )[0]
        .outputs[0]
        .token_ids
    )
    stop = greedy[2]
    out = llm.generate(
        [[256, 5, 6]],
        pj.SamplingParams(max_tokens=6, stop_token_ids=[stop], ignore_eos=True),
        progress=False,
    )[0]
    assert out.outputs[0].token_ids == greedy[: greedy.index(stop) + 1]
    assert out.outputs[0].finish_reason == "stop"
    llm.add_request("keep", [1, 2, 3], pj.SamplingParams(max_tokens=3))
    for bad, msg in [
        ([], "prompt: expected at least one token, got an empty prompt"),
        ([1] * 5000, "prompt: 5000 tokens, the model's maximum length is 4096"),
        ([999], r"prompt: token ids must lie in \[0, 320\)"),
    ]:
        with pytest.raises(ValueError, match=msg):
            llm.add_request(f"bad-{len(bad)}", bad)
    with pytest.raises(ValueError, match="request_id: 'keep' is already in use"):
        llm.add_request("keep", [1])
    llm.add_request("gone", [4, 5, 6], pj.SamplingParams(max_tokens=50))
    llm.step()
    llm.abort("gone")
    done = []
    while llm.has_unfinished():
        done += llm.step()
    assert [o.request_id for o in done] == ["keep"] and len(done[0].outputs[0].token_ids) == 3
    assert llm.bm.stats()["pages_used"] == 0


@pytest.mark.parametrize(
    "kwargs,msg",
    [
        (dict(n=0), "n: expected an int >= 1, got 0"),
        (dict(top_p=0.0), r"top_p: expected a float in \(0, 1\], got 0.0"),
        (dict(top_p=1.5), r"top_p: expected a float in \(0, 1\], got 1.5"),
        (dict(max_tokens=0), "max_tokens: expected an int >= 1, got 0"),
        (dict(temperature=-1.0), "temperature: expected a finite float >= 0, got -1.0"),
        (dict(beam_width=2, n=3), "n: expected <= beam_width=2 with beam search, got 3"),
    ],
)
def test_sampling_params_errors(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        pj.SamplingParams(**kwargs)


def test_request_larger_than_the_pool_is_rejected_up_front():
    llm = pj.LLM(*models.load("tiny-llama"), num_pages=8, page_size=PAGE, watermark=0.0)
    with pytest.raises(
        ValueError,
        match=r"request needs up to 12 pages \(4 x 21 tokens\), the "
        r"pool has 7",
    ):
        llm.add_request("big", list(range(5)), pj.SamplingParams(max_tokens=16, n=4))


@pytest.mark.parametrize(
    "params,limits,message",
    [
        (
            dict(n=4, temperature=1.0),
            dict(max_num_seqs=2),
            r"^params\.n: 4 sequences, more than max_num_seqs=2 ",
        ),
        (
            dict(beam_width=3),
            dict(max_num_seqs=2),
            r"^params\.beam_width: 3 sequences, more than max_num_seqs=2 ",
        ),
        (
            dict(n=3, temperature=1.0),
            dict(max_num_seqs=8, max_num_batched_tokens=2),
            r"^params\.n: 3 sequences, more than max_num_batched_tokens=2 ",
        ),
    ],
)
def test_a_group_wider_than_a_step_is_refused_and_does_not_stall_others(params, limits, message):
    # Accepted, such a group never ran and every later request stalled behind it (the
    # engine-reliability issue: `generate -n 4 --max-num-seqs 2` hung).
    llm = pj.LLM(*models.load("tiny-llama"), num_pages=64, page_size=PAGE, **limits)
    with pytest.raises(ValueError, match=message):
        llm.add_request("wide", list(range(5)), pj.SamplingParams(max_tokens=4, **params))
    # Nothing was queued, and a group exactly as wide as the limit still finishes.
    width = min(limits.values())
    llm.add_request(
        "ok", list(range(5)), pj.SamplingParams(max_tokens=4, n=width, seed=1, temperature=1.0)
    )
    done = []
    for _ in range(50):  # bounded: a stall fails instead of hanging
        done += llm.step()
        if not llm.has_unfinished():
            break
    assert [r.request_id for r in done] == ["ok"]
    assert [len(o.token_ids) for o in done[0].outputs] == [4] * width


def test_parallel_arguments_are_checked():
    from jax.sharding import Mesh

    model, _ = models.load("tiny-llama")
    n = jax.device_count()
    with pytest.raises(ValueError, match=rf"tensor_parallel_size: expected an int in \[1, {n}\]"):
        pj.LLM(model, num_pages=8, tensor_parallel_size=n + 1)
    with pytest.raises(TypeError, match="mesh: expected a jax.sharding.Mesh, got str"):
        pj.LLM(model, num_pages=8, mesh="tp")
    with pytest.raises(ValueError, match=rf"data_parallel_size: expected an int in \[1, {n}\]"):
        pj.LLM(model, num_pages=8, data_parallel_size=0)
    with pytest.raises(
        ValueError, match=r"mesh: expected an axis named 'tp' or 'dp', got \('x',\)"
    ):
        pj.LLM(model, num_pages=8, mesh=Mesh(np.array(jax.devices()[:1]), ("x",)))
    mesh = pj.tensor_parallel_mesh(1)
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 differs from the mesh's 'tp'"):
        pj.LLM(model, num_pages=8, mesh=mesh, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="data_parallel_size: 2 differs from the mesh's 'dp'"):
        pj.LLM(model, num_pages=8, mesh=mesh, data_parallel_size=2)
    with pytest.raises(
        ValueError,
        match=r"data_parallel_size x tensor_parallel_size: 2 x 2 = 4 devices, 3 are available",
    ):
        pj.parallel_mesh(2, 2, devices=jax.devices()[:1] * 3)
    # a one-device mesh runs like no mesh
    llm = pj.LLM(model, num_pages=8, mesh=mesh)
    assert llm.generate([[1, 2, 3]], pj.SamplingParams(max_tokens=2), progress=False)[0].finished


@pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="XLA:CPU's own compile options (a GPU/TPU has none)"
)
def test_small_steps_take_their_cpu_compile_options_and_change_no_token(monkeypatch):
    """On CPU, steps of <= SMALL_STEP_TOKENS tokens compile with XLA's own dots (a
    separate jitted function); larger ones, and every step in deterministic mode, with
    the defaults. Tokens are the same either way, log-probs within float error."""
    from paged_jax.engine import runner as engine_runner

    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, n).tolist() for n in (40, 9, 23)]
    params = pj.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=True)
    kw = dict(num_pages=64, page_size=PAGE, max_num_batched_tokens=64, compilation_cache=False)
    llm = pj.LLM(*models.load("tiny-llama"), **kw)
    assert llm.runner.step_fn.small is not None  # noqa: SLF001 (the suite runs on CPU)
    calls = []

    class Seen:  # records which jitted step ran a step of how many tokens
        def __init__(self, name, fn):
            self.name, self.fn = name, fn

        def __call__(self, *a, **k):
            calls.append((self.name, a[1].shape[0]))
            return self.fn(*a, **k)

        def _cache_size(self):
            return self.fn._cache_size()

    step = llm.runner.step_fn
    step.default, step.small = Seen("default", step.default), Seen("small", step.small)
    got = llm.generate(prompts, params, progress=False)
    # the prefill (64 tokens) took the default step, the decode steps (3 rows) the small one
    assert ("default", 64) in calls and ("small", 16) in calls
    assert all((name == "small") == (t <= 16) for name, t in calls)
    assert engine_runner.SMALL_STEP_TOKENS == 16
    assert pj.LLM(*models.load("tiny-llama"), deterministic=True, **kw).runner.step_fn.small is None  # noqa: SLF001

    monkeypatch.setattr(engine_runner, "_small_step_options", lambda: None)
    plain = pj.LLM(*models.load("tiny-llama"), **kw)
    assert plain.runner.step_fn.small is None  # noqa: SLF001
    want = plain.generate(prompts, params, progress=False)
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        np.testing.assert_allclose(g.outputs[0].logprobs, w.outputs[0].logprobs, atol=1e-5)


def test_step_inputs_pack_into_one_buffer_and_come_back_bit_for_bit():
    """The engine sends a step's host arrays as one int32 buffer; inside the jitted step
    each comes back with its shape, dtype and values (uint32 seeds above 2**31, float32
    NaN payloads and negative zeros included)."""
    import jax

    from paged_jax.batch import ScheduledSeq, build_batch
    from paged_jax.block_manager import BlockManager
    from paged_jax.engine.runner import _SAMPLING, _pack_inputs, _unpack_inputs
    from paged_jax.engine.step_types import SamplingColumns

    bm = BlockManager(32, 4, watermark=0.0)
    bm.allocate("a", [1, 2, 3, 4, 5])
    bm.allocate("b", [6, 7])
    batch = build_batch(bm, [ScheduledSeq("a", 0, 5), ScheduledSeq("b", 0, 2)])
    S_b = batch.kv_lens.shape[0]
    rng = np.random.default_rng(0)
    odd = np.array([np.nan, -0.0, np.inf, 1e-45], np.float32)  # bit patterns to keep
    sampling = SamplingColumns(
        np.resize(odd, S_b),
        rng.integers(0, 50, S_b).astype(np.int32),
        rng.random(S_b, np.float32),
        rng.random(S_b, np.float32),
        np.array([[2**32 - 1, 2**31]] * S_b, np.uint32),
        rng.integers(0, 9, S_b).astype(np.int32),
    )
    steps = np.arange(S_b, dtype=np.int32)
    inputs, layout = _pack_inputs(batch, sampling, steps)
    assert inputs.dtype == np.int32 and inputs.ndim == 1
    got = jax.jit(_unpack_inputs, static_argnums=1)(inputs, layout)
    want = {
        "positions": batch.positions,
        "steps": steps,
        **dict(zip(_SAMPLING, sampling.columns(), strict=True)),
    }
    want.update((k, getattr(batch, k)) for k in ("slot_mapping", "page_indices", "copy_dst"))
    for name, a in want.items():
        b = np.asarray(got[name])
        assert b.dtype == a.dtype and b.shape == a.shape, name
        np.testing.assert_array_equal(b.view(np.uint8), a.view(np.uint8), err_msg=name)
    assert "steps" not in jax.jit(_unpack_inputs, static_argnums=1)(
        *_pack_inputs(batch, sampling, None)
    )
