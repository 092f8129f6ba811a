"""The ragged kernels' work list: (sequence, first query token) blocks. jax.numpy only."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl


def work_list(cu_q_lens, num_seqs, num_tokens: int, tokens_per_block: int):
    """(seq i32[W], first token i32[W], valid i32[W]) with W = cdiv(T, bq) + S."""
    S = cu_q_lens.shape[0] - 1
    W = pl.cdiv(num_tokens, tokens_per_block) + S
    n = jnp.reshape(num_seqs, (-1,))[0]
    q_lens = jnp.where(jnp.arange(S) < n, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    blocks = (q_lens + tokens_per_block - 1) // tokens_per_block
    ends = jnp.cumsum(blocks)
    w = jnp.arange(W)
    seq = jnp.minimum(jnp.searchsorted(ends, w, side="right"), S - 1).astype(jnp.int32)
    blk = w - (ends[seq] - blocks[seq])
    start = (cu_q_lens[seq] + blk * tokens_per_block).astype(jnp.int32)
    valid = (w < ends[-1]).astype(jnp.int32)
    return seq, jnp.where(valid > 0, start, 0), valid
