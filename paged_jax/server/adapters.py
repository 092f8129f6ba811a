"""LoRA adapters loaded and unloaded while the server runs (``AdapterRoutes``, a part of the
``Server``): vLLM's ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``. No
JAX here.

On only when the server was given directories adapters may be read from
(``--lora-allowed-dir``, ``Server(lora_dirs=)``): a path that resolves outside them is
refused, so a client with the API key cannot make the server read files elsewhere. The
engine registers or drops the adapter on its own thread between steps (``EngineLoop.
call``), so requests in flight are not touched; an adapter that unfinished requests use
is not unloaded (409).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import pathlib
from collections.abc import Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from paged_jax.server.fields import ApiError, error_response, json_body
from paged_jax.server.schema import LoraRequest, validated


class AdapterRoutes:
    """The server's adapter routes, over its ``Intake`` (key, body), the ``EngineLoop``
    (which runs ``LLM.add_lora`` / ``remove_lora`` between steps) and ``Metrics``;
    ``model_name``: the base model's served name (no adapter may take it); ``dirs``: the
    directories adapters may be loaded from (empty: loading at run time is off)."""

    def __init__(self, llm, intake, loop, metrics, model_name: str, dirs: Sequence[Any] = ()):
        self.llm, self.intake, self.loop, self.metrics = llm, intake, loop, metrics
        self.model_name = model_name
        self.dirs = [pathlib.Path(d).resolve() for d in dirs]
        for d in self.dirs:
            if not d.is_dir():
                raise ValueError(f"lora_dirs: {d} is not a directory")

    async def load(self, request: Request) -> Response:
        """``{"lora_name": name, "lora_path": dir}``: the PEFT adapter in ``dir`` (inside
        an allowed directory) registered as ``name``, served as a model of its own."""
        return await self._answer(request, "load_lora_adapter", self._load)

    async def unload(self, request: Request) -> Response:
        """``{"lora_name": name}``: the adapter dropped (409 while requests use it)."""
        return await self._answer(request, "unload_lora_adapter", self._unload)

    def _load(self, req: LoraRequest) -> str:
        name = req.lora_name
        if name == self.model_name:
            raise ApiError(400, f"lora_name: {name!r} is the base model's name", "lora_name")
        if name in getattr(self.llm, "loras", []):
            raise ApiError(400, f"lora_name: an adapter named {name!r} is loaded", "lora_name")
        path = req.lora_path
        if path is None:
            raise ApiError(400, "lora_path: required", "lora_path")
        where = pathlib.Path(path).resolve()
        if not any(where == d or d in where.parents for d in self.dirs):
            raise ApiError(
                400, f"lora_path: {path} is outside the directories adapters may be loaded "
                "from (--lora-allowed-dir)", "lora_path",
            )  # fmt: skip
        if not (where / "adapter_config.json").is_file():
            raise ApiError(400, f"lora_path: {path} holds no adapter_config.json", "lora_path")
        self._on_engine(lambda: self.llm.add_lora(name, os.fspath(where)), "lora_path")
        return f"Success: LoRA adapter '{name}' added successfully."

    def _unload(self, req: LoraRequest) -> str:
        name = req.lora_name
        if name not in getattr(self.llm, "loras", []):
            raise ApiError(404, f"lora_name: no adapter named {name!r} is loaded", "lora_name")
        self._on_engine(lambda: self.llm.remove_lora(name), "lora_name", busy=409)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _on_engine(self, fn, param: str, busy: int = 400) -> None:
        """``fn()`` on the engine thread between steps, waited for (this runs on a worker
        thread); its ValueError / TypeError a 400 (``busy`` when requests use the adapter)
        naming ``param``."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def settle(result, error) -> None:
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

        try:
            self.loop.call(fn, settle)
            future.result()
        except RuntimeError as e:
            raise ApiError(503, f"server busy: {e}") from None
        except (ValueError, TypeError) as e:
            status = busy if "unfinished requests use" in str(e) else 400
            raise ApiError(status, f"{param}: {e}", param) from None

    async def _answer(self, request: Request, route: str, fn) -> Response:
        if (denied := self.intake.auth(request)) is not None:
            self.metrics.request(route, 401)
            return denied
        if not self.dirs:
            self.metrics.request(route, 404)
            return error_response(
                404, "loading LoRA adapters at run time is off (start the server with "
                "--lora-allowed-dir DIR)",
            )  # fmt: skip
        try:
            raw = await self.intake.read_body(request)
            req = validated(LoraRequest, json_body(raw))
            text = await asyncio.to_thread(fn, req)
        except ApiError as e:
            self.metrics.request(route, e.status)
            return error_response(e.status, e.message, e.param)
        self.metrics.request(route, 200)
        return PlainTextResponse(text)
