"""The serving engine: continuous batching, sampling, n-way sampling and beam search on
copy-on-write pages, prefix caching, preemption by swap or recompute."""

from paged_jax.engine.embedding import EmbeddingOutput
from paged_jax.engine.llm import (
    LLM,
    CompletionOutput,
    EngineFailedError,
    EngineMetrics,
    RequestMetrics,
    RequestOutput,
    StreamOutput,
)
from paged_jax.engine.protocol import PagedDecoder, check_model
from paged_jax.engine.sampling import SamplingParams
from paged_jax.engine.speculative import SpeculativeConfig

__all__ = [
    "LLM",
    "CompletionOutput",
    "EmbeddingOutput",
    "EngineFailedError",
    "EngineMetrics",
    "RequestMetrics",
    "PagedDecoder",
    "RequestOutput",
    "SamplingParams",
    "SpeculativeConfig",
    "StreamOutput",
    "check_model",
]
