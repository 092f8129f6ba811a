"""The few-row GPU product (``pallas_kernels.gpu.matmul``) against numpy, interpreted on
CPU (compiled where the tests run on a GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.kernels.gpu import matmul as kmm
from paged_jax.models.quantization import quantize_fp8, quantize_int8

INTERPRET = jax.default_backend() != "gpu"


@pytest.mark.parametrize(
    "rows, k, n, fmt, block_n, block_k, split_k",
    [
        (16, 256, 128, "float32", 32, 64, 1),
        (32, 256, 128, "float32", 64, 32, 4),  # K in 4 slices, summed after
        (16, 128, 96, "bfloat16", 32, 64, 2),
        (64, 128, 64, "int8", 64, 32, 1),
        (16, 256, 64, "fp8", 16, 64, 2),
    ],
)
def test_the_product_equals_numpys(rows, k, n, fmt, block_n, block_k, split_k):
    rng = np.random.default_rng(rows + k + n)
    x = rng.normal(size=(rows, k)).astype(np.float32)
    w = (rng.normal(size=(k, n)) * rng.uniform(0.1, 2, size=n)).astype(np.float32)
    dtype = jnp.float32 if fmt == "float32" else jnp.bfloat16
    xd = jnp.asarray(x, dtype)
    x_used = np.asarray(xd, np.float32)  # what the kernel multiplies
    if fmt in ("int8", "fp8"):
        q, scale = (quantize_int8 if fmt == "int8" else quantize_fp8)(w, axis=-2)
        w_used = q.astype(np.float32) * scale
        args = (jnp.asarray(q), jnp.asarray(scale))
    else:
        wd = jnp.asarray(w, dtype)
        w_used = np.asarray(wd, np.float32)
        args = (wd,)
    kw = dict(block_n=block_n, block_k=block_k, split_k=split_k, interpret=INTERPRET)
    y = kmm.matmul(xd, *args, **kw)
    assert y.shape == (rows, n) and y.dtype == dtype
    want = x_used.astype(np.float64) @ w_used.astype(np.float64)
    # f32 sums in another order; a bf16 output rounds to 8 bits
    tol = 1e-4 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=tol, atol=tol * 4)
    # the weight's chunks loaded a step ahead: the same sums in the same order (the same
    # bits interpreted; compiled, within a unit in the last place of the output)
    ahead = np.asarray(kmm.matmul(xd, *args, prefetch=True, **kw), np.float32)
    plain = np.asarray(y, np.float32)
    if INTERPRET:
        np.testing.assert_array_equal(ahead, plain)
    else:
        ulp = 2.0**-7 if dtype == jnp.bfloat16 else 2.0**-22
        np.testing.assert_allclose(ahead, plain, rtol=ulp, atol=ulp * np.abs(plain).max())


def test_bad_shapes_are_refused_naming_the_argument():
    x = jnp.zeros((16, 64), jnp.float32)
    with pytest.raises(ValueError, match="x, w"):
        kmm.matmul(x, jnp.zeros((32, 64)), interpret=True)
    with pytest.raises(ValueError, match="scale"):
        kmm.matmul(x, jnp.zeros((64, 64), jnp.int8), interpret=True)
    with pytest.raises(ValueError, match="block_n"):
        kmm.matmul(x, jnp.zeros((64, 64)), block_n=48, interpret=True)
    with pytest.raises(ValueError, match="multiple of block_n"):
        kmm.matmul(x, jnp.zeros((64, 80)), block_n=32, block_k=32, interpret=True)
    with pytest.raises(ValueError, match="rows"):
        kmm.matmul(jnp.zeros((12, 64)), jnp.zeros((64, 64)), interpret=True)


def test_k_is_split_only_while_the_programs_underfill_the_gpu():
    # Llama-3-8B's fused projections at 64 rows: the narrow ones get slices, the wide
    # gate/up none; at 256 rows the partial sums' bytes forbid most slicing.
    split = kmm.default_split_k
    assert split(64, 4096, 6144, 2, 64, 128) == 4
    assert split(64, 4096, 28672, 2, 64, 128) == 1  # 448 programs already
    assert split(64, 14336, 4096, 2, 64, 128) == 8
    assert split(256, 4096, 4096, 2, 64, 128) == 1
    for m, k, n, b in [(64, 4096, 6144, 1), (256, 14336, 4096, 2), (16, 1024, 64, 2)]:
        s = split(m, k, n, b, 64, 128)
        assert k % (s * 128) == 0 and 2 * s * m * n * 4 <= k * n * b // 4 or s == 1


@pytest.mark.parametrize(
    "rows, k, n, dtype, block_m, block_n, groups_per_step, split_k",
    [
        (16, 256, 64, "float32", 16, 32, 2, 1),
        (40, 512, 128, "bfloat16", 32, 64, 4, 2),  # rows padded to 64; K in 2 slices
        (64, 96, 48, "float32", 64, 16, 1, 1),  # 3 groups: one a step
        (200, 128, 64, "bfloat16", 256, 32, 2, 2),  # a decode step's rows in one block
    ],
)
def test_the_four_bit_product_equals_numpys_on_the_dequantized_weight(
    rows, k, n, dtype, block_m, block_n, groups_per_step, split_k
):
    from paged_jax.models.quantization import dequantize_int4, quantize_int4

    rng = np.random.default_rng(rows + k + n)
    w = (rng.normal(size=(k, n)) * rng.uniform(0.1, 2, size=n)).astype(np.float32)
    packed, scale, zero = quantize_int4(w, axis=-2)
    # the kernel widens the weight to x's dtype (its values rounded to bf16 there)
    w_used = np.asarray(dequantize_int4(packed, scale, zero, axis=-2).astype(dtype), np.float64)
    x = jnp.asarray(rng.normal(size=(rows, k)).astype(np.float32), dtype)
    y = kmm.matmul_int4(
        x, jnp.asarray(packed), jnp.asarray(scale), jnp.asarray(zero),
        block_m=block_m, block_n=block_n, groups_per_step=groups_per_step, split_k=split_k,
        interpret=INTERPRET,
    )  # fmt: skip
    assert y.shape == (rows, n) and y.dtype == x.dtype
    want = np.asarray(x, np.float64) @ w_used
    tol = 1e-4 if dtype == "float32" else 1e-2
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=tol, atol=tol * 4)


@pytest.mark.parametrize("with_zero", [False, True])
def test_the_int8_group_product_equals_numpys_on_the_dequantized_weight(with_zero):
    # int8 in groups of 32 along the inputs (GGUF's Q8_0 kept; with minimums, Q5_1's)
    rng = np.random.default_rng(7)
    rows, k, n = 24, 192, 96
    q = rng.integers(-127, 128, size=(k, n)).astype(np.int8)
    scale = rng.uniform(0.001, 0.02, size=(k // 32, n)).astype(np.float32)
    zero = rng.normal(size=(k // 32, n)).astype(np.float32) * 0.1 if with_zero else None
    w = q.astype(np.float32) * np.repeat(scale, 32, axis=0)
    if with_zero:
        w = w + np.repeat(zero, 32, axis=0)
    x = rng.normal(size=(rows, k)).astype(np.float32)
    y = kmm.matmul_int8_groups(
        jnp.asarray(x), jnp.asarray(q), jnp.asarray(scale),
        None if zero is None else jnp.asarray(zero),
        block_m=32, block_n=32, groups_per_step=2, split_k=1, interpret=INTERPRET,
    )  # fmt: skip
    assert y.shape == (rows, n) and y.dtype == jnp.float32
    want = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=1e-4, atol=4e-4)


def test_four_bit_blocks_fit_the_shape_or_are_refused_by_name():
    cfg = kmm.grouped_config(64, 4096, 14336)
    assert cfg["block_m"] == 64 and 14336 % cfg["block_n"] == 0
    assert 4096 % (32 * cfg["groups_per_step"] * cfg["split_k"]) == 0
    assert kmm.grouped_config(256, 4096, 4096)["block_m"] == 256  # a decode step's rows: one
    assert kmm.grouped_config(200, 4096, 4096)["block_n"] == 32  # (256 rows: 32 columns)
    assert kmm.grouped_config(2048, 4096, 4096)["block_m"] == 128  # a prefill's: blocks
    assert kmm.grouped_config(5, 4096, 200) is None  # 200 columns: no block of 16
    x = jnp.zeros((16, 64), jnp.float32)
    p, s = jnp.zeros((32, 64), jnp.uint8), jnp.zeros((2, 64), jnp.float32)
    with pytest.raises(ValueError, match="packed"):
        kmm.matmul_int4(x, jnp.zeros((16, 64), jnp.uint8), s, s, interpret=True)
    with pytest.raises(ValueError, match="scale, zero"):
        kmm.matmul_int4(x, p, s, jnp.zeros((1, 64)), interpret=True)
    with pytest.raises(ValueError, match="block_n"):
        kmm.matmul_int4(x, p, s, s, block_n=48, interpret=True)
    with pytest.raises(ValueError, match="block_m"):
        kmm.matmul_int4(x, p, s, s, block_m=8, interpret=True)
    with pytest.raises(ValueError, match="x, q"):
        kmm.matmul_int8_groups(x, jnp.zeros((64, 64), jnp.uint8), s, interpret=True)


@pytest.mark.parametrize(
    "m, k, n, want",
    [
        (13, 4096, 6144, dict(block_n=64, block_k=128, num_warps=4, num_stages=3)),
        (64, 14336, 4096, dict(block_n=64, block_k=128, num_warps=4, num_stages=3)),
        (100, 4096, 28672, dict(block_n=64, block_k=64, num_warps=8, num_stages=3)),
        (256, 4096, 6144, dict(block_n=32, block_k=64, num_warps=8, num_stages=2)),
        (64, 96, 208, dict(block_n=16, block_k=32, num_warps=4, num_stages=3)),
    ],
)
def test_few_row_config_gives_blocks_that_divide_the_weight(m, k, n, want):
    config = kmm.few_row_config(m, k, n, 1)
    assert {key: config[key] for key in want} == want and config["prefetch"]
    assert n % config["block_n"] == 0 and k % (config["block_k"] * config["split_k"]) == 0


def test_few_row_config_leaves_a_prefill_and_odd_shapes_to_xla():
    assert kmm.few_row_config(257, 4096, 4096, 1) is None  # padded to 512 rows
    assert kmm.few_row_config(64, 4096, 100, 1) is None  # no block of 16 columns divides
    assert kmm.few_row_config(64, 40, 64, 1) is None  # nor one of 16 inputs
