"""Proposers of speculative decoding: what the engine asks of one (``Proposer``, each
sequence as a ``DraftRequest``) and prompt lookup (``NgramProposer``, ``lookup``). A
draft model's proposer is ``draft.DraftModelProposer``. No JAX here."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple, Protocol

import numpy as np


class DraftRequest(NamedTuple):
    """One sequence to propose for: its id, its tokens so far (``i32[n]``, prompt and
    output, the last one sampled but not yet computed) and how many tokens it may take."""

    seq_id: Hashable
    tokens: np.ndarray
    max_tokens: int


class Proposer(Protocol):
    """What the engine asks of a proposer: for each request, up to ``max_tokens`` token ids
    that it guesses follow (an empty list: no guess). A proposer with state of its own
    per sequence (a draft model's cache) may also define ``release(seq_id)``, which the
    engine calls when a sequence ends (finished or aborted)."""

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]: ...


class NgramProposer:
    """Prompt lookup: the longest suffix of ``min_n`` to ``max_n`` tokens that occurred
    before in the sequence, and the tokens that followed its latest earlier occurrence.
    O(n) a sequence: the candidates are the earlier positions of its last token, narrowed
    one token back at a time."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [lookup(r.tokens, r.max_tokens, self.min_n, self.max_n) for r in requests]


def lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
    suffix of ``tokens`` (``i32[L]``) of ``min_n`` to ``max_n`` tokens; [] if none
    occurred."""
    L = len(tokens)
    if k <= 0 or L < min_n + 1:
        return []
    # ends[i]: an earlier position whose token equals the last one (something follows it)
    ends = np.flatnonzero(tokens[: L - 1] == tokens[L - 1])
    best = ends if min_n <= 1 else None
    for back in range(1, min(max_n, L - 1)):
        ends = ends[ends >= back]
        ends = ends[tokens[ends - back] == tokens[L - 1 - back]]
        if not len(ends):
            break
        if back + 1 >= min_n:
            best = ends  # matches of back + 1 tokens
    if best is None or not len(best):
        return []
    e = int(best[-1])
    return tokens[e + 1 : e + 1 + k].tolist()
