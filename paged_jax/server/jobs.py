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
from typing import Any

from paged_jax.chat import render_prompt
from paged_jax.engine.sampling import SamplingParams
from paged_jax.server.fields import (
    ApiError,
    json_body,
    structured_output,
    template_kwargs,
    turn_fields,
)
from paged_jax.server.reasoning import prompt_starts_inside
from paged_jax.server.schema import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    Message,
    TokenizeRequest,
    api_error,
    validated,
)
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

    def tokenize(self, raw: bytes) -> dict:
        """``/tokenize``'s answer to body ``raw``."""
        req = validated(TokenizeRequest, json_body(raw))
        if req.model is not None:
            self.lora_of(req.model)  # (the tokenizer is the base model's for every adapter)
        if req.messages is not None:
            ids = self.chat_prompt(req.messages, add_generation_prompt=req.add_generation_prompt)
        elif req.prompt is None:
            raise ApiError(400, "prompt: required (or messages)", "prompt")
        else:
            ids = self.encode(req.prompt, "prompt", req.add_special_tokens)
        return {
            "count": len(ids),
            "max_model_len": self.llm.max_model_len,
            "tokens": ids,
            "token_strs": None,
        }

    def detokenize(self, raw: bytes) -> dict:
        """``/detokenize``'s answer to body ``raw``."""
        req = validated(DetokenizeRequest, json_body(raw))
        if req.model is not None:
            self.lora_of(req.model)
        vocab = self.llm.model.config.vocab_size
        if any(t >= vocab for t in req.tokens):
            raise ApiError(400, f"tokens: expected a list of token ids in [0, {vocab})", "tokens")
        return {"prompt": self.llm.tokenizer.decode(req.tokens)}

    def encode(self, text: str, where: str, special: bool = True) -> list[int]:
        """``text``'s token ids (with the tokenizer's special tokens when ``special``)."""
        try:
            if special:  # the tokenizer's default, as for generation
                return self.llm.encode(text)
            ids = self.llm.tokenizer.encode(text, add_special_tokens=False)
        except ValueError as e:  # UnicodeEncodeError: a lone surrogate, say
            raise ApiError(400, f"{where}: cannot be tokenized ({e})", "prompt") from None
        return list(getattr(ids, "ids", ids))

    def _priority(self, value: int) -> int:
        """A body's ``priority`` (vLLM's, lower first), other than 0 only when the engine
        schedules by priority (``--scheduling-policy priority``)."""
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
        body = json_body(raw)
        req = validated(ChatRequest if chat else CompletionRequest, body)
        lora = self.lora_of(req.model)
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise ApiError(400, "best_of: only best_of == n is supported", "best_of")
        priority = self._priority(req.priority)
        opts = self._answer_fields(req, chat)
        tools = None
        if chat:
            try:
                tools = ToolRequest.of(body, self.tool_format)
            except ToolError as e:
                raise ApiError(400, str(e), e.param) from None
            args = template_kwargs(req.chat_template_kwargs)
            args.update({} if tools is None else tools.template_args())
            generation, go_on = turn_fields(req)
            prompts = [self.chat_prompt(req.messages, generation, go_on, **args)]
        else:
            prompts = self.prompts(req.prompt)
        limit = self.llm.max_model_len
        for ids in prompts:
            if len(ids) >= limit:
                raise ApiError(
                    400,
                    f"{'messages' if chat else 'prompt'}: {len(ids)} tokens, the model's "
                    f"maximum length is {limit} (one more is needed to generate)",
                    "messages" if chat else "prompt",
                )
        params, echo_only, inside = self._params(req, chat, prompts, opts, tools)
        echo = self._prompt_texts(req.prompt, prompts) if opts["echo"] else None
        return Job(
            id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
            model=req.model,
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

    def _answer_fields(self, req: CompletionRequest | ChatRequest, chat: bool) -> dict:
        """How the answer is written: ``stream``, ``include_usage``, ``logprobs``, ``top``
        (the top log-probs asked), ``echo`` and ``scored`` (vLLM's ``prompt_logprobs``)."""
        if chat:
            logprobs, top = bool(req.logprobs), req.top_logprobs or 0
            if top and not logprobs:
                raise ApiError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
            if (req.model_extra or {}).get("echo"):
                raise ApiError(400, "echo: only /v1/completions echoes its prompt", "echo")
            echo = False
        else:  # an int: the top tokens with each (0: the sampled ones only)
            logprobs, top, echo = req.logprobs is not None, req.logprobs or 0, bool(req.echo)
        scored = req.prompt_logprobs  # vLLM's extension: the prompt's log-probs
        if scored is not None and req.stream:
            raise ApiError(400, "prompt_logprobs: not with stream", "prompt_logprobs")
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return dict(stream=req.stream, include_usage=include_usage, logprobs=logprobs, top=top,
                    echo=echo, scored=scored)  # fmt: skip

    def _params(self, req, chat: bool, prompts: list, opts: dict, tools) -> tuple:
        """``(SamplingParams, echo_only, reply starts inside its thinking)`` of request
        ``req``, checked against the engine (``check_request``)."""
        limit = self.llm.max_model_len
        kw: dict[str, Any] = {"temperature": 1.0}  # OpenAI's default
        names = {}  # the SamplingParams fields given by another name
        for name, field in _SAMPLING.items():
            if getattr(req, name, None) is not None:
                kw[field] = getattr(req, name)
                if name != field:
                    names[field] = name
        for name in ("stop", "allowed_token_ids", "stop_token_ids"):
            if isinstance(kw.get(name), list):
                kw[name] = tuple(kw[name])
        if kw.get("top_k") == -1:  # vLLM's other spelling of "all tokens"
            kw["top_k"] = 0
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
        source, inside = self._structured(req, chat, prompts, tools, kw)
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
            if source is not None:  # a grammar the engine refused: the field that asked
                names["structured"] = source
            raise api_error(e, names) from None
        return params, echo_only, inside

    def _structured(self, req, chat: bool, prompts: list, tools, kw: dict) -> tuple:
        """Puts the request's grammar in ``kw["structured"]`` (a ``response_format``,
        ``structured_outputs`` or ``guided_*`` one, or the tools' for ``tool_choice``
        required or named) and returns ``(the field that asked for it or None, whether a
        reasoning reply starts inside its thinking or None)``."""
        source, structured = structured_output(req) or (None, None)
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
        self, messages: list[Message], add_generation_prompt: bool = True, go_on: bool = False,
        **template_args,
    ) -> list[int]:  # fmt: skip
        """The prompt's token ids of chat ``messages`` (validated ``schema.Message`` s)
        through the model's chat template."""
        messages = [m.for_template() for m in messages]
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
        req = validated(EmbeddingRequest, json_body(raw))
        if self.lora_of(req.model) is not None:
            raise ApiError(
                400, f"model: embeddings come from the base model {self.model_name!r}", "model"
            )
        if isinstance(req.input, list) and not req.input:
            raise ApiError(400, "input: expected at least one input", "input")
        prompts = self.prompts(req.input, "input")
        for k, ids in enumerate(prompts):
            if len(ids) >= self.llm.max_model_len:
                raise ApiError(
                    400,
                    f"input[{k}]: {len(ids)} tokens, more than the model's maximum length of "
                    f"{self.llm.max_model_len - 1} for an input",
                    "input",
                )
        dims, size = req.dimensions, self.llm.model.config.hidden_size
        if dims is not None and not 1 <= dims <= size:
            raise ApiError(
                400, f"dimensions: expected an int in [1, {size}], got {dims!r:.40}", "dimensions"
            )
        return EmbeddingJob(req.model, prompts, req.encoding_format == "base64", dims)
