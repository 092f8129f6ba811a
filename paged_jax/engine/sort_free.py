"""Top-k, top-p and min-p draws without sorting the vocabulary, for GPUs and TPUs.

``sample_rows`` defines a restricted row's token as a draw along the row's tokens in
descending order of the scaled logits (ties: the lower index first), over the prefix that
top-k, top-p and min-p keep. Sorting 128k logits per row, or taking their few hundred
largest with ``lax.top_k``, cost 3-7 ms of a 22 ms Llama-3-8B decode step at 256 rows on
an H100 (issue 57). This module finds the same token with passes over the row that only
compare and add, which a GPU streams at its memory bandwidth:

1. Each logit becomes an integer key with the same order (``sortable``). The kept prefix
   ends inside one group of equal keys, ``v``: the smallest key at which the first token
   at or below it would still be kept. A radix search finds ``v`` 4 bits at a time, each
   round one pass that counts the tokens and sums the weights above 15 trial keys.
2. How many of ``v``'s equal tokens are kept, and so the kept weight ``W_k``, follows from
   the counts above ``v`` (equal logits have equal weights).
3. The draw ``u * W_k`` falls in the group of key ``t``: the largest key whose kept weight
   at or above it exceeds the draw, found by the same radix search. Within the group, the
   ``j``-th of the equal tokens in index order is drawn, ``j`` from the weight above ``t``.

About 18 passes over the ``[R, V]`` logits for any row, peaked or flat. The token is the
definition's except where a decision falls within rounding (sums in another order).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged_jax.kernels.gpu.sample import offset as _offset
from paged_jax.kernels.gpu.sample import sortable

DIGIT_BITS = 4  # bits of a key decided per pass: 15 trial keys per pass, 8 passes
_ROUNDS = 32 // DIGIT_BITS
_DIGITS = 1 << DIGIT_BITS
# Read when traced: a radix round's comparisons laid out [R, V, 16] (the trials vary
# fastest, so a GPU reduction over V reads each key once for all 16 trials) instead of
# [R, 16, V] (a reduction per trial, each reading the whole row). The same sums.
TRIALS_MINOR = True


def _radix_last(pred, span: jax.Array) -> jax.Array:
    """The largest offset ``d`` in ``[0, 2**32)`` with ``pred(d)`` true, for ``pred``
    true at 0 and monotone (true, then false). ``pred`` takes u32 offsets ``[..., B]``
    (the leading shape of ``span``, u32) and returns bools of that shape; offsets past
    ``span`` are clamped to it by the caller's predicate."""
    b = jnp.arange(_DIGITS, dtype=jnp.uint32).reshape((1,) * span.ndim + (_DIGITS,))

    def round_(r, prefix):
        shift = jnp.uint32(32 - DIGIT_BITS) - jnp.uint32(DIGIT_BITS) * r.astype(jnp.uint32)
        trial = prefix[..., None] + (b << shift)  # no carry: the bits below are zero
        holds = pred(trial) | (b == 0)  # the prefix itself holds by the invariant
        digit = jnp.sum(holds, axis=-1, dtype=jnp.uint32) - 1  # monotone: a count
        return prefix + (digit << shift)

    return jax.lax.fori_loop(0, _ROUNDS, round_, jnp.zeros(span.shape, jnp.uint32))


def draw(
    scaled: jax.Array,  # f32[R, V] logits / temperature
    top_k: jax.Array,  # i32[R]  0 = off
    top_p: jax.Array,  # f32[R]  1 = off
    min_p: jax.Array,  # f32[R]  0 = off
    u: jax.Array,  # f32[R, J] uniforms in [0, 1)
    *,
    counts=None,
    nth=None,
) -> jax.Array:  # i32[R, J]
    """Each column's token of a restricted row by ``sample_rows``' definition: the
    first token in descending order of ``scaled`` (ties by index) whose running weight
    over the kept prefix exceeds ``u`` times the kept weight; kept: rank < top_k, weight
    before < top_p x the total, weight >= min_p x the largest (the first token always).
    Rows whose maximum is not finite give an unspecified token (the caller takes the
    argmax there). Traceable; no sort, no top-k.

    ``counts(scaled, m, trials)`` (default: XLA reductions): for trial keys ``i32[R, T]``,
    the count ``i32[R, T]`` and weight ``f32[R, T]`` of each row's keys above each, the
    radix rounds' passes (``paged_jax.kernels.gpu.sample.trial_counts``: a row over
    several programs). ``nth(scaled, t, j, first)`` (default: a cumulative count under
    ``lax.cond``): the ``j``-th index of key ``t`` in index order, ``first`` where ``j`` is
    0, without a conditional on the host (``...gpu.sample.nth_tied``)."""
    R, V = scaled.shape
    index = jax.lax.broadcasted_iota(jnp.int32, (R, V), 1)
    m = jnp.max(scaled, axis=-1, keepdims=True)
    w = jnp.exp(scaled - m)  # the largest weighs 1
    key = sortable(scaled)
    total = jnp.sum(w, axis=-1)
    big = jnp.iinfo(jnp.int32).max
    limit_k = jnp.where(top_k > 0, top_k, big)
    limit_p = top_p * total
    # The lowest key worth reaching: a positive weight (a zero weight is never drawn) of
    # at least min_p (a prefix: weights fall with the key).
    worth = (w > 0) & (w >= min_p[:, None])
    lo = jnp.min(jnp.where(worth, key, big), axis=-1)
    hi = jnp.max(key, axis=-1)
    span = (hi - lo).astype(jnp.uint32)  # hi >= lo: the maximum is worth reaching

    def above(t):  # t i32[R, ...]: (count, weight) of the keys above each t
        if counts is not None:
            n, mass = counts(scaled, m[:, 0], t.reshape(R, -1))
            return n.reshape(t.shape), mass.reshape(t.shape)
        if TRIALS_MINOR and t.ndim > 1:  # [R, ..., V, B]: the trials vary fastest
            lead = (R,) + (1,) * (t.ndim - 2)
            gt = key.reshape(lead + (V, 1)) > t[..., None, :]
            wv = w.reshape(lead + (V, 1))
            return (
                jnp.sum(gt, axis=-2, dtype=jnp.int32),
                jnp.sum(jnp.where(gt, wv, 0.0), axis=-2),
            )
        gt = key.reshape((R,) + (1,) * (t.ndim - 1) + (V,)) > t[..., None]
        wv = w.reshape(gt.shape[:1] + (1,) * (t.ndim - 1) + (V,))
        return jnp.sum(gt, axis=-1, dtype=jnp.int32), jnp.sum(jnp.where(gt, wv, 0.0), axis=-1)

    def kept_first_at_or_below(t):  # would the first token with key <= t be kept?
        n, mass = above(t)
        return (n < limit_k.reshape((R,) + (1,) * (t.ndim - 1))) & (
            mass < limit_p.reshape((R,) + (1,) * (t.ndim - 1))
        )

    # 1. v: the smallest key >= lo at which the first token at or below it is kept.
    def dropped(d):
        return ~kept_first_at_or_below(_offset(lo[:, None], d, span[:, None]))

    last_dropped = _radix_last(dropped, span)
    v = jnp.where(
        dropped(jnp.zeros((R, 1), jnp.uint32))[:, 0], _offset(lo, last_dropped + 1, span), lo
    )

    # 2. How many of v's equal tokens are kept, and the kept weight.
    n_above, mass_above = above(v)
    at_v = key == v[:, None]
    n_at_v = jnp.sum(at_v, axis=-1, dtype=jnp.int32)
    w_v = jnp.max(jnp.where(at_v, w, 0.0), axis=-1)
    by_p = jnp.ceil((limit_p - mass_above) / jnp.where(w_v > 0, w_v, 1.0))
    by_p = jnp.clip(by_p, 1, V).astype(jnp.int32)
    kept_at_v = jnp.maximum(jnp.minimum(jnp.minimum(n_at_v, limit_k - n_above), by_p), 1)
    kept_weight = mass_above + kept_at_v.astype(jnp.float32) * w_v
    target = u * kept_weight[:, None]  # [R, J]

    # 3. t: the largest key >= v whose kept weight at or above it exceeds the target.
    span_v = (hi - v).astype(jnp.uint32)
    J = u.shape[1]

    def reaches(d):  # d u32[R, J, B]
        t = _offset(v[:, None, None], d, span_v[:, None, None])
        _, mass = above(t - 1)  # at or above t (t > v: every such token is kept)
        return (mass > target[..., None]) & (d <= span_v[:, None, None])

    t = _offset(
        v[:, None], _radix_last(reaches, jnp.broadcast_to(span_v[:, None], (R, J))), span_v[:, None]
    )
    keyed = key[:, None, :]  # [R, 1, V]
    at_t = keyed == t[..., None]  # [R, J, V]
    if counts is None:
        weight_before = jnp.sum(jnp.where(keyed > t[..., None], w[:, None, :], 0.0), axis=-1)
    else:  # (the same sums as the search's, in the kernel's order)
        weight_before = above(t)[1]
    w_t = jnp.max(jnp.where(at_t, w[:, None, :], 0.0), axis=-1)
    n_at_t = jnp.where(t == v[:, None], kept_at_v[:, None], jnp.sum(at_t, axis=-1, dtype=jnp.int32))
    j = jnp.floor((target - weight_before) / jnp.where(w_t > 0, w_t, 1.0))
    j = jnp.clip(j, 0, jnp.maximum(n_at_t - 1, 0)).astype(jnp.int32)  # [R, J]

    # The j-th token of key t in index order: the first one unless ties split the draw.
    first = jnp.min(jnp.where(at_t, index[:, None, :], V), axis=-1)

    def jth():
        rank = jnp.cumsum(at_t, axis=-1, dtype=jnp.int32)  # [R, J, V]
        hit = at_t & (rank == j[..., None] + 1)
        return jnp.min(jnp.where(hit, index[:, None, :], V), axis=-1)

    if nth is not None:
        token = nth(scaled, t, j, first)
    else:
        token = jax.lax.cond(jnp.any(j > 0), jth, lambda: first)
    return jnp.minimum(token, V - 1).astype(jnp.int32)
