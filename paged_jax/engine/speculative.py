"""Speculative decoding: what to propose (``SpeculativeConfig``, the proposers) and how
a verify step's samples are accepted (``accept``). No JAX here.

A decoding sequence whose proposer finds a continuation computes it as extra query
tokens of the same ragged step: its input is its last sampled token and the ``k``
proposed tokens, and the step samples ``k + 1`` tokens, one from each position's logits,
with the request's own sampling parameters and the seed and output position each token
would have had without speculation. Token ``j`` is kept while every proposal before it
equals the sample before it, so the tokens kept are exactly those the engine samples
without speculation, greedy or seeded: for a proposal ``d`` that is certain (as n-gram
lookup and a greedy draft make them), drawing ``x`` from the target's distribution ``p``
and accepting ``d`` when ``x == d`` accepts it with probability ``p(d) = min(1, p(d) /
q(d))``, and a rejection leaves ``x`` distributed as ``p`` without ``d``, renormalized:
the standard rejection rule with ``q`` a point mass, which needs no second draw.

The engine core drafts (``EngineCore._draft``), appends the proposals to the block
manager like any token, and after the step drops the rejected ones
(``BlockManager.truncate``): their pages go back to the pool, and only kept tokens ever
reach the prefix cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from paged_jax.batch import bucket
from paged_jax.block_manager import OutOfPages
from paged_jax.engine.launch import MIN_STEP_TOKENS
from paged_jax.engine.request import Work

METHODS = ("ngram", "draft")
# A sequence verifies all its proposals, wherever tokens cost compute, only while a
# moving average of the fraction of its proposals accepted stays at least this
# (``Speculation._ration``).
CONFIDENT = 0.6


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding for ``LLM(speculative=...)``.

    Attributes:
      method: ``"ngram"``: prompt lookup, the last tokens of a sequence matched against
        its own prompt and output, the tokens that followed the latest match proposed
        (no second model).
      num_speculative_tokens: proposed tokens per sequence per step, at most (1 to 16).
      prompt_lookup_max: longest suffix matched (tried first), 1 to 16.
        ``"draft"``: a second, smaller model (``draft_model``) that shares the target's
        tokenizer proposes its greedy continuation (``paged_jax.engine.draft``).
      num_speculative_tokens: proposed tokens per sequence per step, at most (1 to 16).
      prompt_lookup_max: longest suffix matched (tried first), 1 to 16 (n-gram).
      prompt_lookup_min: shortest suffix matched, 1 to ``prompt_lookup_max`` (n-gram).
      draft_model: the draft: a paged-jax model object, or a name or path that
        ``LLM`` loads with ``paged_jax.models.load`` (method ``"draft"`` only).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    draft_model: Any = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative.method: expected one of {METHODS}, got {self.method!r}")
        for name, low, high in (
            ("num_speculative_tokens", 1, 16),
            ("prompt_lookup_max", 1, 16),
            ("prompt_lookup_min", 1, 16),
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
                raise ValueError(
                    f"speculative.{name}: expected an int in [{low}, {high}], got {v!r}"
                )
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError(
                "speculative.draft_model: expected a model with method 'draft' (and none "
                f"with {self.method!r}), got {type(self.draft_model).__name__}"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative.prompt_lookup_min: expected <= prompt_lookup_max="
                f"{self.prompt_lookup_max}, got {self.prompt_lookup_min}"
            )

    @classmethod
    def of(cls, value: Any) -> SpeculativeConfig | None:
        """``value`` as a config: None, a ``SpeculativeConfig``, or a dict of its fields
        (``{"method": "ngram", "num_speculative_tokens": 4}``)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
            if unknown:
                raise ValueError(f"speculative: unknown fields {unknown}")
            return cls(**value)
        raise TypeError(
            f"speculative: expected None, a SpeculativeConfig or a dict, got {type(value).__name__}"
        )

    def proposer(
        self, *, vocab_size: int, page_size: int, num_pages: int, **draft_args: Any
    ) -> Proposer:
        """The proposer this config describes, for a target of ``vocab_size`` tokens (a
        draft gets a pool of ``num_pages`` pages of ``page_size`` tokens, and
        ``draft_args``: ``DraftModelProposer``'s limits and compile callback)."""
        if self.method == "draft":
            from paged_jax.engine.draft import DraftModelProposer

            return DraftModelProposer(
                self.draft_model,
                vocab_size=vocab_size,
                page_size=page_size,
                num_pages=num_pages,
                **draft_args,
            )
        return NgramProposer(self.prompt_lookup_min, self.prompt_lookup_max)


class DraftRequest(NamedTuple):
    """One sequence to propose for: its id, its tokens so far (``i32[n]``, prompt and
    output, the last one sampled but not yet computed) and how many tokens it may take."""

    seq_id: Hashable
    tokens: np.ndarray
    max_tokens: int


class Proposer(Protocol):
    """What the engine asks of a proposer: for each request, up to ``max_tokens`` token ids
    that it guesses follow (an empty list: no guess). A proposer with state of its own
    per sequence (a draft model's cache) may also define ``release(seq_id)``, which the
    engine calls when a sequence ends (finished or aborted)."""

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]: ...


class NgramProposer:
    """Prompt lookup: the longest suffix of ``min_n`` to ``max_n`` tokens that occurred
    before in the sequence, and the tokens that followed its latest earlier occurrence.
    O(n) a sequence: the candidates are the earlier positions of its last token, narrowed
    one token back at a time."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [lookup(r.tokens, r.max_tokens, self.min_n, self.max_n) for r in requests]


def lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
    suffix of ``tokens`` (``i32[L]``) of ``min_n`` to ``max_n`` tokens; [] if none
    occurred."""
    L = len(tokens)
    if k <= 0 or L < min_n + 1:
        return []
    # ends[i]: an earlier position whose token equals the last one (something follows it)
    ends = np.flatnonzero(tokens[: L - 1] == tokens[L - 1])
    best = ends if min_n <= 1 else None
    for back in range(1, min(max_n, L - 1)):
        ends = ends[ends >= back]
        ends = ends[tokens[ends - back] == tokens[L - 1 - back]]
        if not len(ends):
            break
        if back + 1 >= min_n:
            best = ends  # matches of back + 1 tokens
    if best is None or not len(best):
        return []
    e = int(best[-1])
    return tokens[e + 1 : e + 1 + k].tolist()


def accept(draft: Sequence[int], samples: Sequence[int]) -> int:
    """Proposals kept: the length of the longest prefix of ``draft`` (``k`` tokens) equal
    to ``samples`` (the ``k + 1`` tokens the verify step sampled, one per position). The
    tokens a sequence gets are ``samples[: accepted + 1]``."""
    m = 0
    for d, s in zip(draft, samples, strict=False):
        if d != s:
            break
        m += 1
    return m


def verify_rows(num_tokens: int, num_proposals: int, static: bool) -> int:
    """Extra sampling rows of a verify step of ``num_tokens`` (its token bucket, ``T_b``)
    with ``num_proposals`` proposals: their bucket (at least 8), or with static shapes
    ``T_b`` itself (which is never fewer: every proposal is a token of the step)."""
    return num_tokens if static else bucket(num_proposals, 8)


def _more_rows(a: np.ndarray, rows: int, fill) -> np.ndarray:
    """``a`` (``[R, ...]``) with ``rows`` more rows of ``fill``."""
    return np.concatenate([a, np.full((rows, *a.shape[1:]), fill, a.dtype)])


def _draftable(w) -> bool:
    """Whether scheduled ``Work`` ``w`` may verify proposals: it decodes its sequence's
    last sampled token, and its request samples one plain row per sequence (no beams, no
    first token of ``n`` samples to fork, no penalties, which count the tokens before
    each position, no allowed tokens or grammar, no top log-probs)."""
    p, g = w.group.params, w.group
    return (
        w.sample
        and w.stop - w.start == 1
        and w.stop == len(w.seq.tokens)
        and not p.use_beam_search
        and (p.n == 1 or g.forked)
        and not p.penalized
        and p.structured is None
        and p.allowed_token_ids is None
        and not p.top_logprobs
    )


class Speculation:
    """``EngineCore``'s part for speculative decoding (a mixin over the core's state):
    proposals appended to a step's decode rows (``_draft``), the extra sampling rows that
    verify them (``_verify_rows``), and the samples kept, the rest rolled back
    (``_accept_drafts``). ``self.proposer`` is None when speculation is off."""

    def _draft(self, scheds) -> dict[int, list[int]] | None:
        """Proposals for the decode rows of ``scheds`` (each replica's schedule, changed
        in place): each ``Work`` that takes ``k`` proposals becomes ``[n - 1, n + k)``,
        the proposals appended to its block manager. Within the step's token budget; a
        row whose pages are not free goes without. Returns ``{id(Seq): proposals}``, or
        None when no row has any."""
        K = self.speculative.num_speculative_tokens
        vocab = self.model.config.vocab_size
        drafts: dict[int, list[int]] = {}
        for sc, sched in zip(self.schedulers, scheds, strict=True):
            budget = sc.max_num_batched_tokens - sum(w.stop - w.start for w in sched.work)
            if budget <= 0:
                continue
            cand = []
            for j, w in enumerate(sched.work):
                if _draftable(w):
                    room = min(K, w.group.max_len - w.stop - 1)
                    if room > 0:
                        cand.append((j, w, room))
            if not cand:
                continue
            requests = [
                DraftRequest(w.seq.seq_id, sc.bm.token_buffer(w.seq.seq_id)[: w.stop].copy(), room)
                for _, w, room in cand
            ]
            proposals = self.proposer.propose(requests)
            if len(proposals) != len(requests):
                raise RuntimeError(
                    f"proposer: {len(proposals)} proposals for {len(requests)} sequences"
                )
            taken = self._ration(sched.work, cand, proposals, budget)
            for j, w, d in taken:
                if min(d) < 0 or max(d) >= vocab:
                    raise ValueError(f"proposer: token ids must lie in [0, {vocab}), got {d}")
                try:
                    sc.bm.append_slots(w.seq.seq_id, d)
                except OutOfPages:
                    continue
                sched.work[j] = Work(w.group, w.seq, w.start, w.stop + len(d), True)
                drafts[id(w.seq)] = d
        return drafts or None

    def _release_draft(self, s) -> None:
        """Tells the proposer, if it keeps state per sequence, that ``s`` ended."""
        release = getattr(self.proposer, "release", None)
        if release is not None:
            release(s.seq_id)

    def _ration(self, work, cand, proposals, budget: int) -> list:
        """Which proposals the step verifies: ``[(work index, Work, tokens)]`` within
        ``budget`` tokens. Sequences whose recent proposals were mostly accepted
        (``Seq.spec_rate >= CONFIDENT``) verify all of theirs; where every token of a step
        costs compute (CPU, ``ModelRunner.tokens_cost_compute``) the others only verify
        as many as fit in the padding of the step's token bucket (rows it computes
        anyway), so that proposals that keep failing cost almost nothing."""
        ranked = []
        for (j, w, room), d in zip(cand, proposals, strict=True):
            d = [int(t) for t in d[:room]]
            if d:
                ranked.append((-w.seq.spec_rate, j, w, d))
        ranked.sort(key=lambda r: (r[0], r[1]))
        tokens = sum(w.stop - w.start for w in work)
        frugal = self.runner.tokens_cost_compute
        taken = []
        for neg_rate, j, w, d in ranked:
            room = budget
            if frugal and -neg_rate < CONFIDENT:
                room = min(room, bucket(tokens, MIN_STEP_TOKENS) - tokens)
            d = d[:room]
            if d:
                taken.append((j, w, d))
                budget -= len(d)
                tokens += len(d)
        return taken

    def _verify_rows(self, placed, drafts, batch, sampling, penalties, allowed):
        """The step's sampling rows extended by one row per proposal: row ``S_b + e`` samples
        the logits of a proposal's input position with its sequence's parameters, seed
        and the output position of the token it samples there. Returns ``(batch with
        logits_indices i32[S_b + E_b], sampling, penalties, allowed, spec)``, where
        ``spec[i] = (proposals, first extra row)`` for batch row ``i``; the extra rows
        have no penalties, mask or candidates of their own (``_draftable``). ``E_b``: the
        bucket of the proposals, or with static shapes (``LLM.warm_up``) the step's token
        bucket ``T_b``, which holds every proposal, so that a verify step has one shape
        per step shape and warm-up compiles them all (``verify_rows``)."""
        S_b = batch.kv_lens.shape[0]
        spec, src, li, off = {}, [], [], []
        for i, w in placed:
            d = drafts.get(id(w.seq))
            if d is None:
                continue
            k = len(d)
            spec[i] = (d, S_b + len(src))
            last = int(batch.logits_indices[i])  # the row of the last proposal
            src += [i] * k
            li += range(last - k, last)
            off += range(-k, 0)
        E = len(src)
        E_b = verify_rows(batch.token_ids.shape[0], E, self.runner.static_shapes)
        idx = np.zeros(S_b + E_b, np.intp)
        idx[:S_b] = np.arange(S_b)
        idx[S_b : S_b + E] = src
        logits_indices = np.zeros(S_b + E_b, np.int32)
        logits_indices[:S_b] = batch.logits_indices
        logits_indices[S_b : S_b + E] = li
        batch = dataclasses.replace(batch, logits_indices=logits_indices)
        temp, top_k, top_p, min_p, seeds, out_pos = (a[idx] for a in sampling)
        out_pos[S_b : S_b + E] += np.asarray(off, np.int32)
        pad = slice(S_b + E, None)  # padding rows: greedy, unrestricted, position 0
        temp[pad], top_k[pad], top_p[pad], min_p[pad], seeds[pad], out_pos[pad] = 0, 0, 1, 0, 0, 0
        if penalties is not None:  # neutral rows for the proposals
            penalties = penalties.with_neutral_rows(E_b)
        if allowed is not None:  # every token allowed
            allowed = _more_rows(allowed, E_b, -1)
        return batch, (temp, top_k, top_p, min_p, seeds, out_pos), penalties, allowed, spec

    def _accept_drafts(self, f, live, toks, lps) -> tuple[dict, dict]:
        """For each row of step ``f`` that verified proposals: the samples it keeps (those
        up to and including the first that differs from its proposal) as ``{row:
        [(token, log-prob)]}``, its rejected proposals dropped from the block manager
        (``BlockManager.truncate``), and ``{row: tokens computed}`` (the sequence's
        tokens before the step plus the proposals kept)."""
        emit, computed = {}, {}
        m_sum = k_sum = 0
        for i, w in live:
            entry = f.spec.get(i)
            if entry is None:
                continue
            d, e0 = entry
            k = len(d)
            samples = toks[e0 : e0 + k, 0].tolist() + [int(toks[i, 0])]
            logprobs = lps[e0 : e0 + k, 0].tolist() + [float(lps[i, 0])]
            m = accept(d, samples)
            w.seq.spec_rate = 0.5 * w.seq.spec_rate + 0.5 * m / k
            keep = w.stop - k + m  # last sampled token, then the proposals kept
            self._bm(w.group).truncate(w.seq.seq_id, keep)
            computed[i] = keep
            emit[i] = list(zip(samples[: m + 1], logprobs[: m + 1], strict=True))
            m_sum += m
            k_sum += k
        self.metrics.spec_verify_rows += len(emit)
        self.metrics.spec_draft_tokens += k_sum
        self.metrics.spec_accepted_tokens += m_sum
        return emit, computed
