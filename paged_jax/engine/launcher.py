"""``StepLauncher``: the engine core's part that turns a schedule into a dispatched step.

It builds the step's batch (``build_batch``, one per data-parallel replica, side by
side), its rows' inputs (``step_inputs``: sampling columns, penalties, token masks,
prompt scoring, adapters), its input tokens (a running step's samples merged in on the
device for overlapped steps) and hands them to the ``ModelRunner`` as ``StepInputs``;
what it gets back is kept as a ``Launched``. Multi-step launches (``num_scheduler_steps
> 1``) are built from a schedule (``multi_steps``) or, while one runs, as the launch that
goes on from it (``plan_continuation``). No JAX here (the runner's arrays are handed on,
not read).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import numpy as np

from paged_jax._validation import validate_batch
from paged_jax.batch import ScheduledSeq, advance_batch, bucket, build_batch, concat_batches
from paged_jax.engine import step_inputs
from paged_jax.engine.launched import PENDING, Lane, Launched
from paged_jax.engine.request import Status, Work
from paged_jax.engine.shapes import MIN_STEP_TOKENS
from paged_jax.engine.step_types import StepInputs

_SEQS = operator.attrgetter("seqs")


@dataclasses.dataclass
class Continuation:
    """The multi-step launch that goes on from a running one (``plan_continuation``),
    built and reserved, not yet dispatched: lane row ``i`` goes on from the running
    launch's row ``rows[i]``, ``advance[i]`` tokens on."""

    lane: Lane
    rows: np.ndarray  # intp[L]
    advance: np.ndarray  # int64[L]
    groups: list  # the groups it runs (what a fault in its dispatch blames)
    batch: Any


class StepLauncher:
    """Builds and dispatches steps (see the module docstring).

    Args:
      runner: the ``ModelRunner``.
      schedulers: each data-parallel replica's ``Scheduler`` (its block manager).
      metrics: the engine's ``EngineMetrics`` (compile time and count).
      loras: the ``LoraSlots`` (each adapter row's slot).
      grammars: a callable returning the engine's ``structured.Grammars`` (made on first
        use).
      speculator: the ``Speculator``, or None.
      eos_token_ids: the model's.
      checked: validate every step's arrays on the host first (``LLM(checked=)``).
      async_scheduling, num_scheduler_steps: ``LLM``'s.
    """

    def __init__(
        self,
        runner,
        schedulers: list,
        metrics,
        *,
        loras,
        grammars,
        speculator,
        eos_token_ids: set,
        checked: bool,
        async_scheduling: bool,
        num_scheduler_steps: int,
    ):
        self.runner = runner
        self.schedulers = schedulers
        self.metrics = metrics
        self.loras = loras
        self.grammars = grammars
        self.speculator = speculator
        self.eos_token_ids = eos_token_ids
        self.checked = checked
        self.async_scheduling = async_scheduling
        self.num_scheduler_steps = num_scheduler_steps
        self.vocab_size = runner.model.config.vocab_size

    # ------------------------------------------------------------------ a scheduled step
    def dispatch(
        self,
        works: list[list[Work]],
        groups: list,
        *,
        ended: int,
        steps: list[int] | None = None,
        prev: Launched | None = None,
        stalled: bool = False,
        drafts: dict | None = None,
    ) -> Launched:
        """Builds the batch of ``works`` (each scheduler's, in order) and dispatches it:
        one step, or with ``steps`` (one per row) a multi-step launch. ``groups``: the
        groups it runs; ``ended``: ``ResultApplier.ended`` now. ``prev``: the step still
        running, whose samples some rows decode (placeholders in the batch);
        ``stalled``: the schedule stopped short of a preemption; ``drafts``: proposals
        some rows verify, ``{id(Seq): tokens}`` (``Speculator.draft``)."""
        work = [w for ws in works for w in ws]
        # With static shapes a step that scores prompt positions takes the widest shape,
        # whose scoring program warm-up compiled (one, not one a shape)
        widest = self.runner.static_shapes and any(_scores(w) for w in work)
        batch, pending = self._batch(works, steps, prev, widest)
        S_b = batch.kv_lens.shape[0]
        S_r = S_b // len(works)  # replica r's sequence rows from r * S_r
        placed = [(r * S_r + i, w) for r, ws in enumerate(works) for i, w in enumerate(ws)]
        rows, num_samples, num_cand = step_inputs.sampling_rows(placed)
        scoring, scored_groups = step_inputs.prompt_rows(
            batch, placed, static=self.runner.static_shapes
        )
        params = step_inputs.distinct_params(rows)
        inputs = StepInputs(
            batch,
            None,
            step_inputs.sampling_columns(rows, S_b, num_samples),
            replicas=len(works),
            penalties=step_inputs.penalties(placed, rows, S_b, params, self.eos_token_ids),
            num_candidates=num_cand,
            scoring=scoring,
        )
        # A grammar's mask waits for the running step's token: the model call goes now,
        # the sampling once prev's tokens are applied (sample_deferred)
        inputs.defer_sample = prev is not None and any(p.structured is not None for p in params)
        if not inputs.defer_sample:
            inputs.allowed, inputs.cand_allowed = self._masks(placed, rows, S_b, params)
        spec = None
        if drafts:
            spec = self.speculator.verify_rows(placed, drafts, inputs)
        inputs.tokens = self.tokens(inputs.batch, placed, prev, pending, drafts)
        inputs.adapters = self._adapters(inputs.batch, placed)
        lane = None
        if steps is not None:
            lane = Lane.of(work, steps, self.eos_token_ids, self.schedulers[0].bm, ended)
            inputs.steps = lane.steps
        f = self._send(inputs, work, placed, stalled, lane, groups)
        f.spec = spec
        f.scoring = scored_groups
        if inputs.defer_sample:
            f.mask_rows = (rows, S_b, params)
        return f

    def _batch(
        self, works: list[list[Work]], steps, prev: Launched | None, widest: bool = False
    ) -> tuple:
        """``(batch, pending)``: every replica's batch side by side (``concat_batches``),
        and its placeholder tokens, which read ``prev``'s samples on the device (0 in the
        batch until then). ``widest``: padded to ``widest_shape()``."""
        batches, pending = [], 0
        T_w, S_w = self.widest_shape() if widest else (MIN_STEP_TOKENS, 0)
        for sc, ws in zip(self.schedulers, works, strict=True):
            b = build_batch(
                sc.bm,
                [ScheduledSeq(w.seq.seq_id, w.start, w.stop) for w in ws],
                min_tokens=T_w,
                min_seqs=max(S_w, self.min_seqs(sum(w.stop - w.start for w in ws))),
                min_pages=self.min_pages(),
                table_tokens=None
                if steps is None
                else [w.stop + k - 1 for w, k in zip(ws, steps, strict=True)],
            )
            if prev is not None:
                mask = b.token_ids == PENDING
                pending += int(mask.sum())
                b.token_ids[mask] = 0
            if self.checked:
                validate_batch(
                    b,
                    num_pages=sc.bm.num_pages,
                    page_size=self.runner.page_size,
                    group_windows=getattr(sc.bm, "group_windows", None),
                    vocab_size=self.vocab_size,
                )
            batches.append(b)
        return concat_batches(batches), pending

    def _masks(self, placed, rows, S_b: int, params) -> tuple:
        """The rows' token masks (``step_inputs.token_masks``) with the engine's grammars."""

        def fill(pairs, masks):
            self.grammars().fill_rows(pairs, masks)

        return step_inputs.token_masks(placed, rows, S_b, params, self.vocab_size, fill)

    def _adapters(self, batch, placed) -> np.ndarray | None:
        """Each token's adapter slot, or None when no row of the step has an adapter."""
        ids = {w.group.adapter for _, w in placed} - {0}
        if not ids:
            return None
        return step_inputs.adapter_rows(batch, placed, self.loras.slots_for(ids))

    def sample_deferred(self, f: Launched) -> None:
        """Dispatches the sampling of step ``f`` launched with its masks deferred: each
        constrained row's mask from its matcher, which has now taken the token of the
        step ``f`` overlapped (its model call has been running meanwhile)."""
        rows, S_b, params = f.mask_rows
        allowed, cand_allowed = self._masks(f.placed, rows, S_b, params)
        d = self.runner.sample(f.deferred, allowed, cand_allowed)
        f.outputs = d.outputs
        f.deferred = f.mask_rows = None
        if d.compiled:
            f.compiled = True
            self.metrics.compile_s += d.seconds
            self.metrics.compilations += 1
        else:
            f.dispatch_s += d.seconds

    def tokens(self, batch, placed, prev: Launched | None, pending: int, drafts=None):
        """The step's input tokens: the batch's (host), or on the device with each of its
        ``pending`` placeholders (a token ``prev``, a single step, is sampling) taken from
        ``prev``'s output. ``drafts``: the rows' proposals (``{id(Seq): tokens}``), which
        follow a row's placeholder."""
        if prev is None:
            return batch.token_ids
        src = np.full(batch.token_ids.shape[0], -1, np.int32)
        for i, w in placed:
            row = prev.rows.get(id(w.seq))
            k = len(drafts.get(id(w.seq), ())) if drafts else 0
            if row is not None and w.stop - k == len(w.seq.tokens):  # decodes the placeholder
                src[batch.logits_indices[i] - k] = row
        found = int((src >= 0).sum())
        if found != pending:  # a placeholder anywhere else would compute a wrong token
            raise RuntimeError(
                f"overlapped step: {pending} placeholder tokens in the batch, {found} of "
                "them decode a running step's sample (a bug in paged-jax)"
            )
        if not found:
            return batch.token_ids
        zeros = np.zeros_like(src)
        return self.runner.merge_tokens(prev.outputs.tokens, src, zeros, batch.token_ids)

    def _send(self, inputs: StepInputs, work, placed, stalled, lane, groups) -> Launched:
        """Dispatches ``inputs`` (a single step, or with ``lane`` a multi-step launch of
        its rows) and returns it running."""
        steps = None if lane is None else lane.steps.tolist()
        d = self.runner.launch(inputs)
        if d.compiled:
            self.metrics.compile_s += d.seconds
            self.metrics.compilations += 1
        batch = inputs.batch
        return Launched(
            work=work if lane is None else None,
            placed=placed if lane is None else None,
            groups=groups,
            num_tokens=batch.num_tokens if steps is None else sum(steps),
            outputs=None if inputs.defer_sample else d.outputs,
            deferred=d.outputs if inputs.defer_sample else None,
            dispatch_s=0.0 if d.compiled else d.seconds,
            stalled=stalled,
            compiled=d.compiled,
            steps=steps,
            lane=lane,
            batch=batch if steps is not None else None,
            sampling=inputs.sampling if steps is not None else None,
        )

    # ------------------------------------------------------------------ overlapped steps
    def place(self, f: Launched) -> list:
        """Readies the schedule that overlaps running step ``f``: each of its sampling
        sequences still running gets a placeholder for the token ``f`` samples, and every
        sequence's tokens of ``f`` count as computed (the device runs steps in order, so
        any later step sees their K/V). Returns the sequences given a placeholder."""
        placed = []
        for w in f.work:
            s = w.seq
            if s.finish_reason is not None or w.group.status is not Status.RUNNING:
                continue  # finished or aborted since (its row's results are dropped)
            self.schedulers[w.group.replica].bm.mark_computed(s.seq_id, w.stop)
            if w.sample:
                s.tokens.append(PENDING)
                placed.append(s)
        return placed

    def may_overlap(self, f: Launched, isolating: bool) -> bool:
        """Whether the next step may be scheduled before ``f``'s tokens are known: overlap
        is on, no request is isolated as a suspect (``isolating``), ``f``'s schedule did
        not stop short of a preemption (the next one makes it, from known tokens), each
        sampling row only appends its token (no beam search, no first token of n samples
        to fork, no penalties, which count the tokens so far), and it verifies no
        proposals (how many tokens a row keeps is known only once it returned; the step
        that overlaps a plain one may verify some, ``Speculator.draft(pending=)``). A
        grammar's row may overlap: the next step's model call goes before its mask is
        known, its sampling after (``sample_deferred``). A multi-step launch, when one of
        its rows has tokens left
        after it (the next launch goes on from it, ``plan_continuation``); the launch that
        follows a single step may start from its placeholders."""
        if not self.async_scheduling or isolating or f.stalled or f.spec:
            return False
        if f.lane is not None:  # some row goes on after it (``plan_continuation``)
            lane = f.lane
            return bool((lane.stops + lane.steps < lane.max_len).any())
        for w in f.work:
            if w.sample:
                p = w.group.params
                if p.use_beam_search or p.penalized or (p.n > 1 and not w.group.forked):
                    return False
        return True

    # ------------------------------------------------------------------ multi-step launches
    def multi_step_ready(self, isolating: bool) -> bool:
        """Multi-step decoding is on and may run now: one replica, no hybrid pool, no
        isolated suspect (``isolating``), no request waiting or swapped out."""
        if (
            self.num_scheduler_steps == 1
            or len(self.schedulers) != 1
            or self.runner.hybrid_kv_cache
        ):
            return False
        sc = self.schedulers[0]
        return not (isolating or sc.waiting or sc.swapped)

    def multi_steps(self, scheds, isolating: bool) -> list[int] | None:
        """The steps each sequence of the schedule runs in a multi-step launch, its slots
        reserved (``BlockManager.reserve_tokens``), or None for one step: multi-step
        decoding is off, or the schedule swaps, preempts or stalled, a request waits to be
        admitted, a suspect is isolated, there are several replicas or a hybrid pool, a
        row is not a plain decode row (beams, penalties, allowed tokens, the first token of
        n samples), or the reserved tokens' pages are not free. A row runs at most as
        many steps as it has tokens left to sample (``Group.max_len``). With a single
        step still running a row's input token may be the placeholder for its sample
        (read on the device, ``tokens``), its reserved tokens after it."""
        K = self.num_scheduler_steps
        if not self.multi_step_ready(isolating):
            return None
        sched, sc = scheds[0], self.schedulers[0]
        if sched.swap_in or sched.swap_out or sched.preempted or sched.stalled:
            return None
        steps = []
        for w in sched.work:
            g = w.group
            p = g.params
            if not w.sample or w.stop - w.start != 1 or w.stop != len(w.seq.tokens):
                return None
            if (
                p.use_beam_search
                or p.penalized
                or p.top_logprobs
                or p.allowed_token_ids is not None
                or p.structured is not None
                or (p.n > 1 and not g.forked)
                or g.adapter
            ):
                return None
            steps.append(min(K, g.max_len - w.stop))
        if max(steps) <= 1:
            return None
        ids = [w.seq.seq_id for w in sched.work]
        if not sc.bm.reserve_tokens(ids, [k - 1 for k in steps]):
            return None
        return steps

    def plan_continuation(
        self, f: Launched, alive: np.ndarray | None, ended: int, isolating: bool
    ) -> Continuation | None:
        """The multi-step launch that goes on from running launch ``f`` before its tokens
        are known (overlapped steps), built and its slots reserved, or None. Each row of
        ``f`` that has tokens left to sample decodes ``f``'s last sample (read on the
        device) and up to K - 1 more; ``f``'s last samples are filled in with its other
        tokens (``f.carried``). ``alive``: which of ``f``'s rows have not finished
        (``ResultApplier.alive``); ``ended``: ``ResultApplier.ended`` now. Only while
        multi-step decoding may run (``multi_step_ready``: nothing waits to be admitted)
        and ``f`` ran every running sequence; None also when the pages are not free (the
        next step is scheduled once ``f``'s tokens are known). Runs for every launch of a
        steady decode: the rows are handled as whole arrays (``Lane``)."""
        if not self.async_scheduling or not self.multi_step_ready(isolating):
            return None
        sc, K = self.schedulers[0], self.num_scheduler_steps
        lane = f.lane
        # Every running sequence must be a live row of f. A lane built here passed this
        # check, and while no sequence ends (alive is None) none joins the running ones
        # either: admitting, swapping in, preempting and forking all happen in schedules
        # of single steps, which a launch built here follows none of.
        if alive is not None or not lane.continued:
            live = len(lane.seqs) if alive is None else int(alive.sum())
            if live != sum(map(len, map(_SEQS, sc.running))):
                return None  # a request was aborted or a sequence not run: schedule afresh
        n = lane.stops + lane.steps  # the sequences' lengths once f's tokens are in
        left = np.minimum(K, lane.max_len - n)
        go = left > 0
        if alive is not None:
            go &= alive
        every = bool(go.all())
        rows, advance = lane.at, lane.steps  # of f's rows that go on, and their steps in f
        if not every:
            if not go.any():
                return None
            rows, advance, n, left = rows[go], advance[go], n[go], left[go]
        nxt = lane.take(
            None if every else go,
            at=np.arange(len(rows), dtype=np.intp),
            stops=n,
            steps=left,
            ended=ended,
            continued=True,
        )
        if not sc.bm.reserve_tokens(nxt.ids, left):
            return None
        f.carried = go
        f.next = nxt
        groups = f.groups if every else list({id(g): g for g in nxt.groups}.values())
        batch = advance_batch(
            sc.bm,
            f.batch,
            rows,
            advance,
            n + left - 1,
            min_tokens=MIN_STEP_TOKENS,
            min_seqs=self.min_seqs(len(rows)),
            min_pages=self.min_pages(),
            seqs=nxt.ids,
        )
        return Continuation(nxt, rows, advance, groups, batch)

    def dispatch_continuation(self, prev: Launched, c: Continuation) -> Launched:
        """Dispatches continuation ``c`` of multi-step launch ``prev``: row i goes on from
        ``prev``'s row ``c.rows[i]``, ``c.advance[i]`` tokens on, its sampling inputs
        that row's (the output position ``c.advance[i]`` further) and its input token
        ``prev``'s last sample of the row."""
        batch, rows, advance = c.batch, c.rows, c.advance
        if self.checked:
            validate_batch(
                batch,
                num_pages=self.schedulers[0].bm.num_pages,
                page_size=self.runner.page_size,
                vocab_size=self.vocab_size,
            )
        S, S_b, T_b = len(rows), batch.kv_lens.shape[0], batch.token_ids.shape[0]
        # Every row goes on in place (a steady launch): prev's sampling rows as they are,
        # and its rows' last samples as the input tokens.
        in_place = (
            S == len(prev.lane.seqs)
            and S_b == prev.batch.kv_lens.shape[0]
            and T_b == prev.batch.token_ids.shape[0]
        )
        if in_place:
            sampling = prev.sampling.with_out_pos(prev.sampling.out_pos.copy())
            tokens = prev.outputs.last
        else:
            sampling = prev.sampling.gather(rows, S_b)
            src = np.full(T_b, -1, np.int32)  # decode rows: token i is row i's
            col = np.zeros(T_b, np.int32)
            src[:S] = rows
            col[:S] = advance - 1
            # (columns < K of prev's output: its tokens)
            tokens = self.runner.merge_tokens(prev.outputs.tokens, src, col, batch.token_ids)
        sampling.out_pos[:S] += advance.astype(np.int32)
        inputs = StepInputs(batch, tokens, sampling, steps=c.lane.steps)
        return self._send(inputs, None, None, False, c.lane, c.groups)

    # ------------------------------------------------------------------ padding rules
    def min_seqs(self, num_tokens: int) -> int:
        """Fewest sequence rows a step of ``num_tokens`` tokens pads to.

        A prefill-heavy step has at least one row per 16 tokens (at most the bucket of
        ``max_num_seqs``): while prompts are being admitted a few per step, the batch
        grows through 8, 16, 32... sequences, and each size would compile its own
        512-token step (docs/DECISIONS.md, "A row per 16 tokens while prompts are
        admitted"). The padding rows
        cost a few logits rows in a step of hundreds of tokens. Decode steps (one token
        per sequence) are unaffected.
        """
        cap = bucket(self.schedulers[0].max_num_seqs, 8)
        return max(8, min(cap, bucket(num_tokens, 16) // 16))

    def widest_shape(self) -> tuple[int, int]:
        """``(tokens, sequences)`` of a replica's widest step that prefills: the buckets of
        ``max_num_batched_tokens`` and of ``max_num_seqs`` (no fewer rows than any step
        pads to, no more than the tokens: ``shapes.step_shapes``' largest), the shape a
        step scoring prompt positions takes with static shapes."""
        sc = self.schedulers[0]
        T = bucket(sc.max_num_batched_tokens, MIN_STEP_TOKENS)
        return T, min(bucket(sc.max_num_seqs, self.min_seqs(1)), T)

    def min_pages(self) -> int:
        """Fewest pages a block-table row pads to: the longest sequence's once every
        shape is compiled (``ModelRunner.static_shapes``), else 4."""
        return self.runner.table_width if self.runner.static_shapes else 4


def _scores(w: Work) -> bool:
    """Whether scheduled ``w`` computes prompt positions its request scores
    (``SamplingParams.prompt_logprobs``; ``step_inputs.prompt_rows`` picks the rows)."""
    g = w.group
    return g.prompt_lp is not None and w.start < min(w.stop, len(g.prompt) - 1)
