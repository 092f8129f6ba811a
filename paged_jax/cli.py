"""The ``paged-jax`` console script: ``generate`` (the main demo) and ``bench``.

Bad input is a one-line ``paged-jax: error: ...`` on stderr and exit code 2, never a
traceback.
"""

from __future__ import annotations

import _thread
import contextlib
import errno
import gc
import importlib
import json
import os
import pathlib
import signal
import sys
import threading

from paged_jax._cli_flags import _parser

DEFAULT_PROMPTS = ["Paged attention stores the KV cache in", "Once upon a time"]


class Unavailable(Exception):
    """Something the command needs cannot be had (a named model's download failed); one
    line on stderr, exit code 1."""


class UsageError(Exception):
    pass


def _start_jax(args) -> None:
    """Imports JAX and starts its backend (joining the other processes first when
    ``--coordinator`` is given), with Ctrl-C held (see _Interrupts)."""
    coordinator = getattr(args, "coordinator", None)
    if coordinator is None and (
        getattr(args, "num_processes", None) is not None
        or getattr(args, "process_id", None) is not None
    ):
        raise UsageError("--num-processes / --process-id: need --coordinator HOST:PORT")
    if coordinator is not None:
        for flag, v in (("--num-processes", args.num_processes), ("--process-id", args.process_id)):
            if v is None:
                raise UsageError(f"{flag}: required with --coordinator")
        if not 0 <= args.process_id < args.num_processes:
            raise UsageError(
                f"--process-id: expected an int in [0, {args.num_processes}), got {args.process_id}"
            )
    with _INTERRUPTS.held():  # imports and backend start-up: see _Interrupts
        import jax

        from paged_jax import engine, models  # noqa: F401

        if coordinator is not None:
            # collectives between processes on CPU (accelerators have their own)
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.distributed.initialize(
                coordinator_address=coordinator,
                num_processes=args.num_processes,
                process_id=args.process_id,
            )
        jax.devices()


def _mesh(args):
    """The mesh of ``--tensor-parallel-size`` and ``--data-parallel-size`` (None for one
    device)."""
    import paged_jax

    tp, dp = args.tensor_parallel_size, args.data_parallel_size
    try:
        mesh = paged_jax.parallel_mesh(tp, dp)
    except ValueError as e:
        raise UsageError(_flag_names(str(e))) from None
    return mesh if tp * dp > 1 else None


def _prompts(args) -> list[str | list[int]]:
    """The prompts of the command line, in order: ``--prompt``, ``--prompts-file`` lines,
    then ``--prompt-ids``; the demo prompts when none is given."""
    prompts: list[str | list[int]] = list(args.prompt or [])
    for k, p in enumerate(prompts):
        if not p.strip():
            raise UsageError(f"--prompt: prompt {k + 1} is empty")
    if args.prompts_file:
        f = args.prompts_file
        text = _read_text(str(f), "--prompts-file")
        lines = [line for line in text.splitlines() if line.strip()]
        if not lines:
            raise UsageError(f"--prompts-file: {f} has no prompts (every line is blank)")
        prompts += lines
    for k, ids in enumerate(args.prompt_ids or []):
        try:
            prompts.append([int(t) for t in ids.replace(",", " ").split()])
        except ValueError:
            raise UsageError(
                f"--prompt-ids: prompt {k + 1} ({ids!r}) is not a list of integers"
            ) from None
        if not prompts[-1]:
            raise UsageError(f"--prompt-ids: prompt {k + 1} is empty")
    return prompts or list(DEFAULT_PROMPTS)


_FLAGS = {
    "max_tokens": "--max-tokens",
    "temperature": "--temperature",
    "top_k": "--top-k",
    "min_p": "--min-p",
    "repetition_penalty": "--repetition-penalty",
    "presence_penalty": "--presence-penalty",
    "frequency_penalty": "--frequency-penalty",
    "seed": "--seed",
    "n": "-n",
    "beam_width": "--beam-width",
    "page_size": "--page-size",
    "max_model_len": "--max-model-len",
    "quantization": "--quantization",
    "cache_dtype": "--kv-cache-dtype",
    "num_pages": "--num-pages",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "num_scheduler_steps": "--num-scheduler-steps",
    "max_loras": "--max-loras",
    "speculative": "--speculative",
    "speculative.num_speculative_tokens": "--num-speculative-tokens",
    "speculative.draft_model": "--draft-model",
    "tensor_parallel_size": "--tensor-parallel-size",
    "data_parallel_size": "--data-parallel-size",
    "data_parallel_size x tensor_parallel_size": "--data-parallel-size x --tensor-parallel-size",
}


def _flag_names(message: str) -> str:
    """An error about a ``SamplingParams`` or ``LLM`` argument, in the CLI's flag names."""
    field, sep, rest = message.partition(": ")
    return f"{_FLAGS[field]}: {rest}" if sep and field in _FLAGS else message


def _generate(args) -> int:
    if os.sep in args.model and not pathlib.Path(args.model).exists():  # before JAX starts
        raise UsageError(f"--model: {args.model}: no such checkpoint directory or GGUF file")
    if args.n < 1:
        raise UsageError(f"-n: expected >= 1, got {args.n}")
    if not 0.0 < args.top_p <= 1.0:
        raise UsageError(f"--top-p: expected a value in (0, 1], got {args.top_p}")
    prompts = _prompts(args)
    _check_engine_flags(args)
    loras = _lora_specs([args.lora] if args.lora else [], "--lora")
    _start_jax(args)
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
        raise UsageError(_flag_names(str(e))) from None
    mesh = _mesh(args)
    model, tokenizer = _load_model(args.model, args.dtype, mesh, args.quantization)
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
            async_scheduling=not args.no_async_scheduling,
            num_scheduler_steps=args.num_scheduler_steps,
            speculative=_speculative(args),
            compilation_cache=(
                False if args.compilation_cache == "off" else args.compilation_cache
            ),
            mesh=mesh,
            cache_dtype=_kv_cache_dtype(args),
            max_loras=len(loras),
            max_lora_rank=max((r for *_, r in loras), default=16),
        )
        _with_loras(llm, loras)
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
        raise UsageError(_flag_names(str(e))) from None
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
        return _failed(outputs)
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
    return _failed(outputs)


def _chat(args) -> int:
    """``paged-jax chat``: read a message, stream the reply, keep the conversation. Each
    turn's prompt begins with the previous turns, whose pages the prefix cache keeps; the
    line after a reply says how many prompt tokens were reused."""
    loras = _lora_specs([args.lora] if args.lora else [], "--lora")
    _start_jax(args)
    from paged_jax.engine import LLM, SamplingParams

    mesh = _mesh(args)
    model, tokenizer = _load_model(args.model, args.dtype, mesh, args.quantization)
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
            compilation_cache=False if args.compilation_cache == "off" else args.compilation_cache,
            mesh=mesh,
            cache_dtype=_kv_cache_dtype(args),
            max_loras=len(loras),
            max_lora_rank=max((r for *_, r in loras), default=16),
        )
        _with_loras(llm, loras)
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise UsageError(_flag_names(str(e))) from None
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


def _serve(args) -> int:
    """``paged-jax serve``: the OpenAI-compatible server until SIGINT / SIGTERM."""
    from paged_jax.server import missing_modules, serve

    missing = missing_modules()  # before seconds of loading and compiling, not after
    if missing:
        raise Unavailable(
            f"serve: needs the 'serve' extra ({', '.join(missing)} missing): "
            f"{_install_extra('serve')}"
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
    _check_engine_flags(args)
    loras = _lora_specs(args.lora_modules, "--lora-modules")
    max_loras = len(loras) if args.max_loras is None else args.max_loras
    if args.max_loras is not None and (args.max_loras < 1 or not loras):
        raise UsageError(
            f"--max-loras: expected an int >= 1 with --lora-modules, got {args.max_loras}"
        )
    _check_port(args.host, args.port)  # before seconds of loading, not after
    _start_jax(args)
    from paged_jax.engine import LLM

    mesh = _mesh(args)
    model, tokenizer = _load_model(args.model, args.dtype, mesh, args.quantization)
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
            enable_prefix_caching=not args.no_prefix_caching,
            async_scheduling=not args.no_async_scheduling,
            num_scheduler_steps=args.num_scheduler_steps,
            speculative=_speculative(args),
            compilation_cache=False if args.compilation_cache == "off" else args.compilation_cache,
            mesh=mesh,
            cache_dtype=_kv_cache_dtype(args),
            max_loras=max_loras,
            max_lora_rank=max((r for *_, r in loras), default=16),
        )
        _with_loras(llm, loras)
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise UsageError(_flag_names(str(e))) from None
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
        log_level=args.log_level,
        on_ready=ready,
        allowed_hosts=None
        if args.allowed_hosts is None
        else [h.strip() for h in args.allowed_hosts.split(",") if h.strip()],
    )
    return 0


def _lora_specs(specs, flag: str) -> list[tuple[str, pathlib.Path, int]]:
    """``(name, path, rank)`` of each ``NAME=PATH`` of ``flag``, checked before JAX
    starts: a name, a directory holding a PEFT adapter, its rank ``r``."""
    out, seen = [], set()
    for spec in specs or []:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise UsageError(f"{flag}: expected NAME=PATH, got {spec!r}")
        if name in seen:
            raise UsageError(f"{flag}: the name {name!r} is given twice")
        seen.add(name)
        config = pathlib.Path(path) / "adapter_config.json"
        try:
            r = json.loads(config.read_text(encoding="utf-8")).get("r")
        except (OSError, ValueError, AttributeError) as e:
            raise UsageError(f"{flag}: {name}: {config}: {e}") from None
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise UsageError(f"{flag}: {name}: {config}: r: expected an int >= 1, got {r!r}")
        out.append((name, pathlib.Path(path), r))
    return out


def _with_loras(llm, loras) -> None:
    for name, path, _ in loras:
        llm.add_lora(name, path)


def _speculative(args) -> dict | None:
    """``LLM(speculative=)`` from ``--speculative`` and ``--num-speculative-tokens``."""
    if args.speculative is None:
        if args.draft_model is not None:
            raise UsageError("--draft-model: only with --speculative draft")
        return None
    spec = {"method": args.speculative, "num_speculative_tokens": args.num_speculative_tokens}
    if args.draft_model is not None:
        spec["draft_model"] = args.draft_model
    return spec


def _check_engine_flags(args) -> None:
    """The engine's integer flags, checked before JAX starts and the model loads."""
    for flag, lowest in (
        ("page_size", 1),
        ("max_num_seqs", 1),
        ("max_num_batched_tokens", 1),
        ("num_scheduler_steps", 1),
        ("max_model_len", 2),
        ("num_pages", 2),
    ):
        value = getattr(args, flag, None)
        if value is not None and value < lowest:
            why = " (page 0 is null)" if flag == "num_pages" else ""
            raise UsageError(f"{_FLAGS[flag]}: expected an int >= {lowest}{why}, got {value}")


def _install_extra(extra: str) -> str:
    """The pip command that adds ``extra`` to this install: the checkout's own (editable)
    when paged-jax runs from one, else the published package's."""
    root = pathlib.Path(__file__).resolve().parents[1]
    if (root / "pyproject.toml").is_file() and (root / "pallas_kernels").is_dir():
        return f"{sys.executable} -m pip install -e '{root}[{extra}]'"
    return f"pip install 'paged-jax[{extra}]'"


def _check_port(host: str, port: int) -> None:
    """A UsageError naming ``--port`` (or ``--host``) when the server could not listen there:
    bound as the server binds (``SO_REUSEADDR``), then released."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UsageError(f"--host: {host!r} does not resolve ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UsageError(
                    f"--port: {port} on {host} is in use by another program; choose another "
                    "port or stop that program"
                ) from None
            raise UsageError(
                f"--host/--port: cannot listen on {host}:{port} ({e.strerror})"
            ) from None


def _failed(outputs) -> int:
    """Exit status: 1 when the engine failed a request (each says why), else 0."""
    bad = [k + 1 for k, o in enumerate(outputs) if o.error]
    if bad:
        print(f"paged-jax: error: prompt(s) {bad} failed (see above)", file=sys.stderr)
    return 1 if bad else 0


def _kv_cache_dtype(args):
    """``--kv-cache-dtype`` as ``LLM(cache_dtype=)`` takes it: a jnp dtype, or None (auto)."""
    import jax.numpy as jnp

    from paged_jax._cli_flags import KV_CACHE_DTYPES

    name = KV_CACHE_DTYPES[getattr(args, "kv_cache_dtype", "auto")]
    return None if name is None else jnp.dtype(name)


def _load_model(name: str, dtype: str | None = None, mesh=None, quantization=None):
    """(model, tokenizer) of ``--model`` (quantized as ``--quantization`` asks), its
    weights placed in their shards on ``mesh``;
    a broken checkpoint is a UsageError naming the file (config.json, a safetensors file,
    tokenizer.json), a model the mesh does not divide one naming the flag."""
    from paged_jax import models

    try:
        return models.load(name, dtype=dtype, mesh=mesh, quantization=quantization)
    except (ValueError, FileNotFoundError) as e:
        flagged = _flag_names(str(e))  # a model the mesh does not divide
        raise UsageError(flagged if flagged != str(e) else f"--model: {e}") from None
    except models.FetchError as e:  # the package index is unreachable: not a usage error
        raise Unavailable(f"--model: {e}") from None


def _read_text(where: str, flag: str) -> str:
    """The text of ``flag``'s file (UTF-8), or of standard input for '-'; a UsageError
    naming the flag and the file for anything else."""
    if where == "-":
        return sys.stdin.read()
    f = pathlib.Path(where)
    if f.is_dir():
        raise UsageError(f"{flag}: {f} is a directory, expected a text file")
    if not f.is_file():
        raise UsageError(f"{flag}: {f} does not exist")
    try:
        return f.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{flag}: {f} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    except OSError as e:
        raise UsageError(f"{flag}: cannot read {f} ({e.strerror})") from None


def _perplexity(args) -> int:
    """``paged-jax perplexity``: ``engine.scoring.perplexity`` of ``--file`` under
    ``--model``, printed (or as JSON)."""
    if os.sep in args.model and not pathlib.Path(args.model).exists():  # before JAX starts
        raise UsageError(f"--model: {args.model}: no such checkpoint directory or GGUF file")
    text = _read_text(args.file, "--file")
    if not text.strip():
        raise UsageError(f"--file: {args.file} holds no text")
    if args.context < 2:
        raise UsageError(f"--context: expected an int >= 2, got {args.context}")
    if args.stride is not None and not 1 <= args.stride <= args.context:
        raise UsageError(
            f"--stride: expected an int in [1, --context={args.context}], got {args.stride}"
        )
    _start_jax(args)
    from paged_jax.engine import LLM
    from paged_jax.engine.scoring import perplexity

    model, tokenizer = _load_model(args.model, args.dtype, None, args.quantization)
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
            compilation_cache=(
                False if args.compilation_cache == "off" else args.compilation_cache
            ),
            cache_dtype=_kv_cache_dtype(args),
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
        raise UsageError(_flag_names(message)) from None
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


def _embed(args) -> int:
    """``paged-jax embed``: ``LLM.embed`` of the command line's prompts, one JSON line each
    (``index``, ``tokens``, ``embedding``)."""
    if os.sep in args.model and not pathlib.Path(args.model).exists():  # before JAX starts
        raise UsageError(f"--model: {args.model}: no such checkpoint directory or GGUF file")
    if not (args.prompt or args.prompts_file or args.prompt_ids):
        raise UsageError("--prompt, --prompts-file or --prompt-ids: give at least one prompt")
    prompts = _prompts(args)
    if args.max_num_batched_tokens < 1:
        raise UsageError(
            f"--max-num-batched-tokens: expected an int >= 1, got {args.max_num_batched_tokens}"
        )
    _start_jax(args)
    from paged_jax.engine import LLM

    model, tokenizer = _load_model(args.model, args.dtype, None, args.quantization)
    if tokenizer is None and any(isinstance(p, str) for p in prompts):
        raise UsageError(f"--model: {args.model} has no tokenizer; give --prompt-ids")
    try:
        llm = LLM(
            model,
            tokenizer=tokenizer,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=False,
            compilation_cache=(
                False if args.compilation_cache == "off" else args.compilation_cache
            ),
            cache_dtype=_kv_cache_dtype(args),
        )
        outs = llm.embed(prompts, pooling=args.pooling, normalize=not args.no_normalize)
    except ValueError as e:
        raise UsageError(_flag_names(str(e))) from None
    for k, out in enumerate(outs):
        line = {"index": k, "tokens": len(out.prompt_token_ids)}
        print(json.dumps(line | {"embedding": [round(float(x), 7) for x in out.embedding]}))
    return 0


def _bench(args) -> int:
    root = pathlib.Path(__file__).resolve().parents[1]
    if (root / "benchmarks").is_dir() and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        mod = importlib.import_module(f"benchmarks.bench_{args.name}")
    except ModuleNotFoundError as e:
        raise UsageError(
            f"bench: benchmark {args.name!r} is not available here ({e}); run it "
            "from a source checkout"
        ) from None
    from benchmarks.common import take_out_arg

    try:
        argv = take_out_arg(args.args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return int(mod.main(argv) or 0)


class _Interrupts:
    """The console script's Ctrl-C: ``KeyboardInterrupt`` as usual, but never where Python
    or a C extension would turn it into something worse. Main thread only.

    * Inside a garbage-collector callback (JAX registers one) or a ``__del__``, Python
      prints the exception as "Exception ignored" and drops it: the run went on. There
      the interrupt is re-sent a moment later, once the callback has returned.
    * While JAX and its C extensions import and initialize (``held()``), an exception
      raised from Python code that the extension's initializer called aborts the process
      (SIGABRT; seen with jaxlib's MLIR bindings). There it is held and raised when the
      block ends.
    """

    def __init__(self):
        self.depth = 0
        self.pending = False

    def __enter__(self):
        self.active = threading.current_thread() is threading.main_thread()
        if self.active:
            self.previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc):
        if self.active:
            signal.signal(signal.SIGINT, self.previous)

    def _handler(self, signum, frame):
        if self.depth:
            self.pending = True
        elif _inside_ignored_context(frame):
            threading.Timer(0.005, _thread.interrupt_main, args=(signum,)).start()
        else:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def held(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        if self.pending and not self.depth:
            self.pending = False
            raise KeyboardInterrupt


def _inside_ignored_context(frame) -> bool:
    codes = {getattr(cb, "__code__", None) for cb in gc.callbacks}
    while frame is not None:
        if frame.f_code in codes or frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


_INTERRUPTS = _Interrupts()


def main(argv: list[str] | None = None) -> int:
    try:
        with _INTERRUPTS:
            return _main(argv)
    except KeyboardInterrupt:  # before _main's own handling (the parser) or held to its end
        print("paged-jax: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    try:
        args = _parser().parse_args(argv)
        run = {
            "generate": _generate,
            "chat": _chat,
            "serve": _serve,
            "perplexity": _perplexity,
            "embed": _embed,
            "bench": _bench,
        }[args.command]
        code = run(args)
        sys.stdout.flush()  # a write error shows here, not as a traceback at exit
        return code
    except UsageError as e:
        print(f"paged-jax: error: {e}", file=sys.stderr)
        return 2
    except Unavailable as e:
        print(f"paged-jax: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the engine let its step finish; nothing half-done remains
        print("paged-jax: interrupted", file=sys.stderr)
        return 130
    except OSError as e:
        if e.errno not in (errno.EPIPE, errno.ENOSPC, errno.EIO, errno.EBADF):
            raise
        # stdout is closed, full or gone: say so once, and stop Python's exit-time flush
        # of the same buffer from printing a traceback of its own.
        _silence_stdout()
        if e.errno != errno.EPIPE:  # a closed pipe (e.g. `| head`) is the reader's choice
            print(f"paged-jax: error: cannot write the output ({e.strerror})", file=sys.stderr)
        return 2


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def run() -> None:
    """The console script: ``main()``, then exit with its status.

    After Ctrl-C the process ends without Python's finalization: an interrupted JAX call
    can leave XLA worker threads running, and tearing the interpreter and jaxlib down
    under them crashed (SIGSEGV in C++, no Python frame, after "interrupted" had been
    printed: about 1 in 40 interrupts in our runs). Output is flushed first."""
    code = main()
    if code == 130:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(130)
    sys.exit(code)


if __name__ == "__main__":
    run()
