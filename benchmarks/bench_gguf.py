"""A GGUF file loaded as stored against loaded dequantized: bytes held, load time,
engine tokens/s and whether the tokens are the same.

``python -m benchmarks gguf [FILE.gguf ...] [--prompts N] [--tokens N] [--repeats N]``

For each file (default: SmolLM2-135M-Instruct's Q4_1 file, ``smollm2-135m-instruct``,
fetched once) three loads of the same weights:

- ``kept``: the default, ``load_gguf(path)``: the file's blocks kept
  (``models.gguf_blocks.Nibbles``; Q8_0 as int8 groups), each packed panel dequantized
  by the C kernel and multiplied by the rows as they are (float rows);
- ``dequantized``: ``load_gguf(path, dequantize=True)``, every weight f32;
- ``int4``: ``quantization="int4"``: the blocks kept, the rows quantized (W8A8).

Reported per file: its tensors' bytes and their block formats; each load's bytes of
weights held (``nnx.state``) over the file's, and its load time; tokens/s of the peer
workload (``--prompts`` prompts of 90-110 token ids, ``--tokens`` greedy tokens each,
KV cache f32, one ``LLM`` per load, warmed up first) over ``--repeats`` runs, the loads
taking turns (min/median/max); and how many sequences equal the dequantized load's.
Quiet machine wanted: the loads run one after another in one process.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

from benchmarks.common import environment, positive_int, table, write_result

LOADS = ("kept", "dequantized", "int4")


def _file_facts(path) -> dict:
    import gguf

    reader = gguf.GGUFReader(str(path))
    formats = collections.Counter(
        gguf.GGMLQuantizationType(int(t.tensor_type)).name for t in reader.tensors
    )
    return dict(tensor_bytes=sum(int(t.n_bytes) for t in reader.tensors), formats=dict(formats))


def _load(path, kind: str):
    from paged_jax.models import load

    kw = {"kept": {}, "dequantized": {"dequantize": True}, "int4": {"quantization": "int4"}}
    t = time.perf_counter()
    model, _ = load(path, **kw[kind])
    return model, time.perf_counter() - t


def _held_bytes(model) -> int:
    import jax
    from flax import nnx

    return sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))


def measure(path, num_prompts: int, tokens: int, repeats: int) -> dict:
    """One file's row of the report (the module's docstring)."""
    import paged_jax as pj
    from benchmarks.bench_peers import workload

    facts = _file_facts(path)
    params = pj.SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    engines, loads = {}, {}
    for kind in LOADS:
        model, seconds = _load(path, kind)
        if not engines:  # the peer workload's ids, within the model's vocabulary
            vocab = model.config.vocab_size
            prompts = workload(num_prompts, ids=(min(100, vocab // 2), min(40000, vocab)))
        loads[kind] = dict(
            load_s=round(seconds, 3),
            bytes=_held_bytes(model),
            over_file=round(_held_bytes(model) / facts["tensor_bytes"], 4),
        )
        engines[kind] = pj.LLM(
            model, kv_cache_bytes=2**30, compilation_cache=False, cache_dtype="float32"
        )
        engines[kind].generate(prompts, params, progress=False)  # compile, warm up
    seconds = {kind: [] for kind in LOADS}
    outputs = {}
    for _ in range(repeats):
        for kind in LOADS:  # taking turns: a noisy minute touches every load alike
            t = time.perf_counter()
            out = engines[kind].generate(prompts, params, progress=False)
            seconds[kind].append(time.perf_counter() - t)
            outputs[kind] = [r.outputs[0].token_ids for r in out]
    total = len(prompts) * tokens
    for kind in LOADS:
        rates = sorted(total / s for s in seconds[kind])
        loads[kind]["tokens_per_s"] = dict(
            min=round(rates[0], 1),
            median=round(statistics.median(rates), 1),
            max=round(rates[-1], 1),
        )
        loads[kind]["same_sequences"] = sum(
            a == b for a, b in zip(outputs[kind], outputs["dequantized"], strict=True)
        )
    return dict(file=str(path), **facts, loads=loads)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks gguf", description=__doc__)
    ap.add_argument("files", nargs="*", help="GGUF files (default: SmolLM2's Q4_1 file)")
    ap.add_argument("--prompts", type=positive_int, default=32)
    ap.add_argument("--tokens", type=positive_int, default=128)
    ap.add_argument("--repeats", type=positive_int, default=3)
    args = ap.parse_args(argv)
    from paged_jax.models.registry import fetch

    files = args.files or [str(fetch("smollm2-135m-instruct"))]
    rows, results = [], []
    for path in files:
        r = measure(path, args.prompts, args.tokens, args.repeats)
        results.append(r)
        for kind, v in r["loads"].items():
            rows.append(
                dict(
                    file=path.rsplit("/", 1)[-1],
                    load=kind,
                    MB=round(v["bytes"] / 1e6, 1),
                    over_file=v["over_file"],
                    load_s=v["load_s"],
                    tok_s_median=v["tokens_per_s"]["median"],
                    tok_s_min=v["tokens_per_s"]["min"],
                    tok_s_max=v["tokens_per_s"]["max"],
                    same=f"{v['same_sequences']}/{args.prompts}",
                )
            )
    print(
        table(
            rows,
            [
                "file",
                "load",
                "MB",
                "over_file",
                "load_s",
                "tok_s_min",
                "tok_s_median",
                "tok_s_max",
                "same",
            ],
        )
    )
    path = write_result(
        "gguf",
        dict(
            environment=environment(with_jax=True),
            workload=dict(prompts=args.prompts, tokens=args.tokens, repeats=args.repeats),
            results=results,
        ),
    )
    print(f"wrote {path}")
    return 0
