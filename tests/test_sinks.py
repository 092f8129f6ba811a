"""Attention sinks (GPT-OSS): each query head's sink is a logit in the softmax's sum whose
value is 0. Checked on the XLA path, the CPU kernels and the GPU kernels (interpreted)
against an f64 oracle of this file's own (the dense softmax with one more column), decode
(one split and several) and ragged, with windows, bf16, and with sinks far below and far
above the scores."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_cases import HAS_CC, make_case

import paged_jax as pj

BACKENDS = [
    "xla",
    pytest.param("cpu", marks=pytest.mark.skipif(not HAS_CC, reason="no C compiler")),
    "pallas_gpu",  # interpreted
]


def oracle(case, seqs, sinks, *, sm_scale, window=None):
    """f64 ``[T, H, D]``: each token's softmax over its keys and its head's sink."""
    q = np.asarray(jnp.asarray(case.q).astype(jnp.float32), np.float64)
    out = np.zeros(q.shape)
    start = 0
    for (q_len, kv_len), k, v in zip(seqs, case.k_seqs, case.v_seqs, strict=True):
        group = q.shape[1] // k.shape[1]
        k_h, v_h = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        for i in range(q_len):
            pos = kv_len - q_len + i
            keys = np.arange(pos + 1)
            if window is not None:
                keys = keys[pos - keys < window]
            s = np.einsum("hd,chd->hc", q[start + i], k_h[keys]) * sm_scale
            s = np.concatenate([s, np.asarray(sinks, np.float64)[:, None]], axis=1)
            p = np.exp(s - s.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            out[start + i] = np.einsum("hc,chd->hd", p[:, :-1], v_h[keys])
        start += q_len
    return out


def run(case, sinks, backend, *, decode, **kw):
    kw.setdefault("interpret", backend.startswith("pallas"))
    if decode:
        return pj.paged_attention(
            case.q[: case.kv_lens.shape[0]],
            case.kv_pages,
            case.kv_lens,
            case.page_indices,
            sinks=sinks,
            backend=backend,
            **kw,
        )
    return pj.ragged_paged_attention(*case.args, sinks=sinks, backend=backend, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
def test_ragged_steps_with_sinks_match_the_oracle(backend, dtype, window):
    seqs = [(7, 19), (1, 33), (3, 3), (1, 1), (12, 40)]
    case = make_case(3, seqs, num_q_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype)
    sinks = jnp.asarray(np.random.default_rng(0).normal(0, 2, 8), jnp.float32)
    out = run(case, sinks, backend, decode=False, sm_scale=64**-0.5, sliding_window=window)
    T = sum(q for q, _ in seqs)
    want = oracle(case, seqs, sinks, sm_scale=64**-0.5, window=window)
    tol = 2e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(out[:T], np.float64), want[:T], atol=tol, rtol=tol)
    assert not np.asarray(out[T:]).any(), "padding rows must be 0"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", [64, 24])  # 24: the CPU kernel's row-at-a-time path
def test_decode_rows_with_sinks_match_the_oracle(backend, head_dim):
    seqs = [(1, 1), (1, 9), (1, 70), (1, 16)]
    case = make_case(5, seqs, num_q_heads=6, num_kv_heads=2, head_dim=head_dim, pad_seqs=0)
    sinks = jnp.asarray([-3.0, 0.0, 1.5, 4.0, -0.5, 2.0], jnp.float32)
    scale = head_dim**-0.5
    out = run(case, sinks, backend, decode=True, sm_scale=scale)
    want = oracle(case, seqs, sinks, sm_scale=scale)
    np.testing.assert_allclose(np.asarray(out, np.float64), want[: len(seqs)], atol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sinks_far_below_change_nothing_and_far_above_take_everything(backend):
    seqs = [(4, 11), (1, 20)]
    case = make_case(7, seqs, num_q_heads=4, num_kv_heads=2, head_dim=32)
    T = 5
    plain = run(case, None, backend, decode=False, sm_scale=0.2)[:T]
    low = run(case, jnp.full((4,), -1e4, jnp.float32), backend, decode=False, sm_scale=0.2)
    np.testing.assert_allclose(np.asarray(low[:T]), np.asarray(plain), atol=1e-6)
    high = run(case, jnp.full((4,), 80.0, jnp.float32), backend, decode=False, sm_scale=0.2)
    assert np.abs(np.asarray(high[:T])).max() < 1e-20, "a dominant sink leaves ~0 of every value"


def test_the_xla_path_and_the_cpu_kernel_agree_under_jit():
    if not HAS_CC:
        pytest.skip("no C compiler")
    seqs = [(9, 30), (1, 5)]
    case = make_case(11, seqs, num_q_heads=4, num_kv_heads=4, head_dim=32)
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)
    f = jax.jit(lambda s, b: run(case, s, b, decode=False, sm_scale=0.3), static_argnums=1)
    np.testing.assert_allclose(np.asarray(f(sinks, "cpu")), np.asarray(f(sinks, "xla")), atol=2e-6)


def test_bad_sinks_are_named():
    case = make_case(1, [(2, 4)], num_q_heads=4, num_kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match=r"sinks: expected shape \(4,\)"):
        pj.ragged_paged_attention(*case.args, sinks=jnp.zeros(3), backend="xla")
    with pytest.raises(TypeError, match="sinks: expected a float array"):
        pj.ragged_paged_attention(*case.args, sinks=[0.0] * 4, backend="xla")
    with pytest.raises(TypeError, match="sinks"):
        pj.ragged_paged_attention(*case.args, sinks=jnp.zeros(4, jnp.int32), backend="xla")


@pytest.mark.parametrize("splits", [1, 3])
def test_the_gpu_decode_kernel_takes_sinks_with_one_split_and_several(splits):
    """One split: the sinks start each program's softmax; several: they join the merge."""
    from paged_jax.kernels.gpu import decode

    seqs = [(1, 40), (1, 7), (1, 65)]
    case = make_case(2, seqs, num_q_heads=6, num_kv_heads=2, head_dim=32, pad_seqs=0)
    sinks = jnp.asarray([1.0, -2.0, 0.5, 3.0, -0.5, 0.0], jnp.float32)
    out = decode.decode_paged_attention(
        case.q[:3], case.kv_pages, case.kv_lens, case.page_indices, sm_scale=32**-0.5,
        sinks=sinks, num_splits=splits, pages_per_block=2, interpret=True,
    )  # fmt: skip
    want = oracle(case, seqs, sinks, sm_scale=32**-0.5)
    np.testing.assert_allclose(np.asarray(out, np.float64), want[:3], atol=2e-5)


@pytest.mark.parametrize("decode", [True, False])
def test_the_tpu_kernels_take_sinks(decode):
    """TPU interpret mode (D 128, as the kernels' layout wants): decode and ragged rows,
    a sliding window on the ragged ones."""
    seqs = [(1, 30), (1, 9)] if decode else [(5, 21), (1, 12), (3, 3)]
    case = make_case(4, seqs, num_q_heads=4, num_kv_heads=2, head_dim=128, pad_seqs=0)
    sinks = jnp.asarray([0.7, -1.5, 2.5, 0.0], jnp.float32)
    window = None if decode else 6
    out = run(case, sinks, "pallas_tpu", decode=decode, sm_scale=0.1, sliding_window=window)
    want = oracle(case, seqs, sinks, sm_scale=0.1, window=window)
    T = sum(q for q, _ in seqs)
    np.testing.assert_allclose(np.asarray(out[:T], np.float64), want[:T], atol=2e-5)
