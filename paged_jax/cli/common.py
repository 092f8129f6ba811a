"""What the ``paged-jax`` commands share: their errors (``UsageError``: exit 2,
``Unavailable``: exit 1), starting JAX with Ctrl-C held (``INTERRUPTS``), the mesh and
prompts of the command line, its engine flags and their names in messages
(``flag_names``), LoRA adapters, loading a model. No JAX at import."""

from __future__ import annotations

import _thread
import contextlib
import errno
import gc
import json
import pathlib
import signal
import sys
import threading

DEFAULT_PROMPTS = ["Paged attention stores the KV cache in", "Once upon a time"]


class Unavailable(Exception):
    """Something the command needs cannot be had (a named model's download failed); one
    line on stderr, exit code 1."""


class UsageError(Exception):
    pass


def compilation_cache_of(args):
    """``LLM(compilation_cache=)`` of ``--compilation-cache`` (``off``: none)."""
    return False if args.compilation_cache == "off" else args.compilation_cache


def start_jax(args) -> None:
    """Imports JAX and starts its backend (joining the other processes first when
    ``--coordinator`` is given), with Ctrl-C held (see Interrupts)."""
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
    with INTERRUPTS.held():  # imports and backend start-up: see Interrupts
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


def mesh_of(args):
    """The mesh of ``--tensor-parallel-size`` and ``--data-parallel-size`` (None for one
    device)."""
    import paged_jax

    tp, dp = args.tensor_parallel_size, args.data_parallel_size
    try:
        mesh = paged_jax.parallel_mesh(tp, dp)
    except ValueError as e:
        raise UsageError(flag_names(str(e))) from None
    return mesh if tp * dp > 1 else None


def prompts_of(args) -> list[str | list[int]]:
    """The prompts of the command line, in order: ``--prompt``, ``--prompts-file`` lines,
    then ``--prompt-ids``; the demo prompts when none is given."""
    prompts: list[str | list[int]] = list(args.prompt or [])
    for k, p in enumerate(prompts):
        if not p.strip():
            raise UsageError(f"--prompt: prompt {k + 1} is empty")
    if args.prompts_file:
        f = args.prompts_file
        text = read_text(str(f), "--prompts-file")
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


FLAGS = {
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


def flag_names(message: str) -> str:
    """An error about a ``SamplingParams`` or ``LLM`` argument, in the CLI's flag names."""
    field, sep, rest = message.partition(": ")
    return f"{FLAGS[field]}: {rest}" if sep and field in FLAGS else message


def lora_specs(specs, flag: str) -> list[tuple[str, pathlib.Path, int]]:
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


def with_loras(llm, loras) -> None:
    for name, path, _ in loras:
        llm.add_lora(name, path)


def speculative_of(args) -> dict | None:
    """``LLM(speculative=)`` from ``--speculative`` and ``--num-speculative-tokens``."""
    if args.speculative is None:
        if args.draft_model is not None:
            raise UsageError("--draft-model: only with --speculative draft")
        return None
    spec = {"method": args.speculative, "num_speculative_tokens": args.num_speculative_tokens}
    if args.draft_model is not None:
        spec["draft_model"] = args.draft_model
    return spec


def check_engine_flags(args) -> None:
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
            raise UsageError(f"{FLAGS[flag]}: expected an int >= {lowest}{why}, got {value}")


def install_extra(extra: str) -> str:
    """The pip command that adds ``extra`` to this install: the checkout's own (editable)
    when paged-jax runs from one, else the published package's."""
    root = pathlib.Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file() and (root / "pallas_kernels").is_dir():
        return f"{sys.executable} -m pip install -e '{root}[{extra}]'"
    return f"pip install 'paged-jax[{extra}]'"


def check_port(host: str, port: int) -> None:
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


def failed(outputs) -> int:
    """Exit status: 1 when the engine failed a request (each says why), else 0."""
    bad = [k + 1 for k, o in enumerate(outputs) if o.error]
    if bad:
        print(f"paged-jax: error: prompt(s) {bad} failed (see above)", file=sys.stderr)
    return 1 if bad else 0


def kv_cache_dtype(args):
    """``--kv-cache-dtype`` as ``LLM(cache_dtype=)`` takes it: a jnp dtype, or None (auto)."""
    import jax.numpy as jnp

    from paged_jax.cli.flags import KV_CACHE_DTYPES

    name = KV_CACHE_DTYPES[getattr(args, "kv_cache_dtype", "auto")]
    return None if name is None else jnp.dtype(name)


def load_model(
    name: str, dtype: str | None = None, mesh=None, quantization=None, expert_parallel=False
):
    """(model, tokenizer) of ``--model`` (quantized as ``--quantization`` asks), its
    weights placed in their shards on ``mesh`` (a mixture's experts split by expert with
    ``expert_parallel``, ``--enable-expert-parallel``);
    a broken checkpoint is a UsageError naming the file (config.json, a safetensors file,
    tokenizer.json), a model the mesh does not divide one naming the flag."""
    from paged_jax import models

    if expert_parallel and mesh is None:
        raise UsageError("--enable-expert-parallel: needs --tensor-parallel-size above 1")
    try:
        model, tokenizer = models.load(name, dtype=dtype, mesh=mesh, quantization=quantization)
    except (ValueError, FileNotFoundError) as e:
        flagged = flag_names(str(e))  # a model the mesh does not divide
        raise UsageError(flagged if flagged != str(e) else f"--model: {e}") from None
    except models.FetchError as e:  # the package index is unreachable: not a usage error
        raise Unavailable(f"--model: {e}") from None
    if expert_parallel:
        try:
            model.shard(mesh, expert_parallel=True)
        except ValueError as e:  # a dense model, experts the mesh does not divide
            raise UsageError(f"--enable-expert-parallel: {e}") from None
    return model, tokenizer


def read_text(where: str, flag: str) -> str:
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


class Interrupts:
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
        elif inside_ignored_context(frame):
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


def inside_ignored_context(frame) -> bool:
    codes = {getattr(cb, "__code__", None) for cb in gc.callbacks}
    while frame is not None:
        if frame.f_code in codes or frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


INTERRUPTS = Interrupts()
