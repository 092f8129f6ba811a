"""``paged-jax perplexity``, ``paged-jax embed`` and ``paged-jax bench`` (a benchmark of a
source checkout's ``benchmarks/``, run as ``python -m benchmarks``: nothing of it is
imported here)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from paged_jax.cli.common import (
    UsageError,
    compilation_cache_of,
    flag_names,
    kv_cache_dtype,
    load_model,
    prompts_of,
    read_text,
    start_jax,
)


def perplexity(args) -> int:
    """``paged-jax perplexity``: ``engine.scoring.perplexity`` of ``--file`` under
    ``--model``, printed (or as JSON)."""
    if os.sep in args.model and not pathlib.Path(args.model).exists():  # before JAX starts
        raise UsageError(f"--model: {args.model}: no such checkpoint directory or GGUF file")
    text = read_text(args.file, "--file")
    if not text.strip():
        raise UsageError(f"--file: {args.file} holds no text")
    if args.context < 2:
        raise UsageError(f"--context: expected an int >= 2, got {args.context}")
    if args.stride is not None and not 1 <= args.stride <= args.context:
        raise UsageError(
            f"--stride: expected an int in [1, --context={args.context}], got {args.stride}"
        )
    start_jax(args)
    from paged_jax.engine import LLM
    from paged_jax.engine.scoring import perplexity

    model, tokenizer = load_model(args.model, args.dtype, None, args.quantization)
    if tokenizer is None:
        raise UsageError(f"--model: {args.model} has no tokenizer to read --file with")
    longest = model.config.max_position_embeddings
    if args.context >= longest:
        raise UsageError(
            f"--context: expected at most {longest - 1} (the model's length minus one, for "
            f"the token each window samples), got {args.context}"
        )
    try:
        llm = LLM(
            model,
            tokenizer=tokenizer,
            num_pages=args.num_pages,
            page_size=args.page_size,
            max_model_len=args.context + 1,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=False,  # (scored prompts never share pages)
            compilation_cache=compilation_cache_of(args),
            cache_dtype=kv_cache_dtype(args),
        )
        ids = llm.encode(text)
        if len(ids) < 2:
            raise UsageError(f"--file: {args.file} holds {len(ids)} token; at least 2 are scored")
        got = perplexity(
            llm,
            ids,
            context=args.context,
            stride=args.stride,
            progress=not (args.no_progress or args.json),
        )
    except ValueError as e:
        message = str(e)
        for name, flag in (("context", "--context"), ("stride", "--stride")):
            if message.startswith(name + ":"):
                message = flag + message[len(name) :]
        raise UsageError(flag_names(message)) from None
    if args.json:
        print(json.dumps(dict(got.as_dict(), model=args.model, file=args.file), indent=2))
        return 0
    print(
        f"perplexity {got.perplexity:.4f} over {got.tokens} token{'s' if got.tokens > 1 else ''}"
        f" (mean log-prob "
        f"{got.mean_logprob:.4f}; {got.windows} window{'s' if got.windows > 1 else ''} of "
        f"up to {got.context} tokens, "
        f"{got.stride} apart; {got.seconds:.1f} s)"
    )
    return 0


def embed(args) -> int:
    """``paged-jax embed``: ``LLM.embed`` of the command line's prompts, one JSON line each
    (``index``, ``tokens``, ``embedding``)."""
    if os.sep in args.model and not pathlib.Path(args.model).exists():  # before JAX starts
        raise UsageError(f"--model: {args.model}: no such checkpoint directory or GGUF file")
    if not (args.prompt or args.prompts_file or args.prompt_ids):
        raise UsageError("--prompt, --prompts-file or --prompt-ids: give at least one prompt")
    prompts = prompts_of(args)
    if args.max_num_batched_tokens < 1:
        raise UsageError(
            f"--max-num-batched-tokens: expected an int >= 1, got {args.max_num_batched_tokens}"
        )
    start_jax(args)
    from paged_jax.engine import LLM

    model, tokenizer = load_model(args.model, args.dtype, None, args.quantization)
    if tokenizer is None and any(isinstance(p, str) for p in prompts):
        raise UsageError(f"--model: {args.model} has no tokenizer; give --prompt-ids")
    try:
        llm = LLM(
            model,
            tokenizer=tokenizer,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=False,
            compilation_cache=compilation_cache_of(args),
            cache_dtype=kv_cache_dtype(args),
        )
        outs = llm.embed(prompts, pooling=args.pooling, normalize=not args.no_normalize)
    except ValueError as e:
        raise UsageError(flag_names(str(e))) from None
    for k, out in enumerate(outs):
        line = {"index": k, "tokens": len(out.prompt_token_ids)}
        print(json.dumps(line | {"embedding": [round(float(x), 7) for x in out.embedding]}))
    return 0


def bench(args) -> int:
    """``paged-jax bench NAME [args]``: ``python -m benchmarks NAME [args]`` of the source
    checkout this package runs from, in this directory (its ``--out`` default, a new
    ``bench-results/<time>``, lies here); its exit status."""
    root = pathlib.Path(__file__).resolve().parents[2]
    if not (root / "benchmarks" / "__main__.py").is_file():
        raise UsageError(
            f"bench: the benchmarks are in a source checkout ({root} has none); run it "
            "from one (pip install -e . there)"
        )
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run([sys.executable, "-m", "benchmarks", args.name, *args.args], env=env)
    return done.returncode
