"""Top-k, top-p and min-p draws without sorting the vocabulary, for GPUs and TPUs.

``sample_rows`` defines a restricted row's kept tokens as the prefix of its tokens in
descending order of the scaled logits (ties: the lower index first) that top-k, top-p and
min-p keep, and its token as a draw from them in vocabulary order. Sorting 128k logits
per row, or taking their few hundred largest with ``lax.top_k``, cost 3-7 ms of a 22 ms
Llama-3-8B decode step at 256 rows on an H100 (issue 57). This module finds the same
token with passes over the row that only compare and add, which a GPU streams at its
memory bandwidth:

1. Each logit becomes an integer key with the same order (``sortable``). The kept prefix
   ends inside one group of equal keys, ``v``: the smallest key at which the first token
   at or below it would still be kept. A radix search finds ``v`` 4 bits at a time, each
   round one pass that counts the tokens and sums the weights above 15 trial keys.
2. How many of ``v``'s equal tokens are kept follows from the counts above ``v`` (equal
   logits have equal weights): all of them, unless exactly equal logits straddle the
   cut, and then those up to the index of the last one kept.
3. The draw ``u * W_kept`` walks the kept weights in vocabulary order (``inverse_cdf``:
   block sums, then one block), so it needs no second search.

About 14 passes over the ``[R, V]`` logits for any row, peaked or flat. The token is the
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


_CDF_BLOCK = 256


def _search(cdf: jax.Array, target: jax.Array) -> jax.Array:
    """Per row, how many entries of ``cdf`` f32[R, C] are <= each ``target`` f32[R, J].
    By comparing with all of them (C is at most a few hundred here), not a binary search:
    that is a loop, and a GPU whose loop count XLA does not see reads each iteration's
    predicate back to the host, stalling the step's dispatch."""
    return jnp.sum(cdf[:, None, :] <= target[:, :, None], axis=-1, dtype=jnp.int32)


def _last_positive(w: jax.Array) -> jax.Array:
    """``i32[..., 1]``: the last index along ``w``'s last axis holding a positive entry
    (0 where none does)."""
    index = jax.lax.broadcasted_iota(jnp.int32, w.shape, w.ndim - 1)
    return jnp.max(jnp.where(w > 0, index, 0), axis=-1, keepdims=True)


def inverse_cdf(weights: jax.Array, u: jax.Array) -> jax.Array:
    """Index of the draw ``u`` (f32[R, J] in [0, 1)) from unnormalized ``weights`` f32[R, C]
    (each row with a positive weight): the first i whose running sum exceeds ``u *
    total``, never a zero-weight entry (where rounding leaves the running sum at or below
    the target to the end, the last entry of positive weight).

    Wider than one block, it goes in two levels (a cumulative sum of block sums, then one
    within the chosen block): a scan over the whole vocabulary was most of the cost on
    CPU."""
    R, C = weights.shape
    if C <= _CDF_BLOCK:
        cdf = jnp.cumsum(weights, axis=-1)
        return jnp.minimum(_search(cdf, u * cdf[:, -1:]), _last_positive(weights))
    nb = -(-C // _CDF_BLOCK)
    w = jnp.pad(weights, ((0, 0), (0, nb * _CDF_BLOCK - C))).reshape(R, nb, _CDF_BLOCK)
    block_sum = w.sum(-1)  # [R, nb]
    block_cdf = jnp.cumsum(block_sum, axis=-1)
    target = u * block_cdf[:, -1:]  # [R, J]
    blk = jnp.minimum(_search(block_cdf, target), _last_positive(block_sum))  # [R, J]
    start = jnp.take_along_axis(block_cdf - block_sum, blk, axis=-1)  # mass before the block
    chosen = jnp.take_along_axis(w, blk[:, :, None], axis=1).reshape(-1, _CDF_BLOCK)  # [R J, B]
    within = _search(jnp.cumsum(chosen, axis=-1), (target - start).reshape(-1, 1))
    within = jnp.minimum(within, _last_positive(chosen)).reshape(blk.shape)
    return jnp.minimum(blk * _CDF_BLOCK + within, C - 1)


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

    # unrolled: no loop for a GPU runtime to count (a loop it cannot count reads its
    # predicate back to the host every iteration)
    return jax.lax.fori_loop(0, _ROUNDS, round_, jnp.zeros(span.shape, jnp.uint32), unroll=True)


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
    first token in vocabulary order whose running kept weight exceeds ``u`` times the
    kept weight, where the kept tokens are a prefix of the tokens in descending order of
    ``scaled`` (ties by index): rank < top_k, weight before < top_p x the total, weight
    >= min_p x the largest (the first token always).
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

    # 2. How many of v's equal tokens are kept.
    n_above, mass_above = above(v)
    at_v = key == v[:, None]
    n_at_v = jnp.sum(at_v, axis=-1, dtype=jnp.int32)
    w_v = jnp.max(jnp.where(at_v, w, 0.0), axis=-1)
    by_p = jnp.ceil((limit_p - mass_above) / jnp.where(w_v > 0, w_v, 1.0))
    by_p = jnp.clip(by_p, 1, V).astype(jnp.int32)
    kept_at_v = jnp.maximum(jnp.minimum(jnp.minimum(n_at_v, limit_k - n_above), by_p), 1)

    # 3. The kept tokens: keys above v, and v's first kept_at_v equal tokens in index
    # order (all of them unless exactly equal logits straddle the cut: then the index of
    # the last kept one, by a radix search over indices). The draw runs in index order.
    partial = kept_at_v < n_at_v
    first_v = jnp.min(jnp.where(at_v, index, V), axis=-1)  # [R]
    if nth is not None:  # (rank 0 gives `first`: V, all of them, where none is cut)
        rank = jnp.where(partial, kept_at_v - 1, 0)[:, None]
        last_v = nth(scaled, v[:, None], rank, jnp.where(partial, first_v, V)[:, None])[:, 0]
    else:

        def jth():
            ranks = jnp.cumsum(at_v, axis=-1, dtype=jnp.int32)
            hit = at_v & (ranks == kept_at_v[:, None])
            return jnp.where(partial, jnp.min(jnp.where(hit, index, V), axis=-1), V)

        last_v = jax.lax.cond(jnp.any(partial), jth, lambda: jnp.full(R, V, jnp.int32))
    kept = (key > v[:, None]) | (at_v & (index <= last_v[:, None]))
    return inverse_cdf(jnp.where(kept, w, 0.0), u).astype(jnp.int32)
