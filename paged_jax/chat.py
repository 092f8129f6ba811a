"""Chat templates: a model's Jinja template rendered the way Hugging Face's
``apply_chat_template`` renders it, so a conversation becomes the same prompt text.

The template sees ``messages`` (a list of ``{"role": ..., "content": ...}``),
``add_generation_prompt``, the tokenizer's special tokens by name (``bos_token``,
``eos_token``, ...) and any extra keyword arguments (``tools``, ``documents``, ...). The
environment matches the one transformers uses: a sandbox, ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that keeps
non-ASCII text as is, ``raise_exception(message)``, ``strftime_now(format)``, and the
``{% generation %}`` block (rendered as its body).

Host code: no JAX. Templates are untrusted input (a GGUF or a checkpoint names them),
hence the sandbox, and bounds on what one render may cost: ``MAX_RENDER_SECONDS`` of
time (checked between the template's Python lines), ``MAX_RENDER_CHARS`` for the text
and for every string or list the template builds (``+``, ``*``, ``~``, and calls or
filters given a number larger than that, such as ``ljust`` or ``indent`` widths).
Every failure is a ``ChatTemplateError``.
"""

from __future__ import annotations

import datetime
import functools
import json
import re
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from paged_jax.errors import with_context

MAX_RENDER_SECONDS = 2.0
MAX_RENDER_CHARS = 4_000_000


class ChatTemplateError(ValueError):
    """A template that does not parse, raised while rendering (``raise_exception``), failed
    in any other way, or passed the render's bounds of time and size."""


class _OutOfTime(BaseException):  # not an Exception: nothing in a template catches it
    pass


def _within(deadline: float, fn):
    """``fn()``, stopped with ``_OutOfTime`` at the first Python line run in this thread
    after ``deadline`` (``time.monotonic()``)."""

    def line(frame, event, arg):
        if time.monotonic() > deadline:
            raise _OutOfTime
        return line

    old = sys.gettrace()
    sys.settrace(lambda frame, event, arg: line)
    try:
        return fn()
    finally:
        sys.settrace(old)


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str] | None = None,
    **extra: Any,
) -> str:
    """The prompt text of ``messages`` under ``template``.

    Args:
      template: the Jinja source (a model's ``chat_template``).
      messages: the conversation, each a mapping with a string ``role`` and ``content``.
      add_generation_prompt: end with the template's opening of an assistant turn.
      special_tokens: names the template may use, e.g. ``{"bos_token": "<s>"}``.
      extra: more template variables.

    Raises TypeError / ValueError naming ``messages[i]`` for a malformed message, and
    ``ChatTemplateError`` for a template that fails to parse or render.
    """
    if not isinstance(template, str) or not template:
        raise TypeError(f"template: expected a non-empty string, got {template!r:.60}")
    check_messages(messages)
    import jinja2

    compiled = _compile(template)

    def render():
        parts, n = [], 0
        for chunk in compiled.generate(
            messages=[dict(m) for m in messages],
            add_generation_prompt=bool(add_generation_prompt),
            **dict(special_tokens or {}),
            **extra,
        ):
            n += len(chunk)
            if n > MAX_RENDER_CHARS:
                raise ChatTemplateError(
                    f"chat template: the prompt passed {MAX_RENDER_CHARS:,} characters"
                )
            parts.append(chunk)
        return "".join(parts)

    try:
        return _within(time.monotonic() + MAX_RENDER_SECONDS, render)
    except ChatTemplateError:
        raise
    except _OutOfTime:
        raise ChatTemplateError(
            f"chat template: rendering took more than {MAX_RENDER_SECONDS:g} s"
        ) from None
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template: {e}") from None
    except (Exception, RecursionError, MemoryError) as e:  # a template's own failure
        raise ChatTemplateError(f"chat template: {type(e).__name__}: {e}"[:500]) from None


def render_prompt(
    tokenizer: Any,
    messages: Sequence[Mapping],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    **template_args: Any,
) -> list[int]:
    """The token ids of conversation ``messages`` rendered with ``tokenizer``'s chat
    template (its ``apply_chat_template``, as ``paged_jax.models`` tokenizers have;
    ``template_args`` go to the template), as ``LLM.chat`` and the server's chat route
    both render it. ``continue_final_message``: the reply goes on with the final
    (assistant) message instead of starting a new one (its text is cut after that
    message's content, then tokenized without special tokens). ``ValueError`` (a
    ``ChatTemplateError`` from the template) otherwise."""
    render = getattr(tokenizer, "apply_chat_template", None)
    if render is None or getattr(tokenizer, "chat_template", "") is None:
        raise ValueError(
            "tokenizer: chat needs a tokenizer with a chat template (apply_chat_template), "
            "such as paged_jax.models.load gives"
        )
    if continue_final_message:
        text = render(messages, tokenize=False, add_generation_prompt=False, **template_args)
        cut = cut_after_final_message(text, messages)
        try:
            cut.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate: no tokenizer takes it
            raise ValueError(
                f"messages: not valid Unicode text (a lone UTF-16 surrogate at character {e.start})"
            ) from None
        ids = tokenizer.encode(cut, add_special_tokens=False)
        return list(getattr(ids, "ids", ids))
    return list(
        render(
            messages, tokenize=True, add_generation_prompt=add_generation_prompt, **template_args
        )
    )


def render_conversations(tokenizer: Any, conversations: Any, **kw: Any) -> list[list[int]]:
    """``render_prompt`` of each conversation of ``conversations`` (a list of them, or
    one: a list of messages), as ``LLM.chat`` takes them; an error names
    ``conversations[k]``."""
    if isinstance(conversations, (str, bytes)) or not isinstance(conversations, Sequence):
        raise TypeError(
            "conversations: expected a list of messages or a list of conversations, got "
            f"{type(conversations).__name__}"
        )
    single = bool(conversations) and isinstance(conversations[0], Mapping)
    prompts = []
    for k, conv in enumerate([conversations] if single else conversations):
        try:
            prompts.append(render_prompt(tokenizer, conv, **kw))
        except (TypeError, ValueError) as e:
            if str(e).startswith("tokenizer:"):  # the model's, no conversation's
                raise
            raise with_context(e, f"conversations[{k}]") from None
    return prompts


def cut_after_final_message(rendered: str, messages: Sequence[Mapping]) -> str:
    """``rendered`` (the conversation ``messages`` under its chat template, without a
    generation prompt) cut right after the final message's content, so that generation
    goes on with that message instead of starting a new one (vLLM's and transformers'
    ``continue_final_message``: a reply prefilled with its first words). ValueError
    naming ``messages`` when the final message is not an assistant's text, or the
    template does not write it as given."""
    final = messages[-1] if messages else None
    content = final.get("content") if isinstance(final, Mapping) else None
    if not isinstance(content, str) or not content.strip() or final.get("role") != "assistant":
        raise ValueError(
            "messages: continue_final_message needs a final assistant message with text"
        )
    for text in (content, content.strip()):  # (templates may strip a message)
        at = rendered.rfind(text)
        if at >= 0:
            return rendered[: at + len(text)]
    raise ValueError(
        "messages: the chat template does not write the final message's content as given, "
        "so it cannot be continued"
    )


def check_messages(messages: Any) -> None:
    """Raises TypeError / ValueError naming ``messages[i]`` unless ``messages`` is a
    non-empty list of mappings with string ``role`` and ``content`` (``content`` may be
    None in an assistant message that makes ``tool_calls``, as OpenAI's API allows)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages: expected a list of messages, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages: expected at least one message, got none")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TypeError(f"messages[{i}]: expected a mapping, got {type(m).__name__}")
        for key in ("role", "content"):
            if key == "content" and m.get(key) is None and m.get("tool_calls"):
                continue
            if not isinstance(m.get(key), str):
                raise ValueError(f"messages[{i}]: expected a string {key!r}, got {m.get(key)!r}")


def _check_size(x: Any) -> Any:
    from jinja2.sandbox import SecurityError

    if isinstance(x, (str, list, tuple)) and len(x) > MAX_RENDER_CHARS:
        raise SecurityError(f"a value of {len(x):,} items (at most {MAX_RENDER_CHARS:,})")
    return x


def _check_args(args, kwargs) -> None:
    from jinja2.sandbox import SecurityError

    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_RENDER_CHARS:
            raise SecurityError(f"an argument of {a} (at most {MAX_RENDER_CHARS:,})")


# A format spec with a width or precision of 7 digits or more (a million characters).
_WIDE = re.compile(r"%[-+ #0]*[0-9]{7}|%[-+ #0]*[0-9]*\.[0-9]{7}|\{[^{}]*:[^{}]*[0-9]{7}")


def _check_format(fmt: Any) -> None:
    """Refuses a ``%`` or ``str.format`` pattern asking for a million characters or more
    (checked before the string is built)."""
    from jinja2.sandbox import SecurityError

    if isinstance(fmt, str) and _WIDE.search(fmt):
        raise SecurityError("a format width of a million characters or more")


def _bounded_args(f):
    """Filter ``f`` refusing numbers above ``MAX_RENDER_CHARS`` (widths, counts) and
    results longer than that; Jinja's pass-context marks are kept."""

    @functools.wraps(f)
    def bounded(*args, **kwargs):
        _check_args(args[1:], kwargs)
        if f.__name__ == "do_format" and args:
            _check_format(args[0])
        return _check_size(f(*args, **kwargs))

    return bounded


def _sandbox():
    import jinja2.compiler
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    class Generator(jinja2.compiler.CodeGenerator):
        def visit_Concat(self, node, frame):  # ``a ~ b``: joined with a bound
            self.write("environment.bounded_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class Bounded(ImmutableSandboxedEnvironment):
        code_generator_class = Generator
        intercepted_binops = frozenset(["+", "*", "**", "%"])

        def call_binop(self, context, operator, left, right):
            sized = (str, list, tuple)
            if operator == "**" and isinstance(right, (int, float)) and abs(right) > 256:
                raise SecurityError(f"a power of {right} (at most 256)")
            if operator == "*":
                for a, b in ((left, right), (right, left)):
                    if (
                        isinstance(a, sized)
                        and isinstance(b, int)
                        and len(a) * b > MAX_RENDER_CHARS
                    ):
                        raise SecurityError(f"a repetition to {len(a) * b:,} items")
            if operator == "%":
                _check_format(left)
            if operator == "+" and isinstance(left, sized) and isinstance(right, sized):
                if len(left) + len(right) > MAX_RENDER_CHARS:
                    raise SecurityError(f"a value of {len(left) + len(right):,} items")
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's names)
            _check_args(args, kwargs)
            if getattr(__obj, "__name__", None) in ("format", "format_map"):
                method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
                _check_format(getattr(method, "__self__", None))
            return _check_size(super().call(__context, __obj, *args, **kwargs))

        @staticmethod
        def bounded_concat(parts):
            text = [str(p) for p in parts]
            if sum(map(len, text)) > MAX_RENDER_CHARS:
                raise SecurityError(f"a string of {sum(map(len, text)):,} characters")
            return "".join(text)

    return Bounded


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    import jinja2
    import jinja2.ext

    _Bounded = _sandbox()

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: renders its body (transformers uses
        it to mark assistant tokens; the text is the same)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = _Bounded(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    for name, f in list(env.filters.items()):
        env.filters[name] = _bounded_args(f)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template: line {e.lineno}: {e.message}") from None
