"""Host overhead per engine step: scheduler + block manager + batch building + sampling
bookkeeping, against the device's step, at 64 / 256 / 1024 running sequences: steps one
at a time, overlapped steps (``async_scheduling``, the default), multi-step decoding
(``num_scheduler_steps=K``) one launch at a time, and multi-step launches overlapped
(each built and dispatched while the one before runs).

``python -m benchmarks host_overhead [--seqs 64 256 1024] [--steps N] [--repeats R]
[--scheduler-steps K] [--model tiny-llama|NAME]``, written to ``host_overhead.json``
(tiny-llama) or ``host_overhead_NAME.json``.

The engine runs N sequences of a 16-token prompt each (``ignore_eos``, every one to
``--steps`` tokens) for a warm-up pass (compiles every shape), then ``R`` timed passes of
each mode, the modes one after the other in each repeat (the machine's load changes
slowly; ratios within a repeat are fair). A "step" is one decode step of the device (a
multi-step launch counts K). Without overlap the engine's clock splits the run into the
device's share (``step_s``: dispatch and waiting for the sampled tokens) and the host's
(``host_s``); the host share is ``host / (host + device)``, for the one-at-a-time and
the multi-step runs. With overlap the host works while the device runs, so its share is
what the wall clock shows beyond the device: ``(overlapped wall - device time of the
one-at-a-time run) / overlapped wall`` (never below 0). These shares cover the whole
run: the prompts' steps, admitting and finishing the N requests included. The decode
phase's shares cover only the engine calls that complete steps scheduled with every
request admitted (N sequences running, each decoding; with overlap a call completes the
step the call before scheduled); the steady decode's, only those of them that finish no
request and complete a multi-step launch (more than one device step). For the overlapped
multi-step runs these shares are the wall clock's beyond the device time a step of the
same part of the multi-step run without overlap. Those shares difference two runs, so
the machine's noise enters twice; the host CPU shares do not: the engine thread's CPU
time over the wall time of the same steps of the overlapped multi-step run (its decode
phase, its steady decode). That is the most the host's work can add to the wall clock;
how much of it overlapping hides on a CPU, where XLA's threads want the same cores, the
differenced shares tell, and on a 2-core machine they ranged from none of it to nearly
all in runs of the same code. The goal lines say how many multi-step launches a pass
gives each decode-phase and steady share: with the default 48 tokens and K = 16, one
launch is steady decode, a single sample that the machine's noise decides; ``--steps
192`` gives a dozen. Goal: host <= 5% of step time
at 256 sequences. On CPU a tiny model's device step is itself cheap, and the host's
Python shares the cores with XLA's threads, so this is the hardest setting for the goal;
on an accelerator the device step is far longer while the host work is the same.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import environment, positive_int, progress, table, write_result
from paged_jax import models
from paged_jax.engine import LLM, SamplingParams


def result_name(model: str) -> str:
    """The results file's name for ``model``: ``host_overhead`` for the default tiny-llama,
    ``host_overhead_<model>`` for another (so that a real model's record sits beside it)."""
    return "host_overhead" if model == "tiny-llama" else f"host_overhead_{model}"


def _engine(model, tokenizer, num_seqs: int, steps: int, overlapped: bool, K: int = 1) -> LLM:
    return LLM(
        model,
        tokenizer,
        num_pages=num_seqs * (-(-(16 + steps + 2) // 16)) + 8,
        page_size=16,
        max_num_seqs=num_seqs,
        max_num_batched_tokens=max(512, num_seqs),
        enable_prefix_caching=False,
        watermark=0.0,
        async_scheduling=overlapped,
        num_scheduler_steps=K,
    )


def _timed(llm: LLM, prompts, params) -> dict:
    """One pass: wall, device steps, host and device seconds of the whole run, and of
    its decode phase (the calls that complete steps scheduled with every request
    admitted) and steady decode."""
    m0 = dict(vars(llm.metrics))
    # cpu: the engine thread's CPU time (step() runs in this thread)
    phase = dict(host=0.0, device=0.0, wall=0.0, steps=0, cpu=0.0)
    steady = dict(host=0.0, device=0.0, wall=0.0, steps=0, cpu=0.0)
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        llm.add_request(i, prompt, params)
    was_admitted = False
    while llm.has_unfinished():
        admitted = not any(sc.waiting for sc in llm.schedulers)
        # A call completes the steps it scheduled, or with overlapped steps the one the
        # call before scheduled: the last prompts' step completes in the first call with
        # every request admitted, and is not decode.
        decode = was_admitted if llm.async_scheduling else admitted
        was_admitted = admitted
        m = llm.metrics
        h, d, n = m.host_s, m.step_s, m.steps
        t, c = time.perf_counter(), time.thread_time()
        finished = llm.step()
        if decode:
            parts = [phase] if finished or m.steps - n < 2 else [phase, steady]
            for part in parts:
                part["wall"] += time.perf_counter() - t
                part["host"] += m.host_s - h
                part["device"] += m.step_s - d
                part["steps"] += m.steps - n
                part["cpu"] += time.thread_time() - c
    wall = time.perf_counter() - t0
    m = llm.metrics
    return dict(
        wall=wall,
        steps=m.steps - m0["steps"],
        host=m.host_s - m0["host_s"],
        device=m.step_s - m0["step_s"],
        tokens=m.tokens_generated - m0["tokens_generated"],
        decode=phase,
        steady=steady,
    )


def _share(part: dict) -> float:
    """The host's share of ``part``; NaN when it has no device step (none in it)."""
    if not part["steps"]:
        return float("nan")
    return part["host"] / max(part["host"] + part["device"], 1e-12)


def _cpu_share(part: dict) -> float:
    """The engine thread's CPU time over the wall time of ``part`` (NaN: no step)."""
    if not part["steps"]:
        return float("nan")
    return part["cpu"] / max(part["wall"], 1e-12)


def measure(model_name: str, num_seqs: int, steps: int, repeats: int, K: int) -> dict:
    model, tokenizer = models.load(model_name)
    vocab = model.config.vocab_size
    plain = _engine(model, tokenizer, num_seqs, steps, overlapped=False)
    over = _engine(model, tokenizer, num_seqs, steps, overlapped=True)
    # one launch at a time (launches never overlap): its clock splits host and device
    multi = _engine(model, tokenizer, num_seqs, steps, overlapped=False, K=K)
    multi_over = _engine(model, tokenizer, num_seqs, steps, overlapped=True, K=K)
    prompts = [[1, k % vocab, (k // vocab) % vocab] + [7] * 13 for k in range(num_seqs)]
    params = SamplingParams(max_tokens=steps, ignore_eos=True)
    outs = [  # warm-up: compile every bucket; every mode gives the same tokens
        [r.outputs[0].token_ids for r in llm.generate(prompts, params, progress=False)]
        for llm in (plain, over, multi, multi_over)
    ]
    assert all(out == outs[0] for out in outs), "the modes gave different tokens"
    runs = []
    for _ in range(repeats):
        a, b, c, d = (_timed(e, prompts, params) for e in (plain, over, multi, multi_over))
        assert a["tokens"] == b["tokens"] == c["tokens"] == d["tokens"] == num_seqs * steps

        def beyond(part, c=c, d=d):  # the overlapped multi-step run's share beyond
            if not (c[part]["steps"] and d[part]["steps"]):  # the device's (without
                return float("nan")  # overlap); NaN: no such step
            dev = c[part]["device"] / c[part]["steps"]
            wall = d[part]["wall"] / d[part]["steps"]
            return max(wall - dev, 0.0) / max(wall, 1e-12)

        runs.append(
            dict(
                plain_host_share=a["host"] / (a["host"] + a["device"]),
                overlapped_host_share=max(b["wall"] - a["device"], 0.0) / b["wall"],
                multi_host_share=c["host"] / (c["host"] + c["device"]),
                plain_decode_host_share=_share(a["decode"]),
                multi_decode_host_share=_share(c["decode"]),
                multi_overlapped_host_share=max(d["wall"] - c["device"], 0.0) / d["wall"],
                multi_overlapped_decode_host_share=beyond("decode"),
                multi_steady_host_share=_share(c["steady"]),
                multi_overlapped_steady_host_share=beyond("steady"),
                multi_overlapped_decode_cpu_share=_cpu_share(d["decode"]),
                multi_overlapped_steady_cpu_share=_cpu_share(d["steady"]),
                plain_ms_per_step=1e3 * a["wall"] / a["steps"],
                device_ms_per_step=1e3 * a["device"] / a["steps"],
                host_ms_per_step=1e3 * a["host"] / a["steps"],
                overlapped_ms_per_step=1e3 * b["wall"] / b["steps"],
                multi_ms_per_step=1e3 * c["wall"] / c["steps"],
                multi_device_ms_per_step=1e3 * c["device"] / c["steps"],
                multi_host_ms_per_step=1e3 * c["host"] / c["steps"],
                multi_overlapped_ms_per_step=1e3 * d["wall"] / d["steps"],
                speedup=a["wall"] / b["wall"],
                multi_speedup=a["wall"] / c["wall"],
                multi_overlapped_speedup=a["wall"] / d["wall"],
                steps_plain=a["steps"],
                steps_overlapped=b["steps"],
                steps_multi=c["steps"],
                steps_multi_overlapped=d["steps"],
                decode_steps_multi=c["decode"]["steps"],
                decode_steps_multi_overlapped=d["decode"]["steps"],
                steady_steps_multi=c["steady"]["steps"],
                steady_steps_multi_overlapped=d["steady"]["steps"],
            )
        )

    def stats(key):  # None: the part had no step in any run (NaN shares are left out)
        xs = [r[key] for r in runs if r[key] == r[key]]
        if not xs:
            return dict(min=None, median=None, max=None)
        return dict(min=min(xs), median=statistics.median(xs), max=max(xs))

    return dict(
        seqs=num_seqs,
        repeats=repeats,
        **{k: stats(k) for k in runs[0] if "steps_" not in k},
        **{k: runs[0][k] for k in runs[0] if "steps_" in k},
    )


# The device steps (of a pass) that a decode-phase or steady share rests on.
_SAMPLE = {
    "multi_decode_host_share": "decode_steps_multi",
    "multi_overlapped_decode_host_share": "decode_steps_multi_overlapped",
    "multi_steady_host_share": "steady_steps_multi",
    "multi_overlapped_steady_host_share": "steady_steps_multi_overlapped",
    "multi_overlapped_decode_cpu_share": "decode_steps_multi_overlapped",
    "multi_overlapped_steady_cpu_share": "steady_steps_multi_overlapped",
}


def _sample(row: dict, key: str, K: int) -> str:
    """How many multi-step launches a pass gives the share ``key`` (empty for a share of
    the whole run), with a warning below 4: a share from one or two launches is noise."""
    if key not in _SAMPLE:
        return ""
    launches = -(-row[_SAMPLE[key]] // K)
    few = " (few: more --steps gives more)" if launches < 4 else ""
    return f", from {launches} launch{'es' if launches != 1 else ''} a pass{few}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=positive_int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--steps", type=positive_int, default=48)
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument(
        "--scheduler-steps",
        type=positive_int,
        default=16,
        help="K of the multi-step mode (num_scheduler_steps)",
    )
    ap.add_argument("--model", default="tiny-llama")
    args = ap.parse_args(argv)
    rows = []
    with progress(len(args.seqs), "host overhead") as bar:
        for n in args.seqs:
            rows.append(measure(args.model, n, args.steps, args.repeats, args.scheduler_steps))
            bar.advance()

    def mmm(d, scale=1.0, fmt="{:.1f}"):
        if d["median"] is None:
            return "n/a"
        return "/".join(fmt.format(scale * d[k]) for k in ("min", "median", "max"))

    shown = [
        dict(
            seqs=r["seqs"],
            device_ms=mmm(r["device_ms_per_step"]),
            host_ms=mmm(r["host_ms_per_step"]),
            plain_host_share=mmm(r["plain_host_share"], 100, "{:.1f}%"),
            plain_ms_per_step=mmm(r["plain_ms_per_step"]),
            overlapped_ms_per_step=mmm(r["overlapped_ms_per_step"]),
            overlapped_host_share=mmm(r["overlapped_host_share"], 100, "{:.1f}%"),
            speedup=mmm(r["speedup"], fmt="{:.2f}x"),
            multi_device_ms=mmm(r["multi_device_ms_per_step"]),
            multi_host_ms=mmm(r["multi_host_ms_per_step"], fmt="{:.2f}"),
            multi_ms_per_step=mmm(r["multi_ms_per_step"]),
            multi_host_share=mmm(r["multi_host_share"], 100, "{:.1f}%"),
            decode_phase_host_share=mmm(r["plain_decode_host_share"], 100, "{:.1f}%"),
            multi_decode_phase_host_share=mmm(r["multi_decode_host_share"], 100, "{:.1f}%"),
            multi_speedup=mmm(r["multi_speedup"], fmt="{:.2f}x"),
            multi_overlapped_ms_per_step=mmm(r["multi_overlapped_ms_per_step"]),
            multi_overlapped_host_share=mmm(r["multi_overlapped_host_share"], 100, "{:.1f}%"),
            multi_overlapped_decode_phase_host_share=mmm(
                r["multi_overlapped_decode_host_share"], 100, "{:.1f}%"
            ),
            multi_overlapped_speedup=mmm(r["multi_overlapped_speedup"], fmt="{:.2f}x"),
            multi_steady_host_share=mmm(r["multi_steady_host_share"], 100, "{:.1f}%"),
            multi_overlapped_steady_host_share=mmm(
                r["multi_overlapped_steady_host_share"], 100, "{:.1f}%"
            ),
            multi_overlapped_decode_phase_cpu_share=mmm(
                r["multi_overlapped_decode_cpu_share"], 100, "{:.1f}%"
            ),
            multi_overlapped_steady_cpu_share=mmm(
                r["multi_overlapped_steady_cpu_share"], 100, "{:.1f}%"
            ),
        )
        for r in rows
    ]
    print("min/median/max of", args.repeats, "repeats")
    print(table(shown, list(shown[0])))
    at256 = [r for r in rows if r["seqs"] == 256]
    goal = "goal host <= 5% of step time at 256 sequences"
    cpu = "host CPU time over wall time at 256 sequences"
    for what, mode, key in (
        (goal, "overlapped", "overlapped_host_share"),
        (goal, "multi-step", "multi_host_share"),
        (goal, "multi-step, decode phase", "multi_decode_host_share"),
        (goal, "multi-step overlapped", "multi_overlapped_host_share"),
        (goal, "multi-step overlapped, decode phase", "multi_overlapped_decode_host_share"),
        (goal, "multi-step, steady decode", "multi_steady_host_share"),
        (goal, "multi-step overlapped, steady decode", "multi_overlapped_steady_host_share"),
        (cpu, "multi-step overlapped, decode phase", "multi_overlapped_decode_cpu_share"),
        (cpu, "multi-step overlapped, steady decode", "multi_overlapped_steady_cpu_share"),
    ):
        if at256 and at256[0][key]["median"] is not None:
            share = at256[0][key]["median"]
            print(
                f"{what} ({mode}, median): "
                f"{100 * share:.1f}%, {'met' if share <= 0.05 else 'NOT met'}"
                + _sample(at256[0], key, args.scheduler_steps)
            )
    path = write_result(
        result_name(args.model),
        {
            "benchmark": "host_overhead",
            "environment": environment(with_jax=True),
            "parameters": dict(
                seqs=args.seqs,
                decode_steps=args.steps,
                repeats=args.repeats,
                scheduler_steps=args.scheduler_steps,
                page_size=16,
                model=args.model,
            ),
            "results": rows,
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
