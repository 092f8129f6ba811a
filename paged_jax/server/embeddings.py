"""``/v1/embeddings`` (``Embeddings``, a mixin of ``Server``): OpenAI's embeddings route on
``LLM.embed``, run on the engine thread between steps, a step's worth of tokens at a time.
No JAX here."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Mapping

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from paged_jax.server.fields import ApiError, _param_of, error_response, json_body


class Embeddings:
    """``Server``'s embeddings route; reads ``self.llm``, ``self.loop``, ``self.metrics``,
    ``self.model_name``, ``self.embedding_pooling`` and the server's request helpers
    (``_auth``, ``_read_body``, ``_lora_of``, ``_prompts``)."""

    async def embeddings(self, request: Request) -> Response:
        """OpenAI's ``POST /v1/embeddings``: ``input`` (a string, token ids, or a list of
        either) to one vector per input, the final hidden states pooled as
        ``embedding_pooling`` says and L2-normalized (``LLM.embed``), run on the engine
        thread between steps; ``dimensions`` keeps the first that many (renormalized,
        for models trained to allow it), ``encoding_format`` ``"float"`` or ``"base64"``
        (little-endian f32)."""
        if (denied := self._auth(request)) is not None:
            self.metrics.request("embeddings", 401)
            return denied
        try:
            raw = await self._read_body(request)
            job = await asyncio.to_thread(self._parse_embeddings, raw)
        except ApiError as e:
            self.metrics.request("embeddings", e.status)
            return error_response(e.status, e.message, e.param)
        loop = asyncio.get_running_loop()
        pooling = self.embedding_pooling

        async def embed(prompts):
            """``LLM.embed`` of ``prompts`` on the engine thread, between its steps."""
            answer: asyncio.Future = loop.create_future()

            def done(result, error) -> None:
                def settle():
                    if not answer.done():
                        if error is None:
                            answer.set_result(result)
                        else:
                            answer.set_exception(error)

                loop.call_soon_threadsafe(settle)

            self.loop.call(lambda: self.llm.embed(prompts, pooling=pooling), done)
            return await answer

        outputs = []
        try:
            # a step's worth of tokens at a time, so that the engine's steps for requests
            # in flight go on between them (a large request does not stall their streams)
            for group in _by_budget(job["prompts"], self.llm.schedulers[0].max_num_batched_tokens):
                outputs += await embed(group)
        except (ValueError, TypeError) as e:
            self.metrics.request("embeddings", 400)
            return error_response(400, str(e), _param_of(str(e)))
        except RuntimeError as e:
            self.metrics.request("embeddings", 503)
            return error_response(503, f"server busy: {e}")
        data = []
        for k, out in enumerate(outputs):
            v = out.embedding
            if job["dimensions"] is not None:
                v = v[: job["dimensions"]]
                v = v / n if (n := float(np.linalg.norm(v))) > 0 else v
            if job["base64"]:
                value = base64.b64encode(v.astype("<f4").tobytes()).decode()
            else:
                value = v.tolist()
            data.append({"object": "embedding", "index": k, "embedding": value})
        tokens = sum(len(p) for p in job["prompts"])
        self.metrics.request("embeddings", 200)
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "model": job["model"],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    def _parse_embeddings(self, raw: bytes) -> dict:
        body = json_body(raw)
        if not isinstance(body, Mapping):
            raise ApiError(400, "body: expected a JSON object")
        model = body.get("model")
        if not isinstance(model, str):
            raise ApiError(400, f"model: expected a string, got {model!r}", "model")
        if self._lora_of(model) is not None:
            raise ApiError(
                400, f"model: embeddings come from the base model {self.model_name!r}", "model"
            )
        given = body.get("input")
        if isinstance(given, list) and not given:
            raise ApiError(400, "input: expected at least one input", "input")
        prompts = self._prompts(given, "input")
        for k, ids in enumerate(prompts):
            if len(ids) >= self.llm.max_model_len:
                raise ApiError(
                    400,
                    f"input[{k}]: {len(ids)} tokens, more than the model's maximum length of "
                    f"{self.llm.max_model_len - 1} for an input",
                    "input",
                )
        fmt = body.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise ApiError(
                400, f'encoding_format: expected "float" or "base64", got {fmt!r:.40}',
                "encoding_format",
            )  # fmt: skip
        dims = body.get("dimensions")
        size = self.llm.model.config.hidden_size
        if dims is not None and (
            isinstance(dims, bool) or not isinstance(dims, int) or not 1 <= dims <= size
        ):
            raise ApiError(
                400, f"dimensions: expected an int in [1, {size}], got {dims!r:.40}", "dimensions"
            )
        return dict(model=model, prompts=prompts, base64=fmt == "base64", dimensions=dims)


def _by_budget(prompts: list[list[int]], budget: int) -> list[list[list[int]]]:
    """``prompts`` in order, in groups of at most ``budget`` tokens (a longer prompt alone)."""
    groups: list[list[list[int]]] = []
    used = budget
    for p in prompts:
        if used + len(p) > budget:
            groups.append([])
            used = 0
        groups[-1].append(p)
        used += len(p)
    return groups
