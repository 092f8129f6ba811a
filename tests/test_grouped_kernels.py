"""The experts' grouped products (``pallas_kernels/gpu/grouped.py``, ``tpu/grouped.py``):
their tile table (``_groups.expert_tiles``), each kernel against the plain-jnp reference
and numpy, interpreted on CPU (compiled where the tests run on a GPU), and the mixture's
"pallas" way through each kernel against the ``ragged`` way."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental.pallas import tpu as pltpu
from paged_cases import TOLERANCE

from paged_jax.kernels import _groups
from paged_jax.kernels.gpu import grouped as gpu_grouped
from paged_jax.kernels.tpu import grouped as tpu_grouped
from paged_jax.models.layers import moe
from paged_jax.models.quantization import quantize_int8

GPU_INTERPRET = jax.default_backend() != "gpu"


def test_the_tile_table_of_a_hand_worked_case():
    # experts of 6 pairs: [2, 0, 2, 5, 2, 9], 3 experts, tiles of 2 rows. Expert 0: pair 1,
    # one tile (rows 0-1); expert 1: none; expert 2: pairs 0, 2, 4, two tiles (rows 2-5);
    # 5 and 9 name no expert (row M = 2 * num_tiles(6, 3, 2) = 2 * 6 = 12). Used: 3 tiles.
    t = _groups.expert_tiles(jnp.array([2, 0, 2, 5, 2, 9]), 3, 2)
    assert t.rows.tolist() == [2, 0, 3, 12, 4, 12]
    assert t.tiles_used.tolist() == [3]
    # tiles 3-5 are spare: the last used tile's expert (2)
    assert t.tile_expert.tolist() == [0, 2, 2, 2, 2, 2]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    st.integers(1, 8).flatmap(
        lambda x: st.tuples(
            st.just(x),
            st.lists(st.integers(-1, x), min_size=1, max_size=40),
            st.sampled_from([1, 2, 4, 8, 16]),
        )
    )
)
def test_every_tile_holds_one_expert_s_pairs_in_their_order(case):
    experts, ids, block_m = case
    t = _groups.expert_tiles(jnp.asarray(ids, jnp.int32), experts, block_m)
    tiles = _groups.num_tiles(len(ids), experts, block_m)
    rows, tile_expert = np.asarray(t.rows), np.asarray(t.tile_expert)
    used = int(t.tiles_used[0])
    assert tile_expert.shape == (tiles,)
    sizes = [sum(1 for i in ids if i == e) for e in range(experts)]
    assert used == sum(-(-n // block_m) for n in sizes) <= tiles
    for e in range(experts):
        mine = [rows[p] for p, i in enumerate(ids) if i == e]
        assert mine == sorted(mine)  # the pairs' order kept within an expert
        assert all(r < used * block_m and tile_expert[r // block_m] == e for r in mine)
    valid = [rows[p] for p, i in enumerate(ids) if 0 <= i < experts]
    assert len(set(valid)) == len(valid)
    assert all(rows[p] == tiles * block_m for p, i in enumerate(ids) if not 0 <= i < experts)
    if used:  # spare tiles: the last used one's expert (no new weights fetched)
        assert (tile_expert[used:] == tile_expert[used - 1]).all()


def _gpu(*args, block_m, **kw):
    return gpu_grouped.grouped_matmul(*args, block_m=block_m, interpret=GPU_INTERPRET, **kw)


def _tpu(*args, block_m, **kw):
    with pltpu.force_tpu_interpret_mode():
        return tpu_grouped.grouped_matmul(*args, block_m=block_m, **kw)


KERNELS = {"gpu": _gpu, "tpu": _tpu}


def _case(rng, pairs, experts, k, f, block_m, dtype, w_fmt, absent=()):
    ids = rng.integers(0, experts, size=pairs)
    for e in absent:
        ids[ids == e] = (e + 1) % experts
    t = _groups.expert_tiles(jnp.asarray(ids, jnp.int32), experts, block_m)
    x = rng.normal(size=(pairs, k)).astype(np.float32)
    M = t.tile_expert.shape[0] * block_m
    xp = jnp.zeros((M, k), dtype).at[t.rows].set(jnp.asarray(x, dtype), mode="drop")
    w = rng.normal(size=(experts, k, f)).astype(np.float32)
    for e in absent:  # an expert no pair chose: never read, so never a NaN in the output
        w[e] = np.nan
    if w_fmt == "int8":
        q, scale = quantize_int8(np.nan_to_num(w), axis=-2)
        args = (jnp.asarray(q), jnp.asarray(scale))
        w_used = q.astype(np.float32) * scale[:, None, :]
    else:
        args, w_used = (jnp.asarray(w, dtype),), np.asarray(jnp.asarray(w, dtype), np.float32)
    x_used = np.asarray(jnp.asarray(x, dtype), np.float32)
    want = np.einsum("pk,pkf->pf", x_used, w_used[ids], dtype=np.float64)
    return t, xp, args, want


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(
    "pairs, experts, k, f, block_m, dtype, w_fmt",
    [
        (20, 6, 256, 384, 16, "float32", "float"),  # F in 3 blocks of 128 (TPU), 6 of 64
        (9, 4, 128, 256, 16, "bfloat16", "float"),
        (40, 8, 128, 128, 16, "bfloat16", "int8"),  # W8A16: column scales at the end
        (64, 3, 256, 128, 32, "float32", "int8"),  # a prefill's many pairs an expert
    ],
)
def test_each_kernel_multiplies_each_tile_by_its_expert(
    kernel, pairs, experts, k, f, block_m, dtype, w_fmt
):
    rng = np.random.default_rng(pairs * experts + k)
    t, xp, args, want = _case(rng, pairs, experts, k, f, block_m, dtype, w_fmt, absent=(1,))
    out = KERNELS[kernel](xp, args[0], t.tile_expert, t.tiles_used, *args[1:], block_m=block_m)
    got = np.asarray(out.astype(jnp.float32))[np.asarray(t.rows)]
    tol = TOLERANCE[jnp.dtype(dtype)] * 10
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
    ref = _groups.grouped_matmul_reference(
        xp, args[0], t.tile_expert, t.tiles_used, *args[1:], block_m=block_m
    )
    used = int(t.tiles_used[0]) * block_m
    np.testing.assert_allclose(
        np.asarray(out[:used], np.float32), np.asarray(ref[:used], np.float32), rtol=tol, atol=tol
    )


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_step_whose_pairs_name_no_expert_computes_nothing(kernel):
    # every pair another device's (expert parallelism): no tile used, no weight read
    t = _groups.expert_tiles(jnp.full((5,), 4, jnp.int32), 4, 16)
    assert int(t.tiles_used[0]) == 0
    w = jnp.full((4, 128, 128), jnp.nan, jnp.float32)
    xp = jnp.ones((t.tile_expert.shape[0] * 16, 128), jnp.float32)
    out = KERNELS[kernel](xp, w, t.tile_expert, t.tiles_used, block_m=16)
    assert out.shape == xp.shape  # (its rows hold anything: nothing reads them)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(w=jnp.zeros((2, 64, 32), jnp.bfloat16)), "w: expected float32"),
        (dict(w=jnp.zeros((2, 32, 32), jnp.float32)), r"x, w: expected \[M, K\] and \[X, K, F\]"),
        (dict(w=jnp.zeros((2, 64, 32), jnp.int8)), r"scale: an int8 w needs f32\[2, 32\]"),
        (dict(scale=jnp.ones((2, 32))), "scale: only an int8 w takes one"),
        (dict(x=jnp.zeros((40, 64))), r"x: expected 3 tiles of block_m=16 rows \(48\), got 40"),
        (dict(tiles_used=jnp.zeros((2,), jnp.int32)), r"tiles_used: expected shape \(1,\)"),
        (dict(block_m=12), "block_m: expected"),
    ],
)
@pytest.mark.parametrize("kernel", KERNELS)
def test_each_kernel_names_the_argument_it_refuses(kernel, change, message):
    kw = dict(
        x=jnp.zeros((48, 64)),
        w=jnp.zeros((2, 64, 32)),
        tile_expert=jnp.zeros((3,), jnp.int32),
        tiles_used=jnp.ones((1,), jnp.int32),
        scale=None,
        block_m=16,
    )
    kw.update(change)
    if kw["block_m"] == 12:  # (neither a power of two nor a multiple of 8)
        kw["x"] = jnp.zeros((36, 64))
    block_m = kw.pop("block_m")
    args = [kw[n] for n in ("x", "w", "tile_expert", "tiles_used", "scale")]
    with pytest.raises(ValueError, match=message):
        KERNELS[kernel](*args, block_m=block_m)


def test_the_gpu_kernel_refuses_widths_16_does_not_divide():
    t = _groups.expert_tiles(jnp.zeros((3,), jnp.int32), 2, 16)
    xp = jnp.zeros((t.tile_expert.shape[0] * 16, 24))
    with pytest.raises(ValueError, match=r"w: expected K and F multiples of 16, got \[24, 32\]"):
        _gpu(xp, jnp.zeros((2, 24, 32)), t.tile_expert, t.tiles_used, block_m=16)


@pytest.mark.parametrize("kernel", ["gpu", "tpu"])
@pytest.mark.parametrize("fmt", ["bfloat16", "int8"])
def test_the_pallas_way_gives_the_ragged_way_s_sums(kernel, fmt):
    # a mixture's whole block (gate, up, the unit, down, the weighted sum) through each
    # kernel; int8 experts read as int8 with their column scales
    rng = np.random.default_rng(7)
    T, H, F, X, K = 12, 128, 256, 8, 2
    x = jnp.asarray(rng.normal(size=(T, H)), jnp.bfloat16)
    logits = jnp.asarray(rng.normal(size=(T, X)), jnp.float32)
    weights, ids = moe.route(logits, K, normalize=True)
    ws = [rng.normal(size=s).astype(np.float32) * 0.1 for s in ((X, H, F), (X, H, F), (X, F, H))]
    if fmt == "int8":
        qs = [quantize_int8(w, axis=-2) for w in ws]
        scales = tuple(jnp.asarray(s) for _, s in qs)
        ours_w = [jnp.asarray(q) for q, _ in qs]
        floats = [jnp.asarray(q.astype(np.float32) * s[:, None], jnp.bfloat16) for q, s in qs]
    else:
        scales, ours_w = None, [jnp.asarray(w, jnp.bfloat16) for w in ws]
        floats = ours_w
    if kernel == "tpu":
        with pltpu.force_tpu_interpret_mode():
            got = moe.pallas_products(x, weights, ids, *ours_w, scales=scales, kernel="tpu")
    else:
        got = moe.pallas_products(x, weights, ids, *ours_w, scales=scales, kernel="gpu")
    want = moe.expert_products(x, weights, ids, *floats, way="ragged")
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), atol=3e-2, rtol=3e-2
    )


def test_the_sparse_block_reads_int8_column_experts_as_int8_on_the_pallas_way(monkeypatch):
    # experts quantized as for an accelerator (a scale per column): the "pallas" way hands
    # the kernel the int8 weights, and gives what their dequantized floats give
    from flax import nnx

    block = moe.SparseMoE(
        64,
        32,
        4,
        2,
        normalize=True,
        act="silu",
        rngs=nnx.Rngs(0),
        dtype=None,
        param_dtype=jnp.float32,
    )
    with monkeypatch.context() as m:  # a scale per column, as for an accelerator
        m.setattr(moe, "int8_group", lambda w, axis: None)
        block.experts.quantize("int8")
    assert block.experts.column_int8()
    seen = []
    real = moe.pallas_products

    def spy(*a, scales=None, **kw):
        seen.append(None if scales is None else a[3].dtype)
        return real(*a, scales=scales, **kw)

    monkeypatch.setattr(moe, "pallas_products", spy)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 64)), jnp.float32)
    with moe.expert_way("pallas"):
        got = block(x)
    with moe.expert_way("ragged"):
        want = block(x)
    assert seen == [jnp.int8]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)


EXPERT_PARALLEL = """
import jax, jax.numpy as jnp, numpy as np
from paged_jax.models.layers import moe
rng = np.random.default_rng(3)
T, H, F, X, K = 10, 32, 48, 8, 2
x = jnp.asarray(rng.normal(size=(T, H)), jnp.float32)
weights, ids = moe.route(jnp.asarray(rng.normal(size=(T, X)), jnp.float32), K, normalize=True)
ws = [jnp.asarray(rng.normal(size=s) * 0.2, jnp.float32) for s in ((X, H, F), (X, H, F), (X, F, H))]
want = moe.expert_products(x, weights, ids, *ws, way="ragged")
mesh = jax.make_mesh((2,), ("tp",), axis_types=(jax.sharding.AxisType.Explicit,))
split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("tp"))
whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
ws = [jax.device_put(w, split) for w in ws]
x, weights, ids = (jax.device_put(a, whole) for a in (x, weights, ids))
with jax.set_mesh(mesh):
    got = jax.jit(lambda *a: moe.expert_parallel_products(*a, way="pallas"))(x, weights, ids, *ws)
print(float(np.abs(np.asarray(got) - np.asarray(want)).max()))
"""


def test_the_pallas_way_under_expert_parallelism_gives_one_device_s_sums():
    # 2 fake CPU devices, 4 experts each: each device's kernel multiplies its own experts'
    # pairs only (the others' ids name no expert of its tiles), one all-reduce adds them
    import os
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run(
        [sys.executable, "-c", EXPERT_PARALLEL], capture_output=True, text=True, env=env,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.strip().splitlines()[-1]) < 1e-4


def test_an_unknown_kernel_is_refused_by_name():
    from paged_jax import linear

    x, ids = jnp.zeros((2, 16)), jnp.zeros((2, 1), jnp.int32)
    w = jnp.zeros((2, 16, 16))
    with pytest.raises(ValueError, match="kernel: expected 'gpu' or 'tpu', got 'cuda'"):
        moe.pallas_products(x, jnp.ones((2, 1)), ids, w, w, w, kernel="cuda")
    with pytest.raises(ValueError, match="kernel: expected 'gpu' or 'tpu', got 'mosaic'"):
        linear.least_tile_rows("mosaic", jnp.float32)
