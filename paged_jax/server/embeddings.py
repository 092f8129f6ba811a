"""``/v1/embeddings`` (``EmbeddingsRoute``, a part of the ``Server``): OpenAI's embeddings
route on ``LLM.embed``, run on the engine thread between steps, a step's worth of tokens
at a time. No JAX here."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from paged_jax.server.fields import ApiError, error_response
from paged_jax.server.schema import api_error


class EmbeddingsRoute:
    """The server's embeddings route, over its other parts: the ``Intake`` (key, body),
    the ``RequestParser``, the ``EngineLoop`` that runs ``LLM.embed`` between steps and
    the ``Metrics``; ``pooling``: how the hidden states are pooled (``LLM.embed``'s)."""

    def __init__(self, llm, intake, parser, loop, metrics, pooling: str):
        self.llm, self.intake, self.parser = llm, intake, parser
        self.loop, self.metrics, self.pooling = loop, metrics, pooling

    async def answer(self, request: Request) -> Response:
        """OpenAI's ``POST /v1/embeddings``: ``input`` (a string, token ids, or a list of
        either) to one vector per input, the final hidden states pooled as
        ``embedding_pooling`` says and L2-normalized (``LLM.embed``), run on the engine
        thread between steps; ``dimensions`` keeps the first that many (renormalized,
        for models trained to allow it), ``encoding_format`` ``"float"`` or ``"base64"``
        (little-endian f32)."""
        if (denied := self.intake.auth(request)) is not None:
            self.metrics.request("embeddings", 401)
            return denied
        try:
            raw = await self.intake.read_body(request)
            job = await asyncio.to_thread(self.parser.embeddings, raw)
        except ApiError as e:
            self.metrics.request("embeddings", e.status)
            return error_response(e.status, e.message, e.param)
        loop = asyncio.get_running_loop()
        pooling = self.pooling

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
            budget = self.llm.schedulers[0].max_num_batched_tokens
            for group in _by_budget(job.prompts, budget):
                outputs += await embed(group)
        except (ValueError, TypeError) as e:
            self.metrics.request("embeddings", 400)
            e = api_error(e, {"prompt": "input"})
            return error_response(e.status, e.message, e.param)
        except RuntimeError as e:
            self.metrics.request("embeddings", 503)
            return error_response(503, f"server busy: {e}")
        data = []
        for k, out in enumerate(outputs):
            v = out.embedding
            if job.dimensions is not None:
                v = v[: job.dimensions]
                v = v / n if (n := float(np.linalg.norm(v))) > 0 else v
            if job.base64:
                value = base64.b64encode(v.astype("<f4").tobytes()).decode()
            else:
                value = v.tolist()
            data.append({"object": "embedding", "index": k, "embedding": value})
        tokens = sum(len(p) for p in job.prompts)
        self.metrics.request("embeddings", 200)
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "model": job.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )


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
