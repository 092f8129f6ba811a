"""Faults in a step, and what the engine does about them. ``FaultIsolator`` is the engine
core's part that decides it. No JAX.

A step is all or nothing. Python signal handlers (Ctrl-C, timers) are held while a step
runs and called when it ends, so they never interrupt it halfway (a second Ctrl-C does:
the step then fails). When a step raises anyway (a fault in the device call, out of
memory, a second Ctrl-C), the exception propagates after the engine has put every
unfinished request back in the queue to be recomputed from its tokens so far: nothing is
lost and later tokens are those of an uninterrupted run (greedy and seeded sampling are
keyed by seed and position).

A fault one request causes (an ``Exception``, not an interrupt) does not stall the
others: the requests of the failed step become suspects, and each in turn runs with only
the requests already cleared, until it has sampled a token. A suspect is failed when
``STRIKES_TO_FAIL_A_REQUEST`` such steps in a row raise (one if it was alone in the first
failed step): its output (``finish_reason`` "error", ``RequestOutput.error`` the
exception) comes with the next step, and the rest go on. A one-off fault fails nobody.
Only a fault while a step's results are being applied, or
``MAX_CONSECUTIVE_FAILED_STEPS`` failed steps in a row that no request explains, stop
the engine: every later call then raises ``EngineFailedError`` until ``reset()``.
"""

from __future__ import annotations

import logging

from paged_jax.engine.protocol import ModelContractError
from paged_jax.engine.request import Group, Status

log = logging.getLogger("paged_jax")


class EngineFailedError(RuntimeError):
    """The engine stopped in a step it could not recover from; see ``LLM.reset``."""


# A step that raises this many times in a row (each time after requeueing its requests)
# with no request to blame stops the engine instead of failing forever.
MAX_CONSECUTIVE_FAILED_STEPS = 3
# A request is failed (finish_reason "error") once this many steps in a row raised while
# it ran as the only suspect (see LLM: isolating a fault).
STRIKES_TO_FAIL_A_REQUEST = 2


class FaultIsolator:
    """The engine core's part that decides what a failed step means (see the module
    docstring): which requests are suspects, which one runs alone while isolated, which
    one is failed, and when the engine must stop (``failed``). It changes no request
    itself: the core requeues, fails and rebuilds as ``on_fault`` says.

    Args:
      metrics: the engine's ``EngineMetrics`` (failed steps and requests are counted).
    """

    def __init__(self, metrics):
        self.metrics = metrics
        self.failed: BaseException | None = None  # the error that stopped the engine
        self._suspects: list[Group] = []  # groups of a failed step, not yet cleared
        self._cleared: set[int] = set()  # arrivals of suspects that since sampled a token
        self._consecutive = 0  # failed steps in a row

    @property
    def isolating(self) -> bool:
        """Whether suspects are being run one at a time (the engine then runs plain
        single steps, not overlapped or multi-step ones)."""
        return bool(self._suspects)

    def on_fault(self, error: BaseException, phase: str | None, groups: list) -> Group | None:
        """A step raised ``error`` in ``phase`` ("schedule": before its results were
        applied; "apply": while they were) having run ``groups``. Returns the group to
        fail (a suspect on its last strike: the core ends it with ``finish_reason``
        "error"), or None. Sets ``failed`` when the engine must stop: results half
        applied, the model's own fault, or too many failed steps in a row that no
        request explains; otherwise the core requeues every unfinished request."""
        self._consecutive += 1
        self.metrics.failed_steps += 1
        if phase == "apply" or isinstance(error, ModelContractError):
            self.failed = error  # results half applied, or the model's fault, no request's
            return None
        blamed = None
        if isinstance(error, Exception):  # an interrupt says nothing about the requests
            blamed = self._suspect(error, groups)
        if blamed is not None:
            self._consecutive = 0  # explained
            self.metrics.requests_failed += 1
            log.warning("request %r failed: %s: %s", blamed.request_id, type(error).__name__, error)
        elif self._consecutive >= MAX_CONSECUTIVE_FAILED_STEPS:
            self.failed = error  # the fault repeats and no request explains it
        return blamed

    def isolation(self) -> set[int] | None:
        """The arrivals the schedulers may run while suspects are isolated, else None."""
        self._suspects = [g for g in self._suspects if g.status is not Status.FINISHED]
        if not self._suspects:
            self._cleared = set()
            return None
        return self._cleared | {self._suspects[0].arrival}

    def succeeded(self, sampled: list[Group]) -> None:
        """A step call completed, ``sampled``: the groups of its rows that sampled. The
        isolated suspect among them is cleared (it may run with the others again)."""
        self._consecutive = 0
        if self._suspects and any(g is self._suspects[0] for g in sampled):
            cleared = self._suspects.pop(0)
            cleared.strikes = 0
            self._cleared.add(cleared.arrival)

    def _suspect(self, error: Exception, groups: list[Group]) -> Group | None:
        """Updates the suspects after ``error`` in a step that ran ``groups``; returns the
        isolated suspect on its last strike (no longer a suspect)."""
        self._suspects = [g for g in self._suspects if g.status is not Status.FINISHED]
        if not self._suspects:  # a new episode: every request of the step is a suspect
            self._suspects = sorted(groups, key=lambda g: g.arrival)
            if len(groups) == 1:
                groups[0].strikes = 1  # it failed alone already
            return None
        g = self._suspects[0]
        if g not in groups:
            return None  # the suspect did not run: nothing learned
        g.strikes += 1
        if g.strikes < STRIKES_TO_FAIL_A_REQUEST:
            return None
        self._suspects.remove(g)
        return g

    def check_usable(self) -> None:
        """Raises ``EngineFailedError`` while the engine is stopped (``failed``)."""
        if self.failed is not None:
            e = self.failed
            raise EngineFailedError(
                f"the engine stopped after a failed step ({type(e).__name__}: {e}); call "
                "LLM.reset() to drop every request and go on with the same compiled model, "
                "or create a new LLM"
            ) from e

    def reset(self) -> None:
        """Forgets every suspect and a stopped state (``EngineCore.reset``)."""
        self.failed, self._consecutive = None, 0
        self._suspects, self._cleared = [], set()
