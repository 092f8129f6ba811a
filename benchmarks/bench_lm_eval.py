"""``paged-jax serve`` scored by an evaluation harness nobody here wrote, beside
transformers on the same model file.

``python -m benchmarks lm_eval --lm-eval-python VENV/bin/python [--out DIR]``

lm-evaluation-harness runs in a virtual environment of its own (``--lm-eval-python``, or
``$LM_EVAL_PYTHON``): ``python -m venv --system-site-packages VENV`` (for a CPU torch
already installed) and ``VENV/bin/pip install "lm_eval[api]" gguf``. It runs two local
tasks, written into a temporary directory (no dataset download):

- ``pj_mc``: 30 hand-written multiple-choice questions, each answered by the choice of
  highest log-likelihood (accuracy, and each choice's log-likelihood and greedy flag);
- ``pj_ppl``: the rolling log-likelihood of ``bench_quantization.likelihood_text`` (812
  tokens of public-domain prose): word perplexity and bits per byte.

twice: with its ``local-completions`` model against ``paged-jax serve`` on SmolLM2's GGUF
(the server's ``echo`` + ``logprobs`` answers, the harness's remote tokenizer from
``/tokenizer_info``), then with its ``hf`` model on the same GGUF loaded by transformers
(dequantized to f32, as paged-jax loads it). Written: both runs' metrics, and over every
request the largest and mean difference of log-likelihood and the greedy flags that
agree.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

from benchmarks.common import environment, write_result

# (question, choices, index of the right one): common knowledge, written for this file
QUESTIONS = [
    ("The capital of France is", [" Paris", " Berlin", " Madrid", " Rome"], 0),
    ("Water freezes at a temperature of", [" 0 degrees Celsius", " 50 degrees Celsius",
                                           " 100 degrees Celsius", " 20 degrees Celsius"], 0),
    ("The largest planet in the solar system is", [" Mars", " Jupiter", " Venus", " Mercury"], 1),
    ("A week has", [" five days", " seven days", " ten days", " three days"], 1),
    ("The opposite of hot is", [" cold", " loud", " tall", " fast"], 0),
    ("Bees make", [" honey", " steel", " glass", " paper"], 0),
    ("The sun rises in the", [" east", " west", " north", " south"], 0),
    ("Two plus two equals", [" four", " seven", " nine", " one"], 0),
    ("A baby cat is called a", [" kitten", " puppy", " calf", " foal"], 0),
    ("The color of grass is usually", [" green", " purple", " orange", " black"], 0),
    ("People use an umbrella when it", [" rains", " snows indoors", " is dark", " is quiet"], 0),
    ("The chemical symbol for water is", [" H2O", " CO2", " NaCl", " O3"], 0),
    ("A triangle has", [" three sides", " four sides", " five sides", " six sides"], 0),
    ("The Pacific is an", [" ocean", " island", " mountain", " desert"], 0),
    ("Shakespeare wrote", [" Hamlet", " The Odyssey", " Don Quixote", " War and Peace"], 0),
    ("The fastest land animal is the", [" cheetah", " turtle", " snail", " cow"], 0),
    ("Ice is the solid form of", [" water", " air", " iron", " sand"], 0),
    ("The primary language spoken in Brazil is", [" Portuguese", " German", " Japanese",
                                                  " Russian"], 0),
    ("A doctor works in a", [" hospital", " bakery", " garage", " library"], 0),
    ("The moon orbits the", [" Earth", " Sun directly", " Mars", " Jupiter"], 0),
    ("Paper is made from", [" wood", " glass", " stone", " plastic bottles"], 0),
    ("The number after nine is", [" ten", " eight", " twelve", " six"], 0),
    ("Fish live in", [" water", " trees", " deserts", " clouds"], 0),
    ("The author of the theory of relativity is", [" Albert Einstein", " Isaac Newton",
                                                   " Charles Darwin", " Marie Curie"], 0),
    ("Snow is usually", [" white", " red", " blue", " green"], 0),
    ("The heart pumps", [" blood", " air", " water", " bile only"], 0),
    ("Plants need sunlight to perform", [" photosynthesis", " digestion", " respiration only",
                                         " migration"], 0),
    ("The Great Wall is in", [" China", " Egypt", " Peru", " Canada"], 0),
    ("A year has", [" twelve months", " ten months", " six months", " fifteen months"], 0),
    ("Gold is a", [" metal", " gas", " liquid at room temperature", " plant"], 0),
]  # fmt: skip

TASKS = {
    "pj_mc": """task: pj_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/pj_mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
""",
    "pj_ppl": """task: pj_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/pj_ppl.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
""",
}
METRICS = {"pj_mc": ["acc"], "pj_ppl": ["word_perplexity", "bits_per_byte"]}


def write_tasks(where: pathlib.Path) -> pathlib.Path:
    """The two tasks' YAML and data under ``where/tasks``; returns that directory."""
    from benchmarks.bench_quantization import likelihood_text

    d = where / "tasks"
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "pj_mc.jsonl", "w") as f:
        for q, choices, answer in QUESTIONS:
            f.write(json.dumps({"question": q, "choices": choices, "answer": answer}) + "\n")
    with open(d / "pj_ppl.jsonl", "w") as f:
        f.write(json.dumps({"text": likelihood_text()}) + "\n")
    for name, text in TASKS.items():
        (d / f"{name}.yaml").write_text(text.format(dir=d.resolve()))
    return d


def read_run(out: pathlib.Path) -> tuple[dict, dict]:
    """A harness run's ``(metrics {task: {metric: value}}, requests {(task, doc, i):
    (log-likelihood, greedy or None)})`` from its ``--output_path`` directory."""
    results = sorted(glob.glob(str(out / "**" / "results_*.json"), recursive=True))
    if not results:
        raise RuntimeError(f"{out}: no results_*.json (the harness's run failed)")
    table = json.loads(pathlib.Path(results[-1]).read_text())["results"]
    metrics = {t: {m: table[t][f"{m},none"] for m in ms} for t, ms in METRICS.items()}
    requests = {}
    for path in glob.glob(str(out / "**" / "samples_*.jsonl"), recursive=True):
        task = next(t for t in METRICS if f"samples_{t}_" in path)
        for line in open(path):
            doc = json.loads(line)
            for i, resp in enumerate(doc["resps"]):
                r = resp[0]
                if isinstance(r, list):  # [log-likelihood, is_greedy]
                    requests[(task, doc["doc_id"], i)] = (float(r[0]), r[1] in (True, "True"))
                else:  # a rolling log-likelihood
                    requests[(task, doc["doc_id"], i)] = (float(r), None)
    return metrics, requests


def compare(a: dict, b: dict) -> dict:
    """Two runs' requests (``read_run``) side by side: how many, the largest and mean
    absolute log-likelihood difference, and the greedy flags that agree."""
    if set(a) != set(b):
        raise ValueError(f"the runs asked different requests: {sorted(set(a) ^ set(b))[:5]}")
    diffs = [abs(a[k][0] - b[k][0]) for k in a]
    flags = [k for k in a if a[k][1] is not None]
    return dict(
        requests=len(a),
        max_abs_loglikelihood_diff=max(diffs),
        mean_abs_loglikelihood_diff=sum(diffs) / len(diffs),
        greedy_flags=len(flags),
        greedy_flags_equal=sum(a[k][1] == b[k][1] for k in flags),
    )


def _harness(python: str, args: list[str], log: pathlib.Path) -> None:
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    with open(log, "w") as f:
        rc = subprocess.run(
            [python, "-m", "lm_eval", *args], stdout=f, stderr=subprocess.STDOUT, env=env
        ).returncode
    if rc != 0:
        raise RuntimeError(f"lm_eval exited with {rc}; its log: {log}")


def _versions(python: str) -> dict:
    code = (
        "import importlib.metadata as m, json\n"
        "print(json.dumps({d: m.version(d) for d in ('lm_eval', 'transformers', 'torch', "
        "'gguf')}))"
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(
            f"--lm-eval-python {python}: lm_eval, transformers, torch and gguf must be "
            f"installed there ({out.stderr.strip().splitlines()[-1:]})"
        )
    return json.loads(out.stdout)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks lm_eval")
    ap.add_argument(
        "--lm-eval-python",
        default=os.environ.get("LM_EVAL_PYTHON"),
        help="python of a venv with lm_eval[api], transformers, torch and gguf",
    )
    ap.add_argument("--concurrent", type=int, default=4, help="the harness's requests at once")
    args = ap.parse_args(argv)
    if not args.lm_eval_python:
        ap.error("--lm-eval-python (or $LM_EVAL_PYTHON): a Python with lm_eval installed")
    versions = _versions(args.lm_eval_python)
    from benchmarks.bench_serve import ServerProcess
    from paged_jax.models.registry import fetch

    gguf = fetch("smollm2-135m-instruct")
    # the harness's tasks, outputs and logs (removed once the comparison is written; a
    # failed run names its log there)
    out = pathlib.Path(tempfile.mkdtemp(prefix="paged-jax-lm-eval-"))
    tasks = write_tasks(out)
    common = ["--tasks", "pj_mc,pj_ppl", "--include_path", str(tasks), "--log_samples"]

    def serve(port: int) -> list[str]:
        cli = [sys.executable, "-m", "paged_jax.cli", "serve", "--model", str(gguf)]
        return cli + ["--served-model-name", "smol", "--port", str(port), "--log-level", "warning"]

    print("lm_eval: paged-jax serve (local-completions)", file=sys.stderr, flush=True)
    with ServerProcess(serve, "paged-jax") as server:
        model_args = (
            f"model=smol,base_url={server.base}/v1/completions,"
            f"num_concurrent={args.concurrent},max_retries=1"
        )
        _harness(
            args.lm_eval_python,
            ["--model", "local-completions", "--model_args", model_args, *common,
             "--output_path", str(out / "paged-jax")],
            out / "paged-jax.log",
        )  # fmt: skip
    print("lm_eval: transformers on the same GGUF (hf, f32)", file=sys.stderr, flush=True)
    _harness(
        args.lm_eval_python,
        ["--model", "hf", "--model_args",
         f"pretrained={gguf.parent},gguf_file={gguf.name},dtype=float32",
         "--device", "cpu", "--batch_size", "8", *common,
         "--output_path", str(out / "transformers")],
        out / "transformers.log",
    )  # fmt: skip
    ours, ours_requests = read_run(out / "paged-jax")
    theirs, their_requests = read_run(out / "transformers")
    agreement = compare(ours_requests, their_requests)
    for task, ms in METRICS.items():
        for m in ms:
            print(f"{task} {m}: paged-jax {ours[task][m]:.6g}, transformers {theirs[task][m]:.6g}")
    print(
        f"{agreement['requests']} requests: log-likelihoods within "
        f"{agreement['max_abs_loglikelihood_diff']:.3g} (mean "
        f"{agreement['mean_abs_loglikelihood_diff']:.3g}); greedy flags "
        f"{agreement['greedy_flags_equal']} of {agreement['greedy_flags']} equal"
    )
    payload = dict(
        environment=environment(),
        command="python -m benchmarks lm_eval " + " ".join(argv or sys.argv[1:]),
        harness=versions,
        model=dict(name="SmolLM2-135M-Instruct", file=gguf.name, dtype="float32"),
        tasks=dict(
            pj_mc=f"{len(QUESTIONS)} multiple-choice questions",
            pj_ppl="bench_quantization.likelihood_text, rolling",
        ),  # fmt: skip
        metrics={"paged-jax": ours, "transformers": theirs},
        agreement=agreement,
    )
    path = write_result("lm_eval", payload)
    shutil.rmtree(out)
    print(f"results: {path}")
    return 0
