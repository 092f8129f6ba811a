"""``SequenceRows``: a ``BlockManager``'s sequences as rows of arrays (block table, token
ids, counts, marks), grown by doubling, and their lookups. Each sequence owns one row,
so that the calls made for every sequence of every step are array operations over the
sequences' rows, not a pass over one Python object per sequence; a step's tables and
tokens are one gather (``paged_jax.batch``). No JAX."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from ._common import InvalidSequenceState, SeqRows, UnknownSequence

# Per-sequence state kept in rows of arrays (``add`` doubles them all).
_ROW_ARRAYS = (
    "serial",
    "table",
    "tok",
    "ntok",
    "ncomp",
    "resv",
    "last",
    "nhash",
    "win",
    "dropped",
    "swapped",
)


class SequenceRows:
    """The rows (the attributes below are read and written by the manager's other parts;
    arrays are replaced by larger ones as they grow, so read them afresh after a change):

    - ``table``: ``i32[R, C]`` each sequence's block table (host slots while swapped
      out), ``npages(row)`` entries then zeros; the first ``dropped[row]`` entries are
      ``NULL_PAGE`` (host: ``_DROPPED_SLOT``): pages no later token reads (a window).
    - ``tok``: ``i32[R, W]`` token ids (-1 past a row's count, and for a reserved token
      not known yet); ``ntok``: tokens with slots (prompt plus appended).
    - ``ncomp``: leading tokens whose K/V are on the device.
    - ``resv``: the first reserved token not yet filled (``reserve_tokens``), or -1.
    - ``last``: the step of the row's latest append (-1: never).
    - ``nhash``: leading full pages whose prefix-cache keys are known; ``key``: the key
      of page ``nhash - 1`` (``root``, the chain's salted root, when none).
    - ``win``: keys each token attends to (0: all); ``swapped``: on the host.
    - ``serial``: the allocation count when the row was taken (``SeqRows`` checks it).

    Rows of no sequence are zeros (token ids -1). ``step`` counts step boundaries
    (``BlockManager.take_copies``)."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        rows = 8
        self.serial = np.zeros(rows, np.int64)
        self.serials = 0  # rows taken so far
        self.table = np.zeros((rows, 8), np.int32)
        self.tok = np.full((rows, 16), -1, np.int32)
        self.ntok = np.zeros(rows, np.int64)
        self.ncomp = np.zeros(rows, np.int64)
        self.resv = np.zeros(rows, np.int64)
        self.last = np.zeros(rows, np.int64)
        self.nhash = np.zeros(rows, np.int64)
        self.win = np.zeros(rows, np.int64)
        self.dropped = np.zeros(rows, np.int64)
        self.swapped = np.zeros(rows, bool)
        self.root: list[bytes] = [b""] * rows
        self.key: list[bytes] = [b""] * rows
        self.ids: dict[Hashable, int] = {}  # seq_id -> its row
        self.free_rows = list(range(rows - 1, -1, -1))
        self.step = 0

    def add(
        self, seq_id: Hashable, tokens: np.ndarray, pages: Sequence[int], root: bytes, window: int
    ) -> int:
        """A new sequence's row, holding ``tokens`` and ``pages``, nothing computed."""
        if not self.free_rows:
            rows = self.table.shape[0]
            for name in _ROW_ARRAYS:
                a = getattr(self, name)
                fill = -1 if name == "tok" else 0
                pad = ((0, rows),) + ((0, 0),) * (a.ndim - 1)
                setattr(self, name, np.pad(a, pad, constant_values=fill))
            self.root += [b""] * rows
            self.key += [b""] * rows
            self.free_rows = list(range(2 * rows - 1, rows - 1, -1))
        row = self.free_rows.pop()
        self.serials += 1
        self.serial[row] = self.serials
        n = len(tokens)
        self.fit(len(pages), n)
        self.table[row, : len(pages)] = pages
        self.tok[row, :n] = tokens
        self.ntok[row] = n
        self.ncomp[row] = 0
        self.resv[row] = -1
        self.last[row] = -1
        self.nhash[row] = 0
        self.win[row] = window
        self.dropped[row] = 0
        self.swapped[row] = False
        self.root[row] = self.key[row] = root
        self.ids[seq_id] = row
        return row

    def drop(self, seq_id: Hashable, row: int) -> None:
        """Gives the sequence's row back (zeros, token ids -1)."""
        del self.ids[seq_id]
        self.table[row] = 0
        self.tok[row, : self.ntok[row]] = -1
        self.ntok[row] = 0
        self.free_rows.append(row)

    def fit(self, pages: int, tokens: int) -> None:
        """Widens the table to ``pages`` columns and the token ids to ``tokens``, if
        they are narrower (to the next power of two, so widening is rare)."""
        if pages > self.table.shape[1]:
            width = 1 << (pages - 1).bit_length()
            self.table = np.pad(self.table, ((0, 0), (0, width - self.table.shape[1])))
        if tokens > self.tok.shape[1]:
            width = 1 << (tokens - 1).bit_length()
            pad = ((0, 0), (0, width - self.tok.shape[1]))
            self.tok = np.pad(self.tok, pad, constant_values=-1)

    def row(self, seq_id: Hashable) -> int:
        """The sequence's row; ``UnknownSequence`` for one never allocated or freed."""
        try:
            return self.ids[seq_id]
        except KeyError:
            raise UnknownSequence(
                f"seq_id {seq_id!r}: unknown (never allocated, or already freed)"
            ) from None

    def device_row(self, seq_id: Hashable, op: str) -> int:
        """The row of a sequence on the device (``InvalidSequenceState`` if swapped out,
        naming ``op``)."""
        row = self.row(seq_id)
        if self.swapped[row]:
            raise InvalidSequenceState(f"{op}: seq_id {seq_id!r} is swapped out; swap_in first")
        return row

    def device_rows(self, seq_ids: Sequence[Hashable] | SeqRows, op: str) -> np.ndarray:
        """``intp[S]``: the rows of distinct sequences on the device (errors as
        ``device_row``, and ``ValueError`` for a sequence given twice). A ``SeqRows`` is
        checked with two array comparisons; looked up again if a row changed hands."""
        if isinstance(seq_ids, SeqRows):
            rows = seq_ids.rows
            if (self.serial[rows] == seq_ids.serials).all() and not self.swapped[rows].any():
                return rows
            seq_ids = seq_ids.ids  # a row changed hands, or was swapped out
        get = self.ids.get
        found = [get(s) for s in seq_ids]
        rows = np.array(found, np.intp) if None not in found else None
        if rows is None or self.swapped[rows].any():
            rows = np.array([self.device_row(s, op) for s in seq_ids], np.intp)  # raises
        if len(set(found)) < len(found):
            seen: set = set()
            twice = next(s for s in seq_ids if s in seen or seen.add(s))
            raise ValueError(f"seq_ids: expected distinct sequences, got {twice!r} twice")
        return rows

    def seq_rows(self, seq_ids: Sequence[Hashable]) -> SeqRows:
        rows = self.device_rows(seq_ids, "seq_rows")
        return SeqRows(list(seq_ids), rows, self.serial[rows])

    def npages(self, row: int) -> int:
        """Entries of the row's block table (pages of its tokens, dropped ones included)."""
        return -(-int(self.ntok[row]) // self.page_size)

    def filled(self, row: int) -> int:
        """Tokens before the first reserved one not yet filled (all of them if none)."""
        r = int(self.resv[row])
        return int(self.ntok[row]) if r < 0 else r

    def live(self, row: int) -> list[int]:
        """The row's table entries not dropped outside the window."""
        return self.table[row, self.dropped[row] : self.npages(row)].tolist()
