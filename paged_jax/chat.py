"""Chat templates: a model's Jinja template rendered the way Hugging Face's
``apply_chat_template`` renders it, so a conversation becomes the same prompt text.

The template sees ``messages`` (a list of ``{"role": ..., "content": ...}``),
``add_generation_prompt``, the tokenizer's special tokens by name (``bos_token``,
``eos_token``, ...) and any extra keyword arguments (``tools``, ``documents``, ...). The
environment matches the one transformers uses: a sandbox, ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that keeps
non-ASCII text as is, ``raise_exception(message)``, ``strftime_now(format)``, and the
``{% generation %}`` block (rendered as its body).

Host code: no JAX. Templates are untrusted input, hence the sandbox.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any


class ChatTemplateError(ValueError):
    """A template that does not parse, or raised while rendering (``raise_exception``)."""


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
    try:
        return compiled.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=bool(add_generation_prompt),
            **dict(special_tokens or {}),
            **extra,
        )
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template: {e}") from None


def check_messages(messages: Any) -> None:
    """Raises TypeError / ValueError naming ``messages[i]`` unless ``messages`` is a
    non-empty list of mappings with string ``role`` and ``content``."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages: expected a list of messages, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages: expected at least one message, got none")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TypeError(f"messages[{i}]: expected a mapping, got {type(m).__name__}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise ValueError(f"messages[{i}]: expected a string {key!r}, got {m.get(key)!r}")


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

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

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template: line {e.lineno}: {e.message}") from None
