"""Replicas of ``paged-jax serve`` behind vLLM's router (``vllm-router``, a Rust binary in
its wheel on PyPI), on loopback: which routing policy earns the prefix cache's hits.

``python -m benchmarks fleet [--out DIR] [--model smollm2-135m-instruct] [--replicas 2]
[--policies round_robin cache_aware kv_aware] [--system-prompts 8] [--requests 200]
[--system-words 400] [--question-words 12] [--output-len 16] [--concurrency 16]
[--num-pages 150] [--repeats 3] [--kill] [--router COMMAND]``

Set-up: ``--replicas`` servers, each on a port of its own with a pool of ``--num-pages``
pages and its KV-cache events on a ZeroMQ port of its own (``--kv-events-config``), all
started once; for each run a router on its own port in front of them with one policy:
``round_robin``; ``cache_aware`` (the router's own tree of the request texts it sent
where); ``kv_aware`` (the replicas' KV events: which pages each one holds now).

Workload: ``--requests`` completions, each a system prompt of ``--system-words`` words
(one of ``--system-prompts``, drawn at random) then a question of ``--question-words``
words, generating ``--output-len`` greedy tokens; ``--concurrency`` clients each send the
next request when their last one is answered (a closed loop). Every run draws new system
prompts (seeded by run), so a run finds nothing cached by the one before. The default
pool holds about half of the system prompts at once: a fleet serves more prompts than
one replica's cache holds, which is when routing decides the hits.

Per run: the hit rate (prompt tokens served by the prefix cache over prompt tokens, from
each answer's ``usage.prompt_tokens_details.cached_tokens``), output tokens/s (generated
tokens over the run's wall time), failed requests. Per policy: min / median / max over
``--repeats`` rounds, the policies run one after the other within each round; the ratios
to round robin are of the medians.

``--router``: the router's command (default: ``vllm-router`` on the PATH); SGLang's,
which takes the same flags, runs as ``--router "sglang-router launch" --policies
round_robin cache_aware`` (it has no ``kv_aware``), its results written as
``fleet_sglang_router.json``.

``--kill``: one more run with ``cache_aware`` in which the last replica is killed
(SIGKILL) once a third of the requests are answered; every request must be answered or
get an error, none may hang (each waits at most ``--timeout`` seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.bench_serve import ServerProcess, _free_port, _get, stop_process
from benchmarks.common import environment, positive_int, write_result

POLICIES = ("round_robin", "cache_aware", "kv_aware")
NAME = "fleet"  # the served model name on every replica
# Words the prompts are made of (ordinary English: a few tokens each in any tokenizer).
WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have "
    "from or one had by word but not what all were we when your can said there use an each "
    "which she do how their if will up other about out many then them these so some her "
    "would make like him into time has look two more write go see number no way could "
    "people my than first water been call who oil its now find long down day did get come "
    "made may part over new sound take only little work know place year live me back give "
    "most very after thing our just name good sentence man think say great where help "
    "through much before line right too mean old any same tell boy follow came want show "
    "also around form three small set put end does another well large must big even such "
    "because turn here why ask went men read need land different home us move try kind hand "
    "picture again change off play spell air away animal house point page letter mother "
    "answer found study still learn should america world"
).split()


def words(rng, n: int) -> str:
    return " ".join(rng.choice(WORDS, size=n).tolist())


def workload(seed: int, args) -> list[str]:
    """The run's prompts: ``--requests`` texts, each a system prompt (of
    ``--system-prompts``, drawn at random) and a question (seeded by ``seed``)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    systems = [
        f"System {seed}-{i}: you are a helpful assistant. " + words(rng, args.system_words)
        for i in range(args.system_prompts)
    ]
    picks = rng.integers(0, len(systems), size=args.requests)
    return [f"{systems[k]}\n\nUser: {words(rng, args.question_words)}?" for k in picks]


# --------------------------------------------------------------------------- processes
def replica_command(args, events_port: int):
    def command(port: int) -> list[str]:
        config = f'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:{events_port}"}}'
        return [
            sys.executable, "-m", "paged_jax.cli", "serve", "--model", args.model,
            "--served-model-name", NAME, "--port", str(port), "--num-pages",
            str(args.num_pages), "--page-size", str(args.page_size), "--max-num-seqs",
            str(args.concurrency), "--kv-events-config", config, "--log-level", "warning",
        ]  # fmt: skip

    return command


class Router:
    """``vllm-router`` in front of ``replicas`` with ``policy``; waits until it answers
    ``/v1/models``; stopped with SIGINT (SIGKILL after 10 s)."""

    def __init__(self, router: list[str], replicas: list, events: list[int], policy: str, args):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        urls = [r.base for r in replicas]
        self.cmd = [*router, "--host", "127.0.0.1", "--port", str(self.port), "--worker-urls",
                    *urls, "--policy", policy, "--prometheus-port", str(_free_port())]  # fmt: skip
        if policy == "kv_aware":
            for url, port in zip(urls, events, strict=True):
                self.cmd += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{port}"]
            self.cmd += ["--kv-event-block-size", str(args.page_size), "--kv-event-model", NAME]
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"router-{policy}-", suffix=".log")

    def __enter__(self):
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        end = time.monotonic() + 60
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"vllm-router exited: {self.log.read()[-1500:]}")
            try:
                if _get(self.base + "/v1/models", timeout=5).status_code == 200:
                    return self
            except Exception:  # not listening yet
                pass
            time.sleep(0.3)
        self.__exit__()
        raise RuntimeError("vllm-router: not ready after 60 s")

    def __exit__(self, *exc):
        stop_process(self.proc, 10)
        self.log.close()


def router_command(text: str | None) -> tuple[list[str], str, str | None]:
    """(the router's command, the results' name, its version) from ``--router``."""
    import shlex

    from benchmarks.common import _version

    cmd = shlex.split(text) if text else [shutil.which("vllm-router") or "vllm-router"]
    exe = shutil.which(cmd[0]) or cmd[0]
    if not os.access(exe, os.X_OK):
        return cmd, "", None
    dist = os.path.basename(cmd[0]).replace("_", "-")
    version = _version(dist)
    if version is None:  # a router from another environment: ask its Python's pip
        pip = os.path.join(os.path.dirname(exe), "pip")
        out = subprocess.run([pip, "show", dist], capture_output=True, text=True).stdout
        found = [ln.split()[1] for ln in out.splitlines() if ln.startswith("Version:")]
        version = found[0] if found else None
    name = "fleet" if dist == "vllm-router" else "fleet_" + dist.replace("-", "_")
    return [exe, *cmd[1:]], name, version


# --------------------------------------------------------------------------- the client
async def closed_loop(base: str, prompts: list[str], args, on_answer=None) -> list[dict]:
    """``args.concurrency`` clients sending ``prompts`` in order, each its next one once
    its last is answered. One record per request: ``{"tokens", "prompt", "cached",
    "error", "hung", "seconds"}``; ``on_answer(n)`` after each answer (n answered)."""
    import httpx2

    queue = list(enumerate(prompts))
    queue.reverse()
    records: list[dict | None] = [None] * len(prompts)
    answered = 0
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx2.Timeout(args.timeout, connect=30.0)
    async with httpx2.AsyncClient(limits=limits, timeout=timeout) as client:

        async def one_client() -> None:
            nonlocal answered
            while queue:
                i, prompt = queue.pop()
                body = dict(model=NAME, prompt=prompt, max_tokens=args.output_len,
                            temperature=0.0, ignore_eos=True)  # fmt: skip
                rec = dict(tokens=0, prompt=0, cached=0, error=None, hung=False)
                t = time.perf_counter()
                try:
                    r = await client.post(base + "/v1/completions", json=body)
                    if r.status_code != 200:
                        rec["error"] = f"HTTP {r.status_code}: {r.text[:200]}"
                    else:
                        usage = r.json()["usage"]
                        rec["tokens"] = usage["completion_tokens"]
                        rec["prompt"] = usage["prompt_tokens"]
                        details = usage.get("prompt_tokens_details") or {}
                        rec["cached"] = details.get("cached_tokens") or 0
                except httpx2.TimeoutException:
                    rec["error"], rec["hung"] = f"no answer in {args.timeout} s", True
                except Exception as e:  # a dropped connection is a failed request
                    rec["error"] = f"{type(e).__name__}: {e}"
                rec["seconds"] = time.perf_counter() - t
                records[i] = rec
                answered += 1
                if on_answer is not None:
                    on_answer(answered)

        await asyncio.gather(*(one_client() for _ in range(args.concurrency)))
    return records


def summarize(records: list[dict], seconds: float) -> dict:
    ok = [r for r in records if r["error"] is None]
    prompt = sum(r["prompt"] for r in ok)
    tokens = sum(r["tokens"] for r in ok)
    return dict(
        requests=len(records),
        answered=len(ok),
        failed=len(records) - len(ok),
        hung=sum(r["hung"] for r in records),
        seconds=seconds,
        prompt_tokens=prompt,
        cached_tokens=sum(r["cached"] for r in ok),
        hit_rate=sum(r["cached"] for r in ok) / prompt if prompt else 0.0,
        output_tok_s=tokens / seconds if seconds else 0.0,
        errors=sorted({r["error"][:120] for r in records if r["error"]})[:5],
    )


def spread(xs: list[float]) -> dict:
    return dict(min=min(xs), median=statistics.median(xs), max=max(xs))


# --------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks fleet")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--replicas", type=positive_int, default=2)
    ap.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    ap.add_argument("--system-prompts", type=positive_int, default=8)
    ap.add_argument("--requests", type=positive_int, default=200)
    ap.add_argument("--system-words", type=positive_int, default=400)
    ap.add_argument("--question-words", type=positive_int, default=12)
    ap.add_argument("--output-len", type=positive_int, default=16)
    ap.add_argument("--concurrency", type=positive_int, default=16)
    ap.add_argument("--num-pages", type=positive_int, default=150)
    ap.add_argument("--page-size", type=positive_int, default=16)
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a request may wait")
    ap.add_argument("--kill", action="store_true", help="also a run that kills a replica")
    ap.add_argument("--router", default=None, help="the router's command (default: vllm-router)")
    args = ap.parse_args(argv)
    binary, result_name, router_version = router_command(args.router)
    if not result_name:
        print(f"fleet: no router {binary[0]!r}: pip install vllm-router", file=sys.stderr)
        return 2

    def say(msg: str) -> None:
        print(f"fleet: {msg}", file=sys.stderr, flush=True)

    events = [_free_port() for _ in range(args.replicas)]
    replicas = [ServerProcess(replica_command(args, p), f"replica{i}")
                for i, p in enumerate(events)]  # fmt: skip
    runs: dict[str, list[dict]] = {p: [] for p in args.policies}
    kill_run = None
    started = []
    try:
        for r in replicas:
            say(f"starting {r.name} on {r.base}")
            started.append(r.__enter__())
            say(f"{r.name} ready in {r.startup_s:.1f} s")
        for rep in range(args.repeats):
            for k, policy in enumerate(args.policies):
                prompts = workload(1000 * rep + k, args)
                with Router(binary, replicas, events, policy, args) as router:
                    t = time.perf_counter()
                    records = asyncio.run(closed_loop(router.base, prompts, args))
                    res = summarize(records, time.perf_counter() - t)
                runs[policy].append(res)
                say(f"round {rep + 1} {policy}: hit rate {res['hit_rate']:.3f}, "
                    f"{res['output_tok_s']:.1f} tok/s, {res['failed']} failed")  # fmt: skip
        if args.kill and args.replicas > 1:
            prompts = workload(999_999, args)
            victim = replicas[-1]
            with Router(binary, replicas, events, "cache_aware", args) as router:

                def on_answer(n: int) -> None:
                    if n == len(prompts) // 3 and victim.proc.poll() is None:
                        say(f"killing {victim.name} after {n} answers")
                        victim.proc.kill()

                t = time.perf_counter()
                records = asyncio.run(closed_loop(router.base, prompts, args, on_answer))
                kill_run = summarize(records, time.perf_counter() - t)
            say(f"killed run: {kill_run['answered']} answered, {kill_run['failed']} failed, "
                f"{kill_run['hung']} hung")  # fmt: skip
    finally:
        for r in started:
            r.__exit__(None, None, None)
    summary = {}
    for policy, rs in runs.items():
        summary[policy] = dict(
            hit_rate=spread([r["hit_rate"] for r in rs]),
            output_tok_s=spread([r["output_tok_s"] for r in rs]),
            failed=sum(r["failed"] for r in rs),
        )
    if "round_robin" in summary:
        base = summary["round_robin"]
        for s in summary.values():
            hr, tp = base["hit_rate"]["median"], base["output_tok_s"]["median"]
            s["hit_rate_vs_round_robin"] = s["hit_rate"]["median"] / hr if hr else None
            s["tok_s_vs_round_robin"] = s["output_tok_s"]["median"] / tp if tp else None
    for policy, s in summary.items():
        print(
            f"{policy:>12}: hit rate {s['hit_rate']['median']:.3f} "
            f"[{s['hit_rate']['min']:.3f}, {s['hit_rate']['max']:.3f}], "
            f"{s['output_tok_s']['median']:.1f} tok/s "
            f"[{s['output_tok_s']['min']:.1f}, {s['output_tok_s']['max']:.1f}]"
            + (f", x{s['hit_rate_vs_round_robin']:.2f} hits, x{s['tok_s_vs_round_robin']:.2f} "
               "tok/s vs round robin" if s.get("tok_s_vs_round_robin") else "")
        )  # fmt: skip
    if kill_run is not None:
        print(f"killed replica: {kill_run['answered']} answered, {kill_run['failed']} failed "
              f"with an error, {kill_run['hung']} hung of {kill_run['requests']}")  # fmt: skip
    versions = {"router": " ".join(binary), "router_version": router_version}
    payload = dict(
        environment=environment(),
        command="python -m benchmarks fleet " + " ".join(sys.argv[1:] if argv is None else argv),
        versions=versions,
        setup=dict(
            replicas=args.replicas,
            model=args.model,
            num_pages=args.num_pages,
            page_size=args.page_size,
            max_num_seqs=args.concurrency,
        ),
        workload=dict(
            system_prompts=args.system_prompts,
            requests=args.requests,
            system_words=args.system_words,
            question_words=args.question_words,
            output_len=args.output_len,
            concurrency=args.concurrency,
            repeats=args.repeats,
            sampling="greedy, ignore_eos, unstreamed /v1/completions, closed loop",
        ),
        summary=summary,
        runs=runs,
        kill_run=kill_run,
    )
    path = write_result(result_name, payload)
    print(f"results: {path}")
    return 0
