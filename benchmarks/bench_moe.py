"""A mixture of experts against a dense model of the same active parameters, and the ways
of computing the experts' products, on the engine.

``python -m benchmarks moe [--out DIR] [--concurrency 1 4 16] [--prompt-len 64]
[--output-len 64] [--repeats 3] [--ways packed dense gather ragged] [--quantization none
int8]``, written to ``moe_<backend>.json``.

Models (random weights, f32, built here): ``moe``, Qwen3-MoE-shaped and small (8 layers,
hidden 512, 8 query and 4 KV heads of 64, QK-norm, vocabulary 4096; 8 experts of width
512 a layer, 2 a token, renormalized) and ``dense``, the same with one feed-forward block
of width 1024 a layer: the same active parameters a token (two experts' worth). Workload
per concurrency C: C prompts of ``--prompt-len`` random ids, each generating exactly
``--output-len`` greedy tokens, all at once. Each engine is built once and runs the
workload once untimed (compiling); then ``--repeats`` rounds run every engine in turn,
tokens/s = C * output_len / wall time. Reported: min / median / max of each engine's
rounds, and its ratio to ``dense`` taken round by round (the median of the rounds'
ratios). The MoE engines are one per way of ``models.layers.moe.EXPERT_PRODUCTS`` asked
for (``--ways``; "packed": the C kernel's grouped product, on CPU where it builds).
``--quantization int8 int4`` runs both models again with int8 (int4) weights
(``model.quantize``: the experts too), each compared with the dense model of its own
format.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from benchmarks.common import environment, positive_int, table, write_result

SHAPE = dict(
    vocab_size=4096,
    hidden_size=512,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
    qk_norm=True,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
)
EXPERTS, PER_TOKEN, WIDTH = 8, 2, 512


def configs() -> dict:
    """``{"moe": ..., "dense": ...}`` LlamaConfigs of the same active parameters a token."""
    from paged_jax.models import LlamaConfig

    moe = LlamaConfig(
        **SHAPE,
        intermediate_size=WIDTH,
        num_experts=EXPERTS,
        num_experts_per_tok=PER_TOKEN,
        moe_intermediate_size=WIDTH,
        norm_topk_prob=True,
        architecture="Qwen3MoeForCausalLM",
    )
    dense = LlamaConfig(
        **SHAPE, intermediate_size=PER_TOKEN * WIDTH, architecture="Qwen3ForCausalLM"
    )
    return {"moe": moe, "dense": dense}


def _way(way: str | None):
    import contextlib

    from paged_jax.models.layers import moe

    return moe.expert_way(way) if way else contextlib.nullcontext()


def build(cfg, way: str | None, pool_tokens: int, quantization: str | None = None):
    """An engine on a random model of ``cfg``, its experts held ``way`` (None: dense), its
    weights in ``quantization`` (None: f32)."""
    import paged_jax as pj
    from paged_jax.models import init_model

    with _way(way):
        model = init_model(cfg, seed=0)
        if quantization is not None:
            model.quantize(quantization)
        return pj.LLM(model, num_pages=pool_tokens // 16 + 8, page_size=16, compilation_cache=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks moe", description=__doc__)
    ap.add_argument("--concurrency", type=positive_int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prompt-len", type=positive_int, default=64)
    ap.add_argument("--output-len", type=positive_int, default=64)
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--ways", nargs="+", default=["packed", "dense", "gather", "ragged"])
    ap.add_argument("--quantization", nargs="+", default=["none"], choices=["none", "int8", "int4"])
    args = ap.parse_args(argv)

    import jax

    import paged_jax as pj
    from paged_jax.models.layers import moe

    bad = [w for w in args.ways if w not in moe.EXPERT_PRODUCTS]
    if bad:
        ap.error(f"--ways: {bad} not among {moe.EXPERT_PRODUCTS}")
    cfgs = configs()
    longest = max(args.concurrency) * (args.prompt_len + args.output_len)
    engines, base = {}, {}  # name -> (engine, way); name -> its dense model's name
    for quant in args.quantization:
        q = None if quant == "none" else quant
        suffix = "" if q is None else f" {q}"
        engines[f"dense{suffix}"] = (build(cfgs["dense"], None, longest, q), None)
        base[f"dense{suffix}"] = f"dense{suffix}"
        for way in args.ways:
            engines[f"moe {way}{suffix}"] = (build(cfgs["moe"], way, longest, q), way)
            base[f"moe {way}{suffix}"] = f"dense{suffix}"
    rng = np.random.default_rng(0)
    sp = pj.SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    rows = []
    for c in args.concurrency:
        prompts = rng.integers(10, SHAPE["vocab_size"], (c, args.prompt_len)).tolist()
        runs: dict[str, list[float]] = {name: [] for name in engines}
        for r in range(args.repeats + 1):  # round 0 compiles
            for name, (llm, way) in engines.items():
                with _way(way):  # (steps compiled in round 0 take the way)
                    t = time.perf_counter()
                    llm.generate(prompts, sp, progress=False)
                    seconds = time.perf_counter() - t
                if r:
                    runs[name].append(c * args.output_len / seconds)
            print(f"moe: C={c} round {r} done", file=sys.stderr, flush=True)
        for name, tps in runs.items():
            ratios = [a / b for a, b in zip(tps, runs[base[name]], strict=True)]
            rows.append(
                dict(
                    concurrency=c,
                    engine=name,
                    tokens_per_s=dict(min=min(tps), median=statistics.median(tps), max=max(tps)),
                    ratio_to_dense=statistics.median(ratios),
                    experts_packed=bool(
                        name.startswith("moe") and engines[name][0].model.layers.mlp.experts.packed
                    ),
                )
            )
    shown = [
        dict(
            C=r["concurrency"],
            engine=r["engine"],
            tok_s=f"{r['tokens_per_s']['median']:.0f} "
            f"({r['tokens_per_s']['min']:.0f}-{r['tokens_per_s']['max']:.0f})",
            vs_dense=f"{r['ratio_to_dense']:.2f}x",
        )
        for r in rows
    ]
    print(table(shown, ["C", "engine", "tok_s", "vs_dense"]))
    path = write_result(
        f"moe_{jax.default_backend()}",
        dict(
            environment=environment(with_jax=True),
            configs={k: str(v) for k, v in cfgs.items()},
            workload=dict(
                prompt_len=args.prompt_len,
                output_len=args.output_len,
                repeats=args.repeats,
                quantization=args.quantization,
            ),
            rows=rows,
        ),
    )
    print(f"results: {path}")
    return 0
