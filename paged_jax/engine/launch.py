"""A dispatched step (``Launched``) and a multi-step launch's rows as columns (``Lane``):
what the engine core keeps of a step between its dispatch and its results. No JAX here
(a launch's outputs are device arrays the core reads back)."""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any

import numpy as np

from paged_jax._validation import validate_batch
from paged_jax.batch import ScheduledSeq, advance_batch, bucket, build_batch, concat_batches
from paged_jax.block_manager import BlockManager, SeqRows
from paged_jax.engine.request import TokenLog, Work
from paged_jax.engine.sampling import Penalties, allowed_bits, idle_sampling

# The smallest token bucket of a step. Decode of a few sequences in a 16-token bucket
# computed 16 rows of every product. SmolLM2-135M f32 on the 2-core AMD EPYC, greedy
# decode, medians (2026-11-24): 1 sequence 37.2 tokens/s with 8, 39.1 with 4, and
# 32.1-32.9 before (16, with the layers' weights stacked); 4 sequences 144 / 149 / 126.
# 4 cost a bucket more (8 and 4 at the tail of a 32 x 128 run, where sequences finish
# in waves): 15.1-15.4 s to compile that run's buckets against 14.4-14.6 with 8. Never 1:
# XLA turns a one-row scatter into an update that copies the whole KV pool (so
# PagedKVCache.write pads one row to two).
MIN_STEP_TOKENS = 8
_PENDING = -1  # a token the running step is sampling (overlapped steps)
_SEQS = operator.attrgetter("seqs")


@dataclasses.dataclass
class Lane:
    """A multi-step launch's rows as columns: row j is batch row ``at[j]``, sequence
    ``seqs[j]`` of ``groups[j]`` (its id ``ids[j]``), whose input is its token
    ``stops[j] - 1`` and which samples ``steps[j]`` tokens. Built once for the first
    launch of a run and carried from launch to launch (``LLM._continue``), so a steady
    launch makes no per-row objects and checks its rows with whole-array operations."""

    seqs: list  # [Seq]
    groups: list  # [Group]
    ids: SeqRows  # the sequences' ids and block-manager rows
    at: np.ndarray  # intp[L]: batch rows
    stops: np.ndarray  # int64[L]: the sequence's tokens with the row's input (Work.stop)
    steps: np.ndarray  # int64[L]
    max_len: np.ndarray  # int64[L]: Group.max_len
    exact: np.ndarray  # bool[L]: a stop string or log-probs to keep (LLM._extend)
    stop_ids: dict  # id(SamplingParams) -> set of token ids that stop its sequences
    stop_union: list  # every token id in stop_ids (a superset of each row's)
    ended: int  # LLM._ended when every row was known to run (none finished since: all do)
    continued: bool  # built by LLM._continue (its groups have their first token times)
    log: TokenLog  # where the rows' samples wait until read (Seq.attach)
    li: np.ndarray  # intp[L]: each row's row in log
    # float64[L]: the sequences' cum_logprob as the launch starts, set by the launch before
    # as it is applied (None: read them from the sequences)
    cum: np.ndarray | None = None

    @classmethod
    def of(
        cls, work: list, steps: list[int], eos_token_ids: set, bm: BlockManager, ended: int
    ) -> Lane:
        """The lane of a launch scheduled as ``work`` (row i: ``work[i]``), ``steps`` each,
        its sequences in ``bm``; ``ended``: ``LLM._ended`` now."""
        seqs = [w.seq for w in work]
        groups = [w.group for w in work]
        L = len(work)
        stop_ids = {}
        for p in {id(g.params): g.params for g in groups}.values():
            stop_ids[id(p)] = set(p.stop_token_ids) | (set() if p.ignore_eos else eos_token_ids)
        log = TokenLog(L)
        for i, s in enumerate(seqs):
            s.attach(log, i)
        return cls(
            seqs=seqs,
            groups=groups,
            ids=bm.seq_rows([s.seq_id for s in seqs]),
            at=np.arange(L, dtype=np.intp),
            stops=np.fromiter((w.stop for w in work), np.int64, L),
            steps=np.asarray(steps, np.int64),
            max_len=np.fromiter((g.max_len for g in groups), np.int64, L),
            exact=np.fromiter((bool(g.params.stop or g.params.logprobs) for g in groups), bool, L),
            stop_ids=stop_ids,
            stop_union=sorted(set().union(*stop_ids.values())),
            ended=ended,
            continued=False,
            log=log,
            li=np.arange(L, dtype=np.intp),
        )

    def take(self, keep: np.ndarray | None, **columns) -> Lane:
        """The lane of rows ``keep`` (a bool mask; None: all), with ``columns`` replaced
        (arrays over the kept rows)."""
        if keep is None:
            fields = {"seqs": self.seqs, "groups": self.groups, "ids": self.ids}
            fields.update(at=self.at, stops=self.stops, steps=self.steps)
            fields.update(max_len=self.max_len, exact=self.exact, li=self.li)
        else:
            idx = np.flatnonzero(keep).tolist()
            fields = {k: [getattr(self, k)[j] for j in idx] for k in ("seqs", "groups")}
            fields["ids"] = self.ids.take(keep)
            for k in ("at", "stops", "steps", "max_len", "exact", "li"):
                fields[k] = getattr(self, k)[keep]
        fields.update(ended=self.ended, continued=self.continued, log=self.log)
        fields.update(columns)  # (cum is not carried: a lane taken for the next launch
        # starts from sums the launch before has not computed yet)
        return Lane(**fields, stop_ids=self.stop_ids, stop_union=self.stop_union)

    def work(self) -> list:
        """Its rows as ``Work``, in order."""
        return [
            Work(g, s, n - 1, n, True)
            for g, s, n in zip(self.groups, self.seqs, self.stops.tolist(), strict=True)
        ]


@dataclasses.dataclass
class Launched:
    """A dispatched step: its work, batch rows and device outputs (not waited for)."""

    work: list | None  # [Work] (None for a multi-step launch: its ``lane``)
    placed: list | None  # [(batch row, Work)] (None for a multi-step launch)
    groups: list  # [Group] the step runs
    num_tokens: int  # live tokens
    # (tokens i32[S_b, 1], log-probs f32[S_b, 1], candidates or None x 2); a multi-step
    # launch's: (i32[S_b, 2 K] its tokens then its log-probs' bits, None, None, None)
    outputs: tuple
    dispatch_s: float  # the dispatch call's time (0 when it compiled)
    stalled: bool  # its speculative schedule stopped short of a preemption
    compiled: bool = False  # its dispatch compiled a new program (its time: compile_s)
    # Multi-step decoding: the steps each row runs; None: one
    # step. Then also its rows as a lane, and its batch and sampling arrays, from which
    # the next launch is built (``advance_batch``).
    steps: list[int] | None = None
    last: Any = None  # i32[T_b] row r's last sample (0: padding), the next launch's input
    lane: Lane | None = None
    batch: Any = None
    sampling: tuple | None = None
    rows: dict = dataclasses.field(init=False)  # id(Seq) -> batch row of its sample
    # Multi-step: the lane's rows whose last sample a launch dispatched meanwhile decodes
    # (``LLM._continue``): reserved in the block manager, filled with the others.
    carried: np.ndarray | None = None  # bool[L]; None: none
    next: Lane | None = None  # the lane of the launch that goes on from this one
    # Speculative decoding: {batch row: (proposals, first extra sampling row)} of the rows
    # that verify proposals (``Speculation._verify_rows``); None: none.
    spec: dict | None = None
    # A step whose rows are sampled once their grammar masks are known (structured output
    # in an overlapped step, ``Launching._sample_deferred``): the runner's
    # ``DeferredSample`` and the sampling rows' ``(rows, S_b, params)``; ``outputs`` is
    # None until then.
    deferred: Any = None
    mask_rows: tuple | None = None
    # Prompt log-probs (``SamplingParams.prompt_logprobs``) the step computes: ``(group,
    # prompt positions)`` in the order of its score rows (``Launching._prompt_rows``);
    # None: none.
    scoring: list | None = None

    def __post_init__(self):
        # read only for a single step (``LLM._tokens``): a launch is followed by
        # ``LLM._continue``, or completes before the next step is scheduled
        self.rows = {id(w.seq): i for i, w in self.placed if w.sample} if self.steps is None else {}

    def all_work(self) -> list:
        """Its ``Work``, in row order (a multi-step launch's made from its lane)."""
        return self.work if self.lane is None else self.lane.work()

    @property
    def iterations(self) -> int:
        """Device steps the launch runs (a multi-step one: its longest row's, the loop's
        trip count)."""
        return 1 if self.steps is None else max(self.steps)


class Launching:
    """``EngineCore``'s part that builds and dispatches launches (a mixin over the core's
    state): a scheduled step's batch (``build_batch``), its rows' sampling columns and
    penalties and its input tokens (a running step's samples merged in on the device),
    handed to the ``ModelRunner``; and multi-step launches, built from a schedule
    (``_multi_steps``) or going on from the running one (``_continue``)."""

    def _dispatch(
        self,
        works: list[list[Work]],
        steps: list[int] | None,
        prev: Launched | None,
        stalled,
        drafts: dict | None = None,
    ) -> Launched:
        """Builds the batch of ``works`` (each scheduler's, in order) and dispatches it:
        one step, or with ``steps`` (one per row) a multi-step launch. ``prev``: the
        step still running, whose samples some rows decode (placeholders in the batch);
        ``stalled``: the schedule stopped short of a preemption; ``drafts``: proposals
        some rows verify, ``{id(Seq): tokens}`` (``Speculation._draft``)."""
        work = [w for ws in works for w in ws]
        batches, pending = [], 0
        for sc, ws in zip(self.schedulers, works, strict=True):
            b = build_batch(
                sc.bm,
                [ScheduledSeq(w.seq.seq_id, w.start, w.stop) for w in ws],
                min_tokens=MIN_STEP_TOKENS,
                min_seqs=self._min_seqs(sum(w.stop - w.start for w in ws)),
                min_pages=self._min_pages(),
                table_tokens=None
                if steps is None
                else [w.stop + k - 1 for w, k in zip(ws, steps, strict=True)],
            )
            if prev is not None:  # placeholders: filled on the device (0 until then)
                mask = b.token_ids == _PENDING
                pending += int(mask.sum())
                b.token_ids[mask] = 0
            if self.checked:
                validate_batch(
                    b,
                    num_pages=sc.bm.num_pages,
                    page_size=self.page_size,
                    group_windows=getattr(sc.bm, "group_windows", None),
                    vocab_size=self.model.config.vocab_size,
                )
            batches.append(b)
        # replicas' batches side by side: replica r's sequence rows from r * S_r
        batch = concat_batches(batches)
        S_b = batch.kv_lens.shape[0]
        S_r = S_b // len(batches)
        placed = [(r * S_r + i, w) for r, ws in enumerate(works) for i, w in enumerate(ws)]
        rows, num_samples, num_cand = self._sampling_rows(placed)
        scored, scoring = self._prompt_rows(batch, placed)
        temp, top_k, top_p, min_p, seeds, out_pos = idle_sampling(S_b, num_samples)
        if rows:  # one array write per column, not per row
            at = list(rows)
            per_row = list(rows.values())
            params = [p for p, _, _ in per_row]
            temp[at] = [p.temperature for p in params]
            top_k[at] = [p.top_k for p in params]
            top_p[at] = [p.top_p for p in params]
            min_p[at] = [p.min_p for p in params]
            out_pos[at] = [pos for _, _, pos in per_row]
            if num_samples == 1:
                seeds[at, 0] = [seed_row[0] for _, seed_row, _ in per_row]
            else:
                for i, (_, seed_row, _) in rows.items():
                    seeds[i, : len(seed_row)] = seed_row
        sampling = (temp, top_k, top_p, min_p, seeds, out_pos)
        distinct = {id(p): p for p, _, _ in rows.values()}  # requests share params objects
        penalties = self._penalties(placed, rows, S_b, distinct.values())
        # A grammar's mask waits for the running step's token: the model call goes now,
        # the sampling once prev's tokens are applied (_sample_deferred)
        defer = prev is not None and any(p.structured is not None for p in distinct.values())
        allowed = cand_allowed = None
        if not defer:
            allowed, cand_allowed = self._allowed(placed, rows, S_b, distinct.values())
        spec = None
        if drafts:
            batch, sampling, penalties, allowed, spec = self._verify_rows(
                placed, drafts, batch, sampling, penalties, allowed
            )
            if cand_allowed is not None:  # the verify rows' candidates: any token
                extra = batch.logits_indices.shape[0] - cand_allowed.shape[0]
                pad = np.full((extra, cand_allowed.shape[1]), -1, np.int32)
                cand_allowed = np.concatenate([cand_allowed, pad])
        tokens = self._tokens(batch, placed, prev, pending)
        adapters = self._adapters(batch, placed)
        lane = (
            None
            if steps is None
            else Lane.of(work, steps, self.eos_token_ids, self.bm, self._ended)
        )
        replicas = len(batches)
        f = self._send(
            work, placed, stalled, batch, tokens, sampling, penalties, allowed, num_cand,
            replicas, lane, adapters=adapters, defer=defer, cand_allowed=cand_allowed,
            scored=scored,
        )  # fmt: skip
        f.spec = spec
        f.scoring = scoring
        if defer:
            f.mask_rows = (rows, S_b, list(distinct.values()))
        return f

    def _sample_deferred(self, f: Launched) -> None:
        """Dispatches the sampling of step ``f`` launched with its masks deferred: each
        constrained row's mask from its matcher, which has now taken the token of the
        step ``f`` overlapped (its model call has been running meanwhile)."""
        rows, S_b, params = f.mask_rows
        allowed, cand_allowed = self._allowed(f.placed, rows, S_b, params)
        f.outputs, seconds, compiled = self.runner.sample(f.deferred, allowed, cand_allowed)
        f.deferred = f.mask_rows = None
        if compiled:
            f.compiled = True
            self.metrics.compile_s += seconds
            self.metrics.compilations += 1
        else:
            f.dispatch_s += seconds

    def _run_batch(self, lane: Lane, prev: Launched, batch, rows, advance) -> Launched:
        """``_dispatch`` of a batch ``advance_batch`` built from multi-step launch
        ``prev``'s: row i (``lane``'s row i) goes on from ``prev``'s row ``rows[i]``,
        ``advance[i]`` tokens on, its sampling inputs that row's (the output position
        ``advance[i]`` further) and its input token ``prev``'s last sample of the row."""
        if self.checked:
            validate_batch(
                batch,
                num_pages=self.bm.num_pages,
                page_size=self.page_size,
                vocab_size=self.model.config.vocab_size,
            )
        S, S_b, T_b = len(rows), batch.kv_lens.shape[0], batch.token_ids.shape[0]
        # Every row goes on in place (a steady launch): prev's sampling rows as they are,
        # and its rows' last samples (prev.last) as the input tokens.
        in_place = (
            S == len(prev.lane.seqs)
            and S_b == prev.batch.kv_lens.shape[0]
            and T_b == prev.batch.token_ids.shape[0]
        )
        if in_place:
            sampling = list(prev.sampling)
            sampling[5] = sampling[5].copy()
        else:
            sampling = []
            for old, pad in zip(prev.sampling, (0, 0, 1, 0, 0, 0), strict=True):
                new = np.full((S_b, *old.shape[1:]), pad, old.dtype)
                new[:S] = old[rows]
                sampling.append(new)
        sampling[5][:S] += advance.astype(np.int32)  # out_pos
        if in_place:
            tokens = prev.last
        else:
            src = np.full(T_b, -1, np.int32)  # decode rows: token i is row i's
            col = np.zeros(T_b, np.int32)
            src[:S] = rows
            col[:S] = advance - 1
            # (columns < K of prev's output: its tokens)
            tokens = self.runner.merge_tokens(prev.outputs[0], src, col, batch.token_ids)
        return self._send(None, None, False, batch, tokens, tuple(sampling), None, None, 0, 1, lane)

    def _send(
        self,
        work,
        placed,
        stalled,
        batch,
        tokens,
        sampling,
        penalties,
        allowed,
        num_cand,
        replicas,
        lane,
        adapters=None,
        defer=False,
        cand_allowed=None,
        scored=None,
    ) -> Launched:
        """Dispatches the jitted step (or, with its rows' ``lane``, a multi-step launch) on
        ``batch`` with input ``tokens`` and the rows' ``sampling`` arrays (temperature,
        top-k, top-p, min-p, seeds, output positions), ``allowed`` token masks (or None)
        and each token's ``adapters`` (``i32[T_b]`` or None); returns it running.
        ``defer``: the model call only, sampled by ``_sample_deferred``;
        ``cand_allowed``: the beams' candidate masks (``_allowed``); ``scored``: the
        prompt positions scored (``_prompt_rows``)."""
        steps = None if lane is None else lane.steps.tolist()
        outputs, last, dispatch_s, compiled = self.runner.launch(
            batch,
            tokens,
            sampling,
            penalties,
            num_cand,
            None if lane is None else lane.steps,
            replicas,
            allowed,
            adapters,
            defer_sample=defer,
            cand_allowed=cand_allowed,
            scored=scored,
        )
        if compiled:
            self.metrics.compile_s += dispatch_s
            self.metrics.compilations += 1
        return Launched(
            work=work if lane is None else None,
            placed=placed if lane is None else None,
            groups=self._step_groups,
            num_tokens=batch.num_tokens if steps is None else sum(steps),
            outputs=None if defer else outputs,
            deferred=outputs if defer else None,
            last=last,
            dispatch_s=0.0 if compiled else dispatch_s,
            stalled=stalled,
            compiled=compiled,
            steps=steps,
            lane=lane,
            batch=batch if steps is not None else None,
            sampling=sampling if steps is not None else None,
        )

    def _multi_step_ready(self) -> bool:
        """Multi-step decoding is on and may run now: one replica, no hybrid pool, no
        isolated suspect, no request waiting or swapped out."""
        if self.num_scheduler_steps == 1 or len(self.schedulers) != 1 or self.hybrid_kv_cache:
            return False
        sc = self.schedulers[0]
        return not (self._suspects or sc.waiting or sc.swapped)

    def _multi_steps(self, scheds, prev: Launched | None) -> list[int] | None:
        """The steps each sequence of the schedule runs in a multi-step launch, its slots
        reserved (``BlockManager.reserve_tokens``), or None for one step: multi-step
        decoding is off, or the schedule swaps, preempts or stalled, a request waits to be
        admitted, a suspect is isolated, there are several replicas or a hybrid pool, a
        row is not a plain decode row (beams, penalties, allowed tokens, the first token of
        n samples), or the reserved tokens' pages are not free. A row
        runs at most as many steps as it has tokens left to sample (``Group.max_len``).
        With ``prev`` (a single step still running) a row's input token may be the
        placeholder for ``prev``'s sample (read on the device, ``_tokens``), its
        reserved tokens after it."""
        K = self.num_scheduler_steps
        if not self._multi_step_ready():
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

    def _continue(self, f: Launched) -> Launched | None:
        """The multi-step launch that goes on from running launch ``f`` before its tokens
        are known (overlapped steps), or None. Each row of ``f`` that has tokens left to
        sample decodes ``f``'s last sample (read on the device) and up to K - 1 more; the
        slots for all of them are reserved, and ``f``'s last samples are filled in with its
        other tokens (``f.carried``). Only while multi-step decoding may run
        (``_multi_step_ready``: nothing waits to be admitted) and ``f`` ran every running
        sequence; None also when the pages are not free (the next step is scheduled once
        ``f``'s tokens are known). Runs for every launch of a steady decode: the rows are
        handled as whole arrays (``Lane``)."""
        if not self.async_scheduling or not self._multi_step_ready():
            return None
        self._phase = "schedule"
        sc, K = self.schedulers[0], self.num_scheduler_steps
        lane = f.lane
        alive = self._alive(lane)
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
            ended=self._ended,
            continued=True,
        )
        if not sc.bm.reserve_tokens(nxt.ids, left):
            return None
        f.carried = go
        f.next = nxt
        self._step_groups = (  # every row going on: f's groups
            f.groups if every else list({id(g): g for g in nxt.groups}.values())
        )
        batch = advance_batch(
            sc.bm,
            f.batch,
            rows,
            advance,
            n + left - 1,
            min_tokens=MIN_STEP_TOKENS,
            min_seqs=self._min_seqs(len(rows)),
            min_pages=self._min_pages(),
            seqs=nxt.ids,
        )
        return self._run_batch(nxt, f, batch, rows, advance)

    def _tokens(self, batch, placed, prev: Launched | None, pending: int):
        """The step's input tokens: the batch's (host), or on the device with each of its
        ``pending`` placeholders (a token ``prev``, a single step, is sampling) taken from
        ``prev``'s output."""
        if prev is None:
            return batch.token_ids
        src = np.full(batch.token_ids.shape[0], -1, np.int32)
        for i, w in placed:
            row = prev.rows.get(id(w.seq))
            if row is not None and w.stop == len(w.seq.tokens):  # decodes the placeholder
                src[batch.logits_indices[i]] = row
        found = int((src >= 0).sum())
        if found != pending:  # a placeholder anywhere else would compute a wrong token
            raise RuntimeError(
                f"overlapped step: {pending} placeholder tokens in the batch, {found} of "
                "them decode a running step's sample (a bug in paged-jax)"
            )
        if not found:
            return batch.token_ids
        return self.runner.merge_tokens(prev.outputs[0], src, np.zeros_like(src), batch.token_ids)

    def _min_seqs(self, num_tokens: int) -> int:
        """Fewest sequence rows a step of ``num_tokens`` tokens pads to.

        A prefill-heavy step has at least one row per 16 tokens (at most the bucket of
        ``max_num_seqs``): while prompts are being admitted a few per step, the batch
        grows through 8, 16, 32... sequences, and each size would compile its own
        512-token step (measured on SmolLM2: 3 such buckets, 4 s each). The padding rows
        cost a few logits rows in a step of hundreds of tokens. Decode steps (one token
        per sequence) are unaffected.
        """
        cap = bucket(self.schedulers[0].max_num_seqs, 8)
        return max(8, min(cap, bucket(num_tokens, 16) // 16))

    def _min_pages(self) -> int:
        """Fewest pages a block-table row pads to: the longest sequence's once every
        shape is compiled (``ModelRunner.static_shapes``), else 4."""
        return self.runner.table_width if self.runner.static_shapes else 4

    def _sampling_rows(self, placed):
        """Rows that sample: {row: (params, seeds, output position)}, J, beam candidates.
        ``placed``: the step's (batch row, Work) pairs."""
        rows, num_samples, num_cand = {}, 1, 0
        for i, w in placed:
            if not w.sample:
                continue
            g, s, p = w.group, w.seq, w.group.params
            pos = w.stop - s.prompt_len  # output position of the token sampled
            if p.top_logprobs:  # the step's candidates: its most likely tokens
                num_cand = max(num_cand, bucket(p.top_logprobs, 2))
            if p.use_beam_search:
                num_cand = max(num_cand, bucket(2 * p.beam_width, 2))
                rows[i] = (p, [g.seed + s.sample_index], pos)
            elif p.n > 1 and not g.forked:
                rows[i] = (p, [g.seed + j for j in range(p.n)], pos)
                num_samples = max(num_samples, bucket(p.n))
            else:
                rows[i] = (p, [g.seed + s.sample_index], pos)
        return rows, num_samples, num_cand

    def _prompt_rows(self, batch, placed) -> tuple:
        """``(scored, scoring)``: the token rows of the step whose logits score the next
        prompt token (requests with ``SamplingParams.prompt_logprobs``), for
        ``ModelRunner.launch``'s ``scored`` (``(rows i32[E_b], targets i32[E_b], k)``,
        ``E_b`` a power of two >= 8, ``k`` the most top tokens a request asks, rounded up
        to a power of two, or 0), and ``Launched.scoring`` (``[(group, positions)]``, the
        rows' order); ``(None, None)`` when no request of the step asks. Prompt token t
        (t < prompt length - 1) is scored by its own row, unless a completed step has
        already scored it (a recompute after a preemption); a group's sequences
        computing the same prompt (forks recomputed) are scored once."""
        rows, targets, scoring, top = [], [], [], 0
        seen = set()
        for i, w in placed:
            g = w.group
            if g.prompt_lp is None:  # (most rows: one attribute read a step)
                continue
            stop = min(w.stop, len(g.prompt) - 1)
            if w.start >= stop or id(g) in seen:
                continue
            seen.add(id(g))
            first = int(batch.logits_indices[i]) - (w.stop - w.start) + 1  # row of w.start
            ts = [t for t in range(w.start, stop) if g.prompt_lp[t + 1] is None]
            if not ts:
                continue
            rows += [first + t - w.start for t in ts]
            targets += [g.prompt[t + 1] for t in ts]
            scoring.append((g, ts))
            top = max(top, g.params.prompt_logprobs)
        if not rows:
            return None, None
        E_b = bucket(len(rows), 8)
        at = np.zeros(E_b, np.int32)
        at[: len(rows)] = rows
        to = np.zeros(E_b, np.int32)
        to[: len(rows)] = targets
        return (at, to, bucket(top, 2) if top else 0), scoring

    def _adapters(self, batch, placed) -> np.ndarray | None:
        """``i32[T_b]``: each token's adapter (``Group.adapter``, as its LoRA slot plus one
        with ``max_loras``; 0 for padding), or None when every request of the step runs
        without one (the step then compiles without them)."""
        ids = {w.group.adapter for _, w in placed} - {0}
        if not ids:
            return None
        slot = self._slots_for(ids)  # LoRA adapters: each one's slot, loaded if need be
        T_b = batch.token_ids.shape[0]
        out = np.zeros(T_b, np.int32)
        for i, w in placed:
            if w.group.adapter:  # the row's tokens end at its logits row (global rows)
                last = int(batch.logits_indices[i])
                out[last - (w.stop - w.start) + 1 : last + 1] = slot[w.group.adapter]
        return out

    def _allowed(self, placed, rows, S_b, params) -> tuple:
        """``(allowed, cand_allowed)``, each ``i32[S_b, ceil(V / 32)]`` or None.
        ``allowed``: each sampling row's allowed tokens as a bitmask (``sample_rows``'
        ``allowed``; every token for rows without a restriction), or None when no row has
        one (the step then compiles without it): a grammar's
        (``SamplingParams.structured``) and ``SamplingParams.allowed_token_ids``.
        ``cand_allowed``: the same rows for beams under a grammar (their candidates,
        ``beam_candidates``), every token for other rows (whose candidates are the
        model's ``top_logprobs``), or None when no beam has a grammar. ``params``: the
        rows' distinct params."""
        if all(p.allowed_token_ids is None and p.structured is None for p in params):
            return None, None
        vocab = self.model.config.vocab_size
        masks = np.full((S_b, -(-vocab // 32)), -1, np.int32)  # every bit set
        seqs = {i: w for i, w in placed if i in rows}
        for i, (p, _, _) in rows.items():
            w = seqs[i]
            if p.structured is not None and w.seq.finish_reason is None:
                # the grammar's next tokens (structured.py); a sequence that ended in the
                # step this one overlapped keeps every bit (its row's sample is dropped)
                self._grammars().fill(w.group.matchers[w.seq.seq_id], masks, i)
            if p.allowed_token_ids is not None:
                masks[i] &= _allowed_row(p.allowed_token_ids, vocab)
        beams = [i for i, (p, _, _) in rows.items() if p.use_beam_search and p.structured]
        if not beams:
            return masks, None
        cand = np.full_like(masks, -1)
        cand[beams] = masks[beams]
        return masks, cand

    def _penalties(self, placed, rows, S_b, params) -> Penalties | None:
        """Penalty inputs of the step's sampling rows, or None when no row uses them (the
        step then compiles without them). Token arrays are padded with -1 to power-of-two
        widths; the logit biases' arrays exist only when some row has one. ``params``: the
        rows' distinct params."""
        if not any(p.penalized for p in params):
            return None
        seqs = {i: w.seq for i, w in placed if i in rows}
        O_b = bucket(max(len(s.output) for s in seqs.values()), 8)
        P_b = bucket(max(s.prompt_len for s in seqs.values()), 8)
        out = np.full((S_b, O_b), -1, np.int32)
        prompt = np.full((S_b, P_b), -1, np.int32)
        rep = np.ones(S_b, np.float32)
        pres = np.zeros(S_b, np.float32)
        freq = np.zeros(S_b, np.float32)
        # each row's logit bias: its own, and -inf on the tokens that would stop it while
        # it has fewer than min_tokens (SamplingParams.min_tokens)
        biases = {}
        for i, (p, _, _) in rows.items():
            bias = list(p.logit_bias or ())
            if p.min_tokens and len(seqs[i].output) < p.min_tokens:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
                bias += [(t, -np.inf) for t in sorted(stops)]
            if bias:
                biases[i] = bias
        bias_tokens = bias_values = None
        if biases:
            B_b = bucket(max(map(len, biases.values())), 8)
            bias_tokens = np.full((S_b, B_b), -1, np.int32)
            bias_values = np.zeros((S_b, B_b), np.float32)
            for i, bias in biases.items():
                ids, values = zip(*bias, strict=True)
                bias_tokens[i, : len(ids)] = ids
                bias_values[i, : len(ids)] = values
        for i, (p, _, _) in rows.items():
            if not p.penalized:
                continue
            s = seqs[i]
            out[i, : len(s.output)] = s.output
            prompt[i, : s.prompt_len] = s.tokens[: s.prompt_len]
            rep[i], pres[i], freq[i] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty
        # (the runner puts them on the device)
        return Penalties(rep, pres, freq, out, prompt, bias_tokens, bias_values)


@functools.lru_cache(maxsize=256)
def _allowed_row(token_ids: tuple[int, ...], vocab: int) -> np.ndarray:
    """``allowed_bits``, once per distinct set of allowed tokens (read only)."""
    row = allowed_bits(token_ids, vocab)
    row.setflags(write=False)
    return row
