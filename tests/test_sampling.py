"""The sampler: exact against a full-sort reference, no sort on the common paths, greedy
rows at the cost of an argmax, rows independent of their batch."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged_jax as pj
from paged_jax import models
from paged_jax.engine import sampling
from paged_jax.engine.sampling import sample_rows

EPS = 1e-5  # decisions this close to a threshold may go either way in f32


def _uniforms(seeds, positions):
    keys = sampling._keys(jnp.asarray(seeds, jnp.uint32), jnp.asarray(positions, jnp.int32))
    return np.asarray(jax.vmap(jax.random.uniform)(keys), np.float64)


def _reference(logits, temp, top_k, top_p, min_p, u):
    """Token of one row by the definition, with a full stable sort in f64. Returns
    (token, ambiguous) where ambiguous marks a keep decision or draw within EPS."""
    if temp == 0:
        return int(np.argmax(logits)), False
    s = logits.astype(np.float64) / temp
    p = np.exp(s - s.max())
    p /= p.sum()
    restricted = top_k > 0 or top_p < 1 or min_p > 0
    if not restricted:
        cdf = np.cumsum(p)
        t = u * cdf[-1]
        return int(np.searchsorted(cdf, t, side="right")), bool(np.min(np.abs(cdf - t)) < EPS)
    order = np.argsort(-s, kind="stable")
    ps = p[order]
    before = np.cumsum(ps) - ps
    rank = np.arange(len(ps))
    keep = (rank < (top_k or len(ps))) & (before < top_p) & (ps >= min_p * ps[0])
    keep[0] = True
    amb = bool(top_p < 1 and np.any(np.abs(before - top_p) < EPS))
    amb |= bool(min_p > 0 and np.any(np.abs(ps - min_p * ps[0]) < EPS))
    kept = np.zeros(len(ps), bool)
    kept[order] = keep  # the kept set, drawn from in vocabulary order
    cdf = np.cumsum(np.where(kept, p, 0.0))
    t = u * cdf[-1]
    amb |= bool(np.min(np.abs(cdf - t)) < EPS)
    return int(np.searchsorted(cdf, t, side="right")), amb


def _random_params(rng, R, vocab, greedy, top_p_share, columns):
    """Per-row sampling inputs: temperature (0 for a ``greedy`` share of rows), top-k,
    top-p (on a ``top_p_share`` of rows), min-p, seeds ``[R, columns]``, positions."""
    temp = np.where(rng.random(R) < greedy, 0.0, rng.uniform(0.3, 2.0, R)).astype(np.float32)
    top_k = np.where(rng.random(R) < 0.5, rng.integers(1, vocab + 3, R), 0).astype(np.int32)
    top_p = np.where(rng.random(R) < top_p_share, rng.uniform(0.05, 1.0, R), 1.0)
    min_p = np.where(rng.random(R) < 0.3, rng.uniform(0.0, 0.5, R), 0.0).astype(np.float32)
    seeds = rng.integers(0, 2**31, (R, columns)).astype(np.uint32)
    pos = rng.integers(0, 100, R).astype(np.int32)
    return temp, top_k, top_p.astype(np.float32), min_p, seeds, pos


@pytest.mark.parametrize("num_candidates", [4, 16, 256])
def test_tokens_equal_the_full_sort_definition(monkeypatch, num_candidates):
    # Small vocabularies, random parameters, fixed keys: every row's token is the one the
    # definition gives, whether it came from the candidates or the full-sort fallback
    # (few candidates force the fallback often).
    monkeypatch.setattr(sampling, "NUM_CANDIDATES", num_candidates)
    rng = np.random.default_rng(num_candidates)
    checked = fallback = 0
    for vocab in (7, 50, 300):
        R = 40
        logits = rng.standard_normal((R, vocab)).astype(np.float32) * rng.uniform(0.5, 6, (R, 1))
        logits[:4, :3] = logits[:4, :1]  # ties at the top
        temp, top_k, top_p, min_p, seeds, pos = _random_params(rng, R, vocab, 0.15, 0.5, 1)
        toks, lps = jax.jit(sample_rows)(logits, temp, top_k, top_p, seeds, pos, min_p)
        toks, lps = np.asarray(toks[:, 0]), np.asarray(lps[:, 0])
        u = _uniforms(seeds[:, 0], pos)
        for r in range(R):
            ref, amb = _reference(logits[r], temp[r], top_k[r], top_p[r], min_p[r], u[r])
            if amb:
                continue
            assert toks[r] == ref, (vocab, r)
            checked += 1
            restricted = top_k[r] > 0 or top_p[r] < 1 or min_p[r] > 0
            fallback += bool(temp[r] > 0 and restricted and vocab > num_candidates)
        lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
        ref_lp = logits[np.arange(R), toks] - lse
        np.testing.assert_allclose(lps, ref_lp, atol=1e-5)
    assert checked >= 105
    if num_candidates < 50:
        assert fallback > 0


# The GPU kernel compiled on a GPU (gpu_session.sh's kernels stage), interpreted elsewhere.
KERNEL_WAY = "pallas_gpu" if jax.default_backend() == "gpu" else "interpret"
# The XLA passes with the rounds' sums by the split kernel (trial_counts) and ties ranked
# by nth_tied: compiled on a GPU, interpreted elsewhere.
SPLIT_WAY = "pallas_gpu_split" if jax.default_backend() == "gpu" else "interpret_split"


@pytest.mark.parametrize("way", [True, KERNEL_WAY, SPLIT_WAY])
def test_sort_free_tokens_equal_the_full_sort_definition(way):
    # The radix passes against the full-sort definition, as XLA reductions (True), as
    # the GPU kernel and as XLA's passes over the split kernel's sums, interpreted: ties
    # at the top, bf16-rounded rows (many equal logits, so the kept prefix and the draw
    # end inside a group of ties), a row of equal logits, masked (-inf) tokens, two
    # sample columns.
    rng = np.random.default_rng(7)
    checked = 0
    for vocab in (7, 50, 300):
        R = 40
        logits = rng.standard_normal((R, vocab)).astype(np.float32) * rng.uniform(0.5, 6, (R, 1))
        logits[:4, :3] = logits[:4, :1]
        logits[4:14] = np.round(logits[4:14] * 2) / 2  # few distinct values
        logits[14] = 1.0
        logits[15, 5:] = -np.inf
        temp, top_k, top_p, min_p, seeds, pos = _random_params(rng, R, vocab, 0.1, 0.6, 2)
        run = jax.jit(sample_rows, static_argnames="sort_free")
        toks, lps = run(logits, temp, top_k, top_p, seeds, pos, min_p, sort_free=way)
        toks = np.asarray(toks)
        for j in range(2):
            u = _uniforms(seeds[:, j], pos)
            for r in range(R):
                ref, amb = _reference(logits[r], temp[r], top_k[r], top_p[r], min_p[r], u[r])
                if not amb:
                    assert toks[r, j] == ref, (vocab, r, j)
                    checked += 1
        with np.errstate(divide="ignore"):
            lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
        np.testing.assert_allclose(
            np.asarray(lps), logits[np.arange(R)[:, None], toks] - lse[:, None], atol=1e-5
        )
    assert checked >= 200
    # Nothing in the program sorts or takes a top-k.
    text = run.lower(logits, temp, top_k, top_p, seeds, pos, min_p, sort_free=way).as_text().lower()
    for op in ("stablehlo.sort", "top_k", "topk"):
        assert op not in text, op


@pytest.mark.parametrize("way", ["candidates", True, KERNEL_WAY, SPLIT_WAY, "cpu-kernel"])
def test_the_kept_tokens_are_drawn_in_vocabulary_order_with_ties_cut(way):
    # Tokens 10 and 200 on top, the rest tied below. top_k 4 keeps those two and the
    # first two tied tokens in index order (0 and 1; the cut runs through the ties), and
    # the draw walks {0, 1, 10, 200} in that order: u below 1/7.4 gives 0, and so on.
    # top_p 0.5 over 300 equal logits keeps the first 150 and draws token floor(150 u).
    from paged_jax.kernels import cpu

    if way == "cpu-kernel" and not cpu.available():
        pytest.skip("the CPU kernels did not build here")
    V, J = 300, 16
    logits = np.zeros((2, V), np.float32)
    logits[0, [10, 200]] = 1.0
    temp = np.ones(2, np.float32)
    top_k = np.array([4, 0], np.int32)
    top_p = np.array([1.0, 0.5], np.float32)
    seeds = np.arange(2 * J, dtype=np.uint32).reshape(2, J)
    pos = np.array([3, 4], np.int32)
    kw = {"cpu_kernel": True} if way == "cpu-kernel" else {"sort_free": way != "candidates" and way}
    run = jax.jit(functools.partial(sample_rows, **kw))
    toks = np.asarray(run(logits, temp, top_k, top_p, seeds, pos)[0])
    for j in range(J):
        u = _uniforms(seeds[:, j], pos)
        assert toks[1, j] == int(150 * u[1]), (j, u[1])
        ref, amb = _reference(logits[0], 1.0, 4, 1.0, 0.0, u[0])
        assert ref in (0, 1, 10, 200)
        if not amb:
            assert toks[0, j] == ref, (j, u[0])
    assert {0, 1} <= set(toks[0]) and set(toks[0]) <= {0, 1, 10, 200}


def test_inverse_cdf_never_draws_a_zero_weight_entry():
    # A draw at the very top (u = 1, the sums exact) falls past every running sum: the
    # last entry of positive weight is drawn, not a zero-weight entry after it, in one
    # block and in several (whole zero blocks at the end).
    from paged_jax.engine.sort_free import inverse_cdf

    for C, last in ((40, 30), (1000, 600)):
        w = np.zeros((2, C), np.float32)
        w[:, : last + 1 : 3] = 2.0
        w[1, last] = 1.0
        u = np.array([[1.0, 0.0], [1.0, 0.0]], np.float32)
        got = np.asarray(inverse_cdf(jnp.asarray(w), jnp.asarray(u)))
        np.testing.assert_array_equal(got, [[last, 0], [last, 0]])


def test_the_split_kernels_count_above_trials_and_rank_ties():
    # trial_counts: a row over several programs (slices of 64 logits, the last partial;
    # -inf tokens weigh nothing); the counts exact, the weights within f32 sums. nth_tied:
    # the j-th index of a key among equal logits, and `first` where j is 0.
    from paged_jax.kernels.gpu.sample import nth_tied, sortable, trial_counts

    rng = np.random.default_rng(12)
    R, V = 3, 300
    x = rng.standard_normal((R, V)).astype(np.float32)
    x[1, 100:] = -np.inf
    m = x.max(1)
    key = np.asarray(sortable(jnp.asarray(x)))
    t = key[np.arange(R)[:, None], rng.integers(0, 100, (R, 5))]  # 5 trials: padded to 8
    n, w = trial_counts(jnp.asarray(x), jnp.asarray(m), jnp.asarray(t), interpret=True, split=64)
    above = key[:, None, :] > t[:, :, None]
    np.testing.assert_array_equal(np.asarray(n), above.sum(-1))
    weights = np.where(above, np.exp(x - m[:, None])[:, None, :], 0.0).sum(-1)
    np.testing.assert_allclose(np.asarray(w), weights, rtol=1e-5)
    x = np.round(x * 2) / 2  # many ties
    key = np.asarray(sortable(jnp.asarray(x)))
    t = key[:, :2]
    j = np.array([[0, 1], [2, 0], [3, 1]], np.int32)
    tied = [[np.flatnonzero(key[r] == t[r, c]) for c in range(2)] for r in range(R)]
    first = np.array([[tied[r][c][0] for c in range(2)] for r in range(R)], np.int32)
    want = np.array([[tied[r][c][j[r, c]] for c in range(2)] for r in range(R)])
    assert all(len(tied[r][c]) > j[r, c] for r in range(R) for c in range(2))
    assert (want != first).sum() >= 3  # (ranks past the first tie)
    got = nth_tied(*map(jnp.asarray, (x, t, j, first)), interpret=True, block=64)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_the_kernels_prefetching_passes_draw_the_definitions_tokens():
    # The GPU kernel, interpreted, with each pass loading its next chunk ahead (prefetch)
    # and without: the definition's tokens either way, in rows of several chunks whose
    # last is partial (vocab 300, blocks of 64), with ties at the top, few distinct values
    # and masked tokens.
    from paged_jax.kernels.gpu.sample import restricted_draw

    rng = np.random.default_rng(11)
    R, vocab = 24, 300
    logits = rng.standard_normal((R, vocab)).astype(np.float32) * rng.uniform(0.5, 6, (R, 1))
    logits[:3, :3] = logits[:3, :1]
    logits[3:9] = np.round(logits[3:9] * 2) / 2
    logits[9, 100:] = -np.inf
    top_k = np.where(np.arange(R) % 3 == 0, rng.integers(1, 40, R), 0).astype(np.int32)
    min_p = np.where(np.arange(R) % 4 == 2, 0.05, 0.0).astype(np.float32)
    # every row restricted (the kernel's rows): top-p wherever neither of the others is on
    on = (np.arange(R) % 3 != 1) | ((top_k == 0) & (min_p == 0))
    top_p = np.where(on, rng.uniform(0.1, 0.95, R), 1.0).astype(np.float32)
    u = rng.random((R, 2)).astype(np.float32)
    args = (jnp.asarray(logits), jnp.asarray(top_k), jnp.asarray(top_p), jnp.asarray(min_p))
    tokens = {
        prefetch: np.asarray(
            restricted_draw(*args, jnp.asarray(u), block=64, prefetch=prefetch, interpret=True)
        )
        for prefetch in (0, 1, 4)  # none, the next chunk, the chunk 4 ahead (5 chunks a row)
    }
    np.testing.assert_array_equal(tokens[1], tokens[0])
    np.testing.assert_array_equal(tokens[4], tokens[0])
    checked = 0
    for r in range(R):
        for j in range(2):
            ref, amb = _reference(logits[r], 1.0, top_k[r], top_p[r], min_p[r], u[r, j])
            if not amb:
                assert tokens[4][r, j] == ref, (r, j)
                checked += 1
    assert checked >= 40


def test_argmax_rows_is_jnp_argmax_with_ties_nans_and_infinities():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 300)).astype(np.float32)
    x[1, [7, 40, 299]] = 9.0  # ties: the first wins
    x[2, [5, 9]] = np.nan  # the first NaN wins, as with argmax
    x[3] = -np.inf  # nothing above -inf: index 0
    x[4, 17] = np.inf
    x[5, [0, 299]] = [np.nan, np.inf]
    x[6] = x[6].astype(jnp.bfloat16).astype(np.float32)  # many equal values
    x[7, -1] = 50.0  # the last index
    for dtype in (jnp.float32, jnp.bfloat16):
        got = jax.jit(sampling.argmax_rows)(jnp.asarray(x, dtype))
        want = jnp.argmax(jnp.asarray(x, dtype), axis=-1)
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert np.asarray(jax.jit(sampling.argmax_rows)(jnp.asarray(x)))[[1, 2, 3]].tolist() == [
        7,
        5,
        0,
    ]


def test_greedy_only_is_the_argmax_with_the_same_log_probs():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((5, 1000)), jnp.float32)
    zeros = jnp.zeros(5, jnp.float32)
    args = (zeros, jnp.zeros(5, jnp.int32), jnp.ones(5), jnp.zeros((5, 2), jnp.uint32))
    pos = jnp.zeros(5, jnp.int32)
    fast = jax.jit(sample_rows, static_argnames="greedy_only")(logits, *args, pos, greedy_only=True)
    full = jax.jit(sample_rows)(logits, *args, pos)
    np.testing.assert_array_equal(np.asarray(fast[0]), np.asarray(full[0]))
    assert (np.asarray(fast[0]) == np.argmax(np.asarray(logits), -1)[:, None]).all()
    np.testing.assert_allclose(np.asarray(fast[1]), np.asarray(full[1]), rtol=1e-6)
    # The greedy-only program has no sort, top-k or PRNG in it.
    hlo = jax.jit(sample_rows, static_argnames="greedy_only").lower(
        logits, *args, pos, greedy_only=True
    )
    text = hlo.as_text()
    for op in ("stablehlo.sort", "top_k", "topk", "threefry", "stablehlo.case"):
        assert op not in text.lower(), op


def test_no_sort_unless_a_row_needs_the_fallback():
    # The full sort sits in the false branch of a conditional taken only when a
    # restricted row's kept set may pass the candidates.
    text = (
        jax.jit(sample_rows)
        .lower(
            jnp.zeros((4, 5000)),
            jnp.ones(4),
            jnp.zeros(4, jnp.int32),
            jnp.full(4, 0.9),
            jnp.zeros((4, 1), jnp.uint32),
            jnp.zeros(4, jnp.int32),
        )
        .as_text()
    )
    assert "stablehlo.case" in text or "conditional" in text.lower()


def test_a_row_does_not_depend_on_its_batch():
    # Row 0 (peaked, top-p) alone, then next to a flat row that forces the fallback.
    rng = np.random.default_rng(1)
    peaked = (rng.standard_normal(4000) * 8).astype(np.float32)
    flat = rng.standard_normal(4000).astype(np.float32)

    def run(rows):
        R = len(rows)
        return np.asarray(
            jax.jit(sample_rows)(
                jnp.asarray(np.stack(rows)),
                jnp.ones(R),
                jnp.zeros(R, jnp.int32),
                jnp.full(R, 0.9),
                jnp.arange(R * 3, dtype=jnp.uint32).reshape(R, 3) * 0 + 11,
                jnp.full(R, 5, jnp.int32),
            )[0]
        )

    alone = run([peaked])
    batched = run([peaked, flat, flat])
    np.testing.assert_array_equal(batched[0], alone[0])


def test_min_p_one_keeps_only_the_top_token_through_the_engine():
    llm = pj.LLM(*models.load("tiny-llama"), num_pages=64, page_size=8)
    greedy = llm.generate(
        [[3, 4, 5]], pj.SamplingParams(max_tokens=6, ignore_eos=True), progress=False
    )[0]
    sampled = llm.generate(
        [[3, 4, 5]],
        pj.SamplingParams(max_tokens=6, temperature=1.5, min_p=1.0, seed=9, ignore_eos=True),
        progress=False,
    )[0]
    assert sampled.outputs[0].token_ids == greedy.outputs[0].token_ids
    with pytest.raises(ValueError, match=r"min_p: expected a float in \[0, 1\], got 1.5"):
        pj.SamplingParams(min_p=1.5)


def test_the_gpu_sampler_holds_no_conditional_and_skips_rows_not_drawn():
    # Lowered for CUDA on this host: the sampler with the GPU kernel launches it once and
    # holds no stablehlo conditional or loop (a GPU reads a conditional's predicate, and a
    # loop's whose count XLA does not see, back to the host, stalling the step's
    # dispatch), where the candidates' way holds several.
    from paged_jax.kernels.gpu import aot
    from paged_jax.kernels.gpu.sample import restricted_draw

    R, V = 8, 1000
    args = [
        jax.ShapeDtypeStruct((R, V), jnp.float32),
        jax.ShapeDtypeStruct((R,), jnp.float32),
        jax.ShapeDtypeStruct((R,), jnp.int32),
        jax.ShapeDtypeStruct((R,), jnp.float32),
        jax.ShapeDtypeStruct((R, 1), jnp.uint32),
        jax.ShapeDtypeStruct((R,), jnp.int32),
    ]

    def text(way):
        fn = functools.partial(sample_rows, sort_free=way)
        try:
            lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
        except RuntimeError:  # JAX >= 0.11 asks which GPU to target
            with jax.sharding.use_abstract_mesh(aot._abstract_gpu_mesh()):
                lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
        return lowered.as_text()

    gpu, candidates = text("pallas_gpu"), text(False)
    assert "stablehlo.case" not in gpu and "stablehlo.if" not in gpu
    assert "stablehlo.while" not in gpu  # (nor a loop: the draw's searches compare all)
    split = text("pallas_gpu_split")  # (its radix rounds unrolled)
    assert not any(op in split for op in ("stablehlo.case", "stablehlo.if", "stablehlo.while"))
    assert gpu.count("__gpu$xla.gpu.triton") == 1, gpu.count("__gpu$xla.gpu.triton")
    assert "stablehlo.case" in candidates or "stablehlo.if" in candidates
    # rows left out of the draw are not drawn (token 0), the others are
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((4, 64)).astype(np.float32))
    active = jnp.array([True, False, True, False])
    u = jnp.full((4, 1), 0.999, jnp.float32)
    kw = dict(top_k=jnp.zeros(4, jnp.int32), top_p=jnp.full(4, 0.9), min_p=jnp.zeros(4))
    tok = np.asarray(restricted_draw(x, u=u, active=active, interpret=True, **kw))[:, 0]
    every = np.asarray(restricted_draw(x, u=u, interpret=True, **kw))[:, 0]
    assert tok[1] == tok[3] == 0 and (tok[[0, 2]] == every[[0, 2]]).all()
    assert (every[[1, 3]] != 0).all()


@pytest.mark.parametrize("way", ["xla", KERNEL_WAY, SPLIT_WAY])
def test_engine_on_a_sort_free_backend_gives_the_same_seeded_tokens(monkeypatch, way):
    # The engine's XLA sampler (no C kernel) with the sort-free draw switched on for this
    # backend (XLA's passes, or the GPU kernel interpreted), against the candidates: the
    # same seeded top-p/top-k/min-p tokens.
    from paged_jax.engine import runner

    monkeypatch.setattr(pj.linear, "available", lambda: False)
    params = [
        pj.SamplingParams(max_tokens=8, temperature=1.0, seed=s, ignore_eos=True, **kw)
        for s, kw in enumerate([dict(top_p=0.9), dict(top_k=5), dict(min_p=0.05), {}])
    ]

    def run():
        llm = pj.LLM(*models.load("tiny-llama"), num_pages=64, page_size=8)
        outs = llm.generate([[3, 4, 5], [6, 7], [8], [9, 10]], params, progress=False)
        return [o.outputs[0].token_ids for o in outs]

    candidates = run()
    from paged_jax.engine import sampling
    from paged_jax.kernels.gpu import sample

    traced = []  # the draw the jitted step was traced with (it must be the one asked for)
    names = ((sampling, "sort_free_draw"), (sample, "restricted_draw"), (sample, "trial_counts"))
    for module, name in names:
        original = getattr(module, name)

        def counted(*a, _name=name, _original=original, **k):
            traced.append(_name)
            return _original(*a, **k)

        monkeypatch.setattr(module, name, counted)
    monkeypatch.setattr(runner, "SORT_FREE_BACKENDS", {jax.default_backend(): way})
    assert run() == candidates
    want = {"xla": {"sort_free_draw"}, SPLIT_WAY: {"sort_free_draw", "trial_counts"}}
    assert set(traced) == want.get(way, {"restricted_draw"})


def _np_penalties(logits, prompt, output, rep, pres, freq):
    """vLLM's penalties by their definition, on one row (f64)."""
    x = logits.astype(np.float64).copy()
    counts = np.bincount(np.asarray(output, np.int64), minlength=len(x))[: len(x)]
    seen = counts > 0
    seen[np.asarray(prompt, np.int64)] = True
    x[seen] = np.where(x[seen] > 0, x[seen] / rep, x[seen] * rep)
    return x - freq * counts - pres * (counts > 0)


def test_penalties_hand_worked_and_padding_ignored():
    logits = jnp.array([[2.0, -1.0, 0.5, 3.0, 1.0]])
    pen = sampling.Penalties(
        repetition=jnp.array([2.0]),
        presence=jnp.array([0.5]),
        frequency=jnp.array([0.25]),
        output_tokens=jnp.array([[3, 3, 1, -1]], jnp.int32),
        prompt_tokens=jnp.array([[0, -1]], jnp.int32),
    )
    out = np.asarray(sampling.apply_penalties(logits, pen))[0]
    # token 0: prompt, positive -> 2/2; 1: output once, negative -> -1*2 - 0.25 - 0.5;
    # 2: untouched; 3: output twice -> 3/2 - 0.5 - 0.5; 4: untouched.
    np.testing.assert_allclose(out, [1.0, -2.75, 0.5, 0.5, 1.0], rtol=1e-6)
    np.testing.assert_allclose(
        out, _np_penalties(np.asarray(logits[0]), [0], [3, 3, 1], 2.0, 0.5, 0.25), rtol=1e-6
    )


def test_logit_bias_adds_to_its_tokens_after_the_penalties():
    logits = jnp.array([[2.0, -1.0, 0.5, 3.0, 1.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    pen = sampling.Penalties(
        repetition=jnp.array([2.0, 1.0]),
        presence=jnp.zeros(2),
        frequency=jnp.zeros(2),
        output_tokens=jnp.array([[3, -1], [-1, -1]], jnp.int32),
        prompt_tokens=jnp.full((2, 1), -1, jnp.int32),
        # row 0: -100 on token 3 (penalized first: 3 / 2 - 100), +1.5 on 1; padding -1
        # and an id past the vocabulary (a row's own padding) change nothing
        bias_tokens=jnp.array([[1, 3, -1], [4, 9, -1]], jnp.int32),
        bias_values=jnp.array([[1.5, -100.0, 7.0], [2.0, 5.0, 3.0]]),
    )
    out = np.asarray(sampling.apply_penalties(logits, pen))
    np.testing.assert_allclose(out[0], [2.0, 0.5, 0.5, -98.5, 1.0], rtol=1e-6)
    np.testing.assert_allclose(out[1], [0.0, 0.0, 0.0, 0.0, 2.0], rtol=1e-6)
    # keys given as JSON's text, kept sorted by token
    assert pj.SamplingParams(logit_bias={"7": -1, 2: 0.5}).logit_bias == ((2, 0.5), (7, -1.0))


def test_neutral_penalty_rows_change_no_logit():
    # A speculative step's verify rows: every field (those added later too) padded with
    # a value that leaves the logits as they are; the first rows keep their penalties.
    pen = sampling.Penalties(
        repetition=np.array([2.0], np.float32),
        presence=np.array([0.5], np.float32),
        frequency=np.array([0.25], np.float32),
        output_tokens=np.array([[3, 1]], np.int32),
        prompt_tokens=np.array([[0]], np.int32),
        bias_tokens=np.array([[4]], np.int32),
        bias_values=np.array([-7.0], np.float32)[:, None],
    )
    more = pen.with_neutral_rows(3)
    assert all(getattr(more, f.name).shape[0] == 4 for f in dataclasses.fields(more))
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, 5)), jnp.float32)
    out = np.asarray(sampling.apply_penalties(logits, jax.tree.map(jnp.asarray, more)))
    np.testing.assert_array_equal(out[1:], np.asarray(logits)[1:])
    first = sampling.apply_penalties(logits[:1], jax.tree.map(jnp.asarray, pen))
    np.testing.assert_array_equal(out[:1], np.asarray(first))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_through_the_engine_equals_the_definition(temperature):
    # Greedy: each token the argmax of the dense logits plus the bias; sampled with a
    # +100 bias on one token: that token every time. Log-probs stay the raw model's.
    from model_helpers import dense_logits

    llm = pj.LLM(*models.load("tiny-llama"), num_pages=64, page_size=8)
    prompt = [7, 7, 9, 200, 3]
    plain = llm.generate([prompt], pj.SamplingParams(max_tokens=6, ignore_eos=True), progress=False)
    first = plain[0].outputs[0].token_ids
    bias = {first[0]: -100.0, first[1]: -100.0, 17: 2.5}
    if temperature:
        bias = {42: 100.0}
    p = pj.SamplingParams(
        max_tokens=6, temperature=temperature, seed=3, logit_bias=bias, logprobs=True,
        ignore_eos=True,
    )  # fmt: skip
    got = llm.generate([prompt], p, progress=False)[0].outputs[0]
    model = models.init_model(models.TINY_LLAMA, seed=0)
    ids = list(prompt)
    for k, token in enumerate(got.token_ids):
        raw = dense_logits(model, ids)[-1].astype(np.float64)
        row = raw.copy()
        for t, b in bias.items():
            row[t] += b
        if temperature:
            assert token == 42
        else:
            assert token == int(np.argmax(row))
        lse = np.log(np.exp(raw - raw.max()).sum()) + raw.max()
        assert got.logprobs[k] == pytest.approx(raw[token] - lse, abs=1e-4)
        ids.append(token)
    assert got.token_ids != first
    assert llm.metrics.failed_steps == 0  # (generate recovers from one: it would hide it)


def test_min_tokens_holds_back_stop_tokens_and_stop_strings():
    # Greedy with a stop token the model picks at once: before min_tokens each token is
    # the argmax of the dense logits with the stop tokens (and the model's end of
    # sequence) at -inf; from then on the sequence ends at its first stop token. A stop
    # string in the text before min_tokens does not end it either.
    from model_helpers import dense_logits

    llm = pj.LLM(*models.load("tiny-llama"), num_pages=64, page_size=8)
    prompt = [5, 6, 7, 8]
    free = llm.generate([prompt], pj.SamplingParams(max_tokens=8), progress=False)[0].outputs[0]
    stop = free.token_ids[0]
    eos = llm.model.config.eos_token_ids
    model = models.init_model(models.TINY_LLAMA, seed=0)
    for min_tokens in (1, 3, 5):
        p = pj.SamplingParams(max_tokens=12, stop_token_ids=(stop,), min_tokens=min_tokens)
        got = llm.generate([prompt], p, progress=False)[0].outputs[0]
        ids, want = list(prompt), []
        while len(want) < 12:
            row = dense_logits(model, ids)[-1].astype(np.float64)
            if len(want) < min_tokens:
                row[[stop, *eos]] = -np.inf
            want.append(int(np.argmax(row)))
            ids.append(want[-1])
            if want[-1] in (stop, *eos):
                break
        assert got.token_ids == want and len(want) >= min_tokens
        assert got.finish_reason == ("stop" if want[-1] in (stop, *eos) else "length")
    # a stop string (the first token's text): searched for only in text from the
    # min_tokens-th token on
    free = llm.generate([prompt], pj.SamplingParams(max_tokens=12), progress=False)[0].outputs[0]
    first = free.text[:1]
    plain = pj.SamplingParams(max_tokens=12, stop=(first,))
    held = pj.SamplingParams(max_tokens=12, stop=(first,), min_tokens=3)
    a, b = (llm.generate([prompt], q, progress=False)[0].outputs[0] for q in (plain, held))
    assert a.text == "" and a.finish_reason == "stop"
    before = llm.tokenizer.decode(free.token_ids[:2])  # the text of the tokens before the 3rd
    at = free.text.find(first, len(before))
    assert b.text == (free.text if at < 0 else free.text[:at])
    assert b.finish_reason == ("length" if at < 0 else "stop")
    assert llm.metrics.failed_steps == 0


def test_penalized_greedy_through_the_engine_equals_the_definition():
    # Greedy with all three penalties: each token is the argmax of the penalized dense
    # logits of everything before it (prompt and output so far).
    from model_helpers import dense_logits

    llm = pj.LLM(*models.load("tiny-llama"), num_pages=64, page_size=8)
    prompt = [7, 7, 9, 200, 3]
    p = pj.SamplingParams(
        max_tokens=8,
        repetition_penalty=1.4,
        presence_penalty=0.8,
        frequency_penalty=0.6,
        ignore_eos=True,
    )
    got = llm.generate([prompt], p, progress=False)[0].outputs[0].token_ids
    model = models.init_model(models.TINY_LLAMA, seed=0)
    ids, want = list(prompt), []
    for _ in range(8):
        row = _np_penalties(dense_logits(model, ids)[-1], prompt, want, 1.4, 0.8, 0.6)
        want.append(int(np.argmax(row)))
        ids.append(want[-1])
    assert got == want
    plain = llm.generate([prompt], pj.SamplingParams(max_tokens=8, ignore_eos=True), progress=False)
    assert plain[0].outputs[0].token_ids != want  # the penalties changed something here


@pytest.mark.parametrize(
    "kwargs,msg",
    [
        (dict(repetition_penalty=0.0), "repetition_penalty: expected a finite float > 0"),
        (dict(presence_penalty=2.5), r"presence_penalty: expected a float in \[-2, 2\]"),
        (dict(frequency_penalty=float("nan")), r"frequency_penalty: expected a float in"),
        (dict(beam_width=2, presence_penalty=1.0), "not supported with beam search"),
        (dict(logit_bias={3: 101.0}), r"logit_bias\[3\]: expected a float in \[-100, 100\]"),
        (dict(logit_bias={"a": 1.0}), "logit_bias: keys must be token ids >= 0, got 'a'"),
        (dict(logit_bias={-2: 1.0}), "logit_bias: keys must be token ids >= 0, got -2"),
        (dict(logit_bias={1: float("inf")}), r"logit_bias\[1\]: expected a float"),
        (dict(logit_bias=[1, 2]), r"logit_bias: expected None or \{token id: bias\}"),
        (dict(logit_bias=dict.fromkeys(range(1025), 1.0)), "at most 1024 tokens, got 1025"),
        (dict(beam_width=2, logit_bias={1: 1.0}), "logit_bias: not supported with beam search"),
        (dict(max_tokens=4, min_tokens=5), r"min_tokens: expected an int in \[0, max_tokens=4\]"),
        (dict(min_tokens=True), r"min_tokens: expected an int in \[0, max_tokens=16\]"),
        (dict(beam_width=2, min_tokens=1), "min_tokens: not supported with beam search"),
    ],
)
def test_penalty_params_are_checked(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        pj.SamplingParams(**kwargs)


def _masked_reference(logits, allowed, temp, top_k, top_p, min_p, u):
    """The definition on a row whose disallowed logits are -inf (by removing them)."""
    ids = np.asarray(sorted(allowed))
    tok, amb = _reference(logits[ids], temp, top_k, top_p, min_p, u)
    return int(ids[tok]), amb


@pytest.mark.parametrize("cpu_kernel", [False, True], ids=["xla", "cpu-kernel"])
def test_allowed_tokens_are_the_only_ones_sampled(cpu_kernel):
    # The per-row mask (SamplingParams.allowed_token_ids, and the hook grammars use):
    # tokens by the definition over the allowed ones only, greedy rows included;
    # log-probs under the model's whole distribution.
    from paged_jax.engine.sampling import allowed_bits
    from paged_jax.kernels import cpu

    if cpu_kernel and not cpu.available():
        pytest.skip("the CPU kernels did not build here (no C compiler)")
    rng = np.random.default_rng(4)
    R, V = 24, 300
    logits = rng.normal(size=(R, V)).astype(np.float32) * 3
    allowed = [set(rng.choice(V, size=int(rng.integers(1, 40)), replace=False)) for _ in range(R)]
    allowed[0] = set(range(V))  # unrestricted
    allowed[1] = {7}  # one token
    mask = np.stack([allowed_bits(sorted(a), V) for a in allowed])
    temp = np.where(np.arange(R) % 3 == 0, 0.0, 0.8).astype(np.float32)
    top_k = np.where(np.arange(R) % 4 == 1, 5, 0).astype(np.int32)
    top_p = np.where(np.arange(R) % 5 == 2, 0.7, 1.0).astype(np.float32)
    min_p = np.where(np.arange(R) % 7 == 3, 0.1, 0.0).astype(np.float32)
    seeds = np.arange(R, dtype=np.uint32)[:, None]
    pos = np.zeros(R, np.int32)
    toks, lps = sample_rows(
        jnp.asarray(logits),
        *map(jnp.asarray, (temp, top_k, top_p, seeds, pos, min_p)),
        None,
        jnp.asarray(mask),
        cpu_kernel=cpu_kernel,
    )
    toks, lps = np.asarray(toks)[:, 0], np.asarray(lps)[:, 0]
    u = _uniforms(seeds[:, 0], pos)
    raw = logits.astype(np.float64)
    top = raw.max(1, keepdims=True)
    log_softmax = raw - top - np.log(np.exp(raw - top).sum(1, keepdims=True))
    checked = 0
    for r in range(R):
        assert toks[r] in allowed[r], (r, toks[r])
        want, amb = _masked_reference(logits[r], allowed[r], temp[r], top_k[r], top_p[r],
                                      min_p[r], u[r])  # fmt: skip
        if not amb:
            assert toks[r] == want, r
            checked += 1
        assert abs(lps[r] - log_softmax[r, toks[r]]) < 1e-4  # the unmasked distribution
    assert checked >= R - 2 and toks[1] == 7


def test_allowed_token_ids_through_the_engine_and_their_checks():
    from model_helpers import dense_logits

    llm = pj.LLM(*models.load("tiny-llama"), num_pages=64, page_size=8)
    allowed = (10, 20, 30, 40, 50)
    prompt = [3, 4, 5]
    out = (
        llm.generate(
            [prompt],
            pj.SamplingParams(max_tokens=6, ignore_eos=True, allowed_token_ids=list(allowed)),
            progress=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    ids, want = list(prompt), []
    for _ in range(6):  # greedy over the allowed tokens, step by step
        last = dense_logits(llm.model, ids)[-1]
        want.append(max(allowed, key=lambda t: last[t]))
        ids.append(want[-1])
    assert out == want
    # multi-step decoding takes such rows one step at a time: the same tokens
    multi = pj.LLM(*models.load("tiny-llama"), num_pages=64, page_size=8, num_scheduler_steps=4)
    again = (
        multi.generate(
            [prompt],
            pj.SamplingParams(max_tokens=6, ignore_eos=True, allowed_token_ids=allowed),
            progress=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    assert again == want and multi.metrics.multi_step_launches == 0
    with pytest.raises(ValueError, match=r"params.allowed_token_ids: token ids must lie in"):
        llm.add_request("x", prompt, pj.SamplingParams(allowed_token_ids=(10, 10**6)))
    for bad in ([], "abc", [1.5], [-1]):
        with pytest.raises(ValueError, match="allowed_token_ids: expected None or a non-empty"):
            pj.SamplingParams(allowed_token_ids=bad)
    with pytest.raises(ValueError, match="allowed_token_ids: not supported with beam search"):
        pj.SamplingParams(allowed_token_ids=[1], beam_width=2)


def test_top_logprobs_through_the_engine_equal_the_definition():
    """Each token's most likely tokens and log-probs are those of the model's dense
    log-softmax at its position, greedy and sampled, for n > 1 samples too; streamed
    pieces carry each token once, with its log-probs (issue 51, item 2)."""
    from model_helpers import dense_logits

    llm = pj.LLM(*models.load("tiny-llama"), num_pages=64, page_size=8)
    model = models.init_model(models.TINY_LLAMA, seed=0)
    prompt = [7, 7, 9, 200, 3]
    for p in (
        pj.SamplingParams(max_tokens=6, ignore_eos=True, top_logprobs=4),
        pj.SamplingParams(max_tokens=5, ignore_eos=True, top_logprobs=3, temperature=1.0, n=2),
    ):
        (out,) = llm.generate([prompt], p, progress=False)
        for c in out.outputs:
            assert c.logprobs is not None and len(c.top_logprobs) == len(c.token_ids)
            ids = list(prompt)
            for token, lp, top in zip(c.token_ids, c.logprobs, c.top_logprobs, strict=True):
                row = np.asarray(jax.nn.log_softmax(dense_logits(model, ids)[-1]))
                want = np.argsort(-row, kind="stable")[: p.top_logprobs]
                assert [t for t, _ in top] == want.tolist()
                np.testing.assert_allclose([v for _, v in top], row[want], atol=2e-5)
                np.testing.assert_allclose(lp, row[token], atol=2e-5)
                ids.append(token)
    p = pj.SamplingParams(max_tokens=7, ignore_eos=True, top_logprobs=2)
    pieces = list(llm.stream([prompt], p))
    final = pieces[-1].output.outputs[0]
    assert sum((x.token_ids for x in pieces), []) == final.token_ids
    assert sum((x.logprobs for x in pieces), []) == final.logprobs
    assert sum((x.top_logprobs for x in pieces), []) == final.top_logprobs


@pytest.mark.parametrize(
    "kwargs,msg",
    [
        (dict(top_logprobs=21), r"top_logprobs: expected an int in \[0, 20\]"),
        (dict(top_logprobs=True), r"top_logprobs: expected an int in \[0, 20\]"),
        (dict(top_logprobs=2, beam_width=2), "top_logprobs: not supported with beam search"),
    ],
)
def test_top_logprobs_params_are_checked(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        pj.SamplingParams(**kwargs)
    assert pj.SamplingParams(top_logprobs=2).logprobs  # implied
