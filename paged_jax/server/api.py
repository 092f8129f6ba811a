"""OpenAI-compatible HTTP routes on the engine loop (Starlette, served by uvicorn).

``Server`` owns its parts: the ``Intake`` (API key, body limits), the ``RequestParser``
(``jobs.py``: a body into a checked ``Job``), the ``EngineLoop`` (``loop.py``: the engine
on its thread), the ``Responder`` (``answers.py``: events into responses), the
``EmbeddingsRoute`` (``embeddings.py``) and the ``Metrics`` (``metrics.py``).

Starlette rather than FastAPI: every field of an OpenAI request is checked here, so that
a bad one gets OpenAI's error body with status 400 naming the field (FastAPI's pydantic
models would answer 422 in their own format), and nothing else of FastAPI would be used.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from paged_jax.engine.embedding import POOLINGS
from paged_jax.server.adapters import AdapterRoutes
from paged_jax.server.answers import Responder
from paged_jax.server.embeddings import EmbeddingsRoute
from paged_jax.server.fields import ApiError, error_response
from paged_jax.server.intake import Intake
from paged_jax.server.jobs import RequestParser
from paged_jax.server.loop import EngineLoop, Event, Overloaded
from paged_jax.server.metrics import Metrics
from paged_jax.server.reasoning import PARSERS
from paged_jax.server.tools import FORMATS, detect_format


def default_max_request_bytes(max_model_len: int) -> int:
    """The largest request body the server reads by default: 64 bytes per token of the
    model's context (a prompt's text, JSON-escaped, or its token ids), at least 1 MiB."""
    return max(2**20, 64 * max_model_len)


class Server:
    """The routes of one served model; ``app`` is the ASGI application.

    ``max_request_bytes``: larger bodies are refused (413) before they are read whole
    (default ``default_max_request_bytes``). ``body_timeout``: seconds a request's body
    may take to arrive once its headers have (408 after). ``tool_call_parser``: the
    format the model writes tool calls in (``tools.FORMATS``; None: from its chat
    template, ``tools.detect_format``). ``reasoning_parser``: one of
    ``reasoning.PARSERS`` puts a chat reply's thinking (``<think>`` ... ``</think>``) in
    ``reasoning_content``; None leaves it in the content. ``embedding_pooling``: how
    ``/v1/embeddings`` pools the hidden states (``LLM.embed``'s ``pooling``).
    ``lora_dirs``: directories LoRA adapters may be loaded from at run time
    (``adapters.AdapterRoutes``; None: loading at run time is off). ``kv_events``: a
    ``kv_events.KVEventsConfig`` (or its JSON text or dict) whose events are published
    while the server runs (None, or not enabled: none). Request
    bodies are decoded, tokenized and their chat templates rendered on worker threads,
    never on the event loop, so one large request does not hold up the others' routes.
    """

    def __init__(
        self,
        llm: Any,
        *,
        model_name: str,
        api_key: str | None = None,
        max_waiting: int = 256,
        max_request_bytes: int | None = None,
        allowed_hosts: list[str] | None = None,
        body_timeout: float = 60.0,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        embedding_pooling: str = "last",
        lora_dirs: list | None = None,
        kv_events: Any = None,
    ):
        if embedding_pooling not in POOLINGS:
            raise ValueError(
                f"embedding_pooling: expected one of {POOLINGS}, got {embedding_pooling!r}"
            )
        if reasoning_parser not in (None, *PARSERS):
            raise ValueError(
                f"reasoning_parser: expected one of {PARSERS} or None, got {reasoning_parser!r}"
            )
        if tool_call_parser not in (None, *FORMATS):
            raise ValueError(
                f"tool_call_parser: expected one of {FORMATS} or None, got {tool_call_parser!r}"
            )
        # the tool-call format of the model's replies (tools.py), from its chat template
        template = getattr(llm.tokenizer, "chat_template", None)
        tool_format = tool_call_parser or detect_format(
            template if isinstance(template, str) else None
        )
        if llm.tokenizer is None:
            raise ValueError("llm: the server needs a model with a tokenizer (it serves text)")
        if max_request_bytes is None:
            max_request_bytes = default_max_request_bytes(llm.max_model_len)
        if (
            isinstance(max_request_bytes, bool)
            or not isinstance(max_request_bytes, int)
            or max_request_bytes < 1024
        ):
            raise ValueError(
                f"max_request_bytes: expected an int >= 1024, got {max_request_bytes!r}"
            )
        if isinstance(body_timeout, bool) or not isinstance(body_timeout, (int, float)):
            raise TypeError(f"body_timeout: expected seconds, got {body_timeout!r}")
        if not body_timeout > 0:
            raise ValueError(f"body_timeout: expected seconds > 0, got {body_timeout!r}")
        self.llm = llm
        self.model_name = model_name
        self.metrics = Metrics()
        self.metrics.step(llm)  # the engine as it starts (its warm-up's buckets compiled)
        self.kv_events = _kv_events_feed(llm, kv_events)
        self.loop = EngineLoop(
            llm,
            max_waiting=max_waiting,
            on_tokens=self.metrics.tokens,
            on_step=self._on_step,
        )
        self.intake = Intake(api_key, max_request_bytes, float(body_timeout))
        self.parser = RequestParser(llm, model_name, tool_format, reasoning_parser)
        self.responder = Responder(llm.decode, self.loop, self.metrics)
        self.embeddings = EmbeddingsRoute(
            llm, self.intake, self.parser, self.loop, self.metrics, embedding_pooling
        )
        self.adapters = AdapterRoutes(
            llm, self.intake, self.loop, self.metrics, model_name, lora_dirs or ()
        )
        self.created = int(time.time())

        @contextlib.asynccontextmanager
        async def lifespan(app):
            self.loop.start()
            try:
                yield
            finally:
                await asyncio.to_thread(self.loop.stop)
                if self.kv_events is not None:
                    await asyncio.to_thread(self.kv_events.close)

        self.app = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.scrape, methods=["GET"]),
                Route("/get_load", self.load, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/embeddings", self.embeddings.answer, methods=["POST"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
                Route("/tokenizer_info", self.tokenizer_info, methods=["GET"]),
                Route("/v1/load_lora_adapter", self.adapters.load, methods=["POST"]),
                Route("/v1/unload_lora_adapter", self.adapters.unload, methods=["POST"]),
            ],
            lifespan=lifespan,
            exception_handlers={HTTPException: self._http_error, Exception: self._crash},
            # Host headers other than these are refused (a DNS-rebinding page's requests
            # name its own host); None: any
            middleware=[]
            if allowed_hosts is None
            else [Middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts))],
        )

    def _on_step(self, llm) -> None:
        """After each step (engine thread): the gauges, then the step's KV events."""
        self.metrics.step(llm)
        if self.kv_events is not None:
            self.kv_events.step(llm)

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        """Starlette's own answers (404: no such route, 405: a method the route does not
        take) as OpenAI's JSON errors."""
        what = {404: f"{request.url.path}: no such route", 405: f"{request.method}: not "
                f"allowed on {request.url.path}"}.get(exc.status_code, exc.detail)  # fmt: skip
        response = error_response(exc.status_code, what)
        for k, v in (exc.headers or {}).items():
            response.headers[k] = v
        return response

    async def _crash(self, request: Request, exc: Exception) -> Response:
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ simple routes
    async def health(self, request: Request) -> Response:
        if not self.loop.alive:
            return error_response(503, "the engine thread is not running")
        return JSONResponse({"status": "ok"})

    async def load(self, request: Request) -> Response:
        """``GET /get_load``: ``{"load": n}``, the requests in flight (accepted and not yet
        answered: running or waiting), which routers' load-aware policies poll
        (vllm-router's ``power_of_two``). Open like ``/health``."""
        return JSONResponse({"load": self.loop.in_flight})

    async def scrape(self, request: Request) -> Response:
        body, content_type = self.metrics.render(self.loop.in_flight)
        return Response(body, media_type=content_type)

    async def models(self, request: Request) -> Response:
        if (denied := self.intake.auth(request)) is not None:
            return denied
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "paged-jax",
            "max_model_len": self.llm.max_model_len,
        }
        # LoRA adapters (--lora-modules), each a model of its own with the base as parent
        adapters = [
            {**card, "id": name, "root": name, "parent": self.model_name}
            for name in getattr(self.llm, "loras", [])
        ]
        return JSONResponse({"object": "list", "data": [card, *adapters]})

    # ------------------------------------------------------------------ vLLM's extras
    async def tokenize(self, request: Request) -> Response:
        """vLLM's ``POST /tokenize``: ``{"prompt": text}`` (``add_special_tokens``, default
        true) or ``{"messages": [...]}`` (``add_generation_prompt``, default true) to
        ``{"count", "max_model_len", "tokens", "token_strs": null}``."""
        return await self._extra(request, self.parser.tokenize)

    async def detokenize(self, request: Request) -> Response:
        """vLLM's ``POST /detokenize``: ``{"tokens": [ids]}`` to ``{"prompt": text}``."""
        return await self._extra(request, self.parser.detokenize)

    async def tokenizer_info(self, request: Request) -> Response:
        """vLLM's ``GET /tokenizer_info``: the tokenizer's special tokens' text (None where
        it has none), its chat template and the context length. With ``/tokenize`` and
        ``/detokenize`` it is what lm-evaluation-harness's remote tokenizer reads, so a
        served GGUF model needs no Hugging Face tokenizer beside it."""
        if (denied := self.intake.auth(request)) is not None:
            return denied
        tok = self.llm.tokenizer
        special = getattr(tok, "special_tokens", None) or {}
        return JSONResponse(
            {
                "tokenizer_class": type(tok).__name__,
                "bos_token": special.get("bos_token"),
                "eos_token": special.get("eos_token"),
                "pad_token": special.get("pad_token"),
                "unk_token": special.get("unk_token"),
                "chat_template": getattr(tok, "chat_template", None),
                "model_max_length": self.llm.max_model_len,
            }
        )

    async def _extra(self, request: Request, answer) -> Response:
        if (denied := self.intake.auth(request)) is not None:
            return denied
        try:
            raw = await self.intake.read_body(request)
            return JSONResponse(await asyncio.to_thread(answer, raw))
        except ApiError as e:
            return error_response(e.status, e.message, e.param)

    # ------------------------------------------------------------------ generation
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        if (denied := self.intake.auth(request)) is not None:
            self.metrics.request(endpoint, 401)
            return denied
        try:
            raw = await self.intake.read_body(request)
            # decoding, tokenizing and chat templates off the event loop
            job = await asyncio.to_thread(self.parser.generation, raw, chat)
        except ApiError as e:
            self.metrics.request(endpoint, e.status)
            return error_response(e.status, e.message, e.param)
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        rids = [f"{job.id}-{k}" for k in range(len(job.prompts))]
        try:
            for k, (rid, ids) in enumerate(zip(rids, job.prompts, strict=True)):

                def notify(event: Event, k=k) -> None:
                    loop.call_soon_threadsafe(queue.put_nowait, (k, event))

                self.loop.submit(
                    rid, ids, job.params, notify, stream=job.stream, lora=job.lora,
                    priority=job.priority,
                )  # fmt: skip
        except (Overloaded, RuntimeError) as e:
            for rid in rids[:k]:
                self.loop.abort(rid)
            status = 429 if isinstance(e, Overloaded) else 503
            self.metrics.request(endpoint, status)
            return error_response(status, f"server busy: {e}")
        if job.stream:
            return StreamingResponse(
                self.responder.stream(job, rids, queue, endpoint), media_type="text/event-stream"
            )
        return await self.responder.collect(request, job, rids, queue, endpoint)


def _kv_events_feed(llm, config):
    """The server's ``kv_events.KVEventsFeed`` for ``config`` (a ``KVEventsConfig``, its
    JSON text or dict, or None), or None when events are off. pyzmq and msgspec are
    imported only then."""
    if config is None:
        return None
    from paged_jax.server import kv_events

    if not isinstance(config, kv_events.KVEventsConfig):
        config = kv_events.KVEventsConfig.parse(config)
    return kv_events.KVEventsFeed(llm, config) if config.active else None
