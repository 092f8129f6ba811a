"""Where a model's weights are held: for a CPU (``hold_for_cpu``: packed for the C
kernel, or per layer for XLA's dots), for an accelerator (``hold_for_accelerator``: per
layer, the layer loop unrolled, each weight read once per step), split into
tensor-parallel shards (``shard``), per layer at all (``split_layer_weights``), and the KV
pool's dtype that suits them (``preferred_cache_dtype``). A family's model class calls
these from its methods of the same names (the engine calls those); they need its
``layers`` (with ``self_attn`` and ``mlp`` that can ``fuse_projections``), its
``embed_tokens``, ``lm_head``, ``lora`` and ``config``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from paged_jax import linear

from .layers import Embed, Linear, Packed, fp8_units
from .layers.linear import dtype_of
from .layers.moe import Experts, current_way


def held_per_layer(path, var) -> bool:
    """An ``nnx.split`` filter: the variables a layer reads whole, not as its slice of a
    stack: those ``split_layer_weights`` made tuples, and packed stacks."""
    return isinstance(var, Packed) or (
        isinstance(var, nnx.Variable) and isinstance(var.get_value(), tuple)
    )


def split_layer_weights(model):
    """In place: each linear weight of the layers (``[L, in, out]`` kernels, ``[L, out]``
    biases) becomes a tuple of L separate arrays; returns the model.

    The forward pass then picks a layer's weights with a ``lax.switch`` per matrix
    product and reads them where they lie. With the stacked arrays, XLA:CPU copies
    each layer's slice out of the stack before every product, a copy of all the
    weights every step, at a speed that varied from one process to the next
    (docs/DECISIONS.md, "Weights split per layer on XLA:CPU"). The engine does this on
    CPU (``LLM``); other backends read a slice in place. Norm scales stay stacked, and
    packed weights (``Linear.hold_packed``) stay whole.
    Not for a model on a mesh (its shardings are given for the stacked arrays).
    """
    L = model.config.num_layers
    for _, node in nnx.iter_graph(model.layers):
        if not isinstance(node, Linear) or node.packed:  # a packed stack stays whole
            continue
        for var in (
            node.kernel,
            node.bias,
            *(getattr(node, a, None) for a in ("scale", "zero", "high")),
        ):
            w = None if var is None else var.get_value()
            if w is not None and not isinstance(w, tuple):
                var.set_value(tuple(w[i] for i in range(L)))
    return model


def hold_for_accelerator(model, *, fp8_activations: bool | None = None):
    """In place: the layout a GPU or TPU reads each weight once per step with; returns
    the model. The engine calls it for a model off the CPU without a mesh. Idempotent.

    ``fp8_activations``: whether fp8 weights multiply fp8 rows (W8A8,
    ``Linear.hold_fp8_activations``); default, where the device has fp8 units
    (``fp8_units``: an NVIDIA GPU of compute capability 8.9 or more). A model held
    already keeps the choice made then when called again with the default (as the
    engine calls it), so ``hold_for_accelerator(fp8_activations=False)`` before
    ``LLM`` keeps fp8 weights weight-only.

    Each layer's linear weights become arrays of their own (``split_layer_weights``)
    and the forward pass runs the layers as an unrolled Python loop, so every product
    multiplies by its layer's weight where it lies. q, k and v, and gate and up, are
    fused into one weight each (``Attention.fuse_projections``,
    ``MLP.fuse_projections``: 4 products a layer instead of 7). The scan over stacked
    ``[L, ...]`` weights copied each layer's slices into fresh buffers before multiplying, on
    every step, reading the weights' bytes more than twice (docs/DECISIONS.md, "Weights
    read once per step on an accelerator").
    The cost: one traced body per layer, so compile time grows with the depth.
    Norm scales stay stacked (a static slice of a few kilobytes each). A tied
    embedding table is held ``[E, V]`` (``Embed.hold_transposed``), so the LM head
    multiplies by it as it lies on every compiler (XLA:CPU copied the ``[V, E]``
    table's transpose; lookups then gather columns, a few kilobytes a token).
    Not for a model on a mesh (its shardings are given for the stacked arrays).
    Raises ``ValueError`` for a model packed for the CPU kernels (``hold_for_cpu``).
    """
    if any(isinstance(n, (Linear, Embed, Experts)) and n.packed for _, n in nnx.iter_graph(model)):
        raise ValueError(
            "model: its weights are packed for the CPU kernels (hold_for_cpu), which "
            "only a CPU computes with; load it again to run it on an accelerator"
        )
    if model.unrolled and fp8_activations is None:  # held already: as it was held
        return model
    split_layer_weights(model)
    _split_layer_arrays(model)
    model.layers.self_attn.fuse_projections()
    model.layers.mlp.fuse_projections()
    if model.layers.dense_mlp is not None:  # a mixture's dense layers
        model.layers.dense_mlp.fuse_projections()
    if model.lora is not None:  # a fused projection's adapters in one pair, per layer
        model.lora.regroup(model.lora_groups()).pad_for_merge().split_layers()
    if fp8_activations is None:
        fp8_activations = fp8_units()
    if fp8_activations:  # the layers' products (the LM head's logits stay W8A16)
        for _, node in nnx.iter_graph(model.layers):
            if isinstance(node, Linear) and node.quantized == "fp8":
                node.hold_fp8_activations()
        attn, mlp = model.layers.self_attn, model.layers.mlp
        for node in (getattr(attn, "qkv_proj", None), attn.o_proj, getattr(mlp, "down_proj", None)):
            if node is not None:
                node.fp8_rows_kernel = node.fp8_activations
    if model.lm_head is None:
        model.embed_tokens.hold_transposed()
    model.unrolled = True
    return model


def _split_layer_arrays(model) -> None:
    """In place: the layers' arrays outside ``Linear`` modules that a product reads whole
    (a mixture's experts and router, their biases; GPT-OSS's attention sinks) as tuples
    of per-layer arrays (``layers.linear.layer_value`` picks one), for the unrolled loop
    of ``hold_for_accelerator``: a static slice of a stack is copied before its product,
    each step (docs/DECISIONS.md, "A mixture's experts per layer on an accelerator")."""
    L = model.config.num_layers
    for path, _ in nnx.to_flat_state(nnx.state(model.layers, nnx.Param)):
        names = [str(p) for p in path]
        wanted = "experts" in names or names[-2:-1] == ["gate"] or names[-1] == "sinks"
        if not wanted or (len(names) >= 2 and names[-2] == "shared_expert_gate"):
            continue
        node = functools.reduce(lambda n, part: getattr(n, str(part)), path[:-1], model.layers)
        if isinstance(node, Linear):  # (split_layer_weights' own)
            continue
        param = getattr(node, str(path[-1]))
        w = param.get_value()
        if not isinstance(w, tuple) and not isinstance(param, Packed):
            param.set_value(tuple(w[i] for i in range(L)))


def hold_for_cpu(model, *, pack: bool | None = None):
    """In place: the weight layouts the CPU computes with fastest; returns the model.
    The engine calls it for a model on CPU without a mesh (the mesh's shardings are
    given for the loaded layouts). Idempotent.

    ``pack`` (default: where the model computes in f32 with f32, int8, int4 or fp8
    weights, or in bf16 with bf16 ones or those, and ``paged_jax.linear.available()``;
    fp8 ones are packed as bf16; a bf16 model's products take f32 sums of its bf16
    rows' exact products, then round to bf16): every
    linear weight, stacked layers included, and a tied embedding table are packed
    for the C matrix-product kernel (``Linear.hold_packed``, ``Embed.hold_packed``);
    a layer's product reads its weight in the stack by index (docs/DECISIONS.md, "The
    CPU's C matrix-product kernel"). Before packing, q, k and v, and gate and up, are fused
    into one product each (``fuse_linears`` on the stacks; ``qkv_proj`` and
    ``gate_up_proj`` replace them, 4 calls of the kernel a layer instead of 7, and
    a quantized product quantizes its rows once; docs/DECISIONS.md, "Fused
    projections"). A LoRA bank stays one pair
    a target (the kernel adds a fused projection's adapters part by part).

    Otherwise, for XLA's products:

    - ``split_layer_weights``: each layer's linear weights in arrays of their own.
    - A tied embedding table held ``[E, V]`` (``Embed.hold_transposed``), so the LM
      head multiplies by it as it lies (XLA:CPU's product with the transpose of the
      ``[V, E]`` table was 2.2-2.5x slower at a few rows); lookups gather columns
      instead of rows, a small cost beside a prefill step. No weight is copied: the
      memory held stays the same.
    """
    model.unrolled = False  # the CPU's layouts are read in place by the scanned layers
    if model.lora is not None:  # (held for an accelerator before: stacked again)
        model.lora.join_layers()
    linears = [n for _, n in nnx.iter_graph(model) if isinstance(n, Linear)]
    if pack is None:
        # f32 compute with f32 weights; bf16 compute with bf16 ones (the kernel rounds
        # its rows to bf16: exact for bf16 rows); quantized ones with either
        compute = None if model.dtype is None else jnp.dtype(model.dtype)
        table = model.embed_tokens
        pack = (
            compute in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
            and linear.available()
            and all(
                n.packed
                or (n.quantized in ("int8", "int4", "fp8") and not n.fp8_activations)
                or (not n.quantized and dtype_of(n.kernel.get_value()) == compute)
                for n in linears
            )
            and (
                model.lm_head is not None
                or table.packed
                or bool(table.quantized)
                or table.embedding.get_value().dtype == compute
            )
        )
    if pack:
        for node in linears:  # (before anything changes)
            node.check_packable()
        # q/k/v and gate/up in one product each, as on accelerators (the C kernel's
        # calls have a fixed cost, and a quantized product quantizes its rows once);
        # a LoRA bank stays one pair a target, which the kernel adds part by part
        model.layers.self_attn.fuse_projections()
        model.layers.mlp.fuse_projections()
        if model.layers.dense_mlp is not None:
            model.layers.dense_mlp.fuse_projections()
        for _, node in nnx.iter_graph(model):
            if isinstance(node, Linear) or (
                isinstance(node, Experts)
                and current_way() == "packed"  # a mixture's experts
                and node.packable()
            ):
                node.hold_packed()
        if model.lm_head is None:
            model.embed_tokens.hold_packed()
        return model
    split_layer_weights(model)
    if model.lm_head is None:
        model.embed_tokens.hold_transposed()
    return model


def shard(model, mesh: jax.sharding.Mesh, *, expert_parallel: bool = False):
    """Moves the weights into their tensor-parallel shards on ``mesh`` (its ``"tp"``
    axis; ``paged_jax.models.sharding``) and returns the model. The engine calls it
    for a model it is given off the mesh; ``paged_jax.models.load(name, mesh=...)``
    loads straight into the shards instead. Quantized weights (``quantize``) are
    split as their float kernels are, their scales and minimums along (the row-split
    o and down projections' scales whole on every device); they compute by XLA's
    products there (W8A16, weight-only). ``expert_parallel``: a mixture's experts split
    by expert instead of by width (``models.sharding``). Raises ``ValueError`` for weights held for
    one device's kernels (``hold_for_cpu``'s packing, fp8 activations) or a GGUF file's
    blocks kept as stored, which have no split layout."""
    from .sharding import shard_model

    held = sorted(
        {
            "packed for the CPU kernels" if n.packed else "held for fp8 activations"
            for _, n in nnx.iter_graph(model)
            if isinstance(n, (Linear, Embed)) and (n.packed or getattr(n, "fp8_activations", False))
        }
    )
    if held:
        raise ValueError(
            f"model: weights {' and '.join(held)} cannot be sharded over a mesh; shard "
            "the model as loaded (or as quantized), before the engine holds it for one device"
        )
    if any(  # (high bits and offsets: no split rule; 4-bit groups with mins have theirs)
        (isinstance(n, Linear) and (n.high_bits or n.offset))
        or (isinstance(n, Experts) and n.float_rows)
        for _, n in nnx.iter_graph(model)
    ):
        raise ValueError(
            "model: a GGUF file's blocks kept as stored have no split layout; load it with "
            "mesh= (its tensors then go to their shards in float) or with dequantize=True"
        )
    return shard_model(model, mesh, expert_parallel=expert_parallel)


def preferred_cache_dtype(model):
    """The KV pool's dtype the engine gives this model when none is asked for
    (``LLM(cache_dtype=None)``): ``jnp.bfloat16`` where its linear weights are
    quantized and packed for the CPU's C kernels (``hold_for_cpu``; the pool then
    written and read by the C kernels too, ``cache.narrow_pools_by_cpu_kernels``),
    else None (``make_cache``'s default, the compute dtype). On those weights the
    pool's rounding costs little beside theirs and the decode step reads half the
    bytes (docs/DECISIONS.md, "A bf16 pool under quantized CPU weights"). A GGUF
    file's blocks kept as stored (``Linear.float_rows``) compute the float model's
    sums, which a bf16 pool would round: they keep the compute dtype."""
    from paged_jax.cache import narrow_pools_by_cpu_kernels

    quantized = any(
        isinstance(n, Linear) and n.packed and n.quantized and not n.float_rows
        for _, n in nnx.iter_graph(model)
    )
    return jnp.bfloat16 if quantized and narrow_pools_by_cpu_kernels() else None
