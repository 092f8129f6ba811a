"""A step of the engine taken apart on its device: the prefill step's time and FLOP/s
(``prefill_split``), and a decode step split into the whole jitted step, attention of
every layer, the sampler each way, and the rest (``decode_split``). Used by
``bench_engine`` (its module docstring describes each figure)."""

from __future__ import annotations

import functools
import statistics

import numpy as np

from benchmarks.common import time_samples
from benchmarks.engine_roofline import PAGE, SHAPE_FIELDS, device_peaks, prefill_flops


def _device_time(fn) -> float:
    """Median seconds of ``fn()``, which blocks on its own result."""
    return statistics.median(time_samples(fn, repeats=20))


def _run_step(llm, tokens, inputs, layout, decode_only) -> None:
    """One call of the engine's jitted step (greedy rows, the pool donated), waited for."""
    import jax

    runner = llm.runner
    out, runner.cache = runner.step_fn(
        runner.weights,
        tokens,
        inputs,
        runner.cache,
        None,
        layout=layout,
        decode_only=decode_only,
        batch_invariant=False,
        num_candidates=0,
        greedy_only=True,
    )
    jax.block_until_ready(out.tokens)


def prefill_split(llm, name, backend, c, prompt_len) -> dict:
    """Times the engine's jitted step prefilling ``c`` prompts of ``prompt_len`` tokens
    in one step (a bucket the engine runs compiled when ``c`` is their concurrency;
    another ``c`` compiles its own first), with its FLOP/s against the device's peak."""
    import jax
    import jax.numpy as jnp

    from paged_jax.batch import ScheduledSeq, build_batch
    from paged_jax.block_manager import BlockManager
    from paged_jax.engine.runner import _pack_inputs
    from paged_jax.engine.step_types import SamplingColumns

    vocab = llm.model.config.vocab_size
    rng = np.random.default_rng(1)
    bm = BlockManager(llm.bm.num_pages, PAGE, enable_prefix_caching=False, watermark=0.0)
    for i in range(c):
        bm.allocate(i, rng.integers(0, vocab, prompt_len).tolist())
    batch = build_batch(bm, [ScheduledSeq(i, 0, prompt_len) for i in range(c)])
    inputs, layout = _pack_inputs(batch, SamplingColumns.idle(batch.kv_lens.shape[0]), None)
    args = (jnp.asarray(batch.token_ids), jnp.asarray(inputs), layout, False)
    _run_step(llm, *args)  # compiles a bucket the engine runs did not
    t = statistics.median(time_samples(lambda: _run_step(llm, *args), repeats=5))
    flops = prefill_flops(SHAPE_FIELDS[name], c, prompt_len) if name in SHAPE_FIELDS else 0.0
    peaks = device_peaks(jax.devices()[0].device_kind)
    return dict(
        model=name,
        backend=backend,
        sequences=c,
        prompt_len=prompt_len,
        tokens=c * prompt_len,
        tokens_bucket=int(batch.token_ids.shape[0]),
        ms=1e3 * t,
        tflops=flops / t / 1e12,
        of_peak=flops / t / peaks[0] if peaks else None,
    )


def decode_split(llm, name, backend, c, context) -> dict:
    """Times the parts of one decode step of ``c`` sequences at ``context`` tokens, reusing
    ``llm``'s jitted step (its shape bucket is already compiled by the engine runs)."""
    import jax
    import jax.numpy as jnp

    import paged_jax as pj
    from paged_jax import AttentionMetadata
    from paged_jax.batch import ScheduledSeq, build_batch
    from paged_jax.block_manager import BlockManager
    from paged_jax.engine.runner import _pack_inputs
    from paged_jax.engine.sampling import sample_rows
    from paged_jax.engine.step_types import SamplingColumns

    cfg = llm.model.config
    bm = BlockManager(llm.bm.num_pages, PAGE, enable_prefix_caching=False, watermark=0.0)
    rng = np.random.default_rng(0)
    for i in range(c):
        bm.allocate(i, rng.integers(0, cfg.vocab_size, context - 1).tolist())
        bm.mark_computed(i, context - 1)
        bm.append_slots(i, [1])
    batch = build_batch(bm, [ScheduledSeq(i, context - 1, context) for i in range(c)])
    md = AttentionMetadata.from_batch(batch)
    tokens = jnp.asarray(batch.token_ids)
    S = batch.kv_lens.shape[0]
    # the step's host inputs as the engine sends them (one buffer), here on the device
    inputs, layout = _pack_inputs(batch, SamplingColumns.idle(S), None)
    inputs = jnp.asarray(inputs)

    def whole():  # the engine's jitted step: copies, model, sampler (cache donated)
        _run_step(llm, tokens, inputs, layout, md.decode_only)

    H, D = cfg.num_heads, cfg.head_dim
    T = tokens.shape[0]
    q = jax.random.normal(jax.random.key(0), (T, H, D), llm.cache.dtype)

    @functools.partial(jax.jit, static_argnames="decode")
    def attn(q, cache, md, decode):  # every layer in one call, scanned as the step runs it
        def one_layer(out, i):
            kv, table, _, _ = cache.attention_inputs(i, md.page_indices)  # as the model does
            if decode:  # what a decode-only step runs: the decode kernel on S rows
                o = pj.paged_attention(q[:S], kv, md.kv_lens, table, sm_scale=D**-0.5)
                return out.at[:S].add(o), None
            o = pj.ragged_paged_attention(
                q, kv, md.kv_lens, table, md.cu_q_lens, md.num_seqs, sm_scale=D**-0.5
            )
            return out + o, None

        layers = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        return jax.lax.scan(one_layer, jnp.zeros(q.shape, jnp.float32), layers)[0]

    R = md.logits_indices.shape[0]
    logits = jax.random.normal(jax.random.key(1), (R, cfg.vocab_size), jnp.float32)
    samp = jax.jit(sample_rows, static_argnames=("greedy_only", "sort_free"))
    top_p = (
        jnp.ones(R, jnp.float32),
        jnp.zeros(R, jnp.int32),
        jnp.full(R, 0.9, jnp.float32),
        jnp.arange(R, dtype=jnp.uint32)[:, None],
        jnp.zeros(R, jnp.int32),
    )
    greedy_r = (jnp.zeros(R, jnp.float32), *top_p[1:2], jnp.ones(R, jnp.float32), *top_p[3:])
    # Logits N(0, 1): so flat that top-p 0.9 keeps most of the vocabulary (the sampler's
    # full-sort fallback); x8: a peaked distribution, as trained models give.
    peaked = logits * 8.0

    t_whole = _device_time(whole)
    t_attn = _device_time(lambda: jax.block_until_ready(attn(q, llm.cache, md, md.decode_only)))
    t_ragged = _device_time(lambda: jax.block_until_ready(attn(q, llm.cache, md, False)))
    t_greedy = _device_time(
        lambda: jax.block_until_ready(samp(logits, *greedy_r, greedy_only=True))
    )
    t_topp = _device_time(lambda: jax.block_until_ready(samp(logits, *top_p)))
    t_topp_peaked = _device_time(lambda: jax.block_until_ready(samp(peaked, *top_p)))
    t_free = _device_time(lambda: jax.block_until_ready(samp(logits, *top_p, sort_free=True)))
    t_free_peaked = _device_time(
        lambda: jax.block_until_ready(samp(peaked, *top_p, sort_free=True))
    )
    # the GPU's default way (the Pallas kernel, no conditional), where it compiles
    t_kernel = t_kernel_peaked = None
    if jax.default_backend() == "gpu":
        t_kernel = _device_time(
            lambda: jax.block_until_ready(samp(logits, *top_p, sort_free="pallas_gpu"))
        )
        t_kernel_peaked = _device_time(
            lambda: jax.block_until_ready(samp(peaked, *top_p, sort_free="pallas_gpu"))
        )
    # the radix rounds' other layout ([R, 16, V]: a reduction per trial), side by side
    from paged_jax.engine import sort_free

    minor = sort_free.TRIALS_MINOR
    sort_free.TRIALS_MINOR = not minor
    try:
        other = jax.jit(
            lambda *a, **k: sample_rows(*a, **k), static_argnames=("greedy_only", "sort_free")
        )
        t_free_other = _device_time(
            lambda: jax.block_until_ready(other(logits, *top_p, sort_free=True))
        )
    finally:
        sort_free.TRIALS_MINOR = minor
    return dict(
        model=name,
        backend=backend,
        concurrency=c,
        context=context,
        tokens_bucket=int(T),
        step_ms=1e3 * t_whole,
        decode_only=md.decode_only,
        attention_ms=1e3 * t_attn,
        attention_ragged_kernel_ms=1e3 * t_ragged,
        rest_of_model_ms=1e3 * (t_whole - t_attn - t_greedy),
        sampler_greedy_ms=1e3 * t_greedy,
        sampler_top_p_ms=1e3 * t_topp,
        sampler_top_p_peaked_ms=1e3 * t_topp_peaked,
        sampler_top_p_sort_free_ms=1e3 * t_free,
        sampler_top_p_peaked_sort_free_ms=1e3 * t_free_peaked,
        sampler_top_p_kernel_ms=None if t_kernel is None else 1e3 * t_kernel,
        sampler_top_p_peaked_kernel_ms=None if t_kernel_peaked is None else 1e3 * t_kernel_peaked,
        sort_free_trials_minor=minor,
        sampler_top_p_sort_free_other_layout_ms=1e3 * t_free_other,
    )
