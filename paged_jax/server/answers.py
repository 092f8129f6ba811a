"""The server's answers (``Answers``, a mixin of ``Server``): a request's outputs as one
OpenAI response (``_collect``) or as server-sent events (``_stream``), with usage,
log-probs and tool calls. No JAX here."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

from starlette.responses import JSONResponse, Response

from paged_jax.server.fields import _ERROR_TYPES, _param_of, error_response
from paged_jax.server.reasoning import ReasoningStream, split


class Answers:
    """``Server``'s methods that turn engine events into responses (see the module
    docstring); they read ``self.llm``, ``self.loop``, ``self.metrics`` and
    ``self.model_name``."""

    # ------------------------------------------------------------------ answers
    def _choice_index(self, job: dict, k: int, sample: int) -> int:
        return k * job["params"].n + sample

    async def _collect(self, request, job, rids, queue, endpoint) -> Response:
        outputs: list[Any] = [None] * len(rids)
        while any(o is None for o in outputs):
            try:
                k, event = await asyncio.wait_for(queue.get(), timeout=0.5)
            except TimeoutError:
                if await request.is_disconnected():
                    self._abort(rids, outputs)
                    self.metrics.request(endpoint, 499)
                    return Response(status_code=499)
                continue
            if event.kind == "error":
                outputs[k] = event
                self._abort(rids, outputs)
                self.metrics.request(endpoint, event.status)
                return error_response(event.status, event.message, _param_of(event.message))
            if event.kind == "done":
                if event.output.error is not None:
                    outputs[k] = event
                    self._abort(rids, outputs)
                    self.metrics.request(endpoint, 500)
                    return error_response(
                        500, f"the engine failed the request: {event.output.error}"
                    )
                outputs[k] = event.output
                self.metrics.finished(event.output)
        choices = []
        for k, out in enumerate(outputs):
            for c in out.outputs:
                if job.get("echo_only"):  # (its one sampled token left out)
                    c = _without_tokens(c)
                choice: dict[str, Any] = {
                    "index": self._choice_index(job, k, c.index),
                    "finish_reason": c.finish_reason,
                    "logprobs": self._logprob_body(job, c.token_ids, c.logprobs, c.top_logprobs)
                    if job["logprobs"]
                    else None,
                }
                if job.get("echo") is not None:
                    choice["text"] = job["echo"][k]
                    if job["logprobs"]:
                        choice["logprobs"] = self._echoed(job, k, out, choice["logprobs"])
                if job["chat"]:
                    choice["message"] = message = {"role": "assistant", "content": c.text}
                    if job.get("reasoning") is not None:  # thinking apart (reasoning.py)
                        message["reasoning_content"], message["content"] = split(
                            c.text or "", job["reasoning"]
                        )
                    if job["tools"] is not None and message["content"] is not None:
                        cut = c.finish_reason == "length"  # (perhaps inside a call)
                        content, calls = job["tools"].parse(message["content"], cut_short=cut)
                        if calls:
                            choice["message"].update(content=content, tool_calls=calls)
                            if not cut:  # (a call cut short stays "length", as streamed)
                                choice["finish_reason"] = "tool_calls"
                else:
                    choice["text"] = choice.get("text", "") + (c.text or "")
                    if job.get("prompt_logprobs") is not None:
                        choice["prompt_logprobs"] = self._prompt_logprobs(job, out)
                choices.append(choice)
        self.metrics.request(endpoint, 200)
        extra = {}
        if job["chat"] and job.get("prompt_logprobs") is not None:  # vLLM's place for chat
            extra["prompt_logprobs"] = self._prompt_logprobs(job, outputs[0])
        return JSONResponse(
            {
                "id": job["id"],
                "object": "chat.completion" if job["chat"] else "text_completion",
                "created": job["created"],
                "model": job["model"],
                "choices": choices,
                **extra,
                "usage": self._usage(job, outputs),
            }
        )

    def _abort(self, rids, outputs) -> None:
        for rid, out in zip(rids, outputs, strict=True):
            if out is None:
                self.loop.abort(rid)

    def _usage(self, job, outputs) -> dict:
        prompt = sum(len(ids) for ids in job["prompts"])
        done = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        if job.get("echo_only"):
            done = 0
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def _logprob_body(self, job, ids, logprobs, top, offset: int = 0) -> dict:
        """OpenAI's ``logprobs`` of tokens ``ids`` (their ``logprobs``, and ``top``: each
        one's most likely tokens as ``(id, log-prob)``, or None): chat's ``content`` list,
        or completions' parallel lists (``text_offset`` from ``offset``)."""
        text = [self.llm.decode([t]) or "" for t in ids]
        alts = [[] for _ in ids] if top is None else top
        if job["chat"]:

            def entry(t, lp):
                return {"token": t, "logprob": lp, "bytes": list(t.encode())}

            return {
                "content": [
                    dict(
                        entry(t, lp),
                        top_logprobs=[entry(self.llm.decode([a]) or "", b) for a, b in alt],
                    )
                    for t, lp, alt in zip(text, logprobs, alts, strict=True)
                ]
            }
        offsets = []
        for t in text:
            offsets.append(offset)
            offset += len(t)
        return {
            "tokens": text,
            "token_logprobs": list(logprobs),
            "top_logprobs": None
            if top is None
            else [{self.llm.decode([a]) or "": b for a, b in alt} for alt in alts],
            "text_offset": offsets,
        }

    def _prompt_logprobs(self, job, out) -> list:
        """vLLM's ``prompt_logprobs`` of a request's output: None for the first prompt
        token, then for each one ``{"token id": {"logprob", "rank", "decoded_token"}}`` of
        the token itself and its position's most likely ``prompt_logprobs`` tokens (no
        rank is computed: None)."""
        k = job["prompt_logprobs"]
        ids, lps = out.prompt_token_ids, out.prompt_logprobs
        tops = out.prompt_top_logprobs or [[] for _ in ids]
        body: list = [None]
        for t in range(1, len(ids)):
            entries = [(ids[t], lps[t]), *tops[t][:k]]
            body.append(
                {
                    str(a): {"logprob": b, "rank": None, "decoded_token": self.llm.decode([a])}
                    for a, b in entries
                }
            )
        return body

    def _echoed(self, job, k, scored, generated: dict | None) -> dict:
        """Completions' ``logprobs`` of prompt ``k`` echoed, from ``scored`` (its request's
        output, or its first stream piece: ``prompt_logprobs`` and
        ``prompt_top_logprobs``), followed by ``generated`` (the generated tokens' own,
        their ``text_offset`` moved past the prompt's text)."""
        tops = scored.prompt_top_logprobs
        body = self._logprob_body(job, job["prompts"][k], scored.prompt_logprobs, tops)
        if tops is not None:  # OpenAI's first prompt token: no log-prob, no alternatives
            body["top_logprobs"][0] = None
        if generated is not None:
            shift = len(job["echo"][k])
            for key in ("tokens", "token_logprobs", "top_logprobs"):
                both = body[key] is not None and generated[key] is not None
                body[key] = body[key] + generated[key] if both else None
            body["text_offset"] += [o + shift for o in generated["text_offset"]]
        return body

    async def _stream(self, job, rids, queue, endpoint):
        chat = job["chat"]
        kind = "chat.completion.chunk" if chat else "text_completion"
        base = {
            "id": job["id"],
            "object": kind,
            "created": job["created"],
            "model": job["model"],
        }
        outputs: list[Any] = [None] * len(rids)

        offsets: dict[int, int] = {}  # completions' text_offset, per choice
        tools = job.get("tools")
        filters: dict[int, Any] = {}  # per choice, with tools: its StreamFilter
        thinking = job.get("reasoning")  # None: no reasoning parser
        thoughts: dict[int, ReasoningStream] = {}  # per choice, with one
        # per choice, pieces whose text is held back (thinking, a call being written):
        # their log-probs go out with the choice's next chunk
        held_pieces: dict[int, list] = {}

        def chunk(
            index: int,
            text: str | None,
            finish: str | None,
            role: bool = False,
            piece=None,
            calls=None,
            reasoning=None,
        ) -> str:
            logprobs = None
            pieces = held_pieces.pop(index, []) + ([piece] if piece is not None else [])
            if pieces and job["logprobs"]:  # this piece's, after those held back before it
                tops = [p.top_logprobs for p in pieces]
                logprobs = self._logprob_body(
                    job,
                    [t for p in pieces for t in p.token_ids],
                    [lp for p in pieces for lp in p.logprobs],
                    None if None in tops else [a for top in tops for a in top],
                    offsets.get(index, 0),
                )
                if not chat:
                    offsets[index] = offsets.get(index, 0) + sum(map(len, logprobs["tokens"]))
            if chat:
                delta = {"role": "assistant"} if role else {}
                if reasoning:
                    delta["reasoning_content"] = reasoning
                if text is not None:
                    delta["content"] = text
                if calls:  # deltas of calls, each with its index (OpenAI's chunk shape)
                    delta["tool_calls"] = calls
                choice = {"index": index, "delta": delta, "finish_reason": finish}
                choice["logprobs"] = logprobs
            else:
                choice = {"index": index, "text": text or "", "finish_reason": finish}
                choice["logprobs"] = logprobs
            body = dict(base, choices=[choice])
            if job["include_usage"]:
                body["usage"] = None
            return f"data: {json.dumps(body)}\n\n"

        echoed: set[int] = set()  # prompts whose text (echo) was sent

        def echo(k: int, event) -> list[str]:
            """Prompt ``k``'s echo, one chunk per choice, before its first piece: its
            text, and its tokens' log-probs from the request's first piece or output."""
            echoed.add(k)
            source = event.piece if event.kind == "text" else event.output
            text = job["echo"][k]
            chunks = []
            for j in range(job["params"].n):
                index = self._choice_index(job, k, j)
                choice = {"index": index, "text": text, "finish_reason": None, "logprobs": None}
                if job["logprobs"] and source.prompt_logprobs is not None:
                    choice["logprobs"] = self._echoed(job, k, source, None)
                offsets[index] = len(text)
                body = dict(base, choices=[choice])
                if job["include_usage"]:
                    body["usage"] = None
                chunks.append(f"data: {json.dumps(body)}\n\n")
            return chunks

        status = 200
        try:
            if chat:
                for k in range(len(rids)):
                    for j in range(job["params"].n):
                        yield chunk(self._choice_index(job, k, j), "", None, role=True)
            while any(o is None for o in outputs):
                k, event = await queue.get()
                if job.get("echo") is not None and k not in echoed and event.kind != "error":
                    for c in echo(k, event):
                        yield c
                if event.kind == "text" and job.get("echo_only"):
                    continue  # (its one sampled token left out)
                if event.kind == "text":
                    index = self._choice_index(job, k, event.sample)
                    text = event.text
                    calls = reasoning = None
                    if thinking is not None:  # the thinking apart, then the content
                        split_up = thoughts.setdefault(index, ReasoningStream(thinking))
                        reasoning, text = split_up.feed(text)
                        if not text:
                            if reasoning:
                                yield chunk(index, None, None, piece=event.piece,
                                            reasoning=reasoning)  # fmt: skip
                            else:
                                held_pieces.setdefault(index, []).append(event.piece)
                            continue
                    if tools is not None:  # held from where a call may begin
                        calling = filters.setdefault(index, tools.stream_filter())
                        text = calling.feed(text)
                        calls = calling.call_deltas()  # the calls as they are written
                        if not text:
                            if calls or reasoning:
                                yield chunk(index, None, None, piece=event.piece, calls=calls,
                                            reasoning=reasoning)  # fmt: skip
                            else:
                                held_pieces.setdefault(index, []).append(event.piece)
                            continue
                    yield chunk(
                        index, text, None, piece=event.piece, calls=calls, reasoning=reasoning
                    )
                elif event.kind == "error" or event.output.error is not None:
                    outputs[k] = event
                    status = event.status if event.kind == "error" else 500
                    message = (
                        event.message
                        if event.kind == "error"
                        else f"the engine failed the request: {event.output.error}"
                    )
                    self._abort(rids, outputs)
                    error = {"message": message, "type": _ERROR_TYPES.get(status), "code": status}
                    yield f"data: {json.dumps({'error': error})}\n\n"
                    break
                else:
                    outputs[k] = event.output
                    self.metrics.finished(event.output)
                    for c in event.output.outputs:
                        index = self._choice_index(job, k, c.index)
                        finish = c.finish_reason
                        if job.get("echo_only"):
                            finish = "length"
                        if index in thoughts:  # what it held back, then to the tools
                            reasoning, rest = thoughts[index].finish()
                            if rest and tools is not None:
                                held = filters.setdefault(index, tools.stream_filter())
                                rest = held.feed(rest)
                                calls = held.call_deltas()
                            else:
                                calls = None
                            if reasoning or rest or calls:
                                yield chunk(index, rest or None, None, calls=calls,
                                            reasoning=reasoning)  # fmt: skip
                        if index in filters:
                            held = filters[index]
                            rest, calls = held.finish()
                            if rest or calls:
                                yield chunk(index, rest or None, None, calls=calls)
                            if (calls or held.called) and finish != "length":
                                finish = "tool_calls"  # (a call cut short stays "length")
                        yield chunk(index, None if chat else "", finish)
            if status == 200 and job["include_usage"]:
                body = dict(base, choices=[], usage=self._usage(job, outputs))
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
        except BaseException:  # the client went away (cancelled): free its pages
            status = 499
            self._abort(rids, outputs)
            raise
        finally:
            self.metrics.request(endpoint, status)


def _without_tokens(c):
    """Completion ``c`` with no generated tokens (``echo`` with ``max_tokens`` 0)."""
    return dataclasses.replace(
        c,
        token_ids=[],
        text="",
        logprobs=None if c.logprobs is None else [],
        top_logprobs=None if c.top_logprobs is None else [],
        finish_reason="length",
    )
