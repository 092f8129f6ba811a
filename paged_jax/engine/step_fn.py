"""The engine's jitted step (``_make_run``): one model call on a ragged batch of the
paged pool, its copy-on-write copies first, its rows sampled, or a multi-step launch's
decode loop; its compile options on CPU (``_small_step_options``) and the two compiled
forms a runner picks from (``_Step``); the device-side helpers of overlapped steps
(``_merge_tokens``) and swapping (``_read_pages``, ``_write_pages``); and how a compiled
program is described (``_variant``, ``_describe``)."""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from paged_jax.engine.multistep import decode_loop
from paged_jax.engine.protocol import check_step_output
from paged_jax.engine.sampling import beam_candidates, prompt_scores
from paged_jax.engine.step_io import (
    _MD_ARRAYS,
    _cpu_kernel,
    _replicator,
    _row_sampler,
    _unpack_inputs,
)
from paged_jax.engine.step_types import StepOutputs
from paged_jax.metadata import AttentionMetadata
from paged_jax.sharding import DATA_AXIS, per_replica
from paged_jax.sharding import data_parallel_size as data_parallel_size_of

log = logging.getLogger("paged_jax")


def _variant(batch, flags: dict, penalties, adapters, allowed, cand_allowed, scored) -> tuple:
    """What keys a compiled step apart from the other programs of its shape, in words:
    its rows (decode only, or prefill and decode: the attention path differs), its
    sampler (greedy only, batch-invariant) and the optional inputs ``ModelRunner.launch``
    got (None: absent)."""
    out = ["decode rows only" if flags["decode_only"] else "prefill and decode rows"]
    if flags["greedy_only"]:
        out.append("greedy rows only")
    if flags["batch_invariant"]:
        out.append("batch-invariant")
    names = ("penalties", "adapter rows", "token masks", "candidate masks", "prompt log-probs")
    extras = (penalties, adapters, allowed, cand_allowed, scored)
    out += [name for name, x in zip(names, extras, strict=True) if x is not None]
    if flags.get("logits_only"):
        out.append("logits only")
    rows, seqs = batch.logits_indices.shape[0], batch.kv_lens.shape[0]
    if rows != seqs:  # a verify step: a row for each token too
        out.append(f"speculative verify, {rows} sampled rows")
    return tuple(out)


def _describe(b: dict) -> str:
    return (
        f"{b['tokens']} tokens, {b['seqs']} sequences, "
        f"{b['pages_per_seq']} pages per sequence, {b['copies']} page copies"
        + (f", {b['beam_candidates']} beam candidates" if b["beam_candidates"] else "")
        + (f", {b['steps']} decode steps" if b.get("steps", 1) > 1 else "")
        + "".join(f", {v}" for v in b.get("variant", ()))
    )


# Steps of at most this many tokens (a bucket) compile with _small_step_options on CPU.

SMALL_STEP_TOKENS = 16
_SMALL_STEP_OPTIONS = (
    ("xla_cpu_use_xnnpack", False),
    ("xla_cpu_experimental_ynn_fusion_type", ""),
)


@functools.lru_cache(maxsize=1)
def _small_step_options() -> tuple | None:
    """XLA options for small steps on CPU, or None (another backend, or a jaxlib that
    does not know them). With YNNPACK's fusions off, XLA:CPU emits its own dots, which
    at a few rows read the weights faster, the same tokens; at 32 sequences and in
    prefill the default is as fast or faster (docs/DECISIONS.md, "Small-step XLA options
    on CPU")."""
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
    "logits_only",
    "score_top",
    "keep_logits",
)


@functools.lru_cache(maxsize=8)
def _make_run(
    graphdef, state_def, mesh, compiler_options: tuple | None = None, sort_free: bool | str = False
):
    """The engine's jitted step for one model structure (``graphdef``; its weights, the
    step's first argument, a tuple of arrays ``state_def`` unflattens into its
    ``nnx.State``) on one mesh (or None), compiled with ``compiler_options`` (XLA option
    name-value pairs; None: the defaults), drawing restricted rows by ``sort_free``
    (``sample_rows``; the engine passes ``SORT_FREE_BACKENDS``' entry). Cached,
    so engines of the same model (and config) in one process share compiled shape
    buckets. On a mesh, the step's outputs other than the cache are replicated (every
    process reads them whole)."""
    from flax import nnx

    replicated = _replicator(mesh)
    cpu_kernel = _cpu_kernel(mesh)

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
        allowed=None,
        adapters=None,
        cand_allowed=None,
        scored=None,
        *,
        layout,
        decode_only,
        batch_invariant,
        num_candidates,
        greedy_only,
        num_steps=1,
        logits_only=False,
        score_top=0,
        keep_logits=False,
    ):
        x = _unpack_inputs(inputs, layout)
        positions, out_pos, steps = x["positions"], x["out_pos"], x.get("steps")
        md = AttentionMetadata(
            **{k: x[k] for k in _MD_ARRAYS},
            decode_only=decode_only,
            batch_invariant=batch_invariant,
        )
        model = nnx.merge(graphdef, jax.tree.unflatten(state_def, weights))
        vocab_size = model.config.vocab_size
        if mesh is not None and data_parallel_size_of(mesh) > 1:  # each replica its rows
            rows = NamedSharding(mesh, PartitionSpec(DATA_AXIS))
            tokens = jax.lax.with_sharding_constraint(tokens, rows)
            positions = jax.lax.with_sharding_constraint(positions, rows)
        cache = per_replica(lambda c, s, d: c.copy_pages(s, d), cache, md.copy_src, md.copy_dst)

        sample = _row_sampler(
            x,
            penalties,
            allowed,
            invariant=md.batch_invariant,
            greedy_only=greedy_only,
            cpu_kernel=cpu_kernel,
            sort_free=sort_free,
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
            return StepOutputs.of_steps(toks, lps, last).map(replicated), cache
        extra = {} if adapters is None else {"adapter_ids": adapters}
        R = md.logits_indices.shape[0]  # the sampling rows
        if scored is not None:  # prompt positions' rows after them (prompt_logprobs)
            md = dataclasses.replace(
                md, logits_indices=jnp.concatenate([md.logits_indices, scored[0]])
            )
        logits, cache = check_step_output(
            model(tokens, positions, cache, md, **extra), md.logits_indices.shape[0], vocab_size
        )
        out = StepOutputs()
        if scored is not None:
            out.scores = prompt_scores(logits[R:], scored[1], score_top, cpu_kernel=cpu_kernel)
            logits = logits[:R]
        if logits_only:  # sampled by _make_sample's function once the masks are known
            out.logits = logits
            return out.map(replicated), cache
        out.tokens, out.logprobs = sample(logits, out_pos)
        if num_candidates:
            out.cand_logprobs, out.cand_ids = beam_candidates(logits, num_candidates, cand_allowed)
        out = out.map(replicated)
        if keep_logits:  # (static shapes: the extras sampler's input, if a row has extras)
            out.logits = logits
        return out, cache

    return run


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
def _copy_pages(cache, src, dst):
    """Copy-on-write copies (``i32[n]`` each, per replica as ``per_replica`` splits them)
    run ahead of a step: a fork wider than a step's own copies (``ModelRunner._launch``)."""
    return per_replica(lambda c, s, d: c.copy_pages(s, d), cache, src, dst)


@functools.partial(jax.jit, donate_argnums=0)
def _write_pages(cache, pages, data, scales):
    return per_replica(lambda c, *a: c.write_pages(*a), cache, pages, data, scales)
