"""``LLM``: continuous batching on the paged cache, with sampling, n-way samples and beam
search on copy-on-write pages, prefix caching and preemption by swap or recompute.

The public facade of the engine: it checks its arguments, builds the ``ModelRunner``
(``runner.py``: the model, its pool and compiled steps on the device) and the
``EngineCore`` it holds (``core.py``: requests, the step loop and the parts it owns),
and adds the run-to-completion calls (``generate``, ``chat``, ``stream``, ``embed``) and
``warm_up`` (``warmup.py``). The engine core's calls (``step``, ``add_request``,
``abort``...) and state (``metrics``, ``bm``, ``schedulers``...) are reached through it
by name.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any

import jax

from paged_jax.chat import render_conversations
from paged_jax.engine import compile_cache, warmup
from paged_jax.engine.core import EngineCore
from paged_jax.engine.devices import resolve_mesh
from paged_jax.engine.embedding import EmbeddingOutput, embed
from paged_jax.engine.faults import (
    MAX_CONSECUTIVE_FAILED_STEPS,
    STRIKES_TO_FAIL_A_REQUEST,
    EngineFailedError,
)
from paged_jax.engine.loras import enable_lora_slots
from paged_jax.engine.metrics import EngineMetrics, Progress
from paged_jax.engine.outputs import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    StepResult,
    StreamOutput,
)
from paged_jax.engine.runner import ModelRunner
from paged_jax.engine.sampling import SamplingParams
from paged_jax.engine.shapes import StepShape
from paged_jax.engine.speculative import SpeculativeConfig
from paged_jax.errors import with_context
from paged_jax.sharding import data_parallel_size as data_parallel_size_of

log = logging.getLogger("paged_jax")
CHECKED_ENV = "PAGED_JAX_CHECKED"

__all__ = [
    "LLM",
    "CHECKED_ENV",
    "MAX_CONSECUTIVE_FAILED_STEPS",
    "STRIKES_TO_FAIL_A_REQUEST",
    "CompletionOutput",
    "EngineFailedError",
    "EngineMetrics",
    "RequestMetrics",
    "RequestOutput",
    "StreamOutput",
]


def _core(path: str, doc: str) -> property:
    """A read-only attribute of the engine core or one of its parts (``"runner.model"``),
    reached through ``LLM``."""
    names = path.split(".")

    def get(self):
        x = self.engine
        for name in names:
            x = getattr(x, name)
        return x

    return property(get, doc=doc)


class LLM:
    """Generates from a decoder with continuous batching on a paged KV cache.

    Args:
      model: an NNX decoder following ``paged_jax.engine.PagedDecoder``
        (``__call__(tokens, positions, cache, metadata) -> (logits, cache)``,
        ``make_cache``, ``config``), such as ``paged_jax.models.LlamaForCausalLM``; or,
        as vLLM's ``LLM(model=...)`` takes, a name ("smollm2-135m-instruct",
        "tiny-llama"), a Hugging Face checkpoint directory or a GGUF file, loaded with
        ``paged_jax.models.load(model, mesh=...)`` (its tokenizer used unless
        ``tokenizer`` is given). Off a mesh the model is held, in place, the way its
        device reads it fastest (``hold_for_cpu``: packed for the C kernels;
        ``hold_for_accelerator``: each weight read once per step; docs/MODELS.md).
      tokenizer: object with ``encode(str)`` / ``decode(ids)``; None: prompts are
        token ids and outputs have no text.
      num_pages: pages in the pool (of all data-parallel replicas together); None sizes
        it from ``kv_cache_bytes`` (default: what a full batch at the longest context
        could use, at most half the accelerator's free memory, or on CPU a quarter of
        the available memory and 4 GiB).
      page_size: tokens per page.
      max_model_len: the longest sequence in tokens, at most (the default) the model's
        ``max_position_embeddings``; it bounds the block tables ``warm_up()`` pads to.
      max_num_seqs, max_num_batched_tokens: sequences and tokens (decode tokens +
        prefill chunks) per step at most, per data-parallel replica.
      enable_prefix_caching: share full prompt pages across requests.
      preemption: "recompute" (free pages, prefill again later) or "swap" (to host,
        ``num_host_pages`` slots: default as many as the pool). scheduling_policy: "fcfs"
        (arrival order) or "priority" (``add_request(priority=)``, lower first).
      watermark: fraction of pages kept back from admissions.
      cache_dtype: KV cache dtype (default: the model's ``preferred_cache_dtype()``);
        ``jnp.bfloat16`` holds twice f32's tokens in the same memory.
      checked: validate every step's arrays on the host first (``validate_batch``; a
        failure is a failed step). Default: ``$PAGED_JAX_CHECKED`` ("1": on). Costs host
        time every step.
      deterministic: batch-invariant steps: a request's tokens and log-probs (greedy or
        seeded) bitwise the same whatever it is batched with. Slower.
      compilation_cache: a directory where compiled steps are kept across processes,
        True for the default one (``<user cache dir>/paged-jax/xla``), False for none;
        default ``$PAGED_JAX_COMPILATION_CACHE`` (``0``: none), else the default
        directory. ``compilation_cache_dir`` is the one in use.
      tensor_parallel_size, data_parallel_size, mesh: the model and the KV cache split
        over ``tensor_parallel_size`` devices (along KV heads), ``data_parallel_size``
        replicas each with its own pool, block manager and scheduler (a request goes
        where its prefix was sent, else to the least loaded), all in one jitted call
        over ``paged_jax.parallel_mesh(tp, dp)``; or a ``jax.sharding.Mesh`` with a
        ``"tp"`` and/or ``"dp"`` axis in their place (docs/SCALING.md).
      hybrid_kv_cache: for a model with sliding-window layers (Gemma 2 and 3, Mistral),
        a pool whose sliding layers free their pages once the window has passed them.
        None (default): on for such models with one replica; True: on; False: off.
      async_scheduling: overlapped steps (default on): the host schedules and dispatches
        step n+1 while the device runs step n, its decode tokens read on the device;
        ``step()`` then returns what the step launched in the call before finished.
        Outputs are the same either way.
      num_scheduler_steps: decode steps per launch (default 1): with ``K > 1``, plain
        decode steps run ``K`` at a time in one jitted call while no request waits
        (``paged_jax.engine.multistep``); outputs are those of single steps.
      speculative: speculative decoding (``SpeculativeConfig``, or a dict of its fields
        such as ``{"method": "ngram", "num_speculative_tokens": 4}`` or ``{"method":
        "draft", "draft_model": small_model}``; None: off). The tokens kept are exactly
        those of decoding without it; rows with beams, penalties, allowed tokens, a
        grammar or top log-probs decode one token a step. Not with
        ``num_scheduler_steps > 1`` or several data-parallel replicas.
      max_loras, max_lora_rank: LoRA adapters held on the device at once (0: none) and
        their largest rank (16); adapters registered with ``add_lora(name, path)`` run
        per request (``generate(..., lora=name)``), swapped in least recently used
        first.

    docs/ENGINE.md tells more of each option.

    Several processes (``jax.distributed.initialize``, one mesh over all their devices)
    each run this same engine on the same requests in the same order: the scheduler is
    deterministic, so every process makes the same steps. Only process 0 returns outputs
    from ``generate`` and prints progress (the others get ``[]``); ``preemption="swap"``
    needs a single process.

    A step is all or nothing: a signal handler (Ctrl-C, a timer) runs when the step ends;
    a step that raises anyway has every unfinished request requeued, to be recomputed
    from its tokens so far (nothing lost, no token changed); a request that keeps making
    steps fail is isolated and failed alone (``finish_reason`` "error"), and only a
    fault that cannot be undone stops the engine (``EngineFailedError`` until
    ``reset()``). ``paged_jax.engine.faults`` and docs/ENGINE.md tell how.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        num_pages: int | None = None,
        kv_cache_bytes: int | None = None,
        page_size: int = 16,
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        enable_prefix_caching: bool = True,
        preemption: str = "recompute",
        scheduling_policy: str = "fcfs",
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
        speculative: SpeculativeConfig | dict | None = None,
        max_loras: int = 0,
        max_lora_rank: int = 16,
    ):
        self.compilation_cache_dir = compile_cache.enable(compilation_cache)
        mesh = resolve_mesh(tensor_parallel_size, data_parallel_size, mesh)
        if isinstance(model, str | os.PathLike):  # a name or a path, as vLLM's LLM(model=)
            from paged_jax.models import load

            model, loaded = load(model, mesh=mesh)
            tokenizer = loaded if tokenizer is None else tokenizer
        dp = data_parallel_size_of(mesh) if mesh is not None else 1
        self.is_main_process = jax.process_index() == 0
        checked = _checked_options(
            checked=checked,
            deterministic=deterministic,
            async_scheduling=async_scheduling,
            num_scheduler_steps=num_scheduler_steps,
            preemption=preemption,
            page_size=page_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_lora_rank=max_lora_rank,
            max_loras=max_loras,
        )
        speculative = _speculative(speculative, mesh, num_scheduler_steps, dp)
        enable_lora_slots(model, max_loras, max_lora_rank, dp)
        runner = ModelRunner(
            model,
            mesh=mesh,
            page_size=page_size,
            num_pages=num_pages,
            kv_cache_bytes=kv_cache_bytes,
            cache_dtype=cache_dtype,
            hybrid_kv_cache=hybrid_kv_cache,
            max_num_seqs=max_num_seqs,
            deterministic=deterministic,
            num_scheduler_steps=num_scheduler_steps,
            max_model_len=max_model_len,
        )
        bm_args = dict(
            num_pages=runner.num_pages // dp,
            page_size=page_size,
            enable_prefix_caching=enable_prefix_caching,
            watermark=watermark,
            num_host_pages=(runner.num_pages if num_host_pages is None else num_host_pages) // dp,
        )
        if runner.hybrid_kv_cache:
            bm_args["group_windows"] = runner.group_windows
        self.engine = EngineCore(
            runner,
            tokenizer,
            block_manager_args=bm_args,
            num_replicas=dp,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            preemption=preemption,
            scheduling_policy=scheduling_policy,
            checked=checked,
            deterministic=deterministic,
            async_scheduling=async_scheduling,
            num_scheduler_steps=num_scheduler_steps,
            speculative=speculative,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank if max_loras else 0,
        )
        self._warm_ups = 0

    # ------------------------------------------------------------------ the engine core's
    metrics = _core("metrics", "The engine's counters (``EngineMetrics``; ``summary()``).")
    runner = _core("runner", "The ``ModelRunner``: the model, its pool, its compiled steps.")
    model = _core("runner.model", "The model, held for its device.")
    cache = _core("runner.cache", "The KV pool (``PagedKVCache``); every step replaces it.")
    compiled_buckets = _core("runner.compiled_buckets", "The shape buckets compiled so far.")
    hybrid_kv_cache = _core("runner.hybrid_kv_cache", "A pool whose sliding layers free pages.")
    tokenizer = _core("tokenizer", "The tokenizer (None: token ids only).")
    max_model_len = _core("max_model_len", "The longest sequence, in tokens.")
    eos_token_ids = _core("eos_token_ids", "The model's end-of-sequence tokens.")
    bm = _core("bm", "The block manager (one replica; else ``block_managers``).")
    scheduler = _core("scheduler", "The scheduler (one replica; else ``schedulers``).")
    schedulers = _core("schedulers", "Each data-parallel replica's scheduler.")
    block_managers = _core("block_managers", "Each data-parallel replica's block manager.")
    failure = _core("faults.failed", "The error that stopped the engine, else None (``reset``).")
    outputs = _core("outputs", "The ``OutputProcessor`` (stop conditions, text, outputs).")
    max_loras = _core("loras.max_loras", "LoRA slots on the device.")
    loras = _core("loras.names", "The names of the adapters registered, in the order added.")
    checked = _core("checked", "Every step's arrays validated on the host first.")
    deterministic = _core("deterministic", "Batch-invariant steps.")
    async_scheduling = _core("async_scheduling", "Overlapped steps.")
    num_scheduler_steps = _core("num_scheduler_steps", "Decode steps per launch.")

    def step(self) -> StepResult:
        """Runs one engine step; returns the requests that finished in it (a list), and
        what it pushes for streamed requests (``StepResult``; ``EngineCore.step``)."""
        return self.engine.step()

    def add_request(self, request_id: Hashable, prompt, params=None, **kw) -> None:
        """Queues a request for ``step`` (``EngineCore.add_request``: ``cache_salt``,
        ``lora``, ``adapter``, ``stream``, ``priority``)."""
        self.engine.add_request(request_id, prompt, params, **kw)

    def abort(self, request_id: Hashable) -> RequestOutput | None:
        """Stops an unfinished request (``EngineCore.abort``)."""
        return self.engine.abort(request_id)

    def has_unfinished(self) -> bool:
        """True while a request runs or a finished one's output waits for ``step``."""
        return self.engine.has_unfinished()

    def reset(self) -> None:
        """Drops every request and clears a failed state (``EngineCore.reset``)."""
        self.engine.reset()

    def encode(self, prompt) -> list[int]:
        """Token ids of ``prompt`` (a string or token ids), checked."""
        return self.engine.checker.encode(prompt)

    def decode(self, ids: Sequence[int]) -> str | None:
        return self.engine.outputs.decode(ids)

    def check_request(self, prompt, params: SamplingParams | None = None, **kw) -> list[int]:
        """What ``add_request`` checks, without queueing (``EngineCore.check_request``)."""
        return self.engine.check_request(prompt, params, **kw)

    def num_generated(self, request_id: Hashable) -> list[int] | None:
        """Tokens generated so far by each running sample of an unfinished request."""
        return self.engine.num_generated(request_id)

    def add_lora(self, name: str, adapter: Any) -> int:
        """Registers a LoRA adapter for requests to name (``LoraSlots.add``): a PEFT
        adapter directory or a ``models.lora.LoraAdapter``; returns its id."""
        return self.engine.loras.add(name, adapter)

    def remove_lora(self, name: str) -> None:
        """Unregisters adapter ``name`` (refused while unfinished requests use it)."""
        self.engine.remove_lora(name)

    # ------------------------------------------------------------------ compiling
    def warm_up(
        self,
        num_seqs: int | None = None,
        prompt_len: int | None = None,
        max_tokens: int | None = None,
        *,
        sampling_params: SamplingParams | None = None,
        progress: bool = True,
    ) -> list[dict]:
        """Compiles steps before real work: with no workload, every step shape this
        configuration can reach, so that nothing compiles afterwards; with one, the steps
        of ``num_seqs`` prompts of ``prompt_len`` tokens generating ``max_tokens`` each.

        ``warm_up()`` (what ``paged-jax serve`` and ``paged-jax chat`` run before they
        take requests) switches the engine to static shapes for good: every block table
        is padded to ``max_model_len``'s pages and greedy and sampled rows share one
        sampler, which leaves one shape per pair of token and sequence buckets
        (``step_shapes()``; ``paged_jax.engine.shapes``). Each is run once on a batch
        that touches only the null page, and so is each shape of a draft model's own
        steps (speculative decoding), and the extras sampler of each row count
        (``engine/extras.py``: penalties, masks, top log-probs, ``n`` and beams), and the
        copies of forks wider than 8, and the prompt-scoring step (``prompt_logprobs``).

        ``warm_up(num_seqs, prompt_len, max_tokens)`` instead runs that workload once on
        random token ids (``ignore_eos``), compiling exactly the buckets the scheduler
        picks for it; ``sampling_params`` (default greedy) matters there: sampled rows,
        penalties and beams compile steps of their own.

        Prints one line per bucket compiled when ``progress`` (and logs it at INFO to the
        "paged_jax" logger either way); with the persistent compilation cache on, a later
        process loads them from there instead (much faster). Returns the buckets compiled
        (dicts: ``tokens``, ``seqs``, ``pages_per_seq``, ``copies``, ``beam_candidates``,
        ``seconds``, ``steps`` for a multi-step launch's); none is compiled twice. The
        engine's metrics are reset afterwards.
        """
        workload = (num_seqs, prompt_len, max_tokens)
        if all(v is None for v in workload):
            if sampling_params is not None:
                msg = "only for a workload (num_seqs, prompt_len, max_tokens)"
                raise ValueError(f"sampling_params: {msg}; warm_up() compiles every shape")
            return warmup.compile_all(self.engine, progress)
        self._warm_ups += 1  # (each workload's own prefix-cache chain)
        return warmup.run_workload(
            self, *workload, sampling_params, progress, salt=("warm-up", self._warm_ups)
        )

    def step_shapes(self) -> list[StepShape]:
        """The step shapes this configuration reaches with static shapes, per
        data-parallel replica (``paged_jax.engine.shapes.step_shapes``): what
        ``warm_up()`` compiles."""
        return warmup.step_shapes(self.engine)

    # ------------------------------------------------------------------ run to completion
    def chat(
        self,
        conversations: Sequence[Mapping[str, str]] | Sequence[Sequence[Mapping[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        progress: bool = True,
        lora: str | None = None,
        **template_args: Any,
    ) -> list[RequestOutput]:
        """The assistant's next message for a conversation, or for each of a list of them.

        A conversation is a list of ``{"role": ..., "content": ...}`` messages; it is
        rendered with the tokenizer's chat template (``tokenizer.apply_chat_template``,
        as ``paged_jax.models`` tokenizers have; ``template_args`` go to the template)
        and generated like ``generate``'s prompts. The turns a conversation shares with an
        earlier request reuse its pages through the prefix cache
        (``RequestOutput.metrics.num_cached_tokens``). ``lora``: a registered adapter's
        name (``add_lora``) every conversation runs with. ``continue_final_message``: the
        reply goes on with the final (assistant) message instead of starting a new one
        (a reply prefilled with its first words; ``add_generation_prompt`` must then be
        False). Returns one output per conversation; raises ValueError naming
        ``conversations[k]``.
        """
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message: not with add_generation_prompt (pass "
                "add_generation_prompt=False)"
            )
        prompts = render_conversations(
            self.tokenizer,
            conversations,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **template_args,
        )
        return self.generate(prompts, sampling_params, progress=progress, lora=lora)

    def stream(
        self,
        prompts: Sequence[str | Sequence[int]] | str,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        cache_salt: Any = None,
        lora: str | None = None,
    ) -> Iterator[StreamOutput]:
        """Like ``generate``, but yields text as it is generated: after every step, one
        ``StreamOutput`` per sample that has new text or finished.

        Text is detokenized incrementally and never splits a character or a word: text
        that may still change (an incomplete UTF-8 sequence in byte-fallback tokens, or
        the start of a stop string) is held back until the next token settles it. The
        deltas of a sample join into its ``generate`` text. Beam search is not streamed
        (beams are ranked only at the end). Closing the iterator early aborts the
        unfinished requests. ``lora``: as ``generate``'s.
        """
        if self.tokenizer is None:
            raise ValueError("tokenizer: streaming text needs a tokenizer; use generate for ids")
        each = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params]
        for k, p in enumerate(each):
            if p is not None and p.use_beam_search:
                raise ValueError(f"sampling_params[{k}]: beam search cannot be streamed")
        ids, _ = self._add_all("stream", prompts, sampling_params, cache_salt, lora, True)
        index = {rid: k for k, rid in enumerate(ids)}
        left = set(ids)
        others = StepResult()  # what steps pushed of requests added by add_request
        try:
            while left:
                res = self._step_or_recover()
                if res is None:
                    continue
                others.add_others(res, index)
                left -= {o.request_id for o in res}
                for piece in res.streamed:
                    if piece.request_id in index:
                        piece.index = index[piece.request_id]
                        yield piece
        finally:
            if self.failure is None:
                for rid in left:  # closed early or interrupted: nothing left running unseen
                    self.abort(rid)
            self.engine.deliver_later(others)

    def _step_or_recover(self) -> StepResult | None:
        """``step()`` for the run-to-completion loops: None when the step failed and was
        undone (its requests were requeued; one that keeps failing ends with
        finish_reason "error", see the class docstring); a stopped engine raises."""
        try:
            return self.step()
        except Exception as e:
            if self.failure is not None:
                raise
            log.warning("a step failed and was undone (%s: %s)", type(e).__name__, e)
            return None

    def _add_all(self, prefix: str, prompts, sampling_params, cache_salt, lora=None, stream=False):
        """Adds every prompt as a request (``stream``: as ``add_request``'s), all or nothing
        (a bad one aborts those added and raises naming ``prompts[k]``); returns
        ``(request ids, params per prompt)``."""
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
        base = self.engine.requests.arrivals + 1
        for k, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            rid = f"{prefix}-{base}-{k}"
            try:
                self.add_request(rid, prompt, p, cache_salt=cache_salt, lora=lora, stream=stream)
            except (ValueError, TypeError) as e:
                for r in ids:  # all or nothing: nothing of this call stays queued
                    self.abort(r)
                raise with_context(e, f"prompts[{k}]") from e
            ids.append(rid)
        return ids, params

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]] | str,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: bool = True,
        cache_salt: Any = None,
        lora: str | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; returns outputs in the prompts' order (with
        several processes: on process 0, and ``[]`` on the others). ``lora``: a
        registered adapter's name (``add_lora``) every prompt runs with (None: none).

        Every prompt is checked before any runs (an error names ``prompts[k]``). A step
        that fails is undone and the loop goes on (a request that keeps failing comes back
        with ``finish_reason`` "error"). If the call is interrupted or the engine stops
        (``EngineFailedError``), its unfinished requests are aborted before the exception
        propagates; requests added earlier through ``add_request`` keep running in later
        steps.
        """
        ids, params = self._add_all("gen", prompts, sampling_params, cache_salt, lora)
        done: dict[Hashable, RequestOutput] = {}
        mine = set(ids)
        others = StepResult()  # what steps pushed of requests added by add_request
        budget = {
            rid: p_.max_tokens * p_.n
            for rid, p_ in zip(ids, (p or SamplingParams() for p in params), strict=True)
        }
        bar = Progress(sum(budget.values()), len(ids), enabled=progress and self.is_main_process)
        runner = self.engine.runner
        runner.announce = bar.compiling
        try:
            while len(done) < len(ids):
                before = self.metrics.tokens_generated
                res = self._step_or_recover()
                if res is None:
                    continue
                tokens, finished, unused = self.metrics.tokens_generated - before, 0, 0
                others.add_others(res, mine)
                for out in res:
                    if out.request_id in mine:
                        done[out.request_id] = out
                        finished += 1
                        used = sum(len(c.token_ids) for c in out.outputs)
                        unused += max(budget[out.request_id] - used, 0)  # stopped early
                bar.update(self.metrics, tokens, finished, unused)
        except BaseException:
            # Interrupted or failed: this call's requests end with it (none is left to
            # run, unseen, in a later call).
            self.engine.discard_undelivered(mine)
            if self.failure is None:
                for r in ids:
                    if r not in done:
                        self.abort(r)
            raise
        finally:
            runner.announce = None
            bar.close()
            self.engine.deliver_later(others)
        return [done[r] for r in ids] if self.is_main_process else []

    def embed(
        self,
        prompts: Sequence[str | Sequence[int]] | str,
        *,
        pooling: str = "last",
        normalize: bool = True,
    ) -> list[EmbeddingOutput]:
        """Each prompt's embedding: its final hidden states (after the model's last norm)
        pooled into one f32 ``[E]`` vector, ``"last"`` (the last token's, as decoder
        embedders such as Qwen3-Embedding use), ``"mean"`` or ``"first"``, L2-normalized
        when ``normalize`` (``paged_jax.engine.embedding``). Prompts are text (tokenized
        with the special tokens the tokenizer adds) or token ids, checked as
        ``generate``'s are (an error names ``prompts[k]``). They run as prefill steps of
        at most ``max_num_batched_tokens`` tokens on a KV pool of their own, so requests
        in flight keep their pages. On a tensor-parallel mesh too, not yet on
        data-parallel replicas."""
        return embed(self.engine, prompts, pooling=pooling, normalize=normalize)


def _checked_options(*, checked, deterministic, async_scheduling, num_scheduler_steps,
                     preemption, max_loras, **positive) -> bool:  # fmt: skip
    """Checks ``LLM``'s plain options (naming the argument); returns ``checked`` with its
    default (``$PAGED_JAX_CHECKED``) applied."""
    if checked is None:
        checked = os.environ.get(CHECKED_ENV, "") not in ("", "0")
    if not isinstance(checked, bool):
        raise TypeError(f"checked: expected a bool or None, got {checked!r}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: expected a bool, got {deterministic!r}")
    if not isinstance(async_scheduling, bool):
        raise TypeError(f"async_scheduling: expected a bool, got {async_scheduling!r}")
    if (
        isinstance(num_scheduler_steps, bool)
        or not isinstance(num_scheduler_steps, int)
        or num_scheduler_steps < 1
    ):
        raise ValueError(f"num_scheduler_steps: expected an int >= 1, got {num_scheduler_steps!r}")
    if preemption == "swap" and jax.process_count() > 1:
        raise ValueError(
            f"preemption: 'swap' needs a single process, this program has "
            f"{jax.process_count()} (use 'recompute')"
        )
    if preemption not in ("recompute", "swap"):
        raise ValueError(f"preemption: expected 'recompute' or 'swap', got {preemption!r}")
    for name, v in positive.items():  # page_size, max_num_seqs, ...
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
    if isinstance(max_loras, bool) or not isinstance(max_loras, int) or max_loras < 0:
        raise ValueError(f"max_loras: expected an int >= 0, got {max_loras!r}")
    return checked


def _speculative(value: Any, mesh, num_scheduler_steps: int, dp: int) -> SpeculativeConfig | None:
    """``LLM(speculative=...)`` as a config (a draft named by a name or a path loaded onto
    ``mesh``), checked against the engine's other options."""
    speculative = SpeculativeConfig.of(value)
    if speculative is None:
        return None
    if isinstance(speculative.draft_model, str | os.PathLike):
        from paged_jax.models import load

        draft, _ = load(speculative.draft_model, mesh=mesh)
        speculative = dataclasses.replace(speculative, draft_model=draft)
    if num_scheduler_steps > 1:
        raise ValueError(
            f"speculative: not with num_scheduler_steps={num_scheduler_steps} (each "
            "launch of several steps decodes one token a step); pass 1"
        )
    if dp > 1:
        raise ValueError(
            f"speculative: not with data_parallel_size={dp} yet; pass 1 or speculative=None"
        )
    return speculative
