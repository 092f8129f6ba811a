"""Default block sizes and dot precisions of the GPU kernels.

The defaults are sized so a block fits a Hopper SM with room for more than one resident
block, from ahead-of-time compiles for sm_90 (``python -m pallas_kernels.gpu.aot``, see
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
# The ragged kernel's stacked query block ([tokens * group, D]) in bytes of the compute
# dtype: 8 KiB is 32 rows of bf16 at D = 128 (about 72 KiB of shared memory and 220
# registers), 16 rows at D = 256 or for f32; more rows spilled registers with f32.
Q_BLOCK_BYTES = 8 * 1024
MAX_ROWS = {2: 32, 4: 16}


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


def pages_per_block(head_dim: int, kv_dtype, page_size: int, max_pages: int, q_dtype) -> int:
    """Pages per K/V block: the largest power of two keeping one K block within
    ``KV_BLOCK_BYTES`` (counted at the wider of the pool's and the compute dtype's width,
    since quantized pages are widened before the dot), at least one page, at most the table's
    width."""
    itemsize = max(np.dtype(kv_dtype).itemsize, jnp.dtype(compute_dtype(q_dtype)).itemsize)
    tokens = max(1, KV_BLOCK_BYTES // (head_dim * itemsize))
    return int(max(1, min(max_pages, _pow2_floor(max(1, tokens // page_size)))))


def ragged_tokens_per_block(group: int, head_dim: int, q_dtype) -> int:
    """Query tokens per ragged program: the stacked ``[tokens * group, D]`` query block
    within ``Q_BLOCK_BYTES`` of the compute dtype, at most ``MAX_ROWS`` rows (``group`` a
    power of two), at least one token."""
    itemsize = jnp.dtype(compute_dtype(q_dtype)).itemsize
    rows = min(MAX_ROWS[itemsize], _pow2_floor(Q_BLOCK_BYTES // (head_dim * itemsize)))
    return max(1, rows // group)
