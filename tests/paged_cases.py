"""Builders of random paged-attention inputs and the f64 dense oracle they are checked with.

The oracle never sees a page: each sequence's K/V are drawn as contiguous arrays, dense
causal attention is computed on them in f64 (numpy), and only then are they scattered
into a randomly permuted pool. Every page no sequence may read (unused pages, page 0,
table columns past a sequence's length, padding rows) is filled with NaN, so any output
that touches one fails the comparison.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import _quant

# One tolerance table for the whole suite (house rule 6). The primary rule for fast paths
# is relative to the reference's own error (see assert_close_to_oracle); these absolute
# bounds check the reference itself against the f64 oracle.
TOLERANCE = {
    jnp.dtype(jnp.float32): 2e-5,
    jnp.dtype(jnp.float16): 4e-3,
    jnp.dtype(jnp.bfloat16): 3e-2,
}


@dataclasses.dataclass
class Case:
    q: jnp.ndarray  # [T, H, D]
    kv_pages: jnp.ndarray  # [N, P, 2K, D]
    kv_lens: jnp.ndarray  # i32[S]
    page_indices: jnp.ndarray  # i32[S, M]
    cu_q_lens: jnp.ndarray  # i32[S + 1]
    num_seqs: jnp.ndarray  # i32[1]
    k_scale: jnp.ndarray | None  # f32[N, P, K]
    v_scale: jnp.ndarray | None
    expected: np.ndarray  # f64[T, H, D]: dense oracle on the values actually stored
    k_seqs: list  # per sequence f64[kv_len, K, D] (dequantized stored values)
    v_seqs: list

    @property
    def args(self):
        return (
            self.q,
            self.kv_pages,
            self.kv_lens,
            self.page_indices,
            self.cu_q_lens,
            self.num_seqs,
        )


def dense_attention(q, k, v, q_pos, *, sm_scale, sliding_window=None, soft_cap=None):
    """f64 dense causal attention. q: [Q, H, D], k/v: [C, K, D], q_pos: [Q] -> [Q, H, D]."""
    q = np.asarray(q, np.float64)
    num_q, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    k_h = np.repeat(k, group, axis=1)  # [C, H, D]
    v_h = np.repeat(v, group, axis=1)
    s = np.einsum("qhd,chd->hqc", q, k_h) * sm_scale
    if soft_cap is not None:
        s = soft_cap * np.tanh(s / soft_cap)
    k_pos = np.arange(k.shape[0])
    mask = k_pos[None, :] <= np.asarray(q_pos)[:, None]
    if sliding_window is not None:
        mask &= np.asarray(q_pos)[:, None] - k_pos[None, :] < sliding_window
    s = np.where(mask[None], s, -np.inf)
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqc,chd->qhd", p, v_h)


def make_case(
    seed: int,
    seqs: list[tuple[int, int]],  # (q_len, kv_len) per live sequence
    *,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    page_size: int = 8,
    dtype=jnp.float32,
    q_dtype=None,
    pad_seqs: int = 1,
    pad_tokens: int = 3,
    extra_pages: int = 3,
    table_width: int | None = None,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> Case:
    """A ragged batch of ``seqs`` plus ``pad_seqs`` padding rows and ``pad_tokens`` padding
    tokens, with pages randomly permuted in a NaN-filled pool."""
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(dtype)
    q_dtype = jnp.dtype(q_dtype or (jnp.float32 if _quant.is_quantized_dtype(dtype) else dtype))
    quantized = _quant.is_quantized_dtype(dtype)
    sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
    pages_needed = [-(-kv // page_size) for _, kv in seqs]
    width = table_width or max([1, *pages_needed])
    num_pages = 1 + sum(pages_needed) + extra_pages
    combined = 2 * num_kv_heads

    store_dtype = dtype if not quantized else np.dtype(np.float32)
    if quantized:
        kv_pages = np.zeros((num_pages, page_size, combined, head_dim), dtype)
        scales = np.full((num_pages, page_size, combined), np.nan, np.float32)
    else:
        kv_pages = np.full((num_pages, page_size, combined, head_dim), np.nan, store_dtype)
        scales = None

    free = list(rng.permutation(np.arange(1, num_pages)))
    table = np.zeros((len(seqs) + pad_seqs, width), np.int32)
    # Padding rows and unused columns point at unused (NaN) pages or at page 0.
    unused = free[sum(pages_needed) :] + [0]
    table[:] = rng.choice(unused, size=table.shape)
    total_q = sum(ql for ql, _ in seqs)
    q = rng.standard_normal((total_q + pad_tokens, num_q_heads, head_dim))
    q = np.asarray(jnp.asarray(q, q_dtype).astype(jnp.float32), np.float64)
    q[total_q:] = np.nan
    expected = np.zeros(q.shape)
    k_seqs, v_seqs = [], []
    start = 0
    for i, (q_len, kv_len) in enumerate(seqs):
        pages = [free.pop() for _ in range(pages_needed[i])]
        table[i, : len(pages)] = pages
        k = rng.standard_normal((kv_len, num_kv_heads, head_dim))
        v = rng.standard_normal((kv_len, num_kv_heads, head_dim))
        kv = np.stack([k, v], axis=2).reshape(kv_len, combined, head_dim)
        if quantized:
            stored, s = _quant.quantize_rows(jnp.asarray(kv, jnp.float32), dtype)
            stored, s = np.asarray(stored), np.asarray(s)
            deq = _quant.numpy_dequantize(stored, s)
        else:
            stored = np.asarray(jnp.asarray(kv, dtype))
            deq = np.asarray(stored.astype(np.float32), np.float64)
        for t in range(kv_len):
            page, off = pages[t // page_size], t % page_size
            kv_pages[page, off] = stored[t]
            if quantized:
                scales[page, off] = s[t]
        k_deq, v_deq = deq[:, 0::2], deq[:, 1::2]
        k_seqs.append(k_deq)
        v_seqs.append(v_deq)
        if q_len:
            q_pos = np.arange(kv_len - q_len, kv_len)
            expected[start : start + q_len] = dense_attention(
                q[start : start + q_len],
                k_deq,
                v_deq,
                q_pos,
                sm_scale=sm_scale,
                sliding_window=sliding_window,
                soft_cap=soft_cap,
            )
        start += q_len
    q_lens = [ql for ql, _ in seqs] + [0] * pad_seqs
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    # Padding rows' cu entries stay at the end of live tokens; kv_lens of padding rows are
    # garbage-but-legal values so a kernel that reads them would show it.
    kv_lens = np.array([kv for _, kv in seqs] + [width * page_size] * pad_seqs, np.int32)
    k_scale = v_scale = None
    if quantized:
        k_scale = jnp.asarray(scales[..., 0::2])
        v_scale = jnp.asarray(scales[..., 1::2])
    return Case(
        q=jnp.asarray(q, q_dtype),
        kv_pages=jnp.asarray(kv_pages),
        kv_lens=jnp.asarray(kv_lens),
        page_indices=jnp.asarray(table),
        cu_q_lens=jnp.asarray(cu),
        num_seqs=jnp.array([len(seqs)], jnp.int32),
        k_scale=k_scale,
        v_scale=v_scale,
        expected=expected,
        k_seqs=k_seqs,
        v_seqs=v_seqs,
    )


# Whether the CPU backend's C kernel can be built here (it needs a compiler).
HAS_CC = bool(os.environ.get("CC")) or any(map(shutil.which, ("cc", "gcc", "clang")))


def kernel_case(seed: int, seqs, page: int, heads: tuple[int, int], head_dim: int, dtype, **kw):
    """``make_case`` as the kernels' grids spell it: ``heads = (H, K)``, ``dtype`` a name
    or dtype; ``kw`` (padding, sliding window, soft cap) goes to ``make_case``."""
    return make_case(
        seed,
        seqs,
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        page_size=page,
        dtype=jnp.dtype(dtype),
        **kw,
    )


def max_err(actual, expected, num_tokens: int | None = None) -> float:
    a = np.asarray(jnp.asarray(actual).astype(jnp.float32), np.float64)
    if num_tokens is not None:
        a, expected = a[:num_tokens], expected[:num_tokens]
    return float(np.max(np.abs(a - expected), initial=0.0))


def assert_close_to_oracle(actual, reference, expected, *, what: str = "output") -> None:
    """The suite's accuracy rule for fast paths: error vs the f64 oracle is at most twice
    the error of the plain-jnp reference on the same inputs, plus 1e-5. NaN fails."""
    a = np.asarray(jnp.asarray(actual).astype(jnp.float32))
    assert np.isfinite(a).all(), f"{what}: {np.count_nonzero(~np.isfinite(a))} non-finite values"
    err = max_err(actual, expected)
    ref_err = max_err(reference, expected)
    assert err <= 2 * ref_err + 1e-5, (
        f"{what}: max error vs f64 oracle {err:.3g} > 2 * reference error {ref_err:.3g} + 1e-5"
    )


def assert_reference_close(actual, expected, dtype) -> None:
    a = np.asarray(jnp.asarray(actual).astype(jnp.float32))
    assert np.isfinite(a).all(), f"{np.count_nonzero(~np.isfinite(a))} non-finite values"
    tol = TOLERANCE[jnp.dtype(dtype)]
    err = max_err(actual, expected)
    assert err <= tol, f"max error vs f64 oracle {err:.3g} > tolerance {tol:g} for {dtype}"


def grid_case(*values, id: str, by_default: bool):
    """One case of a parametrized grid: in the default suite when ``by_default``, else
    behind ``-m slow`` (the default runs a covering part; .ci/run runs the whole grid)."""
    return pytest.param(*values, id=id, marks=() if by_default else pytest.mark.slow)


def covering_sample(full: list[tuple], num: int, seed: int) -> list[tuple]:
    """A seeded sample of ``num`` cases from ``full`` (tuples of axis values) that covers
    as many axis values as it can: each pick is the case adding the most values not yet
    seen (ties in a seeded random order), so with ``num`` >= the longest axis every
    dtype, option and size appears. Keeps default grids small without dropping one."""
    import random

    pool = list(full)
    random.Random(seed).shuffle(pool)
    seen: set[tuple[int, str]] = set()
    picked: list[tuple] = []
    for _ in range(min(num, len(pool))):
        best = max(pool, key=lambda c: len({(i, repr(v)) for i, v in enumerate(c)} - seen))
        pool.remove(best)
        picked.append(best)
        seen |= {(i, repr(v)) for i, v in enumerate(best)}
    return picked
