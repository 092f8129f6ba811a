"""Matrix products against weights packed for the CPU kernel (``pallas_kernels/cpu``).

A weight ``w [K, N]`` packed by ``pack`` lies in column panels, ``[P, K, NR]``, the
layout the kernel's ``linear.c`` reads front to back without repacking it on every call
as a general matrix product does; ``matmul(x, packed, n)`` computes ``x @ w`` with it.
``LlamaForCausalLM.hold_for_cpu`` packs a model's weights this way where ``available()``.
Faster than XLA's dot on the unpacked weight at every row count of a step, most at a few
rows (docs/DECISIONS.md, "The CPU's C matrix-product kernel").
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp


def available() -> bool:
    """True where weights can be packed (and the engine's greedy sampler may use its C
    kernel): JAX's default backend is the CPU, the CPU kernels built
    (``paged_jax.kernels.cpu.available()``), and ``PAGED_JAX_BACKEND`` is not ``xla``
    (which keeps every CPU step on XLA)."""
    if jax.default_backend() != "cpu" or os.environ.get("PAGED_JAX_BACKEND") == "xla":
        return False
    from paged_jax.kernels import cpu

    return cpu.available()


def pack(w: jax.Array) -> jax.Array:  # [(L,) K, N] f32, int8, uint8, bf16 -> [(L,) P, K, NR]
    """``w`` in column panels of the kernel's width NR (``P = ceil(N / NR)``, zero past
    column N), each of a stack ``[L, K, N]`` alike; float32, int8 (quantized weights,
    whose scales ``pack_scales`` lays out), uint8 (4-bit weights, two rows a byte) or
    bfloat16 (K even; fp8 weights are held so on CPU, with column scales).
    Raises ``ValueError`` for another dtype or rank, or where the kernels are not
    available."""
    from paged_jax.kernels import cpu

    return cpu.pack_weight(w)


def pack_scales(scales: jax.Array) -> jax.Array:  # f32[(L,) N] -> f32[(L,) P * NR]
    """The column scales of int8 weights, laid out for ``matmul`` with the weights
    ``pack`` packed (zero past column N)."""
    from paged_jax.kernels import cpu

    return cpu.pack_scales(scales)


def pack_high(
    high: jax.Array, bits: int
) -> jax.Array:  # u8[(L,) K b / 8, N] -> [(L,) P, K b / 8, NR]
    """The high bits (``bits`` 1 or 2 a weight) of 4-bit weights ``pack`` packed, laid out
    beside them for ``matmul(..., high=)`` (a GGUF file's 5- and 6-bit blocks kept:
    ``models.gguf_blocks.Nibbles``)."""
    from paged_jax.kernels import cpu

    return cpu.pack_high(high, bits)


def unpack_high(packed: jax.Array, n: int, bits: int) -> jax.Array:
    """The high bits ``pack_high`` packed: ``[(L,) P, K bits / 8, NR] -> [(L,) K bits / 8,
    n]``."""
    from paged_jax.kernels import cpu

    return cpu.unpack_high(packed, n, bits)


def unpack(packed: jax.Array, n: int) -> jax.Array:  # [(L,) P, K, NR] -> [(L,) K, n]
    """The weight that ``pack`` made ``packed``."""
    from paged_jax.kernels import cpu

    return cpu.unpack_weight(packed, n)


def packed_columns(
    packed: jax.Array,  # [P, K, NR] f32 or int8, or [P, K / 2, NR] uint8 (4-bit)
    ids: jax.Array,  # int[...]
) -> jax.Array:  # [..., K] (4-bit: [..., K / 2], two rows a byte)
    """Columns ``ids`` of the weight ``pack`` packed, each as a row (how a packed tied
    head's table looks its tokens up)."""
    from paged_jax.kernels import cpu

    return cpu.packed_columns(packed, ids)


def matmul(
    x: jax.Array,  # [..., K] f32
    packed: jax.Array,  # [P, K, NR] or [L, P, K, NR] f32
    n: int,
    layer: jax.Array | int | None = None,  # i32 scalar: which of L weights
    rows: jax.Array | int | None = None,  # i32 scalar: rows of x to compute
    scales: jax.Array | None = None,  # int8: f32[(L,) P * NR] (pack_scales) or groups'
    mins: jax.Array | None = None,  # 4-bit, int8 groups: scales and mins f32[(L,) P, K / G, NR]
    rotated: bool = False,  # static: quantized weights rotated along K (below)
    high: jax.Array | None = None,  # 4-bit: u8[(L,) P, K bits / 8, NR] (pack_high)
    offset: int = 0,  # static: 4-bit without mins: scales * (q - offset)
    float_rows: bool = False,  # static: 4-bit, int8 groups: weights dequantized, x as is
) -> jax.Array:  # [..., n] f32
    """``x @ w`` for the ``[K, n]`` weight ``w`` packed as ``packed`` (of a stack of L, the
    one at ``layer``, read where it lies), by the CPU kernel: one f32 sum per output
    over K in order, so a row's result does not depend on the other rows. ``rows``: only
    the first ``rows`` rows of ``x`` (flattened) are computed, the others' results are 0
    (None: all). int8 weights need their ``scales``: column j of the weight is ``q[:, j] *
    scales[j]``, or with scales per group of rows (``[(L,) P, K / G, NR]``) ``q[k, j] *
    scales[k // G, j]``, plus ``mins[k // G, j]`` where ``mins`` are given. 4-bit
    weights (uint8 ``[(L,) P, K / 2, NR]``) need their groups' ``scales`` and ``mins``
    (each packed by ``pack`` from ``[(L,) K / G, n]``; f32 or f16), or ``scales`` alone
    and an ``offset``: ``scales * (q - offset)``; ``high`` adds 1 or 2 bits above each
    4-bit value (``pack_high``). ``float_rows``: the quantized weights are dequantized a
    panel at a time and multiply ``x`` as it is (not quantized): the very sums of the f32
    product on the dequantized weights. bf16 weights multiply rows rounded
    to bf16, each product exact in f32, times column ``scales`` if given
    (``paged_jax.kernels.cpu.reference_bf16``). Quantized
    weights multiply rows of ``x`` quantized to int8 in blocks of 32 inputs (4-bit: the
    groups), a scale each, by exact integer dot products (W8A8; see
    ``paged_jax.kernels.cpu.reference_quantized`` for the definition). ``rotated``: the
    quantized weights are ``R w`` (``paged_jax.kernels.cpu.rotate_blocks`` along K, blocks
    of 32), and each row of ``x`` is rotated likewise before it is quantized, which
    leaves the product ``x @ w`` and spreads a block's outlier over its inputs. Raises
    ``ValueError`` for mismatched shapes or dtypes."""
    from paged_jax.kernels import cpu

    return cpu.linear(
        x,
        packed,
        n,
        layer=layer,
        rows=rows,
        scales=scales,
        mins=mins,
        rotated=rotated,
        high=high,
        offset=offset,
        float_rows=float_rows,
    )


def rotate(x, axis: int = -1):
    """``x`` rotated along ``axis`` in blocks of 32 as ``matmul(..., rotated=True)``
    rotates its rows, and as rotated quantized weights are held along their inputs
    (``paged_jax.kernels.cpu.rotate_blocks``: the orthonormal Hadamard matrix of order
    32, its own inverse; the same bits): in ``jax.numpy`` for a JAX array (a tracer
    too), which it stays, else in numpy. Needs no C build."""
    import numpy as np

    from paged_jax.kernels.cpu import rotate_blocks

    if isinstance(x, jax.Array):  # one program (not an op at a time: ~25 compiles a shape)
        return _rotate_jnp(x, axis)
    return rotate_blocks(x, axis, xp=np)


@functools.partial(jax.jit, static_argnums=1)
def _rotate_jnp(x: jax.Array, axis: int) -> jax.Array:
    import jax.numpy as jnp

    from paged_jax.kernels.cpu import rotate_blocks

    return rotate_blocks(x, axis, xp=jnp)


def lora_delta(
    x: jax.Array,  # f32[T, K]
    a: jax.Array,  # f32[L, K, S R]: a target's A bank, every slot side by side
    b: jax.Array,  # f32[L, S R, N]
    ids: jax.Array,  # i32[T]: each row's slot plus one, 0 for none
    layer: jax.Array | int,
    rank: int,
) -> jax.Array:  # f32[T, N]
    """What LoRA adapters add to a projection's rows, by the CPU kernel: row t times its
    own slot's ``A`` then ``B`` (slot ``ids[t] - 1``; zeros for id 0), the layer's banks
    read in place. ``models.lora.delta``'s way on CPU; see
    ``paged_jax.kernels.cpu.lora_delta``."""
    from paged_jax.kernels import cpu

    return cpu.lora_delta(x, a, b, ids, layer, rank)


def expert_matmul(
    x: jax.Array,  # f32[M, K], rows sorted by expert
    packed: jax.Array,  # f32, bf16, int8 [W, P, K, NR], uint8 [W, P, K / 2, NR]: W experts
    n: int,
    sizes: jax.Array,  # i32[X] each expert's rows, in order
    first: jax.Array | int = 0,  # the weight of expert 0 (expert e's: first + e)
    scales: jax.Array | None = None,  # int8, 4-bit: f32[W, P, K / G, NR]
    mins: jax.Array | None = None,  # 4-bit: f32[W, P, K / G, NR]
    **kept,  # a GGUF file's 4-bit experts kept: high, offset, float_rows (as matmul's)
) -> jax.Array:  # f32[M, n]
    """Each expert's rows of ``x`` times its own weight, by the CPU kernel
    (``paged_jax.kernels.cpu.grouped_linear``): expert e's ``sizes[e]`` rows, after the
    experts before it, by weight ``first + e``, each row as ``matmul`` computes it alone
    (int8 weights with their ``scales`` per group of inputs, 4-bit ones with ``scales``
    and ``mins``: the rows quantized to int8 in those groups); the rows past the experts'
    are 0, and an expert no row chose is not read. ``kept``: ``high``, ``offset`` and
    ``float_rows`` of a GGUF file's 4-bit experts kept, as ``matmul`` takes them."""
    from paged_jax.kernels import cpu

    return cpu.grouped_linear(x, packed, n, sizes, first, scales=scales, mins=mins, **kept)


def expert_tiles(ids: jax.Array, num_experts: int, block_m: int):
    """The tile table of a step's (token, expert) pairs whose experts are ``ids``
    (``i32[N]``) for ``tiled_expert_matmul``: ``(rows i32[N], tile_expert i32[tiles],
    tiles_used i32[1])`` (``paged_jax.kernels._groups.expert_tiles``; an id outside ``[0,
    num_experts)`` gets no row). ``num_experts``, ``block_m`` static."""
    from paged_jax.kernels import _groups

    return _groups.expert_tiles(ids, num_experts, block_m)


def least_tile_rows(kernel: str, dtype) -> int:
    """The fewest rows a tile of ``tiled_expert_matmul``'s ``kernel`` ("gpu" or "tpu")
    may hold for rows of ``dtype``."""
    if kernel == "tpu":
        from paged_jax.kernels.tpu import grouped

        return grouped.min_block_m(dtype)
    if kernel == "gpu":
        from paged_jax.kernels.gpu import grouped

        return grouped.MIN_BLOCK_M
    raise ValueError(f"kernel: expected 'gpu' or 'tpu', got {kernel!r}")


def tiled_expert_matmul(
    x: jax.Array,  # [M, K], M = tiles * block_m: the pairs' rows laid out by expert_tiles
    w: jax.Array,  # [X, K, F], x's dtype or int8
    tile_expert: jax.Array,  # i32[tiles]
    tiles_used: jax.Array,  # i32[1]
    scale: jax.Array | None = None,  # f32[X, F] for an int8 w
    *,
    block_m: int,
    kernel: str,
    interpret: bool = False,
) -> jax.Array:  # [M, F] in x's dtype; rows of tiles past tiles_used: anything
    """Each used tile's rows times its expert's weight (times that expert's column
    ``scale`` for an int8 ``w``), by the Pallas grouped product of ``kernel``: "gpu"
    (``paged_jax.kernels.gpu.grouped``, Triton) or "tpu" (``kernels.tpu.grouped``,
    Mosaic). ``interpret``: run it interpreted (off its device)."""
    if kernel == "tpu":
        from paged_jax.kernels.tpu import grouped
    elif kernel == "gpu":
        from paged_jax.kernels.gpu import grouped
    else:
        raise ValueError(f"kernel: expected 'gpu' or 'tpu', got {kernel!r}")
    return grouped.grouped_matmul(
        x, w, tile_expert, tiles_used, scale, block_m=block_m, interpret=interpret
    )


def grouped_matmul(
    x: jax.Array,  # [M, K] bf16 / f32
    q: jax.Array,  # 4 bits: u8 [K / 2, N], two inputs a byte; 8 bits: int8 [K, N]
    scale: jax.Array,  # f32 [K / G, N]
    zero: jax.Array | None,  # f32 [K / G, N], the groups' minimums, or None
    bits: int,
    *,
    interpret: bool = False,
) -> jax.Array | None:  # [M, N] in x's dtype
    """``x @ w`` for a weight quantized in groups of G inputs (``w = q * scale (+ zero)``)
    by the GPU's Pallas kernels, which read it as it lies
    (``paged_jax.kernels.gpu.matmul.matmul_int4`` for ``bits`` 4, ``matmul_int8_groups``
    for 8), at the blocks ``grouped_config`` gives the shape; None where no block fits (the
    caller takes XLA's way). ``interpret``: run them interpreted (off a GPU)."""
    from paged_jax.kernels.gpu import matmul as gpu_matmul

    if bits not in (4, 8):
        raise ValueError(f"bits: expected 4 or 8, got {bits!r}")
    k = q.shape[0] * (2 if bits == 4 else 1)
    config = gpu_matmul.grouped_config(x.shape[0], k, q.shape[1], group=k // scale.shape[0])
    if config is None or x.shape[0] == 0:
        return None
    fn = gpu_matmul.matmul_int4 if bits == 4 else gpu_matmul.matmul_int8_groups
    return fn(x, q, scale, zero, interpret=interpret, **config)


def few_row_matmul(
    x: jax.Array,  # [M, K] bf16 / f32
    q: jax.Array,  # int8 / float8_e4m3fn [K, N]
    scale: jax.Array,  # f32 [N], one per output channel
    *,
    interpret: bool = False,
) -> jax.Array | None:  # [M, N] in x's dtype
    """``x @ (q * scale)`` for an 8-bit weight with a scale per output channel (W8A16)
    by the GPU's few-row Pallas product (``paged_jax.kernels.gpu.matmul.matmul``, which
    widens each chunk of the weight in registers, the next chunk loaded ahead), at the
    blocks ``few_row_config`` gives: a decode step's rows, padded to a power of two >= 16.
    None where no block fits or past ``FEW_ROWS`` rows (the caller takes XLA's way).
    ``interpret``: run it interpreted (off a GPU)."""
    from paged_jax.kernels.gpu import matmul as gpu_matmul

    m, k = x.shape
    config = gpu_matmul.few_row_config(m, k, q.shape[1], jnp.dtype(q.dtype).itemsize)
    if config is None or m == 0:
        return None
    rows = gpu_matmul.padded_rows(m)
    xp = jnp.pad(x, ((0, rows - m), (0, 0)))
    y = gpu_matmul.matmul(xp, q, scale.astype(jnp.float32), interpret=interpret, **config)
    return y[:m]


def fp8_rows(x: jax.Array, *, interpret: bool = False, **options) -> tuple[jax.Array, jax.Array]:
    """``(q float8_e4m3fn [M, W], scale f32 [M])``: rows ``x [M, W]`` quantized as
    ``paged_jax._quant.quantize_rows`` does, by one Pallas kernel for the GPU
    (``interpret``: off a GPU). ``options`` are the kernel's
    (``paged_jax.kernels.gpu.rows.fp8_rows``): ``act`` (rows of ``act(gate) * up`` from
    ``[M, 2 W]``), or ``norm_weight`` ``[W]`` with ``eps``, ``unit_offset`` and ``dtype``
    (rows of an RMS norm's output)."""
    from paged_jax.kernels.gpu import rows

    return rows.fp8_rows(x, interpret=interpret, **options)


__all__ = [
    "available",
    "few_row_matmul",
    "fp8_rows",
    "grouped_matmul",
    "lora_delta",
    "matmul",
    "pack",
    "pack_high",
    "packed_columns",
    "pack_scales",
    "rotate",
    "unpack",
    "unpack_high",
]
