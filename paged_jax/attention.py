"""Public paged-attention entry points and backend dispatch.

Backends: ``"xla"`` (plain jnp, every platform), ``"pallas_tpu"`` and ``"pallas_gpu"``
(``pallas_kernels/``, imported lazily so the core never needs them), and ``"cpu"`` (C
decode and ragged kernels XLA calls through its FFI, ``pallas_kernels/cpu``, built on
first use by the system's C compiler; quantized pools stay on XLA). ``"auto"`` takes the
first implemented and enabled backend in the platform's order of preference (TPU:
pallas_tpu; NVIDIA GPU: pallas_gpu; CPU: cpu when it builds, else XLA); the environment
variable ``PAGED_JAX_BACKEND`` overrides it.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import jax
import jax.numpy as jnp

from paged_jax import _xla
from paged_jax._validation import static_check_decode, static_check_ragged

BACKENDS = ("auto", "xla", "pallas_tpu", "pallas_gpu", "cpu")

# Preference per platform; "auto" skips backends whose kernels are not implemented yet.
_PREFERENCE = {
    "tpu": ("pallas_tpu", "xla"),
    "gpu": ("pallas_gpu", "xla"),
    "cuda": ("pallas_gpu", "xla"),
    "rocm": ("xla",),
    "cpu": ("cpu", "xla"),
}
# Which Pallas backends "auto" may pick (the measurements: docs/DECISIONS.md, "Which
# backends "auto" picks"); PAGED_JAX_BACKEND=xla restores the XLA path without a code change.
# * pallas_tpu: verified in TPU interpret mode and compiled for v5e/v6e through libtpu on a
#   CPU host (.ci/tpu_compile); speed unmeasured. Pools the kernels do not take go to XLA
#   (_tpu_or_none).
# * pallas_gpu: compiled, tested and timed on an H100: the decode kernel reads K/V near copy
#   bandwidth, about 10x the XLA path's.
# * cpu: where it builds; 4-5x XLA's decode and ragged steps on SmolLM2's shapes.
_AUTO_ENABLED = {"pallas_tpu": True, "pallas_gpu": True, "cpu": True}
_ENV_OVERRIDE = "PAGED_JAX_BACKEND"


def _pallas_impl(backend: str, kind: str) -> Callable | None:
    """The kernel implementing ``kind`` ("ragged" | "decode"), or None if there is none (the
    CPU backend: none where its kernels did not build)."""
    if backend == "cpu":
        from paged_jax.kernels import cpu

        return getattr(cpu, f"{kind}_paged_attention") if cpu.available() else None
    if backend == "pallas_tpu":
        from paged_jax.kernels import tpu as mod
    else:
        from paged_jax.kernels import gpu as mod
    return getattr(mod, f"{kind}_paged_attention", None)


def backend_of(impl: Callable) -> str:
    """ "pallas_gpu", "pallas_tpu" or "cpu": the backend a kernel function belongs to."""
    for name, module in (("pallas_gpu", "gpu"), ("cpu", "cpu")):
        if impl.__module__.startswith(f"paged_jax.kernels.{module}"):
            return name
    return "pallas_tpu"


def _default_platform() -> str:
    """The platform computations go to: that of ``jax.default_device`` where one is set
    (CPU devices on a GPU machine, say), else JAX's default backend."""
    device = jax.config.jax_default_device
    if device is None:
        return jax.default_backend()
    return device if isinstance(device, str) else device.platform


def available_backends(platform: str | None = None) -> tuple[str, ...]:
    """Implemented backends for ``platform`` (default: that of ``jax.default_device`` if
    set, else JAX's default backend), best first."""
    platform = platform or _default_platform()
    names = _PREFERENCE.get(platform, ("xla",))
    return tuple(b for b in names if b == "xla" or _pallas_impl(b, "ragged") is not None)


def _auto(platform: str | None = None) -> str:
    """The backend "auto" picks: ``$PAGED_JAX_BACKEND`` if set, else the best implemented,
    enabled backend of the platform."""
    forced = os.environ.get(_ENV_OVERRIDE)
    if forced:
        if forced not in BACKENDS or forced == "auto":
            raise ValueError(f"{_ENV_OVERRIDE}: expected one of {BACKENDS[1:]}, got {forced!r}")
        return forced
    for b in available_backends(platform):
        if b == "xla" or _AUTO_ENABLED[b]:
            return b
    return "xla"


def _resolve(backend: str, kind: str, batch_invariant: bool = False) -> Callable | None:
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = _auto()
        if batch_invariant and backend == "pallas_gpu" and not os.environ.get(_ENV_OVERRIDE):
            # Bitwise invariance on a GPU is the XLA path's: the Triton kernels' invariant
            # mode left log-probs up to 1e-6 apart alone and batched (docs/DECISIONS.md,
            # "Batch-invariant attention on a GPU").
            return None
    if backend == "xla":
        return None
    if backend == "cpu":  # an unbuilt kernel is an error when asked for
        from paged_jax.kernels import cpu

        if not cpu.available():
            raise ValueError(
                f"backend='cpu': the CPU kernel is not available here ({cpu.unavailable_reason()});"
                " use backend='xla' or 'auto'"
            )
        return _pallas_impl(backend, kind)
    impl = _pallas_impl(backend, kind)
    if impl is None:
        raise NotImplementedError(
            f"backend={backend!r}: the {kind} kernel is not implemented yet; use "
            f"backend='xla' or 'auto' (available here: {available_backends()})"
        )
    return impl


def _tpu_or_none(impl, backend: str, kv_pages) -> Callable | None:
    """``impl``, or None (XLA) where ``"auto"`` picked the TPU kernels for a pool they do
    not take (``paged_jax.kernels.tpu.supports``: a head dim over 128, an 8-bit pool
    with an odd number of kv heads). Asked for by name, the kernel raises instead."""
    if impl is None or backend != "auto" or backend_of(impl) != "pallas_tpu":
        return impl
    from paged_jax.kernels import tpu

    return impl if tpu.supports(kv_pages) else None


def _cpu_or_none(impl, q, kv_pages, k_scale, v_scale) -> Callable | None:
    """``impl``, or None (XLA) where a CPU kernel cannot take the call: the C kernels read
    f32/bf16 queries and pools without scales. They are batch invariant as they are
    (each token computed alone, its ragged row bitwise its decode row), so
    ``batch_invariant`` steps take them too."""
    if impl is None or backend_of(impl) != "cpu":
        return impl
    plain = k_scale is None and v_scale is None
    floats = {q.dtype, kv_pages.dtype} <= {jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)}
    return impl if plain and floats else None


def _check_sinks(sinks, q) -> None:
    """``ValueError``/``TypeError`` naming ``sinks`` unless it is None or a float ``[H]``."""
    if sinks is None:
        return
    shape, dtype = getattr(sinks, "shape", None), getattr(sinks, "dtype", None)
    if shape is None or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"sinks: expected a float array [H] or None, got {type(sinks).__name__}")
    if tuple(shape) != (q.shape[1],):
        raise ValueError(f"sinks: expected shape ({q.shape[1]},) (one a query head), got {shape}")


def ragged_paged_attention(
    q: jax.Array,  # [T, H, D]
    kv_pages: jax.Array,  # [N, P, 2K, D]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, M]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float | jax.Array | None = None,
    v_scale: float | jax.Array | None = None,
    sinks: jax.Array | None = None,  # f32[H]
    backend: str = "auto",
    interpret: bool = False,
    batch_invariant: bool = False,
) -> jax.Array:  # [T, H, D], q.dtype
    """Attention for a ragged batch mixing prefill chunks and decode tokens.

    Same argument order and meaning as
    ``jax.experimental.pallas.ops.tpu.ragged_paged_attention.ragged_paged_attention``.

    Args:
      q: ``[T, H, D]`` every sequence's new tokens, concatenated; sequence i owns rows
        ``cu_q_lens[i]:cu_q_lens[i+1]``. Rows past ``cu_q_lens[num_seqs]`` are padding.
      kv_pages: ``[N, P, 2K, D]`` one layer of the pool (K at 2h, V at 2h + 1); the new
        tokens' K/V must already be written.
      kv_lens: ``i32[S]`` tokens in each sequence's kv, new tokens included.
      page_indices: ``i32[S, M]`` block table; row i lists sequence i's pages in order.
      cu_q_lens: ``i32[S + 1]`` cumulative new-token counts, starting at 0.
      num_seqs: ``i32[1]`` sequences in use; rows ``>= num_seqs`` are neither read nor
        written (their outputs are 0).
      sm_scale: multiplies ``q . k`` (e.g. ``D ** -0.5``).
      sliding_window: a token attends to at most this many most recent keys (itself included).
      soft_cap: logits become ``soft_cap * tanh(logits / soft_cap)``.
      k_scale, v_scale: dequantization of int8/fp8 pages: a float, or per-token
        ``f32[N, P, K]`` scales (``PagedKVCache.layer`` returns them).
      sinks: ``f32[H]`` or None: each query head's attention sink (GPT-OSS), a logit on the
        scale of ``sm_scale * q.k`` that joins the softmax's sum with a value of 0, so a
        token may attend to "nothing". Taken by every backend.
      backend: ``"auto" | "xla" | "pallas_tpu" | "pallas_gpu" | "cpu"`` (``"cpu"``: the C
        kernels for f32/bf16 pools, XLA for quantized pools).
      interpret: run Pallas kernels in interpret mode (CPU testing); ignored by ``"xla"``.
      batch_invariant: each token's output is bitwise independent of the other tokens and
        sequences of the call: KV block sizes and order are fixed, never chosen from T, S
        or M (see ``_xla.attend_tokens``). The TPU kernels are so by construction; XLA
        and the GPU kernels fix their blocks. Costs some speed (the XLA path always loops).
        On an NVIDIA GPU, ``"auto"`` then takes the XLA path, bitwise invariant there where
        the Triton kernels' log-probs were up to 1e-6 apart (asked for by name, they keep
        their invariant blocks).

    Returns ``[T, H, D]`` in q's dtype: new token t attends causally to its sequence's
    keys ``0 .. pos(t)`` where ``pos`` counts from ``kv_len - q_len``. Values (lengths, page
    ids) are not checked under jit: see ``paged_jax.validate_inputs``.
    """
    static_check_ragged(
        q,
        kv_pages,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    _check_sinks(sinks, q)
    impl = _cpu_or_none(_resolve(backend, "ragged", batch_invariant), q, kv_pages, k_scale, v_scale)
    impl = _tpu_or_none(impl, backend, kv_pages)
    kwargs = dict(
        sm_scale=float(sm_scale),
        sliding_window=sliding_window,
        soft_cap=None if soft_cap is None else float(soft_cap),
        k_scale=k_scale,
        v_scale=v_scale,
    )
    if sinks is not None:
        kwargs["sinks"] = sinks
    if impl is None:
        return _xla.ragged_paged_attention(
            q,
            kv_pages,
            kv_lens,
            page_indices,
            cu_q_lens,
            num_seqs,
            batch_invariant=bool(batch_invariant),
            **kwargs,
        )
    if batch_invariant and backend_of(impl) == "pallas_gpu":
        kwargs["batch_invariant"] = True
    return impl(
        q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, interpret=interpret, **kwargs
    )


def paged_attention(
    q: jax.Array,  # [B, H, D]
    kv_pages: jax.Array,  # [N, P, 2K, D]
    kv_lens: jax.Array,  # i32[B]
    page_indices: jax.Array,  # i32[B, M]
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float | jax.Array | None = None,
    v_scale: float | jax.Array | None = None,
    sinks: jax.Array | None = None,  # f32[H]
    backend: str = "auto",
    interpret: bool = False,
    batch_invariant: bool = False,
) -> jax.Array:  # [B, H, D], q.dtype
    """Decode attention: one new token per sequence, at position ``kv_lens[b] - 1``.

    The ``q_len == 1`` case of ``ragged_paged_attention`` with its own fast path. Rows with
    ``kv_lens[b] == 0`` are padding: output 0, no page read. Other arguments as there.
    """
    static_check_decode(
        q,
        kv_pages,
        kv_lens,
        page_indices,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    _check_sinks(sinks, q)
    impl = _cpu_or_none(_resolve(backend, "decode", batch_invariant), q, kv_pages, k_scale, v_scale)
    impl = _tpu_or_none(impl, backend, kv_pages)
    kwargs = dict(
        sm_scale=float(sm_scale),
        sliding_window=sliding_window,
        soft_cap=None if soft_cap is None else float(soft_cap),
        k_scale=k_scale,
        v_scale=v_scale,
    )
    if sinks is not None:
        kwargs["sinks"] = sinks
    if impl is None:
        return _xla.paged_attention(
            q, kv_pages, kv_lens, page_indices, batch_invariant=bool(batch_invariant), **kwargs
        )
    if batch_invariant and backend_of(impl) == "pallas_gpu":
        kwargs["batch_invariant"] = True
    return impl(q, kv_pages, kv_lens, page_indices, interpret=interpret, **kwargs)
