"""Sampling on the CPU (``sample.c``): each row's argmax and log-sum-exp for greedy steps
(``greedy_rows``), and the whole sampler without sorting the vocabulary
(``sample_tokens``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .build import (
    GREEDY_TARGET,
    SAMPLE_TARGET,
    require,
    threads_of,
)


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
    count = threads_of(threads)
    require()
    r = x.shape[0]
    call = jax.ffi.ffi_call(
        GREEDY_TARGET,
        (jax.ShapeDtypeStruct((r,), jnp.int32), jax.ShapeDtypeStruct((r,), jnp.float32)),
    )
    token, lse = call(x, jnp.asarray([count], jnp.int32))
    return token, lse


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
    count = threads_of(threads)
    require()
    call = jax.ffi.ffi_call(
        SAMPLE_TARGET,
        (
            jax.ShapeDtypeStruct(u.shape, jnp.int32),
            jax.ShapeDtypeStruct((r,), jnp.float32),
        ),
    )
    return call(x, temperature, top_k, top_p, min_p, u, jnp.asarray([count], jnp.int32))
