"""The engine on an accelerator: tokens/s of random-weight models built on the device, a
decode step split into its parts, and transformers ``generate`` on the same device.

``python -m benchmarks engine [--out DIR] [--models smollm2-135m llama3-8b]
[--concurrency 64 256] [--prompt-len 128] [--output-len 128] [--backends pallas_gpu xla]
[--repeats 3] [--transformers] [--decode-kernel on|off|both] [--layout per-layer|scan|both]
[--num-scheduler-steps K] [--async-scheduling on|off|both] [--prefill-tokens N ...]
[--no-split] [--quantization none int8 fp8 int4] [--lora-adapters 0 8]
[--expert-way ragged dense gather]``

Models: SmolLM2-135M-shaped and Llama-3-8B-shaped decoders, and a Qwen3-30B-A3B-shaped
mixture of experts (``SHAPE_FIELDS``; by default the two dense ones), random weights,
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
import itertools
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from benchmarks.common import environment, positive_int, table, write_result
from benchmarks.engine_roofline import (  # noqa: F401 (SHAPE_FIELDS, PAGE: the shapes' home)
    PAGE,
    PEAKS,
    SHAPE_FIELDS,
    abstract_decode_step,
    device_peaks,
    prefill_flops,
    roofline_tokens_per_s,
    weight_reads,
)
from benchmarks.engine_splits import decode_split, prefill_split
from benchmarks.engine_switches import decode_kernel, decode_prefetch, expert_way, w8a16_kernel
from benchmarks.engine_switches import sort_free as sort_free_way

LORA_RANK = 16  # --lora-adapters' rank, on every projection


def _stats(samples: list[float]) -> dict:
    return dict(min=min(samples), median=statistics.median(samples), max=max(samples))


def _prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, (n, length)).tolist()


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
    ap.add_argument(
        "--models",
        nargs="+",
        default=["smollm2-135m", "llama3-8b"],
        choices=sorted(SHAPE_FIELDS),
    )
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
        "--expert-way",
        nargs="+",
        default=["default"],
        choices=["default", "packed", "dense", "gather", "ragged"],
        help="a mixture of experts (--models qwen3-30b-a3b): its experts' products each way "
        "(models.layers.moe.EXPERT_PRODUCTS), or as moe.EXPERT_WAYS says; each in turn",
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
                    expert_way=args.expert_way,
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
            for on, overlap, sort_free, walk, w8, loras, experts in itertools.product(
                ways[args.decode_kernel],
                ways[args.async_scheduling],
                args.sort_free,
                args.decode_prefetch,
                args.w8a16_kernel,
                sorted(args.lora_adapters),  # no slots first: slots stay on the model
                args.expert_way,
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
                if experts != "default":
                    label = f"{label}, experts {experts}"
                print(f"{name} / {label} ...", flush=True)
                try:
                    with (
                        decode_kernel(on),
                        sort_free_way(sort_free),
                        decode_prefetch(walk),
                        w8a16_kernel(w8),
                        expert_way(experts),
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
