"""The engine's counters (``EngineMetrics``), what a step adds to them
(``record_step``), and the progress bar of ``LLM.generate``. No JAX here."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass
class EngineMetrics:
    steps: int = 0  # device steps completed (a step() call completes 0 to 2)
    elapsed_s: float = 0.0
    # Dispatching the jitted step and waiting for its results (device work not hidden
    # behind host work), compiling calls excluded.
    step_s: float = 0.0
    # step_s's two parts: the dispatch calls (enqueueing the step; on a GPU, launching
    # its kernels) and the waits for the sampled tokens. A dispatch that takes about a
    # device step means the dispatch waited for the device (nothing overlapped).
    dispatch_s: float = 0.0
    wait_s: float = 0.0
    compile_s: float = 0.0  # calls of the jitted step that compiled a new shape bucket
    # Scheduling, block manager, batch building, sampling bookkeeping: with overlapped
    # steps (async_scheduling) mostly while the device runs the previous step.
    host_s: float = 0.0
    overlapped_steps: int = 0  # steps dispatched while the previous one still ran
    multi_step_launches: int = 0  # launches of several decode steps (num_scheduler_steps)
    # Overlapped schedules that stopped where a decode needed a page none had: the step
    # after completes first, and its schedule preempts if pages are still short.
    overlap_stalls: int = 0
    tokens_computed: int = 0  # prompt + generated tokens run through the model
    tokens_generated: int = 0
    requests_finished: int = 0
    ttft_sum_s: float = 0.0
    kv_utilization_sum: float = 0.0
    kv_samples: int = 0
    max_pages_used: int = 0
    max_pages_shared: int = 0
    preemptions_swap: int = 0
    preemptions_recompute: int = 0
    prefix_hit_rate: float = 0.0
    compilations: int = 0
    failed_steps: int = 0  # steps that raised; their requests were requeued (recomputed)
    requests_failed: int = 0  # requests the engine ended with finish_reason "error"
    # Speculative decoding: rows that verified proposals, the proposals, those accepted
    spec_verify_rows: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        """Proposed tokens accepted, as a fraction (0 when none were proposed)."""
        return self.spec_accepted_tokens / max(self.spec_draft_tokens, 1)

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a verifying row gets per step: its accepted proposals plus the token
        sampled after them (1 when nothing was verified)."""
        rows = self.spec_verify_rows
        return (self.spec_accepted_tokens + rows) / rows if rows else 1.0

    def summary(self) -> dict[str, float]:
        return {
            "requests": self.requests_finished,
            "generated tokens": self.tokens_generated,
            "tokens/s (generated)": self.tokens_generated / max(self.elapsed_s, 1e-9),
            "tokens/s (computed)": self.tokens_computed / max(self.elapsed_s, 1e-9),
            "requests/s": self.requests_finished / max(self.elapsed_s, 1e-9),
            "mean TTFT (s)": self.ttft_sum_s / max(self.requests_finished, 1),
            "steps": self.steps,
            "host share of step time": self.host_s / max(self.host_s + self.step_s, 1e-9),
            "mean KV utilization": self.kv_utilization_sum / max(self.kv_samples, 1),
            "max pages used": self.max_pages_used,
            "max pages shared": self.max_pages_shared,
            "prefix hit rate": self.prefix_hit_rate,
            "preemptions (swap)": self.preemptions_swap,
            "preemptions (recompute)": self.preemptions_recompute,
            "compilations": self.compilations,
            "compile time (s)": self.compile_s,
            "failed steps (recovered)": self.failed_steps,
            "failed requests": self.requests_failed,
            "speculative acceptance rate": self.spec_acceptance_rate,
            "speculative mean accepted length": self.spec_mean_accepted_length,
        }


def record_step(
    m: EngineMetrics,
    seconds: float,
    completed: int,
    schedulers: Sequence[Any],
    page_size: int,
    *,
    full: bool,
) -> None:
    """Adds a ``step()`` call to ``m``: ``seconds`` of wall time, ``completed`` device
    steps; the pool's peak use and the schedulers' preemptions. ``full``: also the
    block managers' full recount (KV utilization, shared pages, prefix hits), which walks
    every page of every sequence, so callers sample it."""
    m.steps += completed
    m.elapsed_s += seconds
    m.host_s = m.elapsed_s - m.step_s - m.compile_s
    bms = [sc.bm for sc in schedulers]
    used = sum(bm.num_pages - 1 - bm.num_free_pages for bm in bms)
    m.max_pages_used = max(m.max_pages_used, used)
    if full:
        stats = [bm.stats() for bm in bms]
        total = {k: sum(st[k] for st in stats) for k in stats[0]}
        pages = total["pages_used"] * page_size
        m.kv_samples += 1
        m.kv_utilization_sum += total["tokens_stored"] / pages if pages else 1.0
        m.max_pages_shared = max(m.max_pages_shared, total["pages_shared"])
        queries = total["prefix_queries"]
        m.prefix_hit_rate = total["prefix_hits"] / queries if queries else 0.0
    m.preemptions_swap = sum(sc.num_preempted["swap"] for sc in schedulers)
    m.preemptions_recompute = sum(sc.num_preempted["recompute"] for sc in schedulers)


class Progress:
    """A rich progress bar of generated tokens, with finished requests, tokens/s and the
    step being compiled (silent when disabled).

    The total is every request's token budget (``max_tokens`` per sample or beam); a
    request that stops early counts its unused budget as done, so the bar ends full.
    """

    def __init__(self, total_tokens: int, requests: int, *, enabled: bool):
        self._p = None
        self.requests, self.finished = requests, 0
        if not enabled:
            return
        from rich.progress import BarColumn, Progress, TextColumn

        self._p = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed:.0f}/{task.total:.0f} tokens"),
            TextColumn("{task.fields[info]}"),
            transient=False,
        )
        self._task = self._p.add_task("generating", total=max(total_tokens, 1), info="")
        self._p.start()

    def compiling(self, what: str) -> None:
        """Shown while a new step shape compiles (the call blocks; rich redraws)."""
        if self._p is not None:
            self._p.update(self._task, description=f"compiling the step for {what}")

    def update(self, m: EngineMetrics, tokens: int, finished: int) -> None:
        self.finished += finished
        if self._p is not None:
            rate = f"{m.tokens_generated / max(m.elapsed_s, 1e-9):.0f} tok/s"
            info = f"{self.finished}/{self.requests} requests, {rate}"
            self._p.update(self._task, description="generating", advance=tokens, info=info)

    def close(self) -> None:
        if self._p is not None:
            self._p.stop()
