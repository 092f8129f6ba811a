"""``Intake``: the server's part that lets a request in: its API key (401), its body's
content type (415), size (413, counted as it arrives) and arrival time (408). No JAX."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import Response

from paged_jax.server.fields import ApiError, error_response


class Intake:
    """Checks of every request before it is read.

    Args:
      api_key: the key clients must send (``Authorization: Bearer KEY``), or None.
      max_request_bytes: larger bodies are refused (413) before they are read whole.
      body_timeout: seconds a body may take to arrive once its headers have (408 after).
    """

    def __init__(self, api_key: str | None, max_request_bytes: int, body_timeout: float):
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.body_timeout = body_timeout

    def auth(self, request: Request) -> Response | None:
        """The 401 answer of a request without this server's key, else None."""
        if self.api_key is None:
            return None
        if request.headers.get("authorization", "") != f"Bearer {self.api_key}":
            return error_response(401, "api key: missing or wrong (Authorization: Bearer KEY)")
        return None

    async def read_body(self, request: Request) -> bytes:
        """The body, refused (413) once it passes ``max_request_bytes``: by its declared
        length before reading, else as it arrives."""
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json":  # a cross-site form or text/plain post is no API call
            raise ApiError(
                415, f"body: expected Content-Type application/json, got {kind or 'none'!r}"
            )
        limit = self.max_request_bytes
        too_large = ApiError(
            413,
            f"body: larger than this server's limit of {limit} bytes (--max-request-bytes)",
        )
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0

        async def read():
            nonlocal size
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)

        try:
            await asyncio.wait_for(read(), self.body_timeout)
        except TimeoutError:
            raise ApiError(
                408,
                f"body: {size} bytes arrived in {self.body_timeout:g} s, the rest did not "
                "(--body-timeout)",
            ) from None
        return b"".join(chunks)
