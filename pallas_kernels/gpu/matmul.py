"""Few-row matrix products streaming the weight in its own dtype (Pallas, Triton
lowering): the products of a decode step on an NVIDIA GPU, as an instrument.

Each program takes a ``block_n``-wide column panel of the weight (and with ``split_k`` >
1 a slice of its rows), streams it in ``block_k``-row chunks, widens 8-bit chunks in
registers, and keeps every row's partial sums in registers. ``x [M, K] @ w [K, N]``
(times ``scale [N]`` for an 8-bit ``w``), accumulated in f32, returned in ``x``'s dtype.
Runs under ``interpret=True`` on CPU (the tests) and lowers through Triton on GPU.

Measured, not used by the models (``python -m benchmarks products --pallas ...``; H200,
``benchmarks/results/products_gpu_h200_pallas*.json``, ``products_chain_h200.json``): at
64 rows the Llama-3-8B shape's 32 fused layers took 5.52 ms against XLA's 5.67 (bf16),
at 256 rows 11.8 against 7.5; 8-bit weights widened here took 7.4-7.6 ms at 64 rows, the
widening keeping the weight off the tensor cores' asynchronous path. What holds XLA's
products to about 2.5 TB/s at 64 rows is not the product's inner loop: chained in one
call, each product costs about 9 us beyond its bytes at 4.8 TB/s, whichever kernel runs
it (a 34 MB weight 15.9 us, a 235 MB one 61 us, 3.85 TB/s). Fewer, larger kernels per
step, not a better product, are what the decode step's weights need next.
Compiled for sm_90 (triton 3.9), an 8-bit weight's chunk is an ``ld.global`` issued in the
step that multiplies it (its latency in every step) where a float one is pipelined
through shared memory; ``prefetch=True`` loads the next chunk before the product, not yet
timed (``python -m benchmarks products --pallas 64:128:4:3:p``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import tuning


def _kernel(x_ref, w_ref, s_ref, o_ref, *, block_k, steps, compute, prefetch=False):
    # x_ref [M, K / split_k], w_ref [K / split_k, BN], s_ref [BN] or None, o_ref [M, BN]
    rows = x_ref.shape[0]
    zeros = jnp.zeros((rows, w_ref.shape[1]), jnp.float32)

    def chunk(i):
        return w_ref[pl.ds(i * block_k, block_k), :]

    def product(i, ws, acc):
        xs = x_ref[:, pl.ds(i * block_k, block_k)].astype(compute)
        return acc + jnp.dot(xs, ws.astype(compute), preferred_element_type=jnp.float32)

    if prefetch:
        # The weight's next chunk is loaded (into registers) before this chunk's product,
        # and widened one step later: compiled for sm_90, Triton pipelines a float
        # weight's chunks through shared memory but loads an 8-bit one, which it widens
        # in registers, only when the step needs it (``ld.global`` then the dot: the
        # load's whole latency in every step). The last step reloads the last chunk.
        def step(i, carry):
            acc, ws = carry
            ahead = chunk(jnp.minimum(i + 1, steps - 1))
            return product(i, ws, acc), ahead

        acc = jax.lax.fori_loop(0, steps, step, (zeros, chunk(0)))[0]
    else:
        acc = jax.lax.fori_loop(0, steps, lambda i, acc: product(i, chunk(i), acc), zeros)
    if s_ref is not None:
        acc = acc * s_ref[...][None, :]
    o_ref[...] = acc.astype(o_ref.dtype)


def _kernel_without_scale(x_ref, w_ref, o_ref, **kw):  # a float weight: no scale operand
    _kernel(x_ref, w_ref, None, o_ref, **kw)


def default_split_k(m: int, k: int, n: int, w_bytes: int, block_n: int, block_k: int) -> int:
    """K's slices a product of ``m`` rows by a ``[k, n]`` weight of ``w_bytes`` a value
    takes: doubled while the programs (``n / block_n`` panels times slices) fill less than
    two waves of an H100/H200's 132 SMs, each slice keeps at least 4 chunks of
    ``block_k``, and the slices' f32 partial sums (written and read back) stay under a
    quarter of the weight's bytes."""
    split = 1
    while (
        n // block_n * split < 2 * 132
        and k % (2 * split * block_k) == 0
        and k // (2 * split) >= 4 * block_k
        and 2 * split * m * n * 4 * 2 <= k * n * w_bytes // 4
    ):
        split *= 2
    return split


FEW_ROWS = 256  # rows (padded to a power of two) up to which few_row_config gives blocks


def padded_rows(m: int) -> int:
    """The rows a product's block holds for ``m`` rows: a power of two, at least 16 (the
    tensor cores' smallest)."""
    return max(16, 1 << max(0, (m - 1).bit_length()))


def few_row_config(m: int, k: int, n: int, w_bytes: int) -> dict | None:
    """``matmul``'s blocks for ``m`` rows (padded to a power of two >= 16) by a ``[k, n]``
    weight of ``w_bytes`` a value, or None past ``FEW_ROWS`` rows (a prefill: bound by its
    FLOPs, XLA's products) or where no block divides the weight. The next chunk of the
    weight loaded ahead; K split by ``default_split_k``. Up to 64 rows: 64 columns a
    program, chunks of 128 weight rows, 3 stages, 4 warps; 128 rows: chunks of 64, 8 warps;
    256: 32 columns, chunks of 64, 2 stages, 8 warps. Compiled for sm_90 (the Llama-3-8B
    shape's products, int8) each keeps 2-4 programs a SM within 128 registers a thread, no
    spills, where 256 rows at 64 columns held one. Chosen from the shapes alone, not yet
    tuned on a GPU."""
    rows = padded_rows(m)
    if rows > FEW_ROWS:
        return None
    widths, chunks = ((32, 16), (64, 32, 16)) if rows == 256 else ((64, 32, 16), (128, 64, 32, 16))
    if rows == 128:
        chunks = (64, 32, 16)
    block_n = next((b for b in widths if n % b == 0), None)
    block_k = next((b for b in chunks if k % b == 0), None)
    if block_n is None or block_k is None:
        return None
    return dict(
        block_n=block_n,
        block_k=block_k,
        split_k=default_split_k(rows, k, n, w_bytes, block_n, block_k),
        num_warps=4 if rows <= 64 else 8,
        num_stages=2 if rows == 256 else 3,
        prefetch=True,
    )


def _check(x, w, scale, block_n, block_k, split_k):
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"x, w: expected [M, K] and [K, N], got {x.shape} and {w.shape}")
    if jnp.dtype(w.dtype).itemsize == 1 and scale is None:
        raise ValueError(f"scale: an 8-bit w ({w.dtype}) needs its f32[N] scale")
    if scale is not None and scale.shape != (w.shape[1],):
        raise ValueError(f"scale: expected shape ({w.shape[1]},), got {scale.shape}")
    M, K, N = x.shape[0], *w.shape
    if M < 16 or M & (M - 1):
        raise ValueError(f"x: expected a power of two >= 16 rows, got {M}")
    for name, v in (("block_n", block_n), ("block_k", block_k), ("split_k", split_k)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name}: expected a power of two, got {v}")
    if N % block_n or K % (block_k * split_k):
        raise ValueError(
            f"w: expected N a multiple of block_n={block_n} and K of block_k * split_k="
            f"{block_k * split_k}, got [{K}, {N}]"
        )


@functools.partial(
    jax.jit,
    static_argnames=(
        "block_n",
        "block_k",
        "split_k",
        "num_warps",
        "num_stages",
        "interpret",
        "prefetch",
    ),
)
def matmul(
    x: jax.Array,
    w: jax.Array,
    scale: jax.Array | None = None,
    *,
    block_n: int = 64,
    block_k: int = 128,
    split_k: int = 1,
    num_warps: int = 4,
    num_stages: int = 3,
    interpret: bool = False,
    prefetch: bool = False,
) -> jax.Array:
    """``x @ w`` (``* scale`` per column): ``x`` bf16/f32 ``[M, K]`` with M a power of two
    >= 16; ``w`` ``[K, N]`` in ``x``'s dtype, or int8 / float8_e4m3fn with ``scale``
    f32 ``[N]``; returns ``[M, N]`` in ``x``'s dtype. A program per ``block_n`` columns
    (times ``split_k`` slices of K, summed after in f32). ``prefetch``: each step loads
    the weight's next ``block_k`` rows before its product (the same sums). Raises
    ``ValueError`` for shapes the blocks do not divide."""
    _check(x, w, scale, block_n, block_k, split_k)
    M, K, N = x.shape[0], *w.shape
    ks = K // split_k
    compute = x.dtype
    kernel = functools.partial(
        _kernel if scale is not None else _kernel_without_scale,
        block_k=block_k,
        steps=ks // block_k,
        compute=compute,
        prefetch=bool(prefetch),
    )
    out_dtype = jnp.float32 if split_k > 1 else x.dtype
    in_specs = [
        pl.BlockSpec((M, ks), lambda j, s: (0, s)),
        pl.BlockSpec((ks, block_n), lambda j, s: (s, j)),
    ]
    args = [x, w]
    if scale is not None:
        in_specs.append(pl.BlockSpec((block_n,), lambda j, s: (j,)))
        args.append(scale.astype(jnp.float32))
    out = pl.pallas_call(
        kernel,
        grid=(N // block_n, split_k),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, M, block_n), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((split_k, M, N), out_dtype),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="few_row_matmul",
    )(*args)
    return out[0] if split_k == 1 else out.sum(0).astype(x.dtype)


def _grouped_kernel(
    x_ref, p_ref, s_ref, z_ref, o_ref, *, bits, group, groups_per_step, steps, compute
):
    # x_ref [BM, K / split_k]; p_ref: 4 bits, [K / split_k / 2, BN] u8 (byte r: K indices
    # 2r, low nibble, and 2r + 1); 8 bits, [K / split_k, BN] int8; s_ref and z_ref (or
    # None: no minimums) [K / split_k / group, BN] f32; o_ref [BM, BN]
    per = 2 if bits == 4 else 1  # weights a byte
    rows = group // per * groups_per_step  # rows of p_ref a step
    g = jnp.arange(rows)[:, None] // (group // per)  # each row's group in the step

    def widen(q, scale, zero):
        w = q.astype(jnp.float32) * scale
        return (w if zero is None else w + zero).astype(compute)

    def body(i, acc):
        p = p_ref[pl.ds(i * rows, rows), :].astype(jnp.int32)
        scale = zero = None
        for j in range(groups_per_step):  # the step's groups' rows, spread over their rows
            s = s_ref[pl.ds(i * groups_per_step + j, 1), :]
            scale = s if scale is None else jnp.where(g == j, s, scale)
            if z_ref is not None:
                z = z_ref[pl.ds(i * groups_per_step + j, 1), :]
                zero = z if zero is None else jnp.where(g == j, z, zero)
        if bits == 8:
            xs = x_ref[:, pl.ds(i * rows, rows)].astype(compute)
            return acc + jnp.dot(xs, widen(p, scale, zero), preferred_element_type=jnp.float32)
        # The step's 2 * rows inputs loaded whole (contiguous: Triton pipelines them
        # through shared memory; two strided loads were scalar ones in the step itself),
        # then split into even (low nibbles') and odd (high nibbles') inputs in registers.
        xs = x_ref[:, pl.ds(2 * i * rows, 2 * rows)].reshape(x_ref.shape[0], rows, 2)
        x_lo, x_hi = (
            h.reshape(x_ref.shape[0], rows).astype(compute) for h in jnp.split(xs, 2, axis=2)
        )
        acc = acc + jnp.dot(x_lo, widen(p & 15, scale, zero), preferred_element_type=jnp.float32)
        return acc + jnp.dot(x_hi, widen(p >> 4, scale, zero), preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def grouped_config(m: int, k: int, n: int, group: int = 32) -> dict | None:
    """``matmul_int4`` / ``matmul_int8_groups``' blocks for ``m`` rows by a ``[k, n]``
    weight in groups of ``group`` inputs, or None where none fit (``n`` not a multiple of
    16, ``k`` not of ``group``, ``group`` not of 32). Every row in one block up to 256 (so
    a decode step reads the weight once: 256 rows take 32 columns a program, 100 registers
    a thread in Triton's sm_90 build where 64 took 233), 64 columns a program where they
    divide,
    blocks of 128 rows past 256 (a prefill, bound by its FLOPs), two groups a step where K
    allows up to 64 rows and one past them (a step's inputs are loaded whole and split
    into the low and high nibbles' in registers: two groups of 128 or 256 rows held one
    program a SM, compiled for sm_90, one group two; at 256 rows two stages, as a third
    one took 133 registers a thread, one program a SM), and K split while the programs
    fill less than two waves of an H100/H200's 132 SMs. Chosen from the shapes alone, not yet
    tuned on a GPU."""
    rows = padded_rows(m)
    block_m = rows if rows <= 256 else 128
    widths = (32, 16) if block_m == 256 else (64, 32, 16)
    block_n = next((b for b in widths if n % b == 0), None)
    gps = next((g for g in ((2, 1) if block_m <= 64 else (1,)) if k % (group * g) == 0), None)
    if block_n is None or gps is None or group % 32:
        return None
    programs = -(-m // block_m) * (n // block_n)
    split = 1
    while programs * split < 2 * 132 and k % (2 * split * group * gps) == 0 and split < 8:
        split *= 2
    return dict(
        block_m=block_m,
        block_n=block_n,
        groups_per_step=gps,
        split_k=split,
        num_warps=4 if block_m <= 64 else 8,
        num_stages=2 if block_m == 256 else 3,
    )


_GROUPED_STATIC = (
    "block_m",
    "block_n",
    "groups_per_step",
    "split_k",
    "num_warps",
    "num_stages",
    "interpret",
)


@functools.partial(jax.jit, static_argnames=_GROUPED_STATIC)
def matmul_int4(
    x: jax.Array,
    packed: jax.Array,
    scale: jax.Array,
    zero: jax.Array,
    *,
    block_m: int = 64,
    block_n: int = 64,
    groups_per_step: int = 2,
    split_k: int = 1,
    num_warps: int = 4,
    num_stages: int = 3,
    interpret: bool = False,
) -> jax.Array:
    """``x @ w`` for ``w`` in 4-bit groups as ``models.quantization.quantize_int4`` holds
    it along the inputs: ``packed`` u8 ``[K / 2, N]`` (byte r of a column: inputs 2r, low
    nibble, and 2r + 1), ``scale`` and ``zero`` f32 ``[K / G, N]`` (``w = q * scale +
    zero`` in each group of G consecutive inputs). ``x`` bf16/f32 ``[M, K]``; returns
    ``[M, N]`` in ``x``'s dtype. The weight is read as it lies, 4 bits a value, and
    widened in registers a step of ``groups_per_step`` groups at a time: no dequantized
    copy in memory, which is what XLA:GPU makes of the same product (a bf16 copy of the
    weight each call: ``python -m benchmarks step_kernels --variants int4``). A program
    per ``block_m`` rows and ``block_n`` columns (times ``split_k`` slices of K, summed
    after in f32); M is padded to a multiple of ``block_m``. Raises ``ValueError`` for
    shapes the blocks do not divide (``grouped_config`` gives blocks that fit)."""
    if x.ndim != 2 or packed.ndim != 2 or packed.dtype != jnp.uint8:
        raise ValueError(
            f"x, packed: expected [M, K] and u8 [K / 2, N], got {x.shape} and "
            f"{packed.dtype}{list(packed.shape)}"
        )
    if packed.shape[0] * 2 != x.shape[1]:
        raise ValueError(
            f"packed: expected [{x.shape[1] // 2}, N] for x's K = {x.shape[1]}, got {packed.shape}"
        )
    return _grouped(
        x, packed, scale, zero, 4, block_m, block_n, groups_per_step, split_k,
        num_warps, num_stages, interpret,
    )  # fmt: skip


@functools.partial(jax.jit, static_argnames=_GROUPED_STATIC)
def matmul_int8_groups(
    x: jax.Array,
    q: jax.Array,
    scale: jax.Array,
    zero: jax.Array | None = None,
    *,
    block_m: int = 64,
    block_n: int = 64,
    groups_per_step: int = 2,
    split_k: int = 1,
    num_warps: int = 4,
    num_stages: int = 3,
    interpret: bool = False,
) -> jax.Array:
    """``x @ w`` for ``w`` in int8 groups along the inputs (a GGUF file's Q8_0, Q6_K,
    Q5_x... blocks kept, ``models.gguf_loader``): ``q`` int8 ``[K, N]``, ``scale`` (and
    ``zero``, the groups' minimums, or None) f32 ``[K / G, N]``: ``w = q * scale (+
    zero)``. As ``matmul_int4`` otherwise (XLA:GPU writes a dequantized copy of such a
    weight before its product too; a scale per output channel it widens in its GEMM)."""
    if x.ndim != 2 or q.ndim != 2 or q.dtype != jnp.int8 or q.shape[0] != x.shape[1]:
        raise ValueError(
            f"x, q: expected [M, K] and int8 [K, N], got {x.shape} and {q.dtype}{list(q.shape)}"
        )
    return _grouped(
        x, q, scale, zero, 8, block_m, block_n, groups_per_step, split_k,
        num_warps, num_stages, interpret,
    )  # fmt: skip


def _grouped(
    x, p, scale, zero, bits, block_m, block_n, groups_per_step, split_k, warps, stages, interpret
):
    """The pallas_call behind ``matmul_int4`` and ``matmul_int8_groups`` (shapes of ``x``
    and ``p`` checked there)."""
    for name, v in (
        ("block_m", block_m),
        ("block_n", block_n),
        ("groups_per_step", groups_per_step),
        ("split_k", split_k),
    ):
        tuning.check_pow2(name, v)
    if block_m < 16:
        raise ValueError(f"block_m: expected >= 16 (the tensor cores' rows), got {block_m}")
    M, K = x.shape
    N = p.shape[1]
    if (
        scale.ndim != 2
        or scale.shape[1] != N
        or K % scale.shape[0]
        or (zero is not None and zero.shape != scale.shape)
    ):
        got = f"{scale.shape} and {None if zero is None else zero.shape}"
        raise ValueError(
            f"scale, zero: expected [K / G, {N}] (zero the same or None) with G dividing "
            f"K = {K}, got {got}"
        )
    group = K // scale.shape[0]
    if group % 32:
        raise ValueError(f"scale: expected groups of a multiple of 32 inputs, got {group}")
    ks = K // split_k
    if N % block_n or ks % (group * groups_per_step):
        raise ValueError(
            f"w: expected N a multiple of block_n={block_n} and K / split_k a multiple of "
            f"{group * groups_per_step} (groups_per_step groups), got K={K}, N={N}"
        )
    Mp = -(-M // block_m) * block_m
    xp = x if Mp == M else jnp.pad(x, ((0, Mp - M), (0, 0)))
    kernel = functools.partial(
        _grouped_kernel,
        bits=bits,
        group=group,
        groups_per_step=groups_per_step,
        steps=ks // (group * groups_per_step),
        compute=x.dtype,
    )
    gs = ks // group
    per = 2 if bits == 4 else 1
    side = pl.BlockSpec((gs, block_n), lambda i, j, s: (s, j))
    out = pl.pallas_call(
        kernel,
        grid=(Mp // block_m, N // block_n, split_k),
        in_specs=[
            pl.BlockSpec((block_m, ks), lambda i, j, s: (i, s)),
            pl.BlockSpec((ks // per, block_n), lambda i, j, s: (s, j)),
            side,
            None if zero is None else side,
        ],
        out_specs=pl.BlockSpec((None, block_m, block_n), lambda i, j, s: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((split_k, Mp, N), jnp.float32 if split_k > 1 else x.dtype),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
        name=f"few_row_matmul_int{bits}",
    )(
        xp,
        p,
        scale.astype(jnp.float32),
        None if zero is None else zero.astype(jnp.float32),
    )
    out = out[0] if split_k == 1 else out.sum(0).astype(x.dtype)
    return out[:M]
