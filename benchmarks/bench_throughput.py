"""Throughput on this machine: paged continuous batching vs static batching on a
contiguous cache, same model, same jitted step, same KV memory budget.

``python -m benchmarks throughput [--requests N] [--budget TOKENS]``

Model: tiny-llama (random weights, f32) on CPU. Requests: ShareGPT-like lengths scaled by
1/4 and capped at 512 tokens in total; every request generates exactly its sampled
output length (greedy, EOS ignored).

* paged: ``paged_jax.LLM`` with ``budget / page_size`` pages;
* static: batches of ``budget // 512`` requests, each owning a contiguous 512-token range
  of the same cache (the HF-style padded layout), prefilled together then decoded until
  the longest finishes (finished rows keep being computed, as padded batches do).

Each scheme runs the workload once to compile, then is timed on a second run. Goal: >= 2x
tokens/s for paged.
"""

from __future__ import annotations

import argparse
import time

import jax.numpy as jnp
import numpy as np

from benchmarks.common import environment, positive_int, pyplot, save_plot, table, write_result
from benchmarks.workloads import sample_lengths
from paged_jax import models
from paged_jax.batch import bucket
from paged_jax.engine import LLM, SamplingParams
from paged_jax.metadata import AttentionMetadata

PAGE = 16
MAX_LEN = 512


def run_paged(prompts, outs, budget):
    llm = LLM(
        *models.load("tiny-llama"),
        num_pages=budget // PAGE + 1,
        page_size=PAGE,
        max_num_seqs=256,
        max_num_batched_tokens=512,
        enable_prefix_caching=False,
        watermark=0.0,
    )
    params = [SamplingParams(max_tokens=o, ignore_eos=True) for o in outs]
    llm.generate(prompts, params, progress=False)  # compile
    t = time.perf_counter()
    res = llm.generate(prompts, params, progress=False)
    dt = time.perf_counter() - t
    return dt, [r.outputs[0].token_ids for r in res]


class StaticBatcher:
    """Padded static batches on a contiguous per-slot cache layout."""

    def __init__(self, budget):
        self.model = models.init_model(models.TINY_LLAMA, seed=0)
        self.step, self.state = models.make_step(self.model)
        self.slots = budget // MAX_LEN
        self.per_slot = MAX_LEN // PAGE
        self.cache = self.model.make_cache(1 + self.slots * self.per_slot, PAGE)
        self.table = 1 + np.arange(self.slots * self.per_slot, dtype=np.int32).reshape(
            self.slots, self.per_slot
        )

    def _run(self, tokens, positions, kv_lens, q_lens, slot_ids, logits_rows):
        T = bucket(len(tokens), 16)
        S = self.slots
        tok = np.zeros(T, np.int32)
        pos = np.zeros(T, np.int32)
        slot_map = np.zeros(T, np.int32)
        tok[: len(tokens)], pos[: len(tokens)] = tokens, positions
        seq_of = np.repeat(slot_ids, q_lens)
        slot_map[: len(tokens)] = self.table[seq_of, pos[: len(tokens)] // PAGE] * PAGE + (
            pos[: len(tokens)] % PAGE
        )
        kv = np.zeros(S, np.int32)
        kv[: len(kv_lens)] = kv_lens
        cu = np.zeros(S + 1, np.int32)
        cu[1 : len(q_lens) + 1] = np.cumsum(q_lens)
        cu[len(q_lens) + 1 :] = cu[len(q_lens)]
        li = np.zeros(S, np.int32)
        li[: len(logits_rows)] = logits_rows
        md = AttentionMetadata(
            slot_mapping=jnp.asarray(slot_map),
            kv_lens=jnp.asarray(kv),
            page_indices=jnp.asarray(self.table[np.r_[slot_ids, np.zeros(S - len(slot_ids), int)]]),
            cu_q_lens=jnp.asarray(cu),
            num_seqs=jnp.array([len(q_lens)], jnp.int32),
            logits_indices=jnp.asarray(li),
            copy_src=jnp.zeros(8, jnp.int32),
            copy_dst=jnp.zeros(8, jnp.int32),
        )
        logits, self.cache = self.step(
            self.state, jnp.asarray(tok), jnp.asarray(pos), self.cache, md
        )
        return np.asarray(logits)[: len(q_lens)].argmax(-1)

    def generate(self, prompts, outs):
        results = [None] * len(prompts)
        for b in range(0, len(prompts), self.slots):
            idx = list(range(b, min(b + self.slots, len(prompts))))
            ids = np.arange(len(idx))
            q_lens = np.array([len(prompts[i]) for i in idx])
            toks = np.concatenate([prompts[i] for i in idx])
            pos = np.concatenate([np.arange(n) for n in q_lens])
            nxt = self._run(toks, pos, q_lens, q_lens, ids, np.cumsum(q_lens) - 1)
            gen = [[int(t)] for t in nxt]
            lens = q_lens.copy()  # next position to compute per row
            target = np.array([outs[i] for i in idx])
            for _ in range(target.max() - 1):
                # Finished rows are still computed (padding) but stay at their last position.
                active = np.array([len(g) < t for g, t in zip(gen, target, strict=True)])
                pos = np.where(active, lens, lens - 1)
                nxt = self._run(
                    np.array([g[-1] for g in gen]),
                    pos,
                    pos + 1,
                    np.ones(len(idx), int),
                    ids,
                    np.arange(len(idx)),
                )
                lens = np.where(active, lens + 1, lens)
                for g, t, a in zip(gen, nxt, active, strict=True):
                    if a:
                        g.append(int(t))
            for k, i in enumerate(idx):
                results[i] = gen[k][: outs[i]]
        return results


def run_static(prompts, outs, budget):
    sb = StaticBatcher(budget)
    sb.generate(prompts, outs)  # compile
    t = time.perf_counter()
    res = sb.generate(prompts, outs)
    return time.perf_counter() - t, res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=positive_int, default=64)
    ap.add_argument("--budget", type=positive_int, default=8192, help="KV token slots")
    args = ap.parse_args(argv)
    if args.budget < MAX_LEN:
        ap.error(f"--budget: expected >= {MAX_LEN} (a request of the maximum length must fit)")
    lengths = sample_lengths("sharegpt", args.requests, seed=2, max_len=MAX_LEN, scale=0.25)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, p).tolist() for p, _ in lengths]
    outs = [o for _, o in lengths]
    t_static, r_static = run_static(prompts, outs, args.budget)
    t_paged, r_paged = run_paged(prompts, outs, args.budget)
    same = sum(a == b for a, b in zip(r_static, r_paged, strict=True))
    gen = sum(outs)
    rows = [
        dict(
            scheme="static batching, contiguous cache",
            seconds=t_static,
            tokens_per_s=gen / t_static,
            requests_per_s=args.requests / t_static,
        ),
        dict(
            scheme="paged continuous batching",
            seconds=t_paged,
            tokens_per_s=gen / t_paged,
            requests_per_s=args.requests / t_paged,
        ),
    ]
    ratio = t_static / t_paged
    shown = [{k: (f"{v:.2f}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows]
    print(table(shown, ["scheme", "seconds", "tokens_per_s", "requests_per_s"]))
    print(
        f"paged / static: {ratio:.2f}x tokens/s and requests/s (goal >= 2x: "
        f"{'met' if ratio >= 2 else 'NOT met'}); identical greedy outputs for "
        f"{same}/{args.requests} requests"
    )
    path = write_result(
        "throughput",
        {
            "benchmark": "throughput",
            "environment": environment(with_jax=True),
            "parameters": dict(
                requests=args.requests,
                budget_tokens=args.budget,
                max_len=MAX_LEN,
                page_size=PAGE,
                model="tiny-llama (random weights, f32)",
                mean_prompt=float(np.mean([p for p, _ in lengths])),
                mean_output=float(np.mean(outs)),
                generated_tokens=gen,
            ),
            "results": rows,
            "ratio": ratio,
            "identical_outputs": same,
        },
    )
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.bar(
            ["static\ncontiguous", "paged\ncontinuous"],
            [r["tokens_per_s"] for r in rows],
            color=["C3", "C0"],
        )
        ax.set_ylabel("generated tokens / s (CPU)")
        ax.set_title(f"same KV budget ({args.budget} tokens): {ratio:.2f}x")
        save_plot("throughput", fig)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
