"""The engine core: requests, the step loop, and the parts it owns.

``EngineCore`` owns the requests (``add_request``, ``abort``; a ``RequestTable``), one
scheduler and block manager per data-parallel replica, and the loop of ``step()``:
schedule, swap pages (``HostSwap``), build and dispatch the step (``StepLauncher``,
which hands ``StepInputs`` to the ``ModelRunner``), and apply the sampled tokens when
they come back (``ResultApplier``), overlapping the next step with the running one
(``async_scheduling``) and running several decode steps a launch
(``num_scheduler_steps``). Speculative decoding (``Speculator``), LoRA slots
(``LoraSlots``) and fault isolation (``FaultIsolator``) are parts of their own; each is
an object with a small public interface, and none reads another's private state. A step
is all or nothing: a fault puts every request back to be recomputed, isolates the
request that causes it, or stops the engine until ``reset()``. ``LLM`` is its public
facade.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Sequence
from typing import Any

from paged_jax.block_manager import BlockManager, HybridBlockManager
from paged_jax.engine._signals import DeferSignals
from paged_jax.engine.admission import RequestChecker
from paged_jax.engine.applier import ResultApplier
from paged_jax.engine.faults import FaultIsolator
from paged_jax.engine.launched import Launched
from paged_jax.engine.launcher import StepLauncher
from paged_jax.engine.loras import LoraSlots
from paged_jax.engine.metrics import EngineMetrics, record_step
from paged_jax.engine.outputs import OutputProcessor, RequestOutput, StepResult, StreamOutput
from paged_jax.engine.request import Group, RequestTable, Seq
from paged_jax.engine.routing import PrefixRouter
from paged_jax.engine.runner import ModelRunner
from paged_jax.engine.sampling import SamplingParams
from paged_jax.engine.scheduler import Scheduler
from paged_jax.engine.speculative import SpeculativeConfig, Speculator
from paged_jax.engine.swapper import HostSwap

log = logging.getLogger("paged_jax")


class EngineCore:
    """Continuous batching of requests on a ``ModelRunner`` (see the module docstring and
    ``LLM``, which builds it and documents every option).

    Args:
      runner: the model, its pool and its compiled step.
      tokenizer: for string prompts and text (None: token ids only).
      block_manager_args: ``BlockManager`` (or, with ``group_windows``,
        ``HybridBlockManager``) arguments of each replica's block manager.
      num_replicas: data-parallel replicas, each with its own scheduler and pool.
      max_num_seqs, max_num_batched_tokens, preemption, scheduling_policy: each
        replica's ``Scheduler``'s (its ``policy``).
      checked, deterministic, async_scheduling, num_scheduler_steps, speculative,
        max_loras, max_lora_rank: as ``LLM``'s (``speculative`` a ``SpeculativeConfig`` or
        None; ``max_loras`` slots the runner's model holds already).

    Parts (attributes): ``schedulers``, ``requests`` (``RequestTable``), ``router``,
    ``outputs`` (``OutputProcessor``), ``metrics``, ``checker`` (``RequestChecker``),
    ``launcher`` (``StepLauncher``), ``applier`` (``ResultApplier``), ``swapper``
    (``HostSwap``), ``faults`` (``FaultIsolator``), ``loras`` (``LoraSlots``),
    ``speculator`` (``Speculator`` or None).
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
        speculative: SpeculativeConfig | None = None,
        max_loras: int = 0,
        max_lora_rank: int = 0,
        scheduling_policy: str = "fcfs",
    ):
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_model_len = runner.max_model_len
        self.eos_token_ids = set(getattr(runner.model.config, "eos_token_ids", ()))
        self.checked = checked
        self.deterministic = deterministic
        self.async_scheduling = async_scheduling
        self.num_scheduler_steps = num_scheduler_steps
        self.metrics = EngineMetrics()  # (reset in place, never replaced: parts hold it)
        self.outputs = OutputProcessor(tokenizer, self.eos_token_ids, self.max_model_len)
        self._bm_args = block_manager_args
        # One block manager and scheduler per data-parallel replica (page ids local to
        # its pool); `bm` and `scheduler` name the only one when there is one.
        self.schedulers = [
            Scheduler(
                self._new_block_manager(),
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                preemption=preemption,
                policy=scheduling_policy,
            )
            for _ in range(num_replicas)
        ]
        self.requests = RequestTable(num_replicas)
        # Requests go where their prompt's leading pages were sent before (its prefix
        # hits), within a margin of the least loaded replica (paged_jax.engine.routing)
        self.router = PrefixRouter(
            num_replicas,
            runner.page_size,
            slack=max(2, max_num_seqs // 8),
            capacity=num_replicas * block_manager_args["num_pages"],
            enabled=block_manager_args.get("enable_prefix_caching", True),
        )
        self.loras = LoraSlots(runner, max_loras, max_lora_rank)
        if max_loras:
            for sc in self.schedulers:
                sc.adapter_slots = max_loras
        self.speculator = None
        if speculative is not None:
            proposer = speculative.proposer(
                vocab_size=runner.model.config.vocab_size,
                page_size=runner.page_size,
                num_pages=block_manager_args["num_pages"],
                max_model_len=runner.max_model_len,
                max_step_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                on_compile=runner.compiled_buckets.append,
                mesh=runner.mesh,
            )
            self.speculator = Speculator(speculative, proposer, runner, self.metrics)
        self._grammar_compiler = None
        self.checker = RequestChecker(
            tokenizer,
            vocab_size=runner.model.config.vocab_size,
            max_model_len=self.max_model_len,
            schedulers=self.schedulers,
            grammars=self.grammars,
        )
        self.swapper = HostSwap(runner)
        self.faults = FaultIsolator(self.metrics)
        self.applier = ResultApplier(
            self.schedulers,
            self.requests,
            self.outputs,
            self.metrics,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            speculator=self.speculator,
            checked=checked,
        )
        self.launcher = StepLauncher(
            runner,
            self.schedulers,
            self.metrics,
            loras=self.loras,
            grammars=self.grammars,
            speculator=self.speculator,
            eos_token_ids=self.eos_token_ids,
            checked=checked,
            async_scheduling=async_scheduling,
            num_scheduler_steps=num_scheduler_steps,
        )
        self._phase: str | None = None  # where the running step is ("apply": results)
        self._undelivered: list[RequestOutput] = []  # finished, not yet returned
        self._unstreamed: list[StreamOutput] = []  # pieces of streams, not yet returned
        self._new_tokens: dict[Hashable, int] = {}  # streams' new tokens, not yet returned
        self._step_groups: list[Group] = []  # the running step's groups (a fault's blame)
        self._inflight: Launched | None = None  # a step left running (async_scheduling)
        self._accounted = 0  # step calls accounted (metrics)

    # ------------------------------------------------------------------ the parts' state
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

    @property
    def in_flight(self) -> Launched | None:
        """The step left running for the next ``step()`` call (overlapped steps), if any."""
        return self._inflight

    @property
    def step_groups(self) -> list[Group]:
        """The groups of the step being scheduled, run or applied (what a fault in it
        blames)."""
        return self._step_groups

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

    def grammars(self):
        """The engine's grammar compiler (``structured.Grammars``), made on first use."""
        if self._grammar_compiler is None:
            from paged_jax.engine.structured import Grammars

            eos = sorted(self.eos_token_ids)[0] if self.eos_token_ids else None
            vocab = self.runner.model.config.vocab_size
            self._grammar_compiler = Grammars(self.tokenizer, eos, vocab)
        return self._grammar_compiler

    def remove_lora(self, name: str) -> None:
        """Unregisters adapter ``name``; refused while unfinished requests use it."""
        self.loras.remove(name, self.requests.using_adapter(self.loras.id_of(name)))

    # ------------------------------------------------------------------ requests
    def check_request(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, *, cache_salt=None
    ) -> list[int]:
        """What ``add_request`` checks of a request against this engine's limits (the
        prompt's tokens and length, ``n`` or ``beam_width`` against ``max_num_seqs``, the
        pages it may need against the pool), without queueing it: ``ValueError`` /
        ``TypeError`` naming what is wrong, else the prompt's token ids. Reads only the
        engine's configuration, so another thread may call it while the engine steps (the
        server does, before it answers)."""
        return self.checker.check(prompt, params or SamplingParams(), cache_salt)[0]

    def add_request(
        self,
        request_id: Hashable,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: Any = None,
        lora: str | None = None,
        adapter: int = 0,
        stream: bool | str = False,
        priority: int = 0,
    ) -> None:
        """Queues a request. Raises ValueError on a bad request (nothing is queued).

        ``request_id`` must not belong to an unfinished request; a finished or aborted
        request's id may be used again. ``lora``: the name of a registered LoRA adapter
        (``add_lora``) the request runs with (None: the base model). ``adapter``: for a
        model of your own whose ``__call__`` takes ``adapter_ids``, the index passed with
        every token of the request (0: none). Requests of different adapters never share
        prefix-cache pages. ``stream``: True, every ``step`` pushes the request's new
        settled text and tokens (``StepResult.streamed``) and its new token count
        (``StepResult.new_tokens``); ``"tokens"``: the counts only (no text is decoded
        before the request finishes); False: nothing before it finishes. ``priority``:
        with scheduling policy "priority", lower values are admitted first and preempted
        last (vLLM's sense; any int); with "fcfs" it must be 0.
        """
        self.faults.check_usable()
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if stream not in (False, True, "tokens"):
            raise ValueError(f"stream: expected False, True or 'tokens', got {stream!r}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority: expected an int, got {priority!r}")
        if priority and (policy := self.schedulers[0].policy) != "priority":
            msg = f"needs scheduling_policy='priority' (this engine's is {policy!r})"
            raise ValueError(f"priority: {priority} {msg}")
        if stream is True and self.tokenizer is None:
            raise ValueError("stream: streaming text needs a tokenizer; pass stream='tokens'")
        if lora is not None:
            if adapter:
                raise ValueError("lora, adapter: give one of them, not both")
            adapter = self.loras.id_of(lora)
        self.loras.check(adapter)
        ids, _ = self.checker.check(prompt, params, cache_salt)
        arrival = self.requests.next_arrival()
        g = Group(
            request_id=request_id,
            arrival=arrival,
            prompt=ids,
            params=params,
            seed=params.seed if params.seed is not None else arrival,
            # an adapter's K/V differ from the base model's: its own prefix-cache chain
            salt=cache_salt if adapter == 0 else ("adapter", adapter, cache_salt),
            arrival_time=time.perf_counter(),
            max_len=min(len(ids) + params.max_tokens, self.max_model_len),
            adapter=adapter,
            priority=priority,
        )
        if params.prompt_logprobs is not None:
            # every prompt token computed here, so each gets its logits row: a chain of
            # the prefix cache of its own (a recompute after a preemption may still hit
            # its own pages, whose tokens' log-probs were kept when their step completed)
            g.salt = ("prompt_logprobs", g.arrival, g.salt)
            g.prompt_lp = [None] * len(ids)
            g.prompt_top = [[] for _ in ids] if params.prompt_logprobs else None
        g.seqs.append(Seq(f"{g.arrival}/0", list(ids), len(ids), 0))
        if params.structured is not None:
            g.matchers[g.seqs[0].seq_id] = self.grammars().matcher(params.structured)
        # where its prefix was sent, else the least loaded replica (deterministic:
        # every process routes alike)
        g.replica = self.router.route(ids, g.salt, self.requests.load)
        self.requests.add(g)
        self.schedulers[g.replica].add(g)
        if stream:
            self.outputs.open_stream(request_id, text=stream is True)

    def abort(self, request_id: Hashable) -> RequestOutput | None:
        """Stops an unfinished request and frees its pages and host buffers.

        Returns its ``RequestOutput`` (``finished=True``, every sequence's tokens so far,
        ``finish_reason`` "abort" on those that had not finished). An id that is unknown
        or whose request already finished returns None (its output was returned by the
        step that finished it).
        """
        self.faults.check_usable()
        g = self.requests.get(request_id)
        if g is None:
            return None
        self.outputs.close_stream(request_id)
        self.schedulers[g.replica].remove(g)
        return self.applier.abort(g, lambda slots, bm: self.swapper.drop(g.replica, slots, bm))

    def num_generated(self, request_id: Hashable) -> list[int] | None:
        """Tokens generated so far by each running sample of an unfinished request (None
        for an unknown or finished one). Cheap: no text is decoded."""
        g = self.requests.get(request_id)
        return None if g is None else [len(s.output) for s in g.seqs]

    def has_unfinished(self) -> bool:
        """True while a request runs or a finished one's output waits for ``step``."""
        return any(sc.has_work() for sc in self.schedulers) or bool(self._undelivered)

    def deliver_later(self, result: StepResult) -> None:
        """What a caller of ``step`` took but does not own (a ``generate`` loop meets
        requests another caller added): the next ``step`` returns it first."""
        merged = StepResult()
        for part in (result, StepResult(self._undelivered, self._unstreamed, self._new_tokens)):
            merged.add_others(part, mine=())
        self._undelivered, self._unstreamed = list(merged), merged.streamed
        self._new_tokens = merged.new_tokens

    def discard_undelivered(self, request_ids) -> None:
        """Drops the outputs of ``request_ids`` waiting for ``step`` (their caller ended:
        an interrupted ``generate``)."""
        self._undelivered = [o for o in self._undelivered if o.request_id not in request_ids]
        self._unstreamed = [p for p in self._unstreamed if p.request_id not in request_ids]

    # ------------------------------------------------------------------ one step
    def step(self) -> StepResult:
        """Runs one engine step; returns the requests that finished in it, and what it
        pushes for the streamed ones (``StepResult``).

        If it raises, every unfinished request has been requeued (see the class
        docstring); call ``step`` again to go on. A signal handler held during the step
        runs on return; if it raises, the step's outputs come with the next call.
        """
        self.faults.check_usable()
        held = DeferSignals()
        with held:
            try:
                # kept before the handlers come back: a signal landing as they do (in
                # __exit__) must not lose the step's outputs
                self._undelivered += self._step()
                pieces, counts = self.outputs.stream_pieces(self.requests.get, self._undelivered)
                self._unstreamed += pieces
                for rid, n in counts.items():
                    self._new_tokens[rid] = self._new_tokens.get(rid, 0) + n
            except BaseException as e:
                held.restore()
                self._on_fault(e)
                raise
        held.release()  # may raise (KeyboardInterrupt): the outputs wait in _undelivered
        out = StepResult(self._undelivered, self._unstreamed, self._new_tokens)
        self._undelivered, self._unstreamed, self._new_tokens = [], [], {}
        return out

    def _step(self) -> list[RequestOutput]:
        """One step's results, and with overlapped steps the next step launched first.

        Overlapped (``async_scheduling``, a step left running by the previous call): the
        next step is scheduled and dispatched while that one runs on the device, each of
        its sampling sequences ending in a placeholder for the token it will get (read on
        the device from the running step's output, ``StepLauncher.tokens``); then the
        running step's tokens are read and applied. A multi-step launch left running is
        followed by the launch that goes on from it (``_continue``: its rows, each
        decoding its last sample), built from its batch while it runs, when nothing waits
        to be admitted; otherwise it completes first and the next step is scheduled. A
        step is left running for the next call only when nothing in its results can
        change what the following step computes (``StepLauncher.may_overlap``);
        otherwise it completes in this call.
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
            placed = self.launcher.place(prev)
            try:
                nxt = self._launch(prev)
            finally:
                for s in placed:
                    s.tokens.pop()
            finished += self._complete(prev, overlapped=True)
            done.append(prev)
            if nxt is not None and nxt.deferred is not None:
                self.launcher.sample_deferred(nxt)  # its grammars have taken prev's tokens
        else:
            nxt = self._launch(None)
        if nxt is not None:
            self.metrics.overlap_stalls += nxt.stalled
            self.metrics.multi_step_launches += nxt.steps is not None
            self.metrics.overlapped_steps += overlapped
            if self.launcher.may_overlap(nxt, self.faults.isolating):
                self._inflight = nxt
            else:
                finished += self._complete(nxt)
                done.append(nxt)
        self._phase = None
        self.faults.succeeded([w.group for f in done for w in f.all_work() if w.sample])
        self._account(time.perf_counter() - t0, completed=sum(f.iterations for f in done))
        return finished

    def _launch(self, prev: Launched | None) -> Launched | None:
        """Schedules and dispatches a step (without waiting for it); None if there is no
        work. ``prev``: the step still running, whose sampling sequences end in a
        placeholder token (``StepLauncher.place``); the schedule is then speculative."""
        self._phase = "schedule"
        only = self.faults.isolation()
        scheds = []
        for sc in self.schedulers:
            sc.only = only
            scheds.append(sc.schedule(speculative=prev is not None))
        work = [w for sched in scheds for w in sched.work]
        self._step_groups = list({id(w.group): w.group for w in work}.values())
        self.swapper.apply(scheds)
        if not work:
            return None
        steps = self.launcher.multi_steps(scheds, self.faults.isolating)  # None: one step
        drafts = None
        if self.speculator is not None and steps is None:  # proposals to verify
            drafts = self.speculator.draft(self.schedulers, scheds, pending=prev is not None)
        return self.launcher.dispatch(
            [sched.work for sched in scheds],
            self._step_groups,
            ended=self.applier.ended,
            steps=steps,
            prev=prev,
            stalled=any(sched.stalled for sched in scheds),
            drafts=drafts,
        )

    def _continue(self, f: Launched) -> Launched | None:
        """The multi-step launch that goes on from running launch ``f`` before its tokens
        are known (``StepLauncher.plan_continuation``), dispatched; or None."""
        self._phase = "schedule"
        plan = self.launcher.plan_continuation(
            f, self.applier.alive(f.lane), self.applier.ended, self.faults.isolating
        )
        if plan is None:
            return None
        self._step_groups = plan.groups
        return self.launcher.dispatch_continuation(f, plan)

    def _complete(self, f: Launched, *, overlapped: bool = False) -> list[RequestOutput]:
        """Waits for step ``f`` and applies its tokens (``ResultApplier.complete``);
        returns the requests it finished."""
        self._phase = "schedule"  # a fault surfacing here is the step's, as at dispatch
        self._step_groups = f.groups
        finished = self.applier.complete(f, overlapped)
        self.applier.applying = False
        return finished

    # ------------------------------------------------------------------ faults
    def _on_fault(self, error: BaseException) -> None:
        """A step raised: blame a request or suspect some, requeue every unfinished
        request, or stop the engine (``FaultIsolator.on_fault`` decides)."""
        phase, self._phase = self._phase, None
        if self.applier.applying:  # its results were being applied
            phase, self.applier.applying = "apply", False
        groups, self._step_groups = self._step_groups, []
        blamed = self.faults.on_fault(error, phase, groups)
        if blamed is not None:
            self._undelivered.append(self.applier.fail(blamed, error))
        if self.faults.failed is not None:
            return
        try:
            self._rebuild(self.requests.unfinished())
        except BaseException as e:  # noqa: BLE001 (any failure here stops the engine)
            self.faults.failed = e

    def _rebuild(self, requeue: list[Group]) -> None:
        """Fresh block managers, queues and host buffers; ``requeue`` waits to be
        recomputed from its committed tokens. The pool is reallocated only if the failed
        step consumed it (donated buffers); its contents are never read again."""
        for r, sc in enumerate(self.schedulers):  # each request stays on its replica
            sc.reset(self._new_block_manager(), [g for g in requeue if g.replica == r])
        self._inflight = None  # its results are dropped: the requests are recomputed
        self.swapper.clear()
        self.runner.reallocate_if_consumed()

    def reset(self) -> None:
        """Drops every request (no outputs are returned for them), frees every page and
        host buffer, and clears a failed state. Compiled steps are kept."""
        self.requests.clear()
        self.outputs.close_streams()
        self._undelivered.clear()
        self._unstreamed.clear()
        self._new_tokens.clear()
        self._phase = None
        self.applier.applying = False
        self.faults.reset()
        self._rebuild([])

    def _account(self, dt: float, completed: int) -> None:
        # The full recount walks every page of every sequence: sample it (every call while
        # there are few sequences, every 8th beyond), it is statistics, not control.
        self._accounted += 1
        full = sum(sc.bm.num_seqs for sc in self.schedulers) <= 16 or self._accounted % 8 == 1
        record_step(self.metrics, dt, completed, self.schedulers, self.runner.page_size, full=full)
