"""The ``paged-jax`` command line's flags: the parser of every subcommand and the flag
groups they share (``_engine_flags``, ``_parallel_flags``), and ``--version``. Split from
``paged_jax.cli``, which runs the commands; no JAX here."""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

# ``benchmarks/bench_<name>.py`` of a source checkout, for ``paged-jax bench`` and
# ``python -m benchmarks`` both (a test holds the list to the modules)
BENCHMARKS = (
    "memory",
    "sharing",
    "throughput",
    "host_overhead",
    "kernels",
    "engine",
    "block_manager",
    "layer_view",
    "peers",
    "serve",
    "hybrid",
    "sampler",
    "serve_vllm_client",
    "quantization",
    "grammar",
    "speculative",
    "dispatch",
    "products",
    "lora",
    "structured",
    "draw",
    "lm_eval",
    "step_kernels",
    "moe",
    "gguf",
    "fleet",
)


def _version() -> str:
    """``paged-jax 0.1.0 (jax 0.10.2, jaxlib 0.10.2, Python 3.11.7)``, without importing JAX."""
    from importlib import metadata

    from paged_jax import __version__

    def installed(dist):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    jax, jaxlib, py = installed("jax"), installed("jaxlib"), sys.version.split()[0]
    return f"paged-jax {__version__} (jax {jax}, jaxlib {jaxlib}, Python {py})"


def _prompt_flags(p: argparse.ArgumentParser) -> None:
    """``--prompt``, ``--prompts-file`` and ``--prompt-ids`` (``cli._prompts`` reads them)."""
    p.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
    p.add_argument(
        "--prompts-file", type=pathlib.Path, help="one prompt per line (UTF-8; '-': standard input)"
    )
    p.add_argument(
        "--prompt-ids",
        action="append",
        default=None,
        metavar="IDS",
        help="a prompt as token ids, e.g. '1,15,42' (repeatable; no tokenizer needed)",
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="paged-jax", description="PagedAttention for JAX")
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text with continuous batching on a paged cache")
    g.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="'smollm2-135m-instruct' (a real model, downloaded once; as chat and serve), "
        "'tiny-llama' (built in, random weights: its text is noise), a Hugging Face "
        "checkpoint dir or a .gguf file",
    )
    _prompt_flags(g)
    g.add_argument("-n", type=int, default=1, help="samples per prompt (share prompt pages)")
    g.add_argument("--beam-width", type=int, default=1, help="beam search width (1: off)")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="1: off")
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument(
        "--stop", action="append", default=None, help="a stop string (repeatable; not kept)"
    )
    g.add_argument(
        "--chat",
        action="store_true",
        help="each prompt is a user message, rendered with the model's chat template",
    )
    _engine_flags(g)
    g.add_argument("--no-progress", action="store_true")
    g.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="compute dtype of a checkpoint (default: as stored; 16-bit runs in float32 on a "
        "CPU without native bf16)",
    )
    g.add_argument(
        "--compilation-cache",
        default=None,
        metavar="DIR|off",
        help="keep compiled steps here for the next run (default: $PAGED_JAX_COMPILATION_CACHE,"
        " else ~/.cache/paged-jax/xla); off: compile every run",
    )
    g.add_argument("--json", action="store_true", help="print outputs and metrics as JSON")
    _parallel_flags(g, processes=True)
    c = sub.add_parser(
        "chat", help="talk with a model: multi-turn, its reply printed as it is generated"
    )
    c.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="a model with a chat template: 'smollm2-135m-instruct' (default, downloaded "
        "once), a Hugging Face checkpoint dir or a .gguf file",
    )
    c.add_argument("--system", default=None, help="a system message to start with")
    c.add_argument("--max-tokens", type=int, default=256)
    c.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--seed", type=int, default=None)
    c.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    c.add_argument(
        "--hide-thinking",
        action="store_true",
        help="a reasoning model's thinking (<think> ... </think>, where the chat template "
        "has it) is printed dim to stderr and kept out of the conversation; this leaves it "
        "out of the screen too",
    )
    c.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16"], help="default: as stored"
    )
    c.add_argument(
        "--compilation-cache",
        default=None,
        help="directory of compiled steps kept across runs, or 'off'",
    )
    c.add_argument(
        "--no-warm-up",
        action="store_true",
        help="start at once and compile step shapes as they first occur (default: compile "
        "them all first, so that no reply waits for one)",
    )
    _parallel_flags(c, processes=False)
    s = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (completions, chat, streaming)"
    )
    s.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="'smollm2-135m-instruct' (default, downloaded once), 'tiny-llama', a Hugging "
        "Face checkpoint dir or a .gguf file (with a tokenizer)",
    )
    s.add_argument(
        "--served-model-name", default=None, help="the name clients use (default: --model)"
    )
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument(
        "--allowed-hosts",
        default=None,
        help="comma-separated Host headers to answer, '*' for any (default: --host and the "
        "loopback names; any host for a wildcard --host)",
    )
    s.add_argument("--port", type=int, default=8000)
    s.add_argument(
        "--api-key",
        default=os.environ.get("PAGED_JAX_API_KEY"),
        help="clients must send 'Authorization: Bearer KEY' (default: $PAGED_JAX_API_KEY; "
        "none: no check)",
    )
    s.add_argument(
        "--max-waiting",
        type=int,
        default=256,
        help="requests that may wait beyond those running; more are answered 429",
    )
    s.add_argument(
        "--max-request-bytes",
        type=int,
        default=None,
        help="larger request bodies are answered 413 (default: 64 bytes per token of the "
        "model's context, at least 1 MiB)",
    )
    s.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds requests in flight may take to finish after SIGINT / SIGTERM",
    )
    s.add_argument(
        "--header-timeout",
        type=float,
        default=30.0,
        help="seconds a connection may take to send a request's headers (after it opens "
        "or after the previous response); then it is closed",
    )
    s.add_argument(
        "--body-timeout",
        type=float,
        default=60.0,
        help="seconds a request's body may take to arrive once its headers have; then 408",
    )
    s.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="open connections served at once; newer ones are closed on accept (default: "
        "1000, less where the descriptor limit is lower)",
    )
    s.add_argument(
        "--tool-call-parser",
        choices=["hermes", "llama3_json", "mistral"],
        default=None,
        help="the format the model writes tool calls in (default: from its chat template; "
        "hermes for Qwen and Hermes, llama3_json for Llama 3.1+, mistral)",
    )
    s.add_argument(
        "--reasoning-parser",
        choices=["deepseek_r1", "qwen3"],
        default=None,
        help="put what chat replies write between <think> and </think> in reasoning_content "
        "(DeepSeek-R1 and its distills, Qwen3, QwQ); default: none, it stays in content",
    )
    s.add_argument(
        "--embedding-pooling",
        choices=["last", "mean", "first"],
        default="last",
        help="how /v1/embeddings pools a prompt's final hidden states (default: last, as "
        "decoder embedders such as Qwen3-Embedding)",
    )
    _engine_flags(s)
    s.add_argument(
        "--no-warm-up",
        action="store_true",
        help="take requests at once and compile step shapes as they first occur (default: "
        "compile every step shape the configuration reaches first, so that none compiles "
        "while serving)",
    )
    s.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    s.add_argument(
        "--compilation-cache", default=None, help="directory of compiled steps, or 'off'"
    )
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    _parallel_flags(s, processes=False)
    x = sub.add_parser(
        "perplexity",
        help="a model's perplexity on a text: every token scored given the ones before it, "
        "in strided windows batched by the engine",
    )
    x.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="'smollm2-135m-instruct' (default, downloaded once), a Hugging Face checkpoint "
        "dir or a .gguf file (with a tokenizer)",
    )
    x.add_argument("--file", required=True, help="the text (UTF-8); '-' reads standard input")
    x.add_argument(
        "--context",
        type=int,
        default=512,
        help="tokens a window holds (at most the model's length minus one)",
    )
    x.add_argument(
        "--stride",
        type=int,
        default=None,
        help="tokens from one window to the next (default: half the context; equal to it: "
        "disjoint windows)",
    )
    x.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    x.add_argument("--page-size", type=int, default=16)
    x.add_argument("--num-pages", type=int, default=None, help="default: from a memory budget")
    x.add_argument("--max-num-seqs", type=int, default=64)
    x.add_argument("--max-num-batched-tokens", type=int, default=512)
    x.add_argument(
        "--compilation-cache", default=None, help="directory of compiled steps, or 'off'"
    )
    x.add_argument("--no-progress", action="store_true")
    x.add_argument("--json", action="store_true", help="print the result as JSON")
    e = sub.add_parser(
        "embed",
        help="embeddings: each prompt's final hidden states pooled into one vector, printed "
        "as JSON lines",
    )
    e.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="'smollm2-135m-instruct' (default, downloaded once), 'tiny-llama', a Hugging "
        "Face checkpoint dir or a .gguf file",
    )
    _prompt_flags(e)
    e.add_argument(
        "--pooling",
        choices=["last", "mean", "first"],
        default="last",
        help="the last token's hidden state (default, as decoder embedders), their mean, or "
        "the first's",
    )
    e.add_argument("--no-normalize", action="store_true", help="leave the vectors unscaled")
    e.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    e.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="tokens one step computes at most; longer prompts go in pieces (default: 2048)",
    )
    e.add_argument(
        "--compilation-cache", default=None, help="directory of compiled steps, or 'off'"
    )
    b = sub.add_parser(
        "bench",
        help="run a benchmark (from a source checkout); --out DIR among its arguments "
        "names where results go (default: a new bench-results/<time> here)",
    )
    b.add_argument("name", choices=BENCHMARKS)
    b.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    for name in ("generate", "chat", "serve", "perplexity", "embed"):
        _quantization_flag(sub.choices[name])
        _kv_cache_flag(sub.choices[name])
    for name in ("generate", "chat"):
        sub.choices[name].add_argument(
            "--lora",
            default=None,
            metavar="NAME=PATH",
            help="run with this PEFT LoRA adapter (a directory with adapter_config.json and "
            "adapter_model.safetensors)",
        )
    s.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="PEFT LoRA adapters to serve, each a model of its own: a request's model field "
        "names one (or the base model); /v1/models lists them",
    )
    s.add_argument(
        "--max-loras",
        type=int,
        default=None,
        help="adapters held on the device at once (default: every --lora-modules one); "
        "more are swapped in as requests need them",
    )
    s.add_argument(
        "--lora-allowed-dir",
        nargs="+",
        default=None,
        metavar="DIR",
        help="directories LoRA adapters may be loaded from while the server runs "
        "(POST /v1/load_lora_adapter and /v1/unload_lora_adapter, behind --api-key; "
        "needs --max-loras); default: loading at run time is off",
    )
    s.add_argument(
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help="publish the prefix cache's pages stored and evicted over ZeroMQ in vLLM's "
        "KV-event format, for cache-aware routers: vLLM's fields, e.g. "
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558"}\' (needs the kv-events extra: '
        "pip install 'paged-jax[kv-events]')",
    )
    s.add_argument(
        "--max-lora-rank",
        type=int,
        default=None,
        help="the largest adapter rank the slots hold (default: the largest --lora-modules "
        "one, else 16)",
    )
    for command in sub.choices.values():
        _show_defaults(command)
    return p


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """``--help`` names every flag's default: appended to its help (the help is written
    for a flag without one) unless the help says it already or there is none to name."""
    for action in parser._actions:
        default = action.default
        if not action.option_strings or default in (None, False, argparse.SUPPRESS):
            continue
        if "default" in (action.help or ""):
            continue
        action.help = (
            f"{action.help} (default: %(default)s)" if action.help else "default: %(default)s"
        )


def _quantization_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "int4", "fp8"],
        help="quantize the weights as they load: int8, a scale per output channel and "
        "group of 32 inputs on CPU, per output channel on a GPU or TPU (about a quarter "
        "of f32's memory), int4, 4-bit groups of 32 with a scale and a minimum (under a "
        "fifth), or fp8, e4m3 values with one scale per output channel (held as bf16 for "
        "the CPU's kernel); on CPU int8 and int4 quantize the activations too (W8A8). "
        "default: as stored: a GGUF file's Q4_0/Q4_1/Q4_K/Q5_0/Q5_1/Q5_K/Q6_K/Q8_0 "
        "blocks kept at about the file's size (at most 1.11x its bytes), multiplied as "
        "the float weights they stand for",
    )


# --kv-cache-dtype's choices: the KV pool's dtype (``LLM(cache_dtype=)``); "auto" the
# engine's default (the model's preferred_cache_dtype, else its compute dtype)
KV_CACHE_DTYPES = {
    "auto": None,
    "float32": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "int8": "int8",
    "fp8": "float8_e4m3fn",
}


def _kv_cache_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=list(KV_CACHE_DTYPES),
        help="the KV cache's dtype: auto, the model's compute dtype (bfloat16 for "
        "quantized weights on CPU); bfloat16 or float16 "
        "halve f32's bytes (twice the tokens in the same memory; on CPU the decode kernel "
        "reads half as much); int8 or fp8 (e4m3) quarter them, with a scale per token and "
        "head",
    )


def _engine_flags(parser: argparse.ArgumentParser) -> None:
    """The pool and scheduler flags of ``generate`` and ``serve``."""
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest sequence, prompt and output, in tokens (default: the model's context)",
    )
    parser.add_argument("--num-pages", type=int, default=None, help="default: from a memory budget")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--preemption", choices=["recompute", "swap"], default="recompute")
    parser.add_argument(
        "--scheduling-policy",
        choices=["fcfs", "priority"],
        default="fcfs",
        help="the order requests are admitted and preempted in: first come, first served, "
        "or each request's priority (lower first; the server's 'priority' field)",
    )
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="complete each step before scheduling the next (default: the next step is "
        "scheduled while the device runs the current one)",
    )
    parser.add_argument(
        "--num-scheduler-steps",
        type=int,
        default=1,
        help="decode steps per launch while every running sequence decodes and none waits "
        "(multi-step decoding: less host work per token, for throughput on CPU)",
    )
    parser.add_argument(
        "--speculative",
        choices=["ngram", "draft"],
        default=None,
        help="speculative decoding: ngram proposes the tokens that followed the latest "
        "earlier occurrence of a sequence's last tokens in its prompt and output, draft "
        "the greedy continuation of --draft-model; each step verifies them (the same "
        "tokens, fewer steps where the proposals are right)",
    )
    parser.add_argument(
        "--draft-model",
        default=None,
        help="with --speculative draft: a smaller model sharing the model's tokenizer (a "
        "name, checkpoint directory or GGUF file, as --model)",
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=4,
        help="tokens proposed per sequence per step, at most (with --speculative; 1 to 16)",
    )


def _parallel_flags(parser: argparse.ArgumentParser, *, processes: bool) -> None:
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="devices to split the model and KV cache over (heads; default 1)",
    )
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="replicas of the model, each with its own KV pool and its share of the "
        "requests, all stepped in one call (default 1); uses dp x tp devices",
    )
    parser.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="a mixture of experts: whole experts on each of the --tensor-parallel-size "
        "devices (their shares of each token added by one all-reduce) instead of every "
        "expert split by width",
    )
    if not processes:
        return
    parser.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="several processes, one mesh: process 0's address (jax.distributed); every "
        "process runs the same command with its own --process-id",
    )
    parser.add_argument("--num-processes", type=int, default=None)
    parser.add_argument("--process-id", type=int, default=None)
