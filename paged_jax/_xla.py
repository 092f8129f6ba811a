"""The ``"xla"`` backend: paged attention in plain jnp, jit-able on any platform.

Tokens are processed in blocks of ``tokens_per_block``; for each block a loop walks the
KV in blocks of ``pages_per_block`` pages, gathering for every token only the pages of
its own sequence, and folds them in with an online (flash) softmax in f32. Peak
temporary memory is one gathered block, ``tokens_per_block * pages_per_block * P * 2K * D``
elements, whatever the pool or context size; the loop stops at the last page any token
of the block can see and starts at the first page inside its sliding window.

Decode is the same computation with one token per sequence, where the per-token gather
is exactly the per-sequence gather and no K/V byte is read twice.

When one gathered block can hold the whole step (every token against its whole block
table within the 32 MiB budget: decode and small steps), the loops are left out. That
matters on CPU: XLA:CPU has no bf16/f16 data path and its float-normalization pass
rewrites a loop that gathers from a 16-bit pool into one that first converts the whole
pool to f32 (a pool-sized temporary per call, seen with jax 0.10.2). Loop-free steps and
f32 pools never pay it (``tests/test_attention.py`` checks both); GPUs and TPUs move
16-bit data natively.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from paged_jax import _quant

_HI = jax.lax.Precision.HIGHEST
_TEMP_BUDGET_BYTES = 32 * 1024 * 1024


def default_block_sizes(num_tokens: int, page_size: int, num_kv_heads: int, head_dim: int):
    """(tokens_per_block, pages_per_block) keeping one gathered f32 block near 32 MiB."""
    pages_per_block = max(1, 128 // page_size)
    row_bytes = pages_per_block * page_size * 2 * num_kv_heads * head_dim * 4
    tokens = max(1, min(128, _TEMP_BUDGET_BYTES // row_bytes))
    tokens = 1 << (tokens.bit_length() - 1)  # power of two
    tokens = min(tokens, max(1, 1 << max(0, num_tokens - 1).bit_length()))
    return tokens, pages_per_block


def _scale_rows(scale, pages, num_kv_heads):
    """Per-token scales of gathered ``pages: [t, b]`` -> f32[t, b*P, K] (scalars pass)."""
    if scale is None or jnp.ndim(scale) == 0:
        return scale
    s = scale[pages]  # [t, b, P, K]
    return s.reshape(s.shape[0], -1, num_kv_heads)


# Batch-invariant mode: fixed blocks, whatever the step (see ``attend_tokens``).
INVARIANT_TOKENS_PER_BLOCK = 8
INVARIANT_KV_TOKENS = 128  # tokens per KV block (pages: this // page size, at least 1)


def attend_tokens(
    q: jax.Array,  # [T, H, D]
    kv_pages: jax.Array,  # [N, P, 2K, D]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, M]
    tok_seq: jax.Array,  # i32[T]  sequence row of each token
    tok_pos: jax.Array,  # i32[T]  absolute position of each token in its sequence
    tok_valid: jax.Array,  # bool[T] False for padding tokens (output 0, nothing read)
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    k_scale,
    v_scale,
    sinks: jax.Array | None = None,  # f32[H]
    tokens_per_block: int | None = None,
    pages_per_block: int | None = None,
    batch_invariant: bool = False,
) -> jax.Array:  # [T, H, D], q.dtype
    """``sinks``: each query head's sink, a logit in the softmax's sum whose value is 0
    (the running max starts at it and the sum at 1).

    ``batch_invariant``: every token's result is bitwise independent of the rest of the
    step. Its keys are folded in KV blocks of a fixed size (``INVARIANT_KV_TOKENS``) in a
    fixed order, through the same compiled loop body, and tokens are grouped in blocks of
    a fixed count: no size is chosen from the step's token count or table width (which
    changes the summation order, measured as 1-ulp differences between a token alone and
    in a batch of 16 or more). Blocks past a token's own keys are fully masked, and
    folding a fully masked block leaves the running sums bitwise unchanged."""
    num_tokens, num_heads, head_dim = q.shape
    num_pages, page_size, combined, _ = kv_pages.shape
    num_kv_heads = combined // 2
    group = num_heads // num_kv_heads
    if num_tokens == 0:
        return q
    page_indices, bq, bp = _block_sizes(
        num_tokens,
        page_indices,
        kv_pages.shape,
        tokens_per_block,
        pages_per_block,
        batch_invariant=batch_invariant,
    )
    max_pages = page_indices.shape[1]
    num_kv_blocks = -(-max_pages // bp)
    chunk = bp * page_size
    num_blocks = -(-num_tokens // bq)
    pad = num_blocks * bq - num_tokens

    def pad_to_blocks(x, fill):
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=fill)
        return x.reshape((num_blocks, bq) + x.shape[1:])

    q_blocks = pad_to_blocks(q, 0)
    seq_blocks = pad_to_blocks(tok_seq, 0)
    pos_blocks = pad_to_blocks(tok_pos, 0)
    valid_blocks = pad_to_blocks(tok_valid, False)

    pool5 = kv_pages.reshape(num_pages, page_size, num_kv_heads, 2, head_dim)

    def one_block(args):
        q_b, seq_b, pos_b, valid_b = args  # [bq, H, D], [bq], [bq], [bq]
        q_kgd = q_b.astype(jnp.float32).reshape(bq, num_kv_heads, group, head_dim)
        kv_end = jnp.max(jnp.where(valid_b, pos_b + 1, 0))
        stop = jnp.minimum((kv_end + chunk - 1) // chunk, num_kv_blocks)  # a bad kv_len
        start = jnp.int32(0)
        if sliding_window is not None:
            first_key = jnp.min(jnp.where(valid_b, pos_b - sliding_window + 1, kv_end))
            start = jnp.clip(first_key, 0, None) // chunk

        def kv_step(j, carry):
            cols = j * bp + jnp.arange(bp)
            in_table = cols < max_pages
            pages = page_indices[seq_b[:, None], jnp.minimum(cols, max_pages - 1)[None, :]]
            # Padding columns, padding tokens and ids outside the pool read the null page
            # (a negative id would otherwise wrap onto another sequence's page).
            ok = in_table[None, :] & valid_b[:, None] & (pages >= 0) & (pages < num_pages)
            pages = jnp.where(ok, pages, 0)  # [bq, bp]
            # One gather each for K and V, straight from the pool (no gathered KV block
            # split in two afterwards: that copy cost as much as the gather on CPU).
            k = pool5[pages, :, :, 0, :].reshape(bq, chunk, num_kv_heads, head_dim)
            v = pool5[pages, :, :, 1, :].reshape(bq, chunk, num_kv_heads, head_dim)
            k_pos = j * chunk + jnp.arange(chunk)
            mask = (k_pos[None, :] <= pos_b[:, None]) & valid_b[:, None]  # [bq, chunk]
            if sliding_window is not None:
                mask &= pos_b[:, None] - k_pos[None, :] < sliding_window
            k = _quant.dequantize_rows(k, _scale_rows(k_scale, pages, num_kv_heads), jnp.float32)
            v = _quant.dequantize_rows(v, _scale_rows(v_scale, pages, num_kv_heads), jnp.float32)
            # Masked keys and values may be garbage or NaN (stale or unwritten pages). A
            # masked key's score is replaced by -inf in _fold, whatever it was; a masked value
            # is zeroed here, since its zero weight times NaN would still be NaN.
            v = jnp.where(mask[:, :, None, None], v, 0.0)
            return _fold(carry, q_kgd, k, v, mask, sm_scale=sm_scale, soft_cap=soft_cap)

        shape = (bq, num_kv_heads, group)
        init = (
            jnp.full(shape, -jnp.inf, jnp.float32)
            if sinks is None
            else jnp.broadcast_to(sinks.astype(jnp.float32).reshape(shape[1:]), shape),
            jnp.zeros(shape, jnp.float32) if sinks is None else jnp.ones(shape, jnp.float32),
            jnp.zeros((bq, num_kv_heads, group, head_dim), jnp.float32),
        )
        if num_kv_blocks == 1 and not batch_invariant:  # no loop: see the module docstring
            _, l, acc = kv_step(0, init)
        else:
            _, l, acc = jax.lax.fori_loop(start, stop, kv_step, init)
        out = acc / jnp.where(l > 0, l, 1.0)[..., None]
        return out.reshape(bq, num_heads, head_dim).astype(q.dtype)

    blocks = (q_blocks, seq_blocks, pos_blocks, valid_blocks)
    if num_blocks == 1 and not batch_invariant:
        out = one_block(jax.tree.map(lambda x: x[0], blocks))[None]
    else:
        out = jax.lax.map(one_block, blocks)
    return out.reshape(num_blocks * bq, num_heads, head_dim)[:num_tokens]


def _block_sizes(
    num_tokens, page_indices, pool_shape, tokens_per_block, pages_per_block, *, batch_invariant
):
    """``attend_tokens``' blocking: ``(page_indices, tokens a block, pages a KV block)``,
    the table widened to whole KV blocks when ``batch_invariant``. With no sizes given, one
    block of everything where its temporaries fit ``_TEMP_BUDGET_BYTES``."""
    _, page_size, combined, head_dim = pool_shape
    max_pages = page_indices.shape[1]
    if batch_invariant:
        tokens_per_block = INVARIANT_TOKENS_PER_BLOCK
        pages_per_block = max(1, INVARIANT_KV_TOKENS // page_size)
        width = -(-max_pages // pages_per_block) * pages_per_block  # whole blocks only
        page_indices = jnp.pad(page_indices, ((0, 0), (0, width - max_pages)))
        max_pages = width
    d_tq, d_pb = default_block_sizes(num_tokens, page_size, combined // 2, head_dim)
    whole_step_bytes = num_tokens * max_pages * page_size * combined * head_dim * 4
    if (
        tokens_per_block is None
        and pages_per_block is None
        and whole_step_bytes <= _TEMP_BUDGET_BYTES
    ):
        d_tq, d_pb = num_tokens, max_pages
    return page_indices, tokens_per_block or d_tq, min(pages_per_block or d_pb, max_pages)


def _fold(carry, q_kgd, k, v, mask, *, sm_scale, soft_cap):
    """One KV block folded into the online softmax ``carry`` (``m``, ``l`` f32[bq, K, G],
    ``acc`` f32[bq, K, G, D]): ``q_kgd`` f32[bq, K, G, D], ``k``/``v`` f32[bq, C, K, D]
    (masked values already zero), ``mask`` bool[bq, C]."""
    m, l, acc = carry
    s = jnp.einsum("tkgd,tckd->tkgc", q_kgd, k, precision=_HI) * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    alpha = jnp.exp(m - m_safe)
    l = alpha * l + jnp.sum(p, axis=-1)
    acc = alpha[..., None] * acc + jnp.einsum("tkgc,tckd->tkgd", p, v, precision=_HI)
    return m_new, l, acc


def ragged_token_layout(kv_lens, cu_q_lens, num_seqs, num_tokens: int):
    """Per-token (sequence row, absolute position, valid) of a ragged batch, each ``[T]``."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    n = jnp.reshape(num_seqs, (-1,))[0]
    num_rows = kv_lens.shape[0]
    seq = jnp.searchsorted(cu_q_lens[1:], t, side="right").astype(jnp.int32)
    valid = (t < cu_q_lens[jnp.clip(n, 0, num_rows)]) & (seq < n)
    seq = jnp.where(valid, seq, 0)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq] - q_len + (t - cu_q_lens[seq])
    return seq, pos, valid


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "tokens_per_block",
        "pages_per_block",
        "batch_invariant",
    ),
)
def ragged_paged_attention(
    q,
    kv_pages,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale,
    sliding_window,
    soft_cap,
    k_scale,
    v_scale,
    sinks=None,
    tokens_per_block=None,
    pages_per_block=None,
    batch_invariant=False,
):
    seq, pos, valid = ragged_token_layout(kv_lens, cu_q_lens, num_seqs, q.shape[0])
    return attend_tokens(
        q,
        kv_pages,
        kv_lens,
        page_indices,
        seq,
        pos,
        valid,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
        sinks=sinks,
        tokens_per_block=tokens_per_block,
        pages_per_block=pages_per_block,
        batch_invariant=batch_invariant,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "tokens_per_block",
        "pages_per_block",
        "batch_invariant",
    ),
)
def paged_attention(
    q,
    kv_pages,
    kv_lens,
    page_indices,
    *,
    sm_scale,
    sliding_window,
    soft_cap,
    k_scale,
    v_scale,
    sinks=None,
    tokens_per_block=None,
    pages_per_block=None,
    batch_invariant=False,
):
    batch = q.shape[0]
    seq = jnp.arange(batch, dtype=jnp.int32)
    return attend_tokens(
        q,
        kv_pages,
        kv_lens,
        page_indices,
        seq,
        kv_lens - 1,
        kv_lens > 0,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
        sinks=sinks,
        tokens_per_block=tokens_per_block,
        pages_per_block=pages_per_block,
        batch_invariant=batch_invariant,
    )
