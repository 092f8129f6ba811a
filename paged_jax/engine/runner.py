"""The model runner: the device side of the engine.

It owns what lives on the accelerator and how steps reach it: the model's weights in the
layout its device reads fastest (``hold_for_cpu`` / ``hold_for_accelerator``, or sharded
on a mesh), the paged KV pool (sized from the memory there), the jitted step and its
compiled shape buckets, the packing of a step's host inputs into one buffer, and the page
copies of swapping. The engine core (``paged_jax.engine.core``) hands it batches built by
the block managers and gets the step's outputs back, still on the device.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from paged_jax.batch import MIN_COPIES, bucket, concat_batches, null_batch
from paged_jax.engine.devices import (  # noqa: F401 (resolve_mesh: the engine's callers read it here)
    _on_mesh,
    hold_for_device,
    mesh_context,
    pool_pages,
    resolve_mesh,
    where_allocated,
)
from paged_jax.engine.extras import (
    EXTRAS_BIASES,
    ExtrasSample,
    ExtrasSampler,
)
from paged_jax.engine.protocol import check_model
from paged_jax.engine.sampling import SORT_FREE_BACKENDS
from paged_jax.engine.step_fn import (  # noqa: F401 (STEP_STATIC_ARGS, SMALL_STEP_TOKENS: read here)
    SMALL_STEP_TOKENS,
    STEP_STATIC_ARGS,
    _copy_pages,
    _describe,
    _make_run,
    _merge_tokens,
    _read_pages,
    _read_scales,
    _small_step_options,
    _Step,
    _variant,
    _write_pages,
)
from paged_jax.engine.step_inputs import STATIC_SCORE_TOP
from paged_jax.engine.step_io import (  # noqa: F401 (_SAMPLING: tests read it here)
    _SAMPLING,
    DeferredSample,
    _make_sample,
    _pack_inputs,
    _padded,
    _unpack_inputs,
)
from paged_jax.engine.step_types import (
    Dispatched,
    PromptScoring,
    SamplingColumns,
    StepInputs,
    StepOutputs,
)
from paged_jax.metadata import decode_only
from paged_jax.sharding import create_cache, kv_head_replicas
from paged_jax.sharding import data_parallel_size as data_parallel_size_of
from paged_jax.sharding import tensor_parallel_size as tensor_parallel_size_of

log = logging.getLogger("paged_jax")

# The copy-on-write copies a step holds a replica (``batch.build_batch``'s ``min_copies``);
# with static shapes, more run apart, ahead of the step (``ModelRunner._copies_apart``).
STEP_COPIES = MIN_COPIES


def _max_model_len(value, longest: int) -> int:
    """``ModelRunner(max_model_len=)`` checked against the model's ``longest`` (its
    ``max_position_embeddings``, the default)."""
    if value is None:
        return longest
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"max_model_len: expected an int or None, got {value!r}")
    if not 2 <= value <= longest:
        raise ValueError(
            f"max_model_len: expected 2 <= max_model_len <= {longest} (the model's "
            f"max_position_embeddings), got {value}"
        )
    return value


class ModelRunner:
    """The model, its KV pool and its compiled step on the device (or a mesh).

    Args:
      model: a decoder following ``paged_jax.engine.PagedDecoder``; placed for its device
        in place: sharded onto ``mesh`` (``shard(mesh)``) when it is off it, else held
        as the CPU (``hold_for_cpu``) or an accelerator (``hold_for_accelerator``) reads
        it fastest, where the model has those methods.
      mesh: a mesh from ``resolve_mesh``, or None (one device).
      page_size, cache_dtype: the pool's page size and dtype (None: the model's).
      num_pages: pages in the pool, every data-parallel replica's together; None sizes
        it from ``kv_cache_bytes`` (default: what ``max_num_seqs`` sequences at the
        model's longest context could use, at most half the accelerator's free memory,
        or on CPU a quarter of the available memory and 4 GiB).
      hybrid_kv_cache: see ``LLM``.
      deterministic: batch-invariant steps (one compiled path for every bucket).
      num_scheduler_steps: decode steps of a multi-step launch (``LLM``).

    Attributes: ``model``, ``cache`` (the pool, replaced by every step: it is donated),
    ``num_pages``, ``hybrid_kv_cache``, ``group_windows`` (the hybrid pool's layer groups'
    windows, else None), ``weights`` (a flat tuple of arrays), ``step_fn`` (the jitted
    step, ``_Step``), ``compiled_buckets`` (dicts, one per shape bucket compiled) and
    ``announce`` (None, or called with a description before a new shape runs).
    """

    def __init__(
        self,
        model: Any,
        *,
        mesh: Mesh | None,
        page_size: int,
        num_pages: int | None,
        kv_cache_bytes: int | None,
        cache_dtype: Any,
        hybrid_kv_cache: bool | None,
        max_num_seqs: int,
        deterministic: bool,
        num_scheduler_steps: int = 1,
        max_model_len: int | None = None,
    ):
        self.mesh = mesh
        self.num_scheduler_steps = num_scheduler_steps
        tp = tensor_parallel_size_of(mesh) if mesh is not None else 1
        dp = data_parallel_size_of(mesh) if mesh is not None else 1
        check_model(model)
        if mesh is not None and not _on_mesh(model, mesh):
            if not callable(getattr(model, "shard", None)):
                raise TypeError(
                    "model: tensor parallelism needs a model with shard(mesh) (placing its "
                    f"weights on the mesh), {type(model).__name__} has none"
                )
            model = model.shard(mesh)
        if mesh is None:
            model = hold_for_device(model)
        self.model = model
        self.page_size = page_size
        self.deterministic = deterministic
        # Every token of a step costs compute here (a CPU computes a few rows at about
        # the cost of one only up to the step's padded bucket): speculative decoding
        # verifies the proposals of sequences that rarely get them accepted only in the
        # padding (``Speculation._draft``).
        self.tokens_cost_compute = jax.default_backend() == "cpu"
        # The model takes each token's adapter index (``adapter_ids``): the hook of
        # per-request adapters (``EngineCore.add_request(adapter=)``).
        self.takes_adapters = "adapter_ids" in inspect.signature(model.__call__).parameters
        self.max_model_len = _max_model_len(max_model_len, model.config.max_position_embeddings)
        # Steps compiled for every bucket at once (LLM.warm_up()): tables as wide as the
        # longest sequence and one sampler for greedy and sampled rows, so that the set of
        # shapes is small (paged_jax.engine.shapes).
        self.static_shapes = False
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
            if hybrid and "hybrid" in inspect.signature(model.make_cache).parameters
            else {}
        )
        if cache_dtype is None and hasattr(model, "preferred_cache_dtype"):
            cache_dtype = model.preferred_cache_dtype()  # (after the weights are held)
        self._cache_dtype = cache_dtype
        probe = model.make_cache(2, page_size, cache_dtype, **self._cache_kw)
        self.hybrid_kv_cache = probe.layer_groups is not None
        self.num_groups = probe.num_groups if self.hybrid_kv_cache else None
        self.group_windows = probe.layer_groups[0] if self.hybrid_kv_cache else None
        # Bytes of a token across the mesh (KV heads repeated when tp exceeds them)
        token_bytes = probe.bytes_per_token * kv_head_replicas(probe.num_kv_heads, tp)
        self.num_pages, need = pool_pages(
            num_pages,
            kv_cache_bytes,
            page_size=page_size,
            token_bytes=token_bytes,
            pages_per_seq=probe.num_groups * -(-self.max_model_len // page_size),
            max_num_seqs=max_num_seqs,
            tp=tp,
            dp=dp,
        )
        num_pages = self.num_pages
        try:
            self.cache = self.make_cache(num_pages)
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            raise ValueError(
                f"num_pages: {num_pages} pages of {page_size} tokens need {need / 2**30:.2f} "
                f"GiB of KV cache, more than {where_allocated()} could allocate; lower "
                "num_pages or kv_cache_bytes"
            ) from None
        self.compiled_buckets: list[dict] = []  # shape buckets this engine compiled
        self._shapes_seen: set[tuple] = set()  # step shapes this engine has run
        self._compiled_keys: set[tuple] = set()  # what the step compiled for (launch)
        self.announce: Callable[[str], None] | None = None
        self.max_num_seqs = max_num_seqs  # (the widest n or beam: the extras sampler's)
        self._make_step_fn(deterministic)

    def _make_step_fn(self, deterministic: bool) -> None:
        """The model's weights as the step takes them and the jitted step (``step_fn``)."""
        from flax import nnx

        self._graphdef, state = nnx.split(self.model)
        # The weights as a flat tuple of arrays: the jitted step takes them so, since
        # flattening an nnx.State in Python at every call cost 50-70 us of a 2-core
        # CPU's time per launch (tiny-llama, 256 sequences, multi-step launches).
        weights, self._state_def = jax.tree.flatten(state)
        self.weights = tuple(weights)
        # Small steps (decode at light load) on CPU compile with XLA's own dots instead
        # of YNNPACK's fusions (see _small_step_options); not in deterministic mode,
        # where every bucket must take the same path.
        options = None if deterministic else _small_step_options()
        # Read when the engine is built (and part of the cache key): how restricted rows
        # are drawn on this backend.
        self.sort_free = SORT_FREE_BACKENDS.get(jax.default_backend(), False)
        run = functools.partial(_make_run, self._graphdef, self._state_def, self.mesh)
        self.step_fn = _Step(
            run(None, self.sort_free),
            None if options is None else run(options, self.sort_free),
        )
        self.extras = ExtrasSampler(
            self.mesh,
            self.sort_free,
            max_model_len=self.max_model_len,
            vocab_size=self.model.config.vocab_size,
            batch_invariant=deterministic,
            record=self.compiled_buckets.append,
            max_width=self.max_num_seqs,
        )

    def make_cache(self, num_pages: int):
        """An empty pool of ``num_pages`` pages, on the mesh in its shards if there is one."""
        make = functools.partial(
            self.model.make_cache, num_pages, self.page_size, self._cache_dtype, **self._cache_kw
        )
        return make() if self.mesh is None else create_cache(make, self.mesh)

    def launch(self, inputs: StepInputs) -> Dispatched:
        """Dispatches the jitted step on ``inputs`` (``StepInputs``: the batch, its input
        tokens, the rows' sampling columns and whatever else some row needs) without
        waiting for it. Returns its outputs (``StepOutputs``, still on the device; with
        ``defer_sample`` the ``DeferredSample`` or ``ExtrasSample`` for ``sample``), the
        dispatch call's seconds and whether it compiled a new program.

        With static shapes, a step whose rows have extras (penalties, biases, token
        masks, candidates: ``takes_extras_sampler``) runs the plain step's program, which
        keeps its logits, and its rows are sampled by the extras sampler of their row
        count (``step_io._make_extras_sample``): both compiled by warm-up."""
        if self.takes_extras_sampler(inputs):
            plain = dataclasses.replace(
                inputs,
                sampling=inputs.sampling.with_samples(1),
                penalties=None,
                allowed=None,
                cand_allowed=None,
                num_candidates=0,
                defer_sample=False,
            )
            d = self._launch(plain)
            extras = ExtrasSample(
                d.outputs.logits,
                inputs.sampling,
                inputs.penalties,
                inputs.num_candidates,
                self.deterministic,
                d.outputs.scores,
            )
            if inputs.defer_sample:
                return Dispatched(extras, d.seconds, d.compiled)
            s = self.extras.sample(extras, inputs.allowed, inputs.cand_allowed)
            return Dispatched(s.outputs, d.seconds + s.seconds, d.compiled or s.compiled)
        return self._launch(inputs)

    def takes_extras_sampler(self, inputs: StepInputs) -> bool:
        """Whether ``launch`` samples ``inputs``' rows with the extras sampler: static
        shapes, one step (prompt scoring or not), some row with extras (or masks deferred, or
        the first token of ``n`` samples), samples and candidates a row that one of its
        programs holds (``ExtrasSampler.width``: any ``n`` and beam width the engine
        takes) and at most ``EXTRAS_BIASES`` biases a row. (Other steps compile a variant
        of their own on first use.)"""
        if not self.static_shapes or inputs.steps is not None:
            return False
        pen, J = inputs.penalties, inputs.sampling.seeds.shape[1]
        extras = (pen, inputs.allowed, inputs.cand_allowed)
        if all(x is None for x in extras) and not (
            inputs.num_candidates or inputs.defer_sample or J > 1
        ):
            return False
        if self.extras.width(J, inputs.num_candidates) is None:
            return False
        return pen is None or pen.bias_tokens is None or pen.bias_tokens.shape[1] <= EXTRAS_BIASES

    def _launch(self, inputs: StepInputs) -> Dispatched:
        batch, sampling = inputs.batch, inputs.sampling
        K = 1 if inputs.steps is None else self.num_scheduler_steps
        S_b = batch.kv_lens.shape[0]
        shape = (batch.token_ids.shape[0], S_b, batch.page_indices.shape[-1])
        shape += (inputs.num_candidates, K)
        if self.announce is not None and shape not in self._shapes_seen:
            self.announce(
                f"{shape[0]} tokens x {S_b} sequences x {shape[2]} pages (once per shape)"
                + (f", {inputs.replicas} replicas" if inputs.replicas > 1 else "")
                + (f", {K} steps a launch" if K > 1 else "")
            )
        self._shapes_seen.add(shape)
        penalties, allowed, adapters = inputs.penalties, inputs.allowed, inputs.adapters
        if penalties is not None:  # host arrays from the launcher
            penalties = jax.tree.map(jnp.asarray, penalties)
        if allowed is not None:
            allowed = jnp.asarray(allowed)
        if adapters is not None:
            adapters = jnp.asarray(adapters)
        optional = {}  # (keywords only when given: other steps' jit keys as before)
        if inputs.cand_allowed is not None:
            optional["cand_allowed"] = jnp.asarray(inputs.cand_allowed)
        if inputs.scoring is not None:
            sc = inputs.scoring
            optional["scored"] = (jnp.asarray(sc.rows), jnp.asarray(sc.targets))
        batch = self._copies_apart(batch, inputs.replicas)
        compiled_before = self.step_fn._cache_size()
        t1 = time.perf_counter()
        padded_steps = None if inputs.steps is None else _padded(inputs.steps, S_b)
        packed, layout = _pack_inputs(batch, sampling, padded_steps)
        flags = self._flags(inputs, layout, K)
        with mesh_context(self.mesh):
            outputs, self.cache = self.step_fn(
                self.weights, inputs.tokens, packed, self.cache, penalties, allowed, adapters,
                **optional, **flags,
            )  # fmt: skip
        seconds = time.perf_counter() - t1
        # A new entry of the step's cache: a new shape compiled, unless only the kind of
        # the tokens differs from one before (a host array, or a device one merged from a
        # running step's samples: dispatch keys them apart, the compiled code is shared).
        compiled = self.step_fn._cache_size() > compiled_before
        if compiled:
            arrays = (penalties, allowed, adapters, optional)
            key = (shape, tuple(flags.items()), str(jax.tree.map(jnp.shape, arrays)))
            compiled = key not in self._compiled_keys
            self._compiled_keys.add(key)
        if compiled:
            extras = (penalties, adapters, allowed, inputs.cand_allowed, inputs.scoring)
            variant = _variant(batch, flags, *extras)
            self._compiled(batch, inputs.num_candidates, seconds, K, variant)
        if inputs.defer_sample:
            outputs = DeferredSample(
                outputs.logits, packed, layout, penalties, flags["batch_invariant"],
                inputs.num_candidates, flags["greedy_only"], outputs.scores,
            )  # fmt: skip
        return Dispatched(outputs, seconds, compiled)

    def _copies_apart(self, batch, replicas: int):
        """With static shapes, a step with more copy-on-write copies than a step holds
        (``STEP_COPIES`` a replica: the first token of over 8 samples or beams forks them
        all at once) runs them first in a program of their own (``_copy_pages``, which
        warm-up compiles for every count up to ``max_num_seqs``), and the step keeps its
        shape. Returns the batch the step takes."""
        n = batch.copy_src.shape[0]
        if not self.static_shapes or n <= STEP_COPIES * replicas:
            return batch
        before = _copy_pages._cache_size()
        t = time.perf_counter()
        with mesh_context(self.mesh):
            self.cache = _copy_pages(
                self.cache, jnp.asarray(batch.copy_src), jnp.asarray(batch.copy_dst)
            )
        if _copy_pages._cache_size() > before:
            b = dict(tokens=0, seqs=0, pages_per_seq=0, copies=n, beam_candidates=0)
            b |= dict(seconds=round(time.perf_counter() - t, 2), variant=("copies apart",))
            self.compiled_buckets.append(b)
            log.info("compiled the copies of %d pages in %.1f s", n, b["seconds"])
        none = np.zeros(STEP_COPIES * replicas, np.int32)  # (page 0 onto itself: no copy)
        return dataclasses.replace(batch, copy_src=none, copy_dst=none)

    def warm_copies(self, replicas: int) -> int:
        """Compiles ``_copies_apart``'s programs, one per count of copies a step may have
        beyond its own (up to ``max_num_seqs`` a replica); returns how many compiled."""
        compiled, n = 0, 2 * STEP_COPIES
        while n // 2 < self.max_num_seqs:
            before = _copy_pages._cache_size()
            none = jnp.zeros(n * replicas, jnp.int32)
            with mesh_context(self.mesh):
                self.cache = _copy_pages(self.cache, none, none)
            jax.block_until_ready(self.cache)
            compiled += _copy_pages._cache_size() > before
            n *= 2
        return compiled

    def _flags(self, inputs: StepInputs, layout: tuple, K: int) -> dict:
        """The step's static arguments for ``inputs`` (with the arrays' shapes, its jit
        key)."""
        flags = dict(
            layout=layout,
            decode_only=decode_only(inputs.batch) and not self.deterministic,
            batch_invariant=self.deterministic,
            num_candidates=inputs.num_candidates,
            num_steps=K,
            # No row samples: an argmax is all (deterministic mode: one path for every
            # row, so a greedy row's log-prob is the same in any batch). With static
            # shapes, one sampler for every step (no second variant to compile; a
            # greedy row costs an argmax in it too).
            greedy_only=not (inputs.sampling.temperature > 0).any()
            and not self.deterministic
            and not self.static_shapes,
        )
        if inputs.defer_sample:
            if inputs.allowed is not None or inputs.cand_allowed is not None or K > 1:
                raise ValueError("defer_sample: one step, its masks given to sample()")
            flags["logits_only"] = True  # (only when set: the other steps' jit key as before)
        elif self.static_shapes and K == 1:  # the extras sampler's input, if a row has extras
            flags["keep_logits"] = True
        if inputs.scoring is not None:
            flags["score_top"] = inputs.scoring.top
        return flags

    def sample(
        self,
        deferred: DeferredSample,
        allowed: np.ndarray | None,
        cand_allowed: np.ndarray | None = None,
    ) -> Dispatched:
        """Dispatches the sampling of a step launched with ``defer_sample``: its rows'
        ``allowed`` masks (``i32[S_b, ceil(V / 32)]`` or None) applied to the logits the
        model call left on the device, and ``cand_allowed`` to its candidates (as
        ``StepInputs``'). Does not wait for it; its ``StepOutputs`` carry the model call's
        prompt scores. An ``ExtrasSample`` goes to the extras sampler."""
        if isinstance(deferred, ExtrasSample):
            return self.extras.sample(deferred, allowed, cand_allowed)
        fn = _make_sample(self.mesh, self.sort_free)
        before = fn._cache_size()
        t = time.perf_counter()
        with mesh_context(self.mesh):
            out = fn(
                deferred.logits,
                deferred.inputs,
                deferred.penalties,
                None if allowed is None else jnp.asarray(allowed),
                None if cand_allowed is None else jnp.asarray(cand_allowed),
                layout=deferred.layout,
                batch_invariant=deferred.batch_invariant,
                num_candidates=deferred.num_candidates,
                greedy_only=deferred.greedy_only,
            )
        out.scores = deferred.scores
        return Dispatched(out, time.perf_counter() - t, fn._cache_size() > before)

    @property
    def table_width(self) -> int:
        """Pages per block-table row with static shapes: the bucket of a sequence of
        ``max_model_len`` tokens (the rows of a hybrid pool's groups alike)."""
        return bucket(-(-self.max_model_len // self.page_size), 4)

    def run_shape(
        self,
        shape,
        replicas: int = 1,
        merges: Sequence[int] = (),
        overlapped: bool = False,
        verify: int = 0,
        adapters: bool = False,
        scoring: bool = False,
    ) -> bool:
        """Runs step ``shape`` (``paged_jax.engine.shapes.StepShape``, per replica) once on
        batches that touch only the null page, ``replicas`` of them side by side, and
        waits for it. Then merges its samples into the input tokens of a step of each of
        ``merges`` tokens per replica (``merge_tokens``: an overlapped step's inputs), and
        with ``overlapped`` runs it again on such merged tokens (a device array, which
        the jitted step's dispatch keys apart from a host one). ``verify`` (> 0): the
        step of speculative decoding's verify steps of this shape instead, with that many
        more sampling rows (``speculative.num_verify_rows`` with static shapes, all
        replicas together). ``adapters``: the
        step with each token's adapter (``adapter_ids``, all 0 here), which compiles
        apart from the step without. ``scoring``: the step scoring every token row as a
        prompt position (``prompt_logprobs``, as static shapes score them). Returns
        whether the step compiled (False: compiled before)."""
        batch = concat_batches(
            [
                null_batch(
                    shape.tokens,
                    shape.seqs,
                    shape.pages_per_seq,
                    decode_only=shape.decode_only,
                    num_groups=self.num_groups,
                )
                for _ in range(replicas)
            ]
        )
        S_b = batch.kv_lens.shape[0]
        sampling = SamplingColumns.idle(S_b)
        if verify:
            rows = np.zeros(S_b + verify, np.int32)
            rows[:S_b] = batch.logits_indices
            batch = dataclasses.replace(batch, logits_indices=rows)
            sampling = SamplingColumns.idle(S_b + verify)
        steps = None if shape.steps == 1 else np.ones(len(batch.seq_ids), np.int32)

        def merged(outputs: StepOutputs, t: int):
            src = np.full(t * replicas, -1, np.int32)
            src[0] = 0  # one placeholder, taken from row 0's sample
            return self.merge_tokens(outputs.tokens, src, np.zeros_like(src), np.zeros_like(src))

        ids = np.zeros(batch.token_ids.shape[0], np.int32) if adapters else None
        inputs = StepInputs(batch, batch.token_ids, sampling, replicas, adapters=ids, steps=steps)
        if scoring:
            T_b = batch.token_ids.shape[0]
            none = np.zeros(T_b, np.int32)
            inputs.scoring = PromptScoring(none, none, STATIC_SCORE_TOP)
        first = self.launch(inputs)
        jax.block_until_ready((first.outputs, self.cache))
        for t in merges:
            jax.block_until_ready(merged(first.outputs, t))
        compiled = first.compiled
        if overlapped:
            inputs.tokens = merged(first.outputs, shape.tokens)
            more = self.launch(inputs)
            jax.block_until_ready((more.outputs, self.cache))
            compiled = compiled or more.compiled
        return compiled

    def _compiled(
        self, batch, num_candidates: int, seconds: float, num_steps: int = 1, variant=()
    ) -> None:
        """Records (and logs at INFO) the shape bucket a step just compiled; ``variant``:
        what else keys its program apart from the other programs of its shape (decode
        rows only, adapter rows, token masks, a verify step's extra sampled rows...)."""
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
        if variant:
            b["variant"] = variant
        self.compiled_buckets.append(b)
        log.info("compiled a step bucket in %.1f s: %s", seconds, _describe(b))

    def merge_tokens(self, prev_tokens, src, col, tokens):
        """``tokens`` with token t taken from ``prev_tokens[src[t], col[t]]`` where
        ``src[t] >= 0``, on the device (``_merge_tokens``)."""
        with mesh_context(self.mesh):
            return _merge_tokens(prev_tokens, src, col, tokens)

    def read_pages(self, pages: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Swap-out reads: ``pages`` (``i32[replicas * n]``, replica r's local ids at
        ``[r n, (r + 1) n)``) as host arrays ``[L, len(pages), ...]``, and their scales
        for a quantized pool (else None)."""
        with mesh_context(self.mesh):
            data = np.asarray(jax.device_get(_read_pages(self.cache, pages)))
            scales = (
                np.asarray(jax.device_get(_read_scales(self.cache, pages)))
                if self.cache.quantized
                else None
            )
        return data, scales

    def write_pages(self, pages: np.ndarray, data: np.ndarray, scales: np.ndarray | None):
        """Swap-in writes: ``data`` (and ``scales``) into ``pages``, laid out as
        ``read_pages`` returns them; the pool is updated in place (donated)."""
        with mesh_context(self.mesh):
            self.cache = _write_pages(
                self.cache,
                jnp.asarray(pages),
                jnp.asarray(data),
                None if scales is None else jnp.asarray(scales),
            )

    def reallocate_if_consumed(self) -> None:
        """A fresh pool if a failed step consumed this one (donated buffers); its
        contents are never read again."""
        if any(x.is_deleted() for x in jax.tree.leaves(self.cache)):
            self.cache = self.make_cache(self.num_pages)
