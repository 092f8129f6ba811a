"""Tokenizers of the model layer: ``TextTokenizer`` (a ``tokenizers.Tokenizer`` with the
checkpoint's chat template and special tokens) and ``ByteTokenizer`` for the built-in tiny
model (no files, no dependencies)."""

from __future__ import annotations

from typing import Any

from paged_jax.chat import render_chat


class ByteTokenizer:
    """Token ids 0..255 are UTF-8 bytes; ``bos_id`` / ``eos_id`` follow them."""

    def __init__(self, bos_id: int = 256, eos_id: int = 257):
        self.bos_id, self.eos_id = bos_id, eos_id

    def encode(
        self, text: str, add_special_tokens: bool = True, *, add_bos: bool | None = None
    ) -> list[int]:
        """UTF-8 bytes of ``text``, after ``bos_id`` when ``add_special_tokens`` (or its
        older name ``add_bos``)."""
        ids = list(text.encode("utf-8"))
        bos = add_special_tokens if add_bos is None else add_bos
        return [self.bos_id, *ids] if bos else ids

    def decode(self, ids) -> str:
        return bytes([i for i in ids if 0 <= i < 256]).decode("utf-8", errors="replace")


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` with what a checkpoint says around it: its chat template
    and special tokens. Everything else (``encode(text).ids``, ``decode``,
    ``token_to_id``, ...) is the wrapped tokenizer's.

    Args:
      tokenizer: a ``tokenizers.Tokenizer``.
      chat_template: the model's Jinja chat template, or None.
      special_tokens: their text by name, e.g. ``{"bos_token": "<s>", "eos_token": "</s>"}``
        (the names chat templates use).
    """

    def __init__(self, tokenizer: Any, *, chat_template: str | None = None, special_tokens=None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template or None
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}

    def encode(self, text: str, add_special_tokens: bool = True):
        """The ``tokenizers.Encoding`` of ``text`` (``.ids``, ``.tokens``)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    # decode(ids) is self.tokenizer's with special tokens skipped: the engine may decode
    # outputs incrementally with the library's DecodeStream (engine/outputs.py)
    stream_decodable = True

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages,
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **extra: Any,
    ) -> str | list[int]:
        """The prompt of a conversation (``[{"role": ..., "content": ...}, ...]``) under the
        model's chat template: text, or with ``tokenize`` its token ids (the template
        writes the special tokens itself, so none are added). Raises ValueError when the
        checkpoint has no chat template, and what ``paged_jax.chat.render_chat`` raises."""
        if self.chat_template is None:
            raise ValueError("tokenizer: this model has no chat template")
        text = render_chat(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens,
            **extra,
        )
        return self.encode(text, add_special_tokens=False).ids if tokenize else text

    def __getattr__(self, name: str) -> Any:
        if name == "tokenizer":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.tokenizer, name)
