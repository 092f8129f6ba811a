"""The engine core: requests, the step loop, results, fault isolation, preemption.

``EngineCore`` owns the requests (``add_request``, ``abort``), one scheduler and block
manager per data-parallel replica, and the loop of ``step()``: schedule, swap pages,
build the batch, hand it to the ``ModelRunner`` (``paged_jax.engine.runner``) and apply
the sampled tokens when they come back, overlapping the next step with the running one
(``async_scheduling``) and running several decode steps a launch
(``num_scheduler_steps``). A step is all or nothing: a fault puts every request back to
be recomputed, isolates the request that causes it, or stops the engine until
``reset()``. A step's samples are applied by the ``ApplyResults`` half
(``results.py``); a dispatched step is a ``Launched`` (``launch.py``); finish reasons,
text and outputs come from the ``OutputProcessor`` (``outputs.py``). ``LLM`` is its
public facade.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from paged_jax._validation import validate_batch
from paged_jax.batch import ScheduledSeq, advance_batch, bucket, build_batch, concat_batches
from paged_jax.block_manager import BlockManager, HybridBlockManager, prefix_root_key
from paged_jax.engine._signals import DeferSignals
from paged_jax.engine.launch import Lane, Launched
from paged_jax.engine.metrics import EngineMetrics, record_step
from paged_jax.engine.outputs import OutputProcessor, RequestOutput
from paged_jax.engine.results import ApplyResults
from paged_jax.engine.runner import ModelRunner
from paged_jax.engine.sampling import Penalties, SamplingParams
from paged_jax.engine.scheduler import Group, Scheduler, Seq, Status, Work


class EngineFailedError(RuntimeError):
    """The engine stopped in a step it could not recover from; see ``LLM.reset``."""


# A step that raises this many times in a row (each time after requeueing its requests)
# with no request to blame stops the engine instead of failing forever.
MAX_CONSECUTIVE_FAILED_STEPS = 3
# A request is failed (finish_reason "error") once this many steps in a row raised while
# it ran as the only suspect (see LLM: isolating a fault).
STRIKES_TO_FAIL_A_REQUEST = 2

log = logging.getLogger("paged_jax")

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


class EngineCore(ApplyResults):
    """Continuous batching of requests on a ``ModelRunner`` (see the module docstring and
    ``LLM``, which builds it and documents every option).

    Args:
      runner: the model, its pool and its compiled step.
      tokenizer: for string prompts and text (None: token ids only).
      block_manager_args: ``BlockManager`` (or, with ``group_windows``,
        ``HybridBlockManager``) arguments of each replica's block manager.
      num_replicas: data-parallel replicas, each with its own scheduler and pool.
      max_num_seqs, max_num_batched_tokens, preemption: each replica's ``Scheduler``'s.
      checked, deterministic, async_scheduling, num_scheduler_steps: as ``LLM``'s.
    """

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Any,
        *,
        block_manager_args: dict,
        num_replicas: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preemption: str,
        checked: bool,
        deterministic: bool,
        async_scheduling: bool,
        num_scheduler_steps: int,
    ):
        self.runner = runner
        self.tokenizer = tokenizer
        self.mesh = runner.mesh
        self.page_size = runner.page_size
        self.max_model_len = runner.max_model_len
        self.eos_token_ids = set(getattr(runner.model.config, "eos_token_ids", ()))
        self.outputs = OutputProcessor(tokenizer, self.eos_token_ids, self.max_model_len)
        self.hybrid_kv_cache = runner.hybrid_kv_cache
        self.checked = checked
        self.deterministic = deterministic
        self.async_scheduling = async_scheduling
        self.num_scheduler_steps = num_scheduler_steps
        self._bm_args = block_manager_args
        # One block manager and scheduler per data-parallel replica (page ids local to
        # its pool); `bm` and `scheduler` name the only one when there is one.
        self.schedulers = [
            Scheduler(
                self._new_block_manager(),
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                preemption=preemption,
            )
            for _ in range(num_replicas)
        ]
        self._load = [0] * num_replicas  # unfinished sequences routed to each replica
        self.metrics = EngineMetrics()
        self._groups: dict[Hashable, Group] = {}
        self._arrivals = 0
        # swapped pages, by (replica, host slot)
        self._host: dict[tuple[int, int], tuple[np.ndarray, np.ndarray | None]] = {}
        self._failed: BaseException | None = None  # set when a step could not be undone
        self._phase: str | None = None  # where the running step is ("apply": results)
        self._consecutive_faults = 0
        self._undelivered: list[RequestOutput] = []  # finished, not yet returned
        self._step_groups: list[Group] = []  # the running step's groups
        self._inflight: Launched | None = None  # a step left running (async_scheduling)
        self._accounted = 0  # step calls accounted (metrics)
        self._suspects: list[Group] = []  # groups of a failed step, not yet cleared
        self._ended = 0  # sequences given a finish reason so far (Lane.ended)
        self._cleared: set[int] = set()  # arrivals of suspects that since sampled a token

    # ------------------------------------------------------------------ the runner's state
    @property
    def model(self) -> Any:
        """The model, held for its device (see ``ModelRunner``)."""
        return self.runner.model

    @property
    def cache(self):
        """The KV pool (``PagedKVCache``); every step replaces it (donated)."""
        return self.runner.cache

    @cache.setter
    def cache(self, value) -> None:
        self.runner.cache = value

    @property
    def compiled_buckets(self) -> list[dict]:
        """The shape buckets this engine compiled (``ModelRunner.compiled_buckets``)."""
        return self.runner.compiled_buckets

    @property
    def _run(self):
        """The jitted step (``ModelRunner.step_fn``); tests wrap it to inject faults."""
        return self.runner.step_fn

    @_run.setter
    def _run(self, value) -> None:
        self.runner.step_fn = value

    @property
    def _weights(self) -> tuple:
        return self.runner.weights

    @property
    def bm(self) -> BlockManager:
        """The block manager (with several data-parallel replicas: ``block_managers``)."""
        return self._only("bm", self.schedulers[0].bm)

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler (with several data-parallel replicas: ``schedulers``)."""
        return self._only("scheduler", self.schedulers[0])

    @property
    def block_managers(self) -> list[BlockManager]:
        """Each data-parallel replica's block manager (page ids local to its pool)."""
        return [sc.bm for sc in self.schedulers]

    def _only(self, name: str, value):
        if len(self.schedulers) > 1:
            raise AttributeError(
                f"{name}: this engine has {len(self.schedulers)} data-parallel replicas; "
                f"use {'block_managers' if name == 'bm' else 'schedulers'}[r]"
            )
        return value

    def _bm(self, g: Group) -> BlockManager:
        return self.schedulers[g.replica].bm

    def _new_block_manager(self) -> BlockManager | HybridBlockManager:
        if "group_windows" in self._bm_args:
            return HybridBlockManager(**self._bm_args)
        return BlockManager(**self._bm_args)

    # ------------------------------------------------------------------ requests
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of ``prompt``: a string (through the tokenizer) or a sequence of ints
        (Python or NumPy integers; floats, bools, strings and mappings are refused, not
        coerced)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: a string needs a tokenizer; pass token ids")
            ids = self.tokenizer.encode(prompt)
            return list(getattr(ids, "ids", ids))
        if isinstance(prompt, bytes) or not isinstance(prompt, Sequence | np.ndarray):
            raise TypeError(
                f"prompt: expected a string or a sequence of token ids, got {type(prompt).__name__}"
            )
        ids = []
        for k, t in enumerate(prompt):
            if isinstance(t, bool) or not isinstance(t, int | np.integer):
                raise TypeError(f"prompt[{k}]: expected an int token id, got {t!r}")
            ids.append(int(t))
        return ids

    def decode(self, ids: Sequence[int]) -> str | None:
        return self.outputs.decode(ids)

    def add_request(
        self,
        request_id: Hashable,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: Any = None,
    ) -> None:
        """Queues a request. Raises ValueError on a bad request (nothing is queued).

        ``request_id`` must not belong to an unfinished request; a finished or aborted
        request's id may be used again.
        """
        self._check_usable()
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params: expected SamplingParams, got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise ValueError("params.stop: stop strings need a tokenizer; this engine has none")
        if request_id in self._groups:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        ids = self.encode(prompt)
        if not ids:
            raise ValueError("prompt: expected at least one token, got an empty prompt")
        vocab = self.model.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            k = next(i for i, t in enumerate(ids) if not 0 <= t < vocab)
            raise ValueError(f"prompt: token ids must lie in [0, {vocab}), prompt[{k}] is {ids[k]}")
        try:  # checked here: with prefix caching off it would only fail much later
            prefix_root_key(cache_salt)
        except TypeError as e:
            raise TypeError(f"cache_salt: {str(e).removeprefix('extra_key: ')}") from None
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(ids)} tokens, the model's maximum length is "
                f"{self.max_model_len} (one more is needed to generate)"
            )
        width = params.beam_width if params.use_beam_search else params.n
        # A group's sequences are scheduled together: one wider than a step can hold would
        # never run, and the scheduler, which keeps arrival order, would stall behind it.
        name = "beam_width" if params.use_beam_search else "n"
        first = self.schedulers[0]  # every replica has the same limits and pool size
        for limit, value in (
            ("max_num_seqs", first.max_num_seqs),
            ("max_num_batched_tokens", first.max_num_batched_tokens),
        ):
            if width > value:
                raise ValueError(
                    f"params.{name}: {width} sequences, more than {limit}={value} "
                    f"(a group's sequences run in the same step)"
                )
        worst = min(len(ids) + params.max_tokens, self.max_model_len)
        pages = width * first.bm.pages_needed(worst)
        usable = first.bm.num_pages - 1 - first.bm.watermark_pages
        if pages > usable:
            raise ValueError(
                f"request needs up to {pages} pages ({width} x {worst} tokens), the pool "
                f"has {usable}: lower max_tokens / n / beam_width or add pages"
            )
        self._arrivals += 1
        g = Group(
            request_id=request_id,
            arrival=self._arrivals,
            prompt=ids,
            params=params,
            seed=params.seed if params.seed is not None else self._arrivals,
            salt=cache_salt,
            arrival_time=time.perf_counter(),
            max_len=min(len(ids) + params.max_tokens, self.max_model_len),
        )
        g.seqs.append(Seq(f"{g.arrival}/0", list(ids), len(ids), 0))
        # the least loaded replica (deterministic: every process routes alike)
        g.replica = min(range(len(self._load)), key=lambda r: (self._load[r], r))
        self._load[g.replica] += width
        self._groups[request_id] = g
        self.schedulers[g.replica].add(g)

    def abort(self, request_id: Hashable) -> RequestOutput | None:
        """Stops an unfinished request and frees its pages and host buffers.

        Returns its ``RequestOutput`` (``finished=True``, every sequence's tokens so far,
        ``finish_reason`` "abort" on those that had not finished). An id that is unknown
        or whose request already finished returns None (its output was returned by the
        step that finished it).
        """
        self._check_usable()
        g = self._groups.get(request_id)
        if g is None:
            return None
        self.schedulers[g.replica].remove(g)
        bm = self._bm(g)
        for s in g.seqs:
            if s.seq_id in bm:
                slots = bm.host_slots(s.seq_id)
                bm.free(s.seq_id)
                for slot in slots:  # swapped-out K/V nobody else holds
                    if bm.host_refcount(slot) == 0:
                        self._host.pop((g.replica, slot), None)
            s.finish_reason = "abort"
            self._ended += 1
            g.done.append(s)
        g.seqs.clear()
        return self._finish(g)

    def num_generated(self, request_id: Hashable) -> list[int] | None:
        """Tokens generated so far by each running sample of an unfinished request (None
        for an unknown or finished one). Cheap: no text is decoded."""
        g = self._groups.get(request_id)
        return None if g is None else [len(s.output) for s in g.seqs]

    def has_unfinished(self) -> bool:
        """True while a request runs or a finished one's output waits for ``step``."""
        return any(sc.has_work() for sc in self.schedulers) or bool(self._undelivered)

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Runs one engine step; returns the requests that finished in it.

        If it raises, every unfinished request has been requeued (see the class
        docstring); call ``step`` again to go on. A signal handler held during the step
        runs on return; if it raises, the step's finished outputs come with the next call.
        """
        self._check_usable()
        held = DeferSignals()
        with held:
            try:
                # kept before the handlers come back: a signal landing as they do (in
                # __exit__) must not lose the step's outputs
                self._undelivered += self._step()
            except BaseException as e:
                held.restore()
                self._on_fault(e)
                raise
        held.release()  # may raise (KeyboardInterrupt): the outputs wait in _undelivered
        out, self._undelivered = self._undelivered, []
        return out

    def _step(self) -> list[RequestOutput]:
        """One step's results, and with overlapped steps the next step launched first.

        Overlapped (``async_scheduling``, a step left running by the previous call): the
        next step is scheduled and dispatched while that one runs on the device, each of
        its sampling sequences ending in a placeholder for the token it will get (read on
        the device from the running step's output, ``_merge_tokens``); then the running
        step's tokens are read and applied. A multi-step launch left running is followed
        by the launch that goes on from it (``_continue``: its rows, each decoding its
        last sample), built from its batch while it runs, when nothing waits to be
        admitted; otherwise it completes first and the next step is scheduled. A step is
        left running for the next call only when nothing in its results can change what
        the following step computes (``_may_overlap``); otherwise it completes in this
        call.
        """
        t0 = time.perf_counter()
        prev, self._inflight = self._inflight, None
        done: list[Launched] = []
        finished: list[RequestOutput] = []
        overlapped = prev is not None
        if prev is not None and prev.steps is not None:  # a multi-step launch
            nxt = self._continue(prev)
            finished += self._complete(prev)
            done.append(prev)
            if nxt is None:
                overlapped = False
                nxt = self._launch(None)
        elif prev is not None:
            placed = self._place(prev)
            try:
                nxt = self._launch(prev)
            finally:
                for s in placed:
                    s.tokens.pop()
            finished += self._complete(prev, overlapped=True)
            done.append(prev)
        else:
            nxt = self._launch(None)
        if nxt is not None:
            self.metrics.overlap_stalls += nxt.stalled
            self.metrics.multi_step_launches += nxt.steps is not None
            self.metrics.overlapped_steps += overlapped
            if self._may_overlap(nxt):
                self._inflight = nxt
            else:
                finished += self._complete(nxt)
                done.append(nxt)
        self._phase = None
        self._consecutive_faults = 0
        if self._suspects and any(
            w.sample and w.group is self._suspects[0] for f in done for w in f.all_work()
        ):
            cleared = self._suspects.pop(0)
            cleared.strikes = 0
            self._cleared.add(cleared.arrival)
        self._account(time.perf_counter() - t0, completed=sum(f.iterations for f in done))
        return finished

    def _launch(self, prev: Launched | None) -> Launched | None:
        """Schedules and dispatches a step (without waiting for it); None if there is no
        work. ``prev``: the step still running, whose sampling sequences end in a
        placeholder token (``_place``); the schedule is then speculative."""
        self._phase = "schedule"
        only = self._isolation()
        scheds = []
        for sc in self.schedulers:
            sc.only = only
            scheds.append(sc.schedule(speculative=prev is not None))
        work = [w for sched in scheds for w in sched.work]
        self._step_groups = list({id(w.group): w.group for w in work}.values())
        self._swap(scheds)
        if not work:
            return None
        steps = self._multi_steps(scheds, prev)  # None: one step
        return self._dispatch(
            [sched.work for sched in scheds], steps, prev, any(sched.stalled for sched in scheds)
        )

    def _dispatch(
        self,
        works: list[list[Work]],
        steps: list[int] | None,
        prev: Launched | None,
        stalled,
    ) -> Launched:
        """Builds the batch of ``works`` (each scheduler's, in order) and dispatches it:
        one step, or with ``steps`` (one per row) a multi-step launch. ``prev``: the
        step still running, whose samples some rows decode (placeholders in the batch);
        ``stalled``: the schedule stopped short of a preemption."""
        work = [w for ws in works for w in ws]
        batches, pending = [], 0
        for sc, ws in zip(self.schedulers, works, strict=True):
            b = build_batch(
                sc.bm,
                [ScheduledSeq(w.seq.seq_id, w.start, w.stop) for w in ws],
                min_tokens=MIN_STEP_TOKENS,
                min_seqs=self._min_seqs(sum(w.stop - w.start for w in ws)),
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
        temp = np.zeros(S_b, np.float32)
        top_k = np.zeros(S_b, np.int32)
        top_p = np.ones(S_b, np.float32)
        min_p = np.zeros(S_b, np.float32)
        seeds = np.zeros((S_b, num_samples), np.uint32)
        out_pos = np.zeros(S_b, np.int32)
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
        penalties = self._penalties(placed, rows, S_b)
        tokens = self._tokens(batch, placed, prev, pending)
        lane = (
            None
            if steps is None
            else Lane.of(work, steps, self.eos_token_ids, self.bm, self._ended)
        )
        replicas = len(batches)
        return self._send(
            work, placed, stalled, batch, tokens, sampling, penalties, num_cand, replicas, lane
        )

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
        return self._send(None, None, False, batch, tokens, tuple(sampling), None, 0, 1, lane)

    def _send(
        self, work, placed, stalled, batch, tokens, sampling, penalties, num_cand, replicas, lane
    ) -> Launched:
        """Dispatches the jitted step (or, with its rows' ``lane``, a multi-step launch) on
        ``batch`` with input ``tokens`` and the rows' ``sampling`` arrays (temperature,
        top-k, top-p, min-p, seeds, output positions); returns it running."""
        steps = None if lane is None else lane.steps.tolist()
        outputs, last, dispatch_s, compiled = self.runner.launch(
            batch,
            tokens,
            sampling,
            penalties,
            num_cand,
            None if lane is None else lane.steps,
            replicas,
        )
        if compiled:
            self.metrics.compile_s += dispatch_s
            self.metrics.compilations += 1
        return Launched(
            work=work if lane is None else None,
            placed=placed if lane is None else None,
            groups=self._step_groups,
            num_tokens=batch.num_tokens if steps is None else sum(steps),
            outputs=outputs,
            last=last,
            dispatch_s=0.0 if compiled else dispatch_s,
            stalled=stalled,
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
        row is not a plain decode row, or the reserved tokens' pages are not free. A row
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
            if p.use_beam_search or p.penalized or (p.n > 1 and not g.forked):
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

    def _place(self, f: Launched) -> list[Seq]:
        """Readies the schedule that overlaps running step ``f``: each of its sampling
        sequences still running gets a placeholder for the token ``f`` samples, and every
        sequence's tokens of ``f`` count as computed (the device runs steps in order, so
        any later step sees their K/V). Returns the sequences given a placeholder."""
        placed = []
        for w in f.work:
            s = w.seq
            if s.finish_reason is not None or w.group.status is not Status.RUNNING:
                continue  # finished or aborted since (its row's results are dropped)
            self._bm(w.group).mark_computed(s.seq_id, w.stop)
            if w.sample:
                s.tokens.append(_PENDING)
                placed.append(s)
        return placed

    def _may_overlap(self, f: Launched) -> bool:
        """Whether the next step may be scheduled before ``f``'s tokens are known: overlap
        is on, no request is isolated as a suspect, ``f``'s schedule did not stop short
        of a preemption (the next one makes it, from known tokens), and each sampling row
        only appends its token (no beam search, no first token of n samples to fork, no
        penalties, which count the tokens so far). A multi-step launch, when one of its
        rows has tokens left after it (the next launch goes on from it, ``_continue``);
        the launch that follows a single step may start from its placeholders
        (``_multi_steps``)."""
        if not self.async_scheduling or self._suspects or f.stalled:
            return False
        if f.lane is not None:  # some row goes on after it (``_continue``)
            lane = f.lane
            return bool((lane.stops + lane.steps < lane.max_len).any())
        for w in f.work:
            if w.sample:
                p = w.group.params
                if p.use_beam_search or p.penalized or (p.n > 1 and not w.group.forked):
                    return False
        return True

    def _complete(self, f: Launched, *, overlapped: bool = False) -> list[RequestOutput]:
        """Waits for step ``f`` and applies its tokens; returns the requests it finished.
        ``overlapped``: the next step was launched meanwhile (with placeholders for these
        tokens, replaced here in the block manager); rows of sequences that finished or
        were aborted since ``f`` was launched are dropped."""
        self._phase = "schedule"  # a fault surfacing here is the step's, as at dispatch
        self._step_groups = f.groups
        t1 = time.perf_counter()
        toks, lps, cand_v, cand_i = f.outputs
        if f.steps is not None:  # i32[S_b, 2 K]: the tokens, then the log-probs' bits
            both = np.asarray(toks)
            K = both.shape[1] // 2
            toks, lps = both[:, :K], both[:, K:].view(np.float32)
        else:
            toks, lps = np.asarray(toks), np.asarray(lps)
        cand = None if cand_v is None else (np.asarray(cand_v), np.asarray(cand_i))
        t2 = time.perf_counter()
        self.metrics.step_s += f.dispatch_s + t2 - t1
        self.metrics.tokens_computed += f.num_tokens
        if f.steps is not None:
            return self._apply_steps(f, toks, lps, t2)
        live = [(i, w) for i, w in f.placed if w.seq.finish_reason is None]
        if not overlapped:  # (overlapped: _place marked them)
            for _, w in live:
                self._bm(w.group).mark_computed(w.seq.seq_id, w.stop)
        self._phase = "apply"
        finished = self._process(live, toks, lps, cand, t2)
        if overlapped:  # the next step appended placeholders for these tokens
            for _, w in live:
                s = w.seq
                if w.sample and s.finish_reason is None:
                    bm = self._bm(w.group)
                    k = len(s.tokens) - 1
                    if s.seq_id in bm and bm.num_tokens(s.seq_id) > k:
                        bm.set_token(s.seq_id, k, s.tokens[k])
        return finished

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

    # ------------------------------------------------------------------ faults
    def _on_fault(self, error: BaseException) -> None:
        """A step raised: blame a request or suspect some, requeue every unfinished
        request, or stop the engine."""
        phase, self._phase = self._phase, None
        groups, self._step_groups = self._step_groups, []
        self._consecutive_faults += 1
        self.metrics.failed_steps += 1
        if phase == "apply":
            self._failed = error  # results were half applied
            return
        if isinstance(error, Exception):  # an interrupt says nothing about the requests
            self._suspect(error, groups)
        if self._consecutive_faults >= MAX_CONSECUTIVE_FAILED_STEPS:
            self._failed = error  # the fault repeats and no request explains it
            return
        try:
            self._rebuild([g for g in self._groups.values() if g.status is not Status.FINISHED])
        except BaseException as e:  # noqa: BLE001 (any failure here stops the engine)
            self._failed = e

    def _isolation(self) -> set[int] | None:
        """The arrivals the scheduler may run while suspects are isolated, else None."""
        self._suspects = [g for g in self._suspects if g.status is not Status.FINISHED]
        if not self._suspects:
            self._cleared = set()
            return None
        return self._cleared | {self._suspects[0].arrival}

    def _suspect(self, error: Exception, groups: list[Group]) -> None:
        """Updates the suspects after ``error`` in a step that ran ``groups``; fails the
        isolated suspect on its last strike."""
        self._suspects = [g for g in self._suspects if g.status is not Status.FINISHED]
        if not self._suspects:  # a new episode: every request of the step is a suspect
            self._suspects = sorted(groups, key=lambda g: g.arrival)
            if len(groups) == 1:
                groups[0].strikes = 1  # it failed alone already
            return
        g = self._suspects[0]
        if g not in groups:
            return  # the suspect did not run: nothing learned
        g.strikes += 1
        if g.strikes < STRIKES_TO_FAIL_A_REQUEST:
            return
        self._suspects.remove(g)
        g.error = f"{type(error).__name__}: {error}"
        for s in g.seqs:
            s.finish_reason = "error"
            self._ended += 1
            g.done.append(s)
        g.seqs.clear()
        self._undelivered.append(self._finish(g))
        self._consecutive_faults = 0  # explained
        self.metrics.requests_failed += 1
        log.warning("request %r failed: %s", g.request_id, g.error)

    def _rebuild(self, requeue: list[Group]) -> None:
        """Fresh block manager, queues and host buffers; ``requeue`` waits to be
        recomputed from its committed tokens. The pool is reallocated only if the failed
        step consumed it (donated buffers); its contents are never read again."""
        for r, sc in enumerate(self.schedulers):  # each request stays on its replica
            sc.bm = self._new_block_manager()
            sc.running, sc.swapped = [], []
            sc.waiting = sorted((g for g in requeue if g.replica == r), key=lambda g: g.arrival)
        for g in requeue:
            g.status = Status.WAITING
        self._inflight = None  # its results are dropped: the requests are recomputed
        self._host.clear()
        self.runner.reallocate_if_consumed()

    @property
    def failure(self) -> BaseException | None:
        """The error of a step that could not be undone, while the engine is stopped by it
        (every call but ``reset()`` then raises ``EngineFailedError``); None otherwise."""
        return self._failed

    def _check_usable(self) -> None:
        if self._failed is not None:
            e = self._failed
            raise EngineFailedError(
                f"the engine stopped after a failed step ({type(e).__name__}: {e}); call "
                "LLM.reset() to drop every request and go on with the same compiled model, "
                "or create a new LLM"
            ) from e

    def reset(self) -> None:
        """Drops every request (no outputs are returned for them), frees every page and
        host buffer, and clears a failed state. Compiled steps are kept."""
        self._groups.clear()
        self._undelivered.clear()
        self._failed, self._phase, self._consecutive_faults = None, None, 0
        self._suspects, self._cleared = [], set()
        self._load = [0] * len(self.schedulers)
        self._rebuild([])

    def _sampling_rows(self, placed):
        """Rows that sample: {row: (params, seeds, output position)}, J, beam candidates.
        ``placed``: the step's (batch row, Work) pairs."""
        rows, num_samples, num_cand = {}, 1, 0
        for i, w in placed:
            if not w.sample:
                continue
            g, s, p = w.group, w.seq, w.group.params
            pos = w.stop - s.prompt_len  # output position of the token sampled
            if p.use_beam_search:
                num_cand = max(num_cand, bucket(2 * p.beam_width, 2))
                rows[i] = (p, [g.seed + s.sample_index], pos)
            elif p.n > 1 and not g.forked:
                rows[i] = (p, [g.seed + j for j in range(p.n)], pos)
                num_samples = max(num_samples, bucket(p.n))
            else:
                rows[i] = (p, [g.seed + s.sample_index], pos)
        return rows, num_samples, num_cand

    def _penalties(self, placed, rows, S_b) -> Penalties | None:
        """Penalty inputs of the step's sampling rows, or None when no row uses them (the
        step then compiles without them). Token arrays are padded with -1 to power-of-two
        widths."""
        distinct = {id(p): p for p, _, _ in rows.values()}  # requests share params objects
        if not any(p.penalized for p in distinct.values()):
            return None
        seqs = {i: w.seq for i, w in placed if i in rows}
        O_b = bucket(max(len(s.output) for s in seqs.values()), 8)
        P_b = bucket(max(s.prompt_len for s in seqs.values()), 8)
        out = np.full((S_b, O_b), -1, np.int32)
        prompt = np.full((S_b, P_b), -1, np.int32)
        rep = np.ones(S_b, np.float32)
        pres = np.zeros(S_b, np.float32)
        freq = np.zeros(S_b, np.float32)
        for i, (p, _, _) in rows.items():
            if not p.penalized:
                continue
            s = seqs[i]
            out[i, : len(s.output)] = s.output
            prompt[i, : s.prompt_len] = s.tokens[: s.prompt_len]
            rep[i], pres[i], freq[i] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty
        return Penalties(rep, pres, freq, out, prompt)  # the runner puts them on the device

    def _swap(self, scheds) -> None:
        """Swap-out reads, then swap-in writes, before the step (see BlockManager), of
        every replica's schedule at once: replica r's pages (local ids, padded with its
        null page to the same count) at positions ``[r n, (r + 1) n)``."""
        outs = [sched.swap_out for sched in scheds]
        ins = [sched.swap_in for sched in scheds]
        if any(outs):
            n = max(map(len, outs))
            pages = np.zeros((len(outs), n), np.int32)
            for r, swap_out in enumerate(outs):
                pages[r, : len(swap_out)] = [d for d, _ in swap_out]
            data, scales = self.runner.read_pages(pages.reshape(-1))
            for r, swap_out in enumerate(outs):
                for k, (_, slot) in enumerate(swap_out):
                    j = r * n + k
                    self._host[r, slot] = (data[:, j], None if scales is None else scales[:, j])
        if any(ins):
            n = bucket(max(map(len, ins)))
            pages = np.zeros(len(ins) * n, np.int32)  # padding rewrites a null page with 0s
            shape = self.cache.kv_pages.shape
            data = np.zeros((shape[0], len(pages)) + shape[2:], self.cache.kv_pages.dtype)
            scales = (
                np.zeros((shape[0], len(pages)) + shape[2:4], np.float32)
                if self.cache.quantized
                else None
            )
            for r, swap_in in enumerate(ins):
                for k, (slot, page) in enumerate(swap_in):
                    j = r * n + k
                    kv, sc = self._host.pop((r, slot))
                    pages[j], data[:, j] = page, kv
                    if scales is not None:
                        scales[:, j] = sc
            self.runner.write_pages(pages, data, scales)

    def _account(self, dt: float, completed: int) -> None:
        # The full recount walks every page of every sequence: sample it (every call while
        # there are few sequences, every 8th beyond), it is statistics, not control.
        self._accounted += 1
        full = sum(sc.bm.num_seqs for sc in self.schedulers) <= 16 or self._accounted % 8 == 1
        record_step(self.metrics, dt, completed, self.schedulers, self.page_size, full=full)
