"""One K/V block of the GPU kernels' page walk (traced inside them): gather, dequantize,
zero what does not count, and fold into the online softmax."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .._softmax import fold


def load_pages(refs, pages):
    """The raw contents of ``pages`` (``i32[bp]`` ids) from ``refs`` (``(k_ref, v_ref,
    k_scale_ref | None, v_scale_ref | None)`` over the whole pool of one kv head): ``(k,
    v, k_scale | None, v_scale | None)``, K and V ``[bp, P, D]`` in the pool's dtype, the
    scales ``f32[bp, P]``. Nothing depends on the values, so a walk may issue these loads
    a block ahead of the block it computes on (``fold_pages`` takes them)."""
    return tuple(None if ref is None else ref[pages] for ref in refs)


def fold_pages(q, raw, keep, mask, carry, *, compute_dtype, precision, soft_cap):
    """Folds the keys of a loaded block (``load_pages``'s ``raw``) into ``carry``.

    ``q``: ``[R, D]`` queries in ``compute_dtype``, already scaled; ``keep``:
    ``bool[bp * P]``, the slots that may be read (others are zeroed: unwritten slots may
    hold NaN, and a masked score does not protect ``p @ v``); ``mask``: which (row, key)
    scores count, broadcastable to ``[R, bp * P]``; ``carry``: ``(acc, m, l)`` as in
    ``fold``. Dots take ``compute_dtype`` operands and accumulate in f32.
    """
    k_raw, v_raw, ks_raw, vs_raw = raw
    tokens = keep.shape[0]
    head_dim = q.shape[-1]

    def widen(x, scale):
        x = x.reshape(tokens, head_dim)
        if scale is not None:
            x = x.astype(jnp.float32) * scale.reshape(tokens, 1)
        return jnp.where(keep[:, None], x.astype(compute_dtype), 0)

    k, v = widen(k_raw, ks_raw), widen(v_raw, vs_raw)
    dot = functools.partial(
        jax.lax.dot_general, precision=precision, preferred_element_type=jnp.float32
    )
    return fold(
        dot(q, k, (((1,), (1,)), ((), ()))),
        mask,
        carry,
        lambda p: dot(p.astype(compute_dtype), v, (((1,), (0,)), ((), ()))),
        soft_cap,
    )


def attend_pages(q, refs, pages, keep, mask, carry, *, compute_dtype, precision, soft_cap):
    """Loads ``pages`` (``i32[bp]``, gathered in the kernel) from ``refs`` and folds their
    keys into ``carry``: ``fold_pages(q, load_pages(refs, pages), ...)``."""
    return fold_pages(
        q,
        load_pages(refs, pages),
        keep,
        mask,
        carry,
        compute_dtype=compute_dtype,
        precision=precision,
        soft_cap=soft_cap,
    )
