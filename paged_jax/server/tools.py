"""Tool calls in ``/v1/chat/completions``: OpenAI's ``tools`` and ``tool_choice``, the
model's chat template rendering the tools, its output parsed back into ``tool_calls``.

Three output formats, one per family of chat templates, chosen from the template's text
(``detect_format``) or named with ``paged-jax serve --tool-call-parser``:

- ``hermes`` (Qwen 2 and 3, Hermes): ``<tool_call>\\n{"name": ..., "arguments": {...}}
  \\n</tool_call>``, one block per call, text around them being content;
- ``llama3_json`` (Llama 3.1 and later): the whole reply is ``{"name": ..., "parameters":
  {...}}`` (after an optional ``<|python_tag|>``), several separated by ``;``;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name": ..., "arguments": {...}}``.

``tool_choice``: ``"none"`` renders no tools and parses nothing; ``"auto"`` (the default
with tools) parses whatever calls the reply makes; ``"required"`` and a named function
constrain the reply with a grammar (structured output, llguidance) to calls of the given
tools whose arguments match their JSON schemas. A call naming no given tool, or whose
arguments are not JSON, stays content. No JAX here.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Mapping
from typing import Any

from paged_jax.engine.structured import COMPACT_JSON

FORMATS = ("hermes", "llama3_json", "mistral")
_ARGS = {"hermes": "arguments", "llama3_json": "parameters", "mistral": "arguments"}
_ARG_KEYS = ("arguments", "parameters")
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_MISTRAL = "[TOOL_CALLS]"
_PYTHON_TAG = "<|python_tag|>"


class ToolError(ValueError):
    """A bad ``tools`` or ``tool_choice``; the message names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def detect_format(template: str | None) -> str:
    """The tool-call format a chat template's model writes (``hermes`` when unknown)."""
    t = template or ""
    if _MISTRAL in t:
        return "mistral"
    if _PYTHON_TAG in t or "ipython" in t:
        return "llama3_json"
    return "hermes"


def _check_tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list) or not tools:
        raise ToolError("tools: expected a non-empty list of function tools", "tools")
    names = set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, Mapping) else None
        if not isinstance(t, Mapping) or t.get("type") != "function" or not isinstance(fn, Mapping):
            raise ToolError(
                f'tools[{i}]: expected {{"type": "function", "function": {{...}}}}', "tools"
            )
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ToolError(
                f"tools[{i}].function.name: expected 1 to 64 letters, digits, _ . or -, "
                f"got {name!r:.40}",
                "tools",
            )
        if name in names:
            raise ToolError(f"tools[{i}].function.name: {name!r} given twice", "tools")
        names.add(name)
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, Mapping):
            raise ToolError(
                f"tools[{i}].function.parameters: expected a JSON schema object", "tools"
            )
    return [dict(t) for t in tools]


class ToolRequest:
    """A chat request's tools: what its template renders, the grammar it is held to and
    how its reply is read back.

    Args:
      tools: OpenAI's ``tools`` (function tools only).
      choice: ``"none"``, ``"auto"``, ``"required"`` or a function's name.
      fmt: one of ``FORMATS``.
      parallel: several calls in one reply (OpenAI's ``parallel_tool_calls``); False:
        one at most (the grammar allows one, a reply's later calls are dropped).
    """

    def __init__(self, tools: list[dict], choice: str, fmt: str, parallel: bool = True):
        self.tools, self.choice, self.fmt, self.parallel = tools, choice, fmt, parallel
        self.names = {t["function"]["name"] for t in tools}

    @classmethod
    def of(cls, body: Mapping, fmt: str) -> ToolRequest | None:
        """The request's tools from its body, or None (no tools). ``ToolError`` naming the
        field for a bad one."""
        tools, choice = body.get("tools"), body.get("tool_choice")
        parallel = body.get("parallel_tool_calls", True)
        if not isinstance(parallel, bool):
            raise ToolError(
                f"parallel_tool_calls: expected a bool, got {parallel!r:.40}", "parallel_tool_calls"
            )
        if tools is None:
            if choice not in (None, "none", "auto"):
                raise ToolError("tool_choice: needs tools", "tool_choice")
            return None
        tools = _check_tools(tools)
        if choice is None:
            choice = "auto"
        elif isinstance(choice, Mapping):
            fn = choice.get("function")
            name = fn.get("name") if isinstance(fn, Mapping) else None
            if choice.get("type") != "function" or not isinstance(name, str):
                raise ToolError(
                    'tool_choice: expected "none", "auto", "required" or {"type": '
                    '"function", "function": {"name": ...}}',
                    "tool_choice",
                )
            if name not in {t["function"]["name"] for t in tools}:
                raise ToolError(f"tool_choice: no tool named {name!r:.64}", "tool_choice")
            choice = name
        elif choice not in ("none", "auto", "required"):
            raise ToolError(
                f'tool_choice: expected "none", "auto", "required" or a function, got '
                f"{choice!r:.40}",
                "tool_choice",
            )
        return cls(tools, choice, fmt, parallel)

    @property
    def active(self) -> bool:
        return self.choice != "none"

    def template_args(self) -> dict:
        """Keyword arguments of the chat template (``tools`` unless the choice is none)."""
        return {"tools": self.tools} if self.active else {}

    def grammar(self) -> str | None:
        """A Lark grammar (llguidance's) of the reply ``required`` or a named choice
        allows: one or more calls (one for a named function) in this format, each of a
        given tool with arguments matching its schema; None otherwise."""
        if self.choice in ("none", "auto"):
            return None
        key = _ARGS[self.fmt]
        chosen = [
            t
            for t in self.tools
            if self.choice == "required" or t["function"]["name"] == self.choice
        ]
        one = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": t["function"]["name"]},
                        key: t["function"].get("parameters", {"type": "object"}),
                    },
                    "required": ["name", key],
                    "additionalProperties": False,
                }
                for t in chosen
            ],
            "x-guidance": COMPACT_JSON,
        }
        many = self.choice == "required" and self.parallel
        if self.fmt == "hermes":
            block = f'"{_HERMES_OPEN}\\n" call "\\n{_HERMES_CLOSE}"'
            start = f'start: {block} ("\\n" {block})*' if many else f"start: {block}"
            return f"{start}\ncall: %json {json.dumps(one)}"
        if self.fmt == "llama3_json":
            if many:
                return f'start: call ("; " call)*\ncall: %json {json.dumps(one)}'
            return f"start: call\ncall: %json {json.dumps(one)}"
        arr = {"type": "array", "items": one, "minItems": 1, "x-guidance": COMPACT_JSON}
        if not many:
            arr["maxItems"] = 1
        return f'start: "{_MISTRAL}" calls\ncalls: %json {json.dumps(arr)}'

    # ------------------------------------------------------------------ reading replies
    def _call(self, obj: Any) -> dict | None:
        if not isinstance(obj, Mapping) or obj.get("name") not in self.names:
            return None
        args = obj.get(_ARGS[self.fmt], obj.get("arguments", obj.get("parameters", {})))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, Mapping):
            return None
        return {
            "id": "call_" + uuid.uuid4().hex[:24],
            "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args)},
        }

    def parse(self, text: str, cut_short: bool = False) -> tuple[str | None, list[dict]]:
        """``(content, tool_calls)`` of a reply: the calls it makes in this format and
        the text around them (None when there is none). ``cut_short``: the reply ended at
        its token limit, perhaps inside a call; it is then read as a stream of it is
        (``StreamFilter``), so the calls are those a streamed reply sends, the last one's
        arguments as far as they were written (not whole JSON)."""
        if not self.active:
            return text, []
        if cut_short:
            f = StreamFilter(self)
            content = f.feed(text)
            deltas = f.call_deltas()
            rest, last = f.finish()
            calls = joined(deltas + last)
            return ((content + rest).strip() or None) if calls else text, calls
        calls: list[dict] = []
        content = text
        if self.fmt == "hermes":
            pattern = re.compile(
                re.escape(_HERMES_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(_HERMES_CLOSE) + r"|$)",
                re.S,
            )
            kept = []
            last = 0
            for m in pattern.finditer(text):
                call = self._call(_loads(m.group(1)))
                if call is not None:
                    kept.append(text[last : m.start()])
                    last = m.end()
                    calls.append(call)
            content = "".join(kept) + text[last:]
        elif self.fmt == "llama3_json":
            body = text.strip().removeprefix(_PYTHON_TAG).strip()
            if body.startswith("{"):
                parts = _json_objects(body)
                found = [self._call(p) for p in parts]
                if parts and all(c is not None for c in found):
                    calls, content = found, ""
        else:
            at = text.find(_MISTRAL)
            if at >= 0:
                arr = _loads(text[at + len(_MISTRAL) :].strip())
                found = [self._call(o) for o in arr] if isinstance(arr, list) else []
                if found and all(c is not None for c in found):
                    calls, content = found, text[:at]
        content = content.strip()
        if not self.parallel:
            calls = calls[:1]
        return (content or None) if calls else text, calls

    def stream_filter(self) -> StreamFilter:
        return StreamFilter(self)


class StreamFilter:
    """One streamed choice of a request with tools: text goes out as it comes until it
    may be the start of a call; from there it is held, and each call goes out as it is
    written: a first delta with its id and name once the name is complete (and one of
    the given tools), then its arguments' JSON text as it grows (``call_deltas``); when
    the choice ends, ``finish`` gives the rest. A call's streamed arguments are the
    model's own text (whose parse is the non-streamed reply's arguments); arguments the
    model writes as a JSON string go out whole once complete."""

    def __init__(self, req: ToolRequest):
        self.req = req
        self.text = ""  # everything so far
        self.sent = 0  # characters of it sent as content
        self.holding = False
        self.held_from = 0  # where the held text begins
        self.streamed: list[list] = []  # per call sent: [id, name, argument chars sent]
        self._pending: list[dict] = []  # deltas not handed out yet

    @property
    def called(self) -> bool:
        """Whether a call has gone out (the choice's finish reason is then
        ``tool_calls``)."""
        return bool(self.streamed)

    def feed(self, piece: str) -> str:
        """The part of the text so far that can go out as content now (the calls' deltas
        wait in ``call_deltas``)."""
        self.text += piece
        if self.holding:
            self._advance(final=False)
            return ""
        if not self.req.active:
            return self._flush(len(self.text))
        t = self.text
        if self.req.fmt == "llama3_json":  # a call is the whole reply
            head = t.lstrip()
            if head.startswith(("{", _PYTHON_TAG)):
                self._hold(self.sent)
                return ""
            if not head or _PYTHON_TAG.startswith(head):
                return ""  # undecided yet
            return self._flush(len(t))
        marker = _HERMES_OPEN if self.req.fmt == "hermes" else _MISTRAL
        at = t.find(marker, self.sent)
        if at >= 0:
            out = self._flush(at)
            self._hold(at)
            return out
        # keep back a tail that could begin the marker
        keep = next((k for k in range(len(marker) - 1, 0, -1) if t.endswith(marker[:k])), 0)
        return self._flush(len(t) - keep)

    def call_deltas(self) -> list[dict]:
        """The ``tool_calls`` deltas (OpenAI's chunk shape, each with its ``index``) made
        since the last call of this."""
        out, self._pending = self._pending, []
        return out

    def _hold(self, at: int) -> None:
        self.holding, self.held_from = True, at
        self._advance(final=False)

    def _advance(self, final: bool) -> None:
        """Queues the deltas of the calls in the held text as far as it goes."""
        for k, c in enumerate(self._known_calls()):
            if k == len(self.streamed):
                if c.name is None:
                    break
                self.streamed.append(["call_" + uuid.uuid4().hex[:24], c.name, 0])
                fn = {"name": c.name, "arguments": ""}
                self._pending.append({"index": k, "id": self.streamed[k][0],
                                      "type": "function", "function": fn})  # fmt: skip
            args = c.arguments(self.text, final)
            sent = self.streamed[k][2]
            if args is not None and len(args) > sent:
                self._pending.append({"index": k, "function": {"arguments": args[sent:]}})
                self.streamed[k][2] = len(args)

    def _known_calls(self, every: bool = False) -> list[_Call]:
        """The held text's calls of given tools (the first alone without parallel calls,
        unless ``every``)."""
        calls = _scan_calls(self.text, self.held_from, self.req.fmt)
        calls = [c for c in calls if c.name in self.req.names]
        return calls if self.req.parallel or every else calls[:1]

    def _flush(self, upto: int) -> str:
        out = self.text[self.sent : upto]
        self.sent = max(self.sent, upto)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """``(content not sent yet, tool_calls deltas)`` once the choice has ended: the
        calls' last deltas (with the calls not streamed yet), or, when the held text made
        no call, the text itself. A call the reply ended inside (cut short at its token
        limit) went out as far as it was written, so its text is not content as well."""
        rest = self.text[self.sent :]
        if not rest:
            return "", self.call_deltas()
        if self.holding:
            self._advance(final=True)
        if not self.streamed:
            content, calls = self.req.parse(rest)
            if not calls:
                return rest, []
            return content or "", [dict(c, index=i) for i, c in enumerate(calls)]
        if self.req.fmt == "hermes":  # block by block: the text between the calls
            kept, at = [], self.sent  # (without parallel calls the later ones dropped)
            for c in self._known_calls(every=True):
                kept.append(self.text[at : c.opens])
                at = _past_block(self.text, c.stops)
            return "".join(kept) + self.text[at:], self.call_deltas()
        known = self._known_calls()[: len(self.streamed)]
        if known and known[-1].stops is None:
            rest = self.text[self.sent : known[-1].opens]
        content, _ = self.req.parse(rest)
        return (content or "") if content != rest else "", self.call_deltas()


def _past_block(text: str, stops: int | None) -> int:
    """Where a hermes call block whose object ends at ``stops`` ends: past its closing
    tag, or the text's end where the object or the tag is cut short."""
    if stops is None:
        return len(text)
    j = stops
    while j < len(text) and text[j] in " \t\r\n":
        j += 1
    if text.startswith(_HERMES_CLOSE, j):
        return j + len(_HERMES_CLOSE)
    return len(text) if _HERMES_CLOSE.startswith(text[j:]) else stops


def joined(deltas: list[dict]) -> list[dict]:
    """Streamed ``tool_calls`` deltas joined into calls, as OpenAI's clients join them:
    by ``index``, the first delta with the id, type and name, the ``arguments`` pieces
    concatenated."""
    calls: dict[int, dict] = {}
    for d in deltas:
        c = calls.setdefault(d["index"], {"id": None, "type": "function", "function": {}})
        c["id"] = d.get("id", c["id"])
        fn = d.get("function", {})
        if "name" in fn:
            c["function"]["name"] = fn["name"]
        c["function"]["arguments"] = c["function"].get("arguments", "") + fn.get("arguments", "")
    return [calls[i] for i in sorted(calls)]


@dataclasses.dataclass
class _Call:
    """A call object in a reply as far as it is written: its name once its string is
    complete, and where its arguments' value lies (``end`` None while it is open)."""

    name: str | None = None
    opens: int = 0  # where the call's text begins (hermes: its opening tag)
    stops: int | None = None  # past its object's closing brace (None: still open)
    start: int | None = None
    end: int | None = None
    quoted: bool = False  # the arguments are a JSON string (not an object)

    def arguments(self, text: str, final: bool) -> str | None:
        """The arguments' text to stream so far: an object's characters as written; a
        string's decoded value once complete (None before, and when there are none)."""
        if self.start is None:
            return None
        if not self.quoted:
            return text[self.start : self.end]
        if self.end is None:
            return None
        value = _loads(text[self.start : self.end])
        return value if isinstance(value, str) else None


def _scan_calls(text: str, at: int, fmt: str) -> list[_Call]:
    """The call objects of the held reply ``text[at:]`` in format ``fmt``, the last one
    possibly unfinished."""
    calls = []
    n = len(text)

    def skip(i: int, chars: str = " \t\r\n") -> int:
        while i < n and text[i] in chars:
            i += 1
        return i

    if fmt == "hermes":
        i = at
        while True:
            i = text.find(_HERMES_OPEN, i)
            if i < 0:
                break
            opens, i = i, skip(i + len(_HERMES_OPEN))
            if i >= n or text[i] != "{":
                continue
            call, i = _scan_object(text, i)
            calls.append(dataclasses.replace(call, opens=opens))
            if i is None:
                break
        return calls
    if fmt == "llama3_json":
        i = skip(at)
        if text.startswith(_PYTHON_TAG, i):
            i = skip(i + len(_PYTHON_TAG))
        sep = "; \t\r\n"
    else:
        i = text.find(_MISTRAL, at)
        if i < 0:
            return calls
        i = skip(i + len(_MISTRAL))
        if i >= n or text[i] != "[":
            return calls
        i = skip(i + 1)
        sep = ", \t\r\n"
    while i is not None and i < n and text[i] == "{":
        call, i = _scan_object(text, i)
        calls.append(call)
        if i is not None:
            i = skip(i, sep)
    return calls


def _scan_object(text: str, i: int) -> tuple[_Call, int | None]:
    """The call object that opens at ``text[i]`` (a ``{``): its ``_Call`` and the index
    past its end (None when it does not end in ``text``)."""
    call = _Call(opens=i)
    depth, key, expect = 0, None, "key"
    in_str = escaped = False
    lit = 0  # where the string being read began
    for j in range(i, len(text)):
        ch = text[j]
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
                if depth == 1 and expect == "key":
                    key, expect = _loads(text[lit : j + 1]), "colon"
                elif depth == 1 and expect == "string":
                    if key == "name":
                        value = _loads(text[lit : j + 1])
                        call.name = value if isinstance(value, str) else None
                    elif key in _ARG_KEYS:
                        call.end = j + 1
                    expect = "comma"
            continue
        if ch == '"':
            in_str = True
            if depth == 1:
                lit = j
                if expect == "value":
                    expect = "string"
                    if key in _ARG_KEYS:
                        call.start, call.end, call.quoted = j, None, True
        elif ch in "{[":
            depth += 1
            if depth == 2 and expect == "value":
                expect = "nested"
                if key in _ARG_KEYS and ch == "{":
                    call.start, call.end, call.quoted = j, None, False
        elif ch in "}]":
            depth -= 1
            if depth == 1 and expect == "nested":
                if key in _ARG_KEYS and call.start is not None and not call.quoted:
                    call.end = j + 1
                expect = "comma"
            elif depth == 0:
                call.stops = j + 1
                return call, j + 1
        elif depth == 1:
            if ch == ":" and expect == "colon":
                expect = "value"
            elif ch == ",":
                expect = "key"
    return call, None


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _json_objects(text: str) -> list[Any]:
    """The values of ``text``'s top-level JSON objects, ``;`` between them (llama3_json's
    parallel calls), read by the standard library's ``raw_decode``; from the first piece
    that is not one object followed by a ``;`` or the end, None (it then reads as no
    call)."""
    decoder, values, i, n = json.JSONDecoder(), [], 0, len(text)
    while i < n:
        value, end = None, None
        if text[i] == "{":
            try:
                value, end = decoder.raw_decode(text, i)
            except ValueError:
                pass
        after = end
        while after is not None and after < n and text[after] in " \t\r\n":
            after += 1
        if end is None or (after < n and text[after] != ";"):
            values.append(None)
            break
        values.append(value)
        i = after + 1
        while i < n and text[i] in " \t\r\n":
            i += 1
    return values
