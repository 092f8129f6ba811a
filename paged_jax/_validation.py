"""Input checks for the attention API, split in two as JAX's own paged ops do.

``static_check_*`` run at trace time on shapes and dtypes only, so they cost nothing in a
jitted step. ``validate_inputs`` / ``validate_decode_inputs`` look at the values (lengths, page ids,
cu_q_lens) and therefore run eagerly on the host, as does ``validate_batch`` (a whole
engine step); the engine calls it in checked mode, jitted code cannot.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from paged_jax import _quant


def _fmt_shape(x) -> str:
    return str(tuple(getattr(x, "shape", ())))


def _check_int32(name: str, x, ndim: int, shape_doc: str) -> None:
    if not hasattr(x, "dtype"):
        raise TypeError(f"{name}: expected an int32 array {shape_doc}, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{name}: expected rank {ndim} {shape_doc}, got shape {_fmt_shape(x)}")
    if jnp.dtype(x.dtype) != jnp.int32:
        raise TypeError(f"{name}: expected dtype int32, got {x.dtype}")


def _check_kv_pages_and_q(q, kv_pages, *, q_name: str, q_doc: str) -> tuple[int, int]:
    """Returns (num_kv_heads K, pages in pool N)."""
    if q.ndim != 3:
        raise ValueError(f"{q_name}: expected rank 3 {q_doc}, got shape {_fmt_shape(q)}")
    if not jnp.issubdtype(q.dtype, jnp.floating) or _quant.is_quantized_dtype(q.dtype):
        raise TypeError(f"{q_name}: expected float32, bfloat16 or float16, got {q.dtype}")
    if kv_pages.ndim != 4:
        raise ValueError(
            f"kv_pages: expected rank 4 [N, P, 2K, D], got shape {_fmt_shape(kv_pages)}"
        )
    kv_dtype = jnp.dtype(kv_pages.dtype)
    if kv_dtype not in _quant.FLOAT_KV_DTYPES + _quant.QUANT_DTYPES:
        raise TypeError(f"kv_pages: expected a float, int8 or float8 dtype, got {kv_pages.dtype}")
    num_pages, _, combined, head_dim = kv_pages.shape
    if num_pages < 1:  # ids outside the pool read the null page 0, which must exist
        raise ValueError(
            f"kv_pages: expected at least 1 page (page 0, the null page), got shape "
            f"{_fmt_shape(kv_pages)}"
        )
    if combined % 2:
        raise ValueError(f"kv_pages: dim 2 (2K, K and V interleaved) must be even, got {combined}")
    if q.shape[2] != head_dim:
        raise ValueError(
            f"{q_name}: head_dim {q.shape[2]} does not match kv_pages head_dim {head_dim}"
        )
    num_kv_heads = combined // 2
    if q.shape[1] % num_kv_heads:
        raise ValueError(
            f"{q_name}: num_q_heads ({q.shape[1]}) must be a multiple of num_kv_heads "
            f"({num_kv_heads})"
        )
    return num_kv_heads, num_pages


def _check_scales(kv_pages, k_scale, v_scale) -> None:
    num_pages, page_size, combined, _ = kv_pages.shape
    expected = (num_pages, page_size, combined // 2)
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None or isinstance(s, (int, float)):
            continue
        if not hasattr(s, "shape"):
            raise TypeError(f"{name}: expected a float or an f32{list(expected)} array, got {s!r}")
        if tuple(s.shape) not in ((), expected):
            raise ValueError(
                f"{name}: expected a scalar or shape {expected} [N, P, K], got {_fmt_shape(s)}"
            )
    if jnp.dtype(kv_pages.dtype) == jnp.int8 and (k_scale is None or v_scale is None):
        raise ValueError("k_scale, v_scale: required for an int8 kv_pages, got None")


def _check_options(sm_scale, sliding_window, soft_cap) -> None:
    if not isinstance(sm_scale, (int, float)) or isinstance(sm_scale, bool):
        raise TypeError(f"sm_scale: expected a Python float, got {type(sm_scale).__name__}")
    if not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale: expected a finite float, got {sm_scale!r}")
    if sliding_window is not None and (
        not isinstance(sliding_window, int)
        or isinstance(sliding_window, bool)
        or sliding_window < 1
    ):
        raise ValueError(f"sliding_window: expected None or an int >= 1, got {sliding_window!r}")
    if soft_cap is not None and (
        not isinstance(soft_cap, (int, float))
        or isinstance(soft_cap, bool)
        or not 0 < soft_cap < math.inf
    ):
        raise ValueError(f"soft_cap: expected None or a finite float > 0, got {soft_cap!r}")


def static_check_ragged(
    q,
    kv_pages,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale,
    sliding_window,
    soft_cap,
    k_scale,
    v_scale,
) -> None:
    """Trace-time checks of ``ragged_paged_attention``'s arguments."""
    _check_kv_pages_and_q(q, kv_pages, q_name="q", q_doc="[T, H, D]")
    _check_int32("kv_lens", kv_lens, 1, "[S]")
    _check_int32("page_indices", page_indices, 2, "[S, M]")
    _check_int32("cu_q_lens", cu_q_lens, 1, "[S + 1]")
    num_seqs_shape = tuple(getattr(num_seqs, "shape", ()))
    if not hasattr(num_seqs, "dtype") or num_seqs_shape not in ((), (1,)):
        raise ValueError(
            f"num_seqs: expected an int32 array of shape [1] or [], got {num_seqs!r}"
            if not hasattr(num_seqs, "dtype")
            else f"num_seqs: expected shape [1] or [], got {num_seqs_shape}"
        )
    if jnp.dtype(num_seqs.dtype) != jnp.int32:
        raise TypeError(f"num_seqs: expected dtype int32, got {num_seqs.dtype}")
    S = kv_lens.shape[0]
    if page_indices.shape[0] != S:
        raise ValueError(
            f"page_indices: expected {S} rows (one per kv_lens entry), got shape "
            f"{_fmt_shape(page_indices)}"
        )
    if cu_q_lens.shape[0] != S + 1:
        raise ValueError(
            f"cu_q_lens: expected shape [{S + 1}] (len(kv_lens) + 1), got {_fmt_shape(cu_q_lens)}"
        )
    _check_scales(kv_pages, k_scale, v_scale)
    _check_options(sm_scale, sliding_window, soft_cap)


def static_check_decode(
    q, kv_pages, kv_lens, page_indices, *, sm_scale, sliding_window, soft_cap, k_scale, v_scale
) -> None:
    """Trace-time checks of ``paged_attention``'s arguments."""
    _check_kv_pages_and_q(q, kv_pages, q_name="q", q_doc="[B, H, D]")
    _check_int32("kv_lens", kv_lens, 1, "[B]")
    _check_int32("page_indices", page_indices, 2, "[B, M]")
    B = q.shape[0]
    if kv_lens.shape[0] != B:
        raise ValueError(f"kv_lens: expected shape [{B}] (q's batch), got {_fmt_shape(kv_lens)}")
    if page_indices.shape[0] != B:
        raise ValueError(
            f"page_indices: expected {B} rows (q's batch), got shape {_fmt_shape(page_indices)}"
        )
    _check_scales(kv_pages, k_scale, v_scale)
    _check_options(sm_scale, sliding_window, soft_cap)


def validate_inputs(
    q,  # [T, H, D]
    kv_pages,  # [N, P, 2K, D]
    kv_lens,  # i32[S]
    page_indices,  # i32[S, M]
    cu_q_lens,  # i32[S + 1]
    num_seqs,  # i32[1] or int
    *,
    allow_null_page: bool = False,
) -> None:
    """Eager, host-side checks of the values jit cannot check; raises ``ValueError``.

    Checks, for the first ``num_seqs`` sequences: ``0 <= num_seqs <= S``; ``cu_q_lens``
    starts at 0, never decreases and ends within ``T``; each sequence's new tokens fit in
    its kv (``q_len <= kv_len``); ``kv_len <= M * P``; every page a sequence reads lies in
    ``[0, N)`` and, unless ``allow_null_page``, is not the null page 0.
    Call it on host (numpy or concrete jax) arrays, e.g. from an engine before a step.
    """
    static_check_ragged(
        q,
        kv_pages,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        sm_scale=1.0,
        sliding_window=None,
        soft_cap=None,
        k_scale=1.0,
        v_scale=1.0,
    )
    num_pages, page_size = kv_pages.shape[:2]
    _check_ragged_values(
        q.shape[0],
        num_pages,
        page_size,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        allow_null_page,
    )


def _check_ragged_values(
    T,
    num_pages,
    page_size,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    allow_null_page,
    sliding_window=None,
):
    """The value checks of ``validate_inputs`` for ``T`` tokens and a pool of
    ``num_pages`` pages of ``page_size`` tokens."""
    kv_lens = np.asarray(kv_lens)
    page_indices = np.asarray(page_indices)
    cu = np.asarray(cu_q_lens)
    n = int(np.asarray(num_seqs).reshape(-1)[0])
    S, M = page_indices.shape
    if not 0 <= n <= S:
        raise ValueError(f"num_seqs: expected 0 <= num_seqs <= {S}, got {n}")
    if cu[0] != 0:
        raise ValueError(f"cu_q_lens: expected cu_q_lens[0] == 0, got {cu[0]}")
    q_lens = np.diff(cu[: n + 1])
    if (q_lens < 0).any():
        i = int(np.argmax(q_lens < 0))
        raise ValueError(
            f"cu_q_lens: must not decrease, but cu_q_lens[{i + 1}]={cu[i + 1]} < "
            f"cu_q_lens[{i}]={cu[i]}"
        )
    if cu[n] > T:
        raise ValueError(f"cu_q_lens: cu_q_lens[num_seqs={n}]={cu[n]} exceeds q's {T} tokens")
    _check_sequences(
        kv_lens[:n], q_lens, page_indices, num_pages, page_size, allow_null_page, sliding_window
    )


def _check_sequences(
    kv_lens, q_lens, page_indices, num_pages, page_size, allow_null_page, sliding_window=None
):
    """Per live sequence i: ``0 <= q_len <= kv_len <= M * P`` and every page it reads in
    ``[0, N)`` (and not the null page unless allowed). Vectorized: one pass, then the
    first offender is named. With ``sliding_window`` W, pages wholly before the window of
    a sequence's first new token are not read (a hybrid pool drops them)."""
    n = len(kv_lens)
    M = page_indices.shape[1]
    kv_lens = kv_lens.astype(np.int64)
    if n and (kv_lens < 0).any():
        i = int(np.argmax(kv_lens < 0))
        raise ValueError(f"kv_lens: kv_lens[{i}]={kv_lens[i]} is negative")
    if n and (q_lens > kv_lens).any():
        i = int(np.argmax(q_lens > kv_lens))
        raise ValueError(
            f"kv_lens: sequence {i} has q_len={q_lens[i]} > kv_len={kv_lens[i]}; kv_lens must "
            "include the new tokens"
        )
    if n and (kv_lens > M * page_size).any():
        i = int(np.argmax(kv_lens > M * page_size))
        raise ValueError(
            f"kv_lens: kv_lens[{i}]={kv_lens[i]} exceeds the block table's capacity "
            f"M * P = {M} * {page_size} = {M * page_size}"
        )
    used = np.arange(M)[None, :] < -(-kv_lens[:, None] // page_size)  # [n, M] pages read
    if sliding_window is not None:
        first = (kv_lens - q_lens - sliding_window + 1) // page_size  # first page read
        used &= np.arange(M)[None, :] >= first[:, None]
    table = page_indices[:n]
    outside = used & ((table < 0) | (table >= num_pages))
    if outside.any():
        i, j = np.argwhere(outside)[0]
        raise ValueError(
            f"page_indices: sequence {i} reads page {table[i, j]}, outside [0, {num_pages})"
        )
    if not allow_null_page and (used & (table == 0)).any():
        i = int(np.argwhere(used & (table == 0))[0][0])
        raise ValueError(
            f"page_indices: sequence {i} reads the null page 0 within its kv_len={kv_lens[i]}"
        )


def validate_decode_inputs(
    q,  # [B, H, D]
    kv_pages,  # [N, P, 2K, D]
    kv_lens,  # i32[B]
    page_indices,  # i32[B, M]
    *,
    allow_null_page: bool = False,
) -> None:
    """``validate_inputs`` for ``paged_attention`` (decode): eager, raises ``ValueError``.

    Checks every row with ``kv_lens[b] > 0`` (rows of 0 are padding): ``kv_len <= M * P``
    and every page it reads in ``[0, N)`` and, unless ``allow_null_page``, not page 0;
    ``kv_lens`` must not be negative.
    """
    static_check_decode(
        q,
        kv_pages,
        kv_lens,
        page_indices,
        sm_scale=1.0,
        sliding_window=None,
        soft_cap=None,
        k_scale=1.0,
        v_scale=1.0,
    )
    num_pages, page_size = kv_pages.shape[:2]
    kv_lens = np.asarray(kv_lens)
    _check_sequences(
        kv_lens,
        np.minimum(kv_lens, 1),
        np.asarray(page_indices),
        num_pages,
        page_size,
        allow_null_page,
    )


def validate_batch(
    batch,
    *,
    num_pages: int,
    page_size: int,
    vocab_size: int,
    group_windows: tuple | None = None,
) -> None:
    """Eager checks of one engine step's ``StepBatch`` against a pool of ``num_pages``
    pages of ``page_size`` tokens; raises ``ValueError`` naming the array and the row.

    Beyond ``validate_inputs`` (lengths, ``cu_q_lens``, page ids): live tokens' ids lie in
    ``[0, vocab_size)``; their positions are ``kv_len - q_len ..  kv_len - 1`` of their
    sequence; each token's K/V slot is on the page its block table lists for its position
    (never the null page) and no slot is written twice; copy-on-write pages lie in
    ``[1, N)``. The engine runs it before every step in checked mode.

    A batch of a hybrid pool (``page_indices [G, S, M]``, ``slot_mapping [G, T]``) is
    checked group by group; ``group_windows`` gives each group's sliding window, before
    which its tables may hold the null page.
    """
    if np.ndim(batch.page_indices) == 3:
        G = batch.page_indices.shape[0]
        windows = (None,) * G if group_windows is None else tuple(group_windows)
        if len(windows) != G:
            raise ValueError(f"group_windows: expected {G} entries, got {len(windows)}")
        for g, w in enumerate(windows):
            part = dataclasses.replace(
                batch, page_indices=batch.page_indices[g], slot_mapping=batch.slot_mapping[g]
            )
            try:
                _validate_tables(part, num_pages, page_size, vocab_size, w)
            except ValueError as e:
                raise ValueError(f"layer group {g}: {e}") from None
        return
    _validate_tables(batch, num_pages, page_size, vocab_size, None)


def _validate_tables(batch, num_pages, page_size, vocab_size, window) -> None:
    """``validate_batch`` of one table set (``page_indices [S, M]``); a group with a
    sliding ``window`` may hold the null page before it."""
    n = int(batch.num_seqs[0])
    cu = batch.cu_q_lens
    _check_ragged_values(
        batch.token_ids.shape[0],
        num_pages,
        page_size,
        batch.kv_lens,
        batch.page_indices,
        cu,
        batch.num_seqs,
        allow_null_page=False,
        sliding_window=window,
    )
    live = int(cu[n])
    toks = batch.token_ids[:live]
    if live and (toks.min() < 0 or toks.max() >= vocab_size):
        t = int(np.argmax((toks < 0) | (toks >= vocab_size)))
        raise ValueError(f"token_ids: token_ids[{t}]={toks[t]} is outside [0, {vocab_size})")
    seq = np.repeat(np.arange(n), np.diff(cu[: n + 1]))  # [live] sequence of each token
    offset = np.arange(live) - cu[seq]
    q_len = (cu[1 : n + 1] - cu[:n])[seq]
    want = batch.kv_lens[seq] - q_len + offset
    pos = batch.positions[:live]
    if (pos != want).any():
        t = int(np.argmax(pos != want))
        raise ValueError(
            f"positions: token {t} (sequence {seq[t]}) is at position {pos[t]}, its kv_len "
            f"and q_len put it at {want[t]}"
        )
    slots = batch.slot_mapping[:live].astype(np.int64)
    page = batch.page_indices[seq, pos // page_size].astype(np.int64)
    want_slot = page * page_size + pos % page_size
    if (slots != want_slot).any():
        t = int(np.argmax(slots != want_slot))
        raise ValueError(
            f"slot_mapping: token {t} (sequence {seq[t]}, position {pos[t]}) writes slot "
            f"{slots[t]}, its block table says {want_slot[t]}"
        )
    uniq, counts = np.unique(slots, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"slot_mapping: slot {uniq[counts > 1][0]} is written twice")
    for name, ids in (("copy_src", batch.copy_src), ("copy_dst", batch.copy_dst)):
        real = ids[(batch.copy_src != 0) | (batch.copy_dst != 0)]  # (0, 0) pairs pad
        if real.size and (real.min() < 1 or real.max() >= num_pages):
            bad = real[(real < 1) | (real >= num_pages)][0]
            raise ValueError(f"{name}: page {bad} is outside [1, {num_pages})")
