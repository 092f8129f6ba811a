"""The online-softmax fold shared by the kernels (traced inside them; jax.numpy only)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def fold(
    s: jax.Array,
    mask: jax.Array,
    carry,
    pv: Callable[[jax.Array], jax.Array],
    soft_cap: float | None = None,
):
    """Folds one block of scores into the running (acc, m, l) of a flash softmax.

    ``s``: raw scores ``f32[..., C]`` (already scaled by sm_scale); ``mask``: which keys
    count (broadcastable to ``s``); ``carry``: ``(acc f32[..., D], m f32[...], l f32[...])``
    with ``m = -inf`` before any key; ``pv(p)``: ``p @ V`` for this block's values. Fully
    masked rows keep ``m = -inf``, ``l = 0`` and contribute nothing.
    """
    acc, m, l = carry

    def per_row(x, like):
        """``x[..., None]`` broadcast to ``like``'s shape in one step: Mosaic GPU has no
        layout for the ``[R, 1]`` intermediate that indexing would make."""
        return jax.lax.broadcast_in_dim(x, like.shape, tuple(range(x.ndim)))

    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(mask, s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=-1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - per_row(m_safe, s))
    alpha = jnp.exp(m - m_safe)
    return per_row(alpha, acc) * acc + pv(p), m_new, alpha * l + p.sum(axis=-1)
