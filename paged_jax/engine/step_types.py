"""The labelled hand-offs of one step between the engine's parts: what the launcher asks
the model runner to run (``StepInputs``, with its rows' ``SamplingColumns`` and the
prompt positions it scores, ``PromptScoring``), what the jitted step returns on the
device (``StepOutputs``), and what the engine reads back (``HostOutputs``).

Shape letters (the package docstring's): ``T_b`` the step's token bucket, ``S_b`` its
sequence bucket, ``R_b`` its sampling rows (``S_b``, or more for a speculative verify
step), ``J`` samples per row (``n`` samples of a prompt's first token), ``C`` candidates
per row (beams, top log-probs), ``K`` decode steps of a multi-step launch, ``E_b`` prompt
positions scored, ``V`` the vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass
class SamplingColumns:
    """Each sampling row's parameters, as columns (host arrays) over the step's rows."""

    temperature: np.ndarray  # f32[R_b]; 0: greedy
    top_k: np.ndarray  # i32[R_b]; 0: all
    top_p: np.ndarray  # f32[R_b]
    min_p: np.ndarray  # f32[R_b]
    seeds: np.ndarray  # u32[R_b, J]; row r's sample j draws with seeds[r, j]
    out_pos: np.ndarray  # i32[R_b]; the output position of the token sampled

    @classmethod
    def idle(cls, rows: int, num_samples: int = 1) -> SamplingColumns:
        """``rows`` greedy, unrestricted rows (``num_samples`` seeds each): what the
        launcher fills in for the rows that sample, and what padding rows keep."""
        return cls(
            temperature=np.zeros(rows, np.float32),
            top_k=np.zeros(rows, np.int32),
            top_p=np.ones(rows, np.float32),
            min_p=np.zeros(rows, np.float32),
            seeds=np.zeros((rows, num_samples), np.uint32),
            out_pos=np.zeros(rows, np.int32),
        )

    def columns(self) -> tuple[np.ndarray, ...]:
        """The columns in field order (how they are packed into the step's buffer)."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    def gather(self, rows: np.ndarray, size: int) -> SamplingColumns:
        """``size`` rows: row ``i < len(rows)`` is this one's row ``rows[i]``, the rest
        idle."""
        out = SamplingColumns.idle(size, self.seeds.shape[1])
        for f in dataclasses.fields(self):
            getattr(out, f.name)[: len(rows)] = getattr(self, f.name)[rows]
        return out

    def with_samples(self, num_samples: int) -> SamplingColumns:
        """These columns with ``num_samples`` seeds a row: the first ones kept, more as
        zeros (samples to be dropped). The other columns are shared, read only."""
        J = self.seeds.shape[1]
        seeds = np.zeros((self.seeds.shape[0], num_samples), np.uint32)
        seeds[:, : min(J, num_samples)] = self.seeds[:, :num_samples]
        return dataclasses.replace(self, seeds=seeds)

    def with_out_pos(self, out_pos: np.ndarray) -> SamplingColumns:
        """These columns (shared, read only) with ``out_pos`` in place of theirs."""
        return dataclasses.replace(self, out_pos=out_pos)


@dataclasses.dataclass(frozen=True)
class PromptScoring:
    """The prompt positions a step scores (``SamplingParams.prompt_logprobs``): token row
    ``rows[e]``'s log-prob of ``targets[e]`` and its ``top`` most likely tokens."""

    rows: np.ndarray  # i32[E_b]: token rows of the step (padding: row 0)
    targets: np.ndarray  # i32[E_b]
    top: int  # a power of two, or 0


@dataclasses.dataclass
class StepInputs:
    """Everything one dispatch of the jitted step takes (``ModelRunner.launch``).

    Only ``batch``, ``tokens`` and ``sampling`` are always there; every other input is
    None (or 0) when no row of the step needs it, and the step then compiles without it.
    """

    batch: Any  # paged_jax.batch.StepBatch: positions, tables, slots, logits rows
    tokens: Any  # i32[T_b], a host array, or a device one (overlapped steps' merges)
    sampling: SamplingColumns
    replicas: int = 1  # data-parallel replicas' batches side by side
    penalties: Any = None  # sampling.Penalties of the rows (host arrays)
    allowed: np.ndarray | None = None  # i32[R_b, ceil(V / 32)]: bitmask of allowed tokens
    cand_allowed: np.ndarray | None = None  # i32[R_b, ceil(V / 32)]: beams' candidates'
    num_candidates: int = 0  # C: each row's most likely tokens returned (beams, top-k)
    adapters: np.ndarray | None = None  # i32[T_b]: each token's adapter (adapter_ids)
    steps: np.ndarray | None = None  # i32[S]: a multi-step launch, each row's decode steps
    scoring: PromptScoring | None = None
    # The model call only: the rows are sampled by ``ModelRunner.sample`` once their masks
    # are known (``allowed`` and ``cand_allowed`` must then be None)
    defer_sample: bool = False


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepOutputs:
    """What the jitted step returns besides the pool, on the device until read.

    A multi-step launch's tokens and their log-probs travel as one array (``packed``:
    ``tokens`` is ``i32[S_b, 2 K]``, the tokens then the log-probs' bits): one transfer
    to the host instead of two. Its ``last`` holds each row's last sample as a token row
    (``i32[T_b]``, 0 for padding): the input of the launch that goes on from it.
    """

    tokens: Any = None  # i32[R_b, J] (packed: i32[S_b, 2 K])
    logprobs: Any = None  # f32[R_b, J] (packed: None)
    cand_logprobs: Any = None  # f32[R_b, C] or None
    cand_ids: Any = None  # i32[R_b, C] or None
    # prompt_scores' (log-probs f32[E_b], top log-probs f32[E_b, k], top ids i32[E_b, k])
    scores: Any = None
    last: Any = None  # i32[T_b] (multi-step) or None
    logits: Any = None  # f32[R_b, V] of a step run with defer_sample, else None
    packed: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @classmethod
    def of_steps(cls, tokens: jax.Array, logprobs: jax.Array, last: jax.Array) -> StepOutputs:
        """A multi-step launch's outputs (in a jitted function): ``tokens`` ``i32[S_b,
        K]`` and ``logprobs`` ``f32[S_b, K]`` packed into one array."""
        bits = jax.lax.bitcast_convert_type(logprobs, jnp.int32)
        both = jnp.concatenate([tokens.astype(jnp.int32), bits], axis=1)
        return cls(tokens=both, last=last, packed=True)

    def map(self, fn) -> StepOutputs:
        """``fn`` applied to every array (a sharding constraint, say)."""
        return jax.tree.map(fn, self)

    def read(self) -> HostOutputs:
        """Waits for the step and copies its outputs to the host."""
        if self.packed:
            both = np.asarray(self.tokens)
            K = both.shape[1] // 2
            toks, lps = both[:, :K], both[:, K:].view(np.float32)
        else:
            toks, lps = np.asarray(self.tokens), np.asarray(self.logprobs)
        cand = None
        if self.cand_logprobs is not None:
            cand = (np.asarray(self.cand_logprobs), np.asarray(self.cand_ids))
        scores = None
        if self.scores is not None:
            scores = tuple(None if a is None else np.asarray(a) for a in self.scores)
        return HostOutputs(toks, lps, cand, scores)


@dataclasses.dataclass
class HostOutputs:
    """A step's outputs on the host (``StepOutputs.read``)."""

    tokens: np.ndarray  # i32[R_b, J]; a multi-step launch's i32[S_b, K]
    logprobs: np.ndarray  # f32, as tokens
    candidates: tuple[np.ndarray, np.ndarray] | None  # (f32[R_b, C], i32[R_b, C])
    scores: tuple | None  # as StepOutputs.scores


@dataclasses.dataclass
class Dispatched:
    """``ModelRunner.launch``'s answer: the step's outputs (not waited for), or for a
    step run with ``defer_sample`` the ``DeferredSample`` to hand ``ModelRunner.sample``;
    the dispatch call's seconds, and whether it compiled a new program."""

    outputs: Any  # StepOutputs | step_io.DeferredSample
    seconds: float
    compiled: bool
