"""``paged-jax serve``: an OpenAI-compatible HTTP server on the engine.

``Server(llm, model_name=...)`` builds the ASGI app (``.app``); ``serve(...)`` runs it
with uvicorn until SIGINT / SIGTERM. Routes: POST /v1/completions, POST
/v1/chat/completions (server-sent events with ``"stream": true``), GET /v1/models,
GET /health, GET /metrics (Prometheus text). See docs/SERVER.md.

Needs the ``serve`` extra (``EXTRA_MODULES``); this module imports none of it, so a
command can check for it (``missing_modules``) before loading a model.
"""

from __future__ import annotations

import importlib
import signal
import threading
from typing import Any

# What the ``serve`` extra installs (pyproject.toml), as the modules imported
EXTRA_MODULES = ("starlette", "uvicorn", "prometheus_client", "llguidance", "pydantic")


def missing_modules() -> list[str]:
    """The modules of the ``serve`` extra that cannot be imported here."""
    missing = []
    for name in EXTRA_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def default_allowed_hosts(host: str) -> list[str] | None:
    """The Host headers a server bound to ``host`` answers by default: ``host`` and the
    loopback names (a page on another site that rebinds its name to this address sends
    its own name, and is refused); None (any) for a wildcard address, which any name may
    reach."""
    if host in ("0.0.0.0", "::", ""):
        return None
    return sorted({host, "localhost", "127.0.0.1", "::1", "[::1]"})


def serve(
    llm: Any,
    *,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_waiting: int = 256,
    max_request_bytes: int | None = None,
    shutdown_timeout: float = 30.0,
    log_level: str = "info",
    on_ready: Any = None,
    allowed_hosts: list[str] | None = None,
    header_timeout: float | None = None,
    body_timeout: float = 60.0,
    max_connections: int | None = None,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    embedding_pooling: str = "last",
    lora_dirs: list | None = None,
    kv_events: Any = None,
) -> None:
    """Serves ``llm`` until SIGINT / SIGTERM, then lets requests in flight finish for up
    to ``shutdown_timeout`` seconds, aborts the rest and returns. ``on_ready()`` is
    called once the socket listens. ``max_request_bytes``: see ``Server``.
    ``allowed_hosts``: Host headers served (``*`` patterns as Starlette's
    ``TrustedHostMiddleware``); None: ``host`` and the loopback names, or any host when
    ``host`` is a wildcard address. ``header_timeout`` (default 30 s) and
    ``max_connections`` (default ``connections.default_max_connections()``): see
    ``paged_jax.server.connections``; ``body_timeout``, ``tool_call_parser``,
    ``reasoning_parser``, ``embedding_pooling``, ``lora_dirs`` and ``kv_events``: see
    ``Server``."""
    import asyncio

    import uvicorn

    from paged_jax.server.api import Server
    from paged_jax.server.connections import (
        DEFAULT_HEADER_TIMEOUT,
        bounded_protocol,
        default_max_connections,
    )

    protocol = bounded_protocol(
        DEFAULT_HEADER_TIMEOUT if header_timeout is None else header_timeout,
        default_max_connections() if max_connections is None else max_connections,
    )

    server = Server(
        llm,
        model_name=model_name,
        api_key=api_key,
        max_waiting=max_waiting,
        max_request_bytes=max_request_bytes,
        allowed_hosts=default_allowed_hosts(host) if allowed_hosts is None else allowed_hosts,
        body_timeout=body_timeout,
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
        embedding_pooling=embedding_pooling,
        lora_dirs=lora_dirs,
        kv_events=kv_events,
    )
    config = uvicorn.Config(
        server.app,
        host=host,
        port=port,
        http=protocol,
        log_level=log_level,
        timeout_graceful_shutdown=shutdown_timeout,
        lifespan="on",
    )
    runner = uvicorn.Server(config)

    async def main() -> None:
        task = asyncio.create_task(runner.serve())
        while not runner.started and not task.done():
            await asyncio.sleep(0.05)
        if runner.started and on_ready is not None:
            on_ready()
        await task

    # uvicorn shuts down gracefully on SIGINT / SIGTERM, then raises the signal again for
    # the handler it found: a no-op here, so the process then exits normally (status 0).
    held = {}
    if threading.current_thread() is threading.main_thread():
        held = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        asyncio.run(main())
    finally:
        for sig, handler in held.items():
            signal.signal(sig, handler)


def _ignore(signum, frame) -> None:
    pass


__all__ = ["serve"]
