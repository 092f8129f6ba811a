"""Megatron-style tensor-parallel placement of a ``LlamaForCausalLM``'s weights.

q, k, v, gate and up are split by their outputs (heads and MLP columns), o and down by
their inputs, so a layer needs two all-reduces (after o, after down) and no other
communication; the embedding table and an untied LM head are split by vocabulary;
norms are replicated. With the cache split along KV heads (``paged_jax.sharding``), a
device's query heads meet exactly their KV heads.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from paged_jax.sharding import TENSOR_AXIS, check_divides, tensor_parallel_size

_BY_OUTPUT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_BY_INPUT = ("o_proj", "down_proj")


def weight_spec(path: tuple, ndim: int) -> P:
    """The ``PartitionSpec`` of the parameter at ``path`` (names as in ``nnx.state``;
    layer weights carry a leading ``[L]`` axis)."""
    names = [str(getattr(p, "key", p)) for p in path]
    leaf = names[-1]
    if names[0] == "embed_tokens":
        return P(TENSOR_AXIS, None)  # [V, E]
    if names[0] == "lm_head":
        return P(None, TENSOR_AXIS) if leaf == "kernel" else P(TENSOR_AXIS)
    for name in names:
        if name in _BY_OUTPUT:
            return P(*([None] * (ndim - 1)), TENSOR_AXIS)  # kernel [L, E, out], bias [L, out]
        if name in _BY_INPUT:
            return P(None, TENSOR_AXIS, None) if leaf == "kernel" else P()
    return P()


def shard_model(model: Any, mesh: jax.sharding.Mesh) -> Any:
    """Places ``model``'s weights on ``mesh`` (its ``"tp"`` axis) and returns it. Raises
    ValueError naming the numbers when the tensor-parallel size does not divide the
    query heads, the KV heads, the MLP width or the vocabulary."""
    cfg = model.config
    tp = tensor_parallel_size(mesh)
    check_divides(cfg.num_heads, cfg.num_kv_heads, tp)
    for name in ("intermediate_size", "vocab_size"):
        if getattr(cfg, name) % tp:
            raise ValueError(f"tensor_parallel_size: {tp} must divide {name}={getattr(cfg, name)}")
    state = nnx.state(model)
    placed = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.device_put(x, NamedSharding(mesh, weight_spec(path, x.ndim))), state
    )
    nnx.update(model, placed)
    return model
