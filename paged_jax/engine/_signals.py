"""Holding back Python signal handlers while an engine step runs.

A handler that raises (Ctrl-C's ``KeyboardInterrupt``, a timer's ``SIGALRM`` handler)
can land between any two bytecodes; inside a step that means between the block
manager's bookkeeping and the device call that it describes. ``DeferSignals`` replaces
every Python-level handler of the usual signals with one that records the signal, and on
exit restores the handlers and calls each recorded one, so a handler runs only at a step
boundary. A second SIGINT while one is held raises ``KeyboardInterrupt`` at once (a stuck
compile can still be interrupted; the engine then recovers as from any failed step).
Only the main thread receives Python signals, so elsewhere this does nothing.
"""

from __future__ import annotations

import signal
import threading

_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGALRM", "SIGHUP", "SIGUSR1", "SIGUSR2")
    if hasattr(signal, name)
)


class DeferSignals:
    """Context manager: Python signal handlers run at exit instead of inside the block.

    ``pending`` lists the signals held. ``release()`` restores the handlers and calls the
    held ones in arrival order (a handler may raise: the caller decides where).
    """

    def __init__(self):
        self.pending: list[tuple[int, object]] = []
        self._saved: dict[int, object] = {}

    def __enter__(self) -> DeferSignals:
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in _SIGNALS:
            handler = signal.getsignal(sig)
            if callable(handler):  # SIG_DFL / SIG_IGN / None are left alone
                self._saved[sig] = handler
                signal.signal(sig, self._record)
        return self

    def _record(self, signum, frame) -> None:
        if signum == signal.SIGINT and any(s == signal.SIGINT for s, _ in self.pending):
            raise KeyboardInterrupt  # pressed twice: do not wait for the step
        self.pending.append((signum, frame))

    def restore(self) -> None:
        """Puts the saved handlers back (idempotent)."""
        saved, self._saved = self._saved, {}
        for sig, handler in saved.items():
            signal.signal(sig, handler)

    def release(self) -> None:
        """Restores the handlers, then runs the held signals' handlers."""
        self.restore()
        pending, self.pending = self.pending, []
        for signum, frame in pending:
            handler = signal.getsignal(signum)
            if callable(handler):
                handler(signum, frame)

    def __exit__(self, *exc) -> None:
        self.restore()
