"""Request state: what the engine keeps of a request (``Group``: its sequences, queue
state and timings) and of each of its sequences (``Seq``: a sample or a beam), the
tokens a multi-step launch samples for many sequences at once (``TokenLog``), and one
sequence's share of a step (``Work``). Every part of the engine reads these; none of
them imports a part. No JAX here."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Hashable
from typing import Any, NamedTuple

import numpy as np

from paged_jax.block_manager import write_spans
from paged_jax.engine.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class TokenLog:
    """Tokens sampled for many sequences at once (a multi-step launch's rows), kept as
    arrays until a sequence's tokens are read: a launch adds 256 rows' tokens with a few
    array operations instead of a Python list operation per sequence (tiny-llama, 256
    sequences, 16 tokens a launch: about 0.2 ms of a 2-core CPU's time). Each attached
    ``Seq`` (``Seq.attach``) is one row; reading its ``tokens`` or ``cum_logprob`` first
    moves the row's new tokens into its list.

    ``toks``: ``i32[R, W]`` row i's tokens since attaching in its first ``count[i]``
    columns; ``cum``: ``f64[R]`` the sequence's log-prob sum after them; ``version``: adds
    so far (a sequence compares it with the one it last read)."""

    __slots__ = ("toks", "count", "cum", "version")

    def __init__(self, num_rows: int):
        self.toks = np.zeros((num_rows, 16), np.int32)
        self.count = np.zeros(num_rows, np.int64)
        self.cum = np.zeros(num_rows, np.float64)
        self.version = 0

    def add(self, rows: np.ndarray, toks: np.ndarray, counts: np.ndarray, cums: np.ndarray):
        """Appends ``toks[i, :counts[i]]`` to row ``rows[i]`` (distinct rows, ``toks``:
        ``i32[n, K]``, ``counts``: ``int[n]`` in ``[1, K]``) and sets its sum to
        ``cums[i]`` (``f64[n]``)."""
        if not len(rows):
            return
        n = self.count[rows]
        m = n + counts
        width = int(m.max())
        if width > self.toks.shape[1]:
            pad = (1 << (width - 1).bit_length()) - self.toks.shape[1]
            self.toks = np.pad(self.toks, ((0, 0), (0, pad)))
        write_spans(self.toks, rows, n, counts, toks)
        self.count[rows] = m
        self.cum[rows] = cums
        self.version += 1


# Identity equality (no __eq__), as for any entity with a lifetime: field-wise equality
# made every ``group in queue`` and ``queue.remove(group)`` compare fields (14 ms to
# remove 256 finished groups from a running queue, newest first).
class Seq:
    """One sequence: a sample or a beam. ``tokens`` = prompt + generated tokens;
    ``cum_logprob``: the generated tokens' log-prob sum. Both may wait in a ``TokenLog``
    (a multi-step lane's) until read."""

    __slots__ = (
        "seq_id",
        "_tokens",
        "prompt_len",
        "sample_index",
        "logprobs",
        "top_logprobs",
        "_cum",
        "finish_reason",
        "stop_text",
        "detok",
        "spec_rate",
        "_log",
        "_row",
        "_seen",
        "_version",
    )

    def __init__(
        self,
        seq_id: str,
        tokens: list[int],
        prompt_len: int,
        sample_index: int,
        logprobs: list[float] | None = None,
        cum_logprob: float = 0.0,
        finish_reason: str | None = None,
        stop_text: str | None = None,  # the text, cut at a stop string (SamplingParams.stop)
    ):
        self.seq_id = seq_id
        self._tokens = tokens
        self.prompt_len = prompt_len
        self.sample_index = sample_index
        self.logprobs = [] if logprobs is None else logprobs
        # per generated token, [(token, log-prob)] of its step's most likely tokens
        # (SamplingParams.top_logprobs)
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self._cum = cum_logprob
        self.finish_reason = finish_reason
        self.stop_text = stop_text
        self.detok: Any = None  # the output processor's IncrementalText of the output
        # speculative decoding: the recent fraction of its proposals accepted (a moving
        # average; 1 until it verified any), which decides how many it may verify
        self.spec_rate = 1.0
        self._log: TokenLog | None = None
        self._row = self._seen = self._version = 0

    def attach(self, log: TokenLog, row: int) -> None:
        """Row ``row`` of ``log`` holds this sequence's next tokens (any it held in
        another log moved into its list first)."""
        if self._log is not None:
            self._sync()
        self._log, self._row, self._seen, self._version = log, row, 0, log.version

    def _sync(self) -> None:
        log = self._log
        self._version = log.version
        n = int(log.count[self._row])
        if n > self._seen:
            self._tokens += log.toks[self._row, self._seen : n].tolist()
            self._seen = n
            self._cum = float(log.cum[self._row])

    @property
    def tokens(self) -> list[int]:
        if self._log is not None and self._log.version != self._version:
            self._sync()
        return self._tokens

    @tokens.setter
    def tokens(self, value: list[int]) -> None:
        if self._log is not None and self._log.version != self._version:
            self._sync()
        self._tokens = value

    @property
    def cum_logprob(self) -> float:
        if self._log is not None and self._log.version != self._version:
            self._sync()
        return self._cum

    @cum_logprob.setter
    def cum_logprob(self, value: float) -> None:
        if self._log is not None and self._log.version != self._version:
            self._sync()
        self._cum = value

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    def __repr__(self) -> str:
        return (
            f"Seq({self.seq_id!r}, {len(self.tokens)} tokens, prompt_len={self.prompt_len}, "
            f"finish_reason={self.finish_reason!r})"
        )


@dataclasses.dataclass(eq=False)
class Group:
    """A request: its sequences, queue state and timings."""

    request_id: Hashable
    arrival: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    salt: object
    arrival_time: float
    seqs: list[Seq] = dataclasses.field(default_factory=list)
    done: list[Seq] = dataclasses.field(default_factory=list)
    status: Status = Status.WAITING
    forked: bool = False  # n-way samples created (after the prompt's first token)
    next_seq: int = 1
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    strikes: int = 0  # failed steps in a row while isolated as a suspect (engine faults)
    error: str | None = None  # why the engine failed this request
    replica: int = 0  # the data-parallel replica (scheduler, pool) that runs it
    # Tokens a sequence ends at whatever it samples (prompt + max_tokens, at most the
    # model's length); None: no limit known. A speculative schedule does not decode a
    # sequence that has reached it.
    max_len: int | None = None
    # SamplingParams.structured: each sequence's grammar matcher, by sequence id
    matchers: dict = dataclasses.field(default_factory=dict)
    # The model's adapter this request runs with (0: none); every token of it carries
    # the index into the model (``EngineCore.add_request(adapter=)``, the LoRA hook)
    adapter: int = 0
    # SamplingParams.prompt_logprobs: each prompt token's log-prob (None until its step
    # completes; the first token's stays None) and, with k > 0, its k most likely tokens
    prompt_lp: list | None = None
    prompt_top: list | None = None
    # Its priority with scheduling policy "priority": lower runs first (``add_request``)
    priority: int = 0

    def new_seq_id(self) -> str:
        # Keyed by the engine's arrival counter, not the request id: request 1 and "1"
        # must not share sequence "1/0".
        sid = f"{self.arrival}/{self.next_seq}"
        self.next_seq += 1
        return sid


class Work(NamedTuple):  # a tuple: built for every sequence of every step
    """One sequence's tokens [start, stop) this step; ``sample``: its logits are used."""

    group: Group
    seq: Seq
    start: int
    stop: int
    sample: bool


def width(g: Group) -> int:
    """The sequences request ``g`` may run at once (its beams or samples)."""
    p = g.params
    return p.beam_width if p.use_beam_search else p.n


class RequestTable:
    """The engine's unfinished requests by id, how many sequences each data-parallel
    replica runs (its load: where the router sends the next request), and the arrivals
    so far (each request's number, which orders the queues and keys its sequences)."""

    def __init__(self, num_replicas: int):
        self._groups: dict[Hashable, Group] = {}
        self.load = [0] * num_replicas
        self.arrivals = 0

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._groups

    def __len__(self) -> int:
        return len(self._groups)

    def get(self, request_id: Hashable) -> Group | None:
        return self._groups.get(request_id)

    def unfinished(self) -> list[Group]:
        """Every request not yet finished, in the order added."""
        return [g for g in self._groups.values() if g.status is not Status.FINISHED]

    def next_arrival(self) -> int:
        self.arrivals += 1
        return self.arrivals

    def add(self, g: Group) -> None:
        """Registers ``g`` (its id unused, its replica chosen)."""
        self._groups[g.request_id] = g
        self.load[g.replica] += width(g)

    def remove(self, g: Group) -> None:
        """Forgets ``g``, finished or aborted (its id may be used again)."""
        if self._groups.get(g.request_id) is g:
            del self._groups[g.request_id]
            self.load[g.replica] -= width(g)

    def using_adapter(self, adapter: int) -> int:
        """Unfinished requests that run with ``adapter``."""
        return sum(1 for g in self._groups.values() if g.adapter == adapter)

    def clear(self) -> None:
        self._groups.clear()
        self.load = [0] * len(self.load)
