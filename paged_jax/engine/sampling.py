"""Sampling parameters (host) and the vectorized on-device sampler.

Every per-request value (temperature, top-k, top-p, seed) reaches the device as an array
row, so a new temperature never recompiles. Randomness is keyed by (seed + sample
index, output position) only, so a request samples the same tokens whatever else is in
the batch, and sample i of an ``n``-way request equals an ``n = 1`` run with seed
``seed + i``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick the tokens of one request.

    Attributes:
      max_tokens: generated tokens at most (>= 1).
      temperature: 0 means greedy (argmax).
      top_k: keep the k most likely tokens (0: all).
      top_p: keep the smallest set of tokens whose probability reaches top_p, in (0, 1].
      seed: random seed of the request (None: derived from the request's arrival order).
      n: independent samples sharing the prompt's pages (copy-on-write).
      beam_width: > 1 runs beam search instead of sampling (``n`` beams are returned,
        ``n <= beam_width``); the prompt's pages are shared by all beams.
      stop_token_ids: tokens that end a sequence (kept in the output).
      ignore_eos: do not stop at the model's end-of-sequence tokens.
      logprobs: return the log-probability of each generated token.
      length_penalty: beam search ranks finished beams by ``logprob / len ** penalty``.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    beam_width: int = 1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    length_penalty: float = 1.0

    def __post_init__(self):
        def bad(name, expected):
            raise ValueError(f"{name}: expected {expected}, got {getattr(self, name)!r}")

        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        def is_real(x):
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "an int >= 1")
        if not is_real(self.temperature) or self.temperature < 0:
            bad("temperature", "a finite float >= 0")
        if not is_int(self.top_k) or not 0 <= self.top_k < 2**31:
            bad("top_k", "an int in [0, 2**31) (0 disables it)")
        if not is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", "a float in (0, 1]")
        if not is_int(self.n) or self.n < 1:
            bad("n", "an int >= 1")
        if not is_int(self.beam_width) or self.beam_width < 1:
            bad("beam_width", "an int >= 1")
        if self.seed is not None:
            # Sample j uses seed + j, a uint32 on the device.
            last = max(self.n, self.beam_width) - 1
            if not is_int(self.seed) or not 0 <= self.seed <= 2**32 - 1 - last:
                bad("seed", f"None or an int in [0, 2**32 - {last + 1}] (n={self.n})")
        if not is_real(self.length_penalty):
            bad("length_penalty", "a finite float")
        if not isinstance(self.ignore_eos, bool) or not isinstance(self.logprobs, bool):
            bad("ignore_eos" if not isinstance(self.ignore_eos, bool) else "logprobs", "a bool")
        if self.beam_width > 1 and self.n > self.beam_width:
            raise ValueError(
                f"n: expected <= beam_width={self.beam_width} with beam search, got {self.n}"
            )
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def use_beam_search(self) -> bool:
        return self.beam_width > 1


def _keys(seeds, positions):
    """One PRNG key per row from (seed, position): independent of the batch."""
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)


def sample_rows(
    logits: jax.Array,  # f32[R, V]
    temperature: jax.Array,  # f32[R]  0 = greedy
    top_k: jax.Array,  # i32[R]  0 = off
    top_p: jax.Array,  # f32[R]  1 = off
    seeds: jax.Array,  # u32[R, J] one seed per sample column
    positions: jax.Array,  # i32[R]  output position of the token being sampled
) -> tuple[jax.Array, jax.Array]:  # (i32[R, J] tokens, f32[R, J] log-probs under the model)
    """``J`` samples per row (column j drawn with ``seeds[:, j]``), and their log-probs.

    Greedy rows (temperature 0) return the argmax in every column. Log-probabilities are
    those of the model's raw distribution. Traceable: the engine calls it inside its step.
    """
    logits = logits.astype(jnp.float32)
    R, vocab = logits.shape
    J = seeds.shape[1]
    logp = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # Temperature, then top-k and top-p on the sorted distribution.
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    scaled = logits / t
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    k = jnp.where(top_k > 0, top_k, vocab)[:, None]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # Keep a token if the mass before it is below top_p (so the first is always kept).
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (rank < k) & (mass_before < top_p[:, None])
    sorted_logits = jnp.where(keep, sorted_logits, -jnp.inf)
    keys = _keys(seeds.reshape(-1), jnp.repeat(positions, J))
    choice = jax.vmap(jax.random.categorical)(keys, jnp.repeat(sorted_logits, J, axis=0))
    choice = choice.reshape(R, J)
    sampled = jnp.take_along_axis(order, choice, axis=-1).astype(jnp.int32)
    tokens = jnp.where(temperature[:, None] > 0, sampled, greedy[:, None])
    return tokens, jnp.take_along_axis(logp, tokens, axis=-1)


def beam_candidates(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The ``k`` best (log-prob f32[R, k], token i32[R, k]) of each row, for beam search."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    vals, ids = jax.lax.top_k(logp, k)
    return vals, ids.astype(jnp.int32)
