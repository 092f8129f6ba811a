"""Reading a GGUF file's metadata: each key's value checked to be of the kind expected
(``field``), and the error every failure raises (``GGUFError``, naming the file and the
key). No JAX."""

from __future__ import annotations

import math
import numbers
from typing import Any


class GGUFError(ValueError):
    """A GGUF file this loader cannot read: unsupported architecture, block format or
    tokenizer, or missing metadata. The message names the file and the key or tensor."""


class _Required:
    pass


_REQUIRED: Any = _Required()


_KINDS = {  # kind: (what the error says it expected, the check, the conversion)
    "str": ("a string", lambda v: isinstance(v, str), str),
    "int": (
        "an integer",
        lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool),
        int,
    ),
    "count": (
        "an integer >= 1",
        lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 1,
        int,
    ),
    "float": (
        "a number",
        lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v),
        float,
    ),
    "bool": ("a bool", lambda v: isinstance(v, (bool, numbers.Integral)), bool),
    "strs": (
        "an array of strings",
        lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
        list,
    ),
    "ints": (
        "an array of integers",
        lambda v: (
            isinstance(v, list)
            and all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in v)
        ),
        list,
    ),
    "floats": (
        "an array of numbers",
        lambda v: (
            isinstance(v, list)
            and all(isinstance(x, numbers.Real) and not isinstance(x, bool) for x in v)
        ),
        list,
    ),
}


def field(
    reader: Any, key: str, path: Any, default: Any = _REQUIRED, kind: str | None = None
) -> Any:
    """Metadata ``key``'s value, checked to be of ``kind`` (``_KINDS``) when given;
    ``default`` when it is absent (``_REQUIRED``: a ``GGUFError``). Every failure is a
    ``GGUFError`` naming the file and the key."""
    f = reader.fields.get(key)
    if f is None:
        if default is _REQUIRED:
            raise GGUFError(f"{path}: metadata key {key!r} is missing")
        return default
    try:
        value = f.contents()
    except Exception as e:  # the reader's own failure on malformed bytes
        raise GGUFError(
            f"{path}: metadata key {key!r} cannot be read ({type(e).__name__})"
        ) from None
    if kind is None:
        return value
    expected, ok, convert = _KINDS[kind]
    if not ok(value):
        shown = f"an array of {len(value)}" if isinstance(value, list) else f"{value!r:.60}"
        raise GGUFError(f"{path}: metadata key {key!r}: expected {expected}, got {shown}")
    return convert(value)


def token_id(reader: Any, key: str, path: Any, num_tokens: int | None) -> int | None:
    """A token id key (``tokenizer.ggml.bos_token_id``, ...): None when absent, else an
    integer in ``[0, num_tokens)`` (unchecked when ``num_tokens`` is None)."""
    i = field(reader, key, path, None, "int")
    if i is not None and (i < 0 or (num_tokens is not None and i >= num_tokens)):
        bound = "" if num_tokens is None else f" < {num_tokens} (the vocabulary)"
        raise GGUFError(f"{path}: metadata key {key!r}: expected a token id >= 0{bound}, got {i}")
    return i
