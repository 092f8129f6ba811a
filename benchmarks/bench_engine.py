"""The engine on an accelerator: tokens/s of random-weight models built on the device, a
decode step split into its parts, and transformers ``generate`` on the same device.

``python -m benchmarks engine [--out DIR] [--models smollm2-135m llama3-8b]
[--concurrency 64 256] [--prompt-len 128] [--output-len 128] [--backends pallas_gpu xla]
[--repeats 3] [--transformers] [--decode-kernel on|off|both] [--layout per-layer|scan|both]
[--num-scheduler-steps K] [--async-scheduling on|off|both] [--prefill-tokens N ...]
[--no-split] [--quantization none int8 fp8 int4] [--lora-adapters 0 8]``

Models: SmolLM2-135M-shaped and Llama-3-8B-shaped decoders (``SHAPE_FIELDS``), random weights,
bf16 weights, activations and KV cache, built on the device (real checkpoints are not needed
to time them). Workload per concurrency C: C requests of ``--prompt-len`` random tokens
(no shared prefixes; prefix caching off), each generating exactly ``--output-len`` greedy
tokens, all submitted at once. tokens/s = C * output_len / wall time of ``LLM.generate``,
after one untimed run of the same workload that compiles its shape buckets; min / median /
max of ``--repeats`` runs.

Decode step split, for C sequences at context ``prompt_len + output_len // 2``, each part
jitted and timed alone on the device (median of 20): the engine's whole jitted step
(copies, model, sampler; the engine's own compiled function); attention
of every layer in one jitted call, as the step runs it (``paged_attention``, the decode
kernel, since decode-only steps use it) and with ``ragged_paged_attention``); the sampler
(``sample_rows``: greedy rows as the engine runs them, ``greedy_only``; top-p 0.9 rows on
flat N(0, 1) logits, which take the full-sort fallback, and on peaked ones, x8; the same
two with ``sort_free="xla"``, XLA's passes that neither sort nor take a top-k, and on a
GPU with ``sort_free="pallas_gpu"``, the same passes in the GPU's kernel, its default); the rest of
the model is the step minus attention minus the greedy sampler (projections,
MLP, norms, rotary, KV writes, LM head).
Host time per step is the engine run's wall time outside its jitted calls, per step.
The device's share splits into the dispatch calls and the waits for the sampled tokens
(``dispatch_ms_per_step``, ``wait_ms_per_step``; a dispatch near a device step means it
waited for the device), ``phase_ms_per_step`` gives where the wall went (the engine's
``_launch``, ``_complete``, ``_place`` and ``merge_tokens``, and the thread's CPU time),
and ``decode_wall_ms_per_step`` is the steady decode's wall time a step (the median of the
``step()`` calls that completed one decode step of every sequence): with overlapped steps
(``async_scheduling``) it is to equal the device's step alone, the split's ``step_ms``.
``--async-scheduling off`` runs steps one at a time, ``both`` each way.

Prefill step, per concurrency C (and per ``--prefill-tokens`` N: N / prompt_len prompts,
a bucket each that compiles first): the engine's jitted step prefilling C prompts of
``--prompt-len`` in one step, timed alone (median of 5), with its FLOPs
(``prefill_flops``) per second against the device's bf16 peak.
By default every prompt of the largest concurrency is prefilled in one step
(``--max-num-batched-tokens``), which keeps the number of compiled shape buckets small.

``--decode-kernel off`` runs the engine with every step on the ragged kernel (decode-only
steps otherwise use the decode kernel: ``AttentionMetadata.decode_only``), ``both`` runs
it each way, for the side-by-side ratio.

``--layout scan`` runs the engine with the model's weights as loaded (stacked, the layers
scanned) instead of ``hold_for_accelerator``'s per-layer weights and unrolled layers;
``both`` runs each, a fresh model each time, for the side-by-side ratio. On a device
whose peaks ``PEAKS`` knows (H100, H200), each row also has the workload's roofline
(``roofline_tokens_per_s``) and the fraction of it reached; every row has the first run's
compile seconds and the wall time per step beside the host's and the device's.

``--quantization`` runs the model with its weights in each format in turn (``none``: bf16
as built; ``int8``, ``fp8``, ``int4``: ``LlamaForCausalLM.quantize`` on the device, a
fresh model each; ``fp8`` multiplies fp8 rows on a GPU with fp8 units, as the engine does
there, ``fp8-weight-only`` widens the weights instead), for the side-by-side ratio; the
roofline stays bf16's.
``--lora-adapters N ...`` runs an engine with ``N`` LoRA slots and ``N`` random adapters
of rank 16 on every projection (``benchmarks.bench_lora.random_adapter``), the requests
spread over them in turn (0: an engine without slots, the base model), each in turn.

``--transformers`` first runs transformers' ``generate`` (greedy, the same shapes, bf16,
its default attention) in a subprocess that imports no JAX, so the two never share the
device's memory.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from benchmarks.common import environment, positive_int, table, time_samples, write_result

# Shapes of the public checkpoints (config.json of each); weights are random here.
SHAPE_FIELDS = {
    "smollm2-135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    "llama3-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        max_position_embeddings=8192,
    ),
}
PAGE = 16
LORA_RANK = 16  # --lora-adapters' rank, on every projection


def _stats(samples: list[float]) -> dict:
    return dict(min=min(samples), median=statistics.median(samples), max=max(samples))


def _prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, (n, length)).tolist()


def abstract_decode_step(make, seqs: int, context: int, page: int = PAGE):
    """A decode step of ``make()``'s model (a ``LlamaForCausalLM``) built from shapes
    alone (``nnx.eval_shape``: nothing allocated): ``(graphdef, state, cache, batch, md)``
    for ``seqs`` sequences of ``context - 1`` computed tokens computing one more each,
    the cache (``ShapeDtypeStruct``s) just large enough, in pages of ``page`` tokens."""
    import jax
    from flax import nnx

    import paged_jax as pj

    abstract = nnx.eval_shape(make)
    graphdef, state = nnx.split(abstract)
    pages = seqs * -(-context // page) + 1
    cache = jax.eval_shape(lambda: abstract.make_cache(pages, page))
    bm = pj.BlockManager(pages, page, enable_prefix_caching=False, watermark=0.0)
    for i in range(seqs):
        bm.allocate(i, list(range(context - 1)))
        bm.mark_computed(i, context - 1)
        bm.append_slots(i, [1])
    batch = pj.build_batch(bm, [pj.ScheduledSeq(i, context - 1, context) for i in range(seqs)])
    return graphdef, state, cache, batch, pj.AttentionMetadata.from_batch(batch)


def weight_reads(
    fields: dict,
    *,
    dtype="float32",
    seqs: int = 1,
    context: int = 8,
    layers=(2, 4),
    hold=None,
    backend: str = "xla",
    compile_fn=None,
) -> dict:
    """How many times XLA's cost analysis says one compiled decode step reads each byte of
    the layers' weights, for a model of config ``fields`` held as the engine holds a model
    off the CPU (``hold_for_accelerator``; or ``hold(model)`` when given, which returns
    the model), built from shapes alone (nothing allocated).

    The step (``seqs`` sequences at ``context`` tokens, the XLA attention backend, the
    model's own ``__call__``) is compiled for four models: ``layers[0]`` and ``layers[1]``
    layers, each at the config's width and 5/4 of it (``hidden_size`` and
    ``intermediate_size``; the same heads). ``bytes_per_weight_byte`` is the double
    difference of the bytes accessed over that of the weight bytes: 1.0 when each weight
    is read once, in place; about 3 when each layer's slice is copied out of a stack; far
    below 1 when the layers run in a loop whose body the analysis counts once. The
    differences cancel what the analysis charges that is not a layer's weights: the
    embedding lookup (a gather is charged its whole table) and the head do not grow
    with layers, attention and the pool do not grow with the width. The pool is kept
    small (default: one sequence's page and the null page), because each in-place
    scatter and gather is charged its whole ``[L, N, ...]`` operand, which grows with
    layers x layers. Also returns the four ``bytes_accessed`` and ``weight_bytes``
    (``[narrow, wide]`` per layer count) and the compile seconds. ``backend``: the
    attention backend; ``compile_fn(fn, *args)``: what compiles the step (default:
    ``jax.jit(fn).lower(*args).compile()`` on the default device; for a TPU,
    ``paged_jax.kernels.tpu.aot.compile_for_tpu``)."""
    import time

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from paged_jax import models

    dt = jnp.dtype(dtype)

    def one(f):
        cfg = models.LlamaConfig(**f)

        def make():
            m = models.LlamaForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=dt, param_dtype=dt)
            return m.hold_for_accelerator() if hold is None else hold(m)

        graphdef, state, cache, batch, md = abstract_decode_step(make, seqs, context)

        def step(state, tokens, positions, cache):
            return nnx.merge(graphdef, state)(tokens, positions, cache, md, backend=backend)

        t = time.perf_counter()
        args = (state, jnp.asarray(batch.token_ids), jnp.asarray(batch.positions), cache)
        if compile_fn is None:
            compiled = jax.jit(step, donate_argnums=(3,)).lower(*args).compile()
        else:
            compiled = compile_fn(step, *args)
        seconds = time.perf_counter() - t
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
        return cost["bytes accessed"], weights, seconds

    def widths(num_layers):
        f = dict(fields, num_layers=num_layers)
        wide = dict(
            f,
            hidden_size=f["hidden_size"] * 5 // 4,
            intermediate_size=f["intermediate_size"] * 5 // 4,
        )
        return one(f), one(wide)

    runs = [widths(n) for n in layers]
    (b00, w00, _), (b01, w01, _) = runs[0]
    (b10, w10, _), (b11, w11, _) = runs[1]
    return dict(
        bytes_per_weight_byte=((b11 - b10) - (b01 - b00)) / ((w11 - w10) - (w01 - w00)),
        bytes_accessed=[[r[0] for r in pair] for pair in runs],
        weight_bytes=[[r[1] for r in pair] for pair in runs],
        compile_s=sum(r[2] for pair in runs for r in pair),
    )


# Dense bf16 peak (FLOP/s) and memory bandwidth (bytes/s) by device kind, from the
# vendor's data sheets (SXM parts).
PEAKS = {"H100": (989e12, 3.35e12), "H200": (989e12, 4.8e12)}


def device_peaks(device_kind: str) -> tuple[float, float] | None:
    """``(bf16 FLOP/s, bytes/s)`` of a device kind ("NVIDIA H100 80GB HBM3"), or None."""
    for key, peaks in PEAKS.items():
        if key in device_kind:
            return peaks
    return None


def prefill_flops(fields: dict, concurrency: int, prompt_len: int) -> float:
    """FLOPs of one step prefilling ``concurrency`` prompts of ``prompt_len`` tokens: the
    layers' products for every token, the head for each prompt's last, causal attention."""
    E, F, L, V = (
        fields[k] for k in ("hidden_size", "intermediate_size", "num_layers", "vocab_size")
    )
    H, K, D = fields["num_heads"], fields["num_kv_heads"], fields["head_dim"]
    layer = 2 * E * H * D + 2 * E * K * D + 3 * E * F
    attn = 4 * L * H * D
    P = prompt_len
    return concurrency * (2 * L * layer * P + 2 * V * E + attn * P * (P + 1) / 2)


def roofline_tokens_per_s(
    fields: dict, concurrency: int, prompt_len: int, output_len: int, peaks, bytes_per=2
) -> float:
    """Output tokens/s of the workload if every step took the larger of its bytes over the
    bandwidth and its FLOPs over the peak (``peaks``: ``device_peaks``), with 16-bit
    weights and KV: one prefill step of every prompt (its products, logits for the last
    token only, causal attention), then ``output_len - 1`` decode steps, step k reading
    every weight (the embedding table included) and the KV of ``prompt_len + k`` tokens
    per sequence. (Issue 57's table counted every parameter's two FLOPs for every prompt
    token; this ideal is a few percent higher, so its fractions a few percent lower.)"""
    flops_peak, bandwidth = peaks
    E, F, L, V = (
        fields[k] for k in ("hidden_size", "intermediate_size", "num_layers", "vocab_size")
    )
    H, K, D = fields["num_heads"], fields["num_kv_heads"], fields["head_dim"]
    layer = 2 * E * H * D + 2 * E * K * D + 3 * E * F
    products = L * layer + V * E  # the layers and the head
    tables = 1 if fields.get("tie_word_embeddings") else 2
    weights = bytes_per * (L * (layer + 2 * E) + E + tables * V * E)
    kv_per_token = bytes_per * L * 2 * K * D
    attn = 4 * L * H * D  # QK and PV FLOPs per (query, key) pair
    C, P = concurrency, prompt_len
    seconds = prefill_flops(fields, C, P) / flops_peak
    for k in range(1, output_len):
        context = P + k
        flops = C * (2 * products + attn * context)
        seconds += max((weights + C * context * kv_per_token) / bandwidth, flops / flops_peak)
    return C * output_len / seconds


# --------------------------------------------------------------------------- transformers
def transformers_peer(
    name: str, concurrency: list[int], prompt_len: int, output_len: int, repeats: int
) -> dict:
    """transformers ``generate`` on the GPU (runs in the subprocess; imports no JAX)."""
    import torch
    import transformers

    f = SHAPE_FIELDS[name]
    cfg = transformers.LlamaConfig(
        vocab_size=f["vocab_size"],
        hidden_size=f["hidden_size"],
        intermediate_size=f["intermediate_size"],
        num_hidden_layers=f["num_layers"],
        num_attention_heads=f["num_heads"],
        num_key_value_heads=f["num_kv_heads"],
        head_dim=f["head_dim"],
        rope_theta=f["rope_theta"],
        max_position_embeddings=f["max_position_embeddings"],
        tie_word_embeddings=f.get("tie_word_embeddings", False),
    )
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    rows = []
    for c in concurrency:
        ids = torch.tensor(_prompts(c, prompt_len, f["vocab_size"]), device="cuda")
        kw = dict(
            attention_mask=torch.ones_like(ids),
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=0,
        )
        with torch.inference_mode():
            model.generate(ids, **kw)  # warm-up
            times = []
            for _ in range(repeats):
                torch.cuda.synchronize()
                t = time.perf_counter()
                out = model.generate(ids, **kw)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
        assert out.shape == (c, prompt_len + output_len), out.shape
        tps = [c * output_len / t for t in times]
        rows.append(
            dict(
                model=name,
                system="transformers generate",
                concurrency=c,
                tokens_per_s=_stats(tps),
                wall_s=_stats(times),
            )
        )
        del ids, out
    return dict(
        rows=rows,
        versions=dict(
            torch=torch.__version__,
            transformers=transformers.__version__,
            attn_implementation=model.config._attn_implementation,
        ),
    )


def run_transformers(args) -> list[dict]:
    out = []
    for name in args.models:
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.bench_engine",
            "--peer",
            name,
            "--concurrency",
            *map(str, args.concurrency),
            "--prompt-len",
            str(args.prompt_len),
            "--output-len",
            str(args.output_len),
            "--repeats",
            str(args.repeats),
        ]
        p = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        if p.returncode or not lines:
            out.append(
                dict(
                    model=name, system="transformers generate", error=(p.stderr or p.stdout)[-600:]
                )
            )
            continue
        res = json.loads(lines[-1])
        for r in res["rows"]:
            r["versions"] = res["versions"]
        out.extend(res["rows"])
    return out


# --------------------------------------------------------------------------- this engine
def build_model(name: str):
    import jax.numpy as jnp

    from paged_jax import models

    cfg = models.LlamaConfig(**SHAPE_FIELDS[name])
    return models.init_model(cfg, seed=0, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)


def _held(layout: str):
    """While active with ``layout="scan"``, ``LLM`` leaves a model off the CPU as loaded
    (stacked weights, scanned layers) instead of calling its ``hold_for_accelerator``:
    the engine as it was before, for the side-by-side ratio."""
    from unittest import mock

    from paged_jax.models import LlamaForCausalLM

    if layout == "scan":
        return mock.patch.object(LlamaForCausalLM, "hold_for_accelerator", lambda self: self)
    return contextlib.nullcontext()


class _Phases:
    """While active, the seconds ``llm`` spends in each phase of its steps, summed: its
    engine core's ``_launch`` (scheduling, batch building and the dispatch call) and
    ``_complete`` (waiting for the sampled tokens and applying them), the launcher's
    ``place`` and the runner's ``merge_tokens`` (an overlapped step's placeholders), by
    wrapping them on the instances; and the calling thread's CPU seconds
    (``time.thread_time``): a phase whose wall time far exceeds the CPU time it took was
    waiting (on the device, a lock)."""

    # (owner in the engine core, method, phase)
    PHASES = (("core", "_launch", "launch"), ("core", "_complete", "complete"))
    PHASES += (("launcher", "place", "place"),)

    def __init__(self, llm):
        self.core = llm.engine  # (its steps' phases are the engine core's methods)
        self.llm, self.s = llm, dict.fromkeys(("launch", "complete", "place", "merge"), 0.0)
        self.calls = []  # per _step call: (seconds, tokens computed by the steps it completed)

    def _owner(self, name: str):
        return self.core if name == "core" else getattr(self.core, name)

    def _wrap(self, owner, attr, key):
        fn = getattr(owner, attr)

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.s[key] += time.perf_counter() - t

        setattr(owner, attr, timed)

    def __enter__(self):
        for owner, attr, key in self.PHASES:
            self._wrap(self._owner(owner), attr, key)
        step, m = self.core._step, self.llm.metrics

        def timed_step():
            t, n = time.perf_counter(), m.tokens_computed
            try:
                return step()
            finally:
                self.calls.append((time.perf_counter() - t, m.tokens_computed - n))

        self.core._step = timed_step
        self._wrap(self.llm.runner, "merge_tokens", "merge")
        self.cpu0 = time.thread_time()
        return self

    def __exit__(self, *exc):
        self.s["cpu"] = time.thread_time() - self.cpu0
        for owner, attr, _ in self.PHASES:
            del self._owner(owner).__dict__[attr]
        del self.core.__dict__["_step"]
        del self.llm.runner.__dict__["merge_tokens"]

    def decode_call_ms(self, c: int) -> float | None:
        """Median milliseconds of the calls that completed one decode step of all ``c``
        sequences (``c`` tokens): the steady decode's wall time a step."""
        got = [t for t, n in self.calls if n == c]
        return 1e3 * statistics.median(got) if got else None


def engine_runs(
    model,
    name,
    backend,
    args,
    layout="per-layer",
    overlap: bool = True,
    loras: int = 0,
    quantization: str | None = None,
) -> list[dict]:
    import jax

    from benchmarks.bench_lora import random_adapter
    from paged_jax.engine import LLM, SamplingParams

    cfg = model.config
    c_max = max(args.concurrency)
    pages = c_max * -(-(args.prompt_len + args.output_len) // PAGE) + 1
    with _held(layout):
        llm = LLM(
            model,
            num_pages=int(pages * 1.1) + 8,
            page_size=PAGE,
            max_num_seqs=c_max,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=False,
            watermark=0.0,
            num_scheduler_steps=args.num_scheduler_steps,
            async_scheduling=overlap,
            max_loras=loras,
        )
    names = [f"a{i}" for i in range(loras)]
    for i, n in enumerate(names):
        llm.add_lora(n, random_adapter(cfg, n, LORA_RANK, seed=i))

    def generate(prompts, params):
        """``llm.generate``, or with adapters each request on the next one in turn."""
        if not names:
            return llm.generate(prompts, params, progress=False)
        plist = params if isinstance(params, list) else [params] * len(prompts)
        for i, (prompt, p) in enumerate(zip(prompts, plist, strict=True)):
            llm.add_request(i, prompt, p, lora=names[i % len(names)])
        done = {}
        while llm.has_unfinished():
            for out in llm.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in range(len(prompts))]

    peaks = device_peaks(jax.devices()[0].device_kind)
    rows = []
    for c in args.concurrency:
        prompts = _prompts(c, args.prompt_len, cfg.vocab_size, seed=c)
        if args.top_p is None:
            params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
        else:  # sampled: temperature 1, one seed per request
            params = [
                SamplingParams(
                    max_tokens=args.output_len,
                    ignore_eos=True,
                    temperature=1.0,
                    top_p=args.top_p,
                    seed=i,
                )
                for i in range(c)
            ]
        before = dataclasses.replace(llm.metrics)
        t = time.perf_counter()
        generate(prompts, params)
        first = time.perf_counter() - t
        cold = _delta(llm.metrics, before)
        times, m = [], None
        for _ in range(args.repeats):
            before = dataclasses.replace(llm.metrics)
            with _Phases(llm) as phases:
                t = time.perf_counter()
                res = generate(prompts, params)
                times.append(time.perf_counter() - t)
            m = _delta(llm.metrics, before)
        assert all(len(r.outputs[0].token_ids) == args.output_len for r in res)
        tps = [c * args.output_len / t for t in times]
        ideal = (
            roofline_tokens_per_s(SHAPE_FIELDS[name], c, args.prompt_len, args.output_len, peaks)
            if peaks and name in SHAPE_FIELDS
            else None
        )
        rows.append(
            dict(
                model=name,
                system=f"paged-jax ({backend})",
                layout=layout,
                quantization=quantization,
                lora_adapters=loras,
                num_scheduler_steps=args.num_scheduler_steps,
                concurrency=c,
                tokens_per_s=_stats(tps),
                wall_s=_stats(times),
                roofline_tokens_per_s=ideal,
                roofline_fraction=None if ideal is None else _stats([x / ideal for x in tps]),
                first_run_s=first,
                first_run_compile_s=cold.compile_s,
                first_run_compilations=cold.compilations,
                steps=m.steps,
                wall_ms_per_step=1e3 * statistics.median(times) / max(m.steps, 1),
                host_ms_per_step=1e3 * m.host_s / max(m.steps, 1),
                device_ms_per_step=1e3 * m.step_s / max(m.steps, 1),
                # the last timed run's split of the device share, and where its wall went
                async_scheduling=overlap,
                overlapped_steps=m.overlapped_steps,
                dispatch_ms_per_step=1e3 * m.dispatch_s / max(m.steps, 1),
                wait_ms_per_step=1e3 * m.wait_s / max(m.steps, 1),
                phase_ms_per_step={k: 1e3 * v / max(m.steps, 1) for k, v in phases.s.items()},
                # the steady decode's wall a step (calls that completed c tokens), and the
                # first calls (the prompts' step, dispatched then waited for)
                decode_wall_ms_per_step=phases.decode_call_ms(c),
                first_calls_ms=[1e3 * t for t, _ in phases.calls[:3]],
                compile_s_in_timed_runs=m.compile_s,
            )
        )
    return rows, llm


@contextlib.contextmanager
def _sort_free(way: str):
    """While active, engines built draw restricted rows ``way`` on this backend ("default":
    as ``SORT_FREE_BACKENDS`` says; "off": the candidates and the full-sort fallback)."""
    import jax

    from paged_jax.engine import runner

    saved = runner.SORT_FREE_BACKENDS
    if way != "default":
        table = dict(saved)
        table.pop(jax.default_backend(), None)
        if way != "off":
            table[jax.default_backend()] = way
        runner.SORT_FREE_BACKENDS = table
    try:
        yield
    finally:
        runner.SORT_FREE_BACKENDS = saved


@contextlib.contextmanager
def _traced_setting(owner, name: str, value):
    """While active, ``owner.name`` is ``value``: a module-level setting the engine's step
    reads when it is traced. The engine's step functions are cached per model
    (``runner._make_run``), so the cache is emptied on the way in and, where the setting
    changed, on the way out, and each engine traces its own step."""
    from paged_jax.engine import runner

    saved = getattr(owner, name)
    setattr(owner, name, value)
    runner._make_run.cache_clear()
    try:
        yield
    finally:
        if getattr(owner, name) != saved:
            runner._make_run.cache_clear()
        setattr(owner, name, saved)


def _decode_prefetch(way: str):
    """While active, the Pallas GPU decode kernel's walk is ``way``: "default" (as
    ``tuning.DECODE_PREFETCH`` says), "on" (loading each next block ahead) or "off"."""
    from paged_jax.kernels.gpu import tuning

    if way == "default":
        return contextlib.nullcontext()
    return _traced_setting(tuning, "DECODE_PREFETCH", way == "on")


@contextlib.contextmanager
def _w8a16_kernel(way: str):
    """While active, W8A16 products (int8, fp8 weight-only) on a GPU go through the
    few-row Pallas product ("on"), XLA's dots ("off"), or as
    ``models.layers.KERNELS["w8a16"]`` says ("default"); the engine's cached steps are
    traced again (``_traced_setting``)."""
    from paged_jax.engine import runner
    from paged_jax.models.layers import KERNELS, use_kernel

    if way == "default":
        yield
        return
    platforms = ("gpu",) if way == "on" else ()
    saved = KERNELS["w8a16"].platforms
    runner._make_run.cache_clear()
    try:
        with use_kernel("w8a16", platforms):
            yield
    finally:
        if platforms != saved:
            runner._make_run.cache_clear()


@contextlib.contextmanager
def _decode_kernel(on: bool):
    """While active with ``on=False``, every engine step is built with ``decode_only=False``
    (the ragged kernel for decode steps too): the engine as it was before the decode path."""
    from paged_jax.metadata import AttentionMetadata

    orig = AttentionMetadata.__dict__["from_batch"]
    if not on:
        AttentionMetadata.from_batch = classmethod(
            lambda cls, b, **kw: dataclasses.replace(orig.__func__(cls, b, **kw), decode_only=False)
        )
    try:
        yield
    finally:
        AttentionMetadata.from_batch = orig


def _delta(after, before):
    return dataclasses.replace(
        after,
        steps=after.steps - before.steps,
        step_s=after.step_s - before.step_s,
        dispatch_s=after.dispatch_s - before.dispatch_s,
        wait_s=after.wait_s - before.wait_s,
        overlapped_steps=after.overlapped_steps - before.overlapped_steps,
        host_s=after.host_s - before.host_s,
        compile_s=after.compile_s - before.compile_s,
        compilations=after.compilations - before.compilations,
    )


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


def peer_main(argv) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer", required=True, choices=sorted(SHAPE_FIELDS))
    ap.add_argument("--concurrency", type=positive_int, nargs="+", required=True)
    ap.add_argument("--prompt-len", type=positive_int, required=True)
    ap.add_argument("--output-len", type=positive_int, required=True)
    ap.add_argument("--repeats", type=positive_int, required=True)
    a = ap.parse_args(argv)
    res = transformers_peer(a.peer, a.concurrency, a.prompt_len, a.output_len, a.repeats)
    print(json.dumps(res))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--peer" in argv:
        return peer_main(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(SHAPE_FIELDS), choices=sorted(SHAPE_FIELDS))
    ap.add_argument("--concurrency", type=positive_int, nargs="+", default=[64, 256])
    ap.add_argument("--prompt-len", type=positive_int, default=128)
    ap.add_argument("--output-len", type=positive_int, default=128)
    ap.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=None,
        help="default: every prompt of the largest concurrency in one step",
    )
    ap.add_argument(
        "--backends",
        nargs="+",
        default=["auto"],
        choices=["auto", "xla", "pallas_gpu", "pallas_tpu", "cpu"],
    )
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument(
        "--decode-kernel",
        choices=["on", "off", "both"],
        default="on",
        help="decode-only steps on the decode kernel (on), the ragged one (off), or each way",
    )
    ap.add_argument(
        "--layout",
        choices=["per-layer", "scan", "both"],
        default="per-layer",
        help="off the CPU: the engine's layout (per-layer weights, unrolled layers), the "
        "scanned stack as loaded (before), or each",
    )
    ap.add_argument("--num-scheduler-steps", type=positive_int, default=1)
    ap.add_argument(
        "--prefill-tokens",
        type=positive_int,
        nargs="*",
        default=[],
        help="also time a step prefilling this many tokens (prompts of --prompt-len), "
        "each a bucket of its own to compile; the concurrencies' prefill steps always",
    )
    ap.add_argument(
        "--async-scheduling",
        choices=["on", "off", "both"],
        default="on",
        help="overlapped steps (the default), steps one at a time, or each way",
    )
    ap.add_argument(
        "--no-split",
        action="store_true",
        help="skip the decode and prefill step splits (engine runs only; they run after the "
        "overlapped engine's runs)",
    )
    ap.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="sample every request at temperature 1 with this top-p (default: greedy)",
    )
    ap.add_argument(
        "--sort-free",
        nargs="+",
        default=["default"],
        choices=["default", "off", "xla", "pallas_gpu", "pallas_gpu_split"],
        help="how the engine draws restricted rows on this backend (SORT_FREE_BACKENDS): "
        "as the engine's default, the top-k candidates with the full-sort fallback (off), "
        "or sort-free, XLA's passes, the Pallas kernel (a program per row) or XLA's passes "
        "over the split kernel's sums; each in turn",
    )
    ap.add_argument(
        "--decode-prefetch",
        nargs="+",
        default=["default"],
        choices=["default", "off", "on"],
        help="GPU: the decode kernel's walk, plain (off), loading each next block ahead (on), "
        "or as tuning.DECODE_PREFETCH says; each in turn",
    )
    ap.add_argument(
        "--w8a16-kernel",
        nargs="+",
        default=["default"],
        choices=["default", "off", "on"],
        help="GPU: W8A16 products (int8, fp8 weight-only) through the few-row Pallas product "
        "(on), XLA's dots (off), or as models.layers.KERNELS['w8a16'] says; each in turn",
    )
    ap.add_argument(
        "--quantization",
        nargs="+",
        default=["none"],
        choices=["none", "int8", "fp8", "fp8-weight-only", "int4"],
        help="the weights in each format in turn (none: bf16), quantized on the device; "
        "fp8 multiplies fp8 rows where the GPU has fp8 units (W8A8), fp8-weight-only never",
    )
    ap.add_argument(
        "--lora-adapters",
        type=int,
        nargs="+",
        default=[0],
        help=f"engines with N LoRA slots and N random rank-{LORA_RANK} adapters, the requests "
        "spread over them (0: no slots), each in turn",
    )
    ap.add_argument(
        "--transformers",
        action="store_true",
        help="also time transformers generate (needs torch with CUDA)",
    )
    args = ap.parse_args(argv)
    if args.max_num_batched_tokens is None:
        args.max_num_batched_tokens = max(args.concurrency) * args.prompt_len
    for flag, vals in (
        ("--concurrency", args.concurrency),
        ("--prompt-len", [args.prompt_len]),
        ("--output-len", [args.output_len]),
    ):
        if min(vals) < 1:
            ap.error(f"{flag}: expected integers >= 1, got {vals}")
    if min(args.lora_adapters) < 0:
        ap.error(f"--lora-adapters: expected integers >= 0, got {args.lora_adapters}")
    peers = run_transformers(args) if args.transformers else []  # before JAX takes the GPU
    import jax

    from paged_jax.attention import _ENV_OVERRIDE as BACKEND_ENV
    from paged_jax.attention import _auto

    env = environment(with_jax=True)
    rows, splits, prefills = list(peers), [], []

    def save(rows, splits):
        return write_result(
            f"engine_{jax.default_backend()}",
            {
                "benchmark": "engine",
                "environment": env,
                "parameters": dict(
                    models={m: SHAPE_FIELDS[m] for m in args.models},
                    concurrency=args.concurrency,
                    prompt_len=args.prompt_len,
                    output_len=args.output_len,
                    page_size=PAGE,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    dtype="bfloat16",
                    repeats=args.repeats,
                    backends=args.backends,
                    decode_kernel=args.decode_kernel,
                    layout=args.layout,
                    num_scheduler_steps=args.num_scheduler_steps,
                    async_scheduling=args.async_scheduling,
                    top_p=args.top_p,
                    sort_free=args.sort_free,
                    decode_prefetch=args.decode_prefetch,
                    w8a16_kernel=args.w8a16_kernel,
                    quantization=args.quantization,
                    lora_adapters=args.lora_adapters,
                    lora_rank=LORA_RANK,
                ),
                "results": rows,
                "decode_step_split": splits,
                "prefill_step": prefills,
            },
        )

    layouts = ["per-layer", "scan"] if args.layout == "both" else [args.layout]
    for name, layout, quant in itertools.product(args.models, layouts, args.quantization):
        model = build_model(name)  # a fresh one: the engine holds it in place
        quant = None if quant == "none" else quant
        if quant is not None:
            model.quantize(quant.removesuffix("-weight-only"))
        if quant == "fp8-weight-only" and jax.default_backend() != "cpu":
            model.hold_for_accelerator(fp8_activations=False)  # kept by the engine's call
        for backend in args.backends:
            if backend == "auto":
                os.environ.pop(BACKEND_ENV, None)
            else:
                os.environ[BACKEND_ENV] = backend
            base = backend if backend != "auto" else f"auto: {_auto()}"
            if len(layouts) > 1:
                base = f"{base}, {layout}"
            if quant is not None:
                base = f"{base}, {quant} weights"
            ways = {"on": [True], "off": [False], "both": [True, False]}
            for on, overlap, sort_free, walk, w8, loras in itertools.product(
                ways[args.decode_kernel],
                ways[args.async_scheduling],
                args.sort_free,
                args.decode_prefetch,
                args.w8a16_kernel,
                sorted(args.lora_adapters),  # no slots first: slots stay on the model
            ):
                label = base if on else f"{base}, ragged kernel for decode steps"
                if not overlap:
                    label = f"{label}, steps one at a time"
                if sort_free != "default":
                    label = f"{label}, sort-free {sort_free}"
                if walk != "default":
                    label = f"{label}, decode prefetch {walk}"
                if w8 != "default":
                    label = f"{label}, W8A16 kernel {w8}"
                if loras:
                    label = f"{label}, {loras} LoRA adapters"
                print(f"{name} / {label} ...", flush=True)
                try:
                    with (
                        _decode_kernel(on),
                        _sort_free(sort_free),
                        _decode_prefetch(walk),
                        _w8a16_kernel(w8),
                    ):
                        runs, llm = engine_runs(
                            model, name, label, args, layout, overlap, loras, quant
                        )
                        rows.extend(runs)
                        ctx = args.prompt_len + args.output_len // 2
                        for c in [] if args.no_split or not overlap else args.concurrency:
                            splits.append(decode_split(llm, name, label, c, ctx))
                        P = args.prompt_len
                        sweep = {t // P for t in args.prefill_tokens if t >= P}
                        for c in (
                            []
                            if args.no_split or not overlap
                            else sorted(set(args.concurrency) | sweep)
                        ):
                            prefills.append(prefill_split(llm, name, label, c, P))
                    del llm
                except Exception as e:  # out of memory, a compile failure: say so, go on
                    rows.append(
                        dict(model=name, system=f"paged-jax ({label})", error=repr(e)[-600:])
                    )
                save(rows, splits)  # a run cut short keeps what it measured
        del model
        jax.clear_caches()
    os.environ.pop(BACKEND_ENV, None)
    flat = []
    for r in rows:
        if "error" in r:
            flat.append(dict(model=r["model"], system=r["system"], error=r["error"][-200:]))
            continue
        flat.append(
            dict(
                model=r["model"],
                system=r["system"],
                C=r["concurrency"],
                tok_s_min=f"{r['tokens_per_s']['min']:.0f}",
                tok_s=f"{r['tokens_per_s']['median']:.0f}",
                tok_s_max=f"{r['tokens_per_s']['max']:.0f}",
                roofline=(
                    f"{r['roofline_fraction']['median']:.2f}" if r.get("roofline_fraction") else "-"
                ),
                wall_ms_step=f"{r.get('wall_ms_per_step', float('nan')):.2f}",
                host_ms_step=f"{r.get('host_ms_per_step', float('nan')):.2f}",
                dispatch_ms=f"{r.get('dispatch_ms_per_step', float('nan')):.2f}",
                wait_ms=f"{r.get('wait_ms_per_step', float('nan')):.2f}",
                decode_wall_ms=f"{r.get('decode_wall_ms_per_step') or float('nan'):.2f}",
                compile_s=f"{r.get('first_run_compile_s', float('nan')):.1f}",
            )
        )
    print(
        table(
            flat,
            [
                "model",
                "system",
                "C",
                "tok_s_min",
                "tok_s",
                "tok_s_max",
                "roofline",
                "wall_ms_step",
                "host_ms_step",
                "dispatch_ms",
                "wait_ms",
                "decode_wall_ms",
                "compile_s",
                "error",
            ],
        )
    )
    print(
        table(
            splits,
            [
                "model",
                "backend",
                "concurrency",
                "step_ms",
                "attention_ms",
                "attention_ragged_kernel_ms",
                "rest_of_model_ms",
                "sampler_greedy_ms",
                "sampler_top_p_ms",
                "sampler_top_p_peaked_ms",
                "sampler_top_p_sort_free_ms",
                "sampler_top_p_peaked_sort_free_ms",
                "sampler_top_p_kernel_ms",
                "sampler_top_p_sort_free_other_layout_ms",
            ],
            digits=2,
        )
    )
    if prefills:
        columns = ["model", "backend", "sequences", "tokens", "ms", "tflops", "of_peak"]
        print(table(prefills, columns, digits=2))
    path = save(rows, splits)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
