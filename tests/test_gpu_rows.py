"""The GPU's fp8 rows kernel (``pallas_kernels.gpu.rows``) against ``quantize_rows``,
interpreted on CPU (compiled where the tests run on a GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax._quant import quantize_rows
from paged_jax.kernels.gpu.rows import fp8_rows

INTERPRET = jax.default_backend() != "gpu"
F8 = jnp.float8_e4m3fn


def _f32(a):
    return np.asarray(a.astype(jnp.float32))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_rows_equal_quantize_rows(dtype):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(6, 300)).astype(np.float32) * rng.uniform(0.01, 50, size=(6, 1))
    x[2] = 0.0  # an all-zero row: scale 1
    x = jnp.asarray(x, dtype)
    q, scale = fp8_rows(x, interpret=INTERPRET)
    want_q, want_scale = quantize_rows(x, F8)
    assert q.dtype == F8 and q.shape == x.shape and scale.shape == (6,)
    np.testing.assert_array_equal(np.asarray(scale), np.asarray(want_scale))
    assert float(scale[2]) == 1.0
    if INTERPRET:
        np.testing.assert_array_equal(_f32(q), _f32(want_q))
    else:  # one fp8 step (1/8 of a value) where a conversion rounds another way
        np.testing.assert_allclose(_f32(q), _f32(want_q), rtol=0.13, atol=2**-6)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_rows_of_an_activation_times_up(act):
    rng = np.random.default_rng(4)
    both = jnp.asarray(rng.normal(size=(5, 2 * 96)).astype(np.float32) * 2, jnp.bfloat16)
    q, scale = fp8_rows(both, act=act, interpret=INTERPRET)
    gate, up = both[:, :96].astype(jnp.float32), both[:, 96:].astype(jnp.float32)
    a = gate * jax.nn.sigmoid(gate) if act == "silu" else jax.nn.gelu(gate, approximate=True)
    ref = (a * up).astype(jnp.bfloat16)  # in f32, rounded once to the input's dtype
    want_q, want_scale = quantize_rows(ref, F8)
    assert q.shape == (5, 96)
    np.testing.assert_allclose(np.asarray(scale), np.asarray(want_scale), rtol=1e-2)
    got = _f32(q) * np.asarray(scale)[:, None]
    want = _f32(want_q) * np.asarray(want_scale)[:, None]
    np.testing.assert_allclose(got, want, rtol=0.13, atol=0.13 * np.abs(want).max() / 16)


@pytest.mark.parametrize("unit_offset", [False, True])
def test_rows_of_an_rms_norm_s_output(unit_offset):
    # models.layers.RMSNorm (Gemma's 1 + weight with unit_offset) then quantize_rows
    from paged_jax.models.layers import RMSNorm

    rng = np.random.default_rng(6)
    h = jnp.asarray(rng.normal(size=(4, 256)).astype(np.float32) * 3, jnp.bfloat16)
    norm = RMSNorm(256, 1e-5, dtype=jnp.bfloat16, param_dtype=jnp.float32, unit_offset=unit_offset)
    norm.weight.set_value(jnp.asarray(rng.uniform(0.5, 1.5, size=256).astype(np.float32)))
    q, scale = fp8_rows(
        h, norm_weight=norm.weight[...], eps=1e-5, unit_offset=unit_offset,
        dtype=jnp.bfloat16, interpret=INTERPRET,
    )  # fmt: skip
    want_q, want_scale = quantize_rows(norm(h), F8)
    np.testing.assert_allclose(np.asarray(scale), np.asarray(want_scale), rtol=1e-2)
    got = _f32(q) * np.asarray(scale)[:, None]
    want = _f32(want_q) * np.asarray(want_scale)[:, None]
    np.testing.assert_allclose(got, want, rtol=0.13, atol=0.13 * np.abs(want).max() / 16)


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="norm_weight"):
        fp8_rows(jnp.zeros((2, 8)), norm_weight=jnp.ones(4), dtype=jnp.bfloat16, interpret=True)
    with pytest.raises(ValueError, match="norm_weight"):
        fp8_rows(jnp.zeros((2, 8)), norm_weight=jnp.ones(8), interpret=True)
    with pytest.raises(ValueError, match="act"):
        fp8_rows(jnp.zeros((2, 8)), act="relu", interpret=True)
    with pytest.raises(ValueError, match="x"):
        fp8_rows(jnp.zeros((2, 7)), act="silu", interpret=True)
    with pytest.raises(ValueError, match="x"):
        fp8_rows(jnp.zeros((8,)), interpret=True)
