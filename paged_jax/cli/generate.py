"""``paged-jax generate`` (the main demo: prompts to completions, a metrics table) and
``paged-jax chat`` (a conversation on the terminal, replies streamed)."""

from __future__ import annotations

import json
import os
import pathlib
import sys

from paged_jax.cli.common import (
    UsageError,
    check_engine_flags,
    compilation_cache_of,
    failed,
    flag_names,
    kv_cache_dtype,
    load_model,
    lora_specs,
    mesh_of,
    prompts_of,
    speculative_of,
    start_jax,
    with_loras,
)


def generate(args) -> int:
    if os.sep in args.model and not pathlib.Path(args.model).exists():  # before JAX starts
        raise UsageError(f"--model: {args.model}: no such checkpoint directory or GGUF file")
    if args.n < 1:
        raise UsageError(f"-n: expected >= 1, got {args.n}")
    if not 0.0 < args.top_p <= 1.0:
        raise UsageError(f"--top-p: expected a value in (0, 1], got {args.top_p}")
    prompts = prompts_of(args)
    check_engine_flags(args)
    loras = lora_specs([args.lora] if args.lora else [], "--lora")
    start_jax(args)
    from paged_jax.engine import LLM, SamplingParams

    try:  # every flag checked before the model loads
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
            seed=args.seed,
            n=args.n,
            beam_width=args.beam_width,
            ignore_eos=args.ignore_eos,
            stop=tuple(args.stop or ()),
        )
    except (ValueError, TypeError) as e:
        raise UsageError(flag_names(str(e))) from None
    mesh = mesh_of(args)
    model, tokenizer = load_model(
        args.model, args.dtype, mesh, args.quantization, args.enable_expert_parallel
    )
    if tokenizer is None and any(isinstance(p, str) for p in prompts):
        raise UsageError(
            f"--model: {args.model} has no tokenizer.json; give prompts as token ids "
            "with --prompt-ids"
        )
    try:
        llm = LLM(
            model,
            tokenizer=tokenizer,
            num_pages=args.num_pages,
            page_size=args.page_size,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=not args.no_prefix_caching,
            preemption=args.preemption,
            scheduling_policy=args.scheduling_policy,
            async_scheduling=not args.no_async_scheduling,
            num_scheduler_steps=args.num_scheduler_steps,
            speculative=speculative_of(args),
            compilation_cache=compilation_cache_of(args),
            mesh=mesh,
            cache_dtype=kv_cache_dtype(args),
            max_loras=len(loras),
            max_lora_rank=max((r for *_, r in loras), default=16),
        )
        with_loras(llm, loras)
        lora = loras[0][0] if loras else None
        show = not args.no_progress and not args.json
        if args.chat:
            if getattr(tokenizer, "chat_template", None) is None:
                raise UsageError(f"--chat: {args.model} has no chat template")
            turns = [[{"role": "user", "content": p}] for p in prompts]
            outputs = llm.chat(turns, params, progress=show, lora=lora)
        else:
            outputs = llm.generate(prompts, params, progress=show, lora=lora)
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise UsageError(flag_names(str(e))) from None
    if not llm.is_main_process:  # several processes: process 0 prints
        return 0
    metrics = llm.metrics.summary()
    if args.json:
        print(
            json.dumps(
                {
                    "outputs": [
                        {
                            "prompt": p,
                            "error": o.error,
                            "completions": [
                                {
                                    "text": c.text,
                                    "token_ids": c.token_ids,
                                    "finish_reason": c.finish_reason,
                                }
                                for c in o.outputs
                            ],
                        }
                        for p, o in zip(prompts, outputs, strict=True)
                    ],
                    "metrics": metrics,
                },
                indent=2,
            )
        )
        return failed(outputs)
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for p, o in zip(prompts, outputs, strict=True):
        console.print(f"[bold]prompt:[/bold] {p!r}")
        for c in o.outputs:
            label = f"  [{c.index}]" if len(o.outputs) > 1 else " "
            shown = repr(c.text) if c.text is not None else f"token ids {c.token_ids}"
            console.print(f"{label} {shown} ({len(c.token_ids)} tokens, {c.finish_reason})")
        if o.error:
            console.print(f"  [red]failed:[/red] {o.error}")
    table = Table(title="engine metrics")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in metrics.items():
        table.add_row(k, f"{v:.3g}" if isinstance(v, float) else str(v))
    console.print(table)
    return failed(outputs)


def chat(args) -> int:
    """``paged-jax chat``: read a message, stream the reply, keep the conversation. Each
    turn's prompt begins with the previous turns, whose pages the prefix cache keeps; the
    line after a reply says how many prompt tokens were reused."""
    loras = lora_specs([args.lora] if args.lora else [], "--lora")
    start_jax(args)
    from paged_jax.engine import LLM, SamplingParams

    mesh = mesh_of(args)
    model, tokenizer = load_model(
        args.model, args.dtype, mesh, args.quantization, args.enable_expert_parallel
    )
    if getattr(tokenizer, "chat_template", None) is None:
        raise UsageError(f"--model: {args.model} has no chat template")
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            stop=tuple(args.stop or ()),
        )
        llm = LLM(
            model,
            tokenizer,
            max_num_seqs=1,  # one conversation: the fewest step shapes
            compilation_cache=compilation_cache_of(args),
            mesh=mesh,
            cache_dtype=kv_cache_dtype(args),
            max_loras=len(loras),
            max_lora_rank=max((r for *_, r in loras), default=16),
        )
        with_loras(llm, loras)
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise UsageError(flag_names(str(e))) from None
    lora = loras[0][0] if loras else None
    if not args.no_warm_up:  # no reply waits for a compile
        llm.warm_up()
    conversation = [{"role": "system", "content": args.system}] if args.system else []
    from paged_jax.server.reasoning import OPEN, ReasoningStream, prompt_starts_inside

    template = tokenizer.chat_template
    thinks = isinstance(template, str) and OPEN in template  # a reasoning model's
    dim, undim = ("\x1b[2m", "\x1b[0m") if sys.stderr.isatty() else ("", "")
    print(f"chat with {args.model}; an empty line or Ctrl-D ends", file=sys.stderr, flush=True)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if not line.strip():
            return 0
        conversation.append({"role": "user", "content": line})
        ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        reply, done = "", None
        # a reasoning model's thinking apart: dim on stderr, never in the conversation
        split = ReasoningStream(prompt_starts_inside(llm, ids)) if thinks else None

        def show(thought: str, text: str) -> str:
            if thought and not args.hide_thinking:
                print(f"{dim}{thought}{undim}", end="", file=sys.stderr, flush=True)
            print(text, end="", flush=True)
            return text

        for piece in llm.stream([ids], params, lora=lora):
            reply += show(*split.feed(piece.text)) if split else show("", piece.text)
            done = piece.output or done
        if split is not None:  # what it held back
            reply += show(*split.finish())
        print()
        m = done.metrics
        print(
            f"[{m.num_generated_tokens} tokens; prefix cache: {m.num_cached_tokens} of "
            f"{m.num_prompt_tokens} prompt tokens reused]",
            file=sys.stderr,
            flush=True,
        )
        conversation.append({"role": "assistant", "content": reply})
