"""Turns one step's scheduled sequences into the fixed-shape int32 arrays of a jitted step.

Pure numpy (no JAX). Every array is padded to a power-of-two bucket so a steady decode
loop compiles once per bucket; padding rows point at the null page 0, padding tokens
write to slot 0 (on the null page), padding copies copy page 0 onto itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import NamedTuple

import numpy as np

from paged_jax.block_manager import BlockManager, SeqRows


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(int(n), int(minimum), 1)
    return 1 << (n - 1).bit_length()


class ScheduledSeq(NamedTuple):  # a tuple: built for every sequence of every step
    """This step computes tokens ``[start, stop)`` of ``seq_id``; it attends to ``[0, stop)``.

    A decode token is ``(n - 1, n)``; a prefill chunk ``(computed, computed + chunk)``.
    """

    seq_id: Hashable
    start: int
    stop: int


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """Inputs of one jitted step. Shapes: S_b sequence rows, M_b pages per row, T_b tokens,
    C_b copies (all powers of two)."""

    token_ids: np.ndarray  # i32[T_b]   input token of each row of q (0 for padding)
    positions: np.ndarray  # i32[T_b]   absolute position of each token (0 for padding)
    # With a HybridBlockManager (G layer groups) these two gain a leading [G] axis.
    slot_mapping: np.ndarray  # i32[T_b] where each token's K/V is written (0 for padding)
    page_indices: np.ndarray  # i32[S_b, M_b] block tables (0 for padding)
    kv_lens: np.ndarray  # i32[S_b]     tokens each sequence attends to (0 for padding)
    cu_q_lens: np.ndarray  # i32[S_b + 1] cumulative new-token counts
    num_seqs: np.ndarray  # i32[1]
    logits_indices: np.ndarray  # i32[S_b] row of each sequence's last new token (0 for pad)
    copy_src: np.ndarray  # i32[C_b] copy-on-write sources (0 for padding)
    copy_dst: np.ndarray  # i32[C_b] copy-on-write destinations (0 for padding)
    seq_ids: tuple  # the scheduled seq_ids, in row order
    num_tokens: int  # live tokens (<= T_b)


# The copy-on-write copies a step holds at least (``C_b``'s smallest bucket): a step with
# more pads to the next power of two.
MIN_COPIES = 8


def build_batch(
    manager: BlockManager,
    scheduled: Sequence[ScheduledSeq],
    *,
    min_tokens: int = 16,
    min_seqs: int = 8,
    min_pages: int = 4,
    min_copies: int = MIN_COPIES,
    take_copies: bool = True,
    table_tokens: Sequence[int] | None = None,
) -> StepBatch:
    """Builds the step's arrays from the manager's block tables and token ids.

    Bucketed shapes: ``T_b = bucket(total new tokens, min_tokens)``, ``S_b = bucket(len(
    scheduled), min_seqs)``, ``M_b = bucket(max pages any scheduled sequence reads,
    min_pages)``, ``C_b = bucket(pending copies, min_copies)``. With ``take_copies`` the
    manager's pending copy-on-write copies are taken (and cleared) into the batch.
    A ``HybridBlockManager`` gives ``page_indices`` ``[G, S_b, M_b]`` and ``slot_mapping``
    ``[G, T_b]``, one of each per layer group. ``table_tokens``: tokens each row's block
    table covers (default, and at least, its ``stop``); more for a launch that decodes
    several tokens of each row (the engine's multi-step decoding, ``decode_loop``).
    """
    P = manager.page_size
    G = getattr(manager, "num_groups", None)  # None: a plain BlockManager
    num_seqs = len(scheduled)
    if G is None:  # the hot path: the sequences' rows of the manager's arrays
        seq_rows = manager.rows  # (the manager's SequenceRows part)
        rows = seq_rows.device_rows([s.seq_id for s in scheduled], "build_batch")
        lens = seq_rows.ntok[rows].tolist()
    else:
        rows = None
        lens = [manager.num_tokens(s.seq_id) for s in scheduled]
    starts = [s.start for s in scheduled]
    stops = [s.stop for s in scheduled]
    for i, (a, b, n) in enumerate(zip(starts, stops, lens, strict=True)):
        if not 0 <= a < b <= n:
            raise ValueError(
                f"scheduled[{i}]: expected 0 <= start < stop <= num_tokens={n} for seq_id "
                f"{scheduled[i].seq_id!r}, got start={a}, stop={b}"
            )
    reach = stops
    if table_tokens is not None:
        if len(table_tokens) != num_seqs:
            raise ValueError(
                f"table_tokens: expected one per scheduled sequence ({num_seqs}), got "
                f"{len(table_tokens)}"
            )
        reach = [max(b, int(r)) for b, r in zip(stops, table_tokens, strict=True)]
        for i, (r, n) in enumerate(zip(reach, lens, strict=True)):
            if r > n:
                raise ValueError(
                    f"table_tokens[{i}]: expected <= num_tokens={n} for seq_id "
                    f"{scheduled[i].seq_id!r}, got {r}"
                )
    q_lens = np.subtract(stops, starts, dtype=np.int64) if num_seqs else np.zeros(0, np.int64)
    num_tokens = int(q_lens.sum())
    T_b = bucket(num_tokens, min_tokens)
    S_b = bucket(num_seqs, min_seqs)
    M_b = bucket(-(-max(reach) // P) if num_seqs else 1, min_pages)

    grouped = () if G is None else (G,)
    page_indices = np.zeros((*grouped, S_b, M_b), np.int32)
    token_ids = np.zeros(T_b, np.int32)
    positions = np.zeros(T_b, np.int32)
    slot_mapping = np.zeros((*grouped, T_b), np.int32)
    cu = np.zeros(S_b + 1, np.int32)
    cu[1 : num_seqs + 1] = np.cumsum(q_lens)
    cu[num_seqs + 1 :] = num_tokens
    kv_lens = np.zeros(S_b, np.int32)
    kv_lens[:num_seqs] = stops
    logits_indices = np.zeros(S_b, np.int32)
    logits_indices[:num_seqs] = cu[1 : num_seqs + 1] - 1

    if G is None and num_tokens == num_seqs:  # decode only: one token a row, no per-row arrays
        if num_seqs:
            _gather_tables(manager, rows, reach, page_indices)
            pos = np.asarray(starts, np.int64)
            positions[:num_seqs] = pos
            token_ids[:num_seqs] = manager.rows.tok[rows, pos]
            slot_mapping[:num_seqs] = page_indices[np.arange(num_seqs), pos // P] * P + pos % P
    elif num_seqs:  # whole arrays at once: per row only its table and tokens are read
        tables, toks = [], []
        used = [-(-r // P) for r in reach]
        for i, s in enumerate(scheduled):
            if G is None:
                pages, buf = manager.rows.table[rows[i]], manager.rows.tok[rows[i]]
            else:
                pages = manager.pages_np(s.seq_id)  # [G, pages]
                buf = manager.token_buffer(s.seq_id)
            tables.append(pages[..., : used[i]])
            toks.append(buf[s.start : s.stop])
        within = np.arange(M_b) < np.array(used)[:, None]  # [S, M_b]: the tables' entries
        page_indices[..., :num_seqs, :][..., within] = np.concatenate(tables, axis=-1)
        row = np.repeat(np.arange(num_seqs), q_lens)  # each token's row
        pos = np.asarray(starts, np.int32)[row] + (np.arange(num_tokens) - cu[row])
        positions[:num_tokens] = pos
        token_ids[:num_tokens] = np.concatenate(toks)
        slot_mapping[..., :num_tokens] = page_indices[..., row, pos // P] * P + pos % P

    if take_copies:
        copy_src, copy_dst = _copies(manager, min_copies)
    else:
        copy_src = copy_dst = np.zeros(bucket(0, min_copies), np.int32)
    return StepBatch(
        token_ids=token_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        page_indices=page_indices,
        kv_lens=kv_lens,
        cu_q_lens=cu,
        num_seqs=np.array([num_seqs], np.int32),
        logits_indices=logits_indices,
        copy_src=copy_src,
        copy_dst=copy_dst,
        seq_ids=tuple(s.seq_id for s in scheduled),
        num_tokens=num_tokens,
    )


def _gather_tables(manager: BlockManager, rows, reach, page_indices: np.ndarray) -> None:
    """Writes into ``page_indices[:S]`` (``i32[S_b, M_b]``, zeros) the block tables of the
    S sequences at ``rows`` of ``manager.tables()``, each up to the page of its token
    ``reach[i] - 1`` (``reach``: ``int[S]``, within the sequence's tokens), by one gather."""
    P = manager.page_size
    table = manager.tables()
    S = len(rows)
    used = -(-np.asarray(reach, np.int64) // P)  # [S] entries each row reads
    cols = min(page_indices.shape[-1], table.shape[1])
    got = table[rows, :cols]
    page_indices[:S, :cols] = np.where(np.arange(cols) < used[:, None], got, 0)


def _copies(manager: BlockManager, min_copies: int) -> tuple[np.ndarray, np.ndarray]:
    """The manager's pending copy-on-write copies, taken (a step boundary), as
    ``(copy_src, copy_dst)``, each ``i32[C_b]`` (padding copies page 0 onto itself)."""
    src, dst = manager.take_copies()
    C_b = bucket(len(src), min_copies)
    copy_src = np.zeros(C_b, np.int32)
    copy_dst = np.zeros(C_b, np.int32)
    copy_src[: len(src)] = src
    copy_dst[: len(dst)] = dst
    return copy_src, copy_dst


def advance_batch(
    manager: BlockManager,
    prev: StepBatch,
    rows: np.ndarray,
    advance: np.ndarray,
    table_tokens: np.ndarray,
    *,
    min_tokens: int = 16,
    min_seqs: int = 8,
    min_pages: int = 4,
    min_copies: int = MIN_COPIES,
    seqs: SeqRows | None = None,
) -> StepBatch:
    """The decode batch that goes on from decode batch ``prev`` (one token a row) without
    scheduling again: the engine's next multi-step launch, built while the one before
    runs.

    Row i decodes the token at ``prev.positions[rows[i]] + advance[i]`` of the sequence
    of ``prev``'s row ``rows[i]`` (``rows``, ``advance``: ``int[S]``), its block table
    covering ``table_tokens[i]`` tokens (``int[S]``, at most the sequence's tokens);
    token ids are 0 (the caller puts the tokens there). The same arrays as
    ``build_batch`` of those rows with these ``table_tokens`` (and the same buckets);
    the tables come from the manager's ``tables()`` in one gather. The manager's pending
    copies are taken. A plain ``BlockManager`` only. ``seqs``: those rows' sequences
    from the manager's ``seq_rows`` (checked, not looked up again), or None.
    """
    P = manager.page_size
    rows = np.asarray(rows, np.int64)
    num_seqs = len(rows)
    ids = [prev.seq_ids[r] for r in rows.tolist()] if seqs is None else seqs.ids
    if len(ids) != num_seqs:
        raise ValueError(f"seqs: expected one per row ({num_seqs}), got {len(ids)}")
    start = prev.positions[rows].astype(np.int64) + advance
    reach = np.maximum(np.asarray(table_tokens, np.int64), start + 1)
    table_rows = manager.rows.device_rows(ids if seqs is None else seqs, "advance_batch")
    lengths = manager.rows.ntok[table_rows]
    over = np.flatnonzero(reach > lengths)
    if len(over):
        i = int(over[0])
        raise ValueError(
            f"table_tokens[{i}]: expected <= num_tokens={lengths[i]} for seq_id "
            f"{ids[i]!r}, got {int(reach[i])}"
        )
    T_b = bucket(num_seqs, min_tokens)
    S_b = bucket(num_seqs, min_seqs)
    M_b = bucket(-(-int(reach.max()) // P) if num_seqs else 1, min_pages)
    page_indices = np.zeros((S_b, M_b), np.int32)
    if num_seqs:
        _gather_tables(manager, table_rows, reach, page_indices)
    token_ids = np.zeros(T_b, np.int32)
    positions = np.zeros(T_b, np.int32)
    positions[:num_seqs] = start
    slot_mapping = np.zeros(T_b, np.int32)
    if num_seqs:
        slot_mapping[:num_seqs] = page_indices[np.arange(num_seqs), start // P] * P + start % P
    cu = np.zeros(S_b + 1, np.int32)
    cu[1 : num_seqs + 1] = np.arange(1, num_seqs + 1)
    cu[num_seqs + 1 :] = num_seqs
    kv_lens = np.zeros(S_b, np.int32)
    kv_lens[:num_seqs] = start + 1
    logits_indices = np.zeros(S_b, np.int32)
    logits_indices[:num_seqs] = np.arange(num_seqs)
    copy_src, copy_dst = _copies(manager, min_copies)
    return StepBatch(
        token_ids=token_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        page_indices=page_indices,
        kv_lens=kv_lens,
        cu_q_lens=cu,
        num_seqs=np.array([num_seqs], np.int32),
        logits_indices=logits_indices,
        copy_src=copy_src,
        copy_dst=copy_dst,
        seq_ids=tuple(ids),
        num_tokens=num_seqs,
    )


def concat_batches(batches: Sequence[StepBatch]) -> StepBatch:
    """One step's batch for data-parallel replicas: each replica's batch padded to the
    largest ``T_b``, ``S_b``, ``M_b`` and ``C_b`` among them, then concatenated, so that
    replica r owns token rows ``[r T_b, (r + 1) T_b)``, sequence rows
    ``[r S_b, (r + 1) S_b)`` (``cu_q_lens``: ``r (S_b + 1)`` on, local to its tokens),
    copies ``[r C_b, (r + 1) C_b)`` and ``num_seqs[r]``. Page ids and slots stay local to
    each replica's pool; ``logits_indices`` become global token rows (``r T_b`` added).
    ``seq_ids`` lists the replicas' live sequences one replica after the other. One
    batch is returned as it is."""
    if len(batches) == 1:
        return batches[0]
    T_b = max(b.token_ids.shape[0] for b in batches)
    S_b = max(b.kv_lens.shape[0] for b in batches)
    M_b = max(b.page_indices.shape[1] for b in batches)
    C_b = max(b.copy_src.shape[0] for b in batches)

    def pad(a: np.ndarray, n: int, value=0) -> np.ndarray:
        return np.pad(a, (0, n - a.shape[0]), constant_values=value)

    parts: dict[str, list[np.ndarray]] = {k: [] for k in _ARRAYS}
    for r, b in enumerate(batches):
        parts["token_ids"].append(pad(b.token_ids, T_b))
        parts["positions"].append(pad(b.positions, T_b))
        parts["slot_mapping"].append(pad(b.slot_mapping, T_b))
        s, m = b.page_indices.shape
        parts["page_indices"].append(np.pad(b.page_indices, ((0, S_b - s), (0, M_b - m))))
        parts["kv_lens"].append(pad(b.kv_lens, S_b))
        parts["cu_q_lens"].append(pad(b.cu_q_lens, S_b + 1, b.cu_q_lens[-1]))
        parts["num_seqs"].append(b.num_seqs)
        parts["logits_indices"].append(pad(b.logits_indices, S_b) + np.int32(r * T_b))
        parts["copy_src"].append(pad(b.copy_src, C_b))
        parts["copy_dst"].append(pad(b.copy_dst, C_b))
    return StepBatch(
        **{k: np.concatenate(v).astype(np.int32) for k, v in parts.items()},
        seq_ids=tuple(sid for b in batches for sid in b.seq_ids),
        num_tokens=sum(b.num_tokens for b in batches),
    )


_ARRAYS = (
    "token_ids",
    "positions",
    "slot_mapping",
    "page_indices",
    "kv_lens",
    "cu_q_lens",
    "num_seqs",
    "logits_indices",
    "copy_src",
    "copy_dst",
)


def null_batch(
    num_tokens: int,
    num_seqs: int,
    pages_per_seq: int,
    *,
    decode_only: bool,
    num_copies: int = 8,
    num_groups: int | None = None,
) -> StepBatch:
    """A step of exactly ``T = num_tokens`` tokens, ``S = num_seqs`` rows, ``M =
    pages_per_seq`` pages per row and ``num_copies`` copies that reads and writes only the
    null page 0: what compiling a step shape ahead of use runs (``LLM.warm_up``).
    ``decode_only``: every row one token (``T == S`` needed), else one row of two tokens.
    ``num_groups``: a ``HybridBlockManager``'s layer groups (tables ``[G, S, M]``)."""
    if decode_only and num_tokens != num_seqs:
        raise ValueError(
            f"num_tokens: a decode-only step has one token a row, expected {num_seqs}, "
            f"got {num_tokens}"
        )
    if num_tokens < 2 and not decode_only:
        raise ValueError(f"num_tokens: expected >= 2 for a prefill step, got {num_tokens}")
    q_lens = [1] * num_seqs if decode_only else [2]
    live = sum(q_lens)
    grouped = () if num_groups is None else (num_groups,)
    cu = np.zeros(num_seqs + 1, np.int32)
    cu[1 : len(q_lens) + 1] = np.cumsum(q_lens)
    cu[len(q_lens) + 1 :] = live
    kv_lens = np.zeros(num_seqs, np.int32)
    kv_lens[: len(q_lens)] = q_lens
    positions = np.zeros(num_tokens, np.int32)
    if not decode_only:
        positions[:2] = (0, 1)
    logits_indices = np.zeros(num_seqs, np.int32)
    logits_indices[: len(q_lens)] = cu[1 : len(q_lens) + 1] - 1
    return StepBatch(
        token_ids=np.zeros(num_tokens, np.int32),
        positions=positions,
        slot_mapping=np.zeros((*grouped, num_tokens), np.int32),  # the null page's slot 0
        page_indices=np.zeros((*grouped, num_seqs, pages_per_seq), np.int32),
        kv_lens=kv_lens,
        cu_q_lens=cu,
        num_seqs=np.array([len(q_lens)], np.int32),
        logits_indices=logits_indices,
        copy_src=np.zeros(num_copies, np.int32),
        copy_dst=np.zeros(num_copies, np.int32),
        seq_ids=tuple(range(len(q_lens))),
        num_tokens=live,
    )
