"""C kernels for CPUs, called through XLA's FFI (the ``"cpu"`` backend).

XLA:CPU runs decode attention as a gather of every sequence's K/V pages, transposes and
small batched dot products: SmolLM2-135M (32 sequences at 256 tokens, f32) spent about
2.5 ms a layer there, 4-5 GB/s of K/V. ``decode.c`` instead reads each sequence's pages
in place, once, with an online softmax, split over the cores (0.6 ms a layer, 22 GB/s,
on the same 2-core machine); its ragged entry does the same for prefill chunks, 5-9x
XLA's ragged path. The kernels are compiled on first use by the system's C compiler
(``$CC``, else ``cc``) against the FFI header jaxlib ships, into one library in
``<user cache dir>/paged-jax/kernels/``, and registered with XLA as custom calls. No
compiler, or a failed build, leaves ``available()`` False and "auto" on the XLA path.

* ``decode_paged_attention``, ``ragged_paged_attention``: the signatures of
  ``paged_jax.paged_attention`` and ``paged_jax.ragged_paged_attention``; f32 or bf16
  queries and pools, sliding windows, soft caps. Not for quantized pools (scales):
  ``paged_jax.attention`` sends those to XLA. Batch invariant as they are.
* ``pack_weight``, ``unpack_weight``, ``linear``, ``panel_width``: matrix products
  against weights packed once in column panels (``linear.c``; ``paged_jax.linear``).
* ``lora_delta``: LoRA adapters' products for rows of different adapters, each row
  multiplied by its own slot's A and B only (``lora.c``; ``paged_jax.linear``).
* ``greedy_rows``: each row's argmax and log-sum-exp (``sample.c``), for greedy steps.
* ``sample_tokens``: the whole sampler (temperature, top-k, top-p, min-p, the draw) without
  sorting the vocabulary (``sample.c``), for steps with sampled rows.
* ``uninitialized``: an array as XLA allocated it, not written (the KV pool, which
  ``paged_jax`` then zeroes lazily).
* ``available()``, ``unavailable_reason()``: whether the kernels built here, and why not.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np

from .._paths import cache_root

TARGET = "paged_jax_cpu_decode_attention"
RAGGED_TARGET = "paged_jax_cpu_ragged_attention"
LINEAR_TARGET = "paged_jax_cpu_linear"
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


def _cache_dir() -> pathlib.Path:
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


def _build() -> tuple[ctypes.CDLL | None, str]:
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
    lib_path = _cache_dir() / f"kernels-{key.hexdigest()[:16]}.so"
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
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
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
    return lib, ""


def _ensure() -> bool:
    with _lock:
        if "ok" not in _state:
            if sys.platform == "win32":
                lib, why = None, "not built on Windows"
            else:
                try:
                    lib, why = _build()
                except Exception as e:  # a broken toolchain must not break the library
                    lib, why = None, f"{type(e).__name__}: {e}"
            _state.update(ok=lib is not None, why=why, lib=lib)
        return _state["ok"]


def available() -> bool:
    """True once the kernel is built and registered with XLA (builds it on first call)."""
    return _ensure()


def unavailable_reason() -> str:
    """Why ``available()`` is False ("" when it is True)."""
    _ensure()
    return _state["why"]


def _threads(threads: int | None = None) -> int:
    """``threads`` (checked: a positive int), or by default the cores this process may use."""
    if threads is not None:
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads: expected a positive int or None, got {threads!r}")
        return threads
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _require() -> None:
    """Raises ``ValueError`` naming why the kernels are not available here, if they are not."""
    if not available():
        raise ValueError(f"the CPU kernels are not available: {unavailable_reason()}")


def decode_paged_attention(
    q: jax.Array,  # [B, H, D] f32 | bf16
    kv_pages: jax.Array,  # [N, P, 2K, D] f32 | bf16
    kv_lens: jax.Array,  # i32[B]
    page_indices: jax.Array,  # i32[B, M]
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale=None,
    v_scale=None,
    batch_invariant: bool = False,
    interpret: bool = False,
    threads: int | None = None,
) -> jax.Array:  # [B, H, D], q.dtype
    """Decode attention over a paged cache on the CPU; arguments as
    ``paged_jax.paged_attention``. ``threads``: at most this many threads (default: the
    cores this process may use); the result does not depend on it. Raises ``ValueError``
    for quantized pools (``k_scale``/``v_scale``), dtypes other than f32/bf16, and when
    the kernel is not available here (``unavailable_reason()``)."""
    del interpret, batch_invariant  # one computation; every row independent of the batch
    params = _attention_params(
        q, kv_pages, k_scale, v_scale, sm_scale, sliding_window, soft_cap, threads
    )
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(
        q, kv_pages, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(page_indices, jnp.int32), params
    )


def ragged_paged_attention(
    q: jax.Array,  # [T, H, D] f32 | bf16
    kv_pages: jax.Array,  # [N, P, 2K, D] f32 | bf16
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, M]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale=None,
    v_scale=None,
    batch_invariant: bool = False,
    interpret: bool = False,
    threads: int | None = None,
) -> jax.Array:  # [T, H, D], q.dtype
    """Attention for a ragged batch (prefill chunks and decode tokens) on the CPU;
    arguments as ``paged_jax.ragged_paged_attention``. Each query token attends to its
    sequence's keys up to its position; up to 8 consecutive tokens of a sequence read
    each block of keys together. A token's result is bitwise the decode kernel's for it
    alone (blocks of keys lie at fixed multiples for every token), so it depends neither
    on the other tokens nor on ``threads``. Rows no
    sequence owns (past ``cu_q_lens[num_seqs]``) are 0. Raises ``ValueError`` as
    ``decode_paged_attention``."""
    del interpret, batch_invariant
    params = _attention_params(
        q, kv_pages, k_scale, v_scale, sm_scale, sliding_window, soft_cap, threads
    )
    call = jax.ffi.ffi_call(RAGGED_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    return call(q, kv_pages, i32(kv_lens), i32(page_indices), i32(cu_q_lens), i32(num_seqs), params)


def _attention_params(q, kv_pages, k_scale, v_scale, sm_scale, sliding_window, soft_cap, threads):
    """Checks what the attention kernels read; their f32[4] params operand."""
    if k_scale is not None or v_scale is not None:
        raise ValueError("k_scale/v_scale: the CPU kernel reads f32 or bf16 pools only")
    for name, x in (("q", q), ("kv_pages", kv_pages)):
        if x.dtype not in (jnp.float32, jnp.bfloat16):
            raise ValueError(f"{name}: expected float32 or bfloat16, got {x.dtype}")
    count = _threads(threads)
    _require()
    return jnp.asarray([sm_scale, sliding_window or 0, soft_cap or 0.0, count], jnp.float32)


def panel_width() -> int:
    """NR, the columns of a packed weight's panel in this build (48 with AVX-512, 24 with
    AVX2, 12 otherwise). Raises ``ValueError`` when the kernels are not available."""
    _require()
    return _state["panel_width"]


def pack_weight(w: jax.Array) -> jax.Array:
    """``w`` in the panel layout ``linear`` reads, NR = ``panel_width()``, ``P = ceil(N /
    NR)`` panels of NR columns (zero past column N), for a ``[K, N]`` weight or each of an
    ``[L, K, N]`` stack:

    - float32 ``[K, N] -> [P, K, NR]``, ``packed[p, k, j] = w[k, p * NR + j]``; the 4-bit
      groups' scales and minimums are packed this way too;
    - int8 ``[K, N] -> [P, K, NR]``, K a multiple of 4, in quads of rows: row i of
      ``packed[p].reshape(K / 4, 4 * NR)`` holds ``w[4i .. 4i + 3, p * NR + j]`` for each
      column j in turn (what an integer dot-product instruction reads);
    - bfloat16 ``[K, N] -> [P, K, NR]``, K even, in pairs of rows: row i of
      ``packed[p].reshape(K / 2, 2 * NR)`` holds ``w[2i, p * NR + j], w[2i + 1, p * NR +
      j]`` for each column j in turn (what a bf16 dot-product instruction reads);
    - uint8 4-bit weights, two rows a byte (row 2i in the low nibble), ``[K / 2, N] ->
      [P, K / 2, NR]``, K a multiple of 8, in octets of rows: row i of ``packed[p].
      reshape(K / 8, 4 * NR)`` holds, for each column j in turn and r = 0 .. 3, ``q[8i + r,
      j]`` in the low nibble and ``q[8i + 4 + r, j]`` in the high one.

    Raises ``ValueError`` for another dtype, rank or K. Outside ``jit`` the panels are
    filled in numpy (no XLA program compiled per weight shape)."""
    if w.ndim not in (2, 3) or w.dtype not in (jnp.float32, jnp.int8, jnp.uint8, jnp.bfloat16):
        raise ValueError(
            f"w: expected a [K, N] or [L, K, N] float32, int8, uint8 or bfloat16 array, got "
            f"{w.dtype}{list(w.shape)}"
        )
    if w.dtype == jnp.bfloat16 and w.shape[-2] % 2:
        raise ValueError(f"w: bf16 weights need K even, got {list(w.shape)}")
    if w.dtype == jnp.int8 and w.shape[-2] % 4:
        raise ValueError(f"w: int8 weights need K a multiple of 4, got {list(w.shape)}")
    if w.dtype == jnp.uint8 and w.shape[-2] % 4:
        raise ValueError(
            f"w: 4-bit weights need K a multiple of 8 (K / 2 rows of bytes a multiple of 4), "
            f"got {list(w.shape)}"
        )
    nr = panel_width()
    try:
        w = np.asarray(w)
    except jax.errors.TracerArrayConversionError:  # under jit: the same panels in jnp
        return _panels(w, nr, jnp)
    packed = _panels(w, nr, np)
    try:  # the new buffer as it is: nothing else holds it (3x faster than a copy)
        return jax.device_put(packed, may_alias=True)
    except TypeError:  # a JAX without may_alias
        return jnp.asarray(packed)


def _panels(w, nr: int, xp):
    """pack_weight's layout of ``w`` (numpy or jax.numpy as ``xp``)."""
    *lead, k, n = w.shape
    p = -(-n // nr)
    if w.dtype == np.uint8:  # two rows a byte -> the rows' values, then octets
        v = xp.stack([w & 15, w >> 4], axis=-2).reshape(*lead, 2 * k, n)
        v = v.reshape(*lead, k // 4, 2, 4, n)
        w = v[..., 0, :, :] | (v[..., 1, :, :] << 4)  # [.., K / 8, 4, N]
        w = w.reshape(*lead, k, n)  # rows (o, r): octet o, its r-th row pair
    w = xp.pad(w, [(0, 0)] * len(lead) + [(0, 0), (0, p * nr - n)])
    if w.dtype == np.float32:
        return xp.moveaxis(w.reshape(*lead, k, p, nr), -2, -3)
    g = _row_group(w.dtype)  # [.., K / g, g, P, NR] -> [.., P, K / g, NR, g]
    w = xp.moveaxis(w.reshape(*lead, k // g, g, p, nr), (-4, -3, -2, -1), (-3, -1, -4, -2))
    return w.reshape(*lead, p, k, nr)


def _row_group(dtype) -> int:
    """Rows of a column side by side in a packed panel: 2 for bf16 weights (a 32-bit
    lane's pair), 4 for 8-bit ones (a lane's quad)."""
    return 2 if jnp.dtype(dtype) == jnp.bfloat16 else 4


def pack_scales(scales: jax.Array) -> jax.Array:
    """Column scales ``f32[(L,) N]`` of int8 weights as ``linear`` reads them with the
    packed weights: ``f32[(L,) P * NR]``, zero past column N."""
    nr = panel_width()
    n = scales.shape[-1]
    pad = [(0, 0)] * (scales.ndim - 1) + [(0, -(-n // nr) * nr - n)]
    return jnp.pad(jnp.asarray(scales, jnp.float32), pad)


def unpack_weight(packed: jax.Array, n: int) -> jax.Array:
    """The weight ``pack_weight`` packed: ``[P, K, NR] -> [K, n]`` or
    ``[L, P, K, NR] -> [L, K, n]`` (any NR; 4-bit: ``[.., P, K / 2, NR] -> [.., K / 2,
    n]``, two rows a byte as before packing)."""
    *lead, p, k, nr = packed.shape
    if packed.dtype == jnp.float32:
        return jnp.moveaxis(packed, -3, -2).reshape(*lead, k, p * nr)[..., :n]
    g = _row_group(packed.dtype)  # [.., P, K / g, NR, g] -> [.., K / g, g, P, NR]
    w = packed.reshape(*lead, p, k // g, nr, g)
    w = jnp.moveaxis(w, (-3, -1, -4, -2), (-4, -3, -2, -1)).reshape(*lead, k, p * nr)[..., :n]
    if packed.dtype != jnp.uint8:
        return w
    w = w.reshape(*lead, k // 4, 4, n)  # octets: [.., K / 8, 4, N], two rows a byte
    v = jnp.stack([w & 15, w >> 4], axis=-3).reshape(*lead, 2 * k, n)  # the K rows in order
    v = v.reshape(*lead, k, 2, n)
    return v[..., 0, :] | (v[..., 1, :] << 4)


def packed_columns(packed: jax.Array, ids: jax.Array) -> jax.Array:
    """Columns ``ids`` (int ``[...]``) of the weight ``pack_weight`` packed, each as a row:
    ``[..., K]`` (4-bit: ``[..., K / 2]``, two rows a byte as before packing). An
    embedding table packed as its tied head's weight looks its tokens up this way."""
    nr = packed.shape[-1]
    if packed.dtype == jnp.float32:
        return packed[ids // nr, :, ids % nr]
    p, k, _ = packed.shape
    g = _row_group(packed.dtype)
    quads = packed.reshape(p, k // g, nr, g)[ids // nr, :, ids % nr, :]  # [..., K / g, g]
    if packed.dtype != jnp.uint8:
        return quads.reshape(*ids.shape, k)
    v = jnp.stack([quads & 15, quads >> 4], axis=-2).reshape(*ids.shape, k, 2)  # in order
    return v[..., 0] | (v[..., 1] << 4)


def linear(
    x: jax.Array,  # [..., K] f32
    packed: jax.Array,  # [(L,) P, K, NR] f32, int8 or bf16, or [(L,) P, K / 2, NR] uint8
    n: int,
    *,
    layer: jax.Array | int | None = None,
    rows: jax.Array | int | None = None,
    threads: int | None = None,
    scales: jax.Array | None = None,  # int8, bf16: f32[(L,) P * NR]; int8: [(L,) P, K / G, NR]
    mins: jax.Array | None = None,  # uint8, int8 with groups: f32[(L,) P, K / G, NR]
    rotated: bool = False,
) -> jax.Array:  # [..., n] f32
    """``x @ w`` for the ``[K, n]`` weight ``w`` that ``pack_weight`` made ``packed`` (for an
    ``[L, ...]`` stack, weight ``layer``: an int or a traced i32 scalar, read in place,
    never sliced out), computed by ``linear.c``: each output one f32 sum over K in order, so
    a row's result does not depend on the other rows or on ``threads`` (default: the cores
    this process may use). ``rows`` (an int or a traced i32 scalar): only the first ``rows``
    rows of ``x`` (flattened to ``[M, K]``) are computed and the rest of the result is 0, so
    a batch padded to a bucket costs its real rows; None, or a value outside ``[0, M]``:
    every row. int8 weights come with ``scales``: the weight is ``q[k, j] * scales[j]``
    (``pack_scales`` of ``f32[(L,) n]``), or ``q[k, j] * scales[k // G, j]``
    (``pack_weight`` of ``f32[(L,) K / G, n]``, G a multiple of 4: groups as GGUF's Q8_0
    blocks), and with grouped scales ``mins`` too (the same layout): ``q[k, j] * scales[k //
    G, j] + mins[k // G, j]`` (GGUF's Q5_1 and Q5_K blocks). 4-bit weights (uint8, two rows
    of ``q`` in [0, 15] a byte, the even row in the low nibble) come with ``scales`` and
    ``mins`` per group of G rows (G a multiple of 8; ``pack_weight`` of their ``[K / G, n]``
    arrays): the weight is ``scales * q + mins``. bf16 weights (K even) may come with
    column ``scales`` (``pack_scales``; an fp8 weight held as bf16: ``q[k, j] *
    scales[j]``); they multiply the rows of ``x`` rounded to bf16, each product exact and
    added into an f32 sum per output (``reference_bf16``). Quantized weights multiply the rows of
    ``x`` quantized to int8 in blocks (32 inputs for int8 weights, the groups for 4-bit
    ones), each with a scale of its own (W8A8, as llama.cpp's Q8 and Q4 products): exact
    integer sums per block, scaled in f32 (``linear.c``'s header has the definition, and
    ``reference_quantized`` computes it in numpy). ``rotated`` (static; int8 or 4-bit
    weights, K a multiple of 32): the weights were rotated along K (``rotate_blocks`` of
    ``w`` along its rows: ``R w``), and each row of ``x`` is rotated the same way before
    it is quantized, so the product is still ``x @ w`` with w the weights before their
    rotation. Raises ``ValueError`` for other dtypes or shapes, a missing or out-of-range
    static ``layer``, ``rotated`` with f32 or bf16 weights or K not a multiple of 32, and
    when the kernels are not available."""
    four, half = packed.dtype == jnp.uint8, packed.dtype == jnp.bfloat16
    # f32 weights alone; int8 ones with scales (and with grouped scales perhaps mins);
    # 4-bit ones with scales and mins; bf16 ones perhaps with column scales
    if half:
        want = jnp.bfloat16
    elif scales is None:
        want = jnp.float32
    else:
        want = jnp.int8 if mins is None or packed.dtype == jnp.int8 else jnp.uint8
    if x.dtype != jnp.float32 or packed.dtype != want:
        expected = {
            jnp.float32: "float32",
            jnp.int8: "float32 and int8 (with scales)",
            jnp.uint8: "float32 and uint8 (with scales and mins)",
            jnp.bfloat16: "float32 and bfloat16",
        }[want]
        hint = ""
        if packed.dtype == jnp.int8:
            hint = " (int8 weights need their scales)"
        elif four:
            hint = " (4-bit weights need their scales and mins)"
        raise ValueError(f"x, packed: expected {expected}, got {x.dtype} and {packed.dtype}{hint}")
    nr = panel_width()
    if packed.ndim not in (3, 4) or packed.shape[-1] != nr:
        raise ValueError(f"packed: expected [(L,) P, K, {nr}], got {list(packed.shape)}")
    p, k, _ = packed.shape[-3:]
    if four:
        k *= 2
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(f"x: expected [..., {k}] (packed's K), got {list(x.shape)}")
    if not isinstance(n, int) or not p * nr - nr < n <= p * nr:
        raise ValueError(f"n: expected an int in ({p * nr - nr}, {p * nr}], got {n!r}")
    if packed.ndim == 4 and layer is None:
        raise ValueError(f"layer: expected an index into packed's {packed.shape[0]} weights")
    weights = packed.shape[0] if packed.ndim == 4 else 1
    if isinstance(layer, int) and not 0 <= layer < weights:
        raise ValueError(f"layer: expected an int in [0, {weights}), got {layer}")
    if rotated and (packed.dtype not in (jnp.int8, jnp.uint8) or k % ROTATION):
        raise ValueError(
            f"rotated: needs int8 or 4-bit weights and K a multiple of {ROTATION}, got "
            f"{packed.dtype} weights and K {k}"
        )
    count = _threads(threads)
    x2 = x.reshape(math.prod(x.shape[:-1]), k)
    params = jnp.stack(
        [
            jnp.asarray(0 if layer is None else layer, jnp.int32),
            jnp.int32(count),
            jnp.asarray(-1 if rows is None else rows, jnp.int32),
            jnp.int32(1 if rotated else 0),
        ]
    )
    call = jax.ffi.ffi_call(LINEAR_TARGET, jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32))
    lead = packed.shape[:-3]
    if half:
        if mins is not None:
            raise ValueError("mins: bf16 weights take none (column scales at most)")
        if k % 2:
            raise ValueError(f"packed: bf16 weights need K even, got {list(packed.shape)}")
        if scales is not None and (scales.dtype != jnp.float32 or scales.shape != (*lead, p * nr)):
            raise ValueError(
                f"scales: expected float32{[*lead, p * nr]} (pack_scales), got "
                f"{scales.dtype}{list(scales.shape)}"
            )
    if scales is None:
        return call(x2, packed, params).reshape(*x.shape[:-1], n)
    if mins is not None:  # 4-bit weights, or int8 ones with groups
        groups = scales.shape[-2] if scales.ndim == packed.ndim else 0
        multiple = 8 if four else 4
        ok = groups > 0 and k % groups == 0 and (k // groups) % multiple == 0
        for name, a in (("scales", scales), ("mins", mins)):
            if not ok or a.dtype != jnp.float32 or a.shape != (*lead, p, groups, nr):
                raise ValueError(
                    f"{name}: expected float32[{', '.join(map(str, (*lead, p)))}, K / G, {nr}] "
                    f"with K / G dividing {k} into groups G a multiple of {multiple}, got "
                    f"{a.dtype}{list(a.shape)}"
                )
        return call(x2, packed, scales, mins, params).reshape(*x.shape[:-1], n)
    if half:
        return call(x2, packed, scales, params).reshape(*x.shape[:-1], n)
    groups = scales.shape[-2] if scales.ndim == packed.ndim else 0
    grouped = groups > 0 and k % groups == 0 and (k // groups) % 4 == 0
    if scales.dtype != jnp.float32 or (
        scales.shape != (*lead, p * nr) and not (grouped and scales.shape == (*lead, p, groups, nr))
    ):
        raise ValueError(
            f"scales: expected float32{[*lead, p * nr]} (pack_scales) or float32"
            f"{[*lead, p, 'K / G', nr]} (pack_weight of [K / G, n] scales, G a multiple of 4 "
            f"dividing {k}), got {scales.dtype}{list(scales.shape)}"
        )
    return call(x2, packed, scales, params).reshape(*x.shape[:-1], n)


def reference_bf16(
    x: np.ndarray,  # f32[M, K]
    w: np.ndarray,  # bf16[K, N]
    scales: np.ndarray | None = None,  # f32[N]
) -> np.ndarray:  # f64[M, N]
    """What ``linear`` computes for bf16 weights (unpacked), in numpy: the rows of ``x``
    rounded to bf16 (to nearest, ties to even), times ``w``, in f64 (so it differs from
    the kernel's f32 sums by their rounding only), times the column ``scales``."""
    import ml_dtypes

    xb = np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    out = xb @ np.asarray(w).astype(np.float64)
    return out if scales is None else out * np.asarray(scales, np.float64)


ROTATION = 32  # inputs a rotation mixes: linear.c's ROTATION


def rotate_blocks(x, axis: int = -1, *, xp=np):
    """``x`` (float, its ``axis`` a multiple of ``ROTATION``) times the orthonormal
    Hadamard matrix of order 32 along ``axis``, each block of 32 entries on its own, in
    f32, as ``linear`` rotates the rows of ``x`` for rotated weights (the same bits: the
    butterflies in ``linear.c``'s order, then the f32 nearest ``1 / sqrt(32)``). The
    matrix is symmetric and its own inverse, so rotating twice gives ``x`` back (to f32
    rounding) and ``rotate_blocks(x) @ rotate_blocks(w, axis=0) = x @ w`` for ``w [K,
    N]``. ``xp``: ``numpy`` (default) or ``jax.numpy`` (traceable)."""
    x = xp.moveaxis(xp.asarray(x, xp.float32), axis, -1)
    shape = x.shape
    if shape[-1] % ROTATION:
        raise ValueError(f"x: expected axis {axis} a multiple of {ROTATION}, got {list(shape)}")
    v = x.reshape(-1, ROTATION)
    h = 1
    while h < ROTATION:
        v = v.reshape(-1, ROTATION // (2 * h), 2, h)
        a, c = v[:, :, 0], v[:, :, 1]
        v = xp.stack([a + c, a - c], axis=2)
        h *= 2
    v = v.reshape(shape) * xp.float32(0.17677669529663687)
    return xp.moveaxis(v, -1, axis)


def quantize_blocks(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows of ``x`` (f32 ``[M, K]``) quantized as ``linear`` quantizes them for
    quantized weights, in numpy: ``(xq int8[M, K], dx f32[M, ceil(K / block)])``. A block
    of ``block`` inputs (the last one the rest of K) with largest magnitude ``a`` has
    ``dx = a / 127`` and ``xq = round(x * (127 / a))`` (ties to even) in [-127, 127], or 0
    and 0 where ``a = 0``."""
    x = np.asarray(x, np.float32)
    m, k = x.shape
    blocks = -(-k // block)
    xq = np.zeros((m, k), np.int8)
    dx = np.zeros((m, blocks), np.float32)
    for g in range(blocks):
        part = x[:, g * block : (g + 1) * block]
        a = np.abs(part).max(axis=1)
        with np.errstate(divide="ignore"):
            inv = np.where(a > 0, np.float32(127) / a, np.float32(0)).astype(np.float32)
        xq[:, g * block : (g + 1) * block] = np.clip(np.rint(part * inv[:, None]), -127, 127)
        dx[:, g] = a / np.float32(127)
    return xq, dx


def reference_quantized(
    x: np.ndarray,  # f32[M, K]
    q: np.ndarray,  # int8[K, N], or uint8[K / 2, N] 4-bit (two rows a byte)
    scales: np.ndarray,  # int8: f32[N] or f32[K / G, N]; 4-bit: f32[K / G, N]
    mins: np.ndarray | None = None,  # 4-bit, int8 with groups: f32[K / G, N]
    rotated: bool = False,
) -> np.ndarray:  # f64[M, N]
    """What ``linear`` computes for quantized weights (unpacked), in numpy: the rows of
    ``x`` quantized in blocks (``quantize_blocks``: the weights' groups, or 32 inputs for
    int8 weights with a scale per column), each block's exact integer sum against the
    weights, scaled (int8 per column: ``scales[n] * sum over blocks of dx * isum``; int8
    groups: ``sum over blocks of isum * d * dx``; 4-bit and int8 groups with ``mins``:
    that ``+ m * dx * (the block's sum of xq)``: the dequantized weights times the
    quantized rows). ``rotated``: ``q`` holds rotated weights (``linear``'s ``rotated``),
    and the rows are rotated by ``rotate_blocks`` before they are quantized. In f64, so
    it differs from the kernel's f32 sums by their rounding only."""
    x = np.asarray(x, np.float32)
    if rotated:
        x = rotate_blocks(x)
    four, grouped = q.dtype == np.uint8, np.ndim(scales) == 2
    if four:
        q = np.stack([q & 15, q >> 4], axis=-2).reshape(2 * q.shape[0], q.shape[1])
    k = x.shape[1]
    block = k // scales.shape[0] if grouped else 32
    xq, dx = quantize_blocks(x, block)
    out = np.zeros((x.shape[0], q.shape[1]))
    for g in range(dx.shape[1]):
        sl = slice(g * block, (g + 1) * block)
        isum = xq[:, sl].astype(np.int64) @ q[sl].astype(np.int64)
        if grouped:
            out += isum * (scales[g].astype(np.float64) * dx[:, g, None])
            if mins is not None:
                xs = np.float32(xq[:, sl].astype(np.int64).sum(axis=1)) * dx[:, g]
                out += mins[g] * xs.astype(np.float64)[:, None]
        else:
            out += isum * dx[:, g, None].astype(np.float64)
    return out if grouped else out * scales.astype(np.float64)


def lora_delta(
    x: jax.Array,  # f32[T, K]
    a: jax.Array,  # f32[L, K, S R]
    b: jax.Array,  # f32[L, S R, N]
    ids: jax.Array,  # i32[T]: each row's slot plus one, 0 for none
    layer: jax.Array | int,
    rank: int,
    *,
    threads: int | None = None,
) -> jax.Array:  # f32[T, N]
    """``(x[t] @ a[layer][:, s R : s R + R]) @ b[layer][s R : s R + R]`` for each row t of
    slot ``s = ids[t] - 1`` (zeros where ``ids[t]`` is 0 or past the slots), by
    ``lora.c``: the layer's banks read in place (``layer``: an int or a traced i32
    scalar), each row only its own slot's columns, each output one f32 sum in a fixed
    order (a row's result depends on no other row). Raises ``ValueError`` for other
    dtypes or shapes, a ``rank`` that does not divide the banks' width, or a static
    ``layer`` out of range, and when the kernels are not available."""
    for name, v, nd in (("x", x, 2), ("a", a, 3), ("b", b, 3)):
        if v.dtype != jnp.float32 or v.ndim != nd:
            raise ValueError(
                f"{name}: expected a float32 array of rank {nd}, got {v.dtype}{list(v.shape)}"
            )
    T, K = x.shape
    L, _, SR = a.shape
    if a.shape[1] != K or b.shape[:2] != (L, SR):
        raise ValueError(
            f"a, b: expected [L, {K}, S R] and [L, S R, N] (x: {list(x.shape)}), got "
            f"{list(a.shape)} and {list(b.shape)}"
        )
    if ids.dtype != jnp.int32 or ids.shape != (T,):
        raise ValueError(f"ids: expected int32[{T}], got {ids.dtype}{list(ids.shape)}")
    if not isinstance(rank, int) or not 1 <= rank <= 1024 or SR % rank:
        raise ValueError(f"rank: expected an int in [1, 1024] dividing {SR}, got {rank!r}")
    if isinstance(layer, int) and not 0 <= layer < L:
        raise ValueError(f"layer: expected an int in [0, {L}), got {layer}")
    _require()
    params = jnp.stack(
        [jnp.asarray(layer, jnp.int32), jnp.int32(rank), jnp.int32(_threads(threads))]
    )
    call = jax.ffi.ffi_call(LORA_TARGET, jax.ShapeDtypeStruct((T, b.shape[2]), jnp.float32))
    return call(x, a, b, ids, params)


def greedy_rows(
    x: jax.Array,  # f32[R, V]
    *,
    threads: int | None = None,
) -> tuple[jax.Array, jax.Array]:  # (i32[R] token, f32[R] lse)
    """Each row's first index of its maximum (``jnp.argmax``, the first NaN winning) and
    its ``jax.nn.logsumexp``, computed by ``sample.c`` in two passes over the row (the
    greedy sampler's work; the sum of exponentials may differ from XLA's in the last
    bits). A row's result does not depend on the others or on ``threads``. Raises
    ``ValueError`` for an ``x`` that is not ``f32[R, V]`` with V >= 1, and when the
    kernels are not available here."""
    if x.dtype != jnp.float32 or x.ndim != 2 or x.shape[1] < 1:
        raise ValueError(f"x: expected f32[R, V] with V >= 1, got {x.dtype}{list(x.shape)}")
    count = _threads(threads)
    _require()
    r = x.shape[0]
    call = jax.ffi.ffi_call(
        GREEDY_TARGET,
        (jax.ShapeDtypeStruct((r,), jnp.int32), jax.ShapeDtypeStruct((r,), jnp.float32)),
    )
    token, lse = call(x, jnp.asarray([count], jnp.int32))
    return token, lse


def write_rows(
    pool: jax.Array,  # [L, N, P, R, D] any dtype
    rows: jax.Array,  # [T, R, D] the pool's dtype
    slots: jax.Array,  # i32[T]
    layer: jax.Array | int,  # i32 scalar
) -> jax.Array:  # [L, N, P, R, D]: the pool, rows written
    """The pool with token t's row written to slot ``slots[t]`` of ``layer`` (page ``slot
    // P``, row ``slot % P``), by ``cache.c``: the result aliases the pool (under donation
    the step writes T rows and nothing else moves); slots outside ``[0, N * P)`` are
    dropped; of two tokens with one slot the later stays. For the 8- and 16-bit pools,
    which XLA:CPU's scatter widens to f32 and back whole. Raises ``ValueError`` for
    mismatched shapes or dtypes, and when the kernels are not available here."""
    _require()
    if pool.ndim != 5 or rows.ndim != 3 or rows.shape[1:] != pool.shape[3:]:
        raise ValueError(
            f"rows: expected [T, {pool.shape[3:]}] rows of a [L, N, P, R, D] pool, got "
            f"{list(rows.shape)} and {list(pool.shape)}"
        )
    if rows.dtype != pool.dtype:
        raise ValueError(f"rows: expected the pool's dtype {pool.dtype}, got {rows.dtype}")
    if slots.shape != rows.shape[:1] or slots.dtype != jnp.int32:
        raise ValueError(
            f"slots: expected int32[{rows.shape[0]}], got {slots.dtype}{list(slots.shape)}"
        )
    params = jnp.stack([jnp.asarray(layer, jnp.int32), jnp.int32(pool.dtype.itemsize)])
    call = jax.ffi.ffi_call(
        WRITE_TARGET, jax.ShapeDtypeStruct(pool.shape, pool.dtype), input_output_aliases={0: 0}
    )
    return call(pool, rows, slots, params)


def _page_ids(name: str, ids: jax.Array) -> jax.Array:
    if ids.ndim != 1 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"{name}: expected int32[n] page ids, got {ids.dtype}{list(ids.shape)}")
    return ids.astype(jnp.int32)


def copy_pages(pool: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    """``pool`` (``[L, N, P, R, D]``, any dtype) with page ``src[i]`` copied to ``dst[i]`` in
    every layer, all reads before all writes, by ``cache.c`` (the result aliases the
    pool); a ``dst`` outside ``[0, N)`` is not written, a ``src`` outside it reads page 0.
    Raises ``ValueError`` for mismatched shapes, and when the kernels are not built."""
    _require()
    src, dst = _page_ids("src", src), _page_ids("dst", dst)
    if src.shape != dst.shape or pool.ndim != 5:
        raise ValueError(f"dst: expected {list(src.shape)} ids (as src), got {list(dst.shape)}")
    params = jnp.asarray([0, pool.dtype.itemsize], jnp.int32)
    call = jax.ffi.ffi_call(
        PAGES_TARGET, jax.ShapeDtypeStruct(pool.shape, pool.dtype), input_output_aliases={0: 0}
    )
    return call(pool, src, dst, params)


def write_pages(pool: jax.Array, data: jax.Array, dst: jax.Array) -> jax.Array:
    """``pool`` (``[L, N, P, R, D]``) with ``data[:, i]`` (``[L, n, P, R, D]``, the pool's
    dtype) in page ``dst[i]`` of every layer, by ``cache.c`` (aliased; a ``dst`` outside
    ``[0, N)`` is not written). Raises ``ValueError`` for mismatched shapes or dtypes."""
    _require()
    dst = _page_ids("dst", dst)
    want = (pool.shape[0], dst.shape[0], *pool.shape[2:])
    if pool.ndim != 5 or data.shape != want or data.dtype != pool.dtype:
        raise ValueError(
            f"data: expected {pool.dtype}{list(want)}, got {data.dtype}{list(data.shape)}"
        )
    params = jnp.asarray([1, pool.dtype.itemsize], jnp.int32)
    call = jax.ffi.ffi_call(
        PAGES_TARGET, jax.ShapeDtypeStruct(pool.shape, pool.dtype), input_output_aliases={0: 0}
    )
    return call(pool, data, dst, params)


def read_pages(pool: jax.Array, src: jax.Array) -> jax.Array:
    """Page ``src[i]`` of every layer of ``pool`` (``[L, N, P, R, D]``): ``[L, n, P, R, D]``,
    by ``cache.c``; a ``src`` outside ``[0, N)`` reads page 0."""
    _require()
    src = _page_ids("src", src)
    if pool.ndim != 5:
        raise ValueError(f"pool: expected [L, N, P, R, D], got {list(pool.shape)}")
    params = jnp.asarray([2, pool.dtype.itemsize], jnp.int32)
    shape = (pool.shape[0], src.shape[0], *pool.shape[2:])
    return jax.ffi.ffi_call(PAGES_TARGET, jax.ShapeDtypeStruct(shape, pool.dtype))(
        pool, src, params
    )


def uninitialized(shape: tuple[int, ...], dtype) -> jax.Array:
    """An array of ``shape`` and ``dtype`` whose contents are whatever its freshly
    allocated memory held: nothing writes it. For a caller that fills it at once (the KV
    pool: ``paged_jax._hugepages.lazy_zeros``). Under a trace, a tracer. Raises
    ``ValueError`` when the kernels are not available here."""
    _require()
    return jax.ffi.ffi_call(UNINITIALIZED_TARGET, jax.ShapeDtypeStruct(tuple(shape), dtype))()


def sample_tokens(
    x: jax.Array,  # f32[R, V]
    temperature: jax.Array,  # f32[R]  0 = greedy
    top_k: jax.Array,  # i32[R]  0 = off
    top_p: jax.Array,  # f32[R]  1 = off
    min_p: jax.Array,  # f32[R]  0 = off
    u: jax.Array,  # f32[R, J] uniforms in [0, 1), one per sample
    *,
    threads: int | None = None,
) -> tuple[jax.Array, jax.Array]:  # (i32[R, J] token, f32[R] lse)
    """``J`` tokens per row, drawn as ``paged_jax.engine.sampling.sample_rows`` defines
    them, with uniform ``u[r, j]`` for column j, and each row's ``jax.nn.logsumexp``.

    Greedy rows (temperature 0) and rows whose largest logit (or its quotient by the
    temperature) is not finite take the argmax (``jnp.argmax``: the first NaN wins).
    Unrestricted sampled rows draw from ``softmax(x / temperature)`` in vocabulary order;
    rows with top-k, top-p or min-p keep a prefix of their tokens in descending order of
    ``x / temperature`` (ties: the lower index first) and draw from it in vocabulary
    order. ``sample.c`` does this without sorting the vocabulary (it sorts the few tokens
    that can be kept), so the token equals the full-sort definition's except where a keep
    decision or the draw falls within rounding of a boundary. A row's result does not
    depend on the others or on ``threads`` (default: the cores this process may use).
    Raises ``ValueError`` for arguments of other dtypes or shapes, and when the kernels
    are not available."""
    if x.dtype != jnp.float32 or x.ndim != 2 or x.shape[1] < 1:
        raise ValueError(f"x: expected f32[R, V] with V >= 1, got {x.dtype}{list(x.shape)}")
    r = x.shape[0]
    for name, a, dtype in (
        ("temperature", temperature, jnp.float32),
        ("top_k", top_k, jnp.int32),
        ("top_p", top_p, jnp.float32),
        ("min_p", min_p, jnp.float32),
    ):
        if a.dtype != dtype or a.shape != (r,):
            raise ValueError(
                f"{name}: expected {jnp.dtype(dtype)}[{r}], got {a.dtype}{list(a.shape)}"
            )
    if u.dtype != jnp.float32 or u.ndim != 2 or u.shape[0] != r:
        raise ValueError(f"u: expected f32[{r}, J], got {u.dtype}{list(u.shape)}")
    try:  # values, where they are known here (not traced); the kernel copes either way
        bad = np.asarray(min_p)
    except jax.errors.TracerArrayConversionError:
        bad = None
    if bad is not None and not np.all((bad >= 0) & (bad <= 1)):
        raise ValueError(
            f"min_p: expected values in [0, 1], got {bad[~((bad >= 0) & (bad <= 1))][:4]}"
        )
    count = _threads(threads)
    _require()
    call = jax.ffi.ffi_call(
        SAMPLE_TARGET,
        (
            jax.ShapeDtypeStruct(u.shape, jnp.int32),
            jax.ShapeDtypeStruct((r,), jnp.float32),
        ),
    )
    return call(x, temperature, top_k, top_p, min_p, u, jnp.asarray([count], jnp.int32))


__all__ = [
    "available",
    "greedy_rows",
    "decode_paged_attention",
    "linear",
    "lora_delta",
    "pack_weight",
    "panel_width",
    "rotate_blocks",
    "sample_tokens",
    "uninitialized",
    "unavailable_reason",
    "unpack_weight",
]
