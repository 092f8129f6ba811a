"""Structured output: a request's tokens constrained to a JSON schema, any JSON object, a
regular expression, a choice among strings or a Lark grammar.

``SamplingParams(structured=StructuredOutput(json=schema))`` asks for it. The engine keeps
one grammar matcher per sequence on the host (``llguidance``, chosen by measurement:
docs/DECISIONS.md), fills each constrained row's token bitmask before the step (the
``allowed`` input of ``sample_rows``: every other token's logit becomes -inf, for greedy
and sampled rows alike), feeds it each sampled token, and ends the sequence ("stop") when
the grammar allows nothing more. Constrained rows are never scheduled before their last
token is known (no overlapped or multi-step launches for them). Host code: no JAX.

Needs the ``llguidance`` package (``pip install llguidance``; in the ``structured`` and
``test`` extras).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from paged_jax.errors import FieldError

_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """Exactly one constraint:

    - ``json``: a JSON schema (a dict, or its JSON text);
    - ``json_object``: True for any JSON object;
    - ``regex``: a regular expression the whole output matches;
    - ``choice``: strings, one of which is the whole output;
    - ``grammar``: a Lark grammar (llguidance's dialect) whose ``start`` rule the output
      matches.

    ``think``: a reasoning model's thinking comes first, unconstrained, and the constraint
    holds from the end of the block on (``paged_jax.server.reasoning``'s rule):
    ``"inside"``, the prompt opened ``<think>`` and the output starts inside it (any text
    up to the first ``</think>``); ``"optional"``, the output may open with a
    ``<think>`` ... ``</think>`` block (after whitespace). Whitespace may follow the
    block. None (default): the whole output is constrained.

    Raises ``ValueError`` / ``TypeError`` naming the field for a malformed one (a schema or
    grammar the library refuses is found when a request is added, against the engine's
    tokenizer).
    """

    json: Mapping[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    think: str | None = None

    def __post_init__(self):
        if self.think not in (None, "inside", "optional"):
            raise ValueError(
                f"structured.think: expected None, 'inside' or 'optional', got {self.think!r:.40}"
            )
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured: expected exactly one of {', '.join(_KINDS)}, got "
                f"{', '.join(given) or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (Mapping, str)):
            raise TypeError(
                f"structured.json: expected a JSON schema (a dict or its text), got "
                f"{type(self.json).__name__}"
            )
        if not isinstance(self.json_object, bool):
            raise TypeError(f"structured.json_object: expected a bool, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(
                    f"structured.{name}: expected a non-empty string, got {value!r:.60}"
                )
        if self.choice is not None:
            choice = self.choice
            if isinstance(choice, str) or not all(isinstance(c, str) and c for c in choice):
                raise TypeError(
                    f"structured.choice: expected a list of non-empty strings, got {choice!r:.60}"
                )
            if not choice:
                raise ValueError("structured.choice: expected at least one string, got none")
            object.__setattr__(self, "choice", tuple(choice))

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str, str | None]:
        """(kind, text, think): what the compiled grammar depends on (a cache key)."""
        kind = self.kind
        if kind == "json":
            text = (
                self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
            )
        elif kind == "choice":
            text = "\x00".join(self.choice)
        else:
            text = "" if kind == "json_object" else getattr(self, kind)
        return kind, text, self.think


def _llguidance():
    try:
        import llguidance
        import llguidance.numpy
    except ImportError:
        raise FieldError(
            "params.structured",
            "structured output needs the llguidance package (pip install llguidance)",
        ) from None
    return llguidance


class Grammars:
    """One engine's grammar compiler: the tokenizer adapted once, each distinct constraint
    compiled once (``matcher`` copies a compiled one). ``tokenizer``: a ``TextTokenizer``
    (its ``tokenizers.Tokenizer``'s JSON describes the vocabulary); ``eos``: the model's
    end-of-sequence token, which the grammar allows once it is complete; ``vocab``: the
    model's vocabulary (at least the tokenizer's; rows past the tokenizer's are never
    allowed)."""

    def __init__(self, tokenizer: Any, eos: int | None, vocab: int):
        self._tokenizer = tokenizer
        self._eos = eos
        self.vocab = vocab
        self._lt = None
        self._cache: dict = {}
        self._executor = None  # llguidance's thread pool, made at the first parallel fill

    def _adapted(self):
        if self._lt is None:
            llg = _llguidance()
            inner = getattr(self._tokenizer, "tokenizer", None)
            if inner is None or not hasattr(inner, "to_str"):
                raise FieldError(
                    "params.structured",
                    "needs a model whose tokenizer is a tokenizers "
                    "Tokenizer (a Hugging Face checkpoint's or a GGUF file's)",
                )
            self._lt = llg.LLTokenizer(inner.to_str(), eos_token=self._eos)
        return self._lt

    def matcher(self, spec: StructuredOutput):
        """A fresh matcher of ``spec``; ``ValueError`` naming the field when the library
        refuses the schema, expression or grammar."""
        return _compiled(self, spec.key()).deep_copy()

    def fill(self, matcher, masks, row: int) -> None:
        """Row ``row`` of ``masks`` (``i32[rows, ceil(vocab / 32)]``) := the tokens
        ``matcher`` allows next."""
        llg = _llguidance()
        words = -(-self._adapted().vocab_size // 32)
        if words == masks.shape[1]:  # the common case: the vocabularies agree
            llg.numpy.fill_next_token_bitmask(matcher, masks, row)
            return
        tmp = np.zeros((1, words), np.int32)  # a padded model vocabulary: the rest stays 0
        llg.numpy.fill_next_token_bitmask(matcher, tmp, 0)
        masks[row] = 0
        masks[row, :words] = tmp[0]

    def fill_rows(self, pairs: Sequence[tuple[Any, int]], masks) -> None:
        """``fill`` for each ``(matcher, row)`` of ``pairs``: from ``PARALLEL_ROWS`` rows
        on, in parallel on llguidance's thread pool (``LLExecutor``, a thread a core; its
        ``fill_next_token_bitmask_par``), each row as ``fill`` writes it; fewer, row by
        row."""
        if len(pairs) < PARALLEL_ROWS:
            for matcher, row in pairs:
                self.fill(matcher, masks, row)
            return
        llg = _llguidance()
        if self._executor is None:
            self._executor = llg.LLExecutor()
        words = -(-self._adapted().vocab_size // 32)
        if words == masks.shape[1]:  # the common case: the vocabularies agree
            llg.numpy.fill_next_token_bitmask_par(self._executor, list(pairs), masks)
            return
        tmp = np.zeros((masks.shape[0], words), np.int32)  # a padded model vocabulary
        llg.numpy.fill_next_token_bitmask_par(self._executor, list(pairs), tmp)
        for _, row in pairs:  # (the rest of each row stays 0)
            masks[row] = 0
            masks[row, :words] = tmp[row]


# The constrained rows of a step from which their masks are filled in parallel: the thread
# pool's hand-off costs about 0.1 ms a call, which fewer rows do not repay (2 cores, SmolLM2's
# vocabulary, medians of 20 steps: 8 rows 0.06 ms row by row against 0.12 together, 32 rows
# 0.18 against 0.17, 256 rows 1.03 against 0.60; python -m benchmarks grammar --step-rows N)
PARALLEL_ROWS = 32

# JSON as json.dumps writes it: a model may not pad it with whitespace without end
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# A reasoning model's thinking before the constrained part (StructuredOutput.think): lazy
# lexemes, so each ends at the first "</think>"
_THINK = {
    "inside": "think[lazy]: /(?s:.*)<\\/think>/\n",
    "optional": "think[lazy]: /[ \\t\\r\\n]*<think>(?s:.*)<\\/think>/\n",
}


def _after_thinking(kind: str, text: str, think: str) -> str:
    """A Lark grammar: the thinking block (``_THINK[think]``), whitespace, then the
    constraint ``(kind, text)`` as its ``body`` rule."""
    if kind in ("json", "json_object"):
        schema = json.loads(text) if kind == "json" else {"type": "object"}
        if not isinstance(schema, dict):
            raise ValueError("expected a JSON schema object")
        body = "body: %json " + json.dumps({**schema, "x-guidance": COMPACT_JSON})
    elif kind == "regex":  # a terminal: its slashes escaped for Lark's /.../
        body = "body: /" + re.sub(r"(?<!\\)/", r"\/", text) + "/"
    elif kind == "choice":
        body = "body: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in text.split("\x00"))
    else:  # a grammar: its start rule renamed to body (a grammar that refers to its own
        # start rule elsewhere then refers to the whole output)
        body, n = re.subn(r"(?m)^(\s*)start(\s*(?:\[[^\]]*\])?\s*:)", r"\1body\2", text)
        if n != 1:
            raise ValueError("expected one start rule to put after the thinking")
    first = "start: think ws body\n" if think == "inside" else "start: think? ws body\n"
    return first + _THINK[think] + "ws: /[ \\t\\r\\n]*/\n" + body + "\n"


def _compiled(grammars: Grammars, key: tuple[str, str, str | None]):
    """The matcher of ``key`` in its initial state, compiled once per engine (the 64 most
    recent kept)."""
    cache = grammars._cache
    if key in cache:
        return cache[key]
    llg = _llguidance()
    lt = grammars._adapted()
    kind, text, think = key
    field = f"params.structured.{kind}"
    try:
        if think is not None:
            grammar = llg.LLMatcher.grammar_from_lark(_after_thinking(kind, text, think))
        elif kind in ("json", "json_object"):  # compact JSON: ", " and ": ", no free spaces
            schema = text if kind == "json" else '{"type": "object"}'
            grammar = llg.LLMatcher.grammar_from_json_schema(schema, overrides=COMPACT_JSON)
        elif kind == "regex":
            grammar = llg.LLMatcher.grammar_from_regex(text)
        elif kind == "choice":
            alts = "|".join(re.escape(c) for c in text.split("\x00"))
            grammar = llg.LLMatcher.grammar_from_regex(f"(?:{alts})")
        else:
            grammar = llg.LLMatcher.grammar_from_lark(text)
    except Exception as e:  # the library's own refusal of the text
        raise FieldError(field, str(e).strip().splitlines()[0] if str(e) else repr(e)) from None
    m = llg.LLMatcher(lt, grammar)
    if m.is_error():
        raise FieldError(field, m.get_error().strip().splitlines()[0])
    if len(cache) >= 64:
        cache.pop(next(iter(cache)))
    cache[key] = m
    return m
