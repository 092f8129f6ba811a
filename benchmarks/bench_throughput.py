"""Throughput on this machine: paged continuous batching vs static batching on a
contiguous cache, same model, same jitted step, same KV memory budget.

``python -m benchmarks throughput [--requests N] [--budget TOKENS] [--repeats 3]``

Model: tiny-llama (random weights, f32) on CPU. Requests: ShareGPT-like lengths scaled by
1/4 and capped at 512 tokens in total; every request generates exactly its sampled
output length (greedy, EOS ignored).

* paged: ``paged_jax.LLM`` with ``budget / page_size`` pages, as it runs by default
  (each step scheduled while the one before runs), and one step at a time
  (``async_scheduling=False``), as the static loop runs: the gap between the two is the
  host's work the overlap hides, the rest is the batching;
* static: batches of ``budget // 512`` requests, each owning a contiguous 512-token range
  of the same cache (the HF-style padded layout), prefilled together then decoded until
  the longest finishes (finished rows keep being computed, as padded batches do). Its
  model is held for the device as the engine holds its own (``hold_for_cpu`` on CPU: the
  C kernels' packed products), so both schemes run the same jitted model step.

Each scheme runs the workload once to compile, then ``--repeats`` timed rounds, the two
schemes alternating within a round: min / median / max of each, and the ratio of the
medians (with the rounds' own ratios' range). Goal: >= 2x tokens/s for paged.
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
from paged_jax.engine.runner import hold_for_device
from paged_jax.metadata import AttentionMetadata

PAGE = 16
MAX_LEN = 512


class PagedEngine:
    """``paged_jax.LLM`` over ``budget / page_size`` pages."""

    def __init__(self, budget, async_scheduling=True):
        self.llm = LLM(
            *models.load("tiny-llama"),
            async_scheduling=async_scheduling,
            num_pages=budget // PAGE + 1,
            page_size=PAGE,
            max_num_seqs=256,
            max_num_batched_tokens=512,
            enable_prefix_caching=False,
            watermark=0.0,
        )

    def generate(self, prompts, outs):
        params = [SamplingParams(max_tokens=o, ignore_eos=True) for o in outs]
        res = self.llm.generate(prompts, params, progress=False)
        return [r.outputs[0].token_ids for r in res]


class StaticBatcher:
    """Padded static batches on a contiguous per-slot cache layout."""

    def __init__(self, budget):
        # held as the engine holds its model on this device
        self.model = hold_for_device(models.init_model(models.TINY_LLAMA, seed=0))
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


def _timed(scheme, prompts, outs):
    t = time.perf_counter()
    res = scheme.generate(prompts, outs)
    return time.perf_counter() - t, res


def _spread(values) -> dict:
    v = sorted(values)
    return dict(min=v[0], median=float(np.median(v)), max=v[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=positive_int, default=64)
    ap.add_argument("--budget", type=positive_int, default=8192, help="KV token slots")
    ap.add_argument("--repeats", type=positive_int, default=3, help="timed rounds")
    args = ap.parse_args(argv)
    if args.budget < MAX_LEN:
        ap.error(f"--budget: expected >= {MAX_LEN} (a request of the maximum length must fit)")
    lengths = sample_lengths("sharegpt", args.requests, seed=2, max_len=MAX_LEN, scale=0.25)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, p).tolist() for p, _ in lengths]
    outs = [o for _, o in lengths]
    schemes = {
        "static": StaticBatcher(args.budget),
        "paged": PagedEngine(args.budget),
        "paged_sync": PagedEngine(args.budget, async_scheduling=False),
    }
    results = {name: scheme.generate(prompts, outs) for name, scheme in schemes.items()}  # compile
    seconds = {name: [] for name in schemes}
    for r in range(args.repeats):
        for name, scheme in schemes.items():
            dt, results[name] = _timed(scheme, prompts, outs)
            seconds[name].append(dt)
        times = ", ".join(f"{name} {t[-1]:.2f} s" for name, t in seconds.items())
        print(f"round {r + 1}/{args.repeats}: {times}")
    same = min(
        sum(a == b for a, b in zip(results["static"], results[name], strict=True))
        for name in ("paged", "paged_sync")
    )
    gen = sum(outs)
    labels = {
        "static": "static batching, contiguous cache",
        "paged": "paged continuous batching",
        "paged_sync": "paged, one step at a time",
    }
    rows = []
    for name, label in labels.items():
        secs = _spread(seconds[name])
        rows.append(
            dict(
                scheme=label,
                seconds=secs,
                tokens_per_s={k: gen / secs[k] for k in ("max", "median", "min")},
                requests_per_s=args.requests / secs["median"],
                rounds_s=seconds[name],
            )
        )
    rounds = [a / b for a, b in zip(seconds["static"], seconds["paged"], strict=True)]
    ratio = float(np.median(seconds["static"]) / np.median(seconds["paged"]))
    ratio_sync = float(np.median(seconds["static"]) / np.median(seconds["paged_sync"]))

    def mmm(values, fmt):  # min / median / max
        v = sorted(values)
        return " / ".join(format(x, fmt) for x in (v[0], float(np.median(v)), v[-1]))

    shown = [
        dict(
            scheme=labels[name],
            tokens_per_s=mmm([gen / t for t in seconds[name]], ".0f"),
            seconds=mmm(seconds[name], ".2f"),
        )
        for name in labels
    ]
    print(table(shown, ["scheme", "tokens_per_s", "seconds"]))
    print(
        f"paged / static: {ratio:.2f}x tokens/s and requests/s, medians (rounds "
        f"{min(rounds):.2f}-{max(rounds):.2f}x; goal >= 2x: "
        f"{'met' if ratio >= 2 else 'NOT met'}); identical greedy outputs for "
        f"{same}/{args.requests} requests; one step at a time: {ratio_sync:.2f}x"
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
                repeats=args.repeats,
            ),
            "results": rows,
            "ratio": ratio,
            "round_ratios": rounds,
            "ratio_one_step_at_a_time": ratio_sync,
            "identical_outputs": same,
        },
    )
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3))
        ax.bar(
            ["static\ncontiguous", "paged\ncontinuous", "paged, one\nstep at a time"],
            [r["tokens_per_s"]["median"] for r in rows],
            color=["C3", "C0", "C2"],
        )
        ax.set_ylabel("generated tokens / s (CPU)")
        ax.set_title(f"same KV budget ({args.budget} tokens): {ratio:.2f}x")
        save_plot("throughput", fig)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
