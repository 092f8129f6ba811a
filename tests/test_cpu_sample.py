"""The greedy sampler's C kernel (``paged_jax.kernels.cpu.greedy_rows``) against
``jnp.argmax`` and ``jax.nn.logsumexp``, and the sampler using it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_cases import HAS_CC

from paged_jax.engine.sampling import sample_rows
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
