"""The sampler's C kernels: ``paged_jax.kernels.cpu.greedy_rows`` against ``jnp.argmax`` and
``jax.nn.logsumexp``, ``cpu.sample_tokens`` against the full-sort definition, and the
sampler using them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_sampling
from paged_cases import HAS_CC

from paged_jax.engine.sampling import Penalties, sample_rows
from paged_jax.kernels import cpu

needs_cc = pytest.mark.skipif(not HAS_CC, reason="no C compiler here: the sampler stays on XLA")


@needs_cc
@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 7), (5, 16), (4, 33), (9, 5003)])
def test_matches_argmax_and_logsumexp(rows, vocab):
    # vocabularies shorter than a vector, a whole one, and tails past whole ones
    x = (np.random.default_rng(vocab).standard_normal((rows, vocab)) * 8).astype(np.float32)
    x[0, vocab // 2] = x[0].max()  # a tie: the first index wins
    token, lse = jax.jit(cpu.greedy_rows)(x)
    assert token.dtype == jnp.int32 and lse.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(token), np.asarray(jnp.argmax(x, axis=-1)))
    np.testing.assert_allclose(lse, jax.nn.logsumexp(x, axis=-1), rtol=2e-6, atol=2e-6)


@needs_cc
def test_rows_with_nan_and_infinities_as_jax_gives_them():
    x = np.zeros((5, 40), np.float32)
    x[0, [7, 3]] = np.nan  # the first NaN wins; the sum is NaN
    x[1] = -np.inf  # every logit -inf: index 0, -inf
    x[2, [5, 9]] = np.inf  # the first +inf, +inf
    x[3, 30] = np.nan  # a NaN past the first vector
    x[4] = -np.inf
    x[4, 39] = 1.0
    token, lse = cpu.greedy_rows(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(token), np.asarray(jnp.argmax(x, axis=-1)))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(jax.nn.logsumexp(x, axis=-1)))


@needs_cc
def test_rows_do_not_depend_on_the_batch_or_threads():
    x = np.random.default_rng(1).standard_normal((16, 30000)).astype(np.float32)
    one = [np.asarray(a) for a in cpu.greedy_rows(jnp.asarray(x), threads=1)]
    for threads in (2, 3):
        for a, b in zip(cpu.greedy_rows(jnp.asarray(x), threads=threads), one, strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)
    token, lse = cpu.greedy_rows(jnp.asarray(x[5:7]))
    np.testing.assert_array_equal(np.asarray(lse), one[1][5:7])


@needs_cc
def test_boundary_errors():
    with pytest.raises(ValueError, match=r"x: expected f32\[R, V\] with V >= 1, got float16"):
        cpu.greedy_rows(jnp.zeros((2, 3), jnp.float16))
    with pytest.raises(ValueError, match=r"got float32\[2, 0\]"):
        cpu.greedy_rows(jnp.zeros((2, 0)))
    with pytest.raises(ValueError, match="threads: expected a positive int"):
        cpu.greedy_rows(jnp.zeros((2, 3)), threads=0)


@needs_cc
def test_the_greedy_sampler_gives_the_same_tokens_with_the_kernel():
    rng = np.random.default_rng(2)
    R, V, J = 6, 3001, 2
    logits = jnp.asarray(rng.standard_normal((R, V)) * 4, jnp.float32)
    args = (
        logits,
        jnp.zeros(R),  # greedy
        jnp.zeros(R, jnp.int32),
        jnp.ones(R),
        jnp.zeros((R, J), jnp.uint32),
        jnp.arange(R, dtype=jnp.int32),
    )
    f = jax.jit(sample_rows, static_argnames=("greedy_only", "cpu_kernel"))
    want = f(*args, greedy_only=True)
    got = f(*args, greedy_only=True, cpu_kernel=True)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=1e-5)
    hlo = f.lower(*args, greedy_only=True, cpu_kernel=True).as_text()
    assert "paged_jax_cpu_greedy_rows" in hlo


def _draws(logits, temp, top_k, top_p, min_p, u, **kw):
    tok, lse = cpu.sample_tokens(
        jnp.asarray(logits, jnp.float32),
        jnp.asarray(temp, jnp.float32),
        jnp.asarray(top_k, jnp.int32),
        jnp.asarray(top_p, jnp.float32),
        jnp.asarray(min_p, jnp.float32),
        jnp.asarray(u, jnp.float32),
        **kw,
    )
    return np.asarray(tok), np.asarray(lse)


def _check_against_definition(logits, temp, top_k, top_p, min_p, u):
    """Asserts every unambiguous draw is the definition's token; returns how many."""
    tok, lse = _draws(logits, temp, top_k, top_p, min_p, u)
    assert tok.shape == u.shape and tok.dtype == np.int32
    np.testing.assert_allclose(lse, jax.nn.logsumexp(logits, axis=-1), rtol=2e-6, atol=2e-6)
    checked = 0
    for r in range(len(logits)):
        for j in range(u.shape[1]):
            ref, amb = test_sampling._reference(
                logits[r], temp[r], top_k[r], top_p[r], min_p[r], u[r, j]
            )
            if not amb:
                assert tok[r, j] == ref, (r, j, temp[r], top_k[r], top_p[r], min_p[r], u[r, j])
                checked += 1
    return checked


@needs_cc
@pytest.mark.parametrize("vocab", [1, 7, 50, 300, 5003])
def test_sample_tokens_are_the_full_sort_definition(vocab):
    # Random temperatures (greedy rows among them), top-k, top-p and min-p, ties at the
    # top, and 24 uniforms a row: each draw is the token the definition's f64 full sort
    # gives (draws within rounding of a boundary aside).
    rng = np.random.default_rng(vocab)
    R, J = 48, 24
    logits = rng.standard_normal((R, vocab)).astype(np.float32)
    logits *= rng.uniform(0.5, 6, (R, 1)).astype(np.float32)
    logits[:4, :3] = logits[:4, :1]  # ties at the top
    logits[4:8] = np.round(logits[4:8])  # many ties
    temp = np.where(rng.random(R) < 0.15, 0.0, rng.uniform(0.3, 2.0, R)).astype(np.float32)
    top_k = np.where(rng.random(R) < 0.5, rng.integers(1, vocab + 3, R), 0).astype(np.int32)
    top_p = np.where(rng.random(R) < 0.5, rng.uniform(0.05, 1.0, R), 1.0).astype(np.float32)
    min_p = np.where(rng.random(R) < 0.3, rng.uniform(0.0, 0.5, R), 0.0).astype(np.float32)
    u = rng.random((R, J)).astype(np.float32)
    assert _check_against_definition(logits, temp, top_k, top_p, min_p, u) >= 0.9 * R * J


@needs_cc
def test_rows_that_keep_thousands_of_tokens_are_exact(monkeypatch):
    # Flat rows keep most of a 20,000-token vocabulary: the kernel widens its gathered
    # set until it holds the kept prefix, and sorts thousands of tokens. Their tokens'
    # probabilities are ~1e-4, so the definition's margin for rounding is narrowed (the
    # kernel's weights are within an ulp, its sums in f64).
    monkeypatch.setattr(test_sampling, "EPS", 2e-6)
    rng = np.random.default_rng(7)
    R, V, J = 8, 20000, 16
    logits = rng.standard_normal((R, V)) * np.array([0.3, 1, 3, 0.3, 1, 3, 1, 2])[:, None]
    logits = logits.astype(np.float32)
    temp = np.array([1, 1, 1, 2, 0.5, 1, 1, 1], np.float32)
    top_k = np.array([0, 0, 0, 0, 0, 15000, 30000, 3000], np.int32)
    top_p = np.array([0.9, 0.99, 0.95, 0.5, 0.9, 1, 1, 0.97], np.float32)
    min_p = np.array([0, 0, 0, 0, 0.02, 0, 0, 0], np.float32)
    u = rng.random((R, J)).astype(np.float32)
    assert _check_against_definition(logits, temp, top_k, top_p, min_p, u) >= 0.7 * R * J


@needs_cc
def test_sample_tokens_at_the_edges():
    V = 40
    x = np.random.default_rng(3).standard_normal((9, V)).astype(np.float32)
    x[0, [7, 3]] = np.nan  # the first NaN, as argmax gives it
    x[1] = -np.inf  # nothing to weigh: index 0
    x[2, [5, 9]] = np.inf  # the first +inf
    x[3, 30] = 10.0  # x / 1e-38 overflows: the argmax
    x[4, :2] = [-0.0, 0.0]  # -0 and +0 tie: the lower index first
    x[4, 2:] = -5.0
    x[5, [4, 20]] = 9.0  # min_p = 1 keeps the two tied maxima only
    x[6] = -np.inf
    x[6, [11, 12]] = [1.0, 2.0]  # only two finite logits
    temp = np.array([1, 1, 1, 1e-38, 1, 1, 1, 0, 1], np.float32)
    top_k = np.array([0, 0, 5, 0, 1, 0, 0, 0, 0], np.int32)
    top_p = np.array([1, 0.5, 1, 1, 1, 1, 1, 1, 1], np.float32)
    min_p = np.array([0, 0, 0, 0, 0, 1, 0, 0, 0], np.float32)
    u = np.tile(np.array([0.0, 0.3, 0.6, 0.999], np.float32), (9, 1))
    tok, lse = _draws(x, temp, top_k, top_p, min_p, u)
    argmax = np.asarray(jnp.argmax(x, axis=-1))
    for r in (0, 1, 2, 3, 7):
        assert (tok[r] == argmax[r]).all(), r
    assert (tok[4] == 0).all()
    assert set(tok[5]) == {4, 20}
    assert set(tok[6]) == {11, 12}
    np.testing.assert_array_equal(lse[:3], np.asarray(jax.nn.logsumexp(x[:3], axis=-1)))
    # no columns, no rows
    assert _draws(x, temp, top_k, top_p, min_p, u[:, :0])[0].shape == (9, 0)
    assert _draws(x[:0], temp[:0], top_k[:0], top_p[:0], min_p[:0], u[:0])[0].shape == (0, 4)


@needs_cc
def test_sample_tokens_do_not_depend_on_the_batch_or_threads():
    rng = np.random.default_rng(4)
    R, V = 12, 30000
    x = (rng.standard_normal((R, V)) * rng.uniform(0.5, 8, (R, 1))).astype(np.float32)
    args = (
        x,
        np.tile(np.float32([0, 1, 0.7]), 4),
        np.tile(np.int32([0, 0, 40]), 4),
        np.repeat(np.float32([0.9, 1.0]), 6),
        np.zeros(R, np.float32),
        rng.random((R, 3)).astype(np.float32),
    )
    one = _draws(*args, threads=1)
    for threads in (2, 3):
        for a, b in zip(_draws(*args, threads=threads), one, strict=True):
            np.testing.assert_array_equal(a, b)
    part = _draws(*(a[3:8] for a in args))
    np.testing.assert_array_equal(part[0], one[0][3:8])
    np.testing.assert_array_equal(part[1], one[1][3:8])


@needs_cc
def test_a_rows_log_sum_exp_has_the_same_bits_in_both_kernels():
    # The log-probs of a request must not depend on whether its batch was greedy-only,
    # sampled or penalized (deterministic mode): both kernels sum a row the same way.
    rng = np.random.default_rng(6)
    R, V = 8, 5000
    x = (rng.standard_normal((R, V)) * 5).astype(np.float32)
    x[2, :300] = -np.inf  # a block of -inf
    _, greedy_lse = cpu.greedy_rows(jnp.asarray(x))
    for temp in (0.0, 1.0, 0.6):
        _, lse = _draws(
            x,
            np.full(R, temp),
            np.tile([0, 30], R // 2),
            np.repeat([1.0, 0.9], R // 2),
            np.zeros(R),
            rng.random((R, 2)),
        )
        np.testing.assert_array_equal(lse, np.asarray(greedy_lse))


@needs_cc
def test_sample_tokens_boundary_errors():
    x, r = jnp.zeros((2, 3)), jnp.zeros(2)
    k, u = jnp.zeros(2, jnp.int32), jnp.zeros((2, 1))
    with pytest.raises(ValueError, match=r"x: expected f32\[R, V\] with V >= 1, got float16"):
        cpu.sample_tokens(x.astype(jnp.float16), r, k, r, r, u)
    with pytest.raises(ValueError, match=r"top_k: expected int32\[2\], got float32\[2\]"):
        cpu.sample_tokens(x, r, r, r, r, u)
    with pytest.raises(ValueError, match=r"min_p: expected float32\[2\], got float32\[3\]"):
        cpu.sample_tokens(x, r, k, r, jnp.zeros(3), u)
    with pytest.raises(ValueError, match=r"u: expected f32\[2, J\], got float32\[2\]"):
        cpu.sample_tokens(x, r, k, r, r, r)
    with pytest.raises(ValueError, match="threads: expected a positive int"):
        cpu.sample_tokens(x, r, k, r, r, u, threads=-1)


@needs_cc
def test_the_sampler_with_the_kernels_gives_the_xla_paths_tokens():
    # Greedy, unrestricted and restricted rows, with and without penalties, through
    # sample_rows both ways: the same tokens, the same log-probs (of the raw logits), and
    # no sort in the kernel's program.
    rng = np.random.default_rng(5)
    R, V, J = 12, 3001, 2
    logits = jnp.asarray(rng.standard_normal((R, V)) * 4, jnp.float32)
    args = (
        logits,
        jnp.asarray(np.tile([0.0, 1.0, 0.8], 4), jnp.float32),
        jnp.asarray(np.tile([0, 0, 0, 20], 3), jnp.int32),
        jnp.asarray(np.repeat([1.0, 0.9], 6), jnp.float32),
        jnp.asarray(rng.integers(0, 2**31, (R, J)), jnp.uint32),
        jnp.arange(R, dtype=jnp.int32),
        jnp.asarray(np.tile([0.0, 0.0, 0.0, 0.0, 0.05, 0.0], 2), jnp.float32),
    )
    pen = Penalties(
        repetition=jnp.full(R, 1.3),
        presence=jnp.full(R, 0.5),
        frequency=jnp.full(R, 0.2),
        output_tokens=jnp.asarray(rng.integers(0, V, (R, 6)), jnp.int32),
        prompt_tokens=jnp.asarray(rng.integers(-1, V, (R, 9)), jnp.int32),
        bias_tokens=jnp.asarray(rng.integers(-1, V, (R, 4)), jnp.int32),
        bias_values=jnp.asarray(rng.uniform(-5, 5, (R, 4)), jnp.float32),
    )
    f = jax.jit(sample_rows, static_argnames=("greedy_only", "cpu_kernel"))
    for penalties in (None, pen):
        want = f(*args, penalties, cpu_kernel=False)
        got = f(*args, penalties, cpu_kernel=True)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)
    text = f.lower(*args, pen, cpu_kernel=True).as_text()
    assert "paged_jax_cpu_sample_rows" in text
    assert "stablehlo.sort" not in text and "topk" not in text.lower()
