"""``LLM``: continuous batching on the paged cache, with sampling, n-way samples and beam
search on copy-on-write pages, prefix caching and preemption by swap or recompute."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import operator
import os
import time
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from paged_jax import linear as paged_linear
from paged_jax._validation import validate_batch
from paged_jax.batch import ScheduledSeq, advance_batch, bucket, build_batch, concat_batches
from paged_jax.block_manager import BlockManager, HybridBlockManager, SeqRows, prefix_root_key
from paged_jax.engine import compile_cache
from paged_jax.engine._signals import DeferSignals
from paged_jax.engine.multistep import decode_loop
from paged_jax.engine.protocol import check_model
from paged_jax.engine.sampling import Penalties, SamplingParams, beam_candidates, sample_rows
from paged_jax.engine.scheduler import Group, Scheduler, Seq, Status, TokenLog, Work
from paged_jax.invariant import rowwise
from paged_jax.metadata import AttentionMetadata, decode_only
from paged_jax.sharding import (
    DATA_AXIS,
    TENSOR_AXIS,
    create_cache,
    kv_head_replicas,
    parallel_mesh,
    per_replica,
)
from paged_jax.sharding import data_parallel_size as data_parallel_size_of
from paged_jax.sharding import tensor_parallel_size as tensor_parallel_size_of


@dataclasses.dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    cumulative_logprob: float
    logprobs: list[float] | None


@dataclasses.dataclass
class StreamOutput:
    """New text of one sample (``LLM.stream``): ``index`` is the prompt's position,
    ``sample`` the sample's; ``finish_reason`` is set on its last piece."""

    index: int
    sample: int
    text: str
    finished: bool = False
    finish_reason: str | None = None
    output: RequestOutput | None = None  # the request's whole output, on its last piece


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served by the prefix cache (summed over preemptions)
    num_generated_tokens: int
    num_preemptions: int

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclasses.dataclass
class RequestOutput:
    request_id: Hashable
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None  # set when the engine failed the request (finish_reason "error")


@dataclasses.dataclass
class EngineMetrics:
    steps: int = 0  # device steps completed (a step() call completes 0 to 2)
    elapsed_s: float = 0.0
    # Dispatching the jitted step and waiting for its results (device work not hidden
    # behind host work), compiling calls excluded.
    step_s: float = 0.0
    compile_s: float = 0.0  # calls of the jitted step that compiled a new shape bucket
    # Scheduling, block manager, batch building, sampling bookkeeping: with overlapped
    # steps (async_scheduling) mostly while the device runs the previous step.
    host_s: float = 0.0
    overlapped_steps: int = 0  # steps dispatched while the previous one still ran
    multi_step_launches: int = 0  # launches of several decode steps (num_scheduler_steps)
    # Overlapped schedules that stopped where a decode needed a page none had: the step
    # after completes first, and its schedule preempts if pages are still short.
    overlap_stalls: int = 0
    tokens_computed: int = 0  # prompt + generated tokens run through the model
    tokens_generated: int = 0
    requests_finished: int = 0
    ttft_sum_s: float = 0.0
    kv_utilization_sum: float = 0.0
    kv_samples: int = 0
    max_pages_used: int = 0
    max_pages_shared: int = 0
    preemptions_swap: int = 0
    preemptions_recompute: int = 0
    prefix_hit_rate: float = 0.0
    compilations: int = 0
    failed_steps: int = 0  # steps that raised; their requests were requeued (recomputed)
    requests_failed: int = 0  # requests the engine ended with finish_reason "error"

    def summary(self) -> dict[str, float]:
        return {
            "requests": self.requests_finished,
            "generated tokens": self.tokens_generated,
            "tokens/s (generated)": self.tokens_generated / max(self.elapsed_s, 1e-9),
            "tokens/s (computed)": self.tokens_computed / max(self.elapsed_s, 1e-9),
            "requests/s": self.requests_finished / max(self.elapsed_s, 1e-9),
            "mean TTFT (s)": self.ttft_sum_s / max(self.requests_finished, 1),
            "steps": self.steps,
            "host share of step time": self.host_s / max(self.host_s + self.step_s, 1e-9),
            "mean KV utilization": self.kv_utilization_sum / max(self.kv_samples, 1),
            "max pages used": self.max_pages_used,
            "max pages shared": self.max_pages_shared,
            "prefix hit rate": self.prefix_hit_rate,
            "preemptions (swap)": self.preemptions_swap,
            "preemptions (recompute)": self.preemptions_recompute,
            "compilations": self.compilations,
            "compile time (s)": self.compile_s,
            "failed steps (recovered)": self.failed_steps,
            "failed requests": self.requests_failed,
        }


class EngineFailedError(RuntimeError):
    """The engine stopped in a step it could not recover from; see ``LLM.reset``."""


# A step that raises this many times in a row (each time after requeueing its requests)
# with no request to blame stops the engine instead of failing forever.
MAX_CONSECUTIVE_FAILED_STEPS = 3
# A request is failed (finish_reason "error") once this many steps in a row raised while
# it ran as the only suspect (see LLM: isolating a fault).
STRIKES_TO_FAIL_A_REQUEST = 2

log = logging.getLogger("paged_jax")
CHECKED_ENV = "PAGED_JAX_CHECKED"


class LLM:
    """Generates from a decoder with continuous batching on a paged KV cache.

    Args:
      model: an NNX decoder following ``paged_jax.engine.PagedDecoder``
        (``__call__(tokens, positions, cache, metadata) -> (logits, cache)``,
        ``make_cache``, ``config``), such as ``paged_jax.models.LlamaForCausalLM``. Names
        ("tiny-llama", a checkpoint directory) become models in the model layer:
        ``model, tokenizer = paged_jax.models.load(name)``. A model on CPU without a
        mesh that has ``hold_for_cpu`` gets it called, in place: its linear weights and
        a tied embedding table packed for the C matrix-product kernel where the CPU
        kernels built (``paged_jax.linear``), else its layers' linear weights held per
        layer and a tied table ``[E, V]``, the layouts XLA:CPU reads fastest. A model on
        a GPU or TPU without a mesh that has ``hold_for_accelerator`` gets that called
        instead: per-layer weights and an unrolled layer loop, each weight read once
        per step.
      tokenizer: object with ``encode(str)`` / ``decode(ids)``; None: prompts are
        token ids and outputs have no text.
      num_pages: pages in the pool (of all data-parallel replicas together: each has
        ``num_pages / data_parallel_size``); None sizes it from ``kv_cache_bytes``.
      kv_cache_bytes: memory budget of the pool when ``num_pages`` is None (default: what a
        full batch at the longest context could use, at most half the accelerator's free
        memory, or on CPU a quarter of the available memory and 4 GiB).
      page_size: tokens per page.
      max_num_seqs: sequences per step at most (per data-parallel replica).
      max_num_batched_tokens: tokens per step at most (decode tokens + prefill chunks;
        per data-parallel replica).
      enable_prefix_caching: share full prompt pages across requests.
      preemption: "recompute" (free pages, prefill again later) or "swap" (to host).
      num_host_pages: host page slots for swapping (default: as many as the pool; split
        evenly among data-parallel replicas).
      watermark: fraction of pages kept back from admissions.
      cache_dtype: KV cache dtype (default: the model's compute dtype).
      checked: validate every step's arrays on the host before the device call
        (``paged_jax.validate_batch``: page ids, lengths, positions, slots, token ids);
        a failure raises ``ValueError`` as a failed step. Default: the environment
        variable ``PAGED_JAX_CHECKED`` ("1" turns it on). For debugging; it costs host
        time every step.
      deterministic: batch-invariant steps. A request's tokens and log-probs (greedy or
        seeded) are then bitwise the same whatever it is batched with, for every cache
        dtype: row-wise model work runs on fixed tiles of rows and attention with fixed
        KV blocks (``AttentionMetadata.batch_invariant``). Slower; see the README.
      compilation_cache: where compiled steps are kept across processes (JAX's
        persistent compilation cache): a directory, True for the default one
        (``<user cache dir>/paged-jax/xla``), False for none. Default: the environment
        variable ``PAGED_JAX_COMPILATION_CACHE`` (a directory, or ``0`` for none), else
        the default directory. The directory in use is ``compilation_cache_dir``
        (None when off). See ``paged_jax.engine.compile_cache``.
      tensor_parallel_size: devices to split the model and the KV cache over
        (Megatron-style tensor parallelism; the cache along KV heads, see
        ``paged_jax.sharding``).
      data_parallel_size: replicas of the model, each with its own pool, block manager
        and scheduler; a request goes to the replica with the fewest unfinished
        sequences (ties: the lowest index). Every step runs all replicas in one jitted
        call over the mesh, each replica's batch on its own devices (no Python loop
        over replicas on the device side). The mesh of ``tensor_parallel_size`` and
        ``data_parallel_size`` is ``paged_jax.parallel_mesh(tp, dp)``, over the first
        ``dp * tp`` of ``jax.devices()`` (of every process): replica r on devices
        ``[r tp, (r + 1) tp)``. A model off that mesh is moved there with its
        ``shard(mesh)``; to place the weights straight into their shards instead, load
        it with ``paged_jax.models.load(name, mesh=mesh)`` and pass ``mesh=mesh`` here.
      mesh: a ``jax.sharding.Mesh`` with a ``"tp"`` and/or a ``"dp"`` axis (any other
        axis of size 1), in place of ``tensor_parallel_size`` and
        ``data_parallel_size``.
      hybrid_kv_cache: for a model with sliding-window layers (Gemma 2 and 3, Mistral),
        a pool of layer groups whose sliding groups free their pages once the window has
        passed them (``PagedKVCache.create(layer_windows=)``, ``HybridBlockManager``):
        sliding layers then hold about a window of pages per sequence. None (default):
        on for such models with one data-parallel replica; True: on (refused with
        several replicas); False: off. Ignored for models without sliding layers or whose
        ``make_cache`` takes no ``hybrid`` argument.
      async_scheduling: overlapped steps (default on). While the device runs a step, the
        host schedules, builds and dispatches the next one, its decode tokens read on the
        device from the running step's output, and only then applies the running step's
        tokens; the host's work per step is then hidden behind the device's instead of
        added to it. A sequence that finishes (a stop token, a stop string) has computed
        one more token by then, which is dropped; a step with a beam-search row, the
        first token of ``n`` samples or penalties completes before the next is
        scheduled. Outputs are the same either way; ``step()`` then returns the requests
        finished by the step launched in the call before. False: every step completes
        within its ``step()`` call.
      num_scheduler_steps: decode steps per launch (multi-step decoding, default 1). With
        ``K > 1``, a step whose every sequence decodes one token (no beams, penalties or
        first token of ``n`` samples) while no request waits to be admitted runs ``K``
        decode steps in one jitted call: the host schedules, builds and applies once per
        ``K`` tokens of each sequence (``paged_jax.engine.multistep``). Outputs are those
        of single steps; a sequence that stops early (a stop token or string) has
        computed up to ``K - 1`` more tokens, which are dropped. For throughput where
        host and device share cores (CPU); a request arriving meanwhile waits for the
        launch to end (up to ``K`` steps) before its prompt runs.

    Several processes (``jax.distributed.initialize``, one mesh over all their devices)
    each run this same engine on the same requests in the same order: the scheduler is
    deterministic, so every process makes the same steps. Only process 0 returns outputs
    from ``generate`` and prints progress (the others get ``[]``); ``preemption="swap"``
    needs a single process.

    A step is all or nothing. Python signal handlers (Ctrl-C, timers) are held while a
    step runs and called when it ends, so they never interrupt it halfway (a second
    Ctrl-C does: the step then fails). When a step raises anyway (a fault in the device
    call, out of memory, a second Ctrl-C), the exception propagates after the engine has
    put every unfinished request back in the queue to be recomputed from its tokens so
    far: nothing is lost and later tokens are those of an uninterrupted run (greedy and
    seeded sampling are keyed by seed and position).

    A fault one request causes (an ``Exception``, not an interrupt) does not stall the
    others: the requests of the failed step become suspects, and each in turn runs with
    only the requests already cleared, until it has sampled a token. A suspect is failed
    when ``STRIKES_TO_FAIL_A_REQUEST`` such steps in a row raise (one if it was alone in
    the first failed step): its output (``finish_reason`` "error", ``RequestOutput.error``
    the exception) comes with the next step, and the rest go on. A one-off fault fails
    nobody. Only a fault while a step's results are being applied, or
    ``MAX_CONSECUTIVE_FAILED_STEPS`` failed steps in a row that no request explains, stop
    the engine: every later call then raises ``EngineFailedError`` until ``reset()``.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        num_pages: int | None = None,
        kv_cache_bytes: int | None = None,
        page_size: int = 16,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        enable_prefix_caching: bool = True,
        preemption: str = "recompute",
        num_host_pages: int | None = None,
        watermark: float = 0.01,
        cache_dtype: Any = None,
        checked: bool | None = None,
        deterministic: bool = False,
        compilation_cache: bool | str | os.PathLike | None = None,
        tensor_parallel_size: int | None = None,
        data_parallel_size: int | None = None,
        mesh: Any = None,
        hybrid_kv_cache: bool | None = None,
        async_scheduling: bool = True,
        num_scheduler_steps: int = 1,
    ):
        self.compilation_cache_dir = compile_cache.enable(compilation_cache)
        self.mesh = _resolve_mesh(tensor_parallel_size, data_parallel_size, mesh)
        tp = tensor_parallel_size_of(self.mesh) if self.mesh is not None else 1
        dp = data_parallel_size_of(self.mesh) if self.mesh is not None else 1
        self.is_main_process = jax.process_index() == 0
        if preemption == "swap" and jax.process_count() > 1:
            raise ValueError(
                f"preemption: 'swap' needs a single process, this program has "
                f"{jax.process_count()} (use 'recompute')"
            )
        if checked is None:
            checked = os.environ.get(CHECKED_ENV, "") not in ("", "0")
        if not isinstance(checked, bool):
            raise TypeError(f"checked: expected a bool or None, got {checked!r}")
        self.checked = checked
        if not isinstance(deterministic, bool):
            raise TypeError(f"deterministic: expected a bool, got {deterministic!r}")
        self.deterministic = deterministic
        if not isinstance(async_scheduling, bool):
            raise TypeError(f"async_scheduling: expected a bool, got {async_scheduling!r}")
        self.async_scheduling = async_scheduling
        if (
            isinstance(num_scheduler_steps, bool)
            or not isinstance(num_scheduler_steps, int)
            or num_scheduler_steps < 1
        ):
            raise ValueError(
                f"num_scheduler_steps: expected an int >= 1, got {num_scheduler_steps!r}"
            )
        self.num_scheduler_steps = num_scheduler_steps
        if preemption not in ("recompute", "swap"):
            raise ValueError(f"preemption: expected 'recompute' or 'swap', got {preemption!r}")
        for name, v in (
            ("page_size", page_size),
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
        ):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        check_model(model)
        if self.mesh is not None and not _on_mesh(model, self.mesh):
            if not callable(getattr(model, "shard", None)):
                raise TypeError(
                    "model: tensor parallelism needs a model with shard(mesh) (placing its "
                    f"weights on the mesh), {type(model).__name__} has none"
                )
            model = model.shard(self.mesh)
        if self.mesh is None and _on_cpu(model) and hasattr(model, "hold_for_cpu"):
            # packed for the C kernels where they built, else XLA:CPU's fastest layouts
            model = model.hold_for_cpu()
        elif self.mesh is None and not _on_cpu(model) and hasattr(model, "hold_for_accelerator"):
            # each weight read where it lies, once per step (no copies out of a stack)
            model = model.hold_for_accelerator()
        self.model = model
        self.tokenizer = tokenizer
        cfg = self.model.config
        self.max_model_len = cfg.max_position_embeddings
        self.eos_token_ids = set(getattr(cfg, "eos_token_ids", ()))
        if hybrid_kv_cache not in (None, True, False):
            raise TypeError(f"hybrid_kv_cache: expected a bool or None, got {hybrid_kv_cache!r}")
        if hybrid_kv_cache and dp > 1:
            raise ValueError(
                f"hybrid_kv_cache: not supported with data_parallel_size={dp} yet; use "
                "hybrid_kv_cache=False (or None: on only where supported)"
            )
        hybrid = hybrid_kv_cache is not False and dp == 1
        self._cache_kw = (
            {"hybrid": True}
            if hybrid and "hybrid" in inspect.signature(self.model.make_cache).parameters
            else {}
        )
        probe = self.model.make_cache(2, page_size, cache_dtype, **self._cache_kw)
        self.hybrid_kv_cache = probe.layer_groups is not None
        # Bytes of a token across the mesh (KV heads repeated when tp exceeds them), and
        # the devices whose memory holds the pool (fake CPU devices share the host's).
        token_bytes = probe.bytes_per_token * kv_head_replicas(probe.num_kv_heads, tp)
        spread = tp * dp if jax.default_backend() != "cpu" else 1
        if num_pages is None:
            per_page = page_size * token_bytes
            pages_per_seq = probe.num_groups * -(-self.max_model_len // page_size)
            most_useful = dp * (max_num_seqs * pages_per_seq + 1) * per_page
            budget = kv_cache_bytes or spread * _default_budget(most_useful // spread)
            num_pages = max(2, budget // per_page // dp) * dp
            if jax.process_count() > 1:  # free memory differs: every process takes 0's
                from jax.experimental import multihost_utils

                num_pages = int(multihost_utils.broadcast_one_to_all(np.int64(num_pages)))
        elif (
            isinstance(num_pages, bool)
            or not isinstance(num_pages, int)
            or num_pages < 2 * dp
            or num_pages % dp
        ):
            each = (
                f", a multiple of data_parallel_size={dp} (each replica's pool has its own)"
                if dp > 1
                else ""
            )
            raise ValueError(
                f"num_pages: expected an int >= {2 * dp} (page 0 is null){each}, got {num_pages!r}"
            )
        self.page_size = page_size
        self._cache_dtype = cache_dtype
        need = num_pages * page_size * token_bytes // spread
        free, where = _free_memory()
        if free is not None and need > free:
            raise ValueError(
                f"num_pages: {num_pages} pages of {page_size} tokens need {_gib(need)} of KV "
                f"cache, {where} has {_gib(free)} free; lower num_pages or kv_cache_bytes"
            )
        try:
            self.cache = self._make_cache(num_pages)
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            raise ValueError(
                f"num_pages: {num_pages} pages of {page_size} tokens need {_gib(need)} of KV "
                f"cache, more than {where} could allocate; lower num_pages or kv_cache_bytes"
            ) from None
        self._bm_args = dict(
            num_pages=num_pages // dp,
            page_size=page_size,
            enable_prefix_caching=enable_prefix_caching,
            watermark=watermark,
            num_host_pages=(num_pages if num_host_pages is None else num_host_pages) // dp,
        )
        if self.hybrid_kv_cache:
            self._bm_args["group_windows"] = probe.layer_groups[0]
        # One block manager and scheduler per data-parallel replica (page ids local to
        # its pool); `bm` and `scheduler` name the only one when there is one.
        self.schedulers = [
            Scheduler(
                self._new_block_manager(),
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                preemption=preemption,
            )
            for _ in range(dp)
        ]
        self._load = [0] * dp  # unfinished sequences routed to each replica
        self.metrics = EngineMetrics()
        self.compiled_buckets: list[dict] = []  # shape buckets this engine compiled
        self._shapes_seen: set[tuple] = set()  # step shapes this engine has run
        self._announce = None  # generate()'s progress bar: told before a new shape runs
        self._warm_ups = 0
        self._groups: dict[Hashable, Group] = {}
        self._arrivals = 0
        # swapped pages, by (replica, host slot)
        self._host: dict[tuple[int, int], tuple[np.ndarray, np.ndarray | None]] = {}
        self._failed: BaseException | None = None  # set when a step could not be undone
        self._phase: str | None = None  # where the running step is ("apply": results)
        self._consecutive_faults = 0
        self._undelivered: list[RequestOutput] = []  # finished, not yet returned
        self._step_groups: list[Group] = []  # the running step's groups
        self._inflight: _Launched | None = None  # a step left running (async_scheduling)
        self._accounted = 0  # step calls accounted (metrics)
        self._suspects: list[Group] = []  # groups of a failed step, not yet cleared
        self._ended = 0  # sequences given a finish reason so far (_Lane.ended)
        self._cleared: set[int] = set()  # arrivals of suspects that since sampled a token
        from flax import nnx

        self._graphdef, state = nnx.split(self.model)
        # The weights as a flat tuple of arrays: the jitted step takes them so, since
        # flattening an nnx.State in Python at every call cost 50-70 us of a 2-core
        # CPU's time per launch (tiny-llama, 256 sequences, multi-step launches).
        weights, self._state_def = jax.tree.flatten(state)
        self._weights = tuple(weights)
        # Small steps (decode at light load) on CPU compile with XLA's own dots instead
        # of YNNPACK's fusions (see _small_step_options); not in deterministic mode,
        # where every bucket must take the same path.
        options = None if deterministic else _small_step_options()
        self._run = _Step(
            _make_run(self._graphdef, self._state_def, self.mesh),
            None
            if options is None
            else _make_run(self._graphdef, self._state_def, self.mesh, options),
        )

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

    def _make_cache(self, num_pages: int):
        """An empty pool, on the mesh in its shards if there is one."""
        make = functools.partial(
            self.model.make_cache, num_pages, self.page_size, self._cache_dtype, **self._cache_kw
        )
        return make() if self.mesh is None else create_cache(make, self.mesh)

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
        return None if self.tokenizer is None else self.tokenizer.decode(list(ids))

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
        done: list[_Launched] = []
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

    def _launch(self, prev: _Launched | None) -> _Launched | None:
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
        prev: _Launched | None,
        stalled,
    ) -> _Launched:
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
        with _mesh_context(self.mesh):
            tokens = self._tokens(batch, placed, prev, pending)
        lane = (
            None
            if steps is None
            else _Lane.of(work, steps, self.eos_token_ids, self.bm, self._ended)
        )
        replicas = len(batches)
        return self._send(
            work, placed, stalled, batch, tokens, sampling, penalties, num_cand, replicas, lane
        )

    def _run_batch(self, lane: _Lane, prev: _Launched, batch, rows, advance) -> _Launched:
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
            with _mesh_context(self.mesh):  # (columns < K of prev's output: its tokens)
                tokens = _merge_tokens(prev.outputs[0], src, col, batch.token_ids)
        return self._send(None, None, False, batch, tokens, tuple(sampling), None, 0, 1, lane)

    def _send(
        self, work, placed, stalled, batch, tokens, sampling, penalties, num_cand, replicas, lane
    ) -> _Launched:
        """Dispatches the jitted step (or, with its rows' ``lane``, a multi-step launch) on
        ``batch`` with input ``tokens`` and the rows' ``sampling`` arrays (temperature,
        top-k, top-p, min-p, seeds, output positions); returns it running."""
        steps = None if lane is None else lane.steps.tolist()
        K = 1 if steps is None else self.num_scheduler_steps
        S_b = batch.kv_lens.shape[0]
        temp = sampling[0]
        shape = (batch.token_ids.shape[0], S_b, batch.page_indices.shape[-1], num_cand, K)
        if self._announce is not None and shape not in self._shapes_seen:
            self._announce(
                f"{shape[0]} tokens x {S_b} sequences x {shape[2]} pages (once per shape)"
                + (f", {replicas} replicas" if replicas > 1 else "")
                + (f", {K} steps a launch" if K > 1 else "")
            )
        self._shapes_seen.add(shape)
        compiled_before = self._run._cache_size()
        t1 = time.perf_counter()
        inputs, layout = _pack_inputs(
            batch,
            sampling,
            None if lane is None else _padded(lane.steps, S_b),
        )
        with _mesh_context(self.mesh):
            toks, lps, cand_v, cand_i, last, self.cache = self._run(
                self._weights,
                tokens,
                inputs,
                self.cache,
                penalties,
                layout=layout,
                decode_only=decode_only(batch) and not self.deterministic,
                batch_invariant=self.deterministic,
                num_candidates=num_cand,
                num_steps=K,
                # No row samples: an argmax is all (deterministic mode: one path for
                # every row, so a greedy row's log-prob is the same in any batch).
                greedy_only=not (temp > 0).any() and not self.deterministic,
            )
        dispatch_s = time.perf_counter() - t1
        compiled = self._run._cache_size() > compiled_before  # compiled a new shape
        if compiled:
            self.metrics.compile_s += dispatch_s
            self.metrics.compilations += 1
            self._compiled(batch, num_cand, dispatch_s, K)
        return _Launched(
            work=work if lane is None else None,
            placed=placed if lane is None else None,
            groups=self._step_groups,
            num_tokens=batch.num_tokens if steps is None else sum(steps),
            outputs=(toks, lps, cand_v, cand_i),
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

    def _multi_steps(self, scheds, prev: _Launched | None) -> list[int] | None:
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

    def _continue(self, f: _Launched) -> _Launched | None:
        """The multi-step launch that goes on from running launch ``f`` before its tokens
        are known (overlapped steps), or None. Each row of ``f`` that has tokens left to
        sample decodes ``f``'s last sample (read on the device) and up to K - 1 more; the
        slots for all of them are reserved, and ``f``'s last samples are filled in with its
        other tokens (``f.carried``). Only while multi-step decoding may run
        (``_multi_step_ready``: nothing waits to be admitted) and ``f`` ran every running
        sequence; None also when the pages are not free (the next step is scheduled once
        ``f``'s tokens are known). Runs for every launch of a steady decode: the rows are
        handled as whole arrays (``_Lane``)."""
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

    def _tokens(self, batch, placed, prev: _Launched | None, pending: int):
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
        return _merge_tokens(prev.outputs[0], src, np.zeros_like(src), batch.token_ids)

    def _place(self, f: _Launched) -> list[Seq]:
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

    def _may_overlap(self, f: _Launched) -> bool:
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

    def _complete(self, f: _Launched, *, overlapped: bool = False) -> list[RequestOutput]:
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

    def _compiled(self, batch, num_candidates: int, seconds: float, num_steps: int = 1) -> None:
        """Records (and logs at INFO) the shape bucket a step just compiled."""
        b = dict(
            tokens=int(batch.token_ids.shape[0]),
            seqs=int(batch.kv_lens.shape[0]),
            pages_per_seq=int(batch.page_indices.shape[-1]),
            copies=int(batch.copy_src.shape[0]),
            beam_candidates=num_candidates,
            seconds=round(seconds, 2),
        )
        if num_steps > 1:
            b["steps"] = num_steps
        self.compiled_buckets.append(b)
        log.info("compiled a step bucket in %.1f s: %s", seconds, _describe(b))

    def warm_up(
        self,
        num_seqs: int,
        prompt_len: int,
        max_tokens: int,
        *,
        sampling_params: SamplingParams | None = None,
        progress: bool = True,
    ) -> list[dict]:
        """Compiles, before real work, the steps a workload of ``num_seqs`` prompts of
        ``prompt_len`` tokens generating ``max_tokens`` each will need.

        It runs that workload once on random token ids (``ignore_eos``: every sequence
        runs to ``max_tokens``), so it compiles exactly the shape buckets the scheduler
        picks for it: every prefill chunk size, batch size and block-table width on the
        way. ``sampling_params`` (default greedy) matters: sampled rows, penalties and
        beams compile steps of their own. Prints one line per bucket compiled when
        ``progress`` (and logs it at INFO to the "paged_jax" logger either way); with the
        persistent compilation cache on, a later process loads these instead.

        Returns the buckets compiled (dicts: ``tokens``, ``seqs``, ``pages_per_seq``,
        ``copies``, ``beam_candidates``, ``seconds``, and ``steps`` for a multi-step
        launch's, see ``num_scheduler_steps``); buckets compiled before are not
        compiled again. The engine's metrics are reset afterwards, and the warm-up
        prompts do not stay in the prefix cache's way (their pages are ordinary LRU
        pages, evicted first when memory runs short).
        """
        for name, v in (
            ("num_seqs", num_seqs),
            ("prompt_len", prompt_len),
            ("max_tokens", max_tokens),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        if prompt_len + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt_len + max_tokens: expected <= max_model_len {self.max_model_len}, "
                f"got {prompt_len} + {max_tokens}"
            )
        p = sampling_params or SamplingParams(temperature=0.0)
        p = dataclasses.replace(p, max_tokens=max_tokens, ignore_eos=True, stop_token_ids=())
        rng = np.random.default_rng(0)
        vocab = self.model.config.vocab_size
        prompts = [rng.integers(0, vocab, prompt_len).tolist() for _ in range(num_seqs)]
        before = len(self.compiled_buckets)
        echo = logging.StreamHandler() if progress else None
        if echo is not None:
            echo.setFormatter(logging.Formatter("warm-up: %(message)s"))
            log.addHandler(echo)
            old_level = log.level
            log.setLevel(min(old_level or logging.WARNING, logging.INFO))
        try:
            # A salt of its own: no page shared with real requests or an earlier warm-up
            # (a prefix hit would shorten the prefill and compile other buckets).
            self._warm_ups += 1
            self.generate(prompts, p, progress=False, cache_salt=("warm-up", self._warm_ups))
        finally:
            if echo is not None:
                log.removeHandler(echo)
                log.setLevel(old_level)
        self.metrics = EngineMetrics()
        return self.compiled_buckets[before:]

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
        if any(x.is_deleted() for x in jax.tree.leaves(self.cache)):
            self.cache = self._make_cache(self._bm_args["num_pages"] * len(self.schedulers))

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
        return Penalties(*(jnp.asarray(a) for a in (rep, pres, freq, out, prompt)))

    def _process(self, placed, toks, lps, cand, now) -> list[RequestOutput]:
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
                self._fork_samples(g, items[0], toks, lps)
            else:
                for i, w in items:
                    self._append(g, w.seq, first_toks[i], first_lps[i])
            if not g.seqs:
                finished.append(self._finish(g))
        return finished

    def _append(self, g: Group, s: Seq, token: int, logprob: float) -> None:
        """Adds a sampled token to ``s``; finishes ``s`` on a stop condition."""
        p = g.params
        tokens = s.tokens
        tokens.append(token)
        s.cum_logprob += logprob
        if p.logprobs:
            s.logprobs.append(logprob)
        self.metrics.tokens_generated += 1
        reason = None
        n = len(tokens)
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            reason = "stop"
        elif p.stop and self._cut_at_stop_string(s, p):
            reason = "stop"
        elif n - s.prompt_len >= p.max_tokens or n >= self.max_model_len:
            reason = "length"
        if reason:
            self._end(g, s, reason)

    def _end(self, g: Group, s: Seq, reason: str) -> None:
        s.finish_reason = reason
        self._ended += 1
        self._bm(g).free(s.seq_id)
        g.seqs.remove(s)
        g.done.append(s)

    def _alive(self, lane: _Lane) -> np.ndarray | None:
        """``bool[L]``: which of the lane's rows have not finished, or None when none has
        (no sequence got a finish reason since the lane was built: ``_Lane.ended``)."""
        if lane.ended == self._ended:
            return None
        return np.fromiter((s.finish_reason is None for s in lane.seqs), bool, len(lane.seqs))

    def _apply_steps(self, f: _Launched, toks, lps, now: float) -> list[RequestOutput]:
        """Applies a multi-step launch (``toks``, ``lps``: ``[S_b, K]``): each row's
        reserved tokens get their sampled values and count as computed, then its samples
        are appended, up to the first that stops it (the rest are dropped).

        The rows are checked as whole arrays (``f.lane``): a row with no stop token among
        its samples and no stop string or log-probs to keep (the common case) only has its
        samples and log-prob sum added to the lane's ``TokenLog`` (its sequence reads them
        when its tokens are read), and ends if it reached its length; the others go
        through ``_extend``."""
        lane = f.lane
        alive = self._alive(lane)
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
        self._phase = "apply"
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
            self._end(groups[j], seqs[j], "length")
        finished = []
        if ended.any() or exact.any():
            for g in {id(g): g for g in groups}.values():
                if not g.seqs:
                    finished.append(self._finish(g))
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
            self._end(g, s, reason)

    def _cut_at_stop_string(self, s: Seq, p: SamplingParams) -> bool:
        """Whether ``s``'s text now contains one of ``p.stop``; if so ``s.stop_text`` is the
        text up to the earliest one (and through it with ``include_stop_str_in_output``).
        Only the text a new token can have completed is searched."""
        text = self.decode(s.output)
        longest = max(map(len, p.stop))
        before = len(self.decode(s.output[:-1])) if len(s.output) > 1 else 0
        start = max(before - longest + 1, 0)
        hits = [(i, x) for x in p.stop if (i := text.find(x, start)) >= 0]
        if not hits:
            return False
        i, x = min(hits)
        s.stop_text = text[: i + len(x)] if p.include_stop_str_in_output else text[:i]
        return True

    def _fork_samples(self, g: Group, item, toks, lps) -> None:
        """The prompt's logits give n tokens: n - 1 forks share every prompt page."""
        i, w = item
        parent = w.seq
        g.forked = True
        children = []
        for j in range(1, g.params.n):
            sid = g.new_seq_id()
            self._bm(g).fork(parent.seq_id, sid)
            child = Seq(sid, list(parent.tokens), parent.prompt_len, j)
            g.seqs.append(child)
            children.append((child, j))
        for s, j in [(parent, 0), *children]:
            self._append(g, s, int(toks[i, j]), float(lps[i, j]))

    def _beam_step(self, g: Group, items, cand) -> None:
        """Keeps the best ``beam_width`` continuations; forks/frees beams on shared pages."""
        p = g.params
        vals, ids = cand
        candidates = []  # (score, parent order, rank, parent seq, token, logprob)
        for order, (i, w) in enumerate(items):
            for rank in range(2 * p.beam_width):
                lp = float(vals[i, rank])
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
        if len(s.output) >= g.params.max_tokens or len(s.tokens) >= self.max_model_len:
            s.finish_reason = "length"
            self._ended += 1
            self._bm(g).free(s.seq_id)
            g.seqs.remove(s)
            g.done.append(s)

    def _finish(self, g: Group) -> RequestOutput:
        g.status = Status.FINISHED
        g.finish_time = time.perf_counter()
        self.schedulers[g.replica].remove(g)
        self._load[g.replica] -= g.params.beam_width if g.params.use_beam_search else g.params.n
        self._groups.pop(g.request_id, None)  # the id may be used again
        self.metrics.requests_finished += 1
        if g.first_token_time is not None:
            self.metrics.ttft_sum_s += g.first_token_time - g.arrival_time
        return self._output(g)

    def _output(self, g: Group) -> RequestOutput:
        p = g.params
        seqs = list(g.done) + list(g.seqs)
        if p.use_beam_search:
            seqs.sort(key=lambda s: -s.cum_logprob / max(len(s.output), 1) ** p.length_penalty)
            seqs = seqs[: p.n]
        else:
            seqs.sort(key=lambda s: s.sample_index)
        outs = []
        for k, s in enumerate(seqs):
            ids = s.output  # a new list (a slice of the sequence's tokens)
            outs.append(
                CompletionOutput(
                    index=k,
                    token_ids=ids,
                    text=s.stop_text if s.stop_text is not None else self.decode(ids),
                    finish_reason=s.finish_reason,
                    cumulative_logprob=s.cum_logprob,
                    logprobs=list(s.logprobs) if p.logprobs else None,
                )
            )
        m = RequestMetrics(
            g.arrival_time,
            g.first_token_time,
            g.finish_time,
            len(g.prompt),
            g.num_cached_tokens,
            sum(len(o.token_ids) for o in outs),
            g.num_preemptions,
        )
        return RequestOutput(
            g.request_id, list(g.prompt), outs, g.status is Status.FINISHED, m, g.error
        )

    # ------------------------------------------------------------------ chat, streaming
    def chat(
        self,
        conversations: Sequence[Mapping[str, str]] | Sequence[Sequence[Mapping[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        progress: bool = True,
        **template_args: Any,
    ) -> list[RequestOutput]:
        """The assistant's next message for a conversation, or for each of a list of them.

        A conversation is a list of ``{"role": ..., "content": ...}`` messages; it is
        rendered with the tokenizer's chat template (``tokenizer.apply_chat_template``,
        as ``paged_jax.models`` tokenizers have; ``template_args`` go to the template)
        and generated like ``generate``'s prompts. The turns a conversation shares with an
        earlier request reuse its pages through the prefix cache
        (``RequestOutput.metrics.num_cached_tokens``). Returns one output per
        conversation; raises ValueError naming ``conversations[k]``.
        """
        return self.generate(
            self._chat_prompts(conversations, add_generation_prompt, template_args),
            sampling_params,
            progress=progress,
        )

    def _chat_prompts(self, conversations, add_generation_prompt, template_args) -> list:
        render = getattr(self.tokenizer, "apply_chat_template", None)
        if render is None:
            raise ValueError(
                "tokenizer: chat needs a tokenizer with a chat template "
                "(apply_chat_template), such as paged_jax.models.load gives"
            )
        if isinstance(conversations, (str, bytes)) or not isinstance(conversations, Sequence):
            raise TypeError(
                "conversations: expected a list of messages or a list of conversations, got "
                f"{type(conversations).__name__}"
            )
        single = bool(conversations) and isinstance(conversations[0], Mapping)
        prompts = []
        for k, conv in enumerate([conversations] if single else conversations):
            try:
                prompts.append(
                    render(
                        conv,
                        add_generation_prompt=add_generation_prompt,
                        tokenize=True,
                        **template_args,
                    )
                )
            except (TypeError, ValueError) as e:
                raise type(e)(f"conversations[{k}]: {e}") from None
        return prompts

    def stream(
        self,
        prompts: Sequence[str | Sequence[int]] | str,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        cache_salt: Any = None,
    ) -> Iterator[StreamOutput]:
        """Like ``generate``, but yields text as it is generated: after every step, one
        ``StreamOutput`` per sample that has new text or finished.

        Text is detokenized incrementally and never splits a character or a word: text
        that may still change (an incomplete UTF-8 sequence in byte-fallback tokens, or
        the start of a stop string) is held back until the next token settles it. The
        deltas of a sample join into its ``generate`` text. Beam search is not streamed
        (beams are ranked only at the end). Closing the iterator early aborts the
        unfinished requests.
        """
        if self.tokenizer is None:
            raise ValueError("tokenizer: streaming text needs a tokenizer; use generate for ids")
        each = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params]
        for k, p in enumerate(each):
            if p is not None and p.use_beam_search:
                raise ValueError(f"sampling_params[{k}]: beam search cannot be streamed")
        ids, _ = self._add_all("stream", prompts, sampling_params, cache_salt)
        index = {rid: k for k, rid in enumerate(ids)}
        sent: dict[tuple, str] = {}  # (request, sample) -> text yielded so far
        left = set(ids)
        others: list[RequestOutput] = []  # requests added by add_request: kept for step()
        try:
            while left:
                outs = self._step_or_recover()
                if outs is None:
                    continue
                finished = {}
                for o in outs:
                    if o.request_id in left:
                        finished[o.request_id] = o
                    else:
                        others.append(o)
                for rid in ids:
                    if rid in left:
                        pieces = self.text_deltas(rid, finished.get(rid), sent, index[rid])
                        yield from pieces
                        if rid in finished:
                            left.discard(rid)
        finally:
            if self._failed is None:
                for rid in left:  # closed early or interrupted: nothing left running unseen
                    self.abort(rid)
            self._undelivered = others + self._undelivered

    def text_deltas(
        self, rid: Hashable, out: RequestOutput | None, sent: dict, index: int = 0
    ) -> list[StreamOutput]:
        """The new settled text of each sample of request ``rid`` since ``sent`` (a dict
        ``(rid, sample) -> text already delivered``, updated here), as ``StreamOutput``s
        with ``index``; ``out``: the request's output if it finished in the last step
        (each sample then gets a last piece with its final text). For a driver of
        ``step()`` that streams (``stream`` and ``paged_jax.server`` call it after every
        step); text that may still change is held back as ``stream`` describes."""
        pieces = []
        if out is not None:
            for c in out.outputs:
                text, prev = c.text or "", sent.get((rid, c.index), "")
                delta = text[len(prev) :] if text.startswith(prev) else ""
                pieces.append(StreamOutput(index, c.index, delta, True, c.finish_reason, out))
            return pieces
        g = self._groups.get(rid)
        for sq in [] if g is None else [*g.seqs, *g.done]:
            text = self._settled_text(sq, g.params.stop)
            prev = sent.get((rid, sq.sample_index), "")
            if len(text) > len(prev) and text.startswith(prev):
                sent[(rid, sq.sample_index)] = text
                pieces.append(StreamOutput(index, sq.sample_index, text[len(prev) :]))
        return pieces

    def _step_or_recover(self) -> list[RequestOutput] | None:
        """``step()`` for the run-to-completion loops: None when the step failed and was
        undone (its requests were requeued; one that keeps failing ends with
        finish_reason "error", see the class docstring); a stopped engine raises."""
        try:
            return self.step()
        except Exception as e:
            if self._failed is not None:
                raise
            log.warning("a step failed and was undone (%s: %s)", type(e).__name__, e)
            return None

    def _add_all(self, prefix: str, prompts, sampling_params, cache_salt):
        """Adds every prompt as a request, all or nothing (a bad one aborts those added and
        raises naming ``prompts[k]``); returns ``(request ids, params per prompt)``."""
        if isinstance(prompts, str):
            prompts = [prompts]
        params = (
            sampling_params
            if isinstance(sampling_params, Sequence)
            else [sampling_params] * len(prompts)
        )
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: expected 1 or {len(prompts)}, got {len(params)}")
        ids = []
        base = self._arrivals + 1
        for k, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            rid = f"{prefix}-{base}-{k}"
            try:
                self.add_request(rid, prompt, p, cache_salt=cache_salt)
            except (ValueError, TypeError) as e:
                for r in ids:  # all or nothing: nothing of this call stays queued
                    self.abort(r)
                raise type(e)(f"prompts[{k}]: {e}") from e
            ids.append(rid)
        return ids, params

    def _settled_text(self, s: Seq, stops: tuple[str, ...]) -> str:
        """The text of ``s`` that later tokens cannot change: without a trailing
        replacement character (half a UTF-8 sequence) and without a tail that could be
        the start of a stop string."""
        if s.stop_text is not None:  # finished at a stop string: final
            return s.stop_text
        text = self.decode(s.output) or ""
        text = text.rstrip("\ufffd")
        if stops:
            hold = max(map(len, stops)) - 1
            text = text[: max(len(text) - hold, 0)] if hold else text
        return text

    # ------------------------------------------------------------------ swaps
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
            with _mesh_context(self.mesh):
                data = np.asarray(jax.device_get(_read_pages(self.cache, pages.reshape(-1))))
                scales = (
                    np.asarray(jax.device_get(_read_scales(self.cache, pages.reshape(-1))))
                    if self.cache.quantized
                    else None
                )
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
            with _mesh_context(self.mesh):
                self.cache = _write_pages(
                    self.cache,
                    jnp.asarray(pages),
                    jnp.asarray(data),
                    None if scales is None else jnp.asarray(scales),
                )

    def _account(self, dt: float, completed: int) -> None:
        m = self.metrics
        m.steps += completed
        m.elapsed_s += dt
        m.host_s = m.elapsed_s - m.step_s - m.compile_s
        bms = self.block_managers
        used = sum(bm.num_pages - 1 - bm.num_free_pages for bm in bms)
        m.max_pages_used = max(m.max_pages_used, used)
        # The full recount walks every page of every sequence: sample it (every call while
        # there are few sequences, every 8th beyond), it is statistics, not control.
        self._accounted += 1
        if sum(bm.num_seqs for bm in bms) <= 16 or self._accounted % 8 == 1:
            stats = [bm.stats() for bm in bms]
            total = {k: sum(st[k] for st in stats) for k in stats[0]}
            pages = total["pages_used"] * self.page_size
            m.kv_samples += 1
            m.kv_utilization_sum += total["tokens_stored"] / pages if pages else 1.0
            m.max_pages_shared = max(m.max_pages_shared, total["pages_shared"])
            queries = total["prefix_queries"]
            m.prefix_hit_rate = total["prefix_hits"] / queries if queries else 0.0
        m.preemptions_swap = sum(sc.num_preempted["swap"] for sc in self.schedulers)
        m.preemptions_recompute = sum(sc.num_preempted["recompute"] for sc in self.schedulers)

    # ------------------------------------------------------------------ batch API
    def generate(
        self,
        prompts: Sequence[str | Sequence[int]] | str,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: bool = True,
        cache_salt: Any = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; returns outputs in the prompts' order (with
        several processes: on process 0, and ``[]`` on the others).

        Every prompt is checked before any runs (an error names ``prompts[k]``). A step
        that fails is undone and the loop goes on (a request that keeps failing comes back
        with ``finish_reason`` "error"). If the call is interrupted or the engine stops
        (``EngineFailedError``), its unfinished requests are aborted before the exception
        propagates; requests added earlier through ``add_request`` keep running in later
        steps.
        """
        ids, params = self._add_all("gen", prompts, sampling_params, cache_salt)
        done: dict[Hashable, RequestOutput] = {}
        mine = set(ids)
        others: list[RequestOutput] = []  # requests added by add_request: kept for step()
        budget = {
            rid: p_.max_tokens * p_.n
            for rid, p_ in zip(ids, (p or SamplingParams() for p in params), strict=True)
        }
        bar = _Progress(sum(budget.values()), len(ids), enabled=progress and self.is_main_process)
        self._announce = bar.compiling
        try:
            while len(done) < len(ids):
                before = self.metrics.tokens_generated
                outs = self._step_or_recover()
                if outs is None:
                    continue
                tokens, finished = self.metrics.tokens_generated - before, 0
                for out in outs:
                    if out.request_id in mine:
                        done[out.request_id] = out
                        finished += 1
                        used = sum(len(c.token_ids) for c in out.outputs)
                        tokens += max(budget[out.request_id] - used, 0)  # stopped early
                    else:
                        others.append(out)
                bar.update(self.metrics, tokens, finished)
        except BaseException:
            # Interrupted or failed: this call's requests end with it (none is left to
            # run, unseen, in a later call).
            self._undelivered = [o for o in self._undelivered if o.request_id not in mine]
            if self._failed is None:
                for r in ids:
                    if r not in done:
                        self.abort(r)
            raise
        finally:
            self._announce = None
            bar.close()
            self._undelivered = others + self._undelivered
        return [done[r] for r in ids] if self.is_main_process else []


def _resolve_mesh(tensor_parallel_size: Any, data_parallel_size: Any, mesh: Any) -> Mesh | None:
    """The engine's mesh from its arguments (None: one device), checked."""
    sizes = {TENSOR_AXIS: tensor_parallel_size, DATA_AXIS: data_parallel_size}
    names = {TENSOR_AXIS: "tensor_parallel_size", DATA_AXIS: "data_parallel_size"}
    if mesh is not None:
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
        if not set(sizes) & set(mesh.axis_names):
            raise ValueError(
                f"mesh: expected an axis named {TENSOR_AXIS!r} or {DATA_AXIS!r}, got "
                f"{mesh.axis_names}"
            )
        others = {a: n for a, n in mesh.shape.items() if a not in sizes and n != 1}
        if others:
            raise ValueError(
                f"mesh: axes other than {TENSOR_AXIS!r} and {DATA_AXIS!r} must have size 1, "
                f"got {others}"
            )
        for axis, size in sizes.items():
            if size not in (None, mesh.shape.get(axis, 1)):
                raise ValueError(
                    f"{names[axis]}: {size!r} differs from the mesh's {axis!r} axis, "
                    f"{mesh.shape.get(axis, 1)}"
                )
    elif tensor_parallel_size is None and data_parallel_size is None:
        return None
    else:
        tp = 1 if tensor_parallel_size is None else tensor_parallel_size
        dp = 1 if data_parallel_size is None else data_parallel_size
        mesh = parallel_mesh(tp, dp)  # checks the numbers
        if tp * dp == 1:
            return None
    processes = {d.process_index for d in mesh.devices.flat}
    if len(processes) < jax.process_count():
        raise ValueError(
            f"mesh: it spans the devices of {len(processes)} of the {jax.process_count()} "
            f"processes; every process must own some of its devices"
        )
    return mesh


def _on_cpu(model: Any) -> bool:
    """Whether every array of ``model`` lives on CPU devices."""
    from flax import nnx

    arrays = jax.tree.leaves(nnx.state(model))
    return bool(arrays) and all(
        all(d.platform == "cpu" for d in getattr(a, "devices", lambda: ())()) for a in arrays
    )


def _on_mesh(model: Any, mesh: Mesh) -> bool:
    """Whether every array of ``model`` already lives on ``mesh``."""
    from flax import nnx

    arrays = jax.tree.leaves(nnx.state(model))
    return all(
        isinstance(getattr(a, "sharding", None), NamedSharding) and a.sharding.mesh == mesh
        for a in arrays
    )


def _mesh_context(mesh: Mesh | None):
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def _free_memory() -> tuple[int | None, str]:
    """Bytes this process's first device can still allocate (None if unknown), and its
    name."""
    dev = jax.local_devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0), dev.device_kind
    try:  # CPU: the host's available memory (Linux)
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "this machine"
    except OSError:
        pass
    return None, "this machine"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


CPU_KV_CACHE_MAX_BYTES = 4 * 2**30


def _default_budget(most_useful: int) -> int:
    """Bytes of KV cache when none is asked for: at most ``most_useful`` (every sequence
    of a full batch at the model's longest context), and on an accelerator half its free
    memory; on CPU a quarter of the machine's available memory, at most 4 GiB
    (``CPU_KV_CACHE_MAX_BYTES``; vLLM's CPU engine also defaults to 4 GiB), 256 MiB if
    the available memory is unknown."""
    free, _ = _free_memory()
    if jax.default_backend() != "cpu":
        cap = int(0.5 * free) if free is not None else 256 * 2**20
    elif free is not None:
        cap = min(CPU_KV_CACHE_MAX_BYTES, free // 4)
    else:
        cap = 256 * 2**20
    return min(cap, most_useful)


def _describe(bucket: dict) -> str:
    return (
        f"{bucket['tokens']} tokens, {bucket['seqs']} sequences, "
        f"{bucket['pages_per_seq']} pages per sequence, {bucket['copies']} page copies"
        + (f", {bucket['beam_candidates']} beam candidates" if bucket["beam_candidates"] else "")
        + (f", {bucket['steps']} decode steps" if bucket.get("steps", 1) > 1 else "")
    )


# Steps of at most this many tokens (a bucket) compile with _small_step_options on CPU.
SMALL_STEP_TOKENS = 16
# The smallest token bucket of a step. Decode of a few sequences in a 16-token bucket
# computed 16 rows of every product. SmolLM2-135M f32 on the 2-core AMD EPYC, greedy
# decode, medians (2026-11-24): 1 sequence 37.2 tokens/s with 8, 39.1 with 4, and
# 32.1-32.9 before (16, with the layers' weights stacked); 4 sequences 144 / 149 / 126.
# 4 cost a bucket more (8 and 4 at the tail of a 32 x 128 run, where sequences finish
# in waves): 15.1-15.4 s to compile that run's buckets against 14.4-14.6 with 8. Never 1:
# XLA turns a one-row scatter into an update that copies the whole KV pool (so
# PagedKVCache.write pads one row to two).
MIN_STEP_TOKENS = 8
_SMALL_STEP_OPTIONS = (
    ("xla_cpu_use_xnnpack", False),
    ("xla_cpu_experimental_ynn_fusion_type", ""),
)


@functools.lru_cache(maxsize=1)
def _small_step_options() -> tuple | None:
    """XLA options for small steps on CPU, or None (another backend, or a jaxlib that
    does not know them). With YNNPACK's fusions off, XLA:CPU emits its own dots, which
    at a few rows read the weights faster: SmolLM2-135M f32 on a 2-core AVX2 CPU,
    decode of 4 sequences, 113-122 ms a step instead of 137-147 ms, 4 x 128 greedy
    tokens at 34.5 instead of 25.5 tokens/s with the same tokens; at 32 sequences and
    in prefill the default is as fast or faster (measured 2026-11-23)."""
    if jax.default_backend() != "cpu":
        return None
    try:
        jax.jit(lambda x: x + 1, compiler_options=dict(_SMALL_STEP_OPTIONS))(np.float32(0))
    except Exception:  # an XLA without these flags: the default path for every step
        log.info("XLA does not take the small-step CPU options; steps use the default")
        return None
    return _SMALL_STEP_OPTIONS


class _Step:
    """The engine's step: ``default`` (a ``_make_run`` function), or ``small`` (the same
    step compiled with the small-step options) for steps of at most
    ``SMALL_STEP_TOKENS`` tokens (``tokens``, the second argument, is ``i32[T]``)."""

    def __init__(self, default, small=None):
        self.default, self.small = default, small

    def _pick(self, args):
        if self.small is not None and args[1].shape[0] <= SMALL_STEP_TOKENS:
            return self.small
        return self.default

    def __call__(self, *args, **kw):
        return self._pick(args)(*args, **kw)

    def lower(self, *args, **kw):
        return self._pick(args).lower(*args, **kw)

    def _cache_size(self) -> int:
        """Shape buckets compiled so far, both functions together."""
        return self.default._cache_size() + (0 if self.small is None else self.small._cache_size())


# The step's static keyword arguments (the jit cache key, with the arrays' shapes).
STEP_STATIC_ARGS = (
    "layout",
    "decode_only",
    "batch_invariant",
    "num_candidates",
    "greedy_only",
    "num_steps",
)


@functools.lru_cache(maxsize=8)
def _make_run(graphdef, state_def, mesh, compiler_options: tuple | None = None):
    """The engine's jitted step for one model structure (``graphdef``; its weights, the
    step's first argument, a tuple of arrays ``state_def`` unflattens into its
    ``nnx.State``) on one mesh (or None), compiled with ``compiler_options`` (XLA option
    name-value pairs; None: the defaults). Cached,
    so engines of the same model (and config) in one process share compiled shape
    buckets. On a mesh, the step's outputs other than the cache are replicated (every
    process reads them whole)."""
    from flax import nnx

    def replicated(x):
        if mesh is None or x is None:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec()))

    # The greedy sampler's C kernel: on CPU where the kernels built (as for packed
    # weights), off a mesh (XLA would gather a sharded operand for it).
    cpu_kernel = mesh is None and paged_linear.available()

    @functools.partial(
        jax.jit,
        donate_argnums=(3,),
        static_argnames=STEP_STATIC_ARGS,
        compiler_options=None if compiler_options is None else dict(compiler_options),
    )
    def run(
        weights,
        tokens,
        inputs,
        cache,
        penalties,
        *,
        layout,
        decode_only,
        batch_invariant,
        num_candidates,
        greedy_only,
        num_steps=1,
    ):
        x = _unpack_inputs(inputs, layout)
        positions, out_pos, steps = x["positions"], x["out_pos"], x.get("steps")
        temp, top_k, top_p, min_p, seeds = (
            x[k] for k in ("temp", "top_k", "top_p", "min_p", "seeds")
        )
        md = AttentionMetadata(
            **{k: x[k] for k in _MD_ARRAYS},
            decode_only=decode_only,
            batch_invariant=batch_invariant,
        )
        model = nnx.merge(graphdef, jax.tree.unflatten(state_def, weights))
        if mesh is not None and data_parallel_size_of(mesh) > 1:  # each replica its rows
            rows = NamedSharding(mesh, PartitionSpec(DATA_AXIS))
            tokens = jax.lax.with_sharding_constraint(tokens, rows)
            positions = jax.lax.with_sharding_constraint(positions, rows)
        cache = per_replica(lambda c, s, d: c.copy_pages(s, d), cache, md.copy_src, md.copy_dst)

        def sample(logits, pos):
            return rowwise(
                lambda *rows: sample_rows(*rows, greedy_only=greedy_only, cpu_kernel=cpu_kernel),
                logits,
                temp,
                top_k,
                top_p,
                seeds,
                pos,
                min_p,
                penalties,
                invariant=md.batch_invariant,
            )

        if num_steps > 1:  # multi-step decoding: tokens [S, num_steps]
            toks, lps, cache = decode_loop(
                model, sample, tokens, positions, cache, md, steps, out_pos, num_steps
            )
            # Each row's last sample as a token row of the same shape as `tokens`: the
            # input of the launch that goes on from this one with the same rows.
            T, S_b = tokens.shape[0], toks.shape[0]
            k = jnp.zeros(T, jnp.int32).at[: min(T, S_b)].set(steps[: min(T, S_b)])
            row = jnp.minimum(jnp.arange(T), S_b - 1)
            last = jnp.where(k > 0, toks[row, jnp.maximum(k - 1, 0)], 0).astype(tokens.dtype)
            # The tokens and the log-probs' bits in one i32[S, 2 K] array: one transfer to
            # the host instead of two (LLM._complete splits them).
            both = jnp.concatenate(
                [toks.astype(jnp.int32), jax.lax.bitcast_convert_type(lps, jnp.int32)], axis=1
            )
            return replicated(both), None, None, None, replicated(last), cache
        logits, cache = model(tokens, positions, cache, md)
        toks, lps = sample(logits, out_pos)
        if num_candidates:
            cv, ci = beam_candidates(logits, num_candidates)
        else:
            cv = ci = None
        return replicated(toks), replicated(lps), replicated(cv), replicated(ci), None, cache

    return run


_PENDING = -1  # a token the running step is sampling (overlapped steps)
_SEQS = operator.attrgetter("seqs")
_CUM_LOGPROB = operator.attrgetter("cum_logprob")

# The step's host inputs travel to the device as one flat int32 buffer: as jit
# arguments, each numpy array costs a host-to-device buffer of its own (about 3 us warm on
# CPU, 25 us in the engine's loop), and a step has 16 of them.
_MD_ARRAYS = tuple(
    f.name for f in dataclasses.fields(AttentionMetadata) if not f.metadata.get("static")
)
_SAMPLING = ("temp", "top_k", "top_p", "min_p", "seeds", "out_pos")  # LLM._dispatch's order
# In the buffer, in order (then "steps" for a multi-step launch); seeds (uint32) go as
# their bits. Then the float32 arrays, as their bits too: temp, top_p, min_p.
_INTS = ("positions", *_MD_ARRAYS, "top_k", "seeds", "out_pos")
_FLOATS = ("temp", "top_p", "min_p")


def _padded(a: np.ndarray, n: int) -> np.ndarray:
    """``i32[n]``: ``a`` then zeros (``np.pad`` costs several times more)."""
    out = np.zeros(n, np.int32)
    out[: len(a)] = a
    return out


def _pack_inputs(batch, sampling, steps) -> tuple[np.ndarray, tuple]:
    """``(inputs i32[N], layout)``: the batch's positions and metadata, the sampling
    columns (``_SAMPLING``) and ``steps`` (``i32[S_b]`` or None) packed into one buffer
    (uint32 and float32 arrays as their bits), and the layout ``_unpack_inputs`` reads
    them back with (static: the arrays' shapes, which the batch's buckets fix)."""
    temp, top_k, top_p, min_p, seeds, out_pos = sampling
    ints = [batch.positions, *(getattr(batch, k) for k in _MD_ARRAYS)]
    ints += (top_k, seeds.view(np.int32), out_pos)
    if steps is not None:
        ints.append(steps)
    floats = (temp, top_p, min_p)
    layout = (tuple(a.shape for a in ints), tuple(a.shape for a in floats))
    parts = ints + [np.asarray(a, np.float32).view(np.int32) for a in floats]
    return np.concatenate(parts, axis=None), layout


def _unpack_inputs(inputs: jax.Array, layout: tuple) -> dict[str, jax.Array]:
    """The arrays ``_pack_inputs`` packed, by name (in a jitted function: slices)."""
    out = {}
    at = 0
    for names, shapes in ((_INTS + ("steps",), layout[0]), (_FLOATS, layout[1])):
        for name, shape in zip(names, shapes, strict=False):
            n = int(np.prod(shape))
            out[name] = inputs[at : at + n].reshape(shape)
            at += n
    out["seeds"] = jax.lax.bitcast_convert_type(out["seeds"], jnp.uint32)
    for name in _FLOATS:
        out[name] = jax.lax.bitcast_convert_type(out[name], jnp.float32)
    return out


@dataclasses.dataclass
class _Lane:
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
    ) -> _Lane:
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

    def take(self, keep: np.ndarray | None, **columns) -> _Lane:
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
        return _Lane(**fields, stop_ids=self.stop_ids, stop_union=self.stop_union)

    def work(self) -> list:
        """Its rows as ``Work``, in order."""
        return [
            Work(g, s, n - 1, n, True)
            for g, s, n in zip(self.groups, self.seqs, self.stops.tolist(), strict=True)
        ]


@dataclasses.dataclass
class _Launched:
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
    # Multi-step decoding: the steps each row runs; None: one
    # step. Then also its rows as a lane, and its batch and sampling arrays, from which
    # the next launch is built (``advance_batch``).
    steps: list[int] | None = None
    last: Any = None  # i32[T_b] row r's last sample (0: padding), the next launch's input
    lane: _Lane | None = None
    batch: Any = None
    sampling: tuple | None = None
    rows: dict = dataclasses.field(init=False)  # id(Seq) -> batch row of its sample
    # Multi-step: the lane's rows whose last sample a launch dispatched meanwhile decodes
    # (``LLM._continue``): reserved in the block manager, filled with the others.
    carried: np.ndarray | None = None  # bool[L]; None: none
    next: _Lane | None = None  # the lane of the launch that goes on from this one

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


@jax.jit
def _merge_tokens(prev_tokens, src, col, tokens):
    """``i32[T]``: ``tokens``, with token t taken from ``prev_tokens[src[t], col[t]]``
    (the running launch's samples, ``i32[S, J]``) where ``src[t] >= 0``."""
    return jnp.where(src >= 0, prev_tokens[jnp.maximum(src, 0), col], tokens)


# Swap copies, each replica's pages in its own pool (``per_replica``; as they are without
# a data-parallel mesh).
@jax.jit
def _read_pages(cache, pages):
    return per_replica(lambda c, p: c.read_pages(p), cache, pages)


@jax.jit
def _read_scales(cache, pages):
    return per_replica(lambda c, p: c.read_page_scales(p), cache, pages)


@functools.partial(jax.jit, donate_argnums=0)
def _write_pages(cache, pages, data, scales):
    return per_replica(lambda c, *a: c.write_pages(*a), cache, pages, data, scales)


class _Progress:
    """A rich progress bar of generated tokens, with finished requests, tokens/s and the
    step being compiled (silent when disabled).

    The total is every request's token budget (``max_tokens`` per sample or beam); a
    request that stops early counts its unused budget as done, so the bar ends full.
    """

    def __init__(self, total_tokens: int, requests: int, *, enabled: bool):
        self._p = None
        self.requests, self.finished = requests, 0
        if not enabled:
            return
        from rich.progress import BarColumn, Progress, TextColumn

        self._p = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed:.0f}/{task.total:.0f} tokens"),
            TextColumn("{task.fields[info]}"),
            transient=False,
        )
        self._task = self._p.add_task("generating", total=max(total_tokens, 1), info="")
        self._p.start()

    def compiling(self, what: str) -> None:
        """Shown while a new step shape compiles (the call blocks; rich redraws)."""
        if self._p is not None:
            self._p.update(self._task, description=f"compiling the step for {what}")

    def update(self, m: EngineMetrics, tokens: int, finished: int) -> None:
        self.finished += finished
        if self._p is not None:
            rate = f"{m.tokens_generated / max(m.elapsed_s, 1e-9):.0f} tok/s"
            info = f"{self.finished}/{self.requests} requests, {rate}"
            self._p.update(self._task, description="generating", advance=tokens, info=info)

    def close(self) -> None:
        if self._p is not None:
            self._p.stop()
