"""The per-step device inputs of a paged model, as one pytree."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where a step's tokens live and what they attend to (all int32 arrays).

    Attributes:
      slot_mapping: ``i32[T]`` cache slot of each token's K/V (padding: a null-page slot).
      kv_lens: ``i32[S]`` tokens each sequence attends to, the step's tokens included.
      page_indices: ``i32[S, M]`` block tables.
      cu_q_lens: ``i32[S + 1]`` cumulative new-token counts.
      num_seqs: ``i32[1]`` live sequences.
      logits_indices: ``i32[R]`` rows of the token axis whose logits the step returns
        (each sequence's last token; any rows for tests).
      copy_src, copy_dst: ``i32[C]`` copy-on-write page copies applied first.
      decode_only: static (part of the jit cache key, not an array). True promises that
        every live sequence has exactly one new token and that token row ``i`` belongs to
        sequence row ``i``, with ``kv_lens == 0`` on padding rows; models then call the
        decode kernel (``paged_jax.paged_attention``) instead of the ragged one, which on
        a GPU is 3-18x faster for such rows (``benchmarks/results/kernels_gpu.json``).
      batch_invariant: static. Every token's logits must be bitwise independent of the
        rest of the step: models run row-wise work on fixed tiles of rows and attention
        with fixed blocks (``ragged_paged_attention(batch_invariant=True)``); never
        combined with ``decode_only``.
    """

    slot_mapping: jax.Array
    kv_lens: jax.Array
    page_indices: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array
    logits_indices: jax.Array
    copy_src: jax.Array
    copy_dst: jax.Array
    decode_only: bool = dataclasses.field(default=False, metadata=dict(static=True))
    batch_invariant: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @classmethod
    def from_batch(cls, batch, *, batch_invariant: bool = False) -> AttentionMetadata:
        """From a ``paged_jax.StepBatch`` (host numpy arrays, moved to the device; the
        engine sends them packed instead, ``_pack_inputs``); ``decode_only`` when
        every scheduled sequence computes one token (unless ``batch_invariant``: the
        decode kernel's reduction order differs from the ragged one's, so a row's result
        would depend on its step's other rows)."""
        static = ("decode_only", "batch_invariant")
        arrays = {
            f.name: jnp.asarray(getattr(batch, f.name))
            for f in dataclasses.fields(cls)
            if f.name not in static
        }
        return cls(
            **arrays,
            decode_only=decode_only(batch) and not batch_invariant,
            batch_invariant=batch_invariant,
        )

    @classmethod
    def prefill(cls, num_tokens: int, slots, page_table_row, *, logits_all: bool = False):
        """One sequence's whole prompt in one step (tests, demos)."""
        slots = np.asarray(slots, np.int32)
        return cls(
            slot_mapping=jnp.asarray(slots),
            kv_lens=jnp.array([num_tokens], jnp.int32),
            page_indices=jnp.asarray(np.asarray(page_table_row, np.int32)[None]),
            cu_q_lens=jnp.array([0, num_tokens], jnp.int32),
            num_seqs=jnp.array([1], jnp.int32),
            logits_indices=jnp.arange(num_tokens, dtype=jnp.int32)
            if logits_all
            else jnp.array([num_tokens - 1], jnp.int32),
            copy_src=jnp.zeros(1, jnp.int32),
            copy_dst=jnp.zeros(1, jnp.int32),
        )


def decode_only(batch) -> bool:
    """Whether every scheduled sequence of a ``paged_jax.StepBatch`` computes one token
    (``AttentionMetadata.decode_only``, unless the step is batch-invariant)."""
    return len(batch.seq_ids) > 0 and batch.num_tokens == len(batch.seq_ids)
