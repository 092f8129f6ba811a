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
import time
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from paged_jax.batch import bucket
from paged_jax.block_manager import BlockManager, HybridBlockManager, prefix_root_key
from paged_jax.engine._signals import DeferSignals
from paged_jax.engine.faults import (
    FaultIsolation,
)
from paged_jax.engine.launch import _PENDING, Launched, Launching
from paged_jax.engine.loras import Loras
from paged_jax.engine.metrics import EngineMetrics, record_step
from paged_jax.engine.outputs import OutputProcessor, RequestOutput
from paged_jax.engine.request import Group, Seq, Status
from paged_jax.engine.results import ApplyResults
from paged_jax.engine.routing import PrefixRouter
from paged_jax.engine.runner import ModelRunner
from paged_jax.engine.sampling import SamplingParams
from paged_jax.engine.scheduler import Scheduler
from paged_jax.engine.speculative import Speculation, SpeculativeConfig

log = logging.getLogger("paged_jax")


def _keep_scores(scoring: list, scores: tuple) -> None:
    """Stores a step's prompt scores (``ModelRunner.launch``'s ``scored``) with their
    requests: ``scoring`` lists ``(group, positions)``, the rows in order, position t's
    row scoring prompt token t + 1."""
    lp, top_v, top_i = (None if a is None else np.asarray(a) for a in scores)
    j = 0
    for g, ts in scoring:
        k = g.params.prompt_logprobs
        for t in ts:
            g.prompt_lp[t + 1] = float(lp[j])
            if k:
                g.prompt_top[t + 1] = list(
                    zip(top_i[j, :k].tolist(), top_v[j, :k].tolist(), strict=True)
                )
            j += 1


class EngineCore(Launching, ApplyResults, FaultIsolation, Speculation, Loras):
    """Continuous batching of requests on a ``ModelRunner`` (see the module docstring and
    ``LLM``, which builds it and documents every option).

    Args:
      runner: the model, its pool and its compiled step.
      tokenizer: for string prompts and text (None: token ids only).
      block_manager_args: ``BlockManager`` (or, with ``group_windows``,
        ``HybridBlockManager``) arguments of each replica's block manager.
      num_replicas: data-parallel replicas, each with its own scheduler and pool.
      max_num_seqs, max_num_batched_tokens, preemption: each replica's ``Scheduler``'s.
      checked, deterministic, async_scheduling, num_scheduler_steps, speculative,
        max_loras, max_lora_rank: as ``LLM``'s (``speculative`` a ``SpeculativeConfig`` or
        None; ``max_loras`` slots the runner's model holds already).
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
        self.speculative = speculative
        self.proposer = (
            None
            if speculative is None
            else speculative.proposer(
                vocab_size=runner.model.config.vocab_size,
                page_size=runner.page_size,
                num_pages=block_manager_args["num_pages"],
                max_model_len=runner.max_model_len,
                max_step_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                on_compile=runner.compiled_buckets.append,
                mesh=runner.mesh,
            )
        )
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
        # Requests go where their prompt's leading pages were sent before (its prefix
        # hits), within a margin of the least loaded replica (paged_jax.engine.routing)
        self.router = PrefixRouter(
            num_replicas,
            self.page_size,
            slack=max(2, max_num_seqs // 8),
            capacity=num_replicas * block_manager_args["num_pages"],
            enabled=block_manager_args.get("enable_prefix_caching", True),
        )
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
        self._init_loras(max_loras, max_lora_rank)

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
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate: no tokenizer takes it
                raise ValueError(
                    f"prompt: not valid Unicode text (a lone UTF-16 surrogate at character "
                    f"{e.start})"
                ) from None
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

    def check_request(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, *, cache_salt=None
    ) -> list[int]:
        """What ``add_request`` checks of a request against this engine's limits (the
        prompt's tokens and length, ``n`` or ``beam_width`` against ``max_num_seqs``, the
        pages it may need against the pool), without queueing it: ``ValueError`` /
        ``TypeError`` naming what is wrong, else the prompt's token ids. Reads only the
        engine's configuration, so another thread may call it while the engine steps (the
        server does, before it answers)."""
        return self._checked(prompt, params or SamplingParams(), cache_salt)[0]

    def _checked(self, prompt, params: SamplingParams, cache_salt) -> tuple[list[int], int]:
        """``(token ids, sequences)`` of a request that passes ``check_request``."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params: expected SamplingParams, got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise ValueError("params.stop: stop strings need a tokenizer; this engine has none")
        if params.structured is not None:
            if self.tokenizer is None:
                raise ValueError(
                    "params.structured: structured output needs a tokenizer; this engine has none"
                )
            self._grammars().matcher(params.structured)  # refuses a bad schema or grammar
        ids = self.encode(prompt)
        if not ids:
            raise ValueError("prompt: expected at least one token, got an empty prompt")
        vocab = self.model.config.vocab_size
        allowed = params.allowed_token_ids
        if allowed is not None and max(allowed) >= vocab:
            raise ValueError(
                f"params.allowed_token_ids: token ids must lie in [0, {vocab}), got {max(allowed)}"
            )
        if params.logit_bias and params.logit_bias[-1][0] >= vocab:
            raise ValueError(
                f"params.logit_bias: token ids must lie in [0, {vocab}), got "
                f"{params.logit_bias[-1][0]}"
            )
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
        return ids, width

    def add_request(
        self,
        request_id: Hashable,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: Any = None,
        lora: str | None = None,
        adapter: int = 0,
    ) -> None:
        """Queues a request. Raises ValueError on a bad request (nothing is queued).

        ``request_id`` must not belong to an unfinished request; a finished or aborted
        request's id may be used again. ``lora``: the name of a registered LoRA adapter
        (``add_lora``) the request runs with (None: the base model). ``adapter``: for a
        model of your own whose ``__call__`` takes ``adapter_ids``, the index passed with
        every token of the request (0: none). Requests of different adapters never share
        prefix-cache pages.
        """
        self._check_usable()
        params = params or SamplingParams()
        if request_id in self._groups:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if lora is not None:
            if adapter:
                raise ValueError("lora, adapter: give one of them, not both")
            adapter = self._lora_id(lora)
        self._check_adapter(adapter)
        ids, width = self._checked(prompt, params, cache_salt)
        self._arrivals += 1
        g = Group(
            request_id=request_id,
            arrival=self._arrivals,
            prompt=ids,
            params=params,
            seed=params.seed if params.seed is not None else self._arrivals,
            # an adapter's K/V differ from the base model's: its own prefix-cache chain
            salt=cache_salt if adapter == 0 else ("adapter", adapter, cache_salt),
            arrival_time=time.perf_counter(),
            max_len=min(len(ids) + params.max_tokens, self.max_model_len),
            adapter=adapter,
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
            g.matchers[g.seqs[0].seq_id] = self._grammars().matcher(params.structured)
        # where its prefix was sent, else the least loaded replica (deterministic:
        # every process routes alike)
        g.replica = self.router.route(ids, g.salt, self._load)
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
            self._release_draft(s)
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
            if nxt is not None and nxt.deferred is not None:
                self._sample_deferred(nxt)  # its grammars have taken prev's tokens
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
        drafts = None
        if self.proposer is not None and steps is None and prev is None:
            drafts = self._draft(scheds)  # proposals to verify (speculative decoding)
        return self._dispatch(
            [sched.work for sched in scheds],
            steps,
            prev,
            any(sched.stalled for sched in scheds),
            drafts,
        )

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

    def _grammars(self):
        """The engine's grammar compiler (``structured.Grammars``), made on first use."""
        if getattr(self, "_grammar_compiler", None) is None:
            from paged_jax.engine.structured import Grammars

            eos = sorted(self.eos_token_ids)[0] if self.eos_token_ids else None
            vocab = self.model.config.vocab_size
            self._grammar_compiler = Grammars(self.tokenizer, eos, vocab)
        return self._grammar_compiler

    def _may_overlap(self, f: Launched) -> bool:
        """Whether the next step may be scheduled before ``f``'s tokens are known: overlap
        is on, no request is isolated as a suspect, ``f``'s schedule did not stop short
        of a preemption (the next one makes it, from known tokens), and each sampling row
        only appends its token (no beam search, no first token of n samples to fork, no
        penalties, which count the tokens so far), and speculation is off (the next
        step's proposals follow this step's tokens). A grammar's row may overlap: the
        next step's model call goes before its mask is known, its sampling after
        (``_sample_deferred``). A multi-step launch, when one of its
        rows has tokens left after it (the next launch goes on from it, ``_continue``);
        the launch that follows a single step may start from its placeholders
        (``_multi_steps``)."""
        if not self.async_scheduling or self._suspects or f.stalled or self.proposer:
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
        toks, lps, cand_v, cand_i, scores = f.outputs
        if f.steps is not None:  # i32[S_b, 2 K]: the tokens, then the log-probs' bits
            both = np.asarray(toks)
            K = both.shape[1] // 2
            toks, lps = both[:, :K], both[:, K:].view(np.float32)
        else:
            toks, lps = np.asarray(toks), np.asarray(lps)
        cand = None if cand_v is None else (np.asarray(cand_v), np.asarray(cand_i))
        t2 = time.perf_counter()
        self.metrics.step_s += f.dispatch_s + t2 - t1
        self.metrics.dispatch_s += f.dispatch_s
        self.metrics.wait_s += t2 - t1
        self.metrics.tokens_computed += f.num_tokens
        before = self.metrics.tokens_generated
        finished = self._apply(f, toks, lps, cand, scores, overlapped, t2)
        if f.compiled:  # its tokens came with the compile's time, not the running's
            self.metrics.compile_tokens += self.metrics.tokens_generated - before
        return finished

    def _apply(self, f: Launched, toks, lps, cand, scores, overlapped: bool, t2: float):
        """``_complete``'s second half: step ``f``'s tokens (host arrays) applied."""
        if f.steps is not None:
            return self._apply_steps(f, toks, lps, t2)
        if f.scoring:  # before _process, which may finish (and output) their requests
            _keep_scores(f.scoring, scores)
        live = [(i, w) for i, w in f.placed if w.seq.finish_reason is None]
        emit, computed = self._accept_drafts(f, live, toks, lps) if f.spec else (None, {})
        if not overlapped:  # (overlapped: _place marked them)
            for i, w in live:
                self._bm(w.group).mark_computed(w.seq.seq_id, computed.get(i, w.stop))
        self._phase = "apply"
        finished = self._process(live, toks, lps, cand, t2, emit)
        if overlapped:  # the next step appended placeholders for these tokens
            for _, w in live:
                s = w.seq
                if w.sample and s.finish_reason is None:
                    bm = self._bm(w.group)
                    k = len(s.tokens) - 1
                    if s.seq_id in bm and bm.num_tokens(s.seq_id) > k:
                        bm.set_token(s.seq_id, k, s.tokens[k])
        return finished

    # ------------------------------------------------------------------ swaps, accounting
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
