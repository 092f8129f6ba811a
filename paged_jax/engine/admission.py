"""``RequestChecker``: what the engine checks of a request before it is queued (its
prompt's tokens and length, its sampling parameters against the model, ``n`` or
``beam_width`` against a step, the pages it may need against the pool). It reads only
the engine's configuration, so another thread may call it while the engine steps (the
server does, before it answers). No JAX here."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from paged_jax.block_manager import prefix_root_key
from paged_jax.engine.sampling import SamplingParams
from paged_jax.errors import FieldError


class RequestChecker:
    """Checks requests against an engine's limits.

    Args:
      tokenizer: for string prompts (None: token ids only).
      vocab_size, max_model_len: the model's.
      schedulers: each data-parallel replica's ``Scheduler`` (every one has the same
        limits and pool size; the first is read).
      grammars: a callable returning the engine's ``structured.Grammars`` (a request's
        schema or grammar is compiled, or refused, here).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        vocab_size: int,
        max_model_len: int,
        schedulers: list,
        grammars: Callable,
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.schedulers = schedulers
        self.grammars = grammars

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of ``prompt``: a string (through the tokenizer) or a sequence of ints
        (Python or NumPy integers; floats, bools, strings and mappings are refused, not
        coerced)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise FieldError("prompt", "a string needs a tokenizer; pass token ids")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate: no tokenizer takes it
                raise FieldError(
                    "prompt",
                    f"not valid Unicode text (a lone UTF-16 surrogate at character {e.start})",
                ) from None
            ids = self.tokenizer.encode(prompt)
            return list(getattr(ids, "ids", ids))
        if isinstance(prompt, bytes) or not isinstance(prompt, Sequence | np.ndarray):
            raise TypeError(
                f"prompt: expected a string or a sequence of token ids, got {type(prompt).__name__}"
            )
        ids = []
        for k, t in enumerate(prompt):
            if isinstance(t, bool) or not isinstance(t, int | np.integer):
                raise TypeError(f"prompt[{k}]: expected an int token id, got {t!r}")
            ids.append(int(t))
        return ids

    def check(self, prompt, params: SamplingParams, cache_salt) -> tuple[list[int], int]:
        """``(token ids, sequences)`` of a request that passes every check;
        ``ValueError`` / ``TypeError`` naming what is wrong otherwise."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params: expected SamplingParams, got {type(params).__name__}")
        self._check_params(params)
        ids = self.encode(prompt)
        if not ids:
            raise FieldError("prompt", "expected at least one token, got an empty prompt")
        vocab = self.vocab_size
        allowed = params.allowed_token_ids
        if allowed is not None and max(allowed) >= vocab:
            raise FieldError(
                "params.allowed_token_ids",
                f"token ids must lie in [0, {vocab}), got {max(allowed)}",
            )
        if params.logit_bias and params.logit_bias[-1][0] >= vocab:
            raise FieldError(
                "params.logit_bias",
                f"token ids must lie in [0, {vocab}), got {params.logit_bias[-1][0]}",
            )
        if min(ids) < 0 or max(ids) >= vocab:
            k = next(i for i, t in enumerate(ids) if not 0 <= t < vocab)
            raise FieldError(
                "prompt", f"token ids must lie in [0, {vocab}), prompt[{k}] is {ids[k]}"
            )
        try:  # checked here: with prefix caching off it would only fail much later
            prefix_root_key(cache_salt)
        except TypeError as e:
            raise TypeError(f"cache_salt: {str(e).removeprefix('extra_key: ')}") from None
        if len(ids) >= self.max_model_len:
            raise FieldError(
                "prompt",
                f"{len(ids)} tokens, the model's maximum length is "
                f"{self.max_model_len} (one more is needed to generate)",
            )
        return ids, self._check_room(ids, params)

    def _check_params(self, params: SamplingParams) -> None:
        """What of ``params`` needs this engine's tokenizer: stop strings, a grammar (which
        it compiles)."""
        if params.stop and self.tokenizer is None:
            raise FieldError("params.stop", "stop strings need a tokenizer; this engine has none")
        if params.structured is not None:
            if self.tokenizer is None:
                raise FieldError(
                    "params.structured", "structured output needs a tokenizer; this engine has none"
                )
            self.grammars().matcher(params.structured)  # refuses a bad schema or grammar

    def _check_room(self, ids: list[int], params: SamplingParams) -> int:
        """The request's sequences, checked against a step's limits and the pool."""
        width = params.beam_width if params.use_beam_search else params.n
        # A group's sequences are scheduled together: one wider than a step can hold would
        # never run, and the scheduler, which keeps arrival order, would stall behind it.
        name = "beam_width" if params.use_beam_search else "n"
        first = self.schedulers[0]  # every replica has the same limits and pool size
        for limit, value in (
            ("max_num_seqs", first.max_num_seqs),
            ("max_num_batched_tokens", first.max_num_batched_tokens),
        ):
            if width > value:
                raise FieldError(
                    f"params.{name}",
                    f"{width} sequences, more than {limit}={value} "
                    f"(a group's sequences run in the same step)",
                )
        worst = min(len(ids) + params.max_tokens, self.max_model_len)
        pages = width * first.bm.pages_needed(worst)
        usable = first.bm.num_pages - 1 - first.bm.watermark_pages
        if pages > usable:
            raise ValueError(
                f"request needs up to {pages} pages ({width} x {worst} tokens), the pool "
                f"has {usable}: lower max_tokens / n / beam_width or add pages"
            )
        return width
