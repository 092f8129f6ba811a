"""One K/V block of the GPU kernels' page walk (traced inside them): gather, dequantize,
zero what does not count, and fold into the online softmax."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .._softmax import fold


def attend_pages(q, refs, pages, keep, mask, carry, *, compute_dtype, precision, soft_cap):
    """Folds the keys of ``pages`` into ``carry``.

    ``q``: ``[R, D]`` queries in ``compute_dtype``, already scaled; ``refs``: ``(k_ref,
    v_ref, k_scale_ref | None, v_scale_ref | None)`` over the whole pool of one kv head;
    ``pages``: ``i32[bp]`` page ids (gathered in the kernel); ``keep``: ``bool[bp * P]``,
    the slots that may be read (others are zeroed: unwritten slots may hold NaN, and a
    masked score does not protect ``p @ v``); ``mask``: which (row, key) scores count,
    broadcastable to ``[R, bp * P]``; ``carry``: ``(acc, m, l)`` as in ``fold``.
    Dots take ``compute_dtype`` operands and accumulate in f32.
    """
    k_ref, v_ref, ks_ref, vs_ref = refs
    tokens = keep.shape[0]
    head_dim = q.shape[-1]

    def load(ref, scale_ref):
        x = ref[pages].reshape(tokens, head_dim)
        if scale_ref is not None:
            x = x.astype(jnp.float32) * scale_ref[pages].reshape(tokens, 1)
        return jnp.where(keep[:, None], x.astype(compute_dtype), 0)

    k, v = load(k_ref, ks_ref), load(v_ref, vs_ref)
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
