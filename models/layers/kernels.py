"""Which products a Pallas kernel computes instead of XLA's dots, and where: one table
(``KERNELS``), read when a step is traced (``kernel_platform``), and the calls that take
the kernels' way (``grouped_by_kernel``, ``w8a16_by_kernel``). Each entry says the
kernel, the platforms it is on for, and why; a switch left off is off until a GPU times
it (docs/DECISIONS.md keeps the measurements). Tests put "cpu" among an entry's
platforms to run its kernel interpreted (``use_kernel``)."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import jax.numpy as jnp

from paged_jax import linear


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """Where a kind of product goes to a Pallas kernel."""

    kernel: str  # what computes it there
    platforms: tuple[str, ...]  # platforms (``jax.default_backend()`` names) it is on for
    why: str


KERNELS: dict[str, KernelChoice] = {
    # A weight quantized in groups along its inputs (4-bit always; int8 as a GGUF file's
    # kept blocks), read as it lies.
    "grouped": KernelChoice(
        "paged_jax.kernels.gpu.matmul.matmul_int4 / matmul_int8_groups",
        ("gpu",),
        "XLA:GPU makes a 16-bit copy of such a weight for every product of a step (a "
        "4-bit weight: 4.5 bytes moved where bf16 moves 2); not yet timed on a GPU",
    ),
    # An fp8-by-fp8 product's rows (W8A8: o's and down's inputs, which no norm's kernel
    # quantizes), quantized in one kernel (with SiLU times up for down's).
    "fp8_rows": KernelChoice(
        "paged_jax.kernels.gpu.rows.fp8_rows",
        ("gpu",),
        "one kernel instead of XLA's two or three; not yet timed on a GPU",
    ),
    # An 8-bit weight with a scale per output channel by 16-bit rows (W8A16: int8, and fp8
    # held weight-only), up to ``FEW_ROWS`` rows, each chunk widened in registers.
    "w8a16": KernelChoice(
        "paged_jax.linear.few_row_matmul",
        (),
        "off until a GPU times it: XLA's W8A16 products took as long as bf16's on an H200 "
        "(docs/DECISIONS.md, 'The W8A16 kernel off'; ``python -m benchmarks engine "
        "--w8a16-kernel off on`` runs the engine each way)",
    ),
}


@contextlib.contextmanager
def use_kernel(product: str, platforms: tuple[str, ...]):
    """``KERNELS[product]`` on for ``platforms`` while the block runs (tests interpret a
    kernel with ``("gpu", "cpu")``; a benchmark's A/B turns one on); steps traced inside
    take its way."""
    old = KERNELS[product]
    KERNELS[product] = dataclasses.replace(old, platforms=tuple(platforms))
    try:
        yield
    finally:
        KERNELS[product] = old


def kernel_platform(product: str) -> str | None:
    """The platform computations go to (``models.quantization._target_platform``) where
    ``KERNELS[product]`` puts its kernel and no mesh splits them (a Pallas call is not
    partitioned: XLA's way stays there), else None. Read at trace time: a change takes
    effect for steps traced after it."""
    from paged_jax import sharding

    from ..quantization import _target_platform

    platform = _target_platform()
    if platform not in KERNELS[product].platforms:
        return None
    if sharding.tensor_parallel_size() > 1 or sharding.data_parallel_size() > 1:
        return None
    return platform


def grouped_by_kernel(module, x, q, scale, zero, bits: int):
    """``x @ w`` for one layer's ``w`` in groups along its inputs (``bits`` 4: ``q`` u8
    ``[in / 2, out]``; 8: int8 ``[in, out]``; ``scale`` and ``zero`` (None: none)
    ``[in / G, out]``) by the GPU's kernels (``paged_jax.linear.grouped_matmul``), in the
    module's dtype; None where ``KERNELS["grouped"]`` does not put it there, on a
    mesh, or where no block fits."""
    platform = kernel_platform("grouped")
    if platform is None or q.ndim != 2 or scale.ndim != 2:
        return None
    k = q.shape[0] * (2 if bits == 4 else 1)
    return rows_by_kernel(
        module,
        x,
        k,
        module.dtype or x.dtype,
        lambda x2: linear.grouped_matmul(x2, q, scale, zero, bits, interpret=platform != "gpu"),
    )


def rows_by_kernel(module, x, k: int, dtype, product):
    """``product`` (a kernel's ``[M, k] -> [M, out]`` or None) of ``x [..., k]`` as rows,
    rotated first where the module's weight is (``(x R)(R w) = x w``), in ``dtype``;
    ``[..., out]``, or None where the kernel gave None."""
    x2 = x.reshape(math.prod(x.shape[:-1]), k)
    if module.rotated:
        x2 = linear.rotate(x2, -1).astype(x.dtype)
    y = product(x2.astype(dtype))
    return None if y is None else y.reshape(*x.shape[:-1], y.shape[-1])


def w8a16_by_kernel(module, x, q, scale):
    """``x @ (q * scale)`` for one layer's 8-bit ``q [in, out]`` with a scale per output
    channel ``[out]`` by the GPU's few-row product (``paged_jax.linear.few_row_matmul``),
    in the module's dtype; None where ``KERNELS["w8a16"]`` does not put it there,
    on a mesh, for a weight of another kind or f32 rows, past its rows or where no block
    fits."""
    platform = kernel_platform("w8a16")
    dtype = jnp.dtype(module.dtype or x.dtype)
    if platform is None or q.ndim != 2 or scale.ndim != 1 or q.dtype.itemsize != 1:
        return None
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return None  # f32 rows keep XLA's dot at the module's precision (Triton's: TF32)
    return rows_by_kernel(
        module,
        x,
        q.shape[0],
        dtype,
        lambda x2: linear.few_row_matmul(x2, q, scale, interpret=platform != "gpu"),
    )
