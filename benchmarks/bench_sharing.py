"""Pages saved by sharing: parallel sampling, beam search, a shared system prompt.

``python -m benchmarks sharing [--requests N]``

The real engine (tiny-llama, random weights, CPU) serves Alpaca-like requests. After
every step the block manager reports pages in use (shared pages counted once) and pages
referenced (the sum of block-table lengths: what the same sequences would hold without
sharing). Saving = 1 - sum(used) / sum(referenced) over all steps. Anchors (paper, on
Alpaca with OPT-13B): parallel sampling 6.1-9.8%, beam search 37.6-55.2%. Beam dynamics
here come from a randomly initialized model, so they differ from a trained model's.
"""

from __future__ import annotations

import argparse

from benchmarks.common import (
    environment,
    positive_int,
    progress,
    pyplot,
    save_plot,
    table,
    write_result,
)
from benchmarks.workloads import sample_lengths
from paged_jax import models
from paged_jax.engine import LLM, SamplingParams

PAGE = 16


def _run(prompts, params, *, prefix_caching=False, num_pages=4096):
    llm = LLM(
        *models.load("tiny-llama"),
        num_pages=num_pages,
        page_size=PAGE,
        max_num_seqs=512,
        max_num_batched_tokens=2048,
        enable_prefix_caching=prefix_caching,
    )
    for k, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        llm.add_request(k, p, sp)
    used = referenced = 0
    while llm.has_unfinished():
        llm.step()
        s = llm.bm.stats()
        used += s["pages_used"]
        referenced += s["pages_referenced"]
    return used, referenced, llm.metrics


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=positive_int, default=32)
    args = ap.parse_args(argv)
    lengths = sample_lengths("alpaca", args.requests, seed=1, max_len=512)
    prompts = [
        [256] + [(7 * k + 3 * i) % 256 for i in range(p - 1)] for k, (p, _) in enumerate(lengths)
    ]
    rows = []
    configs = [("parallel sampling", n, dict(n=n, temperature=1.0)) for n in (2, 4, 6)]
    configs += [("beam search", w, dict(beam_width=w, n=1)) for w in (2, 4, 6)]
    with progress(len(configs) + 1, "sharing") as bar:
        for kind, width, kw in configs:
            params = [
                SamplingParams(max_tokens=o, ignore_eos=kind != "beam search", seed=k, **kw)
                for k, (_, o) in enumerate(lengths)
            ]
            used, ref, _ = _run(prompts, params)
            rows.append(
                dict(
                    scenario=kind,
                    width=width,
                    pages_used=used,
                    pages_unshared=ref,
                    saving=1 - used / ref,
                )
            )
            bar.advance()
        # A 64-token system prompt before every request, prefix caching off vs on.
        system = [256] + list(range(1, 64))
        sys_prompts = [system + p[1:] for p in prompts]
        params = [SamplingParams(max_tokens=o, ignore_eos=True) for _, o in lengths]
        u_off, _, m_off = _run(sys_prompts, params, prefix_caching=False)
        u_on, _, m_on = _run(sys_prompts, params, prefix_caching=True)
        rows.append(
            dict(
                scenario="shared system prompt (prefix cache)",
                width=1,
                pages_used=u_on,
                pages_unshared=u_off,
                saving=1 - u_on / u_off,
                prefill_tokens_saved=1 - m_on.tokens_computed / m_off.tokens_computed,
                prefix_hit_rate=m_on.prefix_hit_rate,
            )
        )
        bar.advance()
    shown = [{**r, "saving": f"{100 * r['saving']:.1f}%"} for r in rows]
    print(table(shown, ["scenario", "width", "pages_used", "pages_unshared", "saving"]))
    last = rows[-1]
    print(
        f"shared system prompt: computed tokens -{100 * last['prefill_tokens_saved']:.1f}%, "
        f"prefix hit rate {100 * last['prefix_hit_rate']:.1f}%"
    )
    path = write_result(
        "sharing",
        {
            "benchmark": "sharing",
            "environment": environment(with_jax=True),
            "parameters": dict(
                requests=args.requests,
                page_size=PAGE,
                workload="alpaca",
                model="tiny-llama (random weights)",
            ),
            "anchors": {
                "parallel sampling (paper)": "6.1-9.8%",
                "beam search (paper)": "37.6-55.2%",
            },
            "results": rows,
        },
    )
    _plot(rows)
    print(f"wrote {path}")
    return 0


def _plot(rows):
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [
        f"{r['scenario'].split(' (')[0]}\n{'' if r['width'] == 1 else r['width']}" for r in rows
    ]
    ax.bar(
        range(len(rows)), [100 * r["saving"] for r in rows], color=["C0"] * 3 + ["C1"] * 3 + ["C2"]
    )
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("KV pages saved (%)")
    ax.set_title("sharing through copy-on-write pages (alpaca-like lengths)")
    save_plot("sharing", fig)


if __name__ == "__main__":
    raise SystemExit(main())
