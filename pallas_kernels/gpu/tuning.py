"""Default block sizes and dot precisions of the GPU kernels.

The defaults are sized so a block fits a Hopper SM with room for more than one resident
block, from ahead-of-time compiles for sm_90 (``python -m paged_jax.kernels.gpu.aot``, see
``benchmarks/results/gpu_aot_sm90.json``). Measured there (Triton 3.9, decode, D = 128,
4 warps): shared memory is about 4 bytes per K/V element of a block in flight for 16-bit
pools (K and V, two buffers), so 128 tokens of bf16 take 132 KiB and 255 registers and leave
one block per SM, while 64 tokens take 68 KiB and 122 registers (three blocks per SM); an
f32 pool at 128 tokens needs 264 KiB, more than the 227 KiB a block may have, and would
not launch. They are defaults only: every kernel takes the knobs as keyword arguments, and
speed is for a GPU to decide (``python -m benchmarks kernels``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# One K (or V) block of one kv head: tokens * head_dim * bytes. 16 KiB keeps a decode block
# near 70 KiB of shared memory for every supported head dim and dtype.
KV_BLOCK_BYTES = 16 * 1024
# Decode blocks when batch * kv heads alone fill the SMs (the sequence is not split): half
# the bytes, so more blocks stay resident per SM. Measured on an H100 (bf16, D = 128, page
# 16, benchmarks/results/kernels_gpu.json): 32-token blocks took 0.43 ms at batch 64 x 4k
# against 0.54 ms for 64-token blocks (96% against 77% of copy bandwidth) and were within 2%
# of the best point at batch 256; with batch 8 (sequences split) 64-token blocks were best.
FULL_GRID_KV_BLOCK_BYTES = 8 * 1024
# Whether the decode kernel's walk loads a block ahead by hand (``decode.py``, ``prefetch``).
# Compiled for sm_90 (triton 3.9, and XLA's Triton in JAX 0.10.2), Triton's pipelining of
# the plain walk issues a block's cp.async copies after the previous block's dots and waits
# on them at once (the walk's latency in every block: its table entries, then its K/V), and
# a third stage changes nothing. Not yet timed on a GPU (``python -m benchmarks kernels
# --tune`` sweeps both), so off until one says.
DECODE_PREFETCH = False
# The ragged kernel's stacked query block ([tokens * group, D]) in bytes, by the compute
# dtype's item size: 16 KiB is 64 rows of bf16 at D = 128, where Triton uses Hopper's wgmma
# (m64) instead of mma.sync. Measured on an H100 (Hq 32, Hkv 8, bf16 prefill): 64 rows ran
# 1.65x faster than 32 rows (2.05 against 3.40 ms for 8 x 2048 causal tokens); 128 rows were
# 4-13% faster still, but every decode row of a mixed batch pays for the whole block. f32
# keeps 8 KiB (16 rows at D = 128, 8 at D = 256): more rows spilled registers.
Q_BLOCK_BYTES = {2: 16 * 1024, 4: 8 * 1024}
MAX_ROWS = {2: 64, 4: 16}


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, int(x)).bit_length() - 1)


def compute_dtype(q_dtype) -> jnp.dtype:
    """The dtype the kernels feed the tensor cores: 16-bit queries keep their dtype (K/V are
    converted to it after dequantization), everything else computes in f32."""
    dtype = jnp.dtype(q_dtype)
    return dtype if dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) else jnp.float32


def dot_precision(compute: jnp.dtype, interpret: bool):
    """Precision of the kernels' dots. f32 on a GPU: three TF32 passes (about f32 accuracy
    on the tensor cores; a plain f32 dot spilled registers at every block size tried).
    Interpret mode runs on XLA:CPU, which has no TF32 algorithms: exact f32 there."""
    if jnp.dtype(compute) != jnp.float32:
        return None
    if interpret:
        return jax.lax.Precision.HIGHEST
    return jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def pages_per_block(
    head_dim: int,
    kv_dtype,
    page_size: int,
    max_pages: int,
    q_dtype,
    block_bytes: int = KV_BLOCK_BYTES,
) -> int:
    """Pages per K/V block: the largest power of two keeping one K block within
    ``block_bytes`` (counted at the wider of the pool's and the compute dtype's width,
    since quantized pages are widened before the dot), at least one page, at most the table's
    width rounded down to a power of two."""
    itemsize = max(np.dtype(kv_dtype).itemsize, jnp.dtype(compute_dtype(q_dtype)).itemsize)
    tokens = max(1, block_bytes // (head_dim * itemsize))
    # Both bounds are powers of two: Triton's lowering takes only power-of-two array sizes
    # (a table 5 pages wide once gave blocks of 5 pages, which interpret mode accepted).
    return int(min(_pow2_floor(max_pages), _pow2_floor(max(1, tokens // page_size))))


def ragged_tokens_per_block(group: int, head_dim: int, q_dtype) -> int:
    """Query tokens per ragged program: the stacked ``[tokens * group, D]`` query block
    within ``Q_BLOCK_BYTES`` for the compute dtype, at most ``MAX_ROWS`` rows (``group`` a
    power of two), at least one token."""
    itemsize = jnp.dtype(compute_dtype(q_dtype)).itemsize
    rows = min(MAX_ROWS[itemsize], _pow2_floor(Q_BLOCK_BYTES[itemsize] // (head_dim * itemsize)))
    return max(1, rows // group)


def check_pow2(name: str, value: int | None) -> None:
    """Raises ``ValueError`` unless ``value`` is None or a power of two >= 1 (block sizes
    become array dimensions, and Triton's lowering accepts only powers of two)."""
    if value is None:
        return
    if not isinstance(value, int) or value < 1 or value & (value - 1):
        raise ValueError(f"{name}: expected a power of two >= 1, got {value!r}")


# The sampling kernel (``sample.py``, one program per row): logits per chunk of a row, key
# bits decided per radix pass (2**bits trial keys compared per logit), and warps per
# program, by how many rows the SMs hold. Measured on an H200 (128,256 logits, top-p 0.9,
# benchmarks/results/draw_gpu_h200.json, 15 configurations): at 256 rows 2048 x 2 bits x 8
# warps took 3.66 ms and 4096 x 2 x 16 3.97; at 64 rows (most SMs idle) 4096 x 2 x 16
# took 1.69 and 2048 x 2 x 8 2.13. 4 bits a pass (16 trial keys) cost more in compares
# than the passes they save; 1 bit, more in passes.
SAMPLE_DIGIT_BITS = 2
# How many chunks ahead each pass loads before computing on this one (0: none). Not yet
# measured on a GPU (the kernel above was timed without it; ``python -m benchmarks draw``
# compares them: ``--configs 2048:2:8 2048:2:8:p 2048:2:8:p4``), so 0 until a GPU says
# otherwise. A pass computes a few instructions a logit, so with one load in flight a
# step still takes a load's latency: more chunks ahead (8 registers a thread each at
# 2048 logits and 8 warps) keep more bytes in flight.
SAMPLE_PREFETCH = 0
SAMPLE_FEW_ROWS = 132  # up to one program per SM of an H100 / H200


def sample_block_and_warps(rows: int) -> tuple[int, int]:
    """(logits per chunk, warps per program) of the sampling kernel for ``rows`` rows."""
    return (4096, 16) if rows <= SAMPLE_FEW_ROWS else (2048, 8)
