"""Plain-jnp oracles for every attention kernel of the package.

Written for clarity, not speed: an eager Python loop over sequences, each sequence's
pages gathered into contiguous K/V, softmax in f32 on the whole row. Nothing here is
shared with the fast paths (``paged_jax._xla``, ``pallas_kernels``) so a bug there
cannot hide here. Needs concrete (non-traced) ``kv_lens``, ``cu_q_lens`` and
``num_seqs``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import _quant
from paged_jax._validation import static_check_decode, static_check_ragged

_HI = jax.lax.Precision.HIGHEST


def _gather_kv(kv_pages, page_row, kv_len, k_scale, v_scale):
    """K, V of one sequence as ``f32[kv_len, K, D]`` each."""
    n = -(-kv_len // kv_pages.shape[1])
    return _gather_pages(kv_pages, jnp.asarray(page_row[:n]), k_scale, v_scale, kv_len=kv_len)


@functools.partial(jax.jit, static_argnames=("kv_len",))
def _gather_pages(kv_pages, pages, k_scale, v_scale, *, kv_len):
    page_size = kv_pages.shape[1]
    num_kv_heads = kv_pages.shape[2] // 2
    n = pages.shape[0]
    kv = kv_pages[pages].reshape(n * page_size, 2 * num_kv_heads, -1)[:kv_len]
    k, v = kv[:, 0::2], kv[:, 1::2]

    def scale_rows(s):
        if s is None or jnp.ndim(s) == 0:
            return s
        return jnp.asarray(s)[pages].reshape(n * page_size, num_kv_heads)[:kv_len]

    k = _quant.dequantize_rows(k, scale_rows(k_scale), jnp.float32)
    v = _quant.dequantize_rows(v, scale_rows(v_scale), jnp.float32)
    return k, v


# One compiled program per sequence shape: op by op, every sequence of a new length
# compiled a dozen small programs (9 s of a 5-sequence test case on CPU, now ~1 s).
@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap"))
def _attend(q, k, v, q_pos, *, sm_scale, sliding_window, soft_cap):
    """q: [Q, H, D]; k, v: f32[C, K, D]; q_pos: [Q] absolute positions -> f32[Q, H, D]."""
    num_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_kgd = q.astype(jnp.float32).reshape(num_q, num_kv_heads, num_heads // num_kv_heads, head_dim)
    s = jnp.einsum("qkgd,ckd->kgqc", q_kgd, k, precision=_HI) * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    k_pos = jnp.arange(k.shape[0])
    mask = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        mask &= q_pos[:, None] - k_pos[None, :] < sliding_window
    s = jnp.where(mask[None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("kgqc,ckd->qkgd", p, v, precision=_HI)
    return out.reshape(num_q, num_heads, head_dim)


def ragged_paged_attention(
    q: jax.Array,  # [T, H, D]
    kv_pages: jax.Array,  # [N, P, 2K, D]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, M]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float | jax.Array | None = None,
    v_scale: float | jax.Array | None = None,
) -> jax.Array:  # [T, H, D], q.dtype
    """Oracle for ``paged_jax.ragged_paged_attention``; rows past ``cu_q_lens[num_seqs]`` are 0.

    Sequence i's new tokens ``q[cu_q_lens[i]:cu_q_lens[i+1]]`` sit at positions
    ``kv_len - q_len ... kv_len - 1`` and attend causally to keys ``0 .. own position``
    (and only the last ``sliding_window`` of them if set).
    """
    static_check_ragged(
        q,
        kv_pages,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    kv_lens_np = np.asarray(kv_lens)
    cu = np.asarray(cu_q_lens)
    table = np.asarray(page_indices)
    out = jnp.zeros(q.shape, q.dtype)
    for i in range(int(np.asarray(num_seqs).reshape(-1)[0])):
        start, stop, kv_len = int(cu[i]), int(cu[i + 1]), int(kv_lens_np[i])
        if stop == start:
            continue
        k, v = _gather_kv(kv_pages, table[i], kv_len, k_scale, v_scale)
        q_pos = jnp.arange(kv_len - (stop - start), kv_len)
        o = _attend(
            q[start:stop],
            k,
            v,
            q_pos,
            sm_scale=sm_scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
        )
        out = out.at[start:stop].set(o.astype(q.dtype))
    return out


def paged_attention(
    q: jax.Array,  # [B, H, D]
    kv_pages: jax.Array,  # [N, P, 2K, D]
    kv_lens: jax.Array,  # i32[B]
    page_indices: jax.Array,  # i32[B, M]
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float | jax.Array | None = None,
    v_scale: float | jax.Array | None = None,
) -> jax.Array:  # [B, H, D], q.dtype
    """Oracle for ``paged_jax.paged_attention``: query b sits at position ``kv_lens[b] - 1``.

    Rows with ``kv_lens[b] == 0`` (padding) are 0.
    """
    static_check_decode(
        q,
        kv_pages,
        kv_lens,
        page_indices,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    kv_lens_np = np.asarray(kv_lens)
    table = np.asarray(page_indices)
    out = jnp.zeros(q.shape, q.dtype)
    for b in range(q.shape[0]):
        kv_len = int(kv_lens_np[b])
        if kv_len == 0:
            continue
        k, v = _gather_kv(kv_pages, table[b], kv_len, k_scale, v_scale)
        o = _attend(
            q[b : b + 1],
            k,
            v,
            jnp.array([kv_len - 1]),
            sm_scale=sm_scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
        )
        out = out.at[b].set(o[0].astype(q.dtype))
    return out
