"""The kernels a decode step launches on an NVIDIA GPU, counted on a machine without one.

``python -m benchmarks step_kernels [--out DIR] [--gpu h200] [--model llama3-8b]
[--seqs 64] [--context 192] [--variants bf16 bf16-prefetch fp8 fp8-weight-only int8
int8-kernel int4 lora8]
[--layers 2 4]``, written to ``step_kernels_<gpu>.json``.

Needs JAX's CUDA plugin (``pip install "jax[cuda12]==<your jax>"`` in a virtual
environment of its own: about 5 GB), not a GPU; runs with JAX 0.10 and 0.11 (which lowers
the Pallas calls against an abstract GPU, as ``paged_jax.kernels.gpu.aot`` does). XLA:GPU
compiles for a GPU described by its properties (``GPUS``: an H100 or H200 as a
``GpuDeviceInfoProto``; JAX's ``topologies.get_topology_desc``) with the whole of its
pipeline, Triton's GEMM fusions and the Pallas kernels included, but with no device to
autotune on: GEMM configurations (split-K, tiles) are its heuristics, and there is no cost
analysis. So this measures a
step's structure, not its speed: how many kernels a layer takes, and which. On an H200 a
decode step's kernel costs a few microseconds beyond its bytes
(``benchmarks/results/products_chain_h200.json``), so at 64 sequences a kernel more a
layer is about 0.1 ms a Llama-3-8B step.

The step is the model's forward (``LlamaForCausalLM.__call__`` held as the engine holds a
model off the CPU: ``hold_for_accelerator``, layers unrolled, ``pallas_gpu`` attention)
for ``--seqs`` sequences at ``--context`` tokens, one new token each, from a model built
from shapes alone (nothing allocated). Kernels a layer: the difference between the
compiled step at ``--layers`` (two layer counts) over the difference of layers; the rest
(embedding, final norm, head) is reported apart. Variants: ``bf16``; ``bf16-prefetch``
(the decode kernel's walk loading ahead, ``tuning.DECODE_PREFETCH``); ``fp8`` (W8A8,
rows quantized to fp8 too, the weight held ``[out, in]``), ``fp8-weight-only`` and
``int8`` (W8A16, XLA's dots); ``int8-kernel`` (W8A16 through the few-row Pallas product,
``models.layers.KERNELS["w8a16"]``); ``int4`` (groups of 32); ``lora8`` (8 adapter
slots of rank 16 on every projection, every row using one).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import time

from benchmarks.common import (
    _version,
    environment,
    positive_int,
    progress,
    table,
    write_result,
)

# GPUs described as XLA's GpuDeviceInfoProto wants them (facts from NVIDIA's data sheets:
# 132 SMs, 228 KiB of shared memory and 64 Ki registers an SM, compute capability 9.0).
_HOPPER = """gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {memory}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 7 }}
runtime_version {{ major: 12 minor: 8 }}
device_description_str: "{name}"
"""
GPUS = {
    "h100": _HOPPER.format(bandwidth=3350000000000, memory=85000000000, name="NVIDIA H100"),
    "h200": _HOPPER.format(bandwidth=4800000000000, memory=150000000000, name="NVIDIA H200"),
}
VARIANTS = (
    "bf16",
    "bf16-prefetch",
    "fp8",
    "fp8-weight-only",
    "int8",
    "int8-kernel",
    "int4",
    "lora8",
)
# Ops of a compiled HLO module's entry computation that launch nothing.
_NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}
_OP = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*(\([^()]*\)|\S+)\s+([\w-]+)\(")


def kernels_of(hlo: str) -> list[tuple[str, str, str]]:
    """The kernels of a compiled module's text (``Compiled.as_text()``) in launch order:
    ``(name, kind, result shape)`` for each op of its ENTRY computation that is not a
    parameter, constant, tuple, get-tuple-element or bitcast; ``kind`` is the op, or for a
    fusion its kind (``kLoop``, ``kInput``, ``kCustom``: Triton GEMMs, Pallas calls...)
    and for a custom call its target."""
    start = hlo.index("\nENTRY ")
    end = hlo.find("\n}\n", start)
    body = hlo[start : end if end >= 0 else None].splitlines()[1:]
    out = []
    for line in body:
        m = _OP.match(line)
        if not m or m.group(3) in _NOT_KERNELS:
            continue
        name, shape, op = m.groups()
        kind = op
        if op == "fusion":
            k = re.search(r"\bkind=(\w+)", line)
            kind = f"fusion:{k.group(1)}" if k else op
        elif op == "custom-call":
            t = re.search(r'custom_call_target="([^"]+)"', line)
            kind = f"custom-call:{t.group(1)}" if t else op
        out.append((name, kind, shape))
    return out


def _commit() -> str | None:
    """This checkout's commit (``git rev-parse HEAD``), or None outside a git checkout."""
    import subprocess

    try:
        r = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=os.path.dirname(os.path.abspath(__file__)),
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() or None


def _topology(gpu: str):
    import jax
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="cuda", target_config=GPUS[gpu], topology="1x1x1")
    return jax.sharding.SingleDeviceSharding(topo.devices[0])


def compile_step(fields: dict, variant: str, sharding, *, seqs: int, context: int, page=16):
    """The compiled decode step (``jax.stages.Compiled``) of a model of config ``fields``
    in ``variant`` for ``sharding``'s device, and its compile seconds."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from benchmarks.engine_roofline import abstract_decode_step
    from paged_jax import models

    cfg = models.LlamaConfig(**fields)
    lora = variant == "lora8"

    def make():
        m = models.LlamaForCausalLM(
            cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16
        )
        if variant in ("fp8", "fp8-weight-only", "int8", "int8-kernel", "int4"):
            m.quantize("fp8" if variant.startswith("fp8") else variant.removesuffix("-kernel"))
        if lora:
            m.enable_lora(8, 16)
        return m.hold_for_accelerator(fp8_activations=variant == "fp8")

    graphdef, state, cache, batch, md = abstract_decode_step(make, seqs, context, page)
    tokens = jnp.asarray(batch.token_ids)
    # every row on an adapter (slot 1 + row % 8): the step a LoRA batch compiles
    ids = jnp.asarray(1 + jnp.arange(tokens.shape[0]) % 8, jnp.int32)

    def step(state, tokens, positions, cache, ids):
        model = nnx.merge(graphdef, state)
        return model(
            tokens, positions, cache, md, backend="pallas_gpu", adapter_ids=ids if lora else None
        )

    args = (state, tokens, jnp.asarray(batch.positions), cache, ids)
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args)
    from paged_jax.kernels.gpu import tuning
    from paged_jax.models.layers import KERNELS

    saved = KERNELS["w8a16"], tuning.DECODE_PREFETCH
    KERNELS["w8a16"] = dataclasses.replace(
        saved[0], platforms=("gpu",) if variant == "int8-kernel" else ()
    )
    tuning.DECODE_PREFETCH = variant == "bf16-prefetch"
    t = time.perf_counter()
    try:
        lowered = _lower(jax.jit(step, donate_argnums=(3,)), args)
    finally:
        KERNELS["w8a16"], tuning.DECODE_PREFETCH = saved
    compiled = lowered.compile()
    return compiled, time.perf_counter() - t


def _lower(fn, args):
    """``fn.lower(*args)``; with JAX >= 0.11, whose Pallas calls ask which GPU to target,
    traced under an abstract GPU mesh and lowered for CUDA."""
    import jax

    try:
        return fn.lower(*args)
    except RuntimeError as err:
        if "abstract" not in str(err).lower():
            raise
        from paged_jax.kernels.gpu import aot

        with jax.sharding.use_abstract_mesh(aot._abstract_gpu_mesh()):
            return fn.trace(*args).lower(lowering_platforms=("cuda",))


def per_layer(kernels: dict[int, list], layers: tuple[int, int]) -> dict:
    """Kernels a layer and outside the layers, from the kernels of the step at two layer
    counts (``kernels[n]``: ``kernels_of``'s list): totals, and per kind."""
    lo, hi = layers
    span = hi - lo
    kinds = {n: collections.Counter(k for _, k, _ in ks) for n, ks in kernels.items()}
    each = (len(kernels[hi]) - len(kernels[lo])) / span
    by_kind = {
        k: (kinds[hi][k] - kinds[lo][k]) / span
        for k in sorted(set(kinds[hi]) | set(kinds[lo]))
        if kinds[hi][k] != kinds[lo][k]
    }
    return {
        "kernels_per_layer": each,
        "kernels_outside_layers": len(kernels[lo]) - each * lo,
        "per_layer_by_kind": by_kind,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks step_kernels", description=__doc__)
    p.add_argument("--gpu", choices=sorted(GPUS), default="h200")
    p.add_argument("--model", default="llama3-8b", help="a shape of bench_engine's SHAPE_FIELDS")
    p.add_argument("--seqs", type=positive_int, default=64)
    p.add_argument("--context", type=positive_int, default=192)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--layers", nargs=2, type=positive_int, default=[2, 4])
    p.add_argument(
        "--show", action="store_true", help="print each step's kernels in order (the fewer layers)"
    )
    args = p.parse_args(argv)
    if args.layers[0] >= args.layers[1]:
        p.error(f"--layers: expected two counts, the first smaller, got {args.layers}")
    from benchmarks.engine_roofline import SHAPE_FIELDS

    if args.model not in SHAPE_FIELDS:
        p.error(f"--model: expected one of {', '.join(SHAPE_FIELDS)}, got {args.model!r}")
    # Before JAX starts: no GPU is to be used (nor looked for), and XLA, not the CPU
    # kernels, runs every op of the step (they are registered for the CPU only).
    os.environ["CUDA_VISIBLE_DEVICES"] = "-1"
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    os.environ["PAGED_JAX_BACKEND"] = "xla"
    try:
        sharding = _topology(args.gpu)
    except Exception as e:  # no CUDA plugin: JAX says "topology not implemented for cuda"
        import jax

        print(
            f"step_kernels: cannot describe a CUDA device to XLA ({type(e).__name__}: {e}).\n"
            f'It needs JAX\'s CUDA plugin: pip install "jax[cuda12]=={jax.__version__}" '
            "(a virtual environment of its own is best: about 5 GB)."
        )
        return 2
    from paged_jax.models import quantization

    # The model is quantized for the GPU it is compiled for, not for this process's
    # default device (the CPU: int8 grouping differs there).
    quantization._target_platform = lambda: "gpu"

    fields_all = SHAPE_FIELDS[args.model]
    rows = []
    shown = {}
    with progress(len(args.variants) * 2, "compiling for " + args.gpu) as bar:
        for variant in args.variants:
            kernels, seconds = {}, {}
            for n in args.layers:
                compiled, seconds[n] = compile_step(
                    dict(fields_all, num_layers=n),
                    variant,
                    sharding,
                    seqs=args.seqs,
                    context=args.context,
                )
                kernels[n] = kernels_of(compiled.as_text())
                bar.advance()
            row = {"variant": variant, **per_layer(kernels, tuple(args.layers))}
            row["compile_s"] = {str(n): round(s, 2) for n, s in seconds.items()}
            rows.append(row)
            shown[variant] = kernels[args.layers[0]]
    print(
        table(
            [
                {
                    "variant": r["variant"],
                    "kernels a layer": r["kernels_per_layer"],
                    "outside the layers": r["kernels_outside_layers"],
                }
                for r in rows
            ],
            ["variant", "kernels a layer", "outside the layers"],
        )
    )
    if args.show:
        for variant, ks in shown.items():
            print(f"\n{variant}, {args.layers[0]} layers: the step's kernels in order")
            for name, kind, shape in ks:
                print(f"  {kind:28s} {shape:44s} {name}")
    import jax

    path = write_result(
        f"step_kernels_{args.gpu}",
        {
            "environment": environment()
            | {
                "jax": jax.__version__,
                "jaxlib": _version("jaxlib"),
                "cuda_plugin": _version("jax-cuda12-plugin") or _version("jax-cuda13-plugin"),
                "commit": _commit(),
            },
            "gpu": args.gpu,
            "model": args.model,
            "seqs": args.seqs,
            "context": args.context,
            "layers": args.layers,
            "what": "kernels of the compiled decode step (model forward, pallas_gpu "
            "attention, layers unrolled), XLA:GPU without autotuning, no GPU used",
            "rows": rows,
        },
    )
    print(f"\nwritten {path}")
    return 0
