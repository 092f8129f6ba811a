"""Scoring text with a model: each token's log-probability given the tokens before it
(``SamplingParams.prompt_logprobs``), over a text longer than one context in strided
windows, summed into a perplexity (``perplexity``; ``paged-jax perplexity``). The windows
are requests like any other: the engine batches them continuously."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

from paged_jax.engine.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class Perplexity:
    """What ``perplexity`` measured: ``tokens`` scored (each given at least one token
    before it), in ``windows`` requests of at most ``context`` tokens ``stride`` apart,
    their summed negative log-likelihood ``nll`` (nats) and the ``seconds`` it took."""

    tokens: int
    windows: int
    context: int
    stride: int
    nll: float
    seconds: float

    @property
    def perplexity(self) -> float:
        """``exp(nll / tokens)``."""
        return math.exp(self.nll / self.tokens)

    @property
    def mean_logprob(self) -> float:
        return -self.nll / self.tokens

    def as_dict(self) -> dict:
        return dict(
            dataclasses.asdict(self), perplexity=self.perplexity, mean_logprob=self.mean_logprob
        )


def windows(num_tokens: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """The strided windows over ``num_tokens`` tokens, as ``(begin, end, first)``: window
    ``[begin, end)`` of at most ``context`` tokens, the next one ``stride`` later, whose
    tokens ``[first, end)`` it scores: those no window before it scored, given every token
    of the window before them (the first token of the text, and of a window that starts
    where the one before ended, has none and is not scored). Every token but the first
    is scored once when ``stride <= context``."""
    out, begin, scored = [], 0, 0
    while True:
        end = min(begin + context, num_tokens)
        first = max(scored, begin + 1)
        if first < end:
            out.append((begin, end, first))
        scored = end
        if end == num_tokens:
            return out
        begin += stride


def perplexity(
    llm: Any,
    token_ids: Sequence[int],
    *,
    context: int,
    stride: int | None = None,
    progress: bool = True,
    lora: str | None = None,
) -> Perplexity | None:
    """The perplexity of ``token_ids`` under ``llm``'s model: windows of ``context``
    tokens, ``stride`` apart (default ``context // 2``; ``windows``), each a request whose
    prompt log-probs score its new tokens, all batched by the engine.

    ``context`` is at most ``llm.max_model_len - 1`` (each request samples one token,
    which is dropped). A larger ``stride`` is faster (less recomputed context) and gives
    the later tokens of each window less context: ``stride == context`` cuts the text
    into disjoint windows. Raises ValueError naming the argument for bad input. With
    several processes (a mesh across hosts): the result on process 0, None on the
    others, as ``LLM.generate`` returns its outputs."""
    ids = list(token_ids)
    if len(ids) < 2:
        raise ValueError(f"token_ids: expected at least 2 tokens, got {len(ids)}")
    most = llm.max_model_len - 1
    if isinstance(context, bool) or not isinstance(context, int) or not 2 <= context <= most:
        raise ValueError(
            f"context: expected an int in [2, {most}] (max_model_len - 1), got {context!r}"
        )
    stride = context // 2 if stride is None else stride
    if isinstance(stride, bool) or not isinstance(stride, int) or not 1 <= stride <= context:
        raise ValueError(f"stride: expected an int in [1, context={context}], got {stride!r}")
    plan = windows(len(ids), context, stride)
    t = time.perf_counter()
    outs = llm.generate(
        [ids[b:e] for b, e, _ in plan],
        SamplingParams(max_tokens=1, prompt_logprobs=0),
        progress=progress,
        lora=lora,
    )
    if not llm.is_main_process:
        return None
    nll, count = 0.0, 0
    for (b, e, first), out in zip(plan, outs, strict=True):
        if out.error is not None:
            raise RuntimeError(f"the engine failed window [{b}, {e}): {out.error}")
        part = out.prompt_logprobs[first - b : e - b]
        nll -= math.fsum(part)
        count += len(part)
    return Perplexity(count, len(plan), context, stride, nll, time.perf_counter() - t)
