"""The CPU kernel's products on a GGUF file's blocks kept as stored
(``models.gguf_blocks.Nibbles``): 4-bit values with 1 or 2 high bits in a plane beside
them (``paged_jax.kernels.cpu.pack_high``), float16 scales, an offset instead of
minimums, and float rows (each panel dequantized, the rows not quantized), against
``reference_quantized`` and against the f32 kernel on the dequantized weights, bit for
bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_cases import HAS_CC

from paged_jax.kernels import cpu
from paged_jax.models.quantization import dequantize_int4

needs_cc = pytest.mark.skipif(not HAS_CC, reason="no C compiler here: products stay on XLA")

# (high bits, group, minimums or an offset, scale dtype): Q4_1 / Q4_K, Q5_1 / Q5_K, Q6_K,
# Q5_0, Q4_0, and f32 scales where float16 cannot hold a file's
LAYOUTS = {
    "q4-mins-f16": (0, 32, None, np.float16),
    "q5-mins-f16": (1, 32, None, np.float16),
    "q6-offset-f16-g16": (2, 16, 32, np.float16),
    "q5-offset-f32": (1, 32, 16, np.float32),
    "q4-offset-f16": (0, 32, 8, np.float16),
}


def _kept(rng, layers, k, n, bits, group, offset, dtype):
    """Random kept blocks: ``(q u8 [(L,) K / 2, N], high or None, scales, mins or None)``,
    the scales small as a model's (weights below ~1)."""
    lead = () if layers is None else (layers,)
    q = rng.integers(0, 256, (*lead, k // 2, n), dtype=np.uint8)
    high = rng.integers(0, 256, (*lead, k * bits // 8, n), dtype=np.uint8) if bits else None
    scales = (rng.random((*lead, k // group, n)) * 0.05 + 1e-3).astype(dtype)
    mins = None if offset is not None else (rng.standard_normal(scales.shape) * 0.1).astype(dtype)
    return q, high, scales, mins


def _call(x, q, high, scales, mins, bits, offset, n, layer=None, rows=None, **kw):
    packed = cpu.pack_weight(jnp.asarray(q))
    extra = dict(
        scales=cpu.pack_weight(jnp.asarray(scales)),
        mins=None if mins is None else cpu.pack_weight(jnp.asarray(mins)),
        high=None if high is None else cpu.pack_high(jnp.asarray(high), bits),
        offset=offset or 0,
    )
    f = jax.jit(lambda x, p: cpu.linear(x, p, n, layer=layer, rows=rows, **extra, **kw))
    return np.asarray(f(jnp.asarray(x), packed))


@needs_cc
@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("layers, k, n, m", [(None, 64, 50, 5), (3, 256, 100, 9)])
def test_kept_blocks_multiply_as_defined(name, layers, k, n, m):
    # W8A8 (the rows quantized in the groups): reference_quantized's sums; float rows:
    # the f32 kernel's own sums on the dequantized weights, bit for bit
    bits, group, offset, dtype = LAYOUTS[name]
    rng = np.random.default_rng(3)
    x = rng.standard_normal((m, k)).astype(np.float32)
    q, high, scales, mins = _kept(rng, layers, k, n, bits, group, offset, dtype)
    for layer in range(layers or 1):
        pick = (lambda a: a) if layers is None else (lambda a, i=layer: None if a is None else a[i])
        at = None if layers is None else layer
        ref = cpu.reference_quantized(
            x, pick(q), pick(scales), pick(mins), high=pick(high), offset=offset or 0
        )
        got = _call(x, q, high, scales, mins, bits, offset, n, layer=at)
        np.testing.assert_allclose(got, ref, rtol=2e-6, atol=2e-6 * np.abs(ref).max())
        w = dequantize_int4(
            jnp.asarray(pick(q)),
            jnp.asarray(pick(scales)),
            None if mins is None else jnp.asarray(pick(mins)),
            0,
            None,
            None if high is None else jnp.asarray(pick(high)),
            offset or 0,
        )
        want = np.asarray(cpu.linear(jnp.asarray(x), cpu.pack_weight(w), n))
        floats = _call(x, q, high, scales, mins, bits, offset, n, layer=at, float_rows=True)
        np.testing.assert_array_equal(floats, want)


@needs_cc
def test_float_rows_compute_the_first_rows_and_zero_the_rest():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((70, 64)).astype(np.float32)  # more than a block of 64 rows
    q, high, scales, mins = _kept(rng, None, 64, 50, 2, 16, 32, np.float16)
    full = _call(x, q, high, scales, mins, 2, 32, 50, float_rows=True)
    part = _call(x, q, high, scales, mins, 2, 32, 50, rows=66, float_rows=True)
    np.testing.assert_array_equal(part[:66], full[:66])
    assert not part[66:].any()


@needs_cc
def test_float_rows_on_int8_groups_are_the_dequantized_product():
    # a GGUF file's Q8_0 blocks (int8, an f32 scale per group of 32) by default
    rng = np.random.default_rng(5)
    x = rng.standard_normal((9, 96)).astype(np.float32)
    q = rng.integers(-127, 128, (96, 40), dtype=np.int8)
    scales = (rng.random((3, 40)) * 0.01).astype(np.float32)
    w = q.astype(np.float32) * np.repeat(scales, 32, axis=0)
    want = np.asarray(cpu.linear(jnp.asarray(x), cpu.pack_weight(jnp.asarray(w)), 40))
    got = cpu.linear(
        jnp.asarray(x),
        cpu.pack_weight(jnp.asarray(q)),
        40,
        scales=cpu.pack_weight(jnp.asarray(scales)),
        float_rows=True,
    )
    np.testing.assert_array_equal(np.asarray(got), want)


@needs_cc
@pytest.mark.parametrize("bits, k", [(1, 64), (2, 32), (2, 48)])
def test_high_bits_pack_and_unpack_exactly(bits, k):
    rng = np.random.default_rng(6)
    high = rng.integers(0, 256, (2, k * bits // 8, 53), dtype=np.uint8)
    packed = cpu.pack_high(jnp.asarray(high), bits)
    nr = cpu.panel_width()
    assert packed.shape == (2, -(-53 // nr), k * bits // 8, nr)
    np.testing.assert_array_equal(np.asarray(cpu.unpack_high(packed, 53, bits)), high)


@needs_cc
def test_kept_blocks_boundary_errors():
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((2, 64)).astype(np.float32))
    q, high, scales, mins = _kept(rng, None, 64, 20, 1, 32, None, np.float16)
    packed = cpu.pack_weight(jnp.asarray(q))
    ps, pm = cpu.pack_weight(jnp.asarray(scales)), cpu.pack_weight(jnp.asarray(mins))
    with pytest.raises(ValueError, match="offset: weights with mins take none"):
        cpu.linear(x, packed, 20, scales=ps, mins=pm, offset=8)
    with pytest.raises(ValueError, match="offset: expected an int >= 0, got -1"):
        cpu.linear(x, packed, 20, scales=ps, offset=-1)
    with pytest.raises(ValueError, match=r"high: expected uint8\[1, K hb / 8, "):
        cpu.linear(
            x, packed, 20, scales=ps, mins=pm, high=cpu.pack_high(jnp.asarray(high), 1)[:, :1]
        )
    with pytest.raises(ValueError, match=r"mins: expected float32 or float16"):
        cpu.linear(x, packed, 20, scales=ps, mins=pm.astype(jnp.float32))
    with pytest.raises(ValueError, match="float_rows: needs 4-bit weights or int8 ones"):
        f32 = cpu.pack_weight(jnp.asarray(rng.standard_normal((64, 20)).astype(np.float32)))
        cpu.linear(x, f32, 20, float_rows=True)
    with pytest.raises(ValueError, match="high, offset: only uint8"):
        int8 = cpu.pack_weight(jnp.asarray(rng.integers(-9, 9, (64, 20), dtype=np.int8)))
        cpu.linear(x, int8, 20, scales=cpu.pack_scales(jnp.ones(20)), offset=4)
    with pytest.raises(ValueError, match="bits: expected 1 or 2, got 3"):
        cpu.pack_high(jnp.asarray(high), 3)


@needs_cc
@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("float_rows", [False, True], ids=["w8a8", "float-rows"])
def test_grouped_kept_rows_are_each_group_s_plain_product(name, float_rows):
    # A mixture's experts kept as stored (grouped_linear): each expert's rows as linear
    # computes them alone by that expert's blocks, bit for bit; the rows past the groups 0
    bits, group, offset, dtype = LAYOUTS[name]
    rng = np.random.default_rng(8)
    w, k, n = 4, 64, 50
    q, high, scales, mins = _kept(rng, w, k, n, bits, group, offset, dtype)
    pq, ps = cpu.pack_weight(jnp.asarray(q)), cpu.pack_weight(jnp.asarray(scales))
    pm = None if mins is None else cpu.pack_weight(jnp.asarray(mins))
    ph = None if high is None else cpu.pack_high(jnp.asarray(high), bits)
    sizes = np.array([3, 0, 5, 2], np.int32)
    x = rng.standard_normal((12, k)).astype(np.float32)
    kw = dict(scales=ps, mins=pm, high=ph, offset=offset or 0, float_rows=float_rows)
    y = np.asarray(cpu.grouped_linear(jnp.asarray(x), pq, n, jnp.asarray(sizes), 0, **kw))
    row = 0
    for e, size in enumerate(sizes):
        one = dict(
            scales=ps[e],
            mins=None if pm is None else pm[e],
            high=None if ph is None else ph[e],
            offset=offset or 0,
            float_rows=float_rows,
        )
        want = np.asarray(cpu.linear(jnp.asarray(x[row : row + size]), pq[e], n, **one))
        np.testing.assert_array_equal(y[row : row + size], want)
        row += size
    assert not y[row:].any()


@needs_cc
def test_grouped_int8_float_rows_are_each_group_s_dequantized_product():
    # A mixture's Q8_0 experts kept (int8, an f32 scale per group of 32), float rows:
    # each expert's rows the f32 kernel's sums on its dequantized weight
    rng = np.random.default_rng(9)
    w, k, n = 3, 64, 40
    q = rng.integers(-127, 128, (w, k, n), dtype=np.int8)
    scales = (rng.random((w, k // 32, n)) * 0.01).astype(np.float32)
    sizes = np.array([2, 4, 0], np.int32)
    x = rng.standard_normal((7, k)).astype(np.float32)
    ps = cpu.pack_weight(jnp.asarray(scales))
    y = cpu.grouped_linear(
        jnp.asarray(x), cpu.pack_weight(jnp.asarray(q)), n, jnp.asarray(sizes), 0,
        scales=ps, float_rows=True,
    )  # fmt: skip
    y, row = np.asarray(y), 0
    for e, size in enumerate(sizes):
        dense = q[e].astype(np.float32) * np.repeat(scales[e], 32, axis=0)
        want = cpu.linear(jnp.asarray(x[row : row + size]), cpu.pack_weight(jnp.asarray(dense)), n)
        np.testing.assert_array_equal(y[row : row + size], np.asarray(want))
        row += size
    assert not y[row:].any()
