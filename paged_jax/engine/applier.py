"""Applying a step's samples to its requests (``ResultApplier``, the engine core's part
that runs after the device): tokens appended and checked for a finish
(``OutputProcessor.finish_reason``), n samples forked from the prompt's first token,
beams kept or dropped, a multi-step launch's rows taken as whole arrays, sequences ended
and finished requests turned into outputs. No JAX here."""

from __future__ import annotations

import math
import operator
import time
from typing import Any

import numpy as np

from paged_jax.engine.launched import Lane, Launched
from paged_jax.engine.outputs import RequestOutput
from paged_jax.engine.request import Group, RequestTable, Seq, Status
from paged_jax.engine.step_inputs import keep_scores

_CUM_LOGPROB = operator.attrgetter("cum_logprob")


class ResultApplier:
    """The engine core's part that applies completed steps (see the module docstring).

    Args:
      schedulers: each data-parallel replica's ``Scheduler`` (a request's pages are in
        its replica's block manager, ``Scheduler.bm``).
      requests: the engine's ``RequestTable`` (a finished request leaves it).
      outputs: the ``OutputProcessor`` (finish reasons, outputs).
      metrics: the engine's ``EngineMetrics``.
      max_model_len, eos_token_ids: the model's.
      speculator: the ``Speculator`` (a verify step's proposals accepted; a sequence
        that ends released), or None.
      checked: check derived state as it is used (``LLM(checked=True)``).
    """

    def __init__(
        self,
        schedulers: list,
        requests: RequestTable,
        outputs,
        metrics,
        *,
        max_model_len: int,
        eos_token_ids: set,
        speculator=None,
        checked: bool = False,
    ):
        self.schedulers = schedulers
        self.requests = requests
        self.outputs = outputs
        self.metrics = metrics
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.speculator = speculator
        self.on_end = None if speculator is None else speculator.release
        self.checked = checked
        self.ended = 0  # sequences given a finish reason so far (Lane.ended)
        # Set once a step's results start changing its requests' state (tokens, finish
        # reasons): a fault from then on cannot be undone by requeueing (the core clears
        # it when the results are all applied)
        self.applying = False

    def _bm(self, g: Group):
        return self.schedulers[g.replica].bm

    def complete(self, f: Launched, overlapped: bool = False) -> list[RequestOutput]:
        """Waits for step ``f``, applies its tokens and returns the requests it finished.
        ``overlapped``: the next step was launched meanwhile (with placeholders for these
        tokens, replaced here in the block manager, and ``f``'s tokens marked computed
        already); rows of sequences that finished or were aborted since ``f`` was
        launched are dropped."""
        t1 = time.perf_counter()
        out = f.outputs.read()
        t2 = time.perf_counter()
        m = self.metrics
        m.step_s += f.dispatch_s + t2 - t1
        m.dispatch_s += f.dispatch_s
        m.wait_s += t2 - t1
        m.tokens_computed += f.num_tokens
        before = m.tokens_generated
        if f.steps is not None:
            finished = self.apply_steps(f, out.tokens, out.logprobs, t2)
        else:
            finished = self._complete_step(f, out, overlapped, t2)
        if f.compiled:  # its tokens came with the compile's time, not the running's
            m.compile_tokens += m.tokens_generated - before
        return finished

    def _complete_step(self, f: Launched, out, overlapped: bool, now: float) -> list:
        """Applies single step ``f``'s outputs (``HostOutputs``)."""
        if f.scoring:  # before process, which may finish (and output) their requests
            keep_scores(f.scoring, out.scores)
        live = [(i, w) for i, w in f.placed if w.seq.finish_reason is None]
        emit, computed = None, {}
        if f.spec:
            emit, computed = self.speculator.accept(f, live, out.tokens, out.logprobs, self._bm)
        if not overlapped:
            for i, w in live:
                self._bm(w.group).mark_computed(w.seq.seq_id, computed.get(i, w.stop))
        self.applying = True
        finished = self.process(live, out.tokens, out.logprobs, out.candidates, now, emit)
        if overlapped:  # the next step appended placeholders for these tokens
            for _, w in live:
                s = w.seq
                if w.sample and s.finish_reason is None:
                    bm = self._bm(w.group)
                    k = len(s.tokens) - 1
                    if s.seq_id in bm and bm.num_tokens(s.seq_id) > k:
                        bm.set_token(s.seq_id, k, s.tokens[k])
        return finished

    def process(self, placed, toks, lps, cand, now, emit=None) -> list[RequestOutput]:
        """Applies a single step's samples (``toks``, ``lps``: ``[R_b, J]``) to the rows
        ``placed`` (``(batch row, Work)``); ``emit``: the tokens and log-probs of rows that
        verified proposals (``Speculator.accept``), appended in order up to the first
        that finishes the sequence. Returns the requests finished."""
        by_group: dict[int, list[tuple[int, Any]]] = {}
        for i, w in placed:
            if w.sample:
                by_group.setdefault(id(w.group), []).append((i, w))
        finished = []
        first_toks, first_lps = toks[:, 0].tolist(), lps[:, 0].tolist()  # ints, floats
        for items in by_group.values():
            g = items[0][1].group
            if g.first_token_time is None:
                g.first_token_time = now
            if g.params.use_beam_search:
                self._beam_step(g, items, cand)
            elif g.params.n > 1 and not g.forked:
                self._fork_samples(g, items[0], toks, lps, cand)
            else:
                for i, w in items:
                    if emit and i in emit:
                        for token, lp in emit[i]:
                            self._append(g, w.seq, token, lp)
                            if w.seq.finish_reason is not None:
                                break
                        continue
                    self._append(g, w.seq, first_toks[i], first_lps[i], _top(g, cand, i))
            if not g.seqs:
                finished.append(self.finish(g))
        return finished

    def _append(self, g: Group, s: Seq, token: int, logprob: float, top=None) -> None:
        """Adds a sampled token to ``s`` (``top``: its step's most likely tokens, for
        ``SamplingParams.top_logprobs``); finishes ``s`` on a stop condition."""
        p = g.params
        tokens = s.tokens
        tokens.append(token)
        s.cum_logprob += logprob
        if p.logprobs:
            s.logprobs.append(logprob)
            if top is not None:
                s.top_logprobs.append(top)
        self.metrics.tokens_generated += 1
        reason = self.outputs.finish_reason(s, p, token)
        matcher = g.matchers.get(s.seq_id)
        if matcher is not None and reason is None:  # the grammar takes the token
            matcher.consume_token(token)
            if matcher.is_stopped():  # nothing more is allowed: the output is complete
                reason = "stop"
        if reason:
            self.end(g, s, reason)

    def end(self, g: Group, s: Seq, reason: str) -> None:
        """Ends running sequence ``s`` of ``g`` with ``reason``: its pages freed."""
        s.finish_reason = reason
        self.ended += 1
        self._bm(g).free(s.seq_id)
        if self.on_end is not None:
            self.on_end(s.seq_id)
        g.seqs.remove(s)
        g.done.append(s)

    def abort(self, g: Group, drop_host) -> RequestOutput:
        """Ends every running sequence of ``g`` with "abort", freeing its pages
        (``drop_host(slots, bm)``: the host copies of its swapped-out pages no other
        sequence holds), and finishes it."""
        bm = self._bm(g)
        for s in g.seqs:
            if s.seq_id in bm:
                slots = bm.host_slots(s.seq_id)
                bm.free(s.seq_id)
                drop_host(slots, bm)
            s.finish_reason = "abort"
            self.ended += 1
            if self.on_end is not None:
                self.on_end(s.seq_id)
            g.done.append(s)
        g.seqs.clear()
        return self.finish(g)

    def fail(self, g: Group, error: BaseException) -> RequestOutput:
        """Ends every sequence of ``g`` with ``finish_reason`` "error" (its pages are left
        to the rebuild that follows a failed step) and finishes it."""
        g.error = f"{type(error).__name__}: {error}"
        for s in g.seqs:
            s.finish_reason = "error"
            self.ended += 1
            g.done.append(s)
        g.seqs.clear()
        return self.finish(g)

    def alive(self, lane: Lane) -> np.ndarray | None:
        """``bool[L]``: which of the lane's rows have not finished, or None when none has
        (no sequence got a finish reason since the lane was built: ``Lane.ended``)."""
        if lane.ended == self.ended:
            return None
        return np.fromiter((s.finish_reason is None for s in lane.seqs), bool, len(lane.seqs))

    def apply_steps(self, f: Launched, toks, lps, now: float) -> list[RequestOutput]:
        """Applies a multi-step launch (``toks``, ``lps``: ``[S_b, K]``): each row's
        reserved tokens get their sampled values and count as computed, then its samples
        are appended, up to the first that stops it (the rest are dropped).

        The rows are checked as whole arrays (``f.lane``): a row with no stop token among
        its samples and no stop string or log-probs to keep (the common case) only has its
        samples and log-prob sum added to the lane's ``TokenLog`` (its sequence reads them
        when its tokens are read), and ends if it reached its length; the others go
        through ``_extend``."""
        lane = f.lane
        alive = self.alive(lane)
        carried = f.carried  # their last sample is reserved too: the next launch decodes it
        if alive is not None and not alive.all():
            if not alive.any():
                return []
            lane = lane.take(alive, cum=None if lane.cum is None else lane.cum[alive])
            if carried is not None:
                carried = carried[alive]
        seqs, groups, at, ks = lane.seqs, lane.groups, lane.at, lane.steps
        L, K = len(seqs), toks.shape[1]
        if L and at[-1] == L - 1:  # rows 0 .. L - 1 (at is increasing): slices, not copies
            row_toks, row_lps = toks[:L], lps[:L]
        else:
            row_toks, row_lps = toks[at], lps[at]
        self.schedulers[0].bm.fill_reserved(
            lane.ids, lane.stops, row_toks, counts=ks - 1 if carried is None else ks - 1 + carried
        )
        self.applying = True
        # Running sums of each row's log-probs from its sequence's, in float64 one at a
        # time (as _append adds them): column c is the sum after c tokens.
        sums = np.empty((L, K + 1))
        if lane.cum is None:
            sums[:, 0] = np.fromiter(map(_CUM_LOGPROB, seqs), np.float64, L)
        else:  # the launch before computed them (reading 256 sequences' cost 50-90 us)
            sums[:, 0] = lane.cum
            if self.checked:
                assert lane.cum.tolist() == list(map(_CUM_LOGPROB, seqs)), "lane.cum drift"
        sums[:, 1:] = row_lps
        sums = np.cumsum(sums, axis=1)
        # Rows that need _extend: a token that may stop them among their samples (any
        # request's stop ids, a superset of each row's), or a stop string or log-probs.
        exact = lane.exact
        if lane.stop_union:
            hit = np.isin(row_toks, lane.stop_union) & (np.arange(K) < ks[:, None])
            exact = exact | hit.any(axis=1)
        # each row's sum after its samples
        last = sums[:, K] if bool((ks == K).all()) else sums[np.arange(L), ks]
        if f.next is not None:  # the launch going on from this one: its rows' sums
            f.next.cum = last if carried is None else last[carried]
        if not lane.continued:  # a continued lane's groups had their first tokens
            for g in {id(g): g for g in groups if g.first_token_time is None}.values():
                g.first_token_time = now
        # The plain rows' samples and sums go to the lane's log (read from it when their
        # sequences are: Seq.tokens); the others, one by one through _extend.
        plain = ~exact
        if plain.all():
            lane.log.add(lane.li, row_toks, ks, last)
        else:
            stop_ids = lane.stop_ids
            for j in np.flatnonzero(exact).tolist():
                g = groups[j]
                row = row_toks[j, : ks[j]].tolist()
                self._extend(g, seqs[j], row, row_lps[j], sums[j], stop_ids[id(g.params)])
            lane.log.add(lane.li[plain], row_toks[plain], ks[plain], last[plain])
        self.metrics.tokens_generated += int(ks[plain].sum())
        # Rows that reached their length (Group.max_len: the prompt plus max_tokens, at
        # most the model's), then the groups with no sequence left, in row order.
        ended = plain & (lane.stops + ks >= lane.max_len)
        for j in np.flatnonzero(ended).tolist():
            self.end(groups[j], seqs[j], "length")
        finished = []
        if ended.any() or exact.any():
            for g in {id(g): g for g in groups}.values():
                if not g.seqs:
                    finished.append(self.finish(g))
        return finished

    def _extend(
        self, g: Group, s: Seq, tokens: list, logprobs: np.ndarray, sums: np.ndarray, stops: set
    ) -> None:
        """``_append`` of several ``tokens``, up to the first that finishes ``s``.
        ``logprobs``: ``f32[>= len(tokens)]`` theirs; ``sums[c]``: ``s.cum_logprob`` after
        ``c`` of them; ``stops``: the token ids that finish ``s``."""
        p = g.params
        if p.stop:  # a stop string may end at any token: one at a time
            for token, lp in zip(tokens, logprobs.tolist(), strict=False):
                self._append(g, s, token, lp)
                if s.finish_reason is not None:
                    return
            return
        cut, reason = len(tokens), None
        if stops and not stops.isdisjoint(tokens):
            cut = next(j for j, token in enumerate(tokens) if token in stops) + 1
            reason = "stop"
            tokens = tokens[:cut]
        s.tokens += tokens
        s.cum_logprob = float(sums[cut])
        if p.logprobs:
            s.logprobs += logprobs[:cut].tolist()
        self.metrics.tokens_generated += cut
        n = len(s.tokens)
        if reason is None and (n - s.prompt_len >= p.max_tokens or n >= self.max_model_len):
            reason = "length"
        if reason:
            self.end(g, s, reason)

    def _fork_samples(self, g: Group, item, toks, lps, cand=None) -> None:
        """The prompt's logits give n tokens: n - 1 forks share every prompt page."""
        i, w = item
        parent = w.seq
        g.forked = True
        children = []
        for j in range(1, g.params.n):
            sid = g.new_seq_id()
            self._bm(g).fork(parent.seq_id, sid)
            child = Seq(sid, list(parent.tokens), parent.prompt_len, j)
            if parent.seq_id in g.matchers:  # before the parent takes its first token
                g.matchers[sid] = g.matchers[parent.seq_id].deep_copy()
            g.seqs.append(child)
            children.append((child, j))
        top = _top(g, cand, i)  # one distribution, every sample's first token
        for s, j in [(parent, 0), *children]:
            self._append(g, s, int(toks[i, j]), float(lps[i, j]), top and list(top))

    def _beam_step(self, g: Group, items, cand) -> None:
        """Keeps the best ``beam_width`` continuations; forks/frees beams on shared pages."""
        p = g.params
        vals, ids = cand
        candidates = []  # (score, parent order, rank, parent seq, token, logprob)
        for order, (i, w) in enumerate(items):
            for rank in range(2 * p.beam_width):
                lp = float(vals[i, rank])
                if lp == -math.inf:  # fewer tokens than candidates allowed (a grammar)
                    break
                candidates.append(
                    (w.seq.cum_logprob + lp, order, rank, w.seq, int(ids[i, rank]), lp)
                )
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        chosen = []
        for score, _, _, parent, token, lp in candidates:
            if len(chosen) == p.beam_width:
                break
            if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
                if len(g.done) < p.beam_width:
                    g.done.append(
                        Seq(
                            g.new_seq_id(),
                            parent.tokens + [token],
                            parent.prompt_len,
                            0,
                            cum_logprob=score,
                            finish_reason="stop",
                        )
                    )
                continue
            chosen.append((parent, token, lp))
        uses: dict[str, int] = {}
        new_beams = []
        for parent, token, lp in chosen:
            uses[parent.seq_id] = uses.get(parent.seq_id, 0) + 1
            if uses[parent.seq_id] == 1:
                beam = Seq(
                    parent.seq_id,
                    list(parent.tokens),
                    parent.prompt_len,
                    0,
                    cum_logprob=parent.cum_logprob,
                )
            else:
                sid = g.new_seq_id()
                self._bm(g).fork(parent.seq_id, sid)
                beam = Seq(
                    sid, list(parent.tokens), parent.prompt_len, 0, cum_logprob=parent.cum_logprob
                )
            new_beams.append((beam, token, lp))
        if g.matchers:  # each beam its parent's grammar state, then its token
            # forks copy their parent's state first; a parent's own beam keeps it
            taken = {
                beam.seq_id: g.matchers[parent.seq_id].deep_copy()
                if beam.seq_id != parent.seq_id
                else g.matchers[parent.seq_id]
                for (beam, _, _), (parent, _, _) in zip(new_beams, chosen, strict=True)
            }
            for beam, token, _ in new_beams:
                taken[beam.seq_id].consume_token(token)
            g.matchers = taken
        for old in g.seqs:
            if old.seq_id not in uses:
                self._bm(g).free(old.seq_id)
        g.seqs = [b for b, _, _ in new_beams]
        for beam, token, lp in new_beams:
            self._append_beam(g, beam, token, lp)
        if len(g.done) >= p.beam_width:  # enough finished beams: stop (early stopping)
            for s in g.seqs:
                self._bm(g).free(s.seq_id)
            g.seqs.clear()

    def _append_beam(self, g: Group, s: Seq, token: int, logprob: float) -> None:
        s.tokens.append(token)
        s.cum_logprob += logprob
        self.metrics.tokens_generated += 1
        matcher = g.matchers.get(s.seq_id)
        reason = None
        if matcher is not None and matcher.is_stopped():  # the grammar allows no more
            reason = "stop"
        elif len(s.output) >= g.params.max_tokens or len(s.tokens) >= self.max_model_len:
            reason = "length"
        if reason is not None:
            s.finish_reason = reason
            self.ended += 1
            self._bm(g).free(s.seq_id)
            g.seqs.remove(s)
            g.done.append(s)

    def finish(self, g: Group) -> RequestOutput:
        """``g``, with no running sequence left, finished: out of its queue and the
        request table (its id may be used again), counted, and its output made."""
        g.status = Status.FINISHED
        g.finish_time = time.perf_counter()
        self.schedulers[g.replica].remove(g)
        self.requests.remove(g)
        self.metrics.requests_finished += 1
        if g.first_token_time is not None:
            self.metrics.ttft_sum_s += g.first_token_time - g.arrival_time
        return self.outputs.request_output(g)


def _top(g: Group, cand, i: int) -> list[tuple[int, float]] | None:
    """Row ``i``'s ``g.params.top_logprobs`` most likely tokens from the step's candidates
    (``cand``: log-probs ``f32[S_b, C]`` and ids ``i32[S_b, C]``), or None."""
    k = g.params.top_logprobs
    if not k or cand is None:
        return None
    vals, ids = cand
    return list(zip(ids[i, :k].tolist(), vals[i, :k].tolist(), strict=True))
