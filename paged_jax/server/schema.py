"""The request bodies of the API as pydantic models, and the one place a bad request
becomes a 400 naming its field (``validated``, ``api_error``). No JAX here.

Each model checks what a body's JSON alone decides: every field's type (strictly: no
``"1"`` for 1, no ``true`` for 1), the ranges fixed by the API (``top_logprobs`` in
[0, 20], ``priority`` an int), the shape of messages, formats and options. What needs the
served model (a token id against its vocabulary, a prompt against its context, a grammar
compiled for its tokenizer) and the sampling values' ranges, which ``SamplingParams``
owns for the library and the server alike, are checked after, by the code that knows
them; their errors are ``FieldError`` s (``paged_jax.errors``) that say which field.

Unknown fields are kept and ignored, as OpenAI's and vLLM's servers do (clients send
``user``, ``metadata``...)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WrapValidator
from pydantic_core import PydanticCustomError

from paged_jax.engine.sampling import MAX_TOP_LOGPROBS
from paged_jax.errors import FieldError
from paged_jax.server.fields import ApiError

# ---------------------------------------------------------------- field types


def _expect(text: str) -> WrapValidator:
    """A field whose every failure reads ``expected {text}`` (a union would otherwise
    report one error per member)."""

    def check(value, handler):
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("expected", "expected {text}", {"text": text}) from None

    return WrapValidator(check)


Int = Annotated[int, Field(strict=True)]
TokenId = Annotated[int, Field(strict=True, ge=0)]
Real = Annotated[float, Field(strict=True, allow_inf_nan=False)]  # (ints are numbers too)
TopLogprobs = Annotated[
    int,
    Field(strict=True, ge=0, le=MAX_TOP_LOGPROBS),
    _expect(f"an int in [0, {MAX_TOP_LOGPROBS}]"),
]
Stop = Annotated[str | list[str] | None, _expect("a string or a list of strings")]
Schema = Annotated[dict[str, Any] | str | None, _expect("a JSON schema")]  # (or its text)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False


class TextPart(_Body):
    """A message's content part: text only (``{"type": "text", "text": ...}``)."""

    type: Literal["text"]
    text: str = ""


class Message(_Body):
    """A chat message: its role (``developer`` is OpenAI's newer ``system``) and content, a
    string or text parts; other keys (``name``, ``tool_calls``, ``tool_call_id``,
    ``reasoning_content``) go to the chat template as given."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[
        str | list[TextPart] | None, _expect("a string, a list of text parts, or null")
    ] = None

    def for_template(self) -> dict:
        """The message as the chat template reads it: text parts joined into one string."""
        out = self.model_dump(exclude_unset=True)
        if isinstance(self.content, list):
            out["content"] = "".join(p.text for p in self.content)
        return out


class JsonSchemaFormat(_Body):
    name: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON of a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's ``structured_outputs``: exactly one of ``json`` (a schema), ``regex``,
    ``choice`` or ``grammar`` (Lark) constrains the output."""

    json_: Schema = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


# ---------------------------------------------------------------- request bodies


class _Generation(_Body):
    """The fields completions and chat share: sampling (OpenAI's and vLLM's), streaming,
    structured output, scheduling. Sampling values' ranges: ``SamplingParams``."""

    model: str
    max_tokens: Int | None = None
    temperature: Real | None = None
    top_p: Real | None = None
    n: Int | None = None
    best_of: Int | None = None
    stop: Stop = None
    seed: Int | None = None
    presence_penalty: Real | None = None
    frequency_penalty: Real | None = None
    logit_bias: dict[str, Real] | None = None
    # vLLM's extensions
    top_k: Int | None = None
    min_p: Real | None = None
    repetition_penalty: Real | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    allowed_token_ids: list[TokenId] | None = None
    stop_token_ids: list[TokenId] | None = None
    min_tokens: Int | None = None
    prompt_logprobs: TopLogprobs | None = None
    priority: Int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    # structured output: one of these
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: Schema = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # accepted only when absent (or null)
    suffix: Annotated[None, _expect("null (suffixes are not supported)")] = None
    functions: Annotated[None, _expect("null (functions are not supported; use tools)")] = None


class CompletionRequest(_Generation):
    """``POST /v1/completions``. ``prompt``: a string, token ids, or a list of either
    (checked against the vocabulary by ``RequestParser.prompts``)."""

    prompt: Any = None
    logprobs: TopLogprobs | None = None  # the top tokens with each (0: the sampled only)
    echo: bool | None = None


class ChatRequest(_Generation):
    """``POST /v1/chat/completions``. ``tools`` and ``tool_choice`` are read by
    ``tools.ToolRequest`` (its ``ToolError`` names the field)."""

    messages: list[Message]
    max_completion_tokens: Int | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False


class EmbeddingRequest(_Body):
    """``POST /v1/embeddings``. ``input``: as completions' ``prompt``."""

    model: str
    input: Any = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = None  # (in [1, hidden size]: checked with the model)


class TokenizeRequest(_Body):
    """vLLM's ``POST /tokenize``: a ``prompt`` or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    """vLLM's ``POST /detokenize`` (ids checked against the vocabulary after)."""

    model: str | None = None
    tokens: list[TokenId]


class LoraRequest(_Body):
    """vLLM's ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
    (``lora_path`` for loading)."""

    lora_name: Annotated[str, Field(min_length=1)]
    lora_path: Annotated[str, Field(min_length=1)] | None = None


# ---------------------------------------------------------------- the one 400 handler


def _where(loc: tuple) -> str:
    """``("messages", 0, "content")`` as the API names it: ``messages[0].content``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


_EXPECTED = {
    "bool_type": "a bool",
    "int_type": "an int",
    "float_type": "a number",
    "finite_number": "a finite number",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
}


def _problem(err: dict) -> str:
    """One pydantic error in the house's words: ``expected ..., got ...``."""
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind == "missing":
        return "required"
    if kind == "expected":
        expected = ctx["text"]
    elif kind in _EXPECTED:
        expected = _EXPECTED[kind]
    elif kind == "literal_error":
        expected = f"one of {ctx['expected']}"
    elif kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
        bound = {"greater_than_equal": ">= {ge}", "less_than_equal": "<= {le}",
                 "greater_than": "> {gt}", "less_than": "< {lt}"}[kind]  # fmt: skip
        expected = bound.format(**ctx)
    elif kind == "string_too_short":
        expected = "a non-empty string"
    else:
        return err["msg"][:1].lower() + err["msg"][1:]
    return f"expected {expected}, got {err['input']!r:.40}"


def validated(model: type[BaseModel], body: Any) -> Any:
    """``body`` (a parsed JSON value) as an instance of ``model``; an ``ApiError`` 400
    naming the first wrong field (``messages[0].role: expected one of ...``) otherwise."""
    if not isinstance(body, dict):
        raise ApiError(400, "body: expected a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        loc = tuple(err["loc"])
        raise ApiError(400, f"{_where(loc)}: {_problem(err)}", str(loc[0])) from None


def api_error(e: Exception, names: dict[str, str] | None = None) -> ApiError:
    """The 400 of an error a library check raised about a request: a ``FieldError``'s
    ``field`` is its ``param`` (``params.stop`` read as ``stop``; ``names`` maps the
    library's names to the body's where they differ: ``{"structured": "response_format"}``
    names the field that asked for a grammar); any other error names none."""
    field = getattr(e, "field", None)
    if field is None:
        return ApiError(400, str(e))
    path = field.removeprefix("params.")
    top = re.split(r"[.\[,]", path)[0]
    message = str(e).replace(field, path, 1)  # (context before it, "prompts[3]: ...", kept)
    if top in (names or {}) and isinstance(e, FieldError):
        path = top = names[top]
        message = f"{path}: {e.problem}"
    return ApiError(400, message, top)
