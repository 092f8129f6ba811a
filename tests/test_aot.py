"""The kernels built ahead of time for real hardware, on a CPU host.

* TPU: every kernel lowers through Mosaic (Pallas' TPU lowering + MLIR verification) for
  TPU v5e and v6e.
* GPU: every kernel lowers to Triton IR for CUDA, and (with the ``triton`` package, in the
  test extra) compiles to an sm_90 cubin that fits a Hopper SM's shared memory, without
  register spills for 16- and 8-bit pools, on bf16/f16 tensor cores.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from paged_jax.kernels.gpu import aot as gpu_aot
from paged_jax.kernels.tpu import aot as tpu_aot

TPU_CASES = tpu_aot.standard_cases()
GPU_CASES = gpu_aot.standard_cases()


# (the pools with 1-4 kv heads behind -m slow: .ci/tpu_compile compiles every case anyway)
@pytest.mark.parametrize("kind", tpu_aot.TPU_KINDS)
@pytest.mark.parametrize(
    "label",
    [
        pytest.param(label, marks=pytest.mark.slow) if label.split()[-1].startswith("K") else label
        for label in TPU_CASES
    ],
)
def test_tpu_kernels_lower_through_mosaic(label, kind):
    fn, args = TPU_CASES[label]
    expected = 2 if label.startswith("kv_write int8") else 1  # rows + scale rows
    assert tpu_aot.lower_to_mosaic(fn, *args, device_kind=kind) == expected


def test_tpu_lowering_check_rejects_what_mosaic_rejects():
    # The construct this check first caught (a strided slice of a VMEM value) must still
    # fail here, or the check has stopped checking.
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...][0::2, :]

    def fn(x):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
            compiler_params=pltpu.CompilerParams(),
        )(x)

    with pytest.raises(Exception, match="strided"):
        tpu_aot.lower_to_mosaic(fn, jax.ShapeDtypeStruct((16, 128), jnp.float32))


@pytest.mark.parametrize("label", list(GPU_CASES))
def test_gpu_kernels_lower_to_triton(label):
    fn, args = GPU_CASES[label]
    (module,) = gpu_aot.lower_to_triton(fn, *args)
    kind = label.split()[0]
    names = {"decode": "paged_flash_decode", "ragged": "paged_ragged_attention"}
    names |= {"fp8_rows": "fp8_rows", "grouped_matmul": "grouped_matmul_gpu"}
    assert module.name == names.get(kind, "few_row_" + kind.replace("_groups", ""))
    if kind in ("decode", "ragged"):  # attention: dots in 4 warps
        assert "tt.dot" in module.ttir and module.num_warps == 4
    elif kind != "fp8_rows":  # the products: dots (8 warps for a block of 128 rows or more)
        assert "tt.dot" in module.ttir and module.num_warps in (4, 8)


@pytest.fixture(scope="module")
def sm90_reports():
    if not gpu_aot.triton_available():
        pytest.skip("needs the triton package (pip install -e '.[test]' installs it)")
    return {
        label: gpu_aot.compile_sm90(gpu_aot.lower_to_triton(fn, *args)[0])
        for label, (fn, args) in GPU_CASES.items()
    }


def test_gpu_kernels_compile_for_sm90_within_the_sm(sm90_reports):
    for label, r in sm90_reports.items():
        assert r.fits, f"{label}: {r.shared_bytes} B of shared memory"
        assert r.blocks_per_sm >= 2 or "float32 D256" in label, (label, r)
        dtype = label.split()[1]
        f32 = dtype == "float32"
        assert r.spill_bytes <= (256 if f32 else 0), (label, r.spill_bytes)
        # Tensor cores: 16-bit operands for 16-bit queries (quantized pools are widened to
        # the bf16 queries), three TF32 passes for f32. mma.sync spells the types
        # ".bf16.bf16.f32"; Hopper's wgmma (64-row blocks: the ragged kernel's bf16
        # default) spells them ".f32.bf16.bf16".
        if label.startswith("fp8_rows"):  # no product: no tensor-core instruction
            assert not r.mma, (label, r.mma)
            continue
        operand = {"float32": "tf32", "float16": "f16"}.get(dtype, "bf16")
        spellings = (f".{operand}.{operand}.f32", f".f32.{operand}.{operand}")
        assert any(w in m for m in r.mma for w in spellings), (label, r.mma)


def test_decode_benchmark_shape_fits_three_blocks_per_sm(sm90_reports):
    # Hq 32, Hkv 8, D 128, bf16, page 16: 64 tokens per block, ~68 KiB of shared memory.
    r = sm90_reports["decode bfloat16 D128 P16 G4"]
    assert r.blocks_per_sm >= 3 and r.registers <= 168, r


def test_sm90_check_rejects_an_oversized_block(sm90_reports):
    # 256 tokens of bf16 K/V per block: what the check exists to catch before a launch.
    fn, args = gpu_aot._decode_case(pages_per_block=16)
    r = gpu_aot.compile_sm90(gpu_aot.lower_to_triton(fn, *args)[0])
    assert not r.fits and r.blocks_per_sm == 0 and r.shared_bytes > gpu_aot.SM90_SHARED_LIMIT


def test_benchmark_tuning_grid_compiles_for_sm90(sm90_reports):
    # python -m benchmarks kernels --tune sweeps these on a GPU; none may fail to launch.
    from benchmarks.bench_kernels import TUNE_GRID

    for knobs in TUNE_GRID:
        fn, args = gpu_aot._decode_case(seqs=64, pages=256, **knobs)
        r = gpu_aot.compile_sm90(gpu_aot.lower_to_triton(fn, *args)[0])
        assert r.fits and r.num_warps == knobs["num_warps"], (knobs, r)


@pytest.mark.slow
def test_benchmark_ragged_grid_compiles_for_sm90_without_spills(sm90_reports):
    # The prefill sweep's points (bf16, the benchmark's shape) launch and keep their
    # registers: the walk loading ahead is swept at 8 warps only (at 4 it spills).
    from benchmarks.bench_kernels import RAGGED_TUNE_GRID
    from paged_jax.kernels.gpu import ragged_paged_attention

    assert any(k["prefetch"] for k in RAGGED_TUNE_GRID)
    for knobs in RAGGED_TUNE_GRID:
        fn, args = gpu_aot.attention_case(
            ragged_paged_attention, "ragged", seqs=8, pages=64, tokens=1024, **knobs
        )
        r = gpu_aot.compile_sm90(gpu_aot.lower_to_triton(fn, *args)[0])
        assert r.fits and r.num_warps == knobs["num_warps"], (knobs, r)
        assert r.spill_bytes == 0 or not knobs["prefetch"], (knobs, r)


@pytest.mark.slow
def test_the_gpu_session_s_draw_configurations_compile_for_sm90_without_spills(sm90_reports):
    # benchmarks/gpu_session.sh's draw stage times the sampling kernel at these
    # configurations (chunks loaded 0-8 ahead): at 256 rows of 128,256 logits each must
    # launch without spilling registers.
    import pathlib
    import re

    import jax.numpy as jnp

    from benchmarks.bench_draw import _config
    from paged_jax.kernels.gpu.sample import restricted_draw

    script = pathlib.Path(__file__).parents[1] / "benchmarks" / "gpu_session.sh"
    configs = re.search(r"DRAW_ARGS---configs ([^}]*)\}", script.read_text()).group(1).split()
    assert any(_config(c)[3] > 1 for c in configs), configs
    S = jax.ShapeDtypeStruct
    R, V = 256, 128256
    args = [S((R, V), jnp.float32), S((R,), jnp.int32), *[S((R,), jnp.float32)] * 2]
    args.append(S((R, 1), jnp.float32))
    for text in configs:
        block, bits, warps, ahead = _config(text)

        def fn(*a, block=block, bits=bits, warps=warps, ahead=ahead):
            return restricted_draw(*a, block=block, bits=bits, num_warps=warps, prefetch=ahead)

        r = gpu_aot.compile_sm90(gpu_aot.lower_to_triton(fn, *args)[0])
        assert r.fits and r.spill_bytes == 0 and r.blocks_per_sm >= 1, (text, r)


@pytest.mark.slow
def test_benchmark_short_context_grid_compiles_for_sm90(sm90_reports):
    # The short-context sweep (splits, 1-8 page blocks, one stage, the walk loading ahead)
    # at the engine workload's shape: 256 sequences of 16 pages (256 tokens); every point
    # must launch (33 compiles: behind -m slow, which CI runs for this file).
    from benchmarks.bench_kernels import SHORT_TUNE_GRID

    assert {k["num_splits"] for k in SHORT_TUNE_GRID} >= {1, 2}
    for knobs in SHORT_TUNE_GRID:
        fn, args = gpu_aot._decode_case(seqs=256, pages=16, **knobs)
        r = gpu_aot.compile_sm90(gpu_aot.lower_to_triton(fn, *args)[0])
        assert r.fits and r.num_warps == knobs["num_warps"], (knobs, r)
