"""The engine core's part for speculative decoding (``Speculator``): proposals for a
step's decode rows, the extra sampling rows that verify them, and the samples kept
(``accept``), the rest rolled back. No JAX here.

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

The engine core's ``Speculator`` drafts (``Speculator.draft``), appends the proposals
to the block manager like any token, and after the step drops the rejected ones
(``BlockManager.truncate``): their pages go back to the pool, and only kept tokens ever
reach the prefix cache.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from paged_jax.batch import bucket
from paged_jax.block_manager import OutOfPages
from paged_jax.engine.request import Work
from paged_jax.engine.shapes import MIN_STEP_TOKENS
from paged_jax.engine.speculative.proposers import DraftRequest
from paged_jax.engine.step_types import StepInputs

# A sequence verifies all its proposals, wherever tokens cost compute, only while a
# moving average of the fraction of its proposals accepted stays at least this
# (``Speculator.ration``).
CONFIDENT = 0.6
# ... and only when the tokens those rates foresee kept (``Speculator.calibration``
# applied) are at least this fraction of the tokens a larger bucket adds to the step: on
# the 2-core CPU a step of 32 tokens cost about 1.3x one of 16 (SmolLM2, f32), and 0.25
# let free-form chat at 16 requests grow its steps at a loss (0.88-0.93x the tokens/s
# without speculation), 0.5 did not (0.98x), 1.0 lost prompt-quoting requests' gain at
# 16 (0.98x against 1.11x at 0.5; 2026-12-07).
GROW_FRACTION = 0.5
# ... and only when the tokens all the step's proposals are foreseen to keep are at least
# this fraction of its sampling rows: a verify step leaves the decode kernels, samples
# its extra rows through the LM head and is not overlapped by the next step, which on
# the 2-core CPU cost about 0.13-0.15 of a step at 16 rows (SmolLM2 f32: 46-47 ms
# against 40-42 ms a plain decode step), about the tokens of that many rows. Without
# it, free-form chat at 16 requests verified a proposal or two in one step of four, each
# such step at a loss (2026-12-07).
VERIFY_COST = 0.15
# ``Speculator.calibration``'s sums also fade by this a step, verifying or not, so that
# after a hundred or so steps that verified nothing the rates are trusted again: load
# that stayed high after proposals failed would otherwise never verify again (about 1
# verify step in 150 at 16 requests, where proposals keep failing).
IDLE_FADE = 0.98


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


def num_verify_rows(
    num_tokens: int, num_seqs: int, num_proposals: int, k: int, static: bool
) -> int:
    """Extra sampling rows of a verify step of ``num_tokens`` (its token bucket, ``T_b``)
    and ``num_seqs`` rows (its sequence bucket, ``S_b``) with ``num_proposals`` proposals
    of at most ``k`` a row: their bucket (at least 8), or with static shapes ``min(T_b,
    S_b * k)``, which is never fewer (every proposal is a token of the step, and no row
    has more than ``k``) and depends on the step's shape alone. Each row is a row of the
    LM head and the sampler: a mixed step of 1,024 tokens and 16 sequences verifies in
    64 rows, not 1,024 (on SmolLM2 about 54 GFLOP of LM head less)."""
    if static:
        return min(num_tokens, num_seqs * k)
    return bucket(num_proposals, 8)


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


class Speculator:
    """The engine core's part for speculative decoding: proposals appended to a step's
    decode rows (``draft``), the extra sampling rows that verify them (``verify_rows``),
    and the samples kept, the rest rolled back (``accept``).

    Args:
      config: the ``SpeculativeConfig``.
      proposer: what proposes (``config.proposer(...)``; a test may put its own).
      runner: the ``ModelRunner`` (whether tokens cost compute; static shapes).
      metrics: the engine's ``EngineMetrics`` (the speculation counters).
    """

    def __init__(self, config, proposer, runner, metrics):
        self.config = config
        self.proposer = proposer
        self.runner = runner
        self.metrics = metrics
        self.foreseen = self.kept = 0.0  # proposals the rates foresaw kept, and kept

    def draft(self, schedulers, scheds, pending: bool = False) -> dict[int, list[int]] | None:
        """Proposals for the decode rows of ``scheds`` (each replica's schedule, changed
        in place; ``schedulers``: theirs): each ``Work`` that takes ``k`` proposals
        becomes ``[n - 1, n + k)``, the proposals appended to its block manager. Within
        the step's token budget; a row whose pages are not free goes without. Returns
        ``{id(Seq): proposals}``, or None when no row has any.

        ``pending``: the schedule overlaps a running step, each decode row's last token a
        placeholder for that step's sample (``StepLauncher.place``). The proposer then
        sees the tokens before it and proposes ``k + 1``: its first guesses the
        placeholder and is dropped, the other ``k`` follow the placeholder in the row.
        Whatever the placeholder turns out to be, only the samples the proposals match
        are kept (``accept``): a wrong guess costs its row's proposals, never a token."""
        self.foreseen, self.kept = IDLE_FADE * self.foreseen, IDLE_FADE * self.kept
        K = self.config.num_speculative_tokens
        drafts: dict[int, list[int]] = {}
        for sc, sched in zip(schedulers, scheds, strict=True):
            budget = sc.max_num_batched_tokens - sum(w.stop - w.start for w in sched.work)
            if budget <= 0:
                continue
            cand = []
            for j, w in enumerate(sched.work):
                if _draftable(w):
                    room = min(K, w.group.max_len - w.stop - 1)
                    if room > 0:
                        cand.append((j, w, room))
            if not cand or not self.may_pay(sched.work, cand):
                continue
            vocab = self.runner.model.config.vocab_size
            known = 1 if pending else 0  # (a placeholder: the tokens before it)
            requests = [
                DraftRequest(
                    w.seq.seq_id,
                    sc.bm.token_buffer(w.seq.seq_id)[: w.stop - known].copy(),
                    room + known,
                )
                for _, w, room in cand
            ]
            proposals = self.proposer.propose(requests)
            if len(proposals) != len(requests):
                raise RuntimeError(
                    f"proposer: {len(proposals)} proposals for {len(requests)} sequences"
                )
            for d in proposals:  # (the guesses of placeholders too)
                if len(d) and (min(d) < 0 or max(d) >= vocab):
                    raise ValueError(f"proposer: token ids must lie in [0, {vocab}), got {d}")
            proposals = [list(d)[known:] for d in proposals]
            for j, w, d in self.ration(sched.work, cand, proposals, budget):
                try:
                    sc.bm.append_slots(w.seq.seq_id, d)
                except OutOfPages:
                    continue
                sched.work[j] = Work(w.group, w.seq, w.start, w.stop + len(d), True)
                drafts[id(w.seq)] = d
        return drafts or None

    @property
    def calibration(self) -> float:
        """Proposals kept per proposal the rows' rates foresaw, over recent verify steps
        (sums that fade by 0.9 a verify step and ``IDLE_FADE`` a step; 1 while they hold
        less than a proposal foreseen): how far ``ration`` may trust those rates."""
        return self.kept / self.foreseen if self.foreseen > 1.0 else 1.0

    def release(self, seq_id) -> None:
        """Tells the proposer, if it keeps state per sequence, that ``seq_id`` ended."""
        release = getattr(self.proposer, "release", None)
        if release is not None:
            release(seq_id)

    def may_pay(self, work, cand) -> bool:
        """Whether ``ration`` could take any proposal of the rows ``cand`` (``[(work
        index, Work, room)]``) in a step of ``work``, were each to propose all its room:
        where tokens cost compute and none could, the proposer is not asked (its lookups
        and the rows' token copies, about 0.07 ms a 16-row step on the 2-core CPU, are
        then not spent on steps that could verify nothing)."""
        if not self.runner.tokens_cost_compute:
            return True
        cal = self.calibration
        best = sum(w.seq.spec_rate * room for _, w, room in cand)
        if not self._verifying_pays(best, work, slack=1e-9):  # (sums in another order)
            return False
        tokens = sum(w.stop - w.start for w in work)
        if bucket(tokens, MIN_STEP_TOKENS) > tokens:  # padding: any row may fill it
            return True
        # no padding: only confident rows verify, growing the bucket at least twofold
        sure = sum(w.seq.spec_rate * room for _, w, room in cand if w.seq.spec_rate >= CONFIDENT)
        return sure * cal >= GROW_FRACTION * bucket(tokens, MIN_STEP_TOKENS) * (1 - 1e-9)

    def ration(self, work, cand, proposals, budget: int) -> list:
        """Which proposals the step verifies: ``[(work index, Work, tokens)]`` within
        ``budget`` tokens. Sequences whose recent proposals were mostly accepted
        (``Seq.spec_rate >= CONFIDENT``) verify all of theirs; where every token of a step
        costs compute (CPU, ``ModelRunner.tokens_cost_compute``) the others only verify
        as many as fit in the padding of the step's token bucket (rows it computes
        anyway), so that proposals that keep failing cost almost nothing; and the
        confident ones too, unless the tokens they are foreseen to keep pay for the
        larger bucket they would take the step to (``GROW_FRACTION``); and there, none
        at all unless the tokens the step's proposals are foreseen to keep pay for what
        verifying costs beyond a plain step (``VERIFY_COST`` of a token a sampling
        row)."""
        ranked = []
        for (j, w, room), d in zip(cand, proposals, strict=True):
            d = [int(t) for t in d[:room]]
            if d:
                ranked.append((-w.seq.spec_rate, j, w, d))
        ranked.sort(key=lambda r: (r[0], r[1]))
        tokens = sum(w.stop - w.start for w in work)
        frugal = self.runner.tokens_cost_compute
        if frugal:  # the confident rows' proposals: worth a larger bucket?
            sure = [(-r, len(d)) for r, _, _, d in ranked if -r >= CONFIDENT]
            grow = bucket(tokens + sum(n for _, n in sure), MIN_STEP_TOKENS) - bucket(
                tokens, MIN_STEP_TOKENS
            )
            expected = sum(r * n for r, n in sure) * self.calibration
            confident = CONFIDENT if expected >= GROW_FRACTION * grow else math.inf  # (none)
        taken, foreseen = [], 0.0
        for neg_rate, j, w, d in ranked:
            room = budget
            if frugal and -neg_rate < confident:
                room = min(room, bucket(tokens, MIN_STEP_TOKENS) - tokens)
            d = d[:room]
            if d:
                taken.append((j, w, d))
                budget -= len(d)
                tokens += len(d)
                foreseen -= neg_rate * len(d)
        if frugal and not self._verifying_pays(foreseen, work):
            return []  # a verify step would cost more than it is foreseen to keep
        return taken

    def _verifying_pays(self, foreseen: float, work, slack: float = 0.0) -> bool:
        """Whether ``foreseen`` proposals kept by the rows' rates (before calibration)
        pay for verifying in a step of ``work``: ``VERIFY_COST`` a sampling row."""
        need = VERIFY_COST * sum(w.sample for w in work)
        return foreseen * self.calibration >= need * (1 - slack)

    def verify_rows(self, placed: list, drafts: dict, inputs: StepInputs) -> dict:
        """Extends ``inputs``' sampling rows by one row per proposal: row ``S_b + e``
        samples the logits of a proposal's input position with its sequence's
        parameters, seed and the output position of the token it samples there (the
        batch's ``logits_indices`` become ``i32[S_b + E_b]``). Returns ``{batch row:
        (proposals, first extra row)}``. The extra rows have no penalties, mask or
        candidates of their own (``_draftable``). ``E_b``: the bucket of the proposals,
        or with static shapes (``LLM.warm_up``) ``min(T_b, S_b * k)``, which holds every
        proposal, so that a verify step has one shape per step shape and warm-up compiles
        them all (``num_verify_rows``)."""
        batch = inputs.batch
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
        E_b = num_verify_rows(
            batch.token_ids.shape[0],
            S_b,
            E,
            self.config.num_speculative_tokens,
            self.runner.static_shapes,
        )
        idx = np.concatenate([np.arange(S_b), np.asarray(src, np.intp)]).astype(np.intp)
        logits_indices = np.zeros(S_b + E_b, np.int32)
        logits_indices[:S_b] = batch.logits_indices
        logits_indices[S_b : S_b + E] = li
        inputs.batch = dataclasses.replace(batch, logits_indices=logits_indices)
        sampling = inputs.sampling.gather(idx, S_b + E_b)  # padding rows: idle
        sampling.out_pos[S_b : S_b + E] += np.asarray(off, np.int32)
        inputs.sampling = sampling
        if inputs.penalties is not None:  # neutral rows for the proposals
            inputs.penalties = inputs.penalties.with_neutral_rows(E_b)
        if inputs.allowed is not None:  # every token allowed
            inputs.allowed = _more_rows(inputs.allowed, E_b, -1)
        if inputs.cand_allowed is not None:  # the verify rows' candidates: any token
            inputs.cand_allowed = _more_rows(inputs.cand_allowed, E_b, -1)
        return spec

    def accept(self, f, live, toks, lps, bm_of) -> tuple[dict, dict]:
        """For each row of step ``f`` that verified proposals: the samples it keeps (those
        up to and including the first that differs from its proposal) as ``{row:
        [(token, log-prob)]}``, its rejected proposals dropped from its block manager
        (``bm_of(group)``; ``BlockManager.truncate``), and ``{row: tokens computed}``
        (the sequence's tokens before the step plus the proposals kept)."""
        emit, computed = {}, {}
        m_sum = k_sum = 0
        self.foreseen, self.kept = 0.9 * self.foreseen, 0.9 * self.kept  # (a moving sum)
        for i, w in live:
            entry = f.spec.get(i)
            if entry is None:
                continue
            d, e0 = entry
            k = len(d)
            samples = toks[e0 : e0 + k, 0].tolist() + [int(toks[i, 0])]
            logprobs = lps[e0 : e0 + k, 0].tolist() + [float(lps[i, 0])]
            m = accept(d, samples)
            self.foreseen, self.kept = self.foreseen + w.seq.spec_rate * k, self.kept + m
            w.seq.spec_rate = 0.5 * w.seq.spec_rate + 0.5 * m / k
            keep = w.stop - k + m  # last sampled token, then the proposals kept
            bm_of(w.group).truncate(w.seq.seq_id, keep)
            computed[i] = keep
            emit[i] = list(zip(samples[: m + 1], logprobs[: m + 1], strict=True))
            m_sum += m
            k_sum += k
        self.metrics.spec_verify_rows += len(emit)
        self.metrics.spec_draft_tokens += k_sum
        self.metrics.spec_accepted_tokens += m_sum
        return emit, computed

    def warm_up(self, progress: bool) -> None:
        """Compiles the proposer's own steps, if it has any (a draft model's)."""
        warm_up = getattr(self.proposer, "warm_up", None)
        if warm_up is not None:
            warm_up(progress)
