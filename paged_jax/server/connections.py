"""Bounds on the server's connections, which uvicorn leaves open-ended.

uvicorn closes a kept-alive connection that stays idle after a response, but a connection
that never completes its request's headers (it sends nothing, or part of a request line)
holds a file descriptor for as long as the client likes: with the usual limit of 1,024
descriptors, about a thousand such connections stop the server from accepting anyone.
``bounded_protocol`` returns uvicorn's h11 protocol with two more rules:

- a request's headers must arrive within ``header_timeout`` seconds of the connection
  opening or of the previous response's end, else the connection is closed;
- beyond ``max_connections`` open connections a new one is closed as soon as it is
  accepted, so descriptors stay free for the ones being served.

The body of a request has its own deadline in the application (``Server``'s
``body_timeout``). Rate limits per client, TLS and slow-reader protection belong to a
reverse proxy in front (docs/SERVER.md).
"""

from __future__ import annotations

import resource
from typing import Any

DEFAULT_HEADER_TIMEOUT = 30.0


def default_max_connections() -> int:
    """Open connections served at once: 1,000, or fewer where the process's descriptor
    limit leaves less than 100 for everything else (model files, the compile cache,
    logs)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1000
    return max(16, min(1000, soft - 100))


def bounded_protocol(header_timeout: float, max_connections: int) -> Any:
    """uvicorn's ``H11Protocol`` with a deadline for each request's headers and a cap on
    open connections (pass it as ``uvicorn.Config(http=...)``)."""
    if not header_timeout > 0:
        raise ValueError(f"header_timeout: expected seconds > 0, got {header_timeout!r}")
    if isinstance(max_connections, bool) or not isinstance(max_connections, int):
        raise TypeError(f"max_connections: expected an int, got {max_connections!r}")
    if max_connections < 1:
        raise ValueError(f"max_connections: expected >= 1, got {max_connections}")
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class BoundedH11Protocol(H11Protocol):
        _deadline = None  # the timer of the headers awaited, if any
        _armed_for = None  # the request cycle the timer was armed after

        def connection_made(self, transport):
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self.logger.warning(
                    "closing a new connection: %d open (--max-connections)", max_connections
                )
                transport.close()
                return
            self._arm()

        def _arm(self):
            self._disarm()
            self._armed_for = self.cycle
            self._deadline = self.loop.call_later(header_timeout, self._headers_late)

        def _disarm(self):
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _headers_late(self):
            self._deadline = None
            if self.cycle is self._armed_for and not self.transport.is_closing():
                self.transport.close()  # no request began since the timer was armed

        def handle_events(self):
            super().handle_events()
            if self._deadline is not None and self.cycle is not self._armed_for:
                self._disarm()  # a request's headers arrived

        def on_response_complete(self):
            super().on_response_complete()
            if not self.transport.is_closing() and self.cycle is not None:
                if self.cycle.response_complete:
                    self._arm()  # the next request's headers, on a kept-alive connection

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

    return BoundedH11Protocol
