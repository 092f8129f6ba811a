"""Building the CPU kernels: the C sources compiled on first use by the system's compiler
against the FFI header jaxlib ships, into one library in ``<user cache dir>/paged-jax/
kernels/`` (keyed by the sources, the compiler, its flags and this CPU), loaded and
registered with XLA as custom calls (``available``; why not, ``unavailable_reason``)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading

import jax

from .._paths import cache_root

TARGET = "paged_jax_cpu_decode_attention"
RAGGED_TARGET = "paged_jax_cpu_ragged_attention"
LINEAR_TARGET = "paged_jax_cpu_linear"
GROUPED_TARGET = "paged_jax_cpu_grouped_linear"
GREEDY_TARGET = "paged_jax_cpu_greedy_rows"
SAMPLE_TARGET = "paged_jax_cpu_sample_rows"
UNINITIALIZED_TARGET = "paged_jax_cpu_uninitialized"
LORA_TARGET = "paged_jax_cpu_lora_delta"
WRITE_TARGET = "paged_jax_cpu_write_rows"
PAGES_TARGET = "paged_jax_cpu_pages"
_HERE = pathlib.Path(__file__).parent
_SOURCES = tuple(_HERE / f for f in ("decode.c", "linear.c", "sample.c", "lora.c", "cache.c"))
_HEADERS = (_HERE / "pool.h", _HERE / "vec.h")
# -ffp-contract=fast lets the compiler fuse multiplies and adds (FMA): 12% off the blocked
# path at 64 sequences x 4k bf16 on a 2-core AMD EPYC with gcc 12.2. Kernel changes are
# judged in the engine too (SmolLM2, 32 x 128 greedy), where the pages come from memory
# rather than from a benchmark's warm cache: an earlier blocked softmax that read each KV
# head's rows in turn ran the engine 16-32% slower and was dropped.
_FLAGS = ("-O3", "-fopenmp-simd", "-ffp-contract=fast", "-shared", "-fPIC", "-std=c11")
# Extra compiler flags for a checking build (.ci/sanitize: AddressSanitizer and UBSan);
# they are part of the cached library's key.
_EXTRA_FLAGS = tuple(os.environ.get("PAGED_JAX_KERNEL_CFLAGS", "").split())
_lock = threading.Lock()
_state: dict = {}  # "ok": bool, "why": str, "lib": the loaded library (kept alive)


def cache_dir() -> pathlib.Path:
    """Where the built library is kept (``<user cache dir>/paged-jax/kernels``)."""
    return cache_root() / "kernels"


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        import platform

        return platform.machine() + platform.processor()


def build_library() -> tuple[ctypes.CDLL | None, str]:
    """Compiles (or finds in the cache) and loads the kernel: (library, why not)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        return None, "no C compiler (set $CC or install cc)"
    include = jax.ffi.include_dir()
    header = pathlib.Path(include, "xla", "ffi", "api", "c_api.h")
    key = hashlib.sha256()
    for part in (
        *(f.read_bytes() for f in _SOURCES + _HEADERS),
        header.read_bytes(),
        cc.encode(),
        " ".join(_FLAGS + _EXTRA_FLAGS).encode(),
    ):
        key.update(part)
    key.update(_cpu_signature().encode())
    lib_path = cache_dir() / f"kernels-{key.hexdigest()[:16]}.so"
    if not lib_path.is_file():
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        why = ""
        for march in (("-march=native",), ()):  # some compilers lack -march=native
            with tempfile.NamedTemporaryFile(dir=lib_path.parent, suffix=".so", delete=False) as t:
                tmp = t.name
            sources = [str(f) for f in _SOURCES]
            cmd = [cc, *_FLAGS, *_EXTRA_FLAGS, *march, f"-I{include}", "-o", tmp, *sources]
            cmd += ["-lm", "-lpthread"]
            try:
                # (a build with sanitizers takes 1.5-2 minutes on a busy 2-core machine,
                # and a timed-out one would fall back to a build without -march=native)
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            except (OSError, subprocess.TimeoutExpired) as e:
                r, why = None, str(e)
            if r is not None and r.returncode == 0:
                os.replace(tmp, lib_path)  # atomic: another process may be building it too
                break
            if r is not None:
                why = (r.stderr or r.stdout).strip()[-500:]
            os.unlink(tmp)
        else:
            names = " and ".join(f.name for f in _SOURCES)
            return None, f"building {names} with {cc} failed: {why}"
    try:
        lib = ctypes.CDLL(str(lib_path))
        handler, linear_handler = lib.PagedJaxDecodeAttention, lib.PagedJaxLinear
        ragged_handler = lib.PagedJaxRaggedAttention
        greedy_handler = lib.PagedJaxGreedyRows
        sample_handler = lib.PagedJaxSampleRows
        uninitialized_handler = lib.PagedJaxUninitialized
        lora_handler = lib.PagedJaxLoraDelta
        write_handler = lib.PagedJaxWriteRows
        pages_handler = lib.PagedJaxPages
        grouped_handler = lib.PagedJaxGroupedLinear
        _state["panel_width"] = int(lib.paged_jax_linear_panel_width())
    except (OSError, AttributeError) as e:
        return None, f"loading {lib_path} failed: {e}"
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler), platform="cpu")
    jax.ffi.register_ffi_target(RAGGED_TARGET, jax.ffi.pycapsule(ragged_handler), platform="cpu")
    jax.ffi.register_ffi_target(LINEAR_TARGET, jax.ffi.pycapsule(linear_handler), platform="cpu")
    jax.ffi.register_ffi_target(GREEDY_TARGET, jax.ffi.pycapsule(greedy_handler), platform="cpu")
    jax.ffi.register_ffi_target(SAMPLE_TARGET, jax.ffi.pycapsule(sample_handler), platform="cpu")
    jax.ffi.register_ffi_target(
        UNINITIALIZED_TARGET, jax.ffi.pycapsule(uninitialized_handler), platform="cpu"
    )
    jax.ffi.register_ffi_target(LORA_TARGET, jax.ffi.pycapsule(lora_handler), platform="cpu")
    jax.ffi.register_ffi_target(WRITE_TARGET, jax.ffi.pycapsule(write_handler), platform="cpu")
    jax.ffi.register_ffi_target(PAGES_TARGET, jax.ffi.pycapsule(pages_handler), platform="cpu")
    jax.ffi.register_ffi_target(GROUPED_TARGET, jax.ffi.pycapsule(grouped_handler), platform="cpu")
    return lib, ""


def ensure() -> bool:
    """Builds and registers the kernels on first call; whether they are available."""
    with _lock:
        if "ok" not in _state:
            if sys.platform == "win32":
                lib, why = None, "not built on Windows"
            else:
                try:
                    lib, why = build_library()
                except Exception as e:  # a broken toolchain must not break the library
                    lib, why = None, f"{type(e).__name__}: {e}"
            _state.update(ok=lib is not None, why=why, lib=lib)
        return _state["ok"]


def available() -> bool:
    """True once the kernel is built and registered with XLA (builds it on first call)."""
    return ensure()


def unavailable_reason() -> str:
    """Why ``available()`` is False ("" when it is True)."""
    ensure()
    return _state["why"]


def threads_of(threads: int | None = None) -> int:
    """``threads`` (checked: a positive int), or by default the cores this process may use."""
    if threads is not None:
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads: expected a positive int or None, got {threads!r}")
        return threads
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def require() -> None:
    """Raises ``ValueError`` naming why the kernels are not available here, if they are not."""
    if not available():
        raise ValueError(f"the CPU kernels are not available: {unavailable_reason()}")
