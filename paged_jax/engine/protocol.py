"""What ``LLM`` needs from a model: the ``PagedDecoder`` protocol and its check.

A model is any ``flax.nnx.Module`` with

* ``config``: an object with ``vocab_size`` (V) and ``max_position_embeddings`` (the
  longest sequence the engine admits), and optionally ``eos_token_ids`` (ids that end a
  request, default none);
* ``make_cache(num_pages, page_size, dtype=None) -> PagedKVCache``: an empty pool shaped
  for the model (its layers, KV heads and head size);
* ``__call__(tokens, positions, cache, metadata) -> (logits, cache)``: one engine step.
  ``tokens``, ``positions``: ``i32[T]``, the step's new tokens of every sequence,
  concatenated; ``cache``: the ``PagedKVCache``; ``metadata``: ``AttentionMetadata``.
  The model writes each new token's K and V with ``cache.write(layer, k, v,
  metadata.slot_mapping)``, attends with ``paged_jax.ragged_paged_attention(q, cache,
  layer, metadata)`` and returns ``f32[R, V]`` logits of the rows
  ``metadata.logits_indices`` (gather them before the LM head) with the new cache.

Optionally ``preferred_cache_dtype() -> dtype | None``: the pool's dtype when ``LLM`` is
given no ``cache_dtype`` (None: ``make_cache``'s default); the engine asks after holding
the weights for the device (``hold_for_cpu``).

``models.LlamaForCausalLM`` is one; docs/BRING_YOUR_OWN_MODEL.md builds others from
scratch (an NNX and a Linen decoder).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class PagedDecoder(Protocol):
    """A decoder ``LLM`` can run (see the module docstring for each member's contract)."""

    config: Any

    def make_cache(self, num_pages: int, page_size: int, dtype: Any = None) -> Any: ...

    def __call__(self, tokens: Any, positions: Any, cache: Any, metadata: Any) -> Any: ...


def check_model(model: Any) -> None:
    """Raises ``TypeError`` naming every member of ``PagedDecoder`` that ``model`` lacks.

    A string gets a pointer to ``paged_jax.models.load`` (names are resolved in the
    model layer, not by the engine).
    """
    if isinstance(model, str):
        raise TypeError(
            f"model: expected a model object, got the name {model!r}; build it with "
            f"`model, tokenizer = paged_jax.models.load({model!r})` and pass "
            "`LLM(model, tokenizer)`"
        )
    from flax import nnx

    missing = []
    if not isinstance(model, nnx.Module):
        missing.append("to be a flax.nnx.Module (wrap a Linen module with nnx.bridge)")
    cfg = getattr(model, "config", None)
    if cfg is None:
        missing.append("config")
    else:
        for attr in ("vocab_size", "max_position_embeddings"):
            if not isinstance(getattr(cfg, attr, None), int):
                missing.append(f"config.{attr} (an int)")
    if not callable(getattr(model, "make_cache", None)):
        missing.append("make_cache(num_pages, page_size, dtype=None)")
    if not callable(model):
        missing.append("__call__(tokens, positions, cache, metadata)")
    if missing:
        raise TypeError(
            f"model: {type(model).__name__} is not a PagedDecoder; it needs "
            + ", ".join(missing)
            + " (see paged_jax.engine.protocol)"
        )


class ModelContractError(TypeError):
    """A model broke the ``PagedDecoder`` contract in a step (its outputs): raised at the
    first step, it stops the engine (no request is to blame), naming the rule."""


def check_step_output(out: Any, rows: int, vocab_size: int) -> Any:
    """``out``, a model's ``__call__`` result in a step whose ``metadata.logits_indices``
    has ``rows`` entries, if it is ``(logits f32[rows, vocab_size], cache)``; else
    ``ModelContractError`` naming the rule. At trace time (shapes only)."""
    name = "model.__call__(tokens, positions, cache, metadata)"
    if not isinstance(out, tuple | list) or len(out) != 2:
        what = f"a {type(out).__name__}" + (
            f" of shape {tuple(out.shape)}" if hasattr(out, "shape") else ""
        )
        raise ModelContractError(
            f"{name} must return (logits, cache), the cache with the step's K/V written; "
            f"it returned {what}"
        )
    logits = out[0]
    shape = tuple(getattr(logits, "shape", ()))
    if len(shape) != 2 or shape[0] != rows:
        raise ModelContractError(
            f"{name} returned logits of shape {shape}; expected [{rows}, {vocab_size}]: one "
            "row per entry of metadata.logits_indices (apply the LM head to "
            "x[metadata.logits_indices], not to every token)"
        )
    if shape[1] != vocab_size:
        raise ModelContractError(
            f"{name} returned logits of shape {shape}; expected {vocab_size} columns "
            "(config.vocab_size)"
        )
    return out
