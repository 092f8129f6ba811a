"""Compiling before serving: every step shape an engine configuration reaches
(``step_shapes``; ``paged_jax.engine.shapes``) run once on batches that touch only the
null page (``compile_all``, what ``LLM.warm_up()`` runs), each shape's programs apart
(overlapped merges, speculative verify steps, adapter rows), and the extras sampler of
each of their row counts (``extras_rows``: rows with penalties, masks or candidates
sample there once warmed up); a given workload run once
instead (``run_workload``); and the warm-up's lines on the terminal (``echo``)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

import numpy as np

from paged_jax.engine.sampling import SamplingParams
from paged_jax.engine.shapes import MIN_STEP_TOKENS, StepShape
from paged_jax.engine.shapes import step_shapes as _step_shapes
from paged_jax.engine.speculative.verifier import num_verify_rows

log = logging.getLogger("paged_jax")


def step_shapes(core) -> list[StepShape]:
    """The step shapes engine ``core`` reaches with static shapes, per data-parallel
    replica: what ``compile_all`` compiles."""
    sc = core.schedulers[0]
    return _step_shapes(
        max_num_seqs=sc.max_num_seqs,
        max_num_batched_tokens=sc.max_num_batched_tokens,
        pages_per_seq=core.runner.table_width,
        min_tokens=MIN_STEP_TOKENS,
        min_seqs=core.launcher.min_seqs,
        deterministic=core.deterministic,
        num_scheduler_steps=core.num_scheduler_steps,
    )


def compile_all(core, progress: bool) -> list[dict]:
    """Switches engine ``core`` to static shapes for good and runs every shape of
    ``step_shapes(core)`` once (and a draft model's own steps); returns the buckets
    compiled. The engine must be idle (its block tables change width)."""
    if core.has_unfinished():
        raise RuntimeError(
            "warm_up(): expected an idle engine (it switches every block table to its "
            "full width), but requests are unfinished"
        )
    runner = core.runner
    runner.static_shapes = True
    shapes = step_shapes(core)
    replicas = len(core.schedulers)
    token_buckets = sorted({s.tokens for s in shapes})
    merged: set[int] = set()  # row counts whose samples were merged (async steps)
    before = len(core.runner.compiled_buckets)
    t0 = time.perf_counter()
    with echo(progress):
        log.info("compiling %d step shapes (static shapes: tables of %d pages)",
                 len(shapes), runner.table_width)  # fmt: skip
        programs = compiled = 0  # a shape's variants (verify, adapters) compile apart
        for k, shape in enumerate(shapes):
            merges = ()
            if core.async_scheduling and shape.steps == 1 and shape.seqs not in merged:
                merged.add(shape.seqs)
                merges = token_buckets
            runs = _programs(core, shape, merges)
            for kw in runs:
                compiled += bool(runner.run_shape(shape, replicas, **kw))
            programs += len(runs)
            if progress and not (k + 1) % 8:
                log.info("%d of %d step shapes ready (%.1f s)", k + 1, len(shapes),
                         time.perf_counter() - t0)  # fmt: skip
        log.info(
            "every step shape ready: %d programs for %d shapes in %.1f s (%d new to "
            "this process)",
            programs, len(shapes), time.perf_counter() - t0, compiled,
        )  # fmt: skip
        rows = extras_rows(core, shapes)
        t1 = time.perf_counter()
        samplers = sum(runner.extras.warm(r) for r in rows)
        samplers += runner.warm_copies(len(core.schedulers))  # forks of over 8 sequences
        log.info(
            "the extras sampler (penalties, masks, candidates) ready for %d row counts "
            "in %.1f s (%d new to this process)",
            len(rows), time.perf_counter() - t1, samplers,
        )  # fmt: skip
        if core.speculator is not None:  # a draft model's own steps
            core.speculator.warm_up(progress)
        new = core.runner.compiled_buckets[before:]
    core.metrics.reset()
    return new


def run_workload(
    llm, num_seqs, prompt_len, max_tokens, sampling_params, progress: bool, salt
) -> list[dict]:
    """``LLM.warm_up(num_seqs, prompt_len, max_tokens)``: that workload run once on
    random token ids (``ignore_eos``), under prefix-cache salt ``salt`` (no page shared
    with real requests or an earlier warm-up: a prefix hit would shorten the prefill and
    compile other buckets); returns the buckets it compiled."""
    workload = (num_seqs, prompt_len, max_tokens)
    for name, v in zip(("num_seqs", "prompt_len", "max_tokens"), workload, strict=True):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected an int >= 1 (or no workload at all), got {v!r}")
    if prompt_len + max_tokens > llm.max_model_len:
        raise ValueError(
            f"prompt_len + max_tokens: expected <= max_model_len {llm.max_model_len}, "
            f"got {prompt_len} + {max_tokens}"
        )
    p = sampling_params or SamplingParams(temperature=0.0)
    p = dataclasses.replace(p, max_tokens=max_tokens, ignore_eos=True, stop_token_ids=())
    rng = np.random.default_rng(0)
    vocab = llm.model.config.vocab_size
    prompts = [rng.integers(0, vocab, prompt_len).tolist() for _ in range(num_seqs)]
    before = len(llm.compiled_buckets)
    with echo(progress):
        llm.generate(prompts, p, progress=False, cache_salt=salt)
    llm.metrics.reset()
    return llm.compiled_buckets[before:]


def extras_rows(core, shapes: list[StepShape]) -> list[int]:
    """The sampling-row counts of ``shapes``' single steps (all replicas together; a
    verify step's rows too): one extras sampler each (``ExtrasSampler.warm``)."""
    replicas = len(core.schedulers)
    rows = set()
    for shape in shapes:
        if shape.steps != 1:
            continue
        rows.add(shape.seqs * replicas)
        if core.speculator is not None and not shape.decode_only:
            rows.add(shape.seqs * replicas + _verify_rows(core, shape))
    return sorted(rows)


def _verify_rows(core, shape: StepShape) -> int:
    """A verify step's extra sampling rows at ``shape`` (all replicas together)."""
    replicas = len(core.schedulers)
    return num_verify_rows(
        shape.tokens * replicas,
        shape.seqs * replicas,
        0,
        core.speculator.config.num_speculative_tokens,
        static=True,
    )


def _programs(core, shape: StepShape, merges) -> list[dict]:
    """``ModelRunner.run_shape``'s arguments for each program of ``shape``: the plain
    step (and its overlapped form), a speculative verify step, steps with adapter rows,
    and for the widest shape that prefills, the step scoring prompt positions (prompt
    log-probs, whose steps all take that shape), with verify rows or adapters too."""
    overlapped = core.async_scheduling and shape.steps == 1
    runs = [dict(merges=merges, overlapped=overlapped)]
    speculates = core.speculator is not None and not shape.decode_only
    verify = _verify_rows(core, shape) if speculates else 0
    if verify and shape.steps == 1:
        runs.append(dict(verify=verify))  # verify steps
    if core.loras.max_loras and shape.steps == 1:  # steps with adapter rows
        runs.append(dict(overlapped=overlapped, adapters=True))
        if verify:
            runs.append(dict(verify=verify, adapters=True))
    widest = core.launcher.widest_shape()
    if not shape.decode_only and (shape.tokens, shape.seqs) == widest and shape.steps == 1:
        # the step scoring prompt positions (prompt_logprobs: the widest shape, always)
        runs.append(dict(overlapped=overlapped, scoring=True))
        if verify:
            runs.append(dict(verify=verify, scoring=True))
        if core.loras.max_loras:
            runs.append(dict(overlapped=overlapped, adapters=True, scoring=True))
    return runs


@contextlib.contextmanager
def echo(on: bool):
    """The "paged_jax" logger's INFO lines printed to stderr (``warm-up: ...``) while on."""
    if not on:
        yield
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("warm-up: %(message)s"))
    log.addHandler(handler)
    old_level = log.level
    log.setLevel(min(old_level or logging.WARNING, logging.INFO))
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
