"""``paged-jax serve``: the OpenAI-compatible server (``paged_jax.server``), its extra
checked before anything loads."""

from __future__ import annotations

import os
import sys

from paged_jax.cli.common import (
    Unavailable,
    UsageError,
    check_engine_flags,
    check_port,
    compilation_cache_of,
    flag_names,
    install_extra,
    kv_cache_dtype,
    load_model,
    lora_specs,
    mesh_of,
    speculative_of,
    start_jax,
    with_loras,
)


def serve(args) -> int:
    """``paged-jax serve``: the OpenAI-compatible server until SIGINT / SIGTERM."""
    from paged_jax.server import missing_modules, serve

    missing = missing_modules()  # before seconds of loading and compiling, not after
    if missing:
        raise Unavailable(
            f"serve: needs the 'serve' extra ({', '.join(missing)} missing): "
            f"{install_extra('serve')}"
        )
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port: expected an int in [0, 65535], got {args.port}")
    if args.max_waiting < 0:
        raise UsageError(f"--max-waiting: expected an int >= 0, got {args.max_waiting}")
    if args.max_request_bytes is not None and args.max_request_bytes < 1024:
        raise UsageError(
            f"--max-request-bytes: expected an int >= 1024, got {args.max_request_bytes}"
        )
    for flag in ("header_timeout", "body_timeout"):
        if not getattr(args, flag) > 0:
            name = "--" + flag.replace("_", "-")
            raise UsageError(f"{name}: expected seconds > 0, got {getattr(args, flag)}")
    if args.max_connections is not None and args.max_connections < 1:
        raise UsageError(f"--max-connections: expected an int >= 1, got {args.max_connections}")
    check_engine_flags(args)
    loras, max_loras = _adapter_flags(args)
    kv_events = _kv_events_flag(args)
    check_port(args.host, args.port)  # before seconds of loading, not after
    start_jax(args)
    from paged_jax.engine import LLM

    mesh = mesh_of(args)
    model, tokenizer = load_model(
        args.model, args.dtype, mesh, args.quantization, args.enable_expert_parallel
    )
    if tokenizer is None:
        raise UsageError(f"--model: {args.model} has no tokenizer; the server serves text")
    try:
        llm = LLM(
            model,
            tokenizer,
            page_size=args.page_size,
            max_model_len=args.max_model_len,
            num_pages=args.num_pages,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            preemption=args.preemption,
            scheduling_policy=args.scheduling_policy,
            enable_prefix_caching=not args.no_prefix_caching,
            async_scheduling=not args.no_async_scheduling,
            num_scheduler_steps=args.num_scheduler_steps,
            speculative=speculative_of(args),
            compilation_cache=compilation_cache_of(args),
            mesh=mesh,
            cache_dtype=kv_cache_dtype(args),
            max_loras=max_loras,
            max_lora_rank=args.max_lora_rank or max((r for *_, r in loras), default=16),
        )
        with_loras(llm, loras)
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise UsageError(flag_names(str(e))) from None
    if not args.no_warm_up:  # nothing compiles once the server says it is ready
        llm.warm_up()
    name = args.served_model_name or args.model

    def ready() -> None:
        print(
            f"paged-jax: serving {name!r} on http://{args.host}:{args.port}/v1",
            file=sys.stderr,
            flush=True,
        )

    serve(
        llm,
        model_name=name,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        max_waiting=args.max_waiting,
        max_request_bytes=args.max_request_bytes,
        shutdown_timeout=args.shutdown_timeout,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        max_connections=args.max_connections,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        embedding_pooling=args.embedding_pooling,
        lora_dirs=args.lora_allowed_dir,
        kv_events=kv_events,
        log_level=args.log_level,
        on_ready=ready,
        allowed_hosts=None
        if args.allowed_hosts is None
        else [h.strip() for h in args.allowed_hosts.split(",") if h.strip()],
    )
    return 0


def _adapter_flags(args) -> tuple[list, int]:
    """(``--lora-modules``' adapters, the LoRA slots) from the adapter flags, checked."""
    loras = lora_specs(args.lora_modules, "--lora-modules")
    max_loras = len(loras) if args.max_loras is None else args.max_loras
    if args.max_loras is not None and (args.max_loras < 1 or not (loras or args.lora_allowed_dir)):
        raise UsageError(
            f"--max-loras: expected an int >= 1 with --lora-modules (or --lora-allowed-dir), "
            f"got {args.max_loras}"
        )
    for d in args.lora_allowed_dir or []:
        if not os.path.isdir(d):
            raise UsageError(f"--lora-allowed-dir: {d} is not a directory")
    if args.lora_allowed_dir and not max_loras:
        raise UsageError("--lora-allowed-dir: needs --max-loras N (the adapters' slots)")
    if args.max_lora_rank is not None and args.max_lora_rank < 1:
        raise UsageError(f"--max-lora-rank: expected an int >= 1, got {args.max_lora_rank}")
    return loras, max_loras


def _kv_events_flag(args):
    """``--kv-events-config`` as a ``KVEventsConfig`` (None without the flag), checked."""
    if args.kv_events_config is None:
        return None
    try:
        from paged_jax.server.kv_events import KVEventsConfig

        return KVEventsConfig.parse(args.kv_events_config)
    except ImportError as e:
        raise UsageError(
            f"--kv-events-config: needs the 'kv-events' extra ({e}): " + install_extra("kv-events")
        ) from None
    except ValueError as e:
        raise UsageError(f"--kv-events-config: {e}") from None
