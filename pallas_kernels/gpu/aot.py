"""Ahead-of-time compilation of the GPU kernels for Hopper (sm_90), on any machine.

A CPU-only machine cannot run the Triton kernels, but it can build them: JAX lowers a
``pallas_call`` for the ``"cuda"`` platform to Triton IR without a GPU, and the ``triton``
package compiles that IR to PTX and a cubin for sm_90. This catches, before any GPU is at
hand, what only a launch would otherwise show: Pallas constructs the Triton lowering
rejects, IR Triton cannot compile, shared memory beyond the 227 KiB a Hopper block may use
(the launch would fail with "out of resources"), and register spills.

* :func:`lower_to_triton` (needs only JAX): the Triton modules a function launches.
* :func:`compile_sm90` (needs ``pip install triton``): shared memory, registers, spills
  and the tensor-core instructions of one module, from Triton's compiler and ``ptxas -v``.
* ``python -m paged_jax.kernels.gpu.aot``: the report for this project's kernels at the
  benchmark's shapes and the test grid.

Caveat: XLA compiles the same IR with its own copy of Triton, whose passes and version can
differ from the ``triton`` package's, so this is strong evidence, not proof, that a kernel
launches; speed can only be measured on a GPU (``python -m benchmarks kernels``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator

import jax

from .._aot_cases import attention_case, grouped_case, sinks_case, standard_grid

# Shared memory one thread block may use on sm_90 (H100/H200): 227 KiB of the SM's 228.
SM90_SHARED_LIMIT = 227 * 1024
SM90_SHARED_PER_SM = 228 * 1024
SM90_REGISTERS_PER_SM = 65536
_ABSTRACT_GPU = "NVIDIA H100"  # what JAX >= 0.11 needs to name the target on a CPU host


@dataclasses.dataclass(frozen=True)
class TritonModule:
    """One ``pallas_call`` lowered for CUDA: its Triton IR (text) and launch parameters."""

    name: str
    ttir: str
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class SM90Report:
    """What Triton and ``ptxas`` say of one module compiled for sm_90.

    ``mma``: counts of tensor-core instructions by PTX spelling (for example
    ``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32``), empty if the dots run on
    CUDA cores. ``blocks_per_sm``: resident blocks one SM can hold, limited by shared
    memory and registers (0: the kernel cannot launch).
    """

    name: str
    shared_bytes: int
    registers: int
    spill_bytes: int
    num_warps: int
    num_stages: int
    mma: dict[str, int]

    @property
    def fits(self) -> bool:
        return self.shared_bytes <= SM90_SHARED_LIMIT

    @property
    def blocks_per_sm(self) -> int:
        if not self.fits:
            return 0
        by_smem = SM90_SHARED_PER_SM // max(1, self.shared_bytes + 1024)  # 1 KiB reserved
        by_regs = SM90_REGISTERS_PER_SM // max(1, self.registers * 32 * self.num_warps)
        return int(min(by_smem, by_regs, 32))


@contextlib.contextmanager
def _capture_triton_ir() -> Iterator[list[str]]:
    # The Triton IR is serialized as bytecode into the custom call; the text form is taken
    # where Pallas builds it (a private function: checked, so a JAX change fails loudly).
    from jax._src.pallas.triton import lowering as triton_lowering

    original = getattr(triton_lowering, "lower_jaxpr_to_triton_module", None)
    if original is None:
        raise RuntimeError(
            "this JAX has no jax._src.pallas.triton.lowering.lower_jaxpr_to_triton_module; "
            "the ahead-of-time check needs updating for it"
        )
    captured: list[str] = []

    def spy(*args, **kwargs):
        result = original(*args, **kwargs)
        captured.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    triton_lowering.lower_jaxpr_to_triton_module = spy
    try:
        yield captured
    finally:
        triton_lowering.lower_jaxpr_to_triton_module = original


def _abstract_gpu_mesh():
    device = jax.sharding.AbstractDevice(device_kind=_ABSTRACT_GPU, num_cores=132, platform="gpu")
    return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)


_CALL_RE = re.compile(
    r"custom_call @__gpu\$xla\.gpu\.triton.*?grid_x = (\d+) : i32, grid_y = (\d+) : i32, "
    r"grid_z = (\d+) : i32.*?name = \"(\w+)\", num_stages = (\d+) : i32, num_warps = (\d+)"
)


def _lower_and_capture(fn: Callable, args) -> tuple[list, list[str]]:
    with _capture_triton_ir() as captured:
        try:
            lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
        except RuntimeError as err:  # JAX >= 0.11 asks which GPU to target
            if "abstract" not in str(err).lower():
                raise
            with jax.sharding.use_abstract_mesh(_abstract_gpu_mesh()):
                lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return _CALL_RE.findall(lowered.as_text()), captured


def lower_to_triton(fn: Callable, *args) -> list[TritonModule]:
    """Lowers ``jax.jit(fn)(*args)`` for CUDA on this host and returns its Triton modules.

    ``args``: arrays or ``jax.ShapeDtypeStruct``s (nothing is computed). Raises whatever
    the Pallas Triton lowering raises for a construct it does not support.
    """
    calls, captured = _lower_and_capture(fn, args)
    if len(calls) != len(captured):
        # JAX reuses the lowering of a jitted kernel it has lowered before, and then the
        # Triton IR is not rebuilt: lower once more from empty caches.
        jax.clear_caches()
        calls, captured = _lower_and_capture(fn, args)
    if len(calls) != len(captured):
        raise RuntimeError(
            f"found {len(calls)} Triton custom calls but captured {len(captured)} modules"
        )
    return [
        TritonModule(
            name=name,
            ttir=ttir,
            num_warps=int(warps),
            num_stages=int(stages),
            grid=(int(gx), int(gy), int(gz)),
        )
        for (gx, gy, gz, name, stages, warps), ttir in zip(calls, captured, strict=True)
    ]


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError:
        return False
    return True


def _ptxas() -> str:
    from triton.backends.nvidia import compiler as nvidia

    return nvidia.get_ptxas(90).path


def compile_sm90(module: TritonModule) -> SM90Report:
    """Compiles one module to a cubin for sm_90 with the ``triton`` package and reads back
    its shared memory (Triton's metadata) and registers and spills (``ptxas -v``)."""
    import triton
    from triton.backends.compiler import GPUTarget

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # XLA fuses too; and no warning
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, f"{module.name}.ttir")
        with open(src, "w") as f:
            f.write(module.ttir)
        kernel = triton.compile(
            src,
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": module.num_warps, "num_stages": module.num_stages},
        )
        ptx = kernel.asm["ptx"]
        ptx_path = os.path.join(tmp, f"{module.name}.ptx")
        with open(ptx_path, "w") as f:
            f.write(ptx)
        log = subprocess.run(
            [_ptxas(), "-arch=sm_90a", "-v", ptx_path, "-o", os.path.join(tmp, "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    if registers is None or spills is None:
        raise RuntimeError(f"unexpected ptxas -v output:\n{log}")
    return SM90Report(
        name=module.name,
        shared_bytes=int(kernel.metadata.shared),
        registers=int(registers.group(1)),
        spill_bytes=int(spills.group(1)),
        num_warps=module.num_warps,
        num_stages=module.num_stages,
        mma=dict(Counter(re.findall(r"\b(wgmma\.[\w.]+|mma\.sync\.[\w.]+)", ptx))),
    )


def _decode_case(dtype="bfloat16", **kw):
    from .decode import decode_paged_attention

    return attention_case(decode_paged_attention, "decode", dtype, **kw)


def standard_cases() -> dict[str, tuple[Callable, list]]:
    """The report's kernels over ``standard_grid`` (both kinds); the dtype sweep of decode
    runs at the benchmark's batch 64 x 4k context (Hq 32, Hkv 8, D 128, page 16); the
    grouped products (``matmul.matmul_int4``, ``matmul_int8_groups``), the W8A16 ones
    (``matmul.matmul``) and the fp8 rows (``rows.fp8_rows``) at the Llama-3-8B shape's;
    the experts' grouped product (``grouped.grouped_matmul``) at Qwen3-30B-A3B's."""
    from .ragged import ragged_paged_attention

    cases = {}
    for label, kw in standard_grid("decode").items():
        if label.endswith("D128 P16 G4"):
            kw = dict(kw, seqs=64, pages=256)
        cases[label] = _decode_case(**kw)
    for label, kw in standard_grid("ragged").items():
        cases[label] = attention_case(ragged_paged_attention, "ragged", **kw)
    for m, n in ((64, 14336), (256, 6144)):  # 4-bit products of the Llama-3-8B shape
        cases[f"matmul_int4 {m}x4096x{n}"] = _grouped_case(4, m, 4096, n)
    cases["matmul_int8_groups 64x4096x4096"] = _grouped_case(8, 64, 4096, 4096)
    for m, n, dtype in ((64, 28672, "int8"), (256, 6144, "float8_e4m3fn")):  # W8A16
        cases[f"matmul {dtype} {m}x4096x{n}"] = _few_row_case(m, 4096, n, dtype)
    for width, act in ((4096, None), (14336, "silu")):  # W8A8 rows: o's and down's inputs
        cases[f"fp8_rows 64x{width}{' ' + act if act else ''}"] = _rows_case(64, width, act)
    cases["fp8_rows 64x4096 rms norm"] = _rows_case(64, 4096, None, norm=True)  # q/k/v's
    label = "bfloat16 D64 G8 sinks+window (GPT-OSS)"
    from .decode import decode_paged_attention

    cases[f"decode {label}"] = sinks_case(decode_paged_attention, "decode")  # merged splits
    cases[f"decode {label} one split"] = sinks_case(
        decode_paged_attention, "decode", batch_invariant=True
    )
    cases[f"ragged {label}"] = sinks_case(ragged_paged_attention, "ragged")
    from .grouped import grouped_matmul

    for dtype in ("bfloat16", "int8"):  # a Qwen3-30B-A3B decode step of 64: gate's, down's
        cases[f"grouped_matmul {dtype} 512 pairs 128x2048x768"] = grouped_case(
            grouped_matmul, dtype
        )
        cases[f"grouped_matmul {dtype} 512 pairs 128x768x2048"] = grouped_case(
            grouped_matmul, dtype, inputs=768, outputs=2048
        )
    return cases


def _rows_case(m: int, width: int, act: str | None, norm: bool = False):
    """``rows.fp8_rows`` of ``m`` bf16 rows of ``width`` values (with ``act``: of
    ``act(gate) * up`` from ``[m, 2 width]``; ``norm``: of an RMS norm's output)."""
    import jax.numpy as jnp

    from .rows import fp8_rows

    S = jax.ShapeDtypeStruct
    shape = (m, 2 * width if act else width)
    if not norm:
        return (lambda x: fp8_rows(x, act=act)), [S(shape, jnp.bfloat16)]

    def fn(x, w):
        return fp8_rows(x, norm_weight=w, eps=1e-5, dtype=jnp.bfloat16)

    return fn, [S(shape, jnp.bfloat16), S((width,), jnp.float32)]


def _few_row_case(m: int, k: int, n: int, dtype: str):
    """``matmul`` of ``m`` bf16 rows by an 8-bit ``[k, n]`` weight (``dtype``) with a
    scale per column, at the blocks ``few_row_config`` gives the shape (W8A16)."""
    import jax.numpy as jnp

    from .matmul import few_row_config, matmul

    S = jax.ShapeDtypeStruct
    config = few_row_config(m, k, n, 1)
    args = [S((m, k), jnp.bfloat16), S((k, n), dtype), S((n,), jnp.float32)]
    return (lambda x, w, s: matmul(x, w, s, **config)), args


def _grouped_case(bits: int, m: int, k: int, n: int):
    """``matmul_int4`` (``bits`` 4) or ``matmul_int8_groups`` (8) of ``m`` bf16 rows by a
    ``[k, n]`` weight in groups of 32 with minimums, at the blocks ``grouped_config``
    gives the shape."""
    import jax.numpy as jnp

    from .matmul import grouped_config, matmul_int4, matmul_int8_groups

    S = jax.ShapeDtypeStruct
    config = grouped_config(m, k, n)
    fn = matmul_int4 if bits == 4 else matmul_int8_groups
    w = S((k // 2, n), jnp.uint8) if bits == 4 else S((k, n), jnp.int8)
    args = [S((m, k), jnp.bfloat16), w] + [S((k // 32, n), jnp.float32)] * 2
    return (lambda x, p, s, z: fn(x, p, s, z, **config)), args


def main(argv=None) -> int:
    import argparse
    import json

    parser = argparse.ArgumentParser(
        prog="python -m paged_jax.kernels.gpu.aot",
        description="Compile the GPU kernels for sm_90 on this host and report their "
        "shared memory, registers, spills and tensor-core instructions.",
    )
    parser.add_argument("--json", help="also write the report to this JSON file")
    parser.add_argument("-k", default="", help="only cases whose name contains this")
    args = parser.parse_args(argv)
    if not triton_available():
        print("this report needs the triton package: pip install triton")
        return 2
    import jaxlib
    import triton
    from rich.console import Console
    from rich.progress import track
    from rich.table import Table

    rows = []
    cases = {k: v for k, v in standard_cases().items() if args.k in k}
    for label, (fn, fn_args) in track(cases.items(), description="compiling for sm_90"):
        for module in lower_to_triton(fn, *fn_args):
            report = compile_sm90(module)
            rows.append(
                dict(
                    case=label,
                    kernel=report.name,
                    shared_kib=round(report.shared_bytes / 1024, 1),
                    registers=report.registers,
                    spill_bytes=report.spill_bytes,
                    num_warps=report.num_warps,
                    num_stages=report.num_stages,
                    blocks_per_sm=report.blocks_per_sm,
                    fits=report.fits,
                    mma=", ".join(f"{k} x{v}" for k, v in sorted(report.mma.items())) or "none",
                )
            )
    table = Table(title="GPU kernels compiled for sm_90 (no GPU used)")
    for col in ("case", "shared_kib", "registers", "spill_bytes", "blocks_per_sm", "mma"):
        table.add_column(col)
    for row in rows:
        table.add_row(
            row["case"],
            str(row["shared_kib"]),
            str(row["registers"]),
            str(row["spill_bytes"]),
            str(row["blocks_per_sm"]),
            row["mma"].replace("mma.sync.aligned.", ""),
        )
    Console(width=160).print(table)
    if args.json:
        meta = dict(
            target="sm_90 (H100/H200), compiled ahead of time; no GPU was used",
            jax=jax.__version__,
            jaxlib=jaxlib.__version__,
            triton=triton.__version__,
            command="python -m paged_jax.kernels.gpu.aot --json " + args.json,
        )
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    bad = [r["case"] for r in rows if not r["fits"] or r["spill_bytes"]]
    if bad:
        print("over the shared-memory limit or spilling:", ", ".join(bad))
    return 1 if any(not r["fits"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
