"""A dispatched step (``Launched``) and a multi-step launch's rows as columns (``Lane``):
what the engine core keeps of a step between its dispatch and its results. No JAX here
(a launch's outputs are device arrays the core reads back, ``StepOutputs.read``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from paged_jax.block_manager import BlockManager, SeqRows
from paged_jax.engine.request import TokenLog, Work
from paged_jax.engine.step_types import SamplingColumns, StepOutputs

# A token the running step is sampling (overlapped steps): the placeholder a sequence's
# tokens end in while the next step is scheduled, filled on the device
PENDING = -1


@dataclasses.dataclass
class Lane:
    """A multi-step launch's rows as columns: row j is batch row ``at[j]``, sequence
    ``seqs[j]`` of ``groups[j]`` (its id ``ids[j]``), whose input is its token
    ``stops[j] - 1`` and which samples ``steps[j]`` tokens. Built once for the first
    launch of a run and carried from launch to launch (``LLM._continue``), so a steady
    launch makes no per-row objects and checks its rows with whole-array operations."""

    seqs: list  # [Seq]
    groups: list  # [Group]
    ids: SeqRows  # the sequences' ids and block-manager rows
    at: np.ndarray  # intp[L]: batch rows
    stops: np.ndarray  # int64[L]: the sequence's tokens with the row's input (Work.stop)
    steps: np.ndarray  # int64[L]
    max_len: np.ndarray  # int64[L]: Group.max_len
    exact: np.ndarray  # bool[L]: a stop string or log-probs to keep (ResultApplier.extend)
    stop_ids: dict  # id(SamplingParams) -> set of token ids that stop its sequences
    stop_union: list  # every token id in stop_ids (a superset of each row's)
    ended: int  # ResultApplier.ended when every row was known to run (none ended since: all do)
    continued: bool  # a continuation's (StepLauncher.plan_continuation): its groups have
    # their first token times
    log: TokenLog  # where the rows' samples wait until read (Seq.attach)
    li: np.ndarray  # intp[L]: each row's row in log
    # float64[L]: the sequences' cum_logprob as the launch starts, set by the launch before
    # as it is applied (None: read them from the sequences)
    cum: np.ndarray | None = None

    @classmethod
    def of(
        cls, work: list, steps: list[int], eos_token_ids: set, bm: BlockManager, ended: int
    ) -> Lane:
        """The lane of a launch scheduled as ``work`` (row i: ``work[i]``), ``steps`` each,
        its sequences in ``bm``; ``ended``: ``ResultApplier.ended`` now."""
        seqs = [w.seq for w in work]
        groups = [w.group for w in work]
        L = len(work)
        stop_ids = {}
        for p in {id(g.params): g.params for g in groups}.values():
            stop_ids[id(p)] = set(p.stop_token_ids) | (set() if p.ignore_eos else eos_token_ids)
        log = TokenLog(L)
        for i, s in enumerate(seqs):
            s.attach(log, i)
        return cls(
            seqs=seqs,
            groups=groups,
            ids=bm.seq_rows([s.seq_id for s in seqs]),
            at=np.arange(L, dtype=np.intp),
            stops=np.fromiter((w.stop for w in work), np.int64, L),
            steps=np.asarray(steps, np.int64),
            max_len=np.fromiter((g.max_len for g in groups), np.int64, L),
            exact=np.fromiter((bool(g.params.stop or g.params.logprobs) for g in groups), bool, L),
            stop_ids=stop_ids,
            stop_union=sorted(set().union(*stop_ids.values())),
            ended=ended,
            continued=False,
            log=log,
            li=np.arange(L, dtype=np.intp),
        )

    def take(self, keep: np.ndarray | None, **columns) -> Lane:
        """The lane of rows ``keep`` (a bool mask; None: all), with ``columns`` replaced
        (arrays over the kept rows)."""
        if keep is None:
            fields = {"seqs": self.seqs, "groups": self.groups, "ids": self.ids}
            fields.update(at=self.at, stops=self.stops, steps=self.steps)
            fields.update(max_len=self.max_len, exact=self.exact, li=self.li)
        else:
            idx = np.flatnonzero(keep).tolist()
            fields = {k: [getattr(self, k)[j] for j in idx] for k in ("seqs", "groups")}
            fields["ids"] = self.ids.take(keep)
            for k in ("at", "stops", "steps", "max_len", "exact", "li"):
                fields[k] = getattr(self, k)[keep]
        fields.update(ended=self.ended, continued=self.continued, log=self.log)
        fields.update(columns)  # (cum is not carried: a lane taken for the next launch
        # starts from sums the launch before has not computed yet)
        return Lane(**fields, stop_ids=self.stop_ids, stop_union=self.stop_union)

    def work(self) -> list:
        """Its rows as ``Work``, in order."""
        return [
            Work(g, s, n - 1, n, True)
            for g, s, n in zip(self.groups, self.seqs, self.stops.tolist(), strict=True)
        ]


@dataclasses.dataclass
class Launched:
    """A dispatched step: its work, batch rows and device outputs (not waited for)."""

    work: list | None  # [Work] (None for a multi-step launch: its ``lane``)
    placed: list | None  # [(batch row, Work)] (None for a multi-step launch)
    groups: list  # [Group] the step runs
    num_tokens: int  # live tokens
    outputs: StepOutputs | None  # None while its sampling is deferred (``deferred``)
    dispatch_s: float  # the dispatch call's time (0 when it compiled)
    stalled: bool  # its speculative schedule stopped short of a preemption
    compiled: bool = False  # its dispatch compiled a new program (its time: compile_s)
    # Multi-step decoding: the steps each row runs; None: one step. Then also its rows as
    # a lane, and its batch and sampling columns, from which the next launch is built
    # (``advance_batch``).
    steps: list[int] | None = None
    lane: Lane | None = None
    batch: Any = None
    sampling: SamplingColumns | None = None
    rows: dict = dataclasses.field(init=False)  # id(Seq) -> batch row of its sample
    # Multi-step: the lane's rows whose last sample a launch dispatched meanwhile decodes
    # (``StepLauncher.plan_continuation``): reserved in the block manager, filled with the
    # others.
    carried: np.ndarray | None = None  # bool[L]; None: none
    next: Lane | None = None  # the lane of the launch that goes on from this one
    # Speculative decoding: {batch row: (proposals, first extra sampling row)} of the rows
    # that verify proposals (``Speculator.verify_rows``); None: none.
    spec: dict | None = None
    # A step whose rows are sampled once their grammar masks are known (structured output
    # in an overlapped step, ``StepLauncher.sample_deferred``): the runner's
    # ``DeferredSample`` and the sampling rows' ``(rows, S_b, params)``; ``outputs`` is
    # None until then.
    deferred: Any = None
    mask_rows: tuple | None = None
    # Prompt log-probs (``SamplingParams.prompt_logprobs``) the step computes: ``(group,
    # prompt positions)`` in the order of its score rows (``step_inputs.prompt_rows``);
    # None: none.
    scoring: list | None = None

    def __post_init__(self):
        # read only for a single step (``StepLauncher.tokens``): a launch is followed by a
        # continuation, or completes before the next step is scheduled
        self.rows = {id(w.seq): i for i, w in self.placed if w.sample} if self.steps is None else {}

    def all_work(self) -> list:
        """Its ``Work``, in row order (a multi-step launch's made from its lane)."""
        return self.work if self.lane is None else self.lane.work()

    @property
    def iterations(self) -> int:
        """Device steps the launch runs (a multi-step one: its longest row's, the loop's
        trip count)."""
        return 1 if self.steps is None else max(self.steps)
