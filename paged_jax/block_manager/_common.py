"""What every part of the block manager shares: its errors, the null page, token
arrays and ``SeqRows``. No JAX."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

import numpy as np

NULL_PAGE = 0  # never handed out; the device-side sink for padding (see paged_jax.cache)
_DROPPED_SLOT = -1  # a swapped-out table's entry for a page dropped outside the window


class BlockManagerError(Exception):
    """Base class of the block manager's errors."""


class OutOfPages(BlockManagerError):
    """Not enough free device (or host) pages; nothing was changed."""


class UnknownSequence(BlockManagerError, KeyError):
    """The seq_id was never allocated, or was already freed."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0])


class DuplicateSequence(BlockManagerError, ValueError):
    """A seq_id that is already live was given to allocate or fork."""


class InvalidSequenceState(BlockManagerError, ValueError):
    """The operation does not fit the sequence's state (e.g. appending while swapped out)."""


def _as_tokens(token_ids, name: str = "token_ids") -> np.ndarray:
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name}: expected integer token ids, got dtype {arr.dtype}")
    return arr.astype(np.int32, copy=False)


def _spans(rows: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> tuple:
    """Index arrays of the cells ``[rows[i], starts[i] : starts[i] + counts[i]]`` of a
    2-D array, row after row: for reading or writing them in one operation. When every
    count is the same (a steady launch), ``[S, c]`` arrays, else flat ones."""
    if len(counts) and counts.min() == counts.max():
        cols = starts[:, None] + np.arange(int(counts[0]))
        return rows[:, None], cols
    return np.repeat(rows, counts), np.repeat(starts, counts) + _ragged(counts)


def write_spans(
    dest: np.ndarray, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray, values
) -> None:
    """``dest[rows[i], starts[i] : starts[i] + counts[i]] = values[i, :counts[i]]`` for
    every i, in one assignment (``values``: ``[S, J]`` with ``counts <= J``; distinct
    rows). A slice of ``values`` when every count is the same, else a gather."""
    at = _spans(rows, starts, counts)
    if at[1].ndim == 2:
        dest[at] = values[:, : at[1].shape[1]]
    else:
        S = len(rows)
        dest[at] = values[_spans(np.arange(S), np.zeros(S, np.int64), counts)]


def _ragged(counts: np.ndarray) -> np.ndarray:
    """``int[sum(counts)]``: ``0 .. counts[i] - 1`` for each i in turn (each element's
    place within its row, for writing rows of different lengths in one assignment)."""
    ends = np.cumsum(counts)
    return np.arange(int(ends[-1]) if len(ends) else 0) - np.repeat(ends - counts, counts)


@dataclasses.dataclass(frozen=True, eq=False)
class SeqRows:
    """Distinct sequences of one ``BlockManager`` with their rows, as ``seq_rows`` gave
    them: pass it where a batched call (``append_tokens``, ``reserve_tokens``,
    ``fill_reserved``, ``paged_jax.batch.advance_batch``) takes ``seq_ids``, and the manager
    checks it with two array comparisons instead of looking each sequence up (a
    multi-step launch's rows, reused launch after launch). A sequence freed since then
    (its row given to another) or swapped out is caught, and the call then looks the ids
    up as if they had been given.

    Attributes:
      ids: the sequence ids, in order.
      rows: ``intp[S]`` their rows of ``tables()``.
      serials: ``int64[S]`` the allocation each row held when taken.
    """

    ids: list
    rows: np.ndarray
    serials: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Hashable:
        return self.ids[i]

    def __iter__(self):
        return iter(self.ids)

    def take(self, keep: np.ndarray) -> SeqRows:
        """The sequences at ``keep`` (a bool mask or ``intp`` indices), in order."""
        idx = np.flatnonzero(keep) if keep.dtype == bool else keep
        return SeqRows([self.ids[i] for i in idx.tolist()], self.rows[idx], self.serials[idx])
