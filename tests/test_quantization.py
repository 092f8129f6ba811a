"""int8 weights (issue 52, a first format): the quantization's error bound, the CPU
kernel's int8 product against the definition, and a quantized model (every way the
engine holds its weights) against a float model holding the dequantized weights."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_helpers import paged_prompt_logits
from paged_cases import grid_case

import paged_jax as pj
from paged_jax import linear, models
from paged_jax.kernels import cpu
from paged_jax.models.layers import KERNELS, Embed, Linear, fuse_linears
from paged_jax.models.quantization import (
    FP8,
    dequantize_int4,
    int8_group,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)


def _interpret_kernel(monkeypatch, product: str) -> None:
    """``KERNELS[product]`` on for the CPU too (its kernel interpreted), for this test."""
    monkeypatch.setitem(
        KERNELS, product, dataclasses.replace(KERNELS[product], platforms=("gpu", "cpu"))
    )


def test_int8_error_is_within_half_a_scale():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3, 64, 40)).astype(np.float32) * rng.uniform(0.01, 3, size=40)
    w[:, :, 7] = 0.0  # a column of zeros: scale 1, q 0
    q, scale = quantize_int8(w, axis=-2)
    assert q.dtype == np.int8 and scale.shape == (3, 40) and np.abs(q).max() <= 127
    err = np.abs(q * scale[:, None, :] - w)
    assert np.all(err <= scale[:, None, :] / 2 * (1 + 1e-6))
    assert np.all(scale[:, 7] == 1.0) and not q[:, :, 7].any()
    assert np.all(np.abs(q).max(axis=-2)[:, np.arange(40) != 7] == 127)


def test_int8_groups_scale_each_group_of_inputs_on_its_own():
    rng = np.random.default_rng(2)
    w = rng.normal(size=(3, 64, 40)).astype(np.float32)
    w[1, 5, :] = 50.0  # an outlier input row: its group's step grows, not the channel's
    w[:, 32:, 7] = 0.0  # a group of zeros: scale 1, q 0
    q, scale = quantize_int8(w, -2, 32)
    assert q.dtype == np.int8 and scale.shape == (3, 2, 40)
    per_input = np.repeat(scale, 32, axis=-2)
    assert np.all(np.abs(q * per_input - w) <= per_input / 2 * (1 + 1e-6))
    assert np.all(scale[:, 1, 7] == 1.0) and not q[:, 32:, 7].any()
    np.testing.assert_allclose(scale[1, 0], 50.0 / 127)
    assert np.all(np.delete(scale[1, 1], 7) < 5.0 / 127)  # the other group: a fine step
    _, whole = quantize_int8(w, axis=-2)
    assert np.all(whole[1] >= 50.0 / 127)  # (per channel the outlier sets every step)
    # an embedding table's groups run along E, its last axis
    qt, st = quantize_int8(w[0].T, -1, 32)
    np.testing.assert_array_equal(qt, q[0].T)
    np.testing.assert_array_equal(st, scale[0].T)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int8(w[:, :48], -2, 32)


def test_int8_is_grouped_where_the_cpu_computes_it(monkeypatch):
    w = np.zeros((2, 96, 8), np.float32)
    assert int8_group(w, -2) == 32  # numpy, JAX's default backend the CPU
    assert int8_group(jnp.asarray(w), -2) == 32  # a CPU array
    assert int8_group(w[:, :48], -2) is None  # 32 does not divide 48: per channel
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert int8_group(w, -2) is None  # for a GPU: per channel, scaled after the dot


def test_fp8_error_is_within_e4m3s_rounding():
    # e4m3 keeps 3 mantissa bits: each value within 2**-4 of itself (relative) from the
    # smallest normal 2**-6 up, within half a subnormal step 2**-9 / 2 below it (in units
    # of the channel's scale); the largest magnitude maps to 448 exactly.
    rng = np.random.default_rng(5)
    w = rng.normal(size=(3, 64, 40)).astype(np.float32) * rng.uniform(0.01, 3, size=40)
    w[:, :, 7] = 0.0
    w[0, 3, 9] = 1e-6  # far below the smallest subnormal of its channel: flushes to 0
    q, scale = quantize_fp8(w, axis=-2)
    assert q.dtype == FP8 and scale.shape == (3, 40)
    v = q.astype(np.float32)
    assert np.abs(v).max() <= 448 and np.all(np.abs(v).max(axis=-2)[:, np.arange(40) != 7] == 448)
    x = w / scale[:, None, :]  # the values rounded, in units of the scale
    bound = np.maximum(np.abs(x) * 2.0**-4, 2.0**-10) * (1 + 1e-6)
    assert np.all(np.abs(v - x) <= bound)
    assert np.all(scale[:, 7] == 1.0) and not v[:, :, 7].any() and v[0, 3, 9] == 0.0


@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4"])
def test_quantizing_on_a_device_gives_the_hosts_values(fmt, monkeypatch):
    # An accelerator's weights are quantized where they lie, in jax.numpy (the same code
    # as the host's numpy way): the same formats, the same values but for the last bit of
    # a scale, hence at most a step where a value sits on a rounding boundary.
    import jax
    import jax.numpy as jnp

    from paged_jax.models import quantization as quant

    rng = np.random.default_rng(11)
    w = rng.normal(size=(2, 64, 40)).astype(np.float32) * rng.uniform(0.01, 3, size=40)
    w[:, :, 5] = 0.0
    fn = {"int8": quantize_int8, "fp8": quantize_fp8, "int4": quantize_int4}[fmt]
    # where an array lies picks the way: a host array stays numpy, quantized in numpy
    assert not quant._on_accelerator(w) and not quant._on_accelerator(jnp.asarray(w))
    host = fn(w, -2)
    assert isinstance(host[0], np.ndarray)
    monkeypatch.setattr(quant, "_on_accelerator", lambda w: True)  # as a GPU's array
    dev = fn(jnp.asarray(w), -2)
    assert len(host) == len(dev)
    for h, d in zip(host, dev, strict=True):
        assert isinstance(d, jax.Array) and h.dtype == d.dtype and h.shape == d.shape
    for h, d in zip(host[1:], dev[1:], strict=True):  # scales (and 4-bit minimums)
        np.testing.assert_allclose(np.asarray(d), h, rtol=2e-7, atol=0)
    if fmt == "int4":  # the codes, both nibbles of each byte
        ch = np.stack([host[0] & 15, host[0] >> 4]).astype(np.float32)
        cd = np.asarray(dev[0])
        cd = np.stack([cd & 15, cd >> 4]).astype(np.float32)
    else:
        ch, cd = host[0].astype(np.float32), np.asarray(dev[0]).astype(np.float32)
    step = np.abs(ch) / 8 + 2.0**-9 if fmt == "fp8" else 1.0  # one step of the format
    off = cd != ch
    assert off.mean() < 0.01  # nearly all equal
    assert np.all(np.abs(cd - ch) <= step)


def test_rows_are_quantized_in_blocks_as_defined():
    # The definition's parts by hand: a block's scale is its largest magnitude / 127, its
    # values round half to even, a zero block stays zero, the last block is the rest of K.
    x = np.zeros((2, 40), np.float32)
    x[0, :32] = np.linspace(-1, 1, 32)
    x[0, 5] = -2.54  # the block's largest: -127
    x[0, 32:] = 0.5  # the last block: 8 inputs, all the largest
    x[1, 32:36] = [1.0, 0.5 / 127, 1.5 / 127, -2.5 / 127]
    xq, dx = cpu.quantize_blocks(x, 32)
    assert dx.shape == (2, 2) and np.allclose(dx[0], [2.54 / 127, 0.5 / 127])
    assert xq[0, 5] == -127 and np.all(xq[0, 32:] == 127)
    assert dx[1, 0] == 0 and np.all(xq[1, :32] == 0)  # a zero block
    assert list(xq[1, 32:36]) == [127, 0, 2, -2]  # ties to even
    assert np.all(np.abs(xq[0, :32] * dx[0, 0] - x[0, :32]) <= dx[0, 0] / 2 + 1e-7)


@pytest.mark.skipif(not linear.available(), reason="the CPU kernels did not build here")
@pytest.mark.parametrize("layers, n, rows", [(None, 100, None), (3, 48, 5), (2, 7, 0)])
def test_the_cpu_kernel_multiplies_by_int8_weights_as_defined(layers, n, rows):
    # K = 100: three blocks of 32 and one of 4.
    rng = np.random.default_rng(1)
    lead = () if layers is None else (layers,)
    w = rng.normal(size=(*lead, 100, n)).astype(np.float32)
    q, scale = quantize_int8(w, axis=-2)
    x = rng.normal(size=(2, 9, 100)).astype(np.float32)
    x[0, 0, 32:64] = 0  # a zero block
    layer = None if layers is None else layers - 1
    got = linear.matmul(
        jnp.asarray(x),
        linear.pack(jnp.asarray(q)),
        n,
        layer=layer,
        rows=rows,
        scales=linear.pack_scales(jnp.asarray(scale)),
    )
    pick = (lambda a: a) if layers is None else (lambda a: a[layer])
    want = cpu.reference_quantized(x.reshape(18, 100), pick(q), pick(scale))
    if rows is not None:
        want[rows:] = 0.0
    np.testing.assert_allclose(np.asarray(got).reshape(18, n), want, atol=2e-5, rtol=1e-5)
    # and within the rows' quantization of the float product (W8A16)
    deq = q.astype(np.float64) * scale[..., None, :]
    exact = x.reshape(18, 100).astype(np.float64) @ pick(deq)
    if rows is not None:
        exact[rows:] = 0.0
    assert np.abs(np.asarray(got).reshape(18, n) - exact).max() <= 0.02 * np.abs(exact).max()
    with pytest.raises(ValueError, match="int8 weights need their scales"):
        linear.matmul(jnp.asarray(x), linear.pack(jnp.asarray(q)), n, layer=layer)
    with pytest.raises(ValueError, match="int8 weights need K a multiple of 4"):
        linear.pack(jnp.asarray(q[..., :98, :]))


@pytest.mark.skipif(not linear.available(), reason="the CPU kernels did not build here")
@pytest.mark.parametrize("layers, n, group", [(None, 100, 32), (3, 48, 16), (2, 7, 96)])
@pytest.mark.parametrize("with_mins", [False, True], ids=["scales", "scales-mins"])
def test_the_cpu_kernel_multiplies_by_int8_groups_as_defined(layers, n, group, with_mins):
    # A scale per column and group of rows (GGUF's Q8_0 blocks): the rows' blocks follow.
    # With a minimum per group too (GGUF's Q5_1 / Q5_K: q in [0, 31], weights d q + m).
    rng = np.random.default_rng(7)
    lead = () if layers is None else (layers,)
    w = rng.normal(size=(*lead, 96, n)).astype(np.float32) + (1.5 if with_mins else 0.0)
    g = w.reshape(*lead, 96 // group, group, n)
    if with_mins:
        lo = g.min(axis=-2)
        scale = ((g.max(axis=-2) - lo) / 31).astype(np.float32)
        q = np.rint((g - lo[..., None, :]) / scale[..., None, :]).astype(np.int8).reshape(w.shape)
        mins = lo.astype(np.float32)
    else:
        scale = (np.abs(g).max(axis=-2) / 127).astype(np.float32)  # [(L,) K / G, n]
        q = np.rint(g / scale[..., None, :]).astype(np.int8).reshape(w.shape)
        mins = None
    x = rng.normal(size=(9, 96)).astype(np.float32)
    layer = None if layers is None else layers - 1
    pk, ps = linear.pack(jnp.asarray(q)), linear.pack(jnp.asarray(scale))
    pm = None if mins is None else linear.pack(jnp.asarray(mins))
    got = np.asarray(linear.matmul(jnp.asarray(x), pk, n, layer=layer, scales=ps, mins=pm))
    pick = (lambda a: a) if layers is None else (lambda a: a[layer])
    want = cpu.reference_quantized(x, pick(q), pick(scale), None if mins is None else pick(mins))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    deq = q.reshape(g.shape) * scale[..., None, :]
    if with_mins:
        deq = deq + mins[..., None, :]
    exact = x.astype(np.float64) @ pick(deq.reshape(w.shape))
    assert np.abs(got - exact).max() <= 0.02 * np.abs(exact).max()
    if with_mins:  # the minimums count: without them the product is far off
        bare = np.asarray(linear.matmul(jnp.asarray(x), pk, n, layer=layer, scales=ps))
        assert np.abs(bare - exact).max() > 0.1 * np.abs(exact).max()
        with pytest.raises(ValueError, match="mins: expected float32"):
            twice = jnp.concatenate([pm, pm], axis=-2)  # not the scales' groups
            linear.matmul(jnp.asarray(x), pk, n, layer=layer, scales=ps, mins=twice)
    with pytest.raises(ValueError, match="G a multiple of 4"):
        six = linear.pack(jnp.zeros((*lead, 16, n), jnp.float32))  # groups of 6 rows
        linear.matmul(
            jnp.asarray(x), pk, n, layer=layer, scales=six, mins=None if pm is None else six
        )


def test_rotating_blocks_is_its_own_inverse_and_keeps_products():
    # The orthonormal Hadamard rotation of each block of 32: numpy and jnp give the same
    # bits, twice is the identity (to f32 rounding), and it moves from rows to weights.
    rng = np.random.default_rng(11)
    x = rng.normal(size=(5, 96)).astype(np.float32)
    w = rng.normal(size=(96, 7)).astype(np.float32)
    r = cpu.rotate_blocks(x)
    assert r.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(cpu.rotate_blocks(jnp.asarray(x), xp=jnp)), r)
    np.testing.assert_allclose(cpu.rotate_blocks(r), x, atol=1e-6)
    np.testing.assert_allclose(r @ cpu.rotate_blocks(w, axis=0), x @ w, atol=1e-4)
    one = np.zeros((1, 32), np.float32)
    one[0, 5] = 1.0  # a lone input spreads over the block: +-1/sqrt(32) each
    np.testing.assert_allclose(np.abs(cpu.rotate_blocks(one)), 32**-0.5, rtol=1e-6)
    with pytest.raises(ValueError, match="a multiple of 32"):
        cpu.rotate_blocks(x[:, :40])


@pytest.mark.skipif(not linear.available(), reason="the CPU kernels did not build here")
@pytest.mark.parametrize("kind", ["int8", "int8-groups", "int8-groups-mins", "int4"])
def test_the_cpu_kernel_rotates_rows_for_rotated_weights(kind):
    # Rotated weights R w: the kernel rotates each row before quantizing it, as the
    # definition does (reference_quantized(rotated=True): the same rows to the bit), and
    # the product stays x @ w. With an outlier input the rotated int8 product is closer
    # to the float one than the plain (the outlier no longer sets its block's step alone).
    rng = np.random.default_rng(12)
    k, n = 96, 40
    w = rng.normal(size=(2, k, n)).astype(np.float32)
    x = rng.normal(size=(6, k)).astype(np.float32)
    x[:, 3] *= 60.0  # one outlier channel, as LLM activations have
    exact = x.astype(np.float64) @ w[1].astype(np.float64)

    def product(weights, rotated):
        mins = None
        if kind == "int4":
            q, scale, mins = quantize_int4(weights, axis=-2)
            kw = dict(scales=linear.pack(jnp.asarray(scale)), mins=linear.pack(jnp.asarray(mins)))
        elif kind == "int8":
            q, scale = quantize_int8(weights, axis=-2)
            kw = dict(scales=linear.pack_scales(jnp.asarray(scale)))
        else:
            q, scale = quantize_int8(weights, -2, 32)
            if kind.endswith("mins"):  # GGUF's Q5_1 layout: weights d q + m (m all 0 here)
                mins = np.zeros_like(scale)
                kw = dict(
                    scales=linear.pack(jnp.asarray(scale)), mins=linear.pack(jnp.asarray(mins))
                )
            else:
                kw = dict(scales=linear.pack(jnp.asarray(scale)))
        got = linear.matmul(
            jnp.asarray(x), linear.pack(jnp.asarray(q)), n, layer=1, rotated=rotated, **kw
        )
        want = cpu.reference_quantized(
            x, q[1], scale[1], None if mins is None else mins[1], rotated=rotated
        )
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=1e-5)
        return np.abs(np.asarray(got) - exact).max()

    plain = product(w, False)
    rotated = product(np.asarray(cpu.rotate_blocks(w, axis=-2)), True)
    if kind != "int4":  # (4-bit weights' own rounding dominates; they are not rotated)
        assert rotated < 0.6 * plain, (rotated, plain)
        assert rotated <= 0.01 * np.abs(exact).max()


@pytest.mark.skipif(not linear.available(), reason="the CPU kernels did not build here")
def test_rotated_rows_need_quantized_weights_and_blocks_of_32():
    x = jnp.ones((2, 64), jnp.float32)
    with pytest.raises(ValueError, match="rotated: needs int8 or 4-bit weights"):
        linear.matmul(x, linear.pack(jnp.ones((64, 8), jnp.float32)), 8, rotated=True)
    q, scale = quantize_int8(np.ones((48, 8), np.float32), axis=-2)
    with pytest.raises(ValueError, match="K a multiple of 32, got int8 weights and K 48"):
        linear.matmul(
            x[:, :48],
            linear.pack(jnp.asarray(q)),
            8,
            scales=linear.pack_scales(jnp.asarray(scale)),
            rotated=True,
        )


def test_int8_for_the_cpu_is_rotated_and_keeps_its_float_product(monkeypatch):
    # Linear.quantize("int8") on the CPU: R w in groups of 32 (rotated); weight() gives
    # the float weights back within the rounding, and XLA's product (which rotates the
    # rows) equals x @ weight(). An accelerator's per-channel int8 is not rotated; a
    # rotated module does not fuse with one that is not.
    from paged_jax.models import quantization as quant

    rng = np.random.default_rng(13)
    w = rng.normal(size=(64, 24)).astype(np.float32)

    def module(seed=0):
        lin = Linear(64, 24, use_bias=False, rngs=nnx.Rngs(seed))
        lin.kernel.set_value(jnp.asarray(w))
        return lin

    lin = module().quantize("int8")
    assert lin.rotated and lin.scale.get_value().shape == (2, 24)
    back = np.asarray(lin.weight())
    step = np.abs(w).max() / 127  # a rotated weight's step is at most the largest one's
    assert np.abs(back - w).max() <= np.sqrt(32) * step / 2 * 1.01
    assert np.abs(back - w).max() > 0  # (quantized: not the float weights themselves)
    x = jnp.asarray(rng.normal(size=(3, 64)).astype(np.float32))
    np.testing.assert_allclose(np.asarray(lin(x)), np.asarray(x) @ back, rtol=1e-4, atol=1e-4)
    other = module(1)
    monkeypatch.setattr(quant, "_on_accelerator", lambda w: True)  # as a GPU's array
    other.quantize("int8")
    assert not other.rotated and other.scale.get_value().shape == (24,)
    assert fuse_linears([lin, other]) is None


@pytest.mark.skipif(not linear.available(), reason="the CPU kernels did not build here")
def test_quantized_rows_do_not_depend_on_the_batch():
    # Each row is quantized on its own: alone or among others, the same bits.
    rng = np.random.default_rng(6)
    w = rng.normal(size=(64, 72)).astype(np.float32)
    q, scale = quantize_int8(w, axis=-2)
    q4, s4, z4 = quantize_int4(w, axis=-2)
    x = rng.normal(size=(13, 64)).astype(np.float32) * rng.uniform(0.1, 10, size=(13, 1))
    ops = [
        (linear.pack(jnp.asarray(q)), dict(scales=linear.pack_scales(jnp.asarray(scale)))),
        (
            linear.pack(jnp.asarray(q4)),
            dict(scales=linear.pack(jnp.asarray(s4)), mins=linear.pack(jnp.asarray(z4))),
        ),
    ]
    for pk, kw in ops:
        batch = np.asarray(linear.matmul(jnp.asarray(x), pk, 72, **kw))
        for i in (0, 6, 12):
            alone = np.asarray(linear.matmul(jnp.asarray(x[i : i + 1]), pk, 72, **kw))
            np.testing.assert_array_equal(alone[0], batch[i])


def test_int4_error_is_within_half_a_group_scale():
    # Along the input axis of a stacked kernel and along E of a table: each weight within
    # half its group's scale, q in [0, 15] two a byte, a constant group exact.
    rng = np.random.default_rng(2)
    w = rng.normal(size=(3, 64, 40)).astype(np.float32) * rng.uniform(0.01, 3, size=40)
    w[:, :32, 7] = 0.25  # a constant group: scale 0, the minimum exact
    packed, scale, zero = quantize_int4(w, axis=-2)
    assert packed.dtype == np.uint8 and packed.shape == (3, 32, 40)
    assert scale.shape == zero.shape == (3, 2, 40)
    deq = np.asarray(dequantize_int4(packed, scale, zero, axis=-2))
    err = np.abs(deq - w)
    assert np.all(err <= np.repeat(scale, 32, axis=-2) / 2 * (1 + 1e-5) + 1e-7)
    assert np.all(deq[:, :32, 7] == 0.25)
    q = np.stack([packed & 15, packed >> 4], axis=-2).reshape(3, 64, 40)  # even rows low
    np.testing.assert_allclose(q * np.repeat(scale, 32, -2) + np.repeat(zero, 32, -2), deq)
    table = rng.normal(size=(10, 96)).astype(np.float32)
    p2, s2, z2 = quantize_int4(table, axis=-1)
    assert p2.shape == (10, 48) and s2.shape == (10, 3)
    assert np.abs(np.asarray(dequantize_int4(p2, s2, z2, axis=-1)) - table).max() <= s2.max()
    with pytest.raises(ValueError, match="a multiple of 32 for 4-bit groups, got 40"):
        quantize_int4(w, axis=-1)


@pytest.mark.skipif(not linear.available(), reason="the CPU kernels did not build here")
@pytest.mark.parametrize("layers, n, rows", [(None, 100, None), (3, 48, 5), (2, 7, 0)])
def test_the_cpu_kernel_multiplies_by_4bit_groups_as_defined(layers, n, rows):
    rng = np.random.default_rng(4)
    lead = () if layers is None else (layers,)
    w = rng.normal(size=(*lead, 96, n)).astype(np.float32)
    packed, scale, zero = quantize_int4(w, axis=-2)
    x = rng.normal(size=(2, 9, 96)).astype(np.float32)
    layer = None if layers is None else layers - 1
    pk = linear.pack(jnp.asarray(packed))
    assert np.array_equal(np.asarray(linear.unpack(pk, n)), packed)
    ps, pz = linear.pack(jnp.asarray(scale)), linear.pack(jnp.asarray(zero))
    got = linear.matmul(jnp.asarray(x), pk, n, layer=layer, rows=rows, scales=ps, mins=pz)
    pick = (lambda a: a) if layers is None else (lambda a: a[layer])
    want = cpu.reference_quantized(x.reshape(18, 96), pick(packed), pick(scale), pick(zero))
    if rows is not None:
        want[rows:] = 0.0
    np.testing.assert_allclose(np.asarray(got).reshape(18, n), want, atol=2e-5, rtol=1e-5)
    deq = np.asarray(dequantize_int4(packed, scale, zero, axis=-2), np.float64)
    exact = x.reshape(18, 96).astype(np.float64) @ pick(deq)
    if rows is not None:
        exact[rows:] = 0.0
    assert np.abs(np.asarray(got).reshape(18, n) - exact).max() <= 0.02 * np.abs(exact).max()
    with pytest.raises(ValueError, match="4-bit weights need their scales and mins"):
        linear.matmul(jnp.asarray(x), pk, n, layer=layer)
    with pytest.raises(ValueError, match="mins: expected float32"):
        linear.matmul(jnp.asarray(x), pk, n, layer=layer, scales=ps, mins=pz[..., :1, :])


# A held-out config: biases on q/k/v (as Qwen2), an untied LM head, GQA 4:2.
CFG = models.LlamaConfig(
    vocab_size=200,
    hidden_size=64,
    intermediate_size=96,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    qkv_bias=True,
    tie_word_embeddings=False,
)


def _pair(cfg, fmt="int8"):
    """(a quantized model, a float model holding its dequantized weights). "int4-table":
    int4 with the embedding table in 4 bits too (as a GGUF file's Q4 table is kept)."""
    quantized = models.init_model(cfg, seed=3)
    if fmt == "int4-table":
        quantized.embed_tokens.quantize("int4")
    quantized.quantize(fmt.removesuffix("-table"))
    dequantized = models.init_model(cfg, seed=3)
    mods = lambda m: [n for _, n in nnx.iter_graph(m) if isinstance(n, (Linear, Embed))]  # noqa: E731
    for a, b in zip(mods(dequantized), mods(quantized), strict=True):
        if isinstance(a, Linear):
            a.kernel.set_value(b.weight())
        else:
            a.embedding.set_value(b.table())
    return quantized, dequantized


TIED = dataclasses.replace(CFG, tie_word_embeddings=True, qkv_bias=False)


def _w8a8_definition(calls):
    """``linear.matmul``'s quantized products as the kernel's header defines them, in jnp
    (rows quantized in blocks, exact integer sums per block, scaled in f32), for an engine
    to trace instead of the C kernel; f32 weights still go to the kernel. Appends to
    ``calls`` each time it is traced."""
    real = linear.matmul

    def matmul(x, packed, n, layer=None, rows=None, scales=None, mins=None, rotated=False):
        if scales is None:
            return real(x, packed, n, layer, rows)
        calls.append(packed.shape)
        if rotated:  # rows rotated as the weights were, then quantized
            x = cpu.rotate_blocks(x, xp=jnp)
        if packed.ndim == 4:  # a stack, by the layer's index
            packed, scales = packed[layer], scales[layer]
            mins = None if mins is None else mins[layer]
        q = linear.unpack(packed, n)
        x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
        m, k = x2.shape
        if packed.dtype == jnp.bfloat16:  # fp8 held as bf16: rows rounded to bf16
            xb = x2.astype(jnp.bfloat16).astype(jnp.float32)
            y = jnp.dot(xb, q.astype(jnp.float32), precision="highest") * scales[None, :n]
            if rows is not None:
                y = jnp.where(jnp.arange(m)[:, None] < rows, y, 0.0)
            return y.reshape(*x.shape[:-1], n)
        grouped = scales.ndim == packed.ndim  # [P, K / G, NR], not [P * NR]
        if grouped:  # the groups' scales (and 4-bit's minimums) [K / G, n]
            d = linear.unpack(scales, n)
            mn = None if mins is None else linear.unpack(mins, n)
            block = k // d.shape[0]
            if q.dtype == jnp.uint8:
                q = jnp.stack([q & 15, q >> 4], axis=-2).reshape(k, n)
        else:
            block = 32
        blocks = -(-k // block)
        xp = jnp.pad(x2, ((0, 0), (0, blocks * block - k))).reshape(m, blocks, block)
        qp = jnp.pad(q.astype(jnp.int32), ((0, blocks * block - k), (0, 0)))
        a = jnp.max(jnp.abs(xp), axis=-1)
        inv = jnp.where(a > 0, 127 / jnp.where(a > 0, a, 1), 0.0)
        xq = jnp.clip(jnp.round(xp * inv[..., None]), -127, 127).astype(jnp.int32)
        isum = jnp.einsum("mbk,bkn->mbn", xq, qp.reshape(blocks, block, n)).astype(jnp.float32)
        dx = a / 127
        if mins is not None:
            xs = jnp.sum(xq, axis=-1).astype(jnp.float32) * dx  # the quantized rows' sums
            y = jnp.sum(isum * d[None] * dx[..., None] + mn[None] * xs[..., None], axis=1)
        elif grouped:
            y = jnp.sum(isum * d[None] * dx[..., None], axis=1)
        else:
            y = jnp.sum(isum * dx[..., None], axis=1) * scales[None, :n]
        if rows is not None:
            y = jnp.where(jnp.arange(m)[:, None] < rows, y, 0.0)
        return y.reshape(*x.shape[:-1], n)

    return matmul


_HELD = {
    "packed-untied-bias": (CFG, "packed"),
    "packed-tied": (TIED, "packed"),
    "xla-untied-bias": (CFG, "xla"),
    "accelerator-tied": (TIED, "accelerator"),
}
# The default suite: every format packed (the CPU's way) and each other way once; the
# whole grid of ways and formats under -m slow (.ci/run runs it).
_HELD_BY_DEFAULT = {("packed-untied-bias", fmt) for fmt in ("int8", "int4", "int4-table", "fp8")}
_HELD_BY_DEFAULT |= {("packed-tied", "int4-table"), ("xla-untied-bias", "int8")}
_HELD_BY_DEFAULT |= {("accelerator-tied", "fp8")}


@pytest.mark.parametrize(
    "cfg, held, fmt",
    [
        grid_case(*_HELD[way], fmt, id=f"{way}-{fmt}", by_default=(way, fmt) in _HELD_BY_DEFAULT)
        for fmt in ("int8", "int4", "int4-table", "fp8")
        for way in _HELD
    ],
)
def test_a_quantized_model_computes_what_its_dequantized_weights_do(cfg, held, fmt, monkeypatch):
    """Through the engine, each way it holds weights: packed for the C kernel (CPU),
    per layer for XLA:CPU, per layer and unrolled (GPUs and TPUs); greedy tokens and
    their log-probs, and a 48-token prompt's logits at every position, equal those of
    the float model with the dequantized weights. Packed,
    the kernel quantizes the rows too (W8A8; fp8 weights, held as bf16, by rows rounded
    to bf16): they equal those of the same model whose quantized products follow the
    kernel's definition in jnp instead."""
    if held == "packed" and not linear.available():
        pytest.skip("the CPU kernels did not build here")
    quantized, dequantized = _pair(cfg, fmt)
    calls = []
    if held == "packed":  # the kernel quantizes the rows too (W8A8): its definition instead
        dequantized = _pair(cfg, fmt)[0]
    if held in ("xla", "accelerator"):
        monkeypatch.setenv("PAGED_JAX_BACKEND", "xla")  # no packing: XLA's products
    if held == "accelerator":  # (weight-only: on a GPU with fp8 units, not its default)
        quantized.hold_for_accelerator(fp8_activations=False)
        dequantized.hold_for_accelerator()
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [50, 60, 70]]
    p = pj.SamplingParams(max_tokens=10, ignore_eos=True, logprobs=True)
    kw = dict(num_pages=64, page_size=8, compilation_cache=False)
    got = pj.LLM(quantized, **kw).generate(prompts, p, progress=False)
    # a whole prompt's logits, every position, as the packed model computes them
    long = [int(t) for t in np.random.default_rng(11).integers(0, cfg.vocab_size, 48)]
    got_logits = paged_prompt_logits(quantized, long)
    if held == "packed":
        monkeypatch.setattr(linear, "matmul", _w8a8_definition(calls))
        jax.clear_caches()  # trace the steps again, with it
    want = pj.LLM(dequantized, **kw).generate(prompts, p, progress=False)
    want_logits = paged_prompt_logits(dequantized, long)
    # Every position's logits: packed, within 3% of the largest (the rows' rounding, a
    # step function, moved by the f32 sums' last bits; measured 0.2-1.5%), the same top
    # token at 95% of the positions at least (measured: all); else within f32 rounding
    diff = np.abs(got_logits - want_logits).max() / np.abs(want_logits).max()
    assert diff <= (0.03 if held == "packed" else 1e-5), diff
    same_top = (got_logits.argmax(-1) == want_logits.argmax(-1)).mean()
    assert same_top >= (0.95 if held == "packed" else 1.0), same_top
    if held == "packed":  # every quantized product and the head traced by the definition
        assert len(calls) >= cfg.num_layers  # traced: the products took the definition
    layers_q = quantized.layers
    # (packed for the CPU kernels or held for an accelerator, q/k/v are one qkv_proj)
    attn = getattr(layers_q, "self_attn", None)
    q_proj = getattr(attn, "q_proj", None) or getattr(attn, "qkv_proj", None)
    if held == "packed" and q_proj is not None:  # (fp8: packed as bf16, the same values)
        dtype = {"int8": jnp.int8, "fp8": jnp.bfloat16}.get(fmt, jnp.uint8)
        table = quantized.embed_tokens.embedding.get_value().dtype
        fp8_table = jnp.bfloat16 if cfg.tie_word_embeddings else jnp.float8_e4m3fn  # (a head)
        assert table == {"int4-table": jnp.uint8, "fp8": fp8_table}.get(fmt, jnp.int8)
        assert q_proj.packed and q_proj.kernel.get_value().dtype == dtype
    for g, w in zip(got, want, strict=True):
        if held == "packed":
            # Rounding the rows is a step function: the f32 sums' last bits (the kernel's
            # order against XLA's) move some values across a step, which then spread. The
            # first tokens agree, their log-probs within a few hundredths.
            assert g.outputs[0].token_ids[:2] == w.outputs[0].token_ids[:2]
            np.testing.assert_allclose(
                g.outputs[0].logprobs[:2], w.outputs[0].logprobs[:2], atol=0.05
            )
            continue
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        np.testing.assert_allclose(g.outputs[0].logprobs, w.outputs[0].logprobs, atol=2e-4)


def test_fp8_activations_multiply_fp8_rows_by_the_fp8_weight_as_defined():
    from paged_jax._quant import quantize_rows
    from paged_jax.models.layers import make_linear as _linear

    rng = np.random.default_rng(7)
    lin = _linear(48, 40, True, rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
    lin.bias.set_value(jnp.asarray(rng.normal(size=40), jnp.float32))
    lin.quantize("fp8")
    w = np.asarray(lin.weight())  # [in, out], the fp8 values times their scales
    x = rng.normal(size=(5, 48)).astype(np.float32) * rng.uniform(0.1, 10, size=(5, 1))
    x[3] = 0.0
    weight_only = np.asarray(lin(jnp.asarray(x)))
    assert lin.hold_fp8_activations() is lin and lin.hold_fp8_activations() is lin
    assert lin.kernel.get_value().shape == (40, 48)  # held [out, in]
    np.testing.assert_array_equal(np.asarray(lin.weight()), w)
    got = np.asarray(lin(jnp.asarray(x)))
    xq, xs = quantize_rows(jnp.asarray(x), jnp.float8_e4m3fn)
    rows = np.asarray(xq, np.float64) * np.asarray(xs, np.float64)[:, None]
    want = rows @ w + np.asarray(lin.bias.get_value())
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_allclose(got[3], np.asarray(lin.bias.get_value()), rtol=0, atol=0)
    # the rows' own rounding: close to the weight-only product, not equal
    rel = np.linalg.norm(got - weight_only) / np.linalg.norm(weight_only)
    assert 0 < rel < 0.08, rel
    other = _linear(8, 4, False, rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
    with pytest.raises(ValueError, match="fp8 activations need an fp8 module"):
        other.quantize("int8").hold_fp8_activations()


def test_fp8_activations_on_an_accelerator_s_layout_keep_the_logits_near():
    # The model held as an accelerator holds it, its layers' fp8 products W8A8 (the
    # default on GPUs with fp8 units; asked for here on CPU), against the same weights
    # weight-only: the logits move by the rows' rounding only, the head stays W8A16.
    from paged_jax.metadata import AttentionMetadata

    def logits(fp8_activations):
        model = _pair(CFG, "fp8")[0].hold_for_accelerator(fp8_activations=fp8_activations)
        qkv = model.layers.self_attn.qkv_proj
        assert qkv.fp8_activations == fp8_activations
        assert not model.lm_head.fp8_activations
        ids = np.arange(1, 12)
        n = len(ids)
        cache = model.make_cache(8, 8)
        md = AttentionMetadata.prefill(n, 8 + np.arange(n), [1, 2], logits_all=True)
        positions = jnp.arange(n, dtype=jnp.int32)
        out, _ = model(jnp.asarray(ids, jnp.int32), positions, cache, md)
        return np.asarray(out)

    a8, a16 = logits(True), logits(False)
    rel = np.linalg.norm(a8 - a16) / np.linalg.norm(a16)
    assert 0 < rel < 0.1, rel


def test_a_held_model_keeps_its_fp8_choice_when_the_engine_holds_it_again(monkeypatch):
    from paged_jax.models import placement

    monkeypatch.setattr(placement, "fp8_units", lambda device=None: True)  # as on a Hopper GPU
    for first, want in [(False, False), (True, True), (None, True)]:
        model = _pair(CFG, "fp8")[0].hold_for_accelerator(fp8_activations=first)
        model.hold_for_accelerator()  # what the engine calls
        assert model.layers.self_attn.qkv_proj.fp8_activations == want, first
    model = _pair(CFG, "fp8")[0].hold_for_accelerator(fp8_activations=False)
    model.hold_for_accelerator(fp8_activations=True)  # asked for: applied
    assert model.layers.mlp.gate_up_proj.fp8_activations


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_quantized_weights_on_the_cpu_kernels_get_a_bf16_pool_unasked(fmt, monkeypatch):
    """The engine's default pool for weights the C kernels compute is bf16
    (``preferred_cache_dtype``); asked for, another dtype stays; a float model, and
    quantized weights on XLA's products, keep the compute dtype."""
    kw = dict(num_pages=16, page_size=8, compilation_cache=False)
    quantized = _pair(CFG, fmt)[0]
    want = jnp.bfloat16 if linear.available() else jnp.float32
    assert pj.LLM(quantized, **kw).cache.dtype == want
    assert quantized.preferred_cache_dtype() == (jnp.bfloat16 if linear.available() else None)
    assert pj.LLM(_pair(CFG, fmt)[0], cache_dtype=jnp.float32, **kw).cache.dtype == jnp.float32
    assert pj.LLM(models.init_model(CFG, seed=3), **kw).cache.dtype == jnp.float32
    monkeypatch.setenv("PAGED_JAX_BACKEND", "xla")  # not packed: XLA's products
    xla = pj.LLM(_pair(CFG, fmt)[0], **kw)
    assert xla.cache.dtype == jnp.float32 and xla.model.preferred_cache_dtype() is None


def test_quantized_weights_take_a_quarter_of_the_bytes():
    def nbytes(m):
        return sum(x.nbytes for x in jax.tree.leaves(nnx.state(m)))

    f32 = models.init_model(CFG, seed=0)
    int8 = models.init_model(CFG, seed=0).quantize("int8")
    assert nbytes(int8) < 0.3 * nbytes(f32)
    int4 = models.init_model(CFG, seed=0).quantize("int4")
    assert nbytes(int4) < 0.21 * nbytes(f32)
    fp8 = models.init_model(CFG, seed=0).quantize("fp8")
    scales = lambda m: sum(  # noqa: E731
        n.scale.get_value().nbytes for _, n in nnx.iter_graph(m) if isinstance(n, (Linear, Embed))
    )
    assert nbytes(fp8) - scales(fp8) == nbytes(int8) - scales(int8)  # a byte a weight
    # Scales: fp8's one an output channel; int8's, computed on the CPU (as here), one per
    # channel and group of 32 inputs where 32 divides the inputs (int8_group)
    for _, n in nnx.iter_graph(int8):
        if isinstance(n, Linear):
            k = n.kernel.get_value()
            *lead, k_in, k_out = k.shape
            want = (*lead, k_in // 32, k_out) if k_in % 32 == 0 else (*lead, k_out)
            assert n.scale.get_value().shape == want, (k.shape, n.scale.get_value().shape)
    assert int8.layers.mlp.down_proj.scale.get_value().ndim == 3  # (CFG's 96 inputs)


def test_load_quantizes_and_names_what_it_cannot_do():
    model, _ = models.load("tiny-llama", quantization="int8")
    assert model.embed_tokens.quantized == "int8"
    assert model.embed_tokens.embedding.get_value().dtype == jnp.int8
    match = "quantization: expected one of 'int8', 'int4', 'fp8' or None, got 'q3'"
    with pytest.raises(ValueError, match=match):
        models.load("tiny-llama", quantization="q3")
    # with a mesh: quantized after the float weights are placed, and placed again
    # (several devices: tests/test_sharding.py, -m slow)
    mesh = pj.tensor_parallel_mesh(1)
    on_mesh, _ = models.load("tiny-llama", quantization="int8", mesh=mesh)
    kernel = on_mesh.layers.self_attn.q_proj.kernel.get_value()
    assert kernel.dtype == jnp.int8 and kernel.sharding.mesh.shape == mesh.shape
    lin = Linear(8, 8, rngs=nnx.Rngs(0))
    lin.kernel.set_value((lin.kernel.get_value(),))  # held per layer already
    with pytest.raises(ValueError, match="quantize before packing or splitting"):
        lin.quantize()


def test_the_cli_quantizes_on_load(capsys):
    import json

    from paged_jax import cli

    argv = ["generate", "--model", "tiny-llama", "--quantization", "int8", "--max-tokens", "3"]
    assert cli.main([*argv, "--prompt", "hi", "--json", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["outputs"][0]["completions"][0]["token_ids"]) == 3
    assert (
        cli.main([*argv[:-3], "int4", *argv[-2:], "--prompt", "hi", "--json", "--no-progress"]) == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert len(out["outputs"][0]["completions"][0]["token_ids"]) == 3
    assert (
        cli.main([*argv[:-3], "fp8", *argv[-2:], "--prompt", "hi", "--json", "--no-progress"]) == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert len(out["outputs"][0]["completions"][0]["token_ids"]) == 3
    with pytest.raises(SystemExit):  # argparse: not among the choices
        cli.main(["generate", "--quantization", "int3"])
    assert "invalid choice: 'int3'" in capsys.readouterr().err


@pytest.mark.skipif(not linear.available(), reason="the CPU kernels did not build here")
def test_quantized_weights_run_on_a_bf16_pool_near_an_f32_one():
    # Packed int4 weights on a bf16 pool (written by cache.c; their default) give
    # log-probs near an f32 pool's.
    kw = dict(num_pages=16, page_size=8, compilation_cache=False)
    p = pj.SamplingParams(max_tokens=3, ignore_eos=True, logprobs=True)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [30, 31, 32]]
    out = {}
    for pool in (jnp.float32, jnp.bfloat16):
        llm = pj.LLM(models.init_model(CFG, seed=0).quantize("int4"), cache_dtype=pool, **kw)
        assert llm.cache.dtype == jnp.dtype(pool)
        out[pool] = llm.generate(prompts, p, progress=False)
    for a, b in zip(out[jnp.float32], out[jnp.bfloat16], strict=True):
        np.testing.assert_allclose(a.outputs[0].logprobs[:1], b.outputs[0].logprobs[:1], atol=0.05)


@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4"])
def test_a_model_built_from_shapes_quantizes_as_a_concrete_one(fmt):
    # nnx.eval_shape of a quantized model (what compiles a step ahead of time, for a
    # TPU with none attached in .ci/tpu_compile): the traced weights quantize with
    # jax.numpy, into the shapes and dtypes a concrete model gets on the same platform.
    def make():
        m = models.LlamaForCausalLM(CFG, rngs=nnx.Rngs(0))
        return m.quantize(fmt)

    abstract = nnx.state(nnx.eval_shape(make))
    concrete = nnx.state(make())
    shapes = lambda s: jax.tree.map(lambda x: (x.shape, jnp.dtype(x.dtype)), s)  # noqa: E731
    assert shapes(abstract) == shapes(concrete)
    assert any(x.dtype == jnp.int8 for x in jax.tree.leaves(abstract)) or fmt == "fp8"


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_grouped_products_on_a_gpu_take_the_kernel_that_reads_them_as_they_lie(fmt, monkeypatch):
    # On a GPU each product by a weight in groups along its inputs (4-bit; int8 in groups,
    # as a GGUF file's kept blocks, here rotated as the CPU's are) goes to matmul_int4 /
    # matmul_int8_groups (XLA:GPU would make a bf16 copy of the weight first); here the
    # kernels run interpreted (their platforms plus "cpu"), held as an accelerator holds a
    # model, and give the logits of the float model holding the dequantized weights. A
    # shape no block fits (the head's 200 columns) stays with XLA.
    from paged_jax.kernels.gpu import matmul as gpu_matmul
    from paged_jax.metadata import AttentionMetadata

    _interpret_kernel(monkeypatch, "grouped")
    monkeypatch.setenv("PAGED_JAX_BACKEND", "xla")  # no packing for the C kernel
    calls = []
    name = "matmul_int4" if fmt == "int4" else "matmul_int8_groups"
    real = getattr(gpu_matmul, name)

    def counted(*a, **kw):
        calls.append(a[1].shape)
        return real(*a, **kw)

    monkeypatch.setattr(gpu_matmul, name, counted)
    quantized, dequantized = _pair(CFG, fmt)
    quantized.hold_for_accelerator()
    dequantized.hold_for_accelerator()
    if fmt == "int8":  # groups (the CPU's layout, quantized here), rotated
        assert quantized.layers.mlp.down_proj.rotated
    ids = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 50, 60], np.int32)
    n = len(ids)

    def logits(model):
        md = AttentionMetadata.prefill(n, np.arange(n), [1, 2], logits_all=True)
        out, _ = model(jnp.asarray(ids), jnp.arange(n, dtype=jnp.int32), model.make_cache(4, 8), md)
        return np.asarray(out)

    got, want = logits(quantized), logits(dequantized)
    # q/k/v, o, gate/up and down of each layer; not the head (200 columns: no block fits)
    assert len(calls) == 4 * CFG.num_layers, calls
    assert all(shape[1] != CFG.vocab_size for shape in calls)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_w8a16_products_through_the_few_row_kernel_stay_as_near_the_floats_as_xla_s(
    fmt, monkeypatch
):
    # W8A16 on a GPU's layout (int8 with a scale per output channel, fp8 held weight-only)
    # of a bf16 model held as an accelerator holds it: its products through the few-row
    # Pallas product (interpreted: its platforms plus "cpu"; 13 rows padded to 16 inside)
    # give logits as near an f32 model of the same dequantized weights as XLA's dot on the
    # widened weight does (which rounds each product to bf16 before its scale), and the
    # same greedy tokens.
    from paged_jax.kernels.gpu import matmul as gpu_matmul
    from paged_jax.metadata import AttentionMetadata
    from paged_jax.models.layers import embed as layers_embed
    from paged_jax.models.layers import linear as layers_linear

    monkeypatch.setenv("PAGED_JAX_BACKEND", "xla")
    for module in (layers_linear, layers_embed):  # a GPU's: per channel
        monkeypatch.setattr(module, "int8_group", lambda w, axis: None)
    calls = []
    real = gpu_matmul.matmul

    def counted(*a, **kw):
        calls.append((a[0].shape, jnp.dtype(a[1].dtype), kw["prefetch"]))
        return real(*a, **kw)

    monkeypatch.setattr(gpu_matmul, "matmul", counted)
    model = models.init_model(CFG, seed=3, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    model.quantize(fmt)
    reference = models.init_model(CFG, seed=3)  # f32, the same dequantized weights
    mods = lambda m: [n for _, n in nnx.iter_graph(m) if isinstance(n, (Linear, Embed))]  # noqa: E731
    for a, b in zip(mods(reference), mods(model), strict=True):
        if isinstance(a, Linear):
            a.kernel.set_value(jnp.asarray(b.weight(), jnp.float32))
        else:
            a.embedding.set_value(jnp.asarray(b.table(), jnp.float32))
    model.hold_for_accelerator(fp8_activations=False)
    ids = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 50, 60], np.int32)
    n = len(ids)

    def logits(m):
        md = AttentionMetadata.prefill(n, np.arange(n), [1, 2], logits_all=True)
        out, _ = m(jnp.asarray(ids), jnp.arange(n, dtype=jnp.int32), m.make_cache(4, 8), md)
        return np.asarray(out, np.float64)

    want = logits(reference)
    xla = logits(model)  # off by default, and "cpu" is not among the platforms
    assert calls == [] and KERNELS["w8a16"].platforms == ()
    _interpret_kernel(monkeypatch, "w8a16")
    got = logits(model)
    q8 = jnp.dtype(jnp.int8 if fmt == "int8" else jnp.float8_e4m3fn)
    # q/k/v, o, gate/up and down of each layer (not the head: 200 columns fit no block)
    assert len(calls) >= 4 * CFG.num_layers, calls
    assert all(c[0][0] == 16 and c[1:] == (q8, True) for c in calls), calls
    scale = np.abs(want).max()
    err_xla, err = np.abs(xla - want).max() / scale, np.abs(got - want).max() / scale
    assert 0 < err <= max(1.25 * err_xla, 0.01), (err, err_xla)
    assert np.array_equal(np.argmax(got, -1), np.argmax(want, -1))


def test_the_engine_with_the_w8a16_kernel_gives_xla_s_tokens(monkeypatch):
    # Through the engine (prefill and decode steps jitted, 2 decode rows padded to 16 in
    # the kernel), an int8 bf16 model held for an accelerator gives the same greedy tokens
    # with its W8A16 products through the few-row kernel (interpreted) as with XLA's dots,
    # and its log-probs within bf16's rounding.
    from paged_jax.kernels.gpu import matmul as gpu_matmul
    from paged_jax.models.layers import embed as layers_embed
    from paged_jax.models.layers import linear as layers_linear

    monkeypatch.setenv("PAGED_JAX_BACKEND", "xla")
    for module in (layers_linear, layers_embed):  # a GPU's: per channel
        monkeypatch.setattr(module, "int8_group", lambda w, axis: None)
    calls = []
    real = gpu_matmul.matmul
    monkeypatch.setattr(gpu_matmul, "matmul", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    model = models.init_model(CFG, seed=5, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    model.quantize("int8").hold_for_accelerator()
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [50, 60, 70]]
    p = pj.SamplingParams(max_tokens=8, ignore_eos=True, logprobs=True)
    kw = dict(num_pages=64, page_size=8, compilation_cache=False)
    want = pj.LLM(model, **kw).generate(prompts, p, progress=False)
    assert calls == []
    _interpret_kernel(monkeypatch, "w8a16")
    jax.clear_caches()  # trace the steps again, with the kernel
    got = pj.LLM(model, **kw).generate(prompts, p, progress=False)
    assert len(calls) >= 4 * CFG.num_layers  # traced: the products took the kernel
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        np.testing.assert_allclose(g.outputs[0].logprobs, w.outputs[0].logprobs, atol=0.05)


def test_fp8_rows_of_qkv_o_and_down_take_one_kernel_each_on_a_gpu(monkeypatch):
    # W8A8 on a GPU: q/k/v's input rows (normed in the kernel), o's, and down's (SiLU times
    # up folded in) are quantized by one Pallas kernel each (XLA:GPU takes two, two and
    # three); interpreted here (their platforms plus "cpu"), the logits are those of XLA's
    # norm and quantize_rows.
    from paged_jax.kernels.gpu import rows as gpu_rows
    from paged_jax.metadata import AttentionMetadata

    monkeypatch.setenv("PAGED_JAX_BACKEND", "xla")
    calls = []
    real = gpu_rows.fp8_rows

    def counted(x, **kw):
        calls.append("norm" if kw.get("norm_weight") is not None else kw.get("act") or "plain")
        return real(x, **kw)

    monkeypatch.setattr(gpu_rows, "fp8_rows", counted)
    model = _pair(CFG, "fp8")[0].hold_for_accelerator(fp8_activations=True)
    attn, mlp = model.layers.self_attn, model.layers.mlp
    assert attn.qkv_proj.fp8_rows_kernel and attn.o_proj.fp8_rows_kernel
    assert mlp.down_proj.fp8_rows_kernel and not mlp.gate_up_proj.fp8_rows_kernel
    ids = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 50, 60], np.int32)
    n = len(ids)

    def logits():
        md = AttentionMetadata.prefill(n, np.arange(n), [1, 2], logits_all=True)
        out, _ = model(jnp.asarray(ids), jnp.arange(n, dtype=jnp.int32), model.make_cache(4, 8), md)
        return np.asarray(out, np.float64)

    want = logits()  # XLA's way: "cpu" is not among the kernel's platforms
    assert calls == []
    _interpret_kernel(monkeypatch, "fp8_rows")
    jax.clear_caches()
    got = logits()
    assert sorted(calls) == sorted(["norm", "plain", "silu"] * CFG.num_layers), calls
    # interpreted, the kernel's ops are XLA's own (the same bits with JAX 0.10.2; 1.5e-4 of
    # the logits with 0.11.2, whose norm sums in another order and flips an fp8 rounding);
    # compiled for a GPU, more values on an edge may round the other way
    tol = 1e-3 if jax.default_backend() != "gpu" else 0.05
    assert np.linalg.norm(got - want) <= tol * np.linalg.norm(want)
