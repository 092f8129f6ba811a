"""OpenAI-compatible HTTP routes on the engine loop (Starlette, served by uvicorn).

Starlette rather than FastAPI: every field of an OpenAI request is checked here, so that
a bad one gets OpenAI's error body with status 400 naming the field (FastAPI's pydantic
models would answer 422 in their own format), and nothing else of FastAPI would be used.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import Mapping
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from paged_jax.chat import render_prompt
from paged_jax.engine.embedding import POOLINGS
from paged_jax.engine.sampling import MAX_TOP_LOGPROBS, SamplingParams
from paged_jax.server.answers import Answers
from paged_jax.server.embeddings import Embeddings
from paged_jax.server.fields import (
    ApiError,
    _param_of,
    error_response,
    json_body,
    structured_output,
    template_kwargs,
    turn_fields,
)
from paged_jax.server.loop import EngineLoop, Event, Overloaded
from paged_jax.server.metrics import Metrics
from paged_jax.server.reasoning import PARSERS, prompt_starts_inside
from paged_jax.server.tools import FORMATS, ToolError, ToolRequest, detect_format

# OpenAI fields this server takes (besides model, prompt / messages, stream)
_SAMPLING = {
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "n": "n",
    "stop": "stop",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "logit_bias": "logit_bias",
    # vLLM's extensions
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "ignore_eos": "ignore_eos",
    "include_stop_str_in_output": "include_stop_str_in_output",
    "allowed_token_ids": "allowed_token_ids",
    "stop_token_ids": "stop_token_ids",
    "min_tokens": "min_tokens",
}
# accepted only at their default (value -> "why not")
_UNSUPPORTED = {
    "suffix": (None, "suffixes are not supported"),
    "functions": (None, "functions are not supported"),
}


# OpenAI's message roles ("developer": its newer name for "system").
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def default_max_request_bytes(max_model_len: int) -> int:
    """The largest request body the server reads by default: 64 bytes per token of the
    model's context (a prompt's text, JSON-escaped, or its token ids), at least 1 MiB."""
    return max(2**20, 64 * max_model_len)


def _prompt_list(prompt: Any) -> Any:
    """Completions' ``prompt`` as a list of prompts: itself when it is one (a non-empty
    list of strings or of token-id lists), else ``[prompt]`` (one string, or one list of
    token ids)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return prompt
    return [prompt]


class Server(Answers, Embeddings):
    """The routes of one served model; ``app`` is the ASGI application.

    ``max_request_bytes``: larger bodies are refused (413) before they are read whole
    (default ``default_max_request_bytes``). ``body_timeout``: seconds a request's body
    may take to arrive once its headers have (408 after). ``tool_call_parser``: the
    format the model writes tool calls in (``tools.FORMATS``; None: from its chat
    template, ``tools.detect_format``). ``reasoning_parser``: one of
    ``reasoning.PARSERS`` puts a chat reply's thinking (``<think>`` ... ``</think>``) in
    ``reasoning_content``; None leaves it in the content. ``embedding_pooling``: how
    ``/v1/embeddings`` pools the hidden states (``LLM.embed``'s ``pooling``). Request
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
    ):
        if embedding_pooling not in POOLINGS:
            raise ValueError(
                f"embedding_pooling: expected one of {POOLINGS}, got {embedding_pooling!r}"
            )
        self.embedding_pooling = embedding_pooling
        if reasoning_parser not in (None, *PARSERS):
            raise ValueError(
                f"reasoning_parser: expected one of {PARSERS} or None, got {reasoning_parser!r}"
            )
        self.reasoning_parser = reasoning_parser
        if tool_call_parser not in (None, *FORMATS):
            raise ValueError(
                f"tool_call_parser: expected one of {FORMATS} or None, got {tool_call_parser!r}"
            )
        # the tool-call format of the model's replies (tools.py), from its chat template
        template = getattr(llm.tokenizer, "chat_template", None)
        self.tool_format = tool_call_parser or detect_format(
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
        self.max_request_bytes = max_request_bytes
        self.body_timeout = float(body_timeout)
        self.llm = llm
        self.model_name = model_name
        self.api_key = api_key
        self.metrics = Metrics()
        self.metrics.step(llm)  # the engine as it starts (its warm-up's buckets compiled)
        self.loop = EngineLoop(
            llm,
            max_waiting=max_waiting,
            on_tokens=self.metrics.tokens,
            on_step=self.metrics.step,
        )
        self.created = int(time.time())

        @contextlib.asynccontextmanager
        async def lifespan(app):
            self.loop.start()
            try:
                yield
            finally:
                await asyncio.to_thread(self.loop.stop)

        self.app = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.scrape, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/embeddings", self.embeddings, methods=["POST"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
                Route("/tokenizer_info", self.tokenizer_info, methods=["GET"]),
            ],
            lifespan=lifespan,
            exception_handlers={HTTPException: self._http_error, Exception: self._crash},
            # Host headers other than these are refused (a DNS-rebinding page's requests
            # name its own host); None: any
            middleware=[]
            if allowed_hosts is None
            else [Middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts))],
        )

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

    async def scrape(self, request: Request) -> Response:
        body, content_type = self.metrics.render(self.loop.in_flight)
        return Response(body, media_type=content_type)

    async def models(self, request: Request) -> Response:
        if (denied := self._auth(request)) is not None:
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

    def _lora_of(self, model: Any) -> str | None:
        """The LoRA adapter a request's ``model`` names (None: the base model); a 404
        ApiError naming what this server serves for any other name."""
        if model == self.model_name:
            return None
        loras = getattr(self.llm, "loras", [])
        if model in loras:
            return model
        served = ", ".join(map(repr, [self.model_name, *loras]))
        raise ApiError(404, f"model: {model!r:.80} does not exist; this server serves {served}",
                       "model")  # fmt: skip

    def _auth(self, request: Request) -> Response | None:
        if self.api_key is None:
            return None
        if request.headers.get("authorization", "") != f"Bearer {self.api_key}":
            return error_response(401, "api key: missing or wrong (Authorization: Bearer KEY)")
        return None

    # ------------------------------------------------------------------ vLLM's extras
    async def tokenize(self, request: Request) -> Response:
        """vLLM's ``POST /tokenize``: ``{"prompt": text}`` (``add_special_tokens``, default
        true) or ``{"messages": [...]}`` (``add_generation_prompt``, default true) to
        ``{"count", "max_model_len", "tokens", "token_strs": null}``."""
        return await self._extra(request, self._tokenize)

    async def detokenize(self, request: Request) -> Response:
        """vLLM's ``POST /detokenize``: ``{"tokens": [ids]}`` to ``{"prompt": text}``."""
        return await self._extra(request, self._detokenize)

    async def tokenizer_info(self, request: Request) -> Response:
        """vLLM's ``GET /tokenizer_info``: the tokenizer's special tokens' text (None where
        it has none), its chat template and the context length. With ``/tokenize`` and
        ``/detokenize`` it is what lm-evaluation-harness's remote tokenizer reads, so a
        served GGUF model needs no Hugging Face tokenizer beside it."""
        if (denied := self._auth(request)) is not None:
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
        if (denied := self._auth(request)) is not None:
            return denied
        try:
            raw = await self._read_body(request)
            return JSONResponse(await asyncio.to_thread(answer, raw))
        except ApiError as e:
            return error_response(e.status, e.message, e.param)

    def _body(self, raw: bytes) -> Mapping:
        body = json_body(raw)
        if not isinstance(body, Mapping):
            raise ApiError(400, "body: expected a JSON object")
        model = body.get("model")
        if model is not None:
            self._lora_of(model)  # (the tokenizer is the base model's for every adapter)
        return body

    def _tokenize(self, raw: bytes) -> dict:
        body = self._body(raw)
        if "messages" in body:
            generation = body.get("add_generation_prompt", True)
            if not isinstance(generation, bool):
                raise ApiError(
                    400, "add_generation_prompt: expected a bool", "add_generation_prompt"
                )
            ids = self._chat_prompt(body["messages"], add_generation_prompt=generation)
        else:
            prompt, special = body.get("prompt"), body.get("add_special_tokens", True)
            if not isinstance(prompt, str):
                raise ApiError(400, f"prompt: expected a string, got {prompt!r:.80}", "prompt")
            if not isinstance(special, bool):
                raise ApiError(400, "add_special_tokens: expected a bool", "add_special_tokens")
            ids = self._encode(prompt, "prompt", special)
        return {
            "count": len(ids),
            "max_model_len": self.llm.max_model_len,
            "tokens": ids,
            "token_strs": None,
        }

    def _detokenize(self, raw: bytes) -> dict:
        tokens = self._body(raw).get("tokens")
        vocab = self.llm.model.config.vocab_size
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens
        ):
            raise ApiError(400, f"tokens: expected a list of token ids in [0, {vocab})", "tokens")
        return {"prompt": self.llm.tokenizer.decode(tokens)}

    def _encode(self, text: str, where: str, special: bool = True) -> list[int]:
        """``text``'s token ids (with the tokenizer's special tokens when ``special``)."""
        try:
            if special:  # the tokenizer's default, as for generation
                return self.llm.encode(text)
            ids = self.llm.tokenizer.encode(text, add_special_tokens=False)
        except ValueError as e:  # UnicodeEncodeError: a lone surrogate, say
            raise ApiError(400, f"{where}: cannot be tokenized ({e})", "prompt") from None
        return list(getattr(ids, "ids", ids))

    # ------------------------------------------------------------------ generation
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        if (denied := self._auth(request)) is not None:
            self.metrics.request(endpoint, 401)
            return denied
        try:
            raw = await self._read_body(request)
            # decoding, tokenizing and chat templates off the event loop
            job = await asyncio.to_thread(self._decode_and_parse, raw, chat)
        except ApiError as e:
            self.metrics.request(endpoint, e.status)
            return error_response(e.status, e.message, e.param)
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        rids = [f"{job['id']}-{k}" for k in range(len(job["prompts"]))]
        try:
            for k, (rid, ids) in enumerate(zip(rids, job["prompts"], strict=True)):

                def notify(event: Event, k=k) -> None:
                    loop.call_soon_threadsafe(queue.put_nowait, (k, event))

                self.loop.submit(
                    rid, ids, job["params"], notify, stream=job["stream"], lora=job["lora"]
                )
        except (Overloaded, RuntimeError) as e:
            for rid in rids[:k]:
                self.loop.abort(rid)
            status = 429 if isinstance(e, Overloaded) else 503
            self.metrics.request(endpoint, status)
            return error_response(status, f"server busy: {e}")
        if job["stream"]:
            return StreamingResponse(
                self._stream(job, rids, queue, endpoint), media_type="text/event-stream"
            )
        return await self._collect(request, job, rids, queue, endpoint)

    async def _read_body(self, request: Request) -> bytes:
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

    def _decode_and_parse(self, raw: bytes, chat: bool) -> dict:
        return self._parse(json_body(raw), chat)

    def _parse(self, body: Any, chat: bool) -> dict:
        if not isinstance(body, Mapping):
            raise ApiError(400, "body: expected a JSON object")
        model = body.get("model")
        if not isinstance(model, str):
            raise ApiError(400, f"model: expected a string, got {model!r}", "model")
        lora = self._lora_of(model)
        for name, (default, why) in _UNSUPPORTED.items():
            if body.get(name, default) not in (default, None, {}, [], {"type": "text"}):
                raise ApiError(400, f"{name}: {why}", name)
        n = body.get("n", 1)
        if "best_of" in body and body["best_of"] not in (None, n):
            raise ApiError(400, "best_of: only best_of == n is supported", "best_of")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, f"stream: expected a bool, got {stream!r}", "stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, Mapping) or not isinstance(
            options.get("include_usage", False), bool
        ):
            raise ApiError(400, "stream_options: expected {include_usage: bool}", "stream_options")
        logprobs, top_logprobs = self._logprobs(body, chat)
        echo = body.get("echo", False)
        if echo not in (None, True, False):
            raise ApiError(400, f"echo: expected a bool, got {echo!r:.40}", "echo")
        if echo and chat:
            raise ApiError(400, "echo: only /v1/completions echoes its prompt", "echo")
        echo = bool(echo)
        scored = body.get("prompt_logprobs")  # vLLM's extension: the prompt's log-probs
        most = MAX_TOP_LOGPROBS
        if scored is not None and (
            isinstance(scored, bool) or not isinstance(scored, int) or not 0 <= scored <= most
        ):
            raise ApiError(
                400,
                f"prompt_logprobs: expected an int in [0, {most}], got {scored!r:.40}",
                "prompt_logprobs",
            )
        if scored is not None and body.get("stream"):
            raise ApiError(400, "prompt_logprobs: not with stream", "prompt_logprobs")
        tools = None
        if chat:
            try:
                tools = ToolRequest.of(body, self.tool_format)
            except ToolError as e:
                raise ApiError(400, str(e), e.param) from None
            args = template_kwargs(body.get("chat_template_kwargs"))
            args.update({} if tools is None else tools.template_args())
            generation, go_on = turn_fields(body)
            prompts = [self._chat_prompt(body.get("messages"), generation, go_on, **args)]
        else:
            prompts = self._prompts(body.get("prompt"))
        for ids in prompts:
            if len(ids) >= self.llm.max_model_len:
                raise ApiError(
                    400,
                    f"{'messages' if chat else 'prompt'}: {len(ids)} tokens, the model's "
                    f"maximum length is {self.llm.max_model_len} (one more is needed to "
                    f"generate)",
                    "messages" if chat else "prompt",
                )
        kw: dict[str, Any] = {"temperature": 1.0}  # OpenAI's default
        for name, field in _SAMPLING.items():
            if body.get(name) is not None:
                kw[field] = body[name]
        for name in ("stop", "allowed_token_ids", "stop_token_ids"):
            if isinstance(kw.get(name), list):
                kw[name] = tuple(kw[name])
        longest = max(len(ids) for ids in prompts)
        # echo with max_tokens 0: the prompt (and its log-probs) only; the engine samples
        # one token, which the answer leaves out
        echo_only = echo and kw.get("max_tokens") == 0
        if echo_only:
            kw["max_tokens"] = 1
        if "max_tokens" not in kw:  # chat: up to the context; completions: OpenAI's 16
            kw["max_tokens"] = self.llm.max_model_len - longest if chat else 16
        elif isinstance(kw["max_tokens"], int) and longest + kw["max_tokens"] > (
            self.llm.max_model_len
        ):
            raise ApiError(
                400,
                f"max_tokens: the prompt's {longest} tokens and max_tokens {kw['max_tokens']} "
                f"make {longest + kw['max_tokens']}, more than the model's maximum length of "
                f"{self.llm.max_model_len} tokens",
                "max_tokens",
            )
        source, structured = structured_output(body) or (None, None)
        grammar = None if tools is None else tools.grammar()
        if grammar is not None:  # tool_choice required or named: calls only
            if structured is not None:
                raise ApiError(
                    400,
                    "tool_choice: not with response_format or structured_outputs",
                    "tool_choice",
                )
            from paged_jax.engine.structured import StructuredOutput

            source, structured = "tools", StructuredOutput(grammar=grammar)
        # with a reasoning parser: whether the reply starts inside its thinking
        inside = (
            prompt_starts_inside(self.llm, prompts[0])
            if chat and self.reasoning_parser is not None
            else None
        )
        # the thinking comes first, free; a Lark grammar of the client's own holds the
        # whole reply (it can describe the thinking itself), the tools' grammar does not
        thinks = structured is not None and (structured.kind != "grammar" or grammar is not None)
        if thinks and inside is not None:
            structured = dataclasses.replace(structured, think="inside" if inside else "optional")
        if structured is not None:
            kw["structured"] = structured
        if echo and logprobs:  # the prompt's tokens get log-probs too
            kw["prompt_logprobs"] = top_logprobs
        if scored is not None:
            kw["prompt_logprobs"] = max(scored, kw.get("prompt_logprobs", 0))
        try:
            params = SamplingParams(logprobs=logprobs, top_logprobs=top_logprobs, **kw)
            for ids in prompts:  # the engine's limits, before any answer starts (a stream's
                self.llm.check_request(ids, params)  # 200 could not become a 400 later)
        except (ValueError, TypeError) as e:
            message = str(e)
            if message.startswith("params.structured") and source is not None:
                # a grammar the engine could not compile: the field that asked for it
                message = f"{source}: {message.partition(': ')[2]}"
            raise ApiError(400, message, _param_of(message)) from None
        return dict(
            id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
            model=model,
            lora=lora,
            chat=chat,
            prompts=prompts,
            params=params,
            stream=stream,
            tools=tools if tools is not None and tools.active else None,
            reasoning=inside,
            include_usage=bool(options.get("include_usage", False)),
            logprobs=logprobs,
            echo=self._prompt_texts(body.get("prompt"), prompts) if echo else None,
            echo_only=echo_only,
            prompt_logprobs=scored,
            created=int(time.time()),
        )

    def _prompt_texts(self, prompt: Any, prompts: list[list[int]]) -> list[str]:
        """What ``echo`` repeats of each prompt: its text as given, or for token ids their
        decoded text."""
        given = _prompt_list(prompt)
        return [
            p if isinstance(p, str) else self.llm.decode(ids) or ""
            for p, ids in zip(given, prompts, strict=True)
        ]

    def _logprobs(self, body: Mapping, chat: bool) -> tuple[bool, int]:
        """(log-probs of the sampled tokens, how many most likely tokens with each):
        completions' ``logprobs`` (an int, 0 for the sampled tokens only), chat's
        ``logprobs`` (a bool) and ``top_logprobs`` (an int; needs ``logprobs``)."""
        value = body.get("logprobs")
        most = MAX_TOP_LOGPROBS
        if chat:
            if value not in (None, True, False):
                raise ApiError(400, f"logprobs: expected a bool, got {value!r}", "logprobs")
            top = body.get("top_logprobs")
            if top is None:
                return bool(value), 0
            if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= most:
                raise ApiError(
                    400,
                    f"top_logprobs: expected an int in [0, {most}], got {top!r}",
                    "top_logprobs",
                )
            if top and not value:
                raise ApiError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
            return bool(value), top
        if value is None:
            return False, 0
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= most:
            raise ApiError(
                400, f"logprobs: expected an int in [0, {most}], got {value!r}", "logprobs"
            )
        return True, value

    def _prompts(self, prompt: Any, field: str = "prompt") -> list[list[int]]:
        def one(p: Any, where: str) -> list[int]:
            if isinstance(p, str):
                ids = self._encode(p, where)
            elif isinstance(p, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in p
            ):
                ids = list(p)
            else:
                raise ApiError(
                    400,
                    f"{where}: expected a string or a list of token ids, got {p!r:.80}",
                    field,
                )
            if not ids:
                raise ApiError(400, f"{where}: expected at least one token", field)
            vocab = self.llm.model.config.vocab_size
            if not all(0 <= t < vocab for t in ids):
                raise ApiError(400, f"{where}: token ids must lie in [0, {vocab})", field)
            return ids

        given = _prompt_list(prompt)
        if given is prompt:  # a list of prompts
            return [one(p, f"{field}[{k}]") for k, p in enumerate(prompt)]
        return [one(prompt, field)]

    def _chat_prompt(
        self, messages: Any, add_generation_prompt: bool = True, go_on: bool = False,
        **template_args,
    ) -> list[int]:  # fmt: skip
        if isinstance(messages, list):  # content as a list of text parts
            flat = []
            for i, m in enumerate(messages):
                if isinstance(m, Mapping) and isinstance(m.get("content"), list):
                    parts = m["content"]
                    if not all(isinstance(p, Mapping) and p.get("type") == "text" for p in parts):
                        raise ApiError(
                            400, f"messages[{i}].content: only text parts are supported", "messages"
                        )
                    for j, p in enumerate(parts):
                        if not isinstance(p.get("text", ""), str):
                            raise ApiError(
                                400,
                                f"messages[{i}].content[{j}].text: expected a string, got "
                                f"{type(p['text']).__name__}",
                                "messages",
                            )
                    m = {**m, "content": "".join(p.get("text", "") for p in parts)}
                flat.append(m)
            messages = flat
        if isinstance(messages, list):
            for i, m in enumerate(messages):
                role = m.get("role") if isinstance(m, Mapping) else None
                if not isinstance(role, str) or role not in _ROLES:
                    raise ApiError(
                        400,
                        f"messages[{i}].role: expected one of {', '.join(sorted(_ROLES))}, "
                        f"got {role!r:.40}",
                        "messages",
                    )
        if getattr(self.llm.tokenizer, "chat_template", None) is None:
            raise ApiError(
                400,
                "messages: this model has no chat template; use /v1/completions",
                "messages",
            )
        try:
            return render_prompt(
                self.llm.tokenizer,
                messages,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=go_on,
                **template_args,
            )
        except (TypeError, ValueError) as e:
            raise ApiError(400, str(e), "messages") from None
