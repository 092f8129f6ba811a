#!/usr/bin/env bash
# What a session with an NVIDIA GPU runs, from the repository root, in as few long commands
# as the lease allows:   OUT=DIR bash benchmarks/gpu_session.sh STAGE...
#
# The next session's first call (planned 2026-11-29; about 9 minutes): the kernels changed
# since the last GPU (the decode kernel's one-split way, the grouped 4-/8-bit products, the
# fp8 rows kernel) tested compiled, then issue 55's and 52's goals:
#   OUT=gpu-out KERNEL_TESTS_MARK="not slow" QUANT_FORMATS="none fp8 int4" \
#   QUANT_ARGS="--models llama3-8b --concurrency 64 --repeats 3" \
#   bash benchmarks/gpu_session.sh install kernels models lora quantized
# The second (about 6 minutes): the two kernel switches prepared since, each way in the
# engine, bash benchmarks/gpu_session.sh ab (the decode kernel's walk loading a block ahead,
# tuning.DECODE_PREFETCH, at 64 and 256 sequences: attention took 3.18 ms of the 8B step's
# 10.08 at 256 sequences x 192 tokens on the H200, 42% of its bandwidth, and 1.36 of 5.6 at
# 64, 25%; and int8 W8A16 through the few-row product, models.layers.KERNELS["w8a16"],
# at 64: issue 52's int8 goal). Flip whichever wins. With minutes left:
# BENCH_ARGS="--tune --contexts 256 --batches 64 256 --tune-contexts 256 --no-prefill" ...
# bench (the decode kernel's knobs at short contexts: splits, 1-8 page blocks, one stage, the
# walk ahead), PRODUCTS_ARGS="--formats int4 int8 --no-separate --pallas 64:128:4:3
# 64:128:4:3:p 64:256:4:2:p --pallas-formats int8" ... products, and sampled.
# Issue 83 (mixtures of experts), on an H200 if the lease has one (61 GB of bf16 weights):
# bash benchmarks/gpu_session.sh moe (the mixtures' tests on the GPU, GPT-OSS's sinks in
# the Triton kernels among them; then the Qwen3-30B-A3B shape's tokens/s at 64 and 256
# requests, each expert way; MOE_ARGS="--concurrency 64 --repeats 3" on an H100). Set
# moe.EXPERT_WAYS["gpu"] to the way that wins.
#
#   install  pip install --no-deps --no-build-isolation -e . (offline: the GPU machines have
#            no package index; paged_jax.models and paged_jax.kernels exist only once
#            installed). Every other stage runs it first when `import paged_jax.kernels` fails.
#   env      versions (driver, CUDA, JAX, jaxlib, triton, flax, torch) and the device
#   kernels  tests/test_pallas_gpu.py, tests/test_pallas_mosaic_gpu.py (default and slow grids)
#            tests/test_kernels_in_model.py and the sampling kernel's tests in
#            tests/test_sampling.py, the kernels compiled for the GPU (interpret=False)
#   models   model, engine, fault, kernel and batch-invariance tests with
#            PAGED_JAX_BACKEND=pallas_gpu (issue 57's list), the weight-reads test and
#            the prompt log-probs' (their extra logits rows in the compiled step) and the
#            embeddings' (the hidden-state steps on their own pool)
#   dispatch python -m benchmarks dispatch (does a dispatched step overlap the host's work:
#            the engine's step loop modelled without the engine, way by way)
#   products python -m benchmarks products (a layer's products: each projection its own
#            weight against q/k/v and gate/up fused, Llama-3-8B shape, 64 and 256 rows;
#            PRODUCTS_ARGS='--formats int4' adds 4-bit groups: XLA on the dequantized
#            weight against the Pallas kernel, pallas_kernels/gpu/matmul.matmul_int4)
#   draw     python -m benchmarks draw (restricted rows drawn each way sample_rows can: the
#            candidates and full sort, the XLA radix passes, the Pallas kernel at DRAW_ARGS,
#            default: its configuration beside five that load chunks ahead, 1 to 8 of them,
#            each compiled for sm_90 within 2 programs a SM at 256 rows (1 at 16 warps); on
#            a GPU the split way, pallas_gpu_split, is timed beside them)
#   bench    python -m benchmarks kernels --tune  (decode + ragged prefill, tuning sweeps)
#            (BENCH_ARGS='--tune --contexts 256 --batches 64 256 --tune-contexts 256 --no-prefill':
#            the decode kernel's knobs at the engine workload's short contexts)
#   engine   python -m benchmarks engine --layout both  (Llama-3-8B / SmolLM2-135M shapes:
#            tokens/s and the roofline fraction, the engine's layout beside the scanned one)
#   speculative  python -m benchmarks speculative --verify-cost (Llama-3-8B shape: a verify
#            step of k proposals per sequence against a decode step, 1 to 64 sequences)
#   quantized  python -m benchmarks engine --quantization none fp8 fp8-weight-only int8 int4
#            --no-split (the 8B shape with 8-bit and 4-bit weights beside bf16, 64 and 256
#            requests; fp8 W8A8 where the GPU has fp8 units, and weight-only; int4 through
#            the Pallas kernel; QUANT_FORMATS picks formats, QUANT_ARGS the rest)
#   lora     python -m benchmarks engine --lora-adapters 0 8 --no-split (the 8B shape, 64
#            requests spread over 8 random rank-16 adapters beside the base engine; LORA_ARGS)
#   ab       python -m benchmarks engine --decode-prefetch off on (the 8B shape, 64 and 256
#            requests), then --quantization int8 --w8a16-kernel off on (64 requests): the
#            switches not yet timed, each way (AB_ARGS replaces the models, concurrencies
#            and repeats of both)
#   flags    python -m benchmarks products --rows 64 --no-separate once per XLA_FLAG_SETS entry
#            (a |-separated list of XLA_FLAGS values; default: none, PDL off, PDL launches
#            on, command buffers off; OpenXLA's main turns both PDL flags on for Hopper,
#            what jaxlib 0.11.2 does is what the first two rows tell): does launching the
#            next kernel early shorten the ~9 us each of a 64-row step's products costs
#            beyond its bytes (products_chain_h200.json)? Each set in a process of its own
#   moe      the mixtures' tests on the GPU (tests/test_moe.py, tests/test_gpt_oss.py: every
#            way's tokens, the layouts held for a device, GPT-OSS's sinks through XLA;
#            tests/test_grouped_kernels.py: the Pallas grouped product compiled), then
#            python -m benchmarks engine --models qwen3-30b-a3b --expert-way ragged pallas
#            dense gather (issue 83: the Qwen3-30B-A3B shape's tokens/s and roofline fraction at
#            64 and 256 requests, each way its experts' products can take; 61 GB of bf16
#            weights: an H200, or an H100 with MOE_ARGS at one concurrency; MOE_ARGS)
#   sampled  python -m benchmarks engine --top-p 0.9 --sort-free default pallas_gpu_split
#            (the 8B shape, 256 requests sampled at top-p 0.9 beside greedy, with the
#            decode step's split, the default kernel and the split one; SAMPLED_ARGS)
#
# Logs and result files go to $OUT (default gpu-out/). Every stage has a time limit
# (seconds, STAGE_LIMIT_<stage> overrides) so a hang cannot eat a lease. KERNEL_TESTS_MARK
# (default "slow or not slow"), BENCH_ARGS (default --tune), ENGINE_ARGS, SPEC_ARGS, DISPATCH_ARGS,
# PRODUCTS_ARGS, DRAW_ARGS, QUANT_ARGS, LORA_ARGS and SAMPLED_ARGS pass through.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
PY=${PYTHON:-python3}

install() {
  $PY -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -n 5
  $PY -c "import paged_jax.kernels, paged_jax.models" || { echo "install failed" >&2; exit 3; }
}
case " $* " in
  *" install "*) ;;
  *) $PY -c "import paged_jax.kernels, paged_jax.models" 2>/dev/null || install ;;
esac

limit() { local v="STAGE_LIMIT_$1"; echo "${!v:-$2}"; }
run() {  # run NAME LIMIT CMD...: tee to $OUT/NAME.log, report rc and seconds
  local name=$1 lim=$2; shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${lim}s): $*"
  timeout "$lim" "$@" 2>&1 | tee "$OUT/$name.log" | tail -n 60
  local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc in $((SECONDS - t0))s"
}

for stage in "$@"; do
  case $stage in
    install) install ;;
    env)
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
      $PY - <<'EOF'
import importlib.metadata as m, platform
print("python", platform.python_version())
for d in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "triton", "flax", "torch",
          "transformers", "pytest", "pytest-xdist", "hypothesis", "chex"):
    try:
        print(d, m.version(d))
    except m.PackageNotFoundError:
        print(d, "-")
import jax
print(jax.devices(), jax.default_backend())
EOF
      ;;
    kernels)
      XLA_PYTHON_CLIENT_PREALLOCATE=false run kernels "$(limit kernels 200)" \
        $PY -m pytest -q -p no:cacheprovider -n 8 -m "${KERNEL_TESTS_MARK:-slow or not slow}" \
        --durations=5 -rf \
        tests/test_pallas_gpu.py tests/test_pallas_mosaic_gpu.py tests/test_kernels_in_model.py \
        tests/test_bad_tables.py tests/test_batch_invariance.py tests/test_gpu_matmul.py \
        tests/test_gpu_rows.py
      XLA_PYTHON_CLIENT_PREALLOCATE=false run kernels_sampling "$(limit kernels 200)" \
        $PY -m pytest -q -p no:cacheprovider -rf tests/test_sampling.py -k "sort_free or vocabulary_order"
      ;;
    models)
      # (cpu too: tests of the CPU's own layouts pin themselves to CPU devices)
      JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_PREALLOCATE=false PAGED_JAX_BACKEND=pallas_gpu \
        run models "$(limit models 200)" \
        $PY -m pytest -q -p no:cacheprovider -n 8 --durations=5 -rf \
        tests/test_models.py tests/test_engine.py tests/test_kernels_in_model.py \
        tests/test_engine_faults.py tests/test_pallas_gpu.py tests/test_batch_invariance.py \
        tests/test_weight_reads.py tests/test_prompt_logprobs.py tests/test_embeddings.py \
        tests/test_quantization.py::test_grouped_products_on_a_gpu_take_the_kernel_that_reads_them_as_they_lie \
        tests/test_quantization.py::test_fp8_rows_of_qkv_o_and_down_take_one_kernel_each_on_a_gpu \
        tests/test_quantization.py::test_w8a16_products_through_the_few_row_kernel_stay_as_near_the_floats_as_xla_s \
        tests/test_quantization.py::test_the_engine_with_the_w8a16_kernel_gives_xla_s_tokens
      ;;
    dispatch)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 run dispatch "$(limit dispatch 120)" \
        $PY -m benchmarks dispatch --out "$OUT" ${DISPATCH_ARGS-}
      ;;
    products)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 run products "$(limit products 150)" \
        $PY -m benchmarks products --out "$OUT" ${PRODUCTS_ARGS-}
      ;;
    draw)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 run draw "$(limit draw 240)" \
        $PY -m benchmarks draw --out "$OUT" ${DRAW_ARGS---configs 2048:2:8 2048:2:8:p 2048:2:8:p4 1024:2:8:p4 512:2:4:p8 2048:2:16:p4}
      ;;
    bench)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 run bench "$(limit bench 480)" \
        $PY -m benchmarks kernels --out "$OUT" ${BENCH_ARGS---tune}
      ;;
    engine)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.85 run engine "$(limit engine 420)" \
        $PY -m benchmarks engine --out "$OUT" ${ENGINE_ARGS---layout both}
      ;;
    speculative)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.85 run speculative "$(limit speculative 300)" \
        $PY -m benchmarks speculative --verify-cost --out "$OUT" ${SPEC_ARGS---concurrency 1 4 16 64}
      ;;
    quantized)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.85 run quantized "$(limit quantized 420)" \
        $PY -m benchmarks engine --out "$OUT/quantized" --no-split \
        --quantization ${QUANT_FORMATS:-none fp8 fp8-weight-only int8 int4} \
        ${QUANT_ARGS---models llama3-8b --concurrency 64 256 --repeats 3}
      ;;
    lora)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.85 run lora "$(limit lora 240)" \
        $PY -m benchmarks engine --out "$OUT/lora" --lora-adapters 0 8 --no-split \
        ${LORA_ARGS---models llama3-8b --concurrency 64 --repeats 3}
      ;;
    ab)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.85 run ab_decode_prefetch "$(limit ab 300)" \
        $PY -m benchmarks engine --out "$OUT/ab" --no-split --decode-prefetch off on \
        ${AB_ARGS---models llama3-8b --concurrency 64 256 --repeats 3}
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.85 run ab_w8a16 "$(limit ab 200)" \
        $PY -m benchmarks engine --out "$OUT/ab_w8a16" --no-split --quantization int8 \
        --w8a16-kernel off on ${AB_ARGS---models llama3-8b --concurrency 64 --repeats 3}
      ;;
    flags)
      IFS='|' read -r -a sets <<< "${XLA_FLAG_SETS-|--xla_gpu_enable_pdl=false --xla_gpu_enable_pdl_launch=false|--xla_gpu_enable_pdl_launch=true|--xla_gpu_enable_command_buffer=}"
      for i in "${!sets[@]}"; do
        echo "--- XLA_FLAGS='${sets[$i]}'"
        XLA_FLAGS="${sets[$i]}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 run "flags_$i" "$(limit flags 90)" \
          $PY -m benchmarks products --out "$OUT/flags_$i" --rows 64 --no-separate ${FLAGS_ARGS-}
      done
      ;;
    moe)
      JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_PREALLOCATE=false run moe_tests "$(limit moe 200)" \
        $PY -m pytest -q -p no:cacheprovider -n 8 --durations=5 -rf \
        tests/test_moe.py tests/test_gpt_oss.py tests/test_sinks.py tests/test_grouped_kernels.py
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 run moe "$(limit moe 420)" \
        $PY -m benchmarks engine --out "$OUT/moe" --no-split --models qwen3-30b-a3b \
        --expert-way ragged pallas dense gather ${MOE_ARGS---concurrency 64 256 --repeats 3}
      ;;
    sampled)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.85 run sampled "$(limit sampled 300)" \
        $PY -m benchmarks engine --out "$OUT/sampled" --top-p 0.9 \
        ${SAMPLED_ARGS---models llama3-8b --concurrency 256 --repeats 3 --sort-free default pallas_gpu_split}
      ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
