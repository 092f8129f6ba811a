"""Request fields of the API that become engine inputs beyond sampling, read from a
validated request (``schema``): structured output (``response_format``,
``structured_outputs``, ``guided_*``), the chat template's (``chat_template_kwargs``,
``add_generation_prompt``, ``continue_final_message``); the body's JSON (``json_body``);
``ApiError``, the error every check of a request raises (status, message naming the
field, the field), and OpenAI's error body for it (``error_response``). No JAX here."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from starlette.responses import JSONResponse

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    body = {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "error"),
            "param": param,
            "code": status,
        }
    }
    return JSONResponse(body, status_code=status)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


# What a lone UTF-16 surrogate looks like in a body: a \\u escape of D800-DFFF, or its three
# bytes (json.loads decodes bytes with "surrogatepass"). A body with neither is not walked.
_MAY_HOLD_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def _lone_surrogate(value: Any) -> tuple[str, str, int] | None:
    """Where a parsed JSON value holds a string that is not valid Unicode text (a lone
    UTF-16 surrogate, which no encoder takes and which ``\\u`` escapes can carry):
    ``(path, top-level field, character index)``, for a value or an object's key
    (``messages[0].content``), or None. Walks iteratively (a body may nest deeply)."""
    todo: list[tuple[Any, str, str]] = [(value, "", "")]
    while todo:
        v, path, top = todo.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                return path or "body", top or "body", e.start
        elif isinstance(v, Mapping):
            items = []
            for k, item in v.items():
                try:
                    k.encode("utf-8")
                except UnicodeEncodeError:  # the key itself, named with its escapes
                    name = k.encode("ascii", "backslashreplace").decode("ascii")
                    return (f"{path}.{name}" if path else name), top or name, 0
                items.append((item, f"{path}.{k}" if path else k, top or k))
            todo += reversed(items)  # (document order: the first bad string is named)
        elif isinstance(v, list):
            todo += reversed([(item, f"{path}[{j}]", top) for j, item in enumerate(v)])
    return None


def json_body(raw: bytes) -> Any:
    """The request body's JSON value; an ApiError (400) saying what is wrong with it,
    naming the field for text that is not valid Unicode (a lone surrogate), whatever
    the route and the field (a prompt, a message, a stop string, a tool, a schema)."""
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ApiError(
            400, f"body: invalid JSON ({e.msg} at line {e.lineno}, column {e.colno})"
        ) from None
    except UnicodeDecodeError:
        raise ApiError(400, "body: invalid JSON (not UTF-8 text)") from None
    except RecursionError:
        raise ApiError(400, "body: nested too deeply") from None
    if _MAY_HOLD_SURROGATE.search(raw):
        bad = _lone_surrogate(body)
        if bad is not None:
            path, top, at = bad
            raise ApiError(
                400,
                f"{path}: not valid Unicode text (a lone UTF-16 surrogate at character {at})",
                top,
            )
    return body


# Template variables the server sets itself
_TEMPLATE_RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "tokenize"})


def template_kwargs(value: dict | None) -> dict:
    """A chat request's ``chat_template_kwargs`` (vLLM's extension: more variables for
    the chat template, such as Qwen3's ``enable_thinking``), checked: none of its keys
    is one the server sets."""
    if value is None:
        return {}
    taken = sorted(_TEMPLATE_RESERVED.intersection(value))
    if taken:
        raise ApiError(
            400, f"chat_template_kwargs: {taken[0]!r} is set by the server", "chat_template_kwargs"
        )
    return dict(value)


def turn_fields(req: Any) -> tuple[bool, bool]:
    """A chat request's ``(add_generation_prompt, continue_final_message)`` (vLLM's
    extensions; defaults true and false, the first false when the second is true)."""
    go_on, generation = req.continue_final_message, req.add_generation_prompt
    if go_on and generation:
        raise ApiError(
            400,
            "continue_final_message: not with add_generation_prompt true",
            "continue_final_message",
        )
    return (not go_on) if generation is None else generation, go_on


def structured_output(req: Any) -> tuple[str, Any] | None:
    """The ``(field, StructuredOutput)`` of a validated request (``schema.ChatRequest``
    or ``CompletionRequest``), or None: OpenAI's ``response_format`` (``json_object``,
    ``json_schema``), vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``,
    ``grammar``) and its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
    ``guided_grammar``; ``field`` names the one the request used (what an error of its
    grammar, found later, names). ``ApiError`` 400 naming the field otherwise."""
    from paged_jax.engine.structured import StructuredOutput

    found = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", dict(json_object=True)))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise ApiError(
                400,
                "response_format.json_schema: required with type json_schema",
                "response_format",
            )
        found.append(("response_format", dict(json=fmt.json_schema.schema_)))
    outputs = req.structured_outputs
    if outputs is not None:
        kinds = dict(json=outputs.json_, regex=outputs.regex, choice=outputs.choice,
                     grammar=outputs.grammar)  # fmt: skip
        found.append(("structured_outputs", {k: v for k, v in kinds.items() if v is not None}))
    for name in ("json", "regex", "choice", "grammar"):
        if getattr(req, f"guided_{name}") is not None:
            found.append((f"guided_{name}", {name: getattr(req, f"guided_{name}")}))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(n for n, _ in found)
        raise ApiError(400, f"{names}: expected one way to constrain the output", found[1][0])
    name, kw = found[0]
    try:
        return name, StructuredOutput(**kw)
    except (TypeError, ValueError) as e:
        raise ApiError(400, f"{name}: {e}", name) from None
