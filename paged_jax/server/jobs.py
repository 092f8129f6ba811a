"""Reading requests: ``RequestParser``, the server's part that turns a request body into
what the engine runs and how the answer is written (a ``Job`` for completions and chat,
an ``EmbeddingJob`` for embeddings), every field checked and a bad one a 400 naming it
(``ApiError``); and vLLM's ``/tokenize`` and ``/detokenize``. It reads the engine's
configuration only (tokenizer, limits, ``check_request``), so it runs on worker threads
while the engine steps. No JAX here."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Mapping
from typing import Any

from paged_jax.chat import render_prompt
from paged_jax.engine.sampling import MAX_TOP_LOGPROBS, SamplingParams
from paged_jax.server.fields import (
    ApiError,
    _param_of,
    json_body,
    structured_output,
    template_kwargs,
    turn_fields,
)
from paged_jax.server.reasoning import prompt_starts_inside
from paged_jax.server.tools import ToolError, ToolRequest

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


def _object_naming_a_model(raw: bytes) -> tuple[Mapping, str]:
    """A body that must be a JSON object with a string ``model``: (the body, the model)."""
    body = json_body(raw)
    if not isinstance(body, Mapping):
        raise ApiError(400, "body: expected a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise ApiError(400, f"model: expected a string, got {model!r}", "model")
    return body, model


def _prompt_list(prompt: Any) -> Any:
    """Completions' ``prompt`` as a list of prompts: itself when it is one (a non-empty
    list of strings or of token-id lists), else ``[prompt]`` (one string, or one list of
    token ids)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return prompt
    return [prompt]


@dataclasses.dataclass
class Job:
    """A completions or chat request, parsed and checked: what the engine runs (one request
    per prompt) and how its answer is written."""

    id: str  # the answer's id ("cmpl-..." or "chatcmpl-...")
    model: str  # as the request named it (the base model or an adapter)
    lora: str | None  # the adapter it runs with
    chat: bool
    prompts: list  # [[token ids]]: one for chat, one or more for completions
    params: SamplingParams
    stream: bool
    tools: Any  # the tools.ToolRequest whose calls the reply may hold, or None
    reasoning: bool | None  # a reasoning parser: the reply starts inside its thinking
    include_usage: bool  # streamed: a last chunk with the usage
    logprobs: bool  # the sampled tokens' log-probs
    echo: list | None  # completions' echo: each prompt's text
    echo_only: bool  # echo with max_tokens 0: the prompt alone (its sampled token dropped)
    prompt_logprobs: int | None  # vLLM's prompt_logprobs: the prompt tokens' top-k
    created: int  # unix seconds
    priority: int = 0  # vLLM's priority (--scheduling-policy priority): lower runs first

    def choice_index(self, k: int, sample: int) -> int:
        """The answer's choice of sample ``sample`` of prompt ``k``."""
        return k * self.params.n + sample


@dataclasses.dataclass
class EmbeddingJob:
    """A ``/v1/embeddings`` request, parsed and checked."""

    model: str
    prompts: list  # [[token ids]]
    base64: bool  # encoding_format "base64" (else floats)
    dimensions: int | None  # the first that many, renormalized


class RequestParser:
    """Reads the requests of one served model (see the module docstring).

    Args:
      llm: the ``LLM`` (its tokenizer, limits and ``check_request``).
      model_name: the name clients send (and LoRA adapters' names, ``llm.loras``).
      tool_format: the format the model writes tool calls in (``tools.FORMATS``).
      reasoning_parser: a ``reasoning.PARSERS`` name, or None.
    """

    def __init__(self, llm: Any, model_name: str, tool_format: str, reasoning_parser):
        self.llm = llm
        self.model_name = model_name
        self.tool_format = tool_format
        self.reasoning_parser = reasoning_parser

    def lora_of(self, model: Any) -> str | None:
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

    def body(self, raw: bytes) -> Mapping:
        """A request body's JSON object, its ``model`` (if any) one this server serves."""
        body = json_body(raw)
        if not isinstance(body, Mapping):
            raise ApiError(400, "body: expected a JSON object")
        model = body.get("model")
        if model is not None:
            self.lora_of(model)  # (the tokenizer is the base model's for every adapter)
        return body

    def tokenize(self, raw: bytes) -> dict:
        """``/tokenize``'s answer to body ``raw``."""
        body = self.body(raw)
        if "messages" in body:
            generation = body.get("add_generation_prompt", True)
            if not isinstance(generation, bool):
                raise ApiError(
                    400, "add_generation_prompt: expected a bool", "add_generation_prompt"
                )
            ids = self.chat_prompt(body["messages"], add_generation_prompt=generation)
        else:
            prompt, special = body.get("prompt"), body.get("add_special_tokens", True)
            if not isinstance(prompt, str):
                raise ApiError(400, f"prompt: expected a string, got {prompt!r:.80}", "prompt")
            if not isinstance(special, bool):
                raise ApiError(400, "add_special_tokens: expected a bool", "add_special_tokens")
            ids = self.encode(prompt, "prompt", special)
        return {
            "count": len(ids),
            "max_model_len": self.llm.max_model_len,
            "tokens": ids,
            "token_strs": None,
        }

    def detokenize(self, raw: bytes) -> dict:
        """``/detokenize``'s answer to body ``raw``."""
        tokens = self.body(raw).get("tokens")
        vocab = self.llm.model.config.vocab_size
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens
        ):
            raise ApiError(400, f"tokens: expected a list of token ids in [0, {vocab})", "tokens")
        return {"prompt": self.llm.tokenizer.decode(tokens)}

    def encode(self, text: str, where: str, special: bool = True) -> list[int]:
        """``text``'s token ids (with the tokenizer's special tokens when ``special``)."""
        try:
            if special:  # the tokenizer's default, as for generation
                return self.llm.encode(text)
            ids = self.llm.tokenizer.encode(text, add_special_tokens=False)
        except ValueError as e:  # UnicodeEncodeError: a lone surrogate, say
            raise ApiError(400, f"{where}: cannot be tokenized ({e})", "prompt") from None
        return list(getattr(ids, "ids", ids))

    def _priority(self, value: Any) -> int:
        """A body's ``priority``: an int (vLLM's, lower first), other than 0 only when the
        engine schedules by priority (``--scheduling-policy priority``)."""
        if isinstance(value, bool) or not isinstance(value, int):
            raise ApiError(400, f"priority: expected an integer, got {value!r:.40}", "priority")
        schedulers = getattr(self.llm, "schedulers", None) or [None]
        policy = getattr(schedulers[0], "policy", "fcfs")
        if value and policy != "priority":
            raise ApiError(
                400, "priority: the server schedules first come, first served (start it "
                "with --scheduling-policy priority)", "priority",
            )  # fmt: skip
        return value

    def generation(self, raw: bytes, chat: bool) -> Job:
        """A completions (``chat`` False) or chat body, parsed and checked against the
        engine's limits before any answer starts (a stream's 200 could not become a 400
        later)."""
        body, model = _object_naming_a_model(raw)
        lora = self.lora_of(model)
        for name, (default, why) in _UNSUPPORTED.items():
            if body.get(name, default) not in (default, None, {}, [], {"type": "text"}):
                raise ApiError(400, f"{name}: {why}", name)
        n = body.get("n", 1)
        if "best_of" in body and body["best_of"] not in (None, n):
            raise ApiError(400, "best_of: only best_of == n is supported", "best_of")
        priority = self._priority(body.get("priority", 0))
        opts = self._answer_fields(body, chat)
        tools = None
        if chat:
            try:
                tools = ToolRequest.of(body, self.tool_format)
            except ToolError as e:
                raise ApiError(400, str(e), e.param) from None
            args = template_kwargs(body.get("chat_template_kwargs"))
            args.update({} if tools is None else tools.template_args())
            generation, go_on = turn_fields(body)
            prompts = [self.chat_prompt(body.get("messages"), generation, go_on, **args)]
        else:
            prompts = self.prompts(body.get("prompt"))
        limit = self.llm.max_model_len
        for ids in prompts:
            if len(ids) >= limit:
                raise ApiError(
                    400,
                    f"{'messages' if chat else 'prompt'}: {len(ids)} tokens, the model's "
                    f"maximum length is {limit} (one more is needed to generate)",
                    "messages" if chat else "prompt",
                )
        params, echo_only, inside = self._params(body, chat, prompts, opts, tools)
        echo = self._prompt_texts(body.get("prompt"), prompts) if opts["echo"] else None
        return Job(
            id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
            model=model,
            lora=lora,
            chat=chat,
            prompts=prompts,
            params=params,
            stream=opts["stream"],
            tools=tools if tools is not None and tools.active else None,
            reasoning=inside,
            include_usage=opts["include_usage"],
            logprobs=opts["logprobs"],
            echo=echo,
            echo_only=echo_only,
            prompt_logprobs=opts["scored"],
            created=int(time.time()),
            priority=priority,
        )

    def _answer_fields(self, body: Mapping, chat: bool) -> dict:
        """How the answer is written: ``stream``, ``include_usage``, ``logprobs``, ``top``
        (the top log-probs asked), ``echo`` and ``scored`` (vLLM's ``prompt_logprobs``)."""
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, f"stream: expected a bool, got {stream!r}", "stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, Mapping) or not isinstance(
            options.get("include_usage", False), bool
        ):
            raise ApiError(400, "stream_options: expected {include_usage: bool}", "stream_options")
        logprobs, top = self._logprob_fields(body, chat)
        echo = body.get("echo", False)
        if echo not in (None, True, False):
            raise ApiError(400, f"echo: expected a bool, got {echo!r:.40}", "echo")
        if echo and chat:
            raise ApiError(400, "echo: only /v1/completions echoes its prompt", "echo")
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
        include_usage = bool(options.get("include_usage", False))
        return dict(stream=stream, include_usage=include_usage, logprobs=logprobs, top=top,
                    echo=bool(echo), scored=scored)  # fmt: skip

    def _params(self, body: Mapping, chat: bool, prompts: list, opts: dict, tools) -> tuple:
        """``(SamplingParams, echo_only, reply starts inside its thinking)`` of a request,
        checked against the engine (``check_request``)."""
        limit = self.llm.max_model_len
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
        echo_only = opts["echo"] and kw.get("max_tokens") == 0
        if echo_only:
            kw["max_tokens"] = 1
        if "max_tokens" not in kw:  # chat: up to the context; completions: OpenAI's 16
            kw["max_tokens"] = limit - longest if chat else 16
        elif isinstance(kw["max_tokens"], int) and longest + kw["max_tokens"] > limit:
            raise ApiError(
                400,
                f"max_tokens: the prompt's {longest} tokens and max_tokens {kw['max_tokens']} "
                f"make {longest + kw['max_tokens']}, more than the model's maximum length of "
                f"{limit} tokens",
                "max_tokens",
            )
        source, inside = self._structured(body, chat, prompts, tools, kw)
        logprobs, top, scored = opts["logprobs"], opts["top"], opts["scored"]
        if opts["echo"] and logprobs:  # the prompt's tokens get log-probs too
            kw["prompt_logprobs"] = top
        if scored is not None:
            kw["prompt_logprobs"] = max(scored, kw.get("prompt_logprobs", 0))
        try:
            params = SamplingParams(logprobs=logprobs, top_logprobs=top, **kw)
            for ids in prompts:  # the engine's limits, before any answer starts
                self.llm.check_request(ids, params)
        except (ValueError, TypeError) as e:
            message = str(e)
            if message.startswith("params.structured") and source is not None:
                # a grammar the engine could not compile: the field that asked for it
                message = f"{source}: {message.partition(': ')[2]}"
            raise ApiError(400, message, _param_of(message)) from None
        return params, echo_only, inside

    def _structured(self, body: Mapping, chat: bool, prompts: list, tools, kw: dict) -> tuple:
        """Puts the request's grammar in ``kw["structured"]`` (a ``response_format``,
        ``structured_outputs`` or ``guided_*`` one, or the tools' for ``tool_choice``
        required or named) and returns ``(the field that asked for it or None, whether a
        reasoning reply starts inside its thinking or None)``."""
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
        return source, inside

    def _prompt_texts(self, prompt: Any, prompts: list[list[int]]) -> list[str]:
        """What ``echo`` repeats of each prompt: its text as given, or for token ids their
        decoded text."""
        given = _prompt_list(prompt)
        return [
            p if isinstance(p, str) else self.llm.decode(ids) or ""
            for p, ids in zip(given, prompts, strict=True)
        ]

    def _logprob_fields(self, body: Mapping, chat: bool) -> tuple[bool, int]:
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

    def prompts(self, prompt: Any, field: str = "prompt") -> list[list[int]]:
        def one(p: Any, where: str) -> list[int]:
            if isinstance(p, str):
                ids = self.encode(p, where)
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

    def chat_prompt(
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

    def embeddings(self, raw: bytes) -> EmbeddingJob:
        """A ``/v1/embeddings`` body, parsed and checked."""
        body, model = _object_naming_a_model(raw)
        if self.lora_of(model) is not None:
            raise ApiError(
                400, f"model: embeddings come from the base model {self.model_name!r}", "model"
            )
        given = body.get("input")
        if isinstance(given, list) and not given:
            raise ApiError(400, "input: expected at least one input", "input")
        prompts = self.prompts(given, "input")
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
        return EmbeddingJob(model, prompts, fmt == "base64", dims)
