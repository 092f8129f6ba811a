"""Restricted sampling rows drawn on an NVIDIA GPU without a sort (Pallas, Triton lowering).

``paged_jax.engine.sort_free.draw`` finds a top-k / top-p / min-p row's token with radix
passes over the row, each of which XLA runs as a separate reduction over a
``[R, V, 2**bits]`` comparison, slower on an H200 than the full sort it was to replace
(docs/DECISIONS.md, "Sort-free draws per backend"). This kernel
runs the same search, pass for pass, inside one program per row: the row is streamed in
``block``-wide chunks, the comparisons against a round's trial keys stay in registers, and
the per-row scalars (the maximum, the total weight, the radix prefixes) never leave the
program.

Definition and keys are ``sort_free.draw``'s (and so ``sample_rows``'s): the kept prefix in
descending order of the scaled logits, ties by index, and the draw ``u * W_kept`` over the
kept tokens in vocabulary order. About 20 passes over the row with ``bits=2``: the maximum,
the total, 16 radix rounds, the kept count at the cut, and the draw (one pass summing
each chunk, then a cumulative sum within the chunk it lands in). Sums run in another order
than XLA's, so a decision that falls within rounding may go the other way. A cut through
several tokens with exactly equal logits (rare) takes one more radix search, over their
indices, inside the program.

Runs under ``interpret=True`` on CPU (the tests) and lowers through Triton on GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import tuning

_I32_MAX = jnp.iinfo(jnp.int32).max


def sortable(x: jax.Array) -> jax.Array:
    """``i32`` keys of ``f32`` values with the same order (equal values, -0 and +0
    included, get equal keys; NaNs are not ordered). Shared with the XLA passes
    (``paged_jax.engine.sort_free``), so both search the same keys."""
    x = jnp.where(x == 0, jnp.float32(0), x)
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def offset(base: jax.Array, d: jax.Array, span: jax.Array) -> jax.Array:
    """``base + min(d, span)``: i32 base, u32 offsets, wrapping mod 2**32 as intended."""
    return base + jnp.minimum(d, span).astype(jnp.int32)


def _kernel(
    x_ref,  # f32[V] the row's scaled logits
    active_ref,  # i32[R] 0: a row not to draw (its tokens are 0)
    top_k_ref,  # i32[R]
    top_p_ref,  # f32[R]
    min_p_ref,  # f32[R]
    u_ref,  # f32[J] the row's uniforms
    token_ref,  # i32[J] out
    *,
    columns,
    **kw,
):
    r = pl.program_id(0)
    active = active_ref[r] != 0

    @pl.when(~active)
    def _():
        for j in range(columns):
            token_ref[j] = jnp.int32(0)

    @pl.when(active)
    def _():
        _draw(r, x_ref, top_k_ref, top_p_ref, min_p_ref, u_ref, token_ref, columns=columns, **kw)


class _Row:
    """One program's row of scaled logits (``x_ref`` f32[V]), read ``block`` lanes at a time."""

    def __init__(self, x_ref, *, vocab, block, prefetch):
        self.x_ref, self.vocab, self.block, self.prefetch = x_ref, vocab, block, prefetch
        self.blocks = pl.cdiv(vocab, block)
        self.lane = jnp.arange(block, dtype=jnp.int32)

    def load(self, i):
        """The i-th chunk: (index i32[block], scaled logits f32[block]); past the row: -inf."""
        idx = i * self.block + self.lane
        at = self.x_ref.at[pl.ds(i * self.block, self.block)]
        return idx, plgpu.load(at, mask=idx < self.vocab, other=-jnp.inf)

    def lanes(self, value, dtype, *trailing):
        return jnp.full((self.block, *trailing), value, dtype)

    def over(self, body, init, reduce):
        """One pass over the row: ``body(chunk, carry)`` folds a chunk (``load``'s
        ``(index, logits)``) into lane-wise accumulators (``init``: arrays with ``block``
        leading lanes), which ``reduce`` (one function per accumulator) folds over the
        lanes once, after the last chunk, so no step of the loop waits on a reduction
        across the program's warps. With ``prefetch`` = d > 0 each step issues the load of
        the chunk d ahead before it computes on this one, so d loads are in flight while
        it computes (a pass's compute is a few instructions a logit: with one load in
        flight a step takes a load's latency, compiled for sm_90; loads past the row's end
        are masked off: they read nothing)."""
        d, block, lane = self.prefetch, self.block, self.lane
        if d:

            def step(i, carry):
                xs, acc = carry
                ahead = self.load(i + d)[1]
                return (*xs[1:], ahead), body((i * block + lane, xs[0]), acc)

            first = tuple(self.load(j)[1] for j in range(d))
            _, acc = jax.lax.fori_loop(0, self.blocks, step, (first, init))
        else:
            step = lambda i, acc: body(self.load(i), acc)  # noqa: E731
            acc = jax.lax.fori_loop(0, self.blocks, step, init)
        return tuple(f(a, axis=0) for f, a in zip(reduce, acc, strict=True))


def _draw(
    r,
    x_ref,
    top_k_ref,
    top_p_ref,
    min_p_ref,
    u_ref,
    token_ref,
    *,
    vocab,
    block,
    bits,
    columns,
    prefetch,
):
    """Row ``r``'s ``columns`` tokens into ``token_ref``: the row's maximum, total and lowest
    key worth reaching, the cut of its kept set (``_cut``), then the draw (``_draw_kept``)."""
    row = _Row(x_ref, vocab=vocab, block=block, prefetch=prefetch)
    # The row's largest value (its key is the largest key), then its weights' total and
    # the lowest key worth reaching (a positive weight of at least min_p).
    (m,) = row.over(
        lambda chunk, acc: (jnp.maximum(acc[0], chunk[1]),),
        (row.lanes(-jnp.inf, jnp.float32),),
        (jnp.max,),
    )
    min_p = min_p_ref[r]

    def totals(chunk, carry):
        total, lo = carry
        _, x = chunk
        w = jnp.exp(x - m)
        worth = (w > 0) & (w >= min_p)
        return total + w, jnp.minimum(lo, jnp.where(worth, sortable(x), _I32_MAX))

    init = (row.lanes(0, jnp.float32), row.lanes(_I32_MAX, jnp.int32))
    total, lo = row.over(totals, init, (jnp.sum, jnp.min))
    top_k = top_k_ref[r]
    limit_k = jnp.where(top_k > 0, top_k, _I32_MAX)
    v, last_v, kept_weight = _cut(row, m, lo, limit_k, top_p_ref[r] * total, bits=bits)
    _draw_kept(row, m, v, last_v, kept_weight, u_ref, token_ref, columns=columns)


def _cut(row: _Row, m, lo, limit_k, limit_p, *, bits):
    """Where the kept set ends: ``(v, last_v, kept_weight)``, the key ``v`` of its last
    tokens, the index of the last kept token of key ``v`` (``vocab`` for all of them) and
    the kept tokens' total weight (weights ``exp(x - m)``)."""
    digits, vocab = 1 << bits, row.vocab
    b = jnp.arange(digits, dtype=jnp.uint32)

    def above(t):  # t i32[digits]: (count, weight) of the keys above each t
        def body(chunk, carry):
            _, x = chunk
            gt = sortable(x)[:, None] > t[None, :]  # [block, digits]
            mass = carry[1] + jnp.where(gt, jnp.exp(x - m)[:, None], 0.0)
            return carry[0] + gt.astype(jnp.int32), mass

        init = (row.lanes(0, jnp.int32, digits), row.lanes(0, jnp.float32, digits))
        return row.over(body, init, (jnp.sum, jnp.sum))

    def radix_last(pred):
        """The largest u32 offset with ``pred`` true (true at 0, then false), ``bits`` per
        round from the top; also ``pred`` at offset 0 as round 0 found it."""

        def round_(i, carry):
            prefix, at_zero = carry
            shift = jnp.uint32(32 - bits) - jnp.uint32(bits) * i.astype(jnp.uint32)
            trial = prefix + (b << shift)  # no carry: the bits below are zero
            holds = pred(trial)
            at_zero = jnp.where(i == 0, jnp.sum(jnp.where(b == 0, holds, False)) > 0, at_zero)
            digit = jnp.sum((holds | (b == 0)).astype(jnp.uint32)) - 1
            return prefix + (digit << shift), at_zero

        init = (jnp.uint32(0), jnp.array(False))
        return jax.lax.fori_loop(0, 32 // bits, round_, init)

    # 1. v: the smallest key >= lo at which the first token at or below it is kept.
    span = (sortable(m) - lo).astype(jnp.uint32)

    def dropped(d):
        n, mass = above(offset(lo, d, span))
        return ~((n < limit_k) & (mass < limit_p))

    last_dropped, dropped_at_lo = radix_last(dropped)
    v = jnp.where(dropped_at_lo, offset(lo, last_dropped + 1, span), lo)

    # 2. How many of v's equal tokens are kept, and the kept weight.
    def at_v(chunk, carry):
        n, mass, n_eq, w_eq = carry
        _, x = chunk
        key = sortable(x)
        w = jnp.exp(x - m)
        gt, eq = key > v, key == v
        return (
            n + gt.astype(jnp.int32),
            mass + jnp.where(gt, w, 0.0),
            n_eq + eq.astype(jnp.int32),
            jnp.maximum(w_eq, jnp.where(eq, w, 0.0)),
        )

    zero_i, zero_f = row.lanes(0, jnp.int32), row.lanes(0, jnp.float32)
    n_above, mass_above, n_at_v, w_v = row.over(
        at_v, (zero_i, zero_f, zero_i, zero_f), (jnp.sum, jnp.sum, jnp.sum, jnp.max)
    )
    by_p = jnp.ceil((limit_p - mass_above) / jnp.where(w_v > 0, w_v, 1.0))
    by_p = jnp.clip(by_p, 1, vocab).astype(jnp.int32)
    kept_at_v = jnp.maximum(jnp.minimum(jnp.minimum(n_at_v, limit_k - n_above), by_p), 1)
    kept_weight = mass_above + kept_at_v.astype(jnp.float32) * w_v

    # 3. The kept tokens: keys above v, and v's first kept_at_v equal tokens in index
    # order: all of them unless exactly equal logits straddle the cut (rare), and then
    # those up to the index of the last kept one, found by a radix search over indices.
    def last_kept_at_v(rank):
        return _nth_index(row.x_ref, v, rank, vocab=vocab, block=row.block, bits=bits)

    # (the branches take an operand: Triton's lowering wants a traced value from each)
    last_v = jax.lax.cond(
        kept_at_v < n_at_v, last_kept_at_v, lambda rank: rank * 0 + vocab, kept_at_v - 1
    )
    return v, last_v, kept_weight


def _draw_kept(row: _Row, m, v, last_v, kept_weight, u_ref, token_ref, *, columns):
    """The draw, in index order: one pass summing each chunk's kept weight finds, per
    column, the chunk where the running sum passes u times the kept weight (or, where
    rounding leaves it short to the end, the last chunk holding a kept token); then a
    cumulative sum within that chunk finds the token."""

    def kept_weights(chunk):
        idx, x = chunk
        key = sortable(x)
        keep = (key > v) | ((key == v) & (idx <= last_v))
        return jnp.where(keep, jnp.exp(x - m), 0.0)

    targets = [u_ref[j] * kept_weight for j in range(columns)]

    def passes(i, carry):
        run, last, last_before, found = carry
        s = jnp.sum(kept_weights(row.load(i)))
        hit = [(c < 0) & (run + s > t) for (c, _), t in zip(found, targets, strict=True)]
        found = tuple(
            (jnp.where(h, i, c), jnp.where(h, run, before))
            for h, (c, before) in zip(hit, found, strict=True)
        )
        last, last_before = jnp.where(s > 0, i, last), jnp.where(s > 0, run, last_before)
        return run + s, last, last_before, found

    none = (jnp.int32(-1), jnp.float32(0))
    init = (jnp.float32(0), jnp.int32(0), jnp.float32(0), (none,) * columns)
    _, last, last_before, found = jax.lax.fori_loop(0, row.blocks, passes, init)
    for j, (c, before) in enumerate(found):
        c, before = jnp.where(c >= 0, c, last), jnp.where(c >= 0, before, last_before)
        wk = kept_weights(row.load(c))
        crossed = jnp.sum((before + jnp.cumsum(wk) <= targets[j]).astype(jnp.int32))
        last_lane = jnp.max(jnp.where(wk > 0, row.lane, 0))
        token_ref[j] = jnp.minimum(c * row.block + jnp.minimum(crossed, last_lane), row.vocab - 1)


def _nth_index(x_ref, t, rank, *, vocab, block, bits):
    """The ``rank``-th (from 0) of the row's tokens of key ``t`` in index order: the
    largest index d with at most ``rank`` of them before it, found ``bits`` of the index
    a round, each round a pass over the row in ``block``-wide chunks (rare: only a cut of the
    kept set through several exactly equal logits asks for it)."""
    digits = 1 << bits
    rounds = pl.cdiv(max(1, (vocab - 1).bit_length()), bits)
    lane = jnp.arange(block, dtype=jnp.int32)
    b = jnp.arange(digits, dtype=jnp.int32)

    def few_before(d):  # d i32[digits]: at most `rank` tokens of key t below d
        def body(c, n):
            idx = c * block + lane
            x = plgpu.load(x_ref.at[pl.ds(c * block, block)], mask=idx < vocab, other=0.0)
            eq = ((sortable(x) == t) & (idx < vocab))[:, None]
            return n + (eq & (idx[:, None] < d[None, :])).astype(jnp.int32)

        zero = jnp.zeros((block, digits), jnp.int32)
        return jnp.sum(jax.lax.fori_loop(0, pl.cdiv(vocab, block), body, zero), axis=0) <= rank

    def round_(i, prefix):
        shift = bits * (rounds - 1 - i)
        holds = few_before(prefix + (b << shift)) | (b == 0)
        return prefix + ((jnp.sum(holds.astype(jnp.int32)) - 1) << shift)

    return jax.lax.fori_loop(0, rounds, round_, jnp.int32(0))


@functools.partial(
    jax.jit,
    static_argnames=("block", "bits", "interpret", "num_warps", "num_stages", "prefetch"),
)
def restricted_draw(
    scaled: jax.Array,  # f32[R, V] logits / temperature
    top_k: jax.Array,  # i32[R]  0 = off
    top_p: jax.Array,  # f32[R]  1 = off
    min_p: jax.Array,  # f32[R]  0 = off
    u: jax.Array,  # f32[R, J] uniforms in [0, 1)
    active: jax.Array | None = None,  # bool[R]  False: not drawn (tokens 0); None: all
    *,
    block: int | None = None,
    bits: int = tuning.SAMPLE_DIGIT_BITS,
    interpret: bool = False,
    num_warps: int | None = None,
    num_stages: int = 1,
    prefetch: int = tuning.SAMPLE_PREFETCH,
) -> jax.Array:  # i32[R, J]
    """Each column's token of a restricted row, as ``paged_jax.engine.sort_free.draw``
    defines it (its docstring has the definition), one program per row.

    ``block`` (a power of two) and ``num_warps``: logits per chunk of the row and warps per
    program (None: ``tuning.sample_block_and_warps`` of the row count). ``bits`` (1, 2, 4
    or 8): key bits decided per radix pass, ``2**bits`` trial keys compared per logit.
    ``prefetch`` (0, 1, 2, 4 or 8; True is 1): each pass over the row loads the chunk
    that many ahead before computing on the current one, that many chunks in registers
    (the same tokens; only how many loads are in flight differs).
    ``active``: rows left out return at once with token 0, so the kernel can be launched
    for every row without a ``lax.cond`` around it (on a GPU a conditional reads its
    predicate back to the host, holding the step's dispatch until the device gets there).
    Nothing here branches on the host: the rare draw among tied logits is resolved inside
    the program. Rows whose maximum is not finite give an unspecified token (the caller
    takes the argmax there)."""
    R, V = scaled.shape
    J = u.shape[1]
    default_block, default_warps = tuning.sample_block_and_warps(R)
    block = default_block if block is None else block
    num_warps = default_warps if num_warps is None else num_warps
    tuning.check_pow2("block", block)
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"bits: expected 1, 2, 4 or 8, got {bits!r}")
    if int(prefetch) not in (0, 1, 2, 4, 8):
        raise ValueError(f"prefetch: expected 0, 1, 2, 4 or 8 chunks ahead, got {prefetch!r}")
    full = lambda shape: pl.BlockSpec(shape, lambda r: (0,) * len(shape))  # noqa: E731
    row = lambda n: pl.BlockSpec((None, n), lambda r: (r, 0))  # noqa: E731
    if active is None:
        active = jnp.ones(R, bool)
    (token,) = pl.pallas_call(
        functools.partial(
            _kernel, vocab=V, block=block, bits=bits, columns=J, prefetch=int(prefetch)
        ),
        grid=(R,),
        in_specs=[row(V), full((R,)), full((R,)), full((R,)), full((R,)), row(J)],
        out_specs=[row(J)],
        out_shape=[jax.ShapeDtypeStruct((R, J), jnp.int32)],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="restricted_draw",
    )(
        scaled.astype(jnp.float32),
        active.astype(jnp.int32),
        top_k.astype(jnp.int32),
        top_p.astype(jnp.float32),
        min_p.astype(jnp.float32),
        u.astype(jnp.float32),
    )
    return token


# -- The same search with each row split over several programs --------------------------
#
# ``restricted_draw`` runs about 20 dependent passes over its row inside one program (36
# when the draw took a second search), and at 64 rows (the row in L2) a pass took about
# 59 us on an H200: latency, not bandwidth.
# Here each radix round is one launch over a grid of (row, slice of the row) programs,
# each summing its slice against the round's trial keys; XLA adds the slices' partials
# and decides the digit (``paged_jax.engine.sort_free.draw`` with ``counts=``), so every
# pass has the whole GPU. Rounds are launched one after another from the traced program:
# nothing reads a predicate back to the host.

SPLIT_LOGITS = 16384  # logits of a row per program of ``trial_counts``
SPLIT_LANES = 32  # trial keys x logits per thread and chunk: a chunk's accumulators


def _counts_kernel(x_ref, m_ref, t_ref, n_ref, w_ref, *, vocab, block, chunks):
    r, s = pl.program_id(0), pl.program_id(1)
    t = t_ref[...]  # i32[T]
    m = m_ref[r]
    lane = jnp.arange(block, dtype=jnp.int32)

    def body(c, carry):
        n, w = carry
        idx = (s * chunks + c) * block + lane
        valid = idx < vocab
        x = plgpu.load(x_ref.at[pl.ds((s * chunks + c) * block, block)], mask=valid, other=0.0)
        gt = valid[:, None] & (sortable(x)[:, None] > t[None, :])  # [block, T]
        weight = jnp.where(valid, jnp.exp(x - m), 0.0)
        return n + gt.astype(jnp.int32), w + jnp.where(gt, weight[:, None], 0.0)

    zeros = (jnp.zeros((block, t.shape[0]), jnp.int32), jnp.zeros((block, t.shape[0]), jnp.float32))
    n, w = jax.lax.fori_loop(0, chunks, body, zeros)
    n_ref[...] = jnp.sum(n, axis=0)
    w_ref[...] = jnp.sum(w, axis=0)


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps", "split"))
def trial_counts(
    scaled: jax.Array,  # f32[R, V]
    m: jax.Array,  # f32[R] each row's largest value (weights exp(x - m))
    trials: jax.Array,  # i32[R, T] trial keys (``sortable``'s)
    *,
    interpret: bool = False,
    num_warps: int = 4,
    split: int = SPLIT_LOGITS,
) -> tuple[jax.Array, jax.Array]:  # i32[R, T], f32[R, T]
    """For each row and trial key: how many of the row's keys lie above it and their
    weights' sum, ``exp(x - m)`` (a logit past the row, or -inf, weighs 0 and is never
    above). The row is cut into slices of about ``split`` logits, one program per row
    and slice, whose partial sums are added here in slice order. Runs under
    ``interpret=True`` on CPU and lowers through Triton on GPU."""
    R, V = scaled.shape
    T0 = trials.shape[1]
    T = 1 << max(0, (T0 - 1).bit_length())  # a power of two (Triton's shapes); the padding
    trials = jnp.pad(trials.astype(jnp.int32), ((0, 0), (0, T - T0)), constant_values=_I32_MAX)
    threads = 32 * num_warps
    block = max(16, threads * max(1, SPLIT_LANES // T))  # logits a chunk
    block = min(block, 1 << max(4, (V - 1).bit_length()))
    chunks_all = pl.cdiv(V, block)
    slices = max(1, min(chunks_all, pl.cdiv(V, split)))
    chunks = pl.cdiv(chunks_all, slices)
    slices = pl.cdiv(chunks_all, chunks)
    full = lambda shape: pl.BlockSpec(shape, lambda r, s: (0,) * len(shape))  # noqa: E731
    n, w = pl.pallas_call(
        functools.partial(_counts_kernel, vocab=V, block=block, chunks=chunks),
        grid=(R, slices),
        in_specs=[
            pl.BlockSpec((None, V), lambda r, s: (r, 0)),
            full((R,)),
            pl.BlockSpec((None, T), lambda r, s: (r, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, T), lambda r, s: (r, s, 0)),
            pl.BlockSpec((None, None, T), lambda r, s: (r, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((R, slices, T), jnp.int32),
            jax.ShapeDtypeStruct((R, slices, T), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name="trial_counts",
    )(scaled.astype(jnp.float32), m.astype(jnp.float32), trials.astype(jnp.int32))
    return jnp.sum(n, axis=1)[:, :T0], jnp.sum(w, axis=1)[:, :T0]  # (the padding: nothing above)


def _nth_kernel(x_ref, t_ref, j_ref, first_ref, token_ref, *, vocab, block, bits, columns):
    for col in range(columns):
        t, rank = t_ref[col], j_ref[col]
        token_ref[col] = first_ref[col]

        @pl.when(rank > 0)
        def _(t=t, rank=rank, col=col):
            index = _nth_index(x_ref, t, rank, vocab=vocab, block=block, bits=bits)
            token_ref[col] = jnp.minimum(index, vocab - 1)


@functools.partial(jax.jit, static_argnames=("interpret", "block"))
def nth_tied(
    scaled: jax.Array,  # f32[R, V]
    t: jax.Array,  # i32[R, J] a key of each row and column
    j: jax.Array,  # i32[R, J] a rank, from 0
    first: jax.Array,  # i32[R, J] the first index of key t (what rank 0 gives)
    *,
    interpret: bool = False,
    block: int = 1024,
) -> jax.Array:  # i32[R, J]
    """The index of the ``j``-th (from 0) of a row's tokens whose key is ``t``, in index
    order; ``first`` where ``j`` is 0 (nearly always: only a cut of the kept set through
    several exactly equal logits asks more), else a radix search over the indices inside
    the row's program. A branch in the program, not on the host."""
    R, V = scaled.shape
    J = t.shape[1]
    block = min(block, 1 << max(4, (V - 1).bit_length()))
    row = lambda n: pl.BlockSpec((None, n), lambda r: (r, 0))  # noqa: E731
    (token,) = pl.pallas_call(
        functools.partial(_nth_kernel, vocab=V, block=block, bits=2, columns=J),
        grid=(R,),
        in_specs=[row(V), row(J), row(J), row(J)],
        out_specs=[row(J)],
        out_shape=[jax.ShapeDtypeStruct((R, J), jnp.int32)],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        name="nth_tied",
    )(scaled.astype(jnp.float32), t.astype(jnp.int32), j.astype(jnp.int32), first.astype(jnp.int32))
    return token
