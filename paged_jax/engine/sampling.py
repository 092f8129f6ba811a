"""Sampling parameters (host) and the vectorized on-device sampler.

Every per-request value (temperature, top-k, top-p, seed) reaches the device as an array
row, so a new temperature never recompiles. Randomness is keyed by (seed + sample
index, output position) only, so a request samples the same tokens whatever else is in
the batch, and sample i of an ``n``-way request equals an ``n = 1`` run with seed
``seed + i``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.engine.sort_free import draw as sort_free_draw
from paged_jax.engine.sort_free import inverse_cdf as _inverse_cdf
from paged_jax.errors import FieldError

MAX_TOP_LOGPROBS = 20  # as OpenAI's top_logprobs
MAX_LOGIT_BIAS = 1024  # tokens a request may bias (SamplingParams.logit_bias)
# Bounds on SamplingParams.stop: each sampled token searches the text it can have
# completed for all of them (OpenAI's API takes 4; vLLM's server bounds them too).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256

# How the engine draws restricted rows on each JAX backend without sorting
# (``sample_rows``' ``sort_free``): "pallas_gpu", the Pallas kernel
# (``paged_jax.kernels.gpu.sample``), or "xla", the same passes as XLA reductions. A
# backend not named here takes the top-k candidates and the full-sort fallback; on CPU
# the engine's C kernel samples instead. On a GPU the kernel's time does not depend on
# how flat the rows are, where a single flat row sends the candidates' whole batch to the
# full sort (docs/DECISIONS.md, "Sort-free draws per backend").
# "pallas_gpu_split" (not yet timed on a GPU): XLA's passes with each radix round's sums
# by ``paged_jax.kernels.gpu.sample.trial_counts``, a row over several programs.
SORT_FREE_BACKENDS: dict[str, str] = {"gpu": "pallas_gpu"}
SORT_FREE_WAYS = ("xla", "pallas_gpu", "interpret", "pallas_gpu_split", "interpret_split")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick the tokens of one request.

    Attributes:
      max_tokens: generated tokens at most (>= 1).
      temperature: 0 means greedy (argmax).
      top_k: keep the k most likely tokens (0: all).
      top_p: keep the smallest set of tokens whose probability reaches top_p, in (0, 1].
      min_p: keep tokens at least min_p times as likely as the most likely one, in [0, 1]
        (after temperature; 0 disables it).
      repetition_penalty: > 0; a token already in the prompt or the output has its logit
        divided by it when positive, multiplied by it otherwise (1: off).
      presence_penalty: subtracted from the logit of every token already in the output,
        in [-2, 2] (0: off).
      frequency_penalty: subtracted once per earlier occurrence in the output, in [-2, 2]
        (0: off). The penalties apply before temperature and to greedy rows too, as in
        vLLM; returned log-probabilities stay those of the model's raw distribution.
      seed: random seed of the request (None: derived from the request's arrival order).
      n: independent samples sharing the prompt's pages (copy-on-write).
      beam_width: > 1 runs beam search instead of sampling (``n`` beams are returned,
        ``n <= beam_width``); the prompt's pages are shared by all beams.
      stop_token_ids: tokens that end a sequence (kept in the output).
      stop: strings that end a sequence when its text contains one (needs a tokenizer;
        found across token boundaries). The text ends before the stop string unless
        ``include_stop_str_in_output``; ``token_ids`` keep every generated token, up to
        the one that completed it. At most ``MAX_STOP_STRINGS`` (64) of at most
        ``MAX_STOP_STRING_CHARS`` (256) characters. Not with beam search.
      include_stop_str_in_output: keep the stop string at the end of the text.
      ignore_eos: do not stop at the model's end-of-sequence tokens.
      logprobs: return the log-probability of each generated token.
      top_logprobs: with each generated token, the ``top_logprobs`` most likely tokens
        of its step and their log-probabilities (0: none; at most ``MAX_TOP_LOGPROBS``;
        implies ``logprobs``). Under the model's raw distribution, as ``logprobs``. Not
        with beam search.
      length_penalty: beam search ranks finished beams by ``logprob / len ** penalty``.
      allowed_token_ids: when given, only these tokens can be sampled (greedy rows too):
        every other logit is -inf before sampling (``sample_rows``' ``allowed`` mask,
        the hook per-step grammars use too); not with beam search. Log-probabilities
        stay those of the model's raw distribution.
      structured: a ``StructuredOutput`` (``paged_jax.engine.structured``): the output
        follows a JSON schema, any JSON object, a regular expression, a choice or a
        Lark grammar, and ends when the grammar allows nothing more. Needs the
        ``llguidance`` package and a model with a tokenizer. With beam search each beam
        keeps its own grammar state and its candidates are the tokens its grammar
        allows, scored by the model's log-probs.
      min_tokens: generated tokens before a stop token, the model's end of sequence or a
        stop string may end the sequence, as vLLM's (0: off; at most ``max_tokens``):
        until then those tokens' logits are -inf (greedy rows too) and no stop string is
        looked for in the text so far. Its rows run as penalized ones do; not with beam
        search or structured output (whose grammar decides where the output ends).
      logit_bias: None, or ``{token id: bias}``, as OpenAI's: each bias, in [-100, 100], is
        added to its token's logit after the penalties, before anything picks a token
        (greedy rows too; -100 all but bans a token, 100 all but forces it); at most
        ``MAX_LOGIT_BIAS`` tokens. Its rows run as penalized ones do (one step a launch,
        not overlapped, not speculated; not with beam search). Log-probabilities stay
        those of the model's raw distribution.
      prompt_logprobs: None (off), or an int k in [0, ``MAX_TOP_LOGPROBS``]: the output's
        ``prompt_logprobs`` holds each prompt token's log-probability given the tokens
        before it (None for the first), and ``prompt_top_logprobs`` the k most likely
        tokens at each prompt position (0: none). Under the model's raw distribution.
        Such a request computes its whole prompt (no prefix cache hits) and its steps
        compute a logits row per prompt token.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    n: int = 1
    beam_width: int = 1
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    length_penalty: float = 1.0
    allowed_token_ids: tuple[int, ...] | None = None
    structured: Any = None  # a StructuredOutput
    prompt_logprobs: int | None = None
    logit_bias: Any = None  # {token id: bias}, kept as a sorted tuple of pairs
    min_tokens: int = 0

    def __post_init__(self):
        def bad(name, expected):
            raise FieldError(name, f"expected {expected}, got {getattr(self, name)!r}")

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
        if not is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "a float in [0, 1]")
        if not is_real(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("repetition_penalty", "a finite float > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if not is_real(getattr(self, name)) or not -2.0 <= getattr(self, name) <= 2.0:
                bad(name, "a float in [-2, 2]")
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
        if not is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            bad("top_logprobs", f"an int in [0, {MAX_TOP_LOGPROBS}]")
        if self.top_logprobs:
            if self.beam_width > 1:
                raise FieldError(
                    "top_logprobs", f"not supported with beam search (beam_width={self.beam_width})"
                )
            object.__setattr__(self, "logprobs", True)
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"an int in [0, max_tokens={self.max_tokens}]")
        if self.min_tokens and self.beam_width > 1:
            raise FieldError(
                "min_tokens", f"not supported with beam search (beam_width={self.beam_width})"
            )
        if self.min_tokens and self.structured is not None:
            raise FieldError(
                "min_tokens", "not with structured output (its grammar decides where it ends)"
            )
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _checked_bias(self.logit_bias))
            if self.beam_width > 1:
                raise FieldError(
                    "logit_bias", f"not supported with beam search (beam_width={self.beam_width})"
                )
        if self.beam_width > 1 and self.penalized:
            raise FieldError(
                "repetition_penalty, presence_penalty, frequency_penalty",
                f"not supported with beam search (beam_width={self.beam_width})",
            )
        if self.beam_width > 1 and self.n > self.beam_width:
            raise FieldError(
                "n", f"expected <= beam_width={self.beam_width} with beam search, got {self.n}"
            )
        if not _token_ids(ids := self.stop_token_ids):
            bad("stop_token_ids", "a list of token ids >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)) or not all(isinstance(x, str) and x for x in stop):
            bad("stop", "a string or a list of non-empty strings")
        if len(stop) > MAX_STOP_STRINGS:  # the message leaves the strings out: too long
            raise FieldError(
                "stop", f"expected at most {MAX_STOP_STRINGS} strings, got {len(stop)}"
            )
        if (longest := max(map(len, stop), default=0)) > MAX_STOP_STRING_CHARS:
            raise FieldError(
                "stop",
                f"expected strings of at most {MAX_STOP_STRING_CHARS} characters, "
                f"got one of {longest}",
            )
        object.__setattr__(self, "stop", tuple(stop))
        if not isinstance(self.include_stop_str_in_output, bool):
            bad("include_stop_str_in_output", "a bool")
        if self.stop and self.beam_width > 1:
            raise FieldError(
                "stop", f"not supported with beam search (beam_width={self.beam_width})"
            )
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
                bad("allowed_token_ids", "None or a non-empty list of token ids >= 0")
            ids = tuple(ids)
            if not ids or not all(is_int(t) and t >= 0 for t in ids):
                bad("allowed_token_ids", "None or a non-empty list of token ids >= 0")
            if self.beam_width > 1:
                raise FieldError(
                    "allowed_token_ids",
                    f"not supported with beam search (beam_width={self.beam_width})",
                )
            object.__setattr__(self, "allowed_token_ids", ids)
        if self.prompt_logprobs is not None and (
            not is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS
        ):
            bad("prompt_logprobs", f"None or an int in [0, {MAX_TOP_LOGPROBS}]")
        if self.structured is not None:
            from paged_jax.engine.structured import StructuredOutput

            if not isinstance(self.structured, StructuredOutput):
                raise TypeError(
                    f"structured: expected a StructuredOutput, got {type(self.structured).__name__}"
                )

    @property
    def use_beam_search(self) -> bool:
        return self.beam_width > 1

    @property
    def penalized(self) -> bool:
        """Whether any of the three penalties, a logit bias or ``min_tokens`` is on: its
        rows carry ``Penalties``."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.logit_bias)
            or self.min_tokens > 0
        )


def _token_ids(ids: Any) -> bool:
    """Whether ``ids`` is a sequence of token ids (ints >= 0, NumPy's too), not a string."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        return False
    return all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in ids)


def _checked_bias(bias: Any) -> tuple[tuple[int, float], ...]:
    """``SamplingParams.logit_bias`` as ``((token, bias), ...)`` sorted by token; a
    ValueError naming it for anything but a mapping of ids >= 0 (ints, or their decimal
    text, as JSON's keys are) to finite floats in [-100, 100]."""
    if isinstance(bias, tuple) and all(isinstance(x, tuple) for x in bias):
        bias = dict(bias)  # (already checked: a copy of a SamplingParams)
    if not isinstance(bias, Mapping):
        raise FieldError("logit_bias", f"expected None or {{token id: bias}}, got {bias!r:.60}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise FieldError("logit_bias", f"expected at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}")
    out = {}
    for key, value in bias.items():
        token = key
        if isinstance(key, str) and key.isdecimal():
            token = int(key)
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise FieldError("logit_bias", f"keys must be token ids >= 0, got {key!r:.40}")
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or not -100.0 <= value <= 100.0:
            raise FieldError(
                f"logit_bias[{key!r:.40}]", f"expected a float in [-100, 100], got {value!r:.40}"
            )
        out[token] = float(value)
    return tuple(sorted(out.items()))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Penalties:
    """Per-row penalty inputs of ``sample_rows`` (rows without penalties: 1, 0, 0).

    ``output_tokens`` / ``prompt_tokens``: ``i32[R, O]`` / ``i32[R, P]`` each row's
    generated and prompt token ids, padded with -1. ``bias_tokens`` / ``bias_values``:
    ``i32[R, B]`` / ``f32[R, B]`` each row's logit bias (``SamplingParams.logit_bias``),
    padded with -1 / 0, or None when no row has one."""

    repetition: jax.Array  # f32[R]
    presence: jax.Array  # f32[R]
    frequency: jax.Array  # f32[R]
    output_tokens: jax.Array  # i32[R, O]
    prompt_tokens: jax.Array  # i32[R, P]
    bias_tokens: jax.Array | None = None  # i32[R, B]
    bias_values: jax.Array | None = None  # f32[R, B]

    def with_neutral_rows(self, rows: int) -> Penalties:
        """These (host, numpy) inputs with ``rows`` more rows that change no logit (a
        speculative step's verify rows): every field padded with its neutral value."""
        more = {}
        for f in dataclasses.fields(self):
            a = getattr(self, f.name)
            if a is not None:
                pad = np.full((rows, *a.shape[1:]), _NEUTRAL[f.name], a.dtype)
                more[f.name] = np.concatenate([a, pad])
        return dataclasses.replace(self, **more)


# each Penalties field's value on a row without penalties
_NEUTRAL = dict(
    repetition=1.0,
    presence=0.0,
    frequency=0.0,
    output_tokens=-1,
    prompt_tokens=-1,
    bias_tokens=-1,
    bias_values=0.0,
)


def apply_penalties(logits: jax.Array, pen: Penalties) -> jax.Array:  # f32[R, V]
    """vLLM's repetition, presence and frequency penalties on ``logits`` f32[R, V], then
    each row's logit bias (added: a token listed twice gets both, as a stop token that
    ``min_tokens`` holds back at -inf and that has a bias of its own)."""
    R, V = logits.shape
    rows = jnp.arange(R)[:, None]

    def counts(tokens):
        ids = jnp.where((tokens >= 0) & (tokens < V), tokens, V)  # padding -> a spare column
        return jnp.zeros((R, V + 1), jnp.float32).at[rows, ids].add(1.0)[:, :V]

    out_count = counts(pen.output_tokens)
    seen = (out_count > 0) | (counts(pen.prompt_tokens) > 0)
    rep = pen.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = (
        logits
        - pen.frequency[:, None] * out_count
        - pen.presence[:, None] * (out_count > 0).astype(jnp.float32)
    )
    if pen.bias_tokens is None:
        return logits
    ids = jnp.where((pen.bias_tokens >= 0) & (pen.bias_tokens < V), pen.bias_tokens, V)
    return logits.at[rows, ids].add(pen.bias_values, mode="drop")


def _keys(seeds, positions):
    """One PRNG key per row from (seed, position): independent of the batch."""
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)


def _uniforms(seeds, positions):
    """``f32[R, J]``: the uniform in [0, 1) of each sample, keyed by its column's seed
    (``seeds`` u32[R, J]) and its row's output position (``positions`` i32[R])."""
    R, J = seeds.shape
    keys = _keys(seeds.reshape(-1), jnp.repeat(positions, J))
    return jax.vmap(jax.random.uniform)(keys).reshape(R, J)


# Candidates a restricted row (top-k, top-p or min-p) draws from: the row's largest logits,
# found with lax.top_k instead of sorting the vocabulary. A row whose kept set could reach
# past them is drawn from a full sort instead (exact either way).
NUM_CANDIDATES = 256


def _in_vocabulary_order(keep: jax.Array, index: jax.Array, vocab: int) -> jax.Array:
    """``bool[R, V]``: the tokens ``index`` (i32[R, C]) with ``keep`` (bool[R, C]) set,
    as a mask over the vocabulary (a scatter per row; ``index`` holds distinct tokens)."""
    R = keep.shape[0]
    rows = jnp.broadcast_to(jnp.arange(R)[:, None], index.shape)
    return jnp.zeros((R, vocab), bool).at[rows, index].set(keep, unique_indices=True)


def _kept(sorted_scaled, lse, top_k, top_p, min_p):
    """Keep mask of tokens in descending order: rank < top_k, probability mass before the
    token < top_p (the first token is always kept), probability >= min_p x the largest.
    Each rule keeps a prefix of the order, so their conjunction is a prefix too."""
    probs = jnp.exp(sorted_scaled - lse[:, None])
    rank = jnp.arange(sorted_scaled.shape[-1])[None, :]
    k = jnp.where(top_k > 0, top_k, jnp.iinfo(jnp.int32).max)[:, None]
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (rank < k) & (mass_before < top_p[:, None]) & (probs >= min_p[:, None] * probs[:, :1])
    return probs, keep | (rank == 0)


def argmax_rows(x: jax.Array) -> jax.Array:
    """``i32[R]``: ``jnp.argmax(x, axis=-1)`` of ``f32[R, V]``, the first index of the
    maximum (of the first NaN in a row holding one), as two plain reductions.

    XLA:CPU lowers ``argmax`` to a reduction over (value, index) pairs that it does not
    vectorize, about 4x the time of the maximum followed by the smallest index holding it
    (docs/DECISIONS.md, "argmax as two reductions"). ``x != x`` marks NaNs: the
    maximum of a row with a NaN is NaN, which equals nothing, so its first NaN wins, as
    with ``argmax``."""
    V = x.shape[-1]
    top = jnp.max(x, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where((x == top) | (x != x), index, V), axis=-1)


def allowed_bits(token_ids: Sequence[int], vocab: int) -> np.ndarray:
    """``i32[ceil(vocab / 32)]``: the ``allowed`` mask row of ``sample_rows`` that allows
    ``token_ids`` (bit ``t % 32`` of word ``t // 32``; ids outside the vocabulary are
    ignored)."""
    ids = np.asarray([t for t in token_ids if 0 <= t < vocab], np.int64)
    words = np.zeros(-(-vocab // 32), np.uint32)
    np.bitwise_or.at(words, ids >> 5, (np.uint32(1) << (ids & 31)).astype(np.uint32))
    return words.view(np.int32)


def mask_logits(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """``logits`` f32[R, V] with -inf where the bitmask ``allowed`` (``i32[R, ceil(V /
    32)]``, bit ``t % 32`` of word ``t // 32`` for token t) has a 0."""
    R, V = logits.shape
    words = allowed.view(jnp.uint32) if allowed.dtype == jnp.int32 else allowed
    token = jnp.arange(V, dtype=jnp.uint32)
    bit = (words[:, token >> 5] >> (token & 31)[None, :]) & 1
    return jnp.where(bit.astype(bool), logits, -jnp.inf)


def sample_rows(
    logits: jax.Array,  # f32[R, V]
    temperature: jax.Array,  # f32[R]  0 = greedy
    top_k: jax.Array,  # i32[R]  0 = off
    top_p: jax.Array,  # f32[R]  1 = off
    seeds: jax.Array,  # u32[R, J] one seed per sample column
    positions: jax.Array,  # i32[R]  output position of the token being sampled
    min_p: jax.Array | None = None,  # f32[R]  0 = off
    penalties: Penalties | None = None,
    allowed: jax.Array | None = None,  # i32[R, ceil(V / 32)] bitmask; None: every token
    *,
    greedy_only: bool = False,
    cpu_kernel: bool = False,
    sort_free: bool | str = False,
) -> tuple[jax.Array, jax.Array]:  # (i32[R, J] tokens, f32[R, J] log-probs under the model)
    """``J`` samples per row (column j drawn with ``seeds[:, j]``), and their log-probs.

    Greedy rows (temperature 0) return the argmax in every column; ``greedy_only=True``
    (static: the engine sets it when no row samples) computes nothing else. Sampled rows
    divide the logits by the temperature, keep the tokens that top-k, top-p and min-p
    allow (``_kept``: a prefix of the tokens in descending order of the scaled logits,
    ties by index), and draw one uniform per column, keyed by (seed, position), mapped
    through the kept tokens' CDF in vocabulary order (the first token whose running kept
    weight exceeds ``u`` times the kept total), restricted or not. Nothing sorts the
    vocabulary unless a restricted row's kept set could reach past the ``NUM_CANDIDATES``
    largest logits; that row alone then takes a full sort, giving the token the
    candidates would have given (the same kept set and draw). A row's token depends only
    on its own inputs. ``penalties`` (``apply_penalties``) change the logits first, greedy
    rows included; then ``allowed`` (``mask_logits``: a bitmask per row, at least one
    token allowed in each) sets every other token's logit to -inf, so nothing else is
    picked.
    Log-probabilities are those of the model's raw distribution. ``cpu_kernel`` (static;
    the engine sets it on CPU where the kernels built, without a mesh): the C kernels pick
    the tokens, ``paged_jax.kernels.cpu.greedy_rows`` for a greedy-only step and
    ``cpu.sample_tokens`` otherwise, from the same uniforms and by the same definition,
    without sorting the vocabulary even where the candidates above would fall back to a
    full sort (docs/DECISIONS.md, "The CPU sampling kernels"); tokens may differ from
    this path's only where a decision falls within rounding. ``sort_free`` (static; XLA
    path only; one of ``SORT_FREE_WAYS``, True meaning "xla"): restricted rows draw by
    ``sort_free.draw``'s radix passes over the row instead of the candidates and the
    full-sort fallback, the same token up to rounding at a cost that does not depend on
    how flat the row is: "xla" runs the passes as XLA reductions, "pallas_gpu" in the GPU
    kernel ``paged_jax.kernels.gpu.sample.restricted_draw`` (one program per row), "interpret"
    that kernel under Pallas' interpreter (tests on CPU); "pallas_gpu_split" the XLA
    passes with each radix round summed by ``...gpu.sample.trial_counts`` (a row over
    several programs) and ties ranked by ``nth_tied``, "interpret_split" those
    interpreted. Traceable.
    """
    raw = logits.astype(jnp.float32)
    R = raw.shape[0]
    if min_p is None:
        min_p = jnp.zeros(R, jnp.float32)
    way = "xla" if sort_free is True else sort_free
    if way and way not in SORT_FREE_WAYS:
        raise FieldError(
            "sort_free", f"expected False, True or one of {SORT_FREE_WAYS}, got {way!r}"
        )
    if cpu_kernel:
        return _sample_in_cpu_kernels(
            raw,
            temperature,
            top_k,
            top_p,
            seeds,
            positions,
            min_p,
            penalties,
            allowed,
            greedy_only=greedy_only,
        )
    lse_raw = jax.nn.logsumexp(raw, axis=-1, keepdims=True)
    logits = raw if penalties is None else apply_penalties(raw, penalties)
    if allowed is not None:
        logits = mask_logits(logits, allowed)
    greedy = jnp.broadcast_to(argmax_rows(logits)[:, None], seeds.shape)
    if not greedy_only:
        t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
        rows = _Rows(
            logits / t,
            temperature,
            top_k,
            top_p.astype(jnp.float32),
            min_p,
            _uniforms(seeds, positions),
        )
        if way in ("pallas_gpu", "interpret", "pallas_gpu_split", "interpret_split"):
            sampled = _draw_in_gpu_kernel(rows, way)
        else:
            sampled = _draw_in_xla(rows, sort_free=way == "xla")
        greedy = jnp.where(temperature[:, None] > 0, sampled, greedy)
    return greedy, jnp.take_along_axis(raw, greedy, axis=-1) - lse_raw


def raw_logprobs(raw: jax.Array, tokens: jax.Array, *, cpu_kernel: bool) -> jax.Array:
    """``f32[R, J]``: the log-probs of ``tokens`` (``i32[R, J]``) under the rows' raw
    distribution ``raw`` (``f32[R, V]`` logits, before penalties and masks), normalized
    as ``sample_rows`` normalizes them for rows with penalties or masks (``cpu_kernel``:
    summed as the C kernels sum)."""
    if cpu_kernel:
        from paged_jax.kernels import cpu

        lse = cpu.greedy_rows(raw)[1][:, None]
    else:
        lse = jax.nn.logsumexp(raw, axis=-1, keepdims=True)
    return jnp.take_along_axis(raw, tokens, axis=-1) - lse


def _sample_in_cpu_kernels(
    raw, temperature, top_k, top_p, seeds, positions, min_p, penalties, allowed, *, greedy_only
):
    """``sample_rows`` with ``cpu_kernel=True``: the C kernels pick the tokens."""
    from paged_jax.kernels import cpu

    R, J = seeds.shape
    logits = raw if penalties is None else apply_penalties(raw, penalties)
    if allowed is not None:
        logits = mask_logits(logits, allowed)
    if greedy_only:
        token, lse = cpu.greedy_rows(logits)
        tokens = jnp.broadcast_to(token[:, None], (R, J))
    else:
        tokens, lse = cpu.sample_tokens(
            logits,
            temperature.astype(jnp.float32),
            top_k.astype(jnp.int32),
            top_p.astype(jnp.float32),
            min_p.astype(jnp.float32),
            _uniforms(seeds, positions),
        )
    if penalties is not None or allowed is not None:  # log-probs under the model's
        lse = cpu.greedy_rows(raw)[1]  # own distribution, summed as the kernels do
    return tokens, jnp.take_along_axis(raw, tokens, axis=-1) - lse[:, None]


class _Rows(NamedTuple):
    """What a draw reads of the rows that sample: ``scaled`` f32[R, V] (logits over the
    temperature), the row's settings (f32/i32[R]) and ``u`` f32[R, J] uniforms."""

    scaled: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    u: jax.Array

    @property
    def lse(self) -> jax.Array:  # f32[R]
        return jax.nn.logsumexp(self.scaled, axis=-1)

    @property
    def restricted(self) -> jax.Array:  # bool[R]
        return (self.top_k > 0) | (self.top_p < 1.0) | (self.min_p > 0)

    def unrestricted(self, lse: jax.Array) -> jax.Array:  # i32[R, J]
        """The whole distribution, in vocabulary order (no sort, no top-k)."""
        return _inverse_cdf(jnp.exp(self.scaled - lse[:, None]), self.u).astype(jnp.int32)


def _draw_in_gpu_kernel(rows: _Rows, way: str) -> jax.Array:  # i32[R, J]
    """Sampled rows' tokens with the restricted ones drawn by the GPU sampling kernels.

    No lax.cond: on a GPU a conditional reads its predicate back to the host, which holds
    the step's dispatch until the device has run everything before it (the overlap of host
    work with the device's then stops). The kernel skips rows that are not drawn; the
    unrestricted rows' pass is cheap enough to run always.
    """
    from paged_jax.kernels.gpu.sample import nth_tied, restricted_draw, trial_counts

    interpret = way.startswith("interpret")
    restricted = rows.restricted
    if way.endswith("_split"):
        counts = functools.partial(trial_counts, interpret=interpret)
        nth = functools.partial(nth_tied, interpret=interpret)
        drawn = sort_free_draw(
            rows.scaled, rows.top_k, rows.top_p, rows.min_p, rows.u, counts=counts, nth=nth
        )
    else:
        active = (rows.temperature > 0) & restricted
        drawn = restricted_draw(
            rows.scaled, rows.top_k, rows.top_p, rows.min_p, rows.u, active, interpret=interpret
        )
    return jnp.where(restricted[:, None], drawn, rows.unrestricted(rows.lse))


def _draw_in_xla(rows: _Rows, *, sort_free: bool) -> jax.Array:  # i32[R, J]
    """Sampled rows' tokens in XLA: unrestricted rows by the whole distribution; restricted
    rows by ``sort_free.draw``'s radix passes (``sort_free``) or by the kept prefix of the
    ``NUM_CANDIDATES`` largest logits, with a full sort for a row whose kept set could
    reach past them. Each branch runs only when some row needs it (``lax.cond``)."""
    scaled, u = rows.scaled, rows.u
    R, vocab = scaled.shape
    lse = rows.lse
    sampled_row, restricted = rows.temperature > 0, rows.restricted
    none = jnp.zeros(u.shape, jnp.int32)
    full = jax.lax.cond(
        jnp.any(sampled_row & ~restricted), lambda: rows.unrestricted(lse), lambda: none
    )
    if sort_free:
        drawn = jax.lax.cond(
            jnp.any(sampled_row & restricted),
            lambda: sort_free_draw(scaled, rows.top_k, rows.top_p, rows.min_p, u),
            lambda: none,
        )
        return jnp.where(restricted[:, None], drawn, full)

    # Restricted rows: the kept prefix of the candidates (in descending order), drawn in
    # vocabulary order: the kept candidates sorted by index (C of them, not V).
    C = min(vocab, NUM_CANDIDATES)

    def candidates():
        vals, idx = jax.lax.top_k(scaled, C)
        probs, keep = _kept(vals, lse, rows.top_k, rows.top_p, rows.min_p)
        by_index = jnp.argsort(jnp.where(keep, idx, vocab), axis=-1)  # kept first, by index
        weights = jnp.take_along_axis(jnp.where(keep, probs, 0.0), by_index, axis=-1)
        at = jnp.take_along_axis(by_index, _inverse_cdf(weights, u), axis=-1)
        tok = jnp.take_along_axis(idx, at, axis=-1)
        return tok.astype(jnp.int32), keep[:, -1] & (C < vocab)

    cand, past_c = jax.lax.cond(
        jnp.any(sampled_row & restricted),
        candidates,
        lambda: (none, jnp.zeros(R, bool)),
    )
    overflow = sampled_row & restricted & past_c  # the kept set may go on past C

    def sorted_draw():
        order = jnp.argsort(-scaled, axis=-1)
        srt = jnp.take_along_axis(scaled, order, axis=-1)
        p, k = _kept(srt, lse, rows.top_k, rows.top_p, rows.min_p)
        kept = _in_vocabulary_order(k, order, vocab)
        weights = jnp.where(kept, jnp.exp(scaled - lse[:, None]), 0.0)
        return _inverse_cdf(weights, u).astype(jnp.int32)

    exact = jax.lax.cond(jnp.any(overflow), sorted_draw, lambda: cand)
    return jnp.where(restricted[:, None], jnp.where(overflow[:, None], exact, cand), full).astype(
        jnp.int32
    )


def prompt_scores(
    logits: jax.Array, targets: jax.Array, k: int, *, cpu_kernel: bool = False
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """Prompt log-probs (``SamplingParams.prompt_logprobs``) of rows ``logits`` (``f32[E,
    V]``, each a prompt position's): ``(log-prob f32[E] of each row's next prompt token
    ``targets`` (``i32[E]``), the ``k`` most likely tokens' log-probs f32[E, k] and ids
    i32[E, k])``, the last two None for ``k`` 0. Under the model's raw distribution, as
    the sampled tokens' log-probs, and computed as they are (a logit minus the row's
    log-sum-exp, summed by the C kernel ``cpu.greedy_rows`` with ``cpu_kernel``, static,
    as ``sample_rows`` does there, several times faster than XLA's): a row's target's
    log-prob equals its entry among the ``k`` bit for bit."""
    raw = logits.astype(jnp.float32)
    if cpu_kernel:
        from paged_jax.kernels import cpu

        lse = cpu.greedy_rows(raw)[1]
    else:
        lse = jax.nn.logsumexp(raw, axis=-1)
    target = jnp.take_along_axis(raw, targets.astype(jnp.int32)[:, None], axis=1)[:, 0] - lse
    if not k:
        return target, None, None
    vals, ids = jax.lax.top_k(raw, k)
    return target, vals - lse[:, None], ids.astype(jnp.int32)


def beam_candidates(
    logits: jax.Array, k: int, allowed: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """The ``k`` best (log-prob f32[R, k], token i32[R, k]) of each row, for beam search
    and ``top_logprobs``. ``allowed`` (``i32[R, ceil(V / 32)]`` bitmasks, or None): only
    these tokens are candidates (a beam's grammar); their log-probs stay the model's
    (normalized over the whole vocabulary). A row with fewer than ``k`` allowed tokens
    gets -inf log-probs in the rest."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    if allowed is not None:
        logp = mask_logits(logp, allowed)
    vals, ids = jax.lax.top_k(logp, k)
    return vals, ids.astype(jnp.int32)
