"""Multi-step decoding: several decode steps of the same sequences in one jitted launch.

A launch of ``K`` steps schedules, builds and applies once for ``K`` tokens of each
sequence, so the host's work per token falls about K-fold. That is what makes host
overhead small where host and device share the same cores (XLA on CPU, where the
engine's overlapped steps cannot hide it). The engine takes this path
(``LLM(num_scheduler_steps=K)``) only for a schedule of plain decode rows (one token
each, no beams, no penalties, no first token of ``n`` samples) with nothing waiting to
be admitted; see ``docs/ENGINE.md``.

On the device (``decode_loop``) step ``i`` feeds each row the token step ``i - 1``
sampled, at position ``p + i``, attending to ``kv_len + i`` tokens, its K/V written to
the slot its block table gives that position. The block manager reserved those slots
before the launch (``BlockManager.reserve_tokens``; the engine gives the tokens their
values with ``fill_reserved`` after it). Row ``r`` runs ``steps[r]`` steps (fewer near its
``max_tokens``); past them it recomputes its last step with its K/V written to the null
page, and its results there are dropped. Sampling is keyed by seed and output position
as in single steps, so the tokens are those of ``K`` single steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from paged_jax.metadata import AttentionMetadata


def decode_loop(
    model_step: Callable,
    sample: Callable,
    tokens: jax.Array,
    positions: jax.Array,
    cache,
    md: AttentionMetadata,
    steps: jax.Array,
    out_pos: jax.Array,
    num_steps: int,
):
    """Runs up to ``num_steps`` decode steps of a decode-only batch in one loop on the
    device (``max(steps)`` of them: a launch whose rows are near their ends stops early).

    Args:
      model_step: ``(tokens i32[T], positions i32[T], cache, md) -> (logits f32[S, V],
        cache)``, the model.
      sample: ``(logits f32[S, V], out_pos i32[S]) -> (tokens i32[S, 1], logprobs
        f32[S, 1])``.
      tokens, positions: ``i32[T]`` (T >= S) the first step's; token row ``r`` is
        sequence row ``r`` (``md.decode_only`` or a batch-invariant step of one token per
        row).
      cache: the ``PagedKVCache`` (``page_size`` static).
      md: the first step's metadata; its block tables cover every step's position.
      steps: ``i32[S]`` steps each row runs (0: a padding row).
      out_pos: ``i32[S]`` output position of each row's first sampled token.
      num_steps: static, the most steps a launch runs (the outputs' width).

    Returns:
      ``(tokens i32[S, num_steps], logprobs f32[S, num_steps], cache)``: row ``r``'s
      first ``steps[r]`` columns are its samples; the rest are to be dropped.
    """
    S = md.kv_lens.shape[0]
    P = cache.page_size
    rows = jnp.arange(S)
    first = positions[:S]
    real = steps > 0
    last = jnp.maximum(steps - 1, 0)

    def body(i, carry):
        toks_in, cache, out_t, out_l = carry
        off = jnp.minimum(i, last)  # a row past its steps repeats its last one
        pos = jnp.where(real, first + off, first)
        slot = md.page_indices[rows, pos // P] * P + pos % P
        slot = jnp.where(i < steps, slot, 0)  # repeats write to the null page
        md_i = dataclasses.replace(
            md,
            kv_lens=jnp.where(real, md.kv_lens + off, 0),
            slot_mapping=md.slot_mapping.at[:S].set(slot),
            # the launch applies its copy-on-write copies once, before the loop
            copy_src=jnp.zeros_like(md.copy_src),
            copy_dst=jnp.zeros_like(md.copy_dst),
        )
        logits, cache = model_step(toks_in, positions.at[:S].set(pos), cache, md_i)
        t, lp = sample(logits, out_pos + i)
        out_t = jax.lax.dynamic_update_index_in_dim(out_t, t[:, 0], i, 1)
        out_l = jax.lax.dynamic_update_index_in_dim(out_l, lp[:, 0].astype(out_l.dtype), i, 1)
        return toks_in.at[:S].set(t[:, 0]), cache, out_t, out_l

    out_t = jnp.zeros((S, num_steps), jnp.int32)
    out_l = jnp.zeros((S, num_steps), jnp.float32)
    # As many steps as the longest row runs (no step of the launch is all repeats).
    trips = jnp.minimum(jnp.max(steps), num_steps)
    _, cache, out_t, out_l = jax.lax.fori_loop(0, trips, body, (tokens, cache, out_t, out_l))
    return out_t, out_l, cache
