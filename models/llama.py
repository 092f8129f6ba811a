"""The decoder (Llama 2/3, Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3, and the mixtures of
experts Mixtral, Qwen2-MoE, Qwen3-MoE, GPT-OSS) in Flax NNX, on the paged KV cache.

One forward pass serves a ragged batch: T new tokens of S sequences, each a prefill chunk
or a decode token. Per layer the tokens' K/V are written into the ``PagedKVCache`` by
slot mapping, then ``paged_jax.ragged_paged_attention`` reads them back with every
earlier token of each sequence (``paged_jax.paged_attention``, the decode kernel, when the
metadata says ``decode_only``). Shape suffixes: T tokens, E hidden size, F MLP size,
H/K query/kv heads, D head dim, V vocabulary, R logits rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

import paged_jax as pj
from paged_jax import linear
from paged_jax.cache import PagedKVCache
from paged_jax.invariant import rowwise
from paged_jax.metadata import AttentionMetadata

from . import lora as _lora
from . import placement
from .config import LayerKind, LlamaConfig
from .layers import (
    FUSED,
    LAYER,
    MLP,
    ROWS,
    Embed,
    Linear,
    RMSNorm,
    apply_rope,
    fuse_linears,
    make_linear,
    rope_attention_factor,
    rope_inv_freq,
    soft_cap,
)
from .layers.kernels import kernel_platform
from .layers.linear import layer_value
from .layers.moe import Experts, SparseMoE
from .quantization import check_format


def _norm(cfg: LlamaConfig, dim: int, kw: dict) -> RMSNorm:
    return RMSNorm(dim, cfg.rms_norm_eps, unit_offset=cfg.norm_unit_offset, **kw)


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = make_linear(cfg.hidden_size, H * D, cfg.qkv_bias, **kw)
        self.k_proj = make_linear(cfg.hidden_size, K * D, cfg.qkv_bias, **kw)
        self.v_proj = make_linear(cfg.hidden_size, K * D, cfg.qkv_bias, **kw)
        self.o_proj = make_linear(H * D, cfg.hidden_size, cfg.o_bias, **kw)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(self, name).lora_targets = (name,)
        self.num_heads, self.num_kv_heads, self.head_dim = H, K, D
        scalar = cfg.query_pre_attn_scalar
        self.sm_scale = (D if scalar is None else scalar) ** -0.5
        self.soft_cap = cfg.attn_logit_softcap
        norm = dict(dtype=dtype, param_dtype=param_dtype)
        self.q_norm = _norm(cfg, D, norm) if cfg.qk_norm else None
        self.k_norm = _norm(cfg, D, norm) if cfg.qk_norm else None
        # GPT-OSS: each head's attention sink (f32[H]; paged_jax.ragged_paged_attention)
        self.sinks = (
            nnx.Param(jax.random.normal(rngs.params(), (H,), jnp.float32) * 0.02)
            if cfg.attention_sinks
            else None
        )

    def fuse_projections(self) -> bool:
        """In place: q, k and v in one product (``fuse_linears``; ``qkv_proj`` replaces
        ``q_proj``, ``k_proj`` and ``v_proj``). Returns whether they were fused."""
        if hasattr(self, "qkv_proj"):
            return True
        fused = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        if fused is None:
            return False
        self.qkv_proj = fused
        del self.q_proj, self.k_proj, self.v_proj
        return True

    def project(self, x_TE, positions_T, inv_freq, rows=None, rope_scale=1.0):
        """Row-wise: ``(q[T, H, D], k[T, K, D], v[T, K, D])``, RoPE applied (its rotation
        times ``rope_scale``, YaRN's attention factor). ``rows``: the fused q/k/v
        product's fp8 rows already quantized (``Linear.__call__``), ``x_TE`` then None."""
        T = x_TE.shape[0] if rows is None else rows[0].shape[0]
        if hasattr(self, "qkv_proj"):  # fuse_projections: one product, split
            qkv = self.qkv_proj(x_TE, rows=rows)
            HD, KD = self.qkv_proj.parts[:2]
            q_THD = qkv[:, :HD].reshape(T, self.num_heads, self.head_dim)
            k_TKD = qkv[:, HD : HD + KD].reshape(T, self.num_kv_heads, self.head_dim)
            v_TKD = qkv[:, HD + KD :].reshape(T, self.num_kv_heads, self.head_dim)
        else:
            q_THD = self.q_proj(x_TE).reshape(T, self.num_heads, self.head_dim)
            k_TKD = self.k_proj(x_TE).reshape(T, self.num_kv_heads, self.head_dim)
            v_TKD = self.v_proj(x_TE).reshape(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # Qwen3, Gemma 3: each head normalized over D, before RoPE
            q_THD, k_TKD = self.q_norm(q_THD), self.k_norm(k_TKD)
        return (
            apply_rope(q_THD, positions_T, inv_freq, rope_scale),
            apply_rope(k_TKD, positions_T, inv_freq, rope_scale),
            v_TKD,
        )

    def output(self, o_THD):
        """Row-wise: ``o_proj`` of the heads' outputs -> ``[T, E]``."""
        return self.o_proj(o_THD.reshape(o_THD.shape[0], self.num_heads * self.head_dim))

    def attend(self, q_THD, k_TKD, v_TKD, layer, cache, md, window, backend, interpret):
        """Writes the step's K/V, then attends (``window``: this layer's sliding window, a
        Python int or None): ``(o[T, H, D], cache)``."""
        return pj.paged_self_attention(
            q_THD,
            k_TKD,
            v_TKD,
            cache,
            layer,
            md,
            sm_scale=self.sm_scale,
            sliding_window=window,
            soft_cap=self.soft_cap,
            sinks=None if self.sinks is None else layer_value(self.sinks),
            backend=backend,
            interpret=interpret,
        )


class DecoderLayer(nnx.Module):
    """One block. Pre-norm (Llama): ``x + attn(norm(x))``, then ``x + mlp(norm(x))`` with
    ``post_attention_layernorm`` as the MLP's norm. With ``sandwich_norms`` (Gemma) each
    block's output is normed as well: ``x + post_attention_layernorm(attn(
    input_layernorm(x)))``, then ``x + post_feedforward_layernorm(mlp(
    pre_feedforward_layernorm(x)))``."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.input_layernorm = _norm(cfg, cfg.hidden_size, kw)
        self.self_attn = Attention(cfg, rngs=rngs, **kw)
        self.post_attention_layernorm = _norm(cfg, cfg.hidden_size, kw)
        self.mlp = (
            SparseMoE(
                cfg.hidden_size,
                cfg.moe_intermediate_size,
                cfg.num_experts,
                cfg.num_experts_per_tok,
                normalize=cfg.norm_topk_prob,
                act=cfg.hidden_act,
                shared_width=cfg.shared_expert_intermediate_size,
                scoring=cfg.router_scoring,
                bias=cfg.moe_bias,
                clamp=None if cfg.swiglu_limit is None else (cfg.swiglu_limit, cfg.swiglu_alpha),
                rngs=rngs,
                **kw,
            )
            if cfg.sparse
            else MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, rngs=rngs, **kw)
        )
        # a mixture's dense layers' MLP (cfg.dense_layers): in every layer, zeros where
        # the experts compute (the layers stay one stack; kind.dense_ffn picks)
        self.dense_mlp = (
            MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, lora=False, rngs=rngs, **kw)
            if cfg.dense_layers
            else None
        )
        sandwich = cfg.sandwich_norms
        self.pre_feedforward_layernorm = _norm(cfg, cfg.hidden_size, kw) if sandwich else None
        self.post_feedforward_layernorm = _norm(cfg, cfg.hidden_size, kw) if sandwich else None

    def __call__(self, x_TE, positions_T, kind: LayerKind, layer, cache, md, backend, interpret):
        """One block on the step's tokens ``x[T, E]``; ``kind`` (static) gives the layer's
        window and RoPE. Returns ``(x[T, E], cache)``."""
        attn, inv = self.self_attn, md.batch_invariant
        inv_freq = rope_inv_freq(attn.head_dim, kind.rope_theta, kind.rope_scaling)
        rope_scale = rope_attention_factor(kind.rope_scaling)
        # LoRA adapters' rows (models.lora): their mask travels with the rows
        bank, mask = _lora._LORA.get() or (None, None)

        def project(x, pos, m):
            with _lora.rows(bank, m):
                rows = self._fp8_qkv_rows(x)
                if rows is not None:  # q/k/v's fp8 rows, normed and quantized in one kernel
                    return attn.project(None, pos, inv_freq, rows=rows, rope_scale=rope_scale)
                return attn.project(self.input_layernorm(x), pos, inv_freq, rope_scale=rope_scale)

        def after(x, o, m):
            with _lora.rows(bank, m):
                return self._after_attention(x, o, kind.dense_ffn)

        q, k, v = rowwise(project, x_TE, positions_T, mask, invariant=inv)
        window = kind.sliding_window
        o_THD, cache = attn.attend(q, k, v, layer, cache, md, window, backend, interpret)
        return rowwise(after, x_TE, o_THD, mask, invariant=inv), cache

    def _fp8_qkv_rows(self, x_TE):
        """q/k/v's fp8 rows (``(q, scale)``) of ``input_layernorm(x_TE)``, normed and
        quantized by one kernel (``paged_jax.linear.fp8_rows``) where W8A8's rows go to it
        (``Linear.fp8_rows_kernel``, ``KERNELS["fp8_rows"]``, no adapters active: XLA
        takes two kernels, the rows' scale being read by several); None otherwise."""
        qkv, norm = getattr(self.self_attn, "qkv_proj", None), self.input_layernorm
        if qkv is None or not qkv.fp8_rows_kernel or x_TE.ndim != 2 or norm.dtype is None:
            return None
        platform = kernel_platform("fp8_rows")
        if platform is None or _lora.current_mask() is not None:
            return None
        return linear.fp8_rows(
            x_TE,
            norm_weight=norm.weight[...],
            eps=norm.eps,
            unit_offset=norm.unit_offset,
            dtype=norm.dtype,
            interpret=platform != "gpu",
        )

    def _after_attention(self, x_TE, o_THD, dense_ffn=False):
        """Row-wise: the residual, the MLP (a mixture's dense layer's: ``dense_mlp``) and
        its residual."""
        mlp = self.dense_mlp if dense_ffn else self.mlp
        if self.pre_feedforward_layernorm is None:
            x_TE = x_TE + self.self_attn.output(o_THD)
            return x_TE + mlp(self.post_attention_layernorm(x_TE))
        x_TE = x_TE + self.post_attention_layernorm(self.self_attn.output(o_THD))
        h = mlp(self.pre_feedforward_layernorm(x_TE))
        return x_TE + self.post_feedforward_layernorm(h)


def _make_layers(cfg: LlamaConfig, rngs: nnx.Rngs, kw: dict) -> DecoderLayer:
    """Every layer in one module, each weight with a leading ``[L]`` axis.

    Built by ``nnx.vmap`` over split keys: the constructor is traced once, not once per
    layer (30 traced constructors took 4.6 s of loading SmolLM2).
    """

    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return DecoderLayer(cfg, rngs=rngs, **kw)

    return make(rngs)


class LlamaForCausalLM(nnx.Module):
    """A decoder whose forward pass runs a ragged step on a paged cache.

    ``dtype`` is the compute dtype, ``param_dtype`` the storage dtype of the weights.
    ``layers`` is one ``DecoderLayer`` whose weights are stacked over the layers (a
    leading ``[L]`` axis; ``layer(i)`` gives layer i alone). The forward pass is a
    ``lax.scan`` over them: one compiled layer body whatever the depth, so compile time
    does not grow with the number of layers, and every layer reuses the same temporary
    buffers (docs/DECISIONS.md, "a scan over the layers"). ``split_layer_weights`` keeps the
    scan but holds each linear weight per layer, for XLA:CPU (see there).
    ``hold_for_accelerator`` holds the weights per layer and unrolls the layer loop, for
    GPUs and TPUs (see there).
    """

    unrolled = False  # hold_for_accelerator sets it on the instance (a static attribute)
    lora = None  # enable_lora sets it: a models.lora.LoraBank

    def __init__(
        self, cfg: LlamaConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32
    ):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.config = cfg
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs, **kw)
        self.layers = _make_layers(cfg, rngs, kw)
        self.norm = _norm(cfg, cfg.hidden_size, kw)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else make_linear(cfg.hidden_size, cfg.vocab_size, False, rngs=rngs, **kw)
        )
        self.dtype = dtype

    def enable_lora(self, slots: int, rank: int) -> LlamaForCausalLM:
        """In place: ``slots`` LoRA adapter slots of rank up to ``rank`` on every
        projection (``models.lora.LoraBank``, zeros: no adapter in any slot), which
        ``__call__``'s ``adapter_ids`` pick per token; returns the model. Idempotent for
        the same sizes; raises ValueError for other sizes or non-positive ones."""
        for name, v in (("slots", slots), ("rank", rank)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        if self.lora is not None:
            if (self.lora.slots, self.lora.rank) != (slots, rank):
                raise ValueError(
                    f"slots, rank: the model has {self.lora.slots} slots of rank "
                    f"{self.lora.rank} already, asked for {slots} of rank {rank}"
                )
            return self
        dtype = self.embed_tokens.param_dtype
        if not jnp.issubdtype(dtype, jnp.floating):  # (a quantized table's)
            dtype = self.dtype or jnp.float32
        self.lora = _lora.LoraBank(self.config, slots, rank, dtype)
        self.lora.regroup(self.lora_groups())
        if self.unrolled:  # held for an accelerator: the bank per layer, as the weights
            self.lora.pad_for_merge().split_layers()
        return self

    def lora_groups(self) -> tuple:
        """``LoraBank.regroup``'s groups for the projections as they are now: one a
        target, but one for each fused projection (``fuse_projections``), named as it
        (``FUSED``)."""
        groups = []
        for _, node in nnx.iter_graph(self.layers):
            if isinstance(node, Linear) and node.lora_targets:
                ts = tuple(node.lora_targets)
                if len(ts) == 1:
                    name = ts[0]
                else:
                    name = next((k for k, v in FUSED.items() if tuple(v) == ts), "_".join(ts))
                if (name, ts) not in groups:
                    groups.append((name, ts))
        order = {t: i for i, t in enumerate(_lora.TARGETS)}
        return tuple(sorted(groups, key=lambda g: order[g[1][0]]))

    def load_lora(self, path, name: str | None = None) -> _lora.LoraAdapter:
        """The PEFT LoRA adapter in directory ``path`` for this model's config
        (``models.lora.load_adapter``)."""
        return _lora.load_adapter(path, self.config, name=name)

    def lora_slot_arrays(self, adapter, slot: int, arrays: dict) -> dict:
        """``arrays`` (the bank's, by variable name: ``a_<target>``, ``b_<target>``) with
        slot ``slot`` holding ``adapter`` (None: emptied), as new arrays
        (``models.lora.slot_arrays``)."""
        if self.lora is None:
            raise ValueError("slot: the model has no LoRA slots (enable_lora)")
        bank = self.lora
        return _lora.slot_arrays(
            adapter, bank.slots, bank.rank, slot, arrays, bank.groups, bank.widths
        )

    @property
    def lora_slots(self) -> int:
        """How many LoRA adapters the model holds at once (``enable_lora``; 0: none)."""
        return 0 if self.lora is None else self.lora.slots

    def layer(self, i: int) -> DecoderLayer:
        """Layer ``i`` as its own module (a copy of its slice of the stacked weights)."""
        if not isinstance(i, int) or not 0 <= i < self.config.num_layers:
            raise ValueError(f"i: expected an int in [0, {self.config.num_layers}), got {i!r}")
        graphdef, per_layer, stacked = nnx.split(self.layers, placement.held_per_layer, ...)
        return nnx.merge(
            graphdef,
            jax.tree.map(lambda w: w[i], per_layer, is_leaf=lambda w: isinstance(w, tuple)),
            jax.tree.map(lambda w: w[i], stacked),
        )

    def split_layer_weights(self) -> LlamaForCausalLM:
        """In place: each linear weight of the layers held per layer
        (``placement.split_layer_weights``); returns the model."""
        return placement.split_layer_weights(self)

    def quantize(self, fmt: str = "int8") -> LlamaForCausalLM:
        """In place: every linear weight (the layers' projections and an untied LM head)
        and the embedding table (a tied LM head's weight) in quantized format ``fmt``
        (``models.quantization``), but for ``"int4"`` the table in int8 (a tied head is
        the product most hurt by 4 bits: SmolLM2's log-likelihood moved 3.1% with it in
        4 bits); returns the model. Norms stay float. Before the engine
        holds the weights for a device (``hold_for_cpu``, ``hold_for_accelerator``,
        ``shard``), which ``paged_jax.models.load(..., quantization=)`` ensures.
        Idempotent. A mixture's experts go to int8 or int4 (``Experts.quantize``; int4:
        4-bit groups of 32 as well) and its routers stay float; raises ``ValueError`` for an
        unknown format, and for fp8 on a mixture (not yet)."""
        check_format(fmt)
        if self.config.sparse and fmt not in ("int8", "int4"):
            raise ValueError(
                f"quantization: {fmt!r} for a mixture of experts is not supported yet (its "
                "experts take int8 and int4)"
            )
        for _, node in nnx.iter_graph(self):
            if isinstance(node, Linear):
                node.quantize(fmt)
            elif isinstance(node, Embed):  # int4: the table (a tied head) in int8
                node.quantize("int8" if fmt == "int4" else fmt)
            elif isinstance(node, Experts):
                node.quantize(fmt)
        return self

    def hold_for_accelerator(self, *, fp8_activations: bool | None = None) -> LlamaForCausalLM:
        """In place: the layout a GPU or TPU reads each weight once per step with
        (``placement.hold_for_accelerator``); returns the model."""
        return placement.hold_for_accelerator(self, fp8_activations=fp8_activations)

    def hold_for_cpu(self, *, pack: bool | None = None) -> LlamaForCausalLM:
        """In place: the weight layouts the CPU computes with fastest
        (``placement.hold_for_cpu``); returns the model."""
        return placement.hold_for_cpu(self, pack=pack)

    def shard(self, mesh: jax.sharding.Mesh, *, expert_parallel: bool = False) -> LlamaForCausalLM:
        """The weights moved into their tensor-parallel shards on ``mesh``
        (``placement.shard``; a mixture's experts split by expert with
        ``expert_parallel``); returns the model."""
        return placement.shard(self, mesh, expert_parallel=expert_parallel)

    def preferred_cache_dtype(self):
        """The KV pool's dtype the engine gives this model when none is asked for
        (``placement.preferred_cache_dtype``)."""
        return placement.preferred_cache_dtype(self)

    def make_cache(
        self, num_pages: int, page_size: int, dtype=None, *, hybrid: bool = False
    ) -> PagedKVCache:
        """An empty paged cache shaped for this model (default dtype: the compute dtype).

        ``hybrid``: when some layers have a sliding window, a pool of layer groups
        (``PagedKVCache.create(layer_windows=...)``) whose sliding groups' pages a
        ``HybridBlockManager`` frees once they leave the window; otherwise ignored.
        """
        c = self.config
        windows = tuple(k.sliding_window for k in c.layer_kinds)
        return PagedKVCache.create(
            c.num_layers,
            num_pages,
            page_size,
            c.num_kv_heads,
            c.head_dim,
            dtype=dtype or self.dtype,
            layer_windows=windows if hybrid and any(w is not None for w in windows) else None,
        )

    def __call__(
        self,
        tokens_T: jax.Array,  # i32[T]
        positions_T: jax.Array,  # i32[T]
        cache: PagedKVCache,
        md: AttentionMetadata,
        *,
        backend: str = "auto",
        interpret: bool = False,
        adapter_ids: jax.Array | None = None,  # i32[T]
    ) -> tuple[jax.Array, PagedKVCache]:  # (f32[R, V], cache)
        """Runs one step; returns the logits of rows ``md.logits_indices`` and the cache.

        ``backend`` / ``interpret`` go to ``paged_jax.ragged_paged_attention`` (or
        ``paged_jax.paged_attention`` for ``md.decode_only`` steps). ``adapter_ids``: each
        token's LoRA slot plus one (0: none; ``enable_lora``), or None (no adapters).
        """
        if adapter_ids is None:
            return self._forward(tokens_T, positions_T, cache, md, backend, interpret)
        if self.lora is None:
            raise ValueError("adapter_ids: the model has no LoRA slots (enable_lora)")
        if adapter_ids.shape != tokens_T.shape:
            raise ValueError(
                f"adapter_ids: expected shape {tokens_T.shape} (one a token), got "
                f"{adapter_ids.shape}"
            )
        with _lora.rows(self.lora, _lora.selector(self.lora, adapter_ids)):
            return self._forward(tokens_T, positions_T, cache, md, backend, interpret)

    def hidden_states(
        self,
        tokens_T: jax.Array,  # i32[T]
        positions_T: jax.Array,  # i32[T]
        cache: PagedKVCache,
        md: AttentionMetadata,
        *,
        backend: str = "auto",
        interpret: bool = False,
    ) -> tuple[jax.Array, PagedKVCache]:  # (f32[R, E], cache)
        """Runs one step as ``__call__`` does, but returns the final hidden states (after
        the last norm, before the LM head) of rows ``md.logits_indices`` instead of their
        logits: what embeddings pool (``LLM.embed``)."""
        x_TE, cache = self._layers(tokens_T, positions_T, cache, md, backend, interpret)
        return self.norm(x_TE[md.logits_indices]).astype(jnp.float32), cache

    def _forward(self, tokens_T, positions_T, cache, md, backend, interpret):
        x_TE, cache = self._layers(tokens_T, positions_T, cache, md, backend, interpret)
        logits = rowwise(self._logits, x_TE[md.logits_indices], invariant=md.batch_invariant)
        return logits, cache

    def _layers(self, tokens_T, positions_T, cache, md, backend, interpret):
        """The embedding and every layer: ``(x [T, E] before the last norm, cache)``."""
        cfg = self.config
        x_TE = self.embed_tokens(tokens_T)
        if cfg.scale_embeddings:  # Gemma: sqrt(E), rounded to the compute dtype first
            x_TE = x_TE * jnp.asarray(cfg.hidden_size**0.5, x_TE.dtype)
        # per_layer: weights held as tuples of per-layer arrays (split_layer_weights), each
        # picked by its product; stacked: [L, ...] arrays, sliced per layer
        graphdef, per_layer, stacked = nnx.split(self.layers, placement.held_per_layer, ...)
        kinds, period = cfg.layer_kinds, cfg.layer_period
        groups, rest = divmod(cfg.num_layers, period)

        def run(x_TE, cache, weights, j, layer):
            """Layer ``layer`` (a traced index), the ``j``-th of its group."""
            block = nnx.merge(graphdef, per_layer, weights)
            token = LAYER.set(layer)
            try:
                return block(x_TE, positions_T, kinds[j], layer, cache, md, backend, interpret)
            finally:
                LAYER.reset(token)

        def one_group(carry, xs):  # the same compiled body for every group of layers
            x_TE, cache = carry
            scanned, g = xs  # scanned: this layer's weights when period == 1, else None
            for j in range(period):  # the layers of a group differ in window / RoPE
                i = g * period + j
                # period > 1: sliced here (a reshaped copy of the stack would cost a step)
                weights = (
                    scanned
                    if scanned is not None
                    else jax.tree.map(
                        lambda a, i=i: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), stacked
                    )
                )
                x_TE, cache = run(x_TE, cache, weights, j, i)
            return (x_TE, cache), None

        group_ids = jnp.arange(groups, dtype=jnp.int32)
        xs = (stacked if period == 1 else None, group_ids)
        # (one replica's batch: data-parallel steps concatenate several, padded each)
        real = md.cu_q_lens[md.num_seqs[0]] if md.num_seqs.shape == (1,) else None
        rows = ROWS.set(None if real is None else (x_TE.shape[0], real))
        try:
            if self.unrolled:  # hold_for_accelerator: layer i's own weights, i a Python int
                for i in range(cfg.num_layers):
                    weights = jax.tree.map(lambda a, i=i: a[i], stacked)
                    x_TE, cache = run(x_TE, cache, weights, i % period, i)
            else:
                (x_TE, cache), _ = jax.lax.scan(one_group, (x_TE, cache), xs)
                for j in range(rest):  # a last, partial group (Gemma 3 1B: 26 = 4 x 6 + 2)
                    i = groups * period + j
                    weights = jax.tree.map(lambda a, i=i: a[i], stacked)
                    x_TE, cache = run(x_TE, cache, weights, j, jnp.int32(i))
        finally:
            ROWS.reset(rows)
        return x_TE, cache

    def _logits(self, x_RE):
        x_RE = self.norm(x_RE)
        if self.lm_head is None:
            logits = self.embed_tokens.attend(x_RE).astype(jnp.float32)
        else:
            logits = self.lm_head(x_RE).astype(jnp.float32)
        # a vocabulary padded for tensor parallelism (models.sharding.pad_vocab)
        logits = logits[:, : self.config.vocab_size]
        return soft_cap(logits, self.config.final_logit_softcap)


def init_model(
    cfg: LlamaConfig,
    *,
    seed: int = 0,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    mesh: jax.sharding.Mesh | None = None,
):
    """A randomly initialized model (fixed seed: the same weights in every process and
    on any mesh). ``mesh``: a mesh with a ``"tp"`` axis; the weights are initialized
    directly in their tensor-parallel shards (``paged_jax.models.sharding``)."""

    def make():
        return LlamaForCausalLM(cfg, rngs=nnx.Rngs(seed), dtype=dtype, param_dtype=param_dtype)

    if mesh is None:
        return make()
    from paged_jax.sharding import tensor_parallel_size

    from .sharding import shard_model, state_shardings

    if cfg.vocab_size % tensor_parallel_size(mesh):  # padded by shard_model
        return shard_model(make(), mesh)

    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    shardings = state_shardings(cfg, abstract, mesh)
    state = jax.jit(lambda: nnx.split(make())[1], out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def make_step(model: LlamaForCausalLM, *, backend: str = "auto", interpret: bool = False):
    """Splits ``model`` and returns ``(step, state)``, where

    ``step(state, tokens i32[T], positions i32[T], cache, metadata) -> (logits f32[R, V],
    cache)`` is jitted, applies the metadata's copy-on-write copies first, and donates
    ``cache`` (the pool is updated in place; do not reuse the cache passed in).
    """
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=(3,))
    def step(state, tokens, positions, cache, md):
        m = nnx.merge(graphdef, state)
        cache = cache.copy_pages(md.copy_src, md.copy_dst)
        return m(tokens, positions, cache, md, backend=backend, interpret=interpret)

    return step, state
