"""What every benchmark records: the machine, the versions, the command, the time."""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import sys
import time

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
# ``python -m benchmarks NAME --out DIR`` sets this: results go where the user says, and the
# committed files in benchmarks/results change only when that is the directory named.
OUT_ENV = "PAGED_JAX_RESULTS_DIR"


_DEFAULT_DIR: pathlib.Path | None = None


def results_dir() -> pathlib.Path:
    """Where results are written: ``$PAGED_JAX_RESULTS_DIR`` (``--out DIR``), else a new
    directory ``bench-results/<UTC time>`` under the current directory, one per process.
    The committed files in ``benchmarks/results`` change only when named explicitly."""
    global _DEFAULT_DIR
    if os.environ.get(OUT_ENV):
        return pathlib.Path(os.environ[OUT_ENV])
    if _DEFAULT_DIR is None:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
        _DEFAULT_DIR = pathlib.Path.cwd() / "bench-results" / stamp
    return _DEFAULT_DIR


def take_out_arg(args: list[str]) -> list[str]:
    """Removes ``--out DIR`` (or ``--out=DIR``) from ``args`` and points results there.
    Raises ValueError when DIR is missing or names a file."""
    args = list(args)
    for i, a in enumerate(args):
        if a == "--out" or a.startswith("--out="):
            if a == "--out":
                if i + 1 >= len(args) or args[i + 1].startswith("-"):
                    raise ValueError("--out: expected a directory")
                value, end = args[i + 1], i + 2
            else:
                value, end = a.split("=", 1)[1], i + 1
            if not value or pathlib.Path(value).is_file():
                raise ValueError(f"--out: expected a directory, got {value!r}")
            os.environ[OUT_ENV] = value
            del args[i:end]
            break
    return args


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (the flag is named by argparse in the error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {value}")
    return value


def _finite(x):
    """``x`` with every NaN or infinite float replaced by None (strict JSON)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# The vector extensions the CPU kernels' speed depends on (linear.c's integer products
# use VNNI where the CPU has it; the panels are AVX-512's or AVX2's width).
_CPU_FEATURES = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8")


def _cpu_features() -> list[str]:
    """Which of ``_CPU_FEATURES`` the CPU has (x86 Linux; empty elsewhere)."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in _CPU_FEATURES if f in have]
    except OSError:
        pass
    return []


def _gpu_driver() -> str | None:
    """The NVIDIA driver version, where ``nvidia-smi`` answers."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def environment(with_jax: bool = False) -> dict:
    """Machine and versions. JAX is only imported (for its device list) if asked."""
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_features": _cpu_features(),
        "cpu_count": os.cpu_count(),
        "numpy": _version("numpy"),
        "paged_jax": _version("paged-jax"),
    }
    if os.environ.get("XLA_FLAGS"):  # compiler options change what is measured
        env["xla_flags"] = os.environ["XLA_FLAGS"]
    if with_jax:
        import jax

        env.update(
            jax=jax.__version__,
            jaxlib=_version("jaxlib"),
            devices=[str(d) for d in jax.devices()],
            device_kind=jax.devices()[0].device_kind,
        )
        if jax.default_backend() == "gpu":
            env.update(gpu_driver=_gpu_driver(), triton=_version("triton"))
    return env


def time_samples(fn, *args, repeats: int, sample_s: float = 2e-3) -> list[float]:
    """Seconds per call of ``fn(*args)``: ``repeats`` samples after a warm-up, each the
    mean of enough back-to-back calls to last about ``sample_s`` (device work is queued
    asynchronously; the sample ends when its last result is ready)."""
    import jax

    jax.block_until_ready(fn(*args))  # compile + warm up
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    one = time.perf_counter() - t
    inner = int(max(1, min(200, sample_s / max(one, 1e-7))))
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            r = fn(*args)
        jax.block_until_ready(r)
        out.append((time.perf_counter() - t) / inner)
    return out


def write_result(name: str, payload: dict) -> pathlib.Path:
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    # Strict JSON: NaN and infinities (a rate over zero requests) become null.
    data = _finite(json.loads(json.dumps(payload, default=str)))
    path.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n")
    return path


def table(rows: list[dict], columns: list[str], digits: int | None = None) -> str:
    """A plain-text table of ``rows`` (dicts) in ``columns`` order; ``digits``: floats
    shown with that many decimals (None: as ``str`` shows them)."""

    def cell(v):
        return f"{v:.{digits}f}" if digits is not None and isinstance(v, float) else str(v)

    cells = [[cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def save_plot(name: str, fig) -> pathlib.Path:
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def progress(total: int, description: str):
    """A rich progress bar (use as a context manager; ``.advance()`` per unit)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    class _Bar:
        def __enter__(self):
            self.p = Progress(
                TextColumn(description),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                transient=True,
            )
            self.task = self.p.add_task(description, total=total)
            self.p.start()
            return self

        def advance(self, n: int = 1):
            self.p.update(self.task, advance=n)

        def __exit__(self, *exc):
            self.p.stop()

    return _Bar()


def pyplot():
    """matplotlib.pyplot with a file backend, or None (and a note) when not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no plot")
        return None
    return plt
