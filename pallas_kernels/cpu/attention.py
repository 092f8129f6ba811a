"""Paged attention on the CPU (``decode.c``): decode and ragged (prefill chunks and decode
rows), each sequence's pages read in place, once, with an online softmax, split over
the cores; the signatures of ``paged_jax.paged_attention`` and
``paged_jax.ragged_paged_attention``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .build import (
    RAGGED_TARGET,
    TARGET,
    require,
    threads_of,
)


def decode_paged_attention(
    q: jax.Array,  # [B, H, D] f32 | bf16
    kv_pages: jax.Array,  # [N, P, 2K, D] f32 | bf16
    kv_lens: jax.Array,  # i32[B]
    page_indices: jax.Array,  # i32[B, M]
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale=None,
    v_scale=None,
    sinks: jax.Array | None = None,  # f32[H]
    batch_invariant: bool = False,
    interpret: bool = False,
    threads: int | None = None,
) -> jax.Array:  # [B, H, D], q.dtype
    """Decode attention over a paged cache on the CPU; arguments as
    ``paged_jax.paged_attention``. ``threads``: at most this many threads (default: the
    cores this process may use); the result does not depend on it. Raises ``ValueError``
    for quantized pools (``k_scale``/``v_scale``), dtypes other than f32/bf16, and when
    the kernel is not available here (``unavailable_reason()``)."""
    del interpret, batch_invariant  # one computation; every row independent of the batch
    params = _attention_params(
        q, kv_pages, k_scale, v_scale, sm_scale, sliding_window, soft_cap, threads, sinks
    )
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(
        q, kv_pages, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(page_indices, jnp.int32), params
    )


def ragged_paged_attention(
    q: jax.Array,  # [T, H, D] f32 | bf16
    kv_pages: jax.Array,  # [N, P, 2K, D] f32 | bf16
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, M]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale=None,
    v_scale=None,
    sinks: jax.Array | None = None,  # f32[H]
    batch_invariant: bool = False,
    interpret: bool = False,
    threads: int | None = None,
) -> jax.Array:  # [T, H, D], q.dtype
    """Attention for a ragged batch (prefill chunks and decode tokens) on the CPU;
    arguments as ``paged_jax.ragged_paged_attention``. Each query token attends to its
    sequence's keys up to its position; up to 8 consecutive tokens of a sequence read
    each block of keys together. A token's result is bitwise the decode kernel's for it
    alone (blocks of keys lie at fixed multiples for every token), so it depends neither
    on the other tokens nor on ``threads``. Rows no
    sequence owns (past ``cu_q_lens[num_seqs]``) are 0. Raises ``ValueError`` as
    ``decode_paged_attention``."""
    del interpret, batch_invariant
    params = _attention_params(
        q, kv_pages, k_scale, v_scale, sm_scale, sliding_window, soft_cap, threads, sinks
    )
    call = jax.ffi.ffi_call(RAGGED_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    return call(q, kv_pages, i32(kv_lens), i32(page_indices), i32(cu_q_lens), i32(num_seqs), params)


def _attention_params(
    q, kv_pages, k_scale, v_scale, sm_scale, sliding_window, soft_cap, threads, sinks=None
):
    """Checks what the attention kernels read; their params operand: f32[4], or f32[4 + H]
    with the heads' ``sinks`` after the four."""
    if k_scale is not None or v_scale is not None:
        raise ValueError("k_scale/v_scale: the CPU kernel reads f32 or bf16 pools only")
    for name, x in (("q", q), ("kv_pages", kv_pages)):
        if x.dtype not in (jnp.float32, jnp.bfloat16):
            raise ValueError(f"{name}: expected float32 or bfloat16, got {x.dtype}")
    count = threads_of(threads)
    require()
    params = jnp.asarray([sm_scale, sliding_window or 0, soft_cap or 0.0, count], jnp.float32)
    if sinks is None:
        return params
    return jnp.concatenate([params, jnp.asarray(sinks, jnp.float32).reshape(q.shape[1])])
