"""``paged_self_attention``: the one call a decoder layer needs on the paged cache.

It replaces a model's own KV cache update and attention: the step's new K and V rows go
into their pages by ``metadata.slot_mapping``, then every query token attends to its
sequence's pages through the block tables (``ragged_paged_attention``, or the decode
kernel when every sequence has one new token).
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from paged_jax.attention import paged_attention, ragged_paged_attention
from paged_jax.cache import PagedKVCache
from paged_jax.invariant import fit_rows
from paged_jax.metadata import AttentionMetadata
from paged_jax.sharding import data_parallel_size, sharded_attention, tensor_parallel_size


def paged_self_attention(
    q: jax.Array,  # [T, H, D]
    k: jax.Array,  # [T, K, D]
    v: jax.Array,  # [T, K, D]
    cache: PagedKVCache,
    layer: int | jax.Array,
    metadata: AttentionMetadata,
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,  # f32[H]
    backend: str = "auto",
    interpret: bool = False,
) -> tuple[jax.Array, PagedKVCache]:  # (o[T, H, D] in q's dtype, cache)
    """Writes layer ``layer``'s new K/V rows, then attends; returns ``(o, cache)``.

    Args:
      q: queries of the step's tokens (RoPE, if any, already applied), ``[T, H, D]``.
      k, v: their keys and values, ``[T, K, D]``; ``H`` a multiple of ``K`` (GQA/MQA).
      cache: the step's ``PagedKVCache`` (use the returned one afterwards).
      layer: this layer's index in the model, an int or a traced i32 scalar (a
        ``lax.scan`` over layers); a hybrid pool (``PagedKVCache.layer_groups``) maps it
        to its group's tables and its slot in the group's pages.
      metadata: the step's ``AttentionMetadata``, as the engine passes it to the model.
      sm_scale: softmax scale (default ``D ** -0.5``).
      sliding_window: attend to at most this many most recent tokens (None: all).
      soft_cap: scores become ``soft_cap * tanh(scores / soft_cap)`` (Gemma 2).
      sinks: ``f32[H]``, each query head's attention sink (GPT-OSS; see
        ``ragged_paged_attention``), or None.
      backend, interpret: see ``ragged_paged_attention``.

    Token t is causal: it sees its own sequence's tokens up to its own position.

    Under a mesh with a ``"tp"`` axis (``jax.set_mesh``), each device writes and attends
    with its own heads: q, k, v and the cache split along heads (``paged_jax.sharding``);
    with a ``"dp"`` axis, each replica with its own token rows, metadata and pages.
    """
    group, layer = cache.locate(layer)
    if group is not None:  # a hybrid pool: this layer's group's tables and slots
        metadata = dataclasses.replace(
            metadata,
            slot_mapping=metadata.slot_mapping[group],
            page_indices=metadata.page_indices[group],
        )
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, backend=backend)
    local = functools.partial(_self_attention, interpret=interpret, **kw)
    tp = tensor_parallel_size()
    if tp > 1 or data_parallel_size() > 1:
        return sharded_attention(local, q, k, v, cache, layer, metadata, tp, sinks)
    return local(q, k, v, cache, layer, metadata, sinks)


def _self_attention(
    q,
    k,
    v,
    cache,
    layer,
    metadata,
    sinks,
    *,
    sm_scale,
    sliding_window,
    soft_cap,
    backend,
    interpret,
):
    T, D = q.shape[0], q.shape[-1]
    cache = cache.write(layer, k, v, metadata.slot_mapping)
    kv_pages, page_indices, k_scale, v_scale = cache.attention_inputs(layer, metadata.page_indices)
    kw = dict(
        sm_scale=D**-0.5 if sm_scale is None else sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
        sinks=sinks,
        backend=backend,
        interpret=interpret,
        batch_invariant=metadata.batch_invariant,
    )
    if metadata.decode_only:  # token row i is sequence row i's only token
        S = metadata.kv_lens.shape[0]
        o = paged_attention(fit_rows(q, S), kv_pages, metadata.kv_lens, page_indices, **kw)
        return fit_rows(o, T), cache
    o = ragged_paged_attention(
        q, kv_pages, metadata.kv_lens, page_indices, metadata.cu_q_lens, metadata.num_seqs, **kw
    )
    return o, cache
