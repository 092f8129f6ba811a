"""``SpeculativeConfig``: what ``LLM(speculative=...)`` asks for, checked, and the
proposer it describes. No JAX here."""

from __future__ import annotations

import dataclasses
from typing import Any

from paged_jax.engine.speculative.proposers import NgramProposer, Proposer

METHODS = ("ngram", "draft")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding for ``LLM(speculative=...)``.

    Attributes:
      method: ``"ngram"``: prompt lookup, the last tokens of a sequence matched against
        its own prompt and output, the tokens that followed the latest match proposed
        (no second model).
      num_speculative_tokens: proposed tokens per sequence per step, at most (1 to 16).
      prompt_lookup_max: longest suffix matched (tried first), 1 to 16.
        ``"draft"``: a second, smaller model (``draft_model``) that shares the target's
        tokenizer proposes its greedy continuation (``paged_jax.engine.speculative.draft``).
      num_speculative_tokens: proposed tokens per sequence per step, at most (1 to 16).
      prompt_lookup_max: longest suffix matched (tried first), 1 to 16 (n-gram).
      prompt_lookup_min: shortest suffix matched, 1 to ``prompt_lookup_max`` (n-gram).
      draft_model: the draft: a paged-jax model object, or a name or path that
        ``LLM`` loads with ``paged_jax.models.load`` (method ``"draft"`` only).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    draft_model: Any = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative.method: expected one of {METHODS}, got {self.method!r}")
        for name, low, high in (
            ("num_speculative_tokens", 1, 16),
            ("prompt_lookup_max", 1, 16),
            ("prompt_lookup_min", 1, 16),
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
                raise ValueError(
                    f"speculative.{name}: expected an int in [{low}, {high}], got {v!r}"
                )
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError(
                "speculative.draft_model: expected a model with method 'draft' (and none "
                f"with {self.method!r}), got {type(self.draft_model).__name__}"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative.prompt_lookup_min: expected <= prompt_lookup_max="
                f"{self.prompt_lookup_max}, got {self.prompt_lookup_min}"
            )

    @classmethod
    def of(cls, value: Any) -> SpeculativeConfig | None:
        """``value`` as a config: None, a ``SpeculativeConfig``, or a dict of its fields
        (``{"method": "ngram", "num_speculative_tokens": 4}``)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
            if unknown:
                raise ValueError(f"speculative: unknown fields {unknown}")
            return cls(**value)
        raise TypeError(
            f"speculative: expected None, a SpeculativeConfig or a dict, got {type(value).__name__}"
        )

    def proposer(
        self, *, vocab_size: int, page_size: int, num_pages: int, **draft_args: Any
    ) -> Proposer:
        """The proposer this config describes, for a target of ``vocab_size`` tokens (a
        draft gets a pool of ``num_pages`` pages of ``page_size`` tokens, and
        ``draft_args``: ``DraftModelProposer``'s limits and compile callback)."""
        if self.method == "draft":
            from paged_jax.engine.speculative.draft import DraftModelProposer

            return DraftModelProposer(
                self.draft_model,
                vocab_size=vocab_size,
                page_size=page_size,
                num_pages=num_pages,
                max_proposals=self.num_speculative_tokens,
                **draft_args,
            )
        return NgramProposer(self.prompt_lookup_min, self.prompt_lookup_max)
