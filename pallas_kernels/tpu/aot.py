"""Ahead-of-time lowering of the TPU kernels to Mosaic, on any machine.

Interpret mode runs a kernel's jaxpr with XLA on the CPU; it never meets Mosaic, the
compiler that builds the kernel for a TPU, and so never sees what Mosaic refuses. JAX can
lower a ``pallas_call`` for the ``"tpu"`` platform on a CPU host when told which TPU to
target (an abstract device): that runs Pallas' Mosaic lowering and MLIR's verifier, the
first half of a TPU compile.

The second half, Mosaic's own passes and XLA's TPU compiler, lives in libtpu, which pip
installs on any Linux machine (``pip install "jax[tpu]"``, matching the installed jax).
With it JAX compiles for a TPU topology described, not attached ("deviceless" ahead-of-
time compilation): the whole kernel is compiled as a TPU would compile it. Each half
found kernels that interpret mode had passed and Mosaic refuses (docs/DECISIONS.md,
"Mosaic ahead of time").

* :func:`lower_to_mosaic`: the Mosaic custom calls of ``jax.jit(fn)(*args)`` for a TPU kind.
* :func:`compile_for_tpu` (needs libtpu): compiles ``jax.jit(fn)(*args)`` for a TPU
  topology on this host.
* ``python -m paged_jax.kernels.tpu.aot [--compile]``: lowers (and with ``--compile``
  compiles) this project's kernels over a grid of shapes and dtypes for TPU v5e and v6e
  and prints one line per case. ``.ci/run`` runs it with ``--compile`` in a virtual
  environment of its own (libtpu is a 100 MB wheel the test command does not need).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import jax

from .._aot_cases import attention_case, grouped_case, sinks_case, standard_grid

TPU_KINDS = ("TPU v5 lite", "TPU v6 lite")  # device_kind of v5e and v6e
TOPOLOGIES = {"TPU v5 lite": "v5e:1x1", "TPU v6 lite": "v6e:1x1"}  # one chip of each


def compile_for_tpu(fn: Callable, *args, device_kind: str = "TPU v5 lite"):
    """Compiles ``jax.jit(fn)(*args)`` (``args``: pytrees of arrays or
    ``jax.ShapeDtypeStruct``s; nothing is computed) for one chip
    of ``device_kind`` on this host, with no TPU attached; returns the ``Compiled``
    (``cost_analysis()``, ``memory_analysis()``, ``as_text()``). Needs libtpu (``pip
    install "jax[tpu]"``) and ``JAX_PLATFORMS=cpu`` (libtpu must not look for a TPU of
    its own). Raises what Mosaic or XLA raise (``MosaicError``, ``JaxRuntimeError``)."""
    import os

    from jax.experimental import topologies

    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")  # quiets libtpu's probing
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    topology = topologies.get_topology_desc(
        platform="tpu",
        topology_name=TOPOLOGIES[device_kind],
        chip_config_name="default",
        chips_per_host_bounds=(1, 1, 1),
        num_slices=1,
    )
    device = topology.devices[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args)
    with jax.default_device(device):  # the kernels read the chip's kind from it
        return jax.jit(fn).lower(*args).compile()


def lower_to_mosaic(fn: Callable, *args, device_kind: str = "TPU v5 lite") -> int:
    """Lowers ``jax.jit(fn)(*args)`` for ``device_kind`` on this host; returns the number of
    Mosaic kernels in it. Raises what the Mosaic lowering raises (for example
    ``VerificationError`` for an op Mosaic does not support)."""
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=1, platform="tpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",))
    return len(re.findall(r"custom_call @tpu_custom_call", lowered.as_text()))


def write_case(dtype="bfloat16", *, kv_heads=8, head_dim=128, page=16, tokens=64):
    """``(fn, args)`` writing one layer's new K/V rows into a pool with ``write_rows``, as
    ``PagedKVCache.write(backend="pallas_tpu")`` does: rows ``[T, 2K, D]`` into a pool
    ``[2, 64, page, 2K, D]`` of ``dtype``, and for int8 the per-row scales
    ``f32[T, 2K]`` into their own pool as well."""
    from .kv_write import write_rows

    S = jax.ShapeDtypeStruct
    row = (2 * kv_heads, head_dim)
    pool = S((2, 64, page) + row, dtype)
    rows = S((tokens,) + row, dtype)
    slots = S((tokens,), "int32")
    if dtype != "int8":
        return (lambda p, r, s: write_rows(p, r, s, 1)), [pool, rows, slots]

    def fn(p, r, scales_pool, scales, s):
        return write_rows(p, r, s, 1), write_rows(scales_pool, scales, s, 1)

    scale_pool = S((2, 64, page, 2 * kv_heads), "float32")
    return fn, [pool, rows, scale_pool, S((tokens, 2 * kv_heads), "float32"), slots]


# Pools with fewer kv heads than the grid's 8, each a head axis XLA tiles whole.
FEW_KV_HEADS = (
    ("bfloat16", 1),
    ("bfloat16", 2),
    ("bfloat16", 4),
    ("float32", 1),
    ("float32", 2),
    ("int8", 2),
    ("int8", 4),
)


def standard_cases() -> dict[str, tuple[Callable, list]]:
    """Both attention kernels over ``standard_grid`` and ``FEW_KV_HEADS`` (less any pool
    they refuse); the KV write for a 16-bit and a quantized cache; the experts' grouped
    product at a Qwen3-30B-A3B decode step's shapes."""
    from . import decode_paged_attention, ragged_paged_attention
    from ._pages import check_layout

    cases = {}
    for kind, kernel in (("decode", decode_paged_attention), ("ragged", ragged_paged_attention)):
        for label, kw in standard_grid(kind).items():
            fn, args = attention_case(kernel, kind, **kw)
            try:  # (a pool the kernels refuse, with a ValueError: nothing to lower)
                check_layout(*args[1].shape[-2:], args[1].dtype)
            except ValueError:
                continue
            cases[label] = (fn, args)
    for kind, kernel in (("decode", decode_paged_attention), ("ragged", ragged_paged_attention)):
        for dtype, kv_heads in FEW_KV_HEADS:
            label = f"{kind} {dtype} D128 P16 K{kv_heads}"
            heads = dict(heads=4 * kv_heads, kv_heads=kv_heads)
            cases[label] = attention_case(kernel, kind, dtype, **heads)
    for dtype in ("bfloat16", "float16", "int8"):
        cases[f"kv_write {dtype} D128 P16"] = write_case(dtype)
    for kind, kernel in (("decode", decode_paged_attention), ("ragged", ragged_paged_attention)):
        cases[f"{kind} bfloat16 D64 G8 sinks+window (GPT-OSS)"] = sinks_case(kernel, kind)
    from .grouped import grouped_matmul

    for dtype in ("bfloat16", "int8"):  # a Qwen3-30B-A3B decode step of 64: gate's, down's
        cases[f"grouped_matmul {dtype} 512 pairs 128x2048x768"] = grouped_case(
            grouped_matmul, dtype
        )
        cases[f"grouped_matmul {dtype} 512 pairs 128x768x2048"] = grouped_case(
            grouped_matmul, dtype, inputs=768, outputs=2048
        )
    return cases


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m paged_jax.kernels.tpu.aot",
        description="Lower (or compile) the TPU kernels for TPU v5e and v6e on this host.",
    )
    parser.add_argument("-k", default="", help="only cases whose name contains this")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile them as a TPU would (needs libtpu: pip install 'jax[tpu]'; run with "
        "JAX_PLATFORMS=cpu)",
    )
    args = parser.parse_args(argv)
    failed = 0
    for label, (fn, fn_args) in standard_cases().items():
        if args.k not in label:
            continue
        for kind in TPU_KINDS:
            try:
                n = lower_to_mosaic(fn, *fn_args, device_kind=kind)
                what = f"{n} Mosaic kernel{'s' * (n != 1)}"
                if args.compile:
                    compile_for_tpu(fn, *fn_args, device_kind=kind)
                    what += ", compiled"
                print(f"ok    {kind:12s} {label} ({what})")
            except Exception as err:  # report every case, then fail
                failed += 1
                first = str(err).strip().splitlines()[0][:160] if str(err).strip() else ""
                print(f"FAIL  {kind:12s} {label}: {type(err).__name__}: {first}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
