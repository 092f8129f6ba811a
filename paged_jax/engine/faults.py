"""Faults in a step: the step is undone (every unfinished request requeued to be recomputed
from its committed tokens), the request that causes it is found by running suspects one
at a time and failed after its strikes, and a fault that cannot be undone (while a step's
results were applied) or that repeats with no request to blame stops the engine until
``reset()``. ``FaultIsolation`` is ``EngineCore``'s part that does it (a mixin over the
core's state). No JAX."""

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


class FaultIsolation:
    """``EngineCore``'s fault handling (see the module docstring)."""

    def _on_fault(self, error: BaseException) -> None:
        """A step raised: blame a request or suspect some, requeue every unfinished
        request, or stop the engine."""
        phase, self._phase = self._phase, None
        groups, self._step_groups = self._step_groups, []
        self._consecutive_faults += 1
        self.metrics.failed_steps += 1
        if phase == "apply":
            self._failed = error  # results were half applied
            return
        if isinstance(error, ModelContractError):  # the model's fault, no request's
            self._failed = error
            return
        if isinstance(error, Exception):  # an interrupt says nothing about the requests
            self._suspect(error, groups)
        if self._consecutive_faults >= MAX_CONSECUTIVE_FAILED_STEPS:
            self._failed = error  # the fault repeats and no request explains it
            return
        try:
            self._rebuild([g for g in self._groups.values() if g.status is not Status.FINISHED])
        except BaseException as e:  # noqa: BLE001 (any failure here stops the engine)
            self._failed = e

    def _isolation(self) -> set[int] | None:
        """The arrivals the scheduler may run while suspects are isolated, else None."""
        self._suspects = [g for g in self._suspects if g.status is not Status.FINISHED]
        if not self._suspects:
            self._cleared = set()
            return None
        return self._cleared | {self._suspects[0].arrival}

    def _suspect(self, error: Exception, groups: list[Group]) -> None:
        """Updates the suspects after ``error`` in a step that ran ``groups``; fails the
        isolated suspect on its last strike."""
        self._suspects = [g for g in self._suspects if g.status is not Status.FINISHED]
        if not self._suspects:  # a new episode: every request of the step is a suspect
            self._suspects = sorted(groups, key=lambda g: g.arrival)
            if len(groups) == 1:
                groups[0].strikes = 1  # it failed alone already
            return
        g = self._suspects[0]
        if g not in groups:
            return  # the suspect did not run: nothing learned
        g.strikes += 1
        if g.strikes < STRIKES_TO_FAIL_A_REQUEST:
            return
        self._suspects.remove(g)
        g.error = f"{type(error).__name__}: {error}"
        for s in g.seqs:
            s.finish_reason = "error"
            self._ended += 1
            g.done.append(s)
        g.seqs.clear()
        self._undelivered.append(self._finish(g))
        self._consecutive_faults = 0  # explained
        self.metrics.requests_failed += 1
        log.warning("request %r failed: %s", g.request_id, g.error)

    def _rebuild(self, requeue: list[Group]) -> None:
        """Fresh block manager, queues and host buffers; ``requeue`` waits to be
        recomputed from its committed tokens. The pool is reallocated only if the failed
        step consumed it (donated buffers); its contents are never read again."""
        for r, sc in enumerate(self.schedulers):  # each request stays on its replica
            sc.bm = self._new_block_manager()
            sc.running, sc.swapped = [], []
            sc.waiting = sorted((g for g in requeue if g.replica == r), key=lambda g: g.arrival)
        for g in requeue:
            g.status = Status.WAITING
        self._inflight = None  # its results are dropped: the requests are recomputed
        self._host.clear()
        self.runner.reallocate_if_consumed()

    @property
    def failure(self) -> BaseException | None:
        """The error of a step that could not be undone, while the engine is stopped by it
        (every call but ``reset()`` then raises ``EngineFailedError``); None otherwise."""
        return self._failed

    def _check_usable(self) -> None:
        if self._failed is not None:
            e = self._failed
            raise EngineFailedError(
                f"the engine stopped after a failed step ({type(e).__name__}: {e}); call "
                "LLM.reset() to drop every request and go on with the same compiled model, "
                "or create a new LLM"
            ) from e

    def reset(self) -> None:
        """Drops every request (no outputs are returned for them), frees every page and
        host buffer, and clears a failed state. Compiled steps are kept."""
        self._groups.clear()
        self._undelivered.clear()
        self._failed, self._phase, self._consecutive_faults = None, None, 0
        self._suspects, self._cleared = [], set()
        self._load = [0] * len(self.schedulers)
        self._rebuild([])
