"""Megatron-style tensor-parallel placement of a ``LlamaForCausalLM``'s weights.

q, k, v, gate and up are split by their outputs (heads and MLP columns), o and down by
their inputs, so a layer needs two all-reduces (after o, after down) and no other
communication; a mixture's experts are split the same way, each expert's width over the
devices (every device holds a slice of every expert; the router is replicated), or with
``expert_parallel`` split by expert (every device holds whole experts, X / tp of them,
and adds its experts' share of each token's sum before one all-reduce:
``models.layers.moe.SparseMoE``); the embedding table and an untied LM head are split by
vocabulary; norms are replicated.
With the cache split along KV heads (``paged_jax.sharding``), a device's query heads
meet exactly their KV heads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from paged_jax.sharding import (
    TENSOR_AXIS,
    check_divides,
    kv_head_replicas,
    tensor_parallel_size,
)

_BY_OUTPUT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_BY_INPUT = ("o_proj", "down_proj")
_KV = ("k_proj", "v_proj")


def _names(path: tuple) -> list[str]:
    """A parameter's path as names (a jax tree path of an ``nnx.State``, which ends in the
    Variable's ``.value``, a GetAttrKey, or a tuple of names)."""
    return [
        str(p.key) if isinstance(p, jax.tree_util.DictKey) else str(p)
        for p in path
        if not isinstance(p, jax.tree_util.GetAttrKey)
    ]


def vocab_axis(path: tuple, ndim: int) -> int | None:
    """The vocabulary axis of the parameter at ``path`` of rank ``ndim``: the first for
    the embedding table ``[V, E]`` and its quantized scales (``[V]``, or ``[V, E / G]``
    per group) and minimums; the last for an LM head's kernel ``[E, V]``, bias ``[V]``,
    scales (``[V]`` or ``[E / G, V]``) and minimums; None for the rest."""
    names = _names(path)
    if names[0] == "embed_tokens":
        return 0
    if names[0] == "lm_head":
        return ndim - 1
    return None


def pad_vocab(path: tuple, value: Any, tp: int) -> Any:
    """``value`` (numpy or jax) of the parameter at ``path`` with its vocabulary axis
    padded with zeros to a multiple of ``tp``, as vLLM's vocabulary-parallel embedding
    pads it: no token id reads the padding rows, and the logits of the padding columns
    are dropped (``LlamaForCausalLM._logits`` keeps ``config.vocab_size``). Other
    parameters, and a vocabulary ``tp`` divides, are returned as they are."""
    axis = vocab_axis(path, value.ndim)
    if axis is None or value.shape[axis] % tp == 0:
        return value
    widths = [(0, 0)] * value.ndim
    widths[axis] = (0, -value.shape[axis] % tp)
    return np.pad(value, widths) if isinstance(value, np.ndarray) else jnp.pad(value, widths)


def weight_spec(
    path: tuple, ndim: int, *, replicate_kv: bool = False, expert_parallel: bool = False
) -> P:
    """The ``PartitionSpec`` of the parameter at ``path`` (names as in ``nnx.state``;
    layer weights carry a leading ``[L]`` axis). ``replicate_kv``: k and v projections
    are replicated (the tensor-parallel size exceeds the KV heads; each device computes
    every KV head and keeps the one its query heads read). ``expert_parallel``: a
    mixture's experts (weights, scales, biases: ``[L, X, ...]``) split by expert."""
    names = _names(path)
    leaf = names[-1]
    if expert_parallel and len(names) >= 2 and names[-2] == "experts":
        return P(None, TENSOR_AXIS, *([None] * (ndim - 2)))
    if len(names) >= 2 and names[-2] == "experts":  # [L, X, in, out]: each expert's width split
        if leaf.endswith("_bias"):  # GPT-OSS: gate's and up's [L, X, F] split as their columns
            return P() if leaf == "down_bias" else P(None, None, TENSOR_AXIS)
        if leaf.endswith(("_scale", "_zero")):  # quantized: gate's and up's split as their
            # columns; down's whole
            return P() if leaf.startswith("down") else P(*([None] * (ndim - 1)), TENSOR_AXIS)
        return (
            P(None, None, None, TENSOR_AXIS)
            if leaf != "down_proj"
            else P(None, None, TENSOR_AXIS, None)
        )
    if names[0] == "embed_tokens":  # [V, E]; quantized: scale [V] or [V, E / G] alike
        return P(TENSOR_AXIS, *([None] * (ndim - 1)))
    if names[0] == "lm_head":  # kernel [E, V], bias [V], scale [V] or [E / G, V]
        return P(*([None] * (ndim - 1)), TENSOR_AXIS)
    for name in names:
        if replicate_kv and name in _KV:
            return P()
        if name in _BY_OUTPUT:
            # kernel [L, E, out] (4-bit: [L, E / 2, out]), bias [L, out], and a quantized
            # kernel's scales [L, out] or [L, E / G, out] and minimums alike
            return P(*([None] * (ndim - 1)), TENSOR_AXIS)
        if name in _BY_INPUT:
            # kernel [L, in, out] (4-bit: [L, in / 2, out]); the bias and the scales
            # ([L, out], or [L, in / G, out] per group: a few percent of the kernel's
            # bytes, replicated so no group need divide evenly) whole on every device
            return P(None, TENSOR_AXIS, None) if leaf == "kernel" else P()
    return P()


def sharder(
    cfg: Any, mesh: jax.sharding.Mesh, *, expert_parallel: bool = False
) -> Callable[[tuple, int], NamedSharding]:
    """``f(path, ndim) -> NamedSharding`` of a ``LlamaForCausalLM`` of config ``cfg`` on
    ``mesh``'s ``"tp"`` axis (``path``: a jax tree path or a tuple of names; a mixture's
    experts split by expert with ``expert_parallel``). Raises ValueError naming the
    numbers when the tensor-parallel size does not divide the query heads, the KV heads
    (or a multiple of them), the MLP width or, with ``expert_parallel``, the experts. A
    vocabulary it does not divide is padded (``pad_vocab``; the loaders and
    ``shard_model`` pad it)."""
    tp = tensor_parallel_size(mesh)
    check_divides(cfg.num_heads, cfg.num_kv_heads, tp)
    widths = {"intermediate_size": cfg.intermediate_size}
    if expert_parallel and not cfg.sparse:
        raise ValueError("expert_parallel: the model has no experts (num_experts is 0)")
    if cfg.sparse:  # (a mixture's intermediate_size is unused but Mixtral's expert width)
        widths = {
            "num_experts" if expert_parallel else "moe_intermediate_size": (
                cfg.num_experts if expert_parallel else cfg.moe_intermediate_size
            )
        }
        if cfg.shared_expert_intermediate_size:
            widths["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
        if cfg.dense_layers:  # a mixture's dense layers' MLP, split as a dense model's
            widths["intermediate_size"] = cfg.intermediate_size
    for name, width in widths.items():
        if width % tp:
            raise ValueError(f"tensor_parallel_size: {tp} must divide {name}={width}")
    replicate_kv = kv_head_replicas(cfg.num_kv_heads, tp) > 1
    return lambda path, ndim: NamedSharding(
        mesh, weight_spec(path, ndim, replicate_kv=replicate_kv, expert_parallel=expert_parallel)
    )


def state_shardings(
    cfg: Any, state: Any, mesh: jax.sharding.Mesh, *, expert_parallel: bool = False
) -> Any:
    """The ``NamedSharding`` of every array of ``state`` (an ``nnx.State`` of a model of
    config ``cfg``, real or abstract), as a tree of the same structure (``sharder``)."""
    sharding = sharder(cfg, mesh, expert_parallel=expert_parallel)
    return jax.tree_util.tree_map_with_path(lambda p, x: sharding(p, x.ndim), state)


def shard_model(model: Any, mesh: jax.sharding.Mesh, *, expert_parallel: bool = False) -> Any:
    """Places ``model``'s weights on ``mesh`` (its ``"tp"`` axis) and returns it (errors:
    ``sharder``); with ``expert_parallel``, a mixture's experts split by expert, which its
    sparse blocks then compute so (``Experts.expert_parallel``). The weights move from
    where they are; to load a checkpoint straight into its shards, pass ``mesh`` to
    ``paged_jax.models.load``."""
    from .layers.moe import Experts

    tp = tensor_parallel_size(mesh)
    state = nnx.state(model)
    state = jax.tree_util.tree_map_with_path(lambda p, x: pad_vocab(p, x, tp), state)
    shardings = state_shardings(model.config, state, mesh, expert_parallel=expert_parallel)
    nnx.update(model, jax.device_put(state, shardings))
    for _, node in nnx.iter_graph(model):
        if isinstance(node, Experts):
            node.expert_parallel = expert_parallel
    return model


def place(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A host array placed in its shards: each device receives only its own slice (and
    with several processes, each process only its devices' slices)."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
