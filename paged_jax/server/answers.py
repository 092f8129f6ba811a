"""Writing answers: ``Responder``, the server's part that turns a job's engine events
(``loop.Event``) into one OpenAI response (``collect``) or server-sent events
(``stream``, each streamed answer's state a ``_StreamState``), with usage, log-probs,
echoed prompts, reasoning and tool calls. No JAX here."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

from starlette.responses import JSONResponse, Response

from paged_jax.server.fields import _ERROR_TYPES, error_response
from paged_jax.server.jobs import Job
from paged_jax.server.reasoning import ReasoningStream, split


class Responder:
    """Answers of one server.

    Args:
      decode: token ids to text (``LLM.decode``).
      loop: the ``EngineLoop`` (a client that goes away has its requests aborted).
      metrics: the server's ``Metrics`` (requests by status, finished requests).
    """

    def __init__(self, decode, loop, metrics):
        self.decode = decode
        self.loop = loop
        self.metrics = metrics

    async def collect(self, request, job: Job, rids, queue, endpoint) -> Response:
        """Waits for every request of ``job`` (events on ``queue``) and answers at once."""
        outputs: list[Any] = [None] * len(rids)
        while any(o is None for o in outputs):
            try:
                k, event = await asyncio.wait_for(queue.get(), timeout=0.5)
            except TimeoutError:
                if await request.is_disconnected():
                    self.abort(rids, outputs)
                    self.metrics.request(endpoint, 499)
                    return Response(status_code=499)
                continue
            if event.kind == "error":
                outputs[k] = event
                self.abort(rids, outputs)
                self.metrics.request(endpoint, event.status)
                return error_response(event.status, event.message, event.param)
            if event.kind == "done":
                if event.output.error is not None:
                    outputs[k] = event
                    self.abort(rids, outputs)
                    self.metrics.request(endpoint, 500)
                    return error_response(
                        500, f"the engine failed the request: {event.output.error}"
                    )
                outputs[k] = event.output
                self.metrics.finished(event.output)
        self.metrics.request(endpoint, 200)
        extra = {}
        if job.chat and job.prompt_logprobs is not None:  # vLLM's place for chat
            extra["prompt_logprobs"] = self.prompt_logprobs(job, outputs[0])
        return JSONResponse(
            {
                "id": job.id,
                "object": "chat.completion" if job.chat else "text_completion",
                "created": job.created,
                "model": job.model,
                "choices": [c for k, out in enumerate(outputs) for c in self._choices(job, k, out)],
                **extra,
                "usage": self.usage(job, outputs),
            }
        )

    def _choices(self, job: Job, k: int, out) -> list[dict]:
        """The choices of prompt ``k``'s finished request ``out``."""
        choices = []
        for c in out.outputs:
            if job.echo_only:  # (its one sampled token left out)
                c = _without_tokens(c)
            logprobs = None
            if job.logprobs:
                logprobs = self.logprob_body(job, c.token_ids, c.logprobs, c.top_logprobs)
            choice: dict[str, Any] = {
                "index": job.choice_index(k, c.index),
                "finish_reason": c.finish_reason,
                "logprobs": logprobs,
            }
            if job.echo is not None:
                choice["text"] = job.echo[k]
                if job.logprobs:
                    choice["logprobs"] = self.echoed(job, k, out, choice["logprobs"])
            if job.chat:
                choice["message"] = message = {"role": "assistant", "content": c.text}
                if job.reasoning is not None:  # thinking apart (reasoning.py)
                    message["reasoning_content"], message["content"] = split(
                        c.text or "", job.reasoning
                    )
                if job.tools is not None and message["content"] is not None:
                    cut = c.finish_reason == "length"  # (perhaps inside a call)
                    content, calls = job.tools.parse(message["content"], cut_short=cut)
                    if calls:
                        message.update(content=content, tool_calls=calls)
                        if not cut:  # (a call cut short stays "length", as streamed)
                            choice["finish_reason"] = "tool_calls"
            else:
                choice["text"] = choice.get("text", "") + (c.text or "")
                if job.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self.prompt_logprobs(job, out)
            choices.append(choice)
        return choices

    def abort(self, rids, outputs) -> None:
        """Aborts the requests of ``rids`` whose ``outputs`` are not in yet."""
        for rid, out in zip(rids, outputs, strict=True):
            if out is None:
                self.loop.abort(rid)

    def usage(self, job: Job, outputs) -> dict:
        prompt = sum(len(ids) for ids in job.prompts)
        done = 0 if job.echo_only else sum(len(c.token_ids) for o in outputs for c in o.outputs)
        cached = sum(o.metrics.cached_prompt_tokens for o in outputs)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
                "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip

    def logprob_body(self, job: Job, ids, logprobs, top, offset: int = 0) -> dict:
        """OpenAI's ``logprobs`` of tokens ``ids`` (their ``logprobs``, and ``top``: each
        one's most likely tokens as ``(id, log-prob)``, or None): chat's ``content`` list,
        or completions' parallel lists (``text_offset`` from ``offset``)."""
        text = [self.decode([t]) or "" for t in ids]
        alts = [[] for _ in ids] if top is None else top
        if job.chat:

            def entry(t, lp):
                return {"token": t, "logprob": lp, "bytes": list(t.encode())}

            return {
                "content": [
                    dict(
                        entry(t, lp),
                        top_logprobs=[entry(self.decode([a]) or "", b) for a, b in alt],
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
            else [{self.decode([a]) or "": b for a, b in alt} for alt in alts],
            "text_offset": offsets,
        }

    def prompt_logprobs(self, job: Job, out) -> list:
        """vLLM's ``prompt_logprobs`` of a request's output: None for the first prompt
        token, then for each one ``{"token id": {"logprob", "rank", "decoded_token"}}`` of
        the token itself and its position's most likely ``prompt_logprobs`` tokens (no
        rank is computed: None)."""
        k = job.prompt_logprobs
        ids, lps = out.prompt_token_ids, out.prompt_logprobs
        tops = out.prompt_top_logprobs or [[] for _ in ids]
        body: list = [None]
        for t in range(1, len(ids)):
            entries = [(ids[t], lps[t]), *tops[t][:k]]
            body.append(
                {
                    str(a): {"logprob": b, "rank": None, "decoded_token": self.decode([a])}
                    for a, b in entries
                }
            )
        return body

    def echoed(self, job: Job, k: int, scored, generated: dict | None) -> dict:
        """Completions' ``logprobs`` of prompt ``k`` echoed, from ``scored`` (its request's
        output, or its first stream piece: ``prompt_logprobs`` and
        ``prompt_top_logprobs``), followed by ``generated`` (the generated tokens' own,
        their ``text_offset`` moved past the prompt's text)."""
        tops = scored.prompt_top_logprobs
        body = self.logprob_body(job, job.prompts[k], scored.prompt_logprobs, tops)
        if tops is not None:  # OpenAI's first prompt token: no log-prob, no alternatives
            body["top_logprobs"][0] = None
        if generated is not None:
            shift = len(job.echo[k])
            for key in ("tokens", "token_logprobs", "top_logprobs"):
                both = body[key] is not None and generated[key] is not None
                body[key] = body[key] + generated[key] if both else None
            body["text_offset"] += [o + shift for o in generated["text_offset"]]
        return body

    async def stream(self, job: Job, rids, queue, endpoint):
        """Server-sent events of ``job``'s requests as their events arrive on ``queue``:
        the role (chat), then content deltas, then one chunk per choice with its
        ``finish_reason``, the usage if asked, then ``[DONE]``."""
        state = _StreamState(self, job, len(rids))
        status = 200
        try:
            if job.chat:
                for k in range(len(rids)):
                    for j in range(job.params.n):
                        yield state.chunk(job.choice_index(k, j), "", None, role=True)
            while any(o is None for o in state.outputs):
                k, event = await queue.get()
                if job.echo is not None and k not in state.echoed and event.kind != "error":
                    for c in state.echo(k, event):
                        yield c
                if event.kind == "text":
                    for c in () if job.echo_only else state.text(k, event):
                        yield c
                elif event.kind == "error" or event.output.error is not None:
                    state.outputs[k] = event
                    status = event.status if event.kind == "error" else 500
                    message = (
                        event.message
                        if event.kind == "error"
                        else f"the engine failed the request: {event.output.error}"
                    )
                    self.abort(rids, state.outputs)
                    error = {"message": message, "type": _ERROR_TYPES.get(status), "code": status}
                    yield f"data: {json.dumps({'error': error})}\n\n"
                    break
                else:
                    state.outputs[k] = event.output
                    self.metrics.finished(event.output)
                    for c in state.done(k, event.output):
                        yield c
            if status == 200 and job.include_usage:
                body = dict(state.base, choices=[], usage=self.usage(job, state.outputs))
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
        except BaseException:  # the client went away (cancelled): free its pages
            status = 499
            self.abort(rids, state.outputs)
            raise
        finally:
            self.metrics.request(endpoint, status)


class _StreamState:
    """What one streamed answer keeps between its events: each request's output once done,
    each choice's ``text_offset`` (completions), its reasoning and tool-call filters, the
    pieces whose text is held back (thinking, a call being written: their log-probs go
    out with the choice's next chunk), and the prompts whose echo was sent."""

    def __init__(self, responder: Responder, job: Job, num_requests: int):
        self.r, self.job = responder, job
        self.base = {
            "id": job.id,
            "object": "chat.completion.chunk" if job.chat else "text_completion",
            "created": job.created,
            "model": job.model,
        }
        self.outputs: list[Any] = [None] * num_requests
        self.offsets: dict[int, int] = {}  # completions' text_offset, per choice
        self.filters: dict[int, Any] = {}  # per choice, with tools: its StreamFilter
        self.thoughts: dict[int, ReasoningStream] = {}  # per choice, with a reasoning parser
        self.held: dict[int, list] = {}  # per choice, pieces whose text is held back
        self.echoed: set[int] = set()

    def chunk(self, index, text, finish, role=False, piece=None, calls=None, reasoning=None):
        """One event of choice ``index``: ``text`` (None: no content), ``finish`` reason,
        the role (chat's first), ``piece``'s log-probs (after those of the pieces held
        back before it), tool-call deltas, reasoning text."""
        job = self.job
        logprobs = None
        pieces = self.held.pop(index, []) + ([piece] if piece is not None else [])
        if pieces and job.logprobs:  # this piece's, after those held back before it
            tops = [p.top_logprobs for p in pieces]
            logprobs = self.r.logprob_body(
                job,
                [t for p in pieces for t in p.token_ids],
                [lp for p in pieces for lp in p.logprobs],
                None if None in tops else [a for top in tops for a in top],
                self.offsets.get(index, 0),
            )
            if not job.chat:
                self.offsets[index] = self.offsets.get(index, 0) + sum(map(len, logprobs["tokens"]))
        if job.chat:
            delta = {"role": "assistant"} if role else {}
            if reasoning:
                delta["reasoning_content"] = reasoning
            if text is not None:
                delta["content"] = text
            if calls:  # deltas of calls, each with its index (OpenAI's chunk shape)
                delta["tool_calls"] = calls
            choice = {"index": index, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "finish_reason": finish}
        choice["logprobs"] = logprobs
        body = dict(self.base, choices=[choice])
        if job.include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body)}\n\n"

    def echo(self, k: int, event) -> list[str]:
        """Prompt ``k``'s echo, one chunk per choice, before its first piece: its text,
        and its tokens' log-probs from the request's first piece or output."""
        job = self.job
        self.echoed.add(k)
        source = event.piece if event.kind == "text" else event.output
        text = job.echo[k]
        chunks = []
        for j in range(job.params.n):
            index = job.choice_index(k, j)
            choice = {"index": index, "text": text, "finish_reason": None, "logprobs": None}
            if job.logprobs and source.prompt_logprobs is not None:
                choice["logprobs"] = self.r.echoed(job, k, source, None)
            self.offsets[index] = len(text)
            body = dict(self.base, choices=[choice])
            if job.include_usage:
                body["usage"] = None
            chunks.append(f"data: {json.dumps(body)}\n\n")
        return chunks

    def text(self, k: int, event) -> list[str]:
        """A text event of prompt ``k``'s request: its reasoning split off, then its
        tool calls (each held back from where a call may begin), then its content."""
        job = self.job
        index = job.choice_index(k, event.sample)
        text, calls, reasoning = event.text, None, None
        if job.reasoning is not None:  # the thinking apart, then the content
            split_up = self.thoughts.setdefault(index, ReasoningStream(job.reasoning))
            reasoning, text = split_up.feed(text)
            if not text:
                if reasoning:
                    return [self.chunk(index, None, None, piece=event.piece, reasoning=reasoning)]
                self.held.setdefault(index, []).append(event.piece)
                return []
        if job.tools is not None:  # held from where a call may begin
            calling = self.filters.setdefault(index, job.tools.stream_filter())
            text = calling.feed(text)
            calls = calling.call_deltas()  # the calls as they are written
            if not text:
                if calls or reasoning:
                    return [self.chunk(index, None, None, piece=event.piece, calls=calls,
                                       reasoning=reasoning)]  # fmt: skip
                self.held.setdefault(index, []).append(event.piece)
                return []
        return [self.chunk(index, text, None, piece=event.piece, calls=calls, reasoning=reasoning)]

    def done(self, k: int, output) -> list[str]:
        """Prompt ``k``'s request finished with ``output``: what its filters held back,
        then one chunk per choice with its finish reason."""
        job = self.job
        chunks = []
        for c in output.outputs:
            index = job.choice_index(k, c.index)
            finish = "length" if job.echo_only else c.finish_reason
            if index in self.thoughts:  # what it held back, then to the tools
                reasoning, rest = self.thoughts[index].finish()
                calls = None
                if rest and job.tools is not None:
                    held = self.filters.setdefault(index, job.tools.stream_filter())
                    rest = held.feed(rest)
                    calls = held.call_deltas()
                if reasoning or rest or calls:
                    chunks.append(self.chunk(index, rest or None, None, calls=calls,
                                             reasoning=reasoning))  # fmt: skip
            if index in self.filters:
                held = self.filters[index]
                rest, calls = held.finish()
                if rest or calls:
                    chunks.append(self.chunk(index, rest or None, None, calls=calls))
                if (calls or held.called) and finish != "length":
                    finish = "tool_calls"  # (a call cut short stays "length")
            chunks.append(self.chunk(index, None if job.chat else "", finish))
        return chunks


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
