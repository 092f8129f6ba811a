"""Configuration of the decoders: Llama 2/3, Qwen2, Qwen3, Mistral, Gemma 2 and Gemma 3 (text),
and the mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE and GPT-OSS."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "GptOssForCausalLM",
)
_MOE = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM")
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
LAYER_TYPES = ("sliding_attention", "full_attention")
_ACTIVATIONS = ("silu", "gelu_tanh")
_REQUIRED_HF_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling (HF ``rope_type="llama3"``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor: expected > 0, got {self.factor}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                "rope_scaling: expected 0 < low_freq_factor < high_freq_factor, got "
                f"low_freq_factor={self.low_freq_factor}, high_freq_factor={self.high_freq_factor}"
            )


@dataclasses.dataclass(frozen=True)
class LinearRopeScaling:
    """Positions divided by ``factor`` (HF ``rope_type="linear"``; Gemma 3's global layers)."""

    factor: float

    def __post_init__(self):
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor: expected > 0, got {self.factor}")


@dataclasses.dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN (HF ``rope_type="yarn"``; GPT-OSS): frequencies rotating fewer than
    ``beta_slow`` times over ``original_max_position_embeddings`` are slowed by ``factor``,
    those rotating more than ``beta_fast`` times kept, the band between blended linearly
    (its ends rounded out to whole dimensions when ``truncate``); queries' and keys'
    rotations are scaled by ``attention_factor``."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0

    def __post_init__(self):
        for name in ("factor", "beta_fast", "beta_slow", "attention_factor"):
            if getattr(self, name) <= 0:
                raise ValueError(f"rope_scaling.{name}: expected > 0, got {getattr(self, name)}")
        if self.original_max_position_embeddings < 1:
            raise ValueError(
                "rope_scaling.original_max_position_embeddings: expected >= 1, got "
                f"{self.original_max_position_embeddings}"
            )


RopeScalings = RopeScaling | LinearRopeScaling | YarnRopeScaling


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """What one layer needs beyond the shared shapes: its attention's sliding window (None:
    every earlier token) and RoPE base and scaling, and whether a mixture's layer has a
    dense feed-forward block instead of its experts (``LlamaConfig.dense_layers``)."""

    sliding_window: int | None
    rope_theta: float
    rope_scaling: RopeScalings | None
    dense_ffn: bool = False


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shapes and options of a Llama-family decoder.

    ``qkv_bias`` / ``o_bias``: biases of the q/k/v and output projections (Llama's
    ``attention_bias`` sets both; Qwen2 has q/k/v biases only). ``sliding_window``: each
    token attends to at most this many most recent tokens (Mistral: every layer).

    Gemma 2 / 3 options (all off for the other families):

    - ``layer_types``: per layer, ``"sliding_attention"`` (the window applies) or
      ``"full_attention"``; None: every layer slides if ``sliding_window`` is set.
    - ``local_rope_theta``: RoPE base of the sliding layers (Gemma 3: 10,000 against
      1,000,000 for the global ones, whose ``rope_scaling`` does not apply to them).
    - ``hidden_act``: ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU).
    - ``norm_unit_offset``: RMSNorm scales by ``1 + w``.
    - ``sandwich_norms``: each block's output is normed too (post-attention and
      post-feedforward norms), and the MLP gets its own pre-norm.
    - ``scale_embeddings``: embeddings multiplied by ``sqrt(hidden_size)``.
    - ``query_pre_attn_scalar``: softmax scale ``query_pre_attn_scalar ** -0.5`` (default
      ``head_dim ** -0.5``).
    - ``attn_logit_softcap`` / ``final_logit_softcap``: scores / logits become
      ``cap * tanh(x / cap)``.

    Mixtures of experts (``num_experts`` > 0; every layer's feed-forward block sparse,
    ``models.layers.moe.SparseMoE``):

    - ``num_experts``, ``num_experts_per_tok``: experts a layer, and how many a token takes.
    - ``moe_intermediate_size``: an expert's width (default ``intermediate_size``).
    - ``norm_topk_prob``: the chosen experts' probabilities divided by their sum.
    - ``shared_expert_intermediate_size``: a shared expert of this width every token takes,
      scaled by a sigmoid gate (Qwen2-MoE); 0: none.
    - ``router_scoring``: ``"softmax"`` (over every expert, then the top k) or
      ``"topk_softmax"`` (the top k logits, then the softmax over them: GPT-OSS).
    - ``moe_bias``: the router and the experts' projections have biases (GPT-OSS).
    - ``swiglu_limit``: the experts' gated unit clamped (GPT-OSS): the gate to at most
      ``limit``, the up projection to ``[-limit, limit]``, then ``(up + 1) * gate *
      sigmoid(swiglu_alpha * gate)``; None: SwiGLU (or GeGLU) as ``hidden_act`` says.

    - ``dense_layers``: the layers of a mixture whose feed-forward block is a dense MLP of
      ``intermediate_size`` (Qwen's ``mlp_only_layers`` and ``decoder_sparse_step``);
      every layer holds both blocks' weights (the unused one zeros), so the layers stay
      one stack.

    ``attention_sinks``: each attention head has a learned sink, a logit that joins the
    softmax's sum with a value of 0 (GPT-OSS; ``paged_jax.ragged_paged_attention``).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScalings | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    sliding_window: int | None = None
    qk_norm: bool = False  # RMSNorm of each query and key head before RoPE (Qwen3, Gemma 3)
    layer_types: tuple[str, ...] | None = None
    local_rope_theta: float | None = None
    hidden_act: str = "silu"
    norm_unit_offset: bool = False
    sandwich_norms: bool = False
    scale_embeddings: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    router_scoring: str = "softmax"
    moe_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    attention_sinks: bool = False
    dense_layers: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads: expected a multiple of num_kv_heads={self.num_kv_heads}, got "
                f"{self.num_heads}"
            )
        hd = self.head_dim
        if hd is not None and (not isinstance(hd, int) or isinstance(hd, bool) or hd < 1):
            raise ValueError(f"head_dim: expected None or a positive int, got {self.head_dim!r}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"{name}: expected a number, got {value!r}")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size: expected a multiple of num_heads={self.num_heads} when "
                    f"head_dim is not given, got {self.hidden_size}"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim % 2:
            raise ValueError(f"head_dim: expected an even number (RoPE), got {self.head_dim}")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps: expected > 0, got {self.rms_norm_eps}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta: expected > 0, got {self.rope_theta}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window: expected None or >= 1, got {self.sliding_window}")
        if self.layer_types is not None:
            types = tuple(self.layer_types)
            object.__setattr__(self, "layer_types", types)
            bad = [t for t in types if t not in LAYER_TYPES]
            if len(types) != self.num_layers or bad:
                raise ValueError(
                    f"layer_types: expected {self.num_layers} entries, each one of "
                    f"{LAYER_TYPES}, got {list(types)!r}"
                )
            if "sliding_attention" in types and self.sliding_window is None:
                raise ValueError("layer_types: sliding layers need sliding_window, which is None")
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act: expected one of {_ACTIVATIONS}, got {self.hidden_act!r}")
        for name in (
            "local_rope_theta",
            "query_pre_attn_scalar",
            "attn_logit_softcap",
            "final_logit_softcap",
        ):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0
            ):
                raise ValueError(f"{name}: expected None or a number > 0, got {value!r}")
        self._check_experts()
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture: expected one of {SUPPORTED_ARCHITECTURES}, got "
                f"{self.architecture!r}"
            )

    def _check_experts(self) -> None:
        for name in ("num_experts", "num_experts_per_tok", "shared_expert_intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}: expected an int >= 0, got {value!r}")
        if self.router_scoring not in ("softmax", "topk_softmax"):
            raise ValueError(
                f"router_scoring: expected 'softmax' or 'topk_softmax', got {self.router_scoring!r}"
            )
        for name in ("swiglu_limit", "swiglu_alpha"):
            value = getattr(self, name)
            if (value is not None or name == "swiglu_alpha") and (
                not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0
            ):
                raise ValueError(f"{name}: expected a number > 0, got {value!r}")
        if not self.num_experts:
            if (
                self.num_experts_per_tok
                or self.shared_expert_intermediate_size
                or self.moe_bias
                or self.dense_layers
            ):
                raise ValueError(
                    "num_experts: 0 (a dense model), but num_experts_per_tok, "
                    "shared_expert_intermediate_size, moe_bias or dense_layers is set"
                )
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok: expected an int in [1, num_experts={self.num_experts}], "
                f"got {self.num_experts_per_tok!r}"
            )
        dense = tuple(self.dense_layers)
        object.__setattr__(self, "dense_layers", dense)
        if any(
            not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.num_layers
            for i in dense
        ) or len(set(dense)) != len(dense):
            raise ValueError(
                f"dense_layers: expected distinct layer indices in [0, {self.num_layers}), "
                f"got {list(dense)!r}"
            )
        width = self.moe_intermediate_size
        if width is None:
            object.__setattr__(self, "moe_intermediate_size", self.intermediate_size)
        elif not isinstance(width, int) or isinstance(width, bool) or width < 1:
            raise ValueError(f"moe_intermediate_size: expected a positive int, got {width!r}")

    @property
    def sparse(self) -> bool:
        """Whether the layers' feed-forward blocks are mixtures of experts."""
        return self.num_experts > 0

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        e = self.eos_token_id
        if e is None:
            return ()
        return tuple(e) if isinstance(e, (tuple, list)) else (int(e),)

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """Each layer's window and RoPE settings, in order (``[L]``)."""
        full = LayerKind(self.sliding_window, self.rope_theta, self.rope_scaling)
        if self.layer_types is None:
            return self._with_dense((full,) * self.num_layers)
        local = LayerKind(
            self.sliding_window,
            self.rope_theta if self.local_rope_theta is None else self.local_rope_theta,
            self.rope_scaling if self.local_rope_theta is None else None,
        )
        full = dataclasses.replace(full, sliding_window=None)
        kinds = tuple(local if t == "sliding_attention" else full for t in self.layer_types)
        return self._with_dense(kinds)

    def _with_dense(self, kinds: tuple[LayerKind, ...]) -> tuple[LayerKind, ...]:
        dense = set(self.dense_layers)
        return tuple(
            dataclasses.replace(k, dense_ffn=True) if i in dense else k for i, k in enumerate(kinds)
        )

    @property
    def layer_period(self) -> int:
        """The shortest period of ``layer_kinds`` over the layers (1 when every layer is
        alike; Gemma 2: 2; Gemma 3: 6). The forward pass scans over groups of this many
        layers, so it compiles this many layer bodies (plus a partial group at the end),
        whatever the depth."""
        kinds = self.layer_kinds
        for p in range(1, len(kinds) + 1):
            if all(kinds[i] == kinds[i % p] for i in range(len(kinds))):
                return p
        return len(kinds)

    # ------------------------------------------------------------------ Hugging Face
    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> LlamaConfig:
        """From a Hugging Face ``config.json`` dict (transformers 4.x or 5.x key names).

        Raises ValueError naming the key for a missing, mistyped or unsupported value.
        """
        if not isinstance(hf, dict):
            raise ValueError(f"expected a JSON object, got {type(hf).__name__}")
        try:
            return cls._from_hf(hf)
        except (TypeError, KeyError) as e:  # a value of the wrong type deep in a conversion
            raise ValueError(f"unexpected value ({type(e).__name__}: {e})") from None

    @classmethod
    def _from_hf(cls, hf: dict[str, Any]) -> LlamaConfig:
        arch = _hf_architecture(hf)
        gemma = arch in _GEMMA
        theta, scaling, local_theta = _hf_rope(hf, arch)
        window, layer_types = _hf_windows(hf, arch)
        if arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"):
            qkv_bias, o_bias = True, False
        elif arch == "GptOssForCausalLM":  # transformers' default: biases on
            qkv_bias = o_bias = bool(hf.get("attention_bias", True))
        else:  # Llama, Mistral, Qwen3, Gemma: q/k/v/o biases together, off by default
            qkv_bias = o_bias = bool(hf.get("attention_bias", False))
        if hf.get("mlp_bias"):
            raise ValueError("mlp_bias: MLP biases are not supported")
        act = (
            hf.get("hidden_activation")
            or hf.get("hidden_act")
            or ("gelu_pytorch_tanh" if gemma else "silu")  # transformers' defaults
        )
        act = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "silu": "silu"}.get(act)
        if act is None:
            raise ValueError(
                f"hidden_act: {hf.get('hidden_activation') or hf.get('hidden_act')!r} is not "
                "supported (silu, gelu_pytorch_tanh)"
            )
        eos = hf.get("eos_token_id")
        experts = _hf_experts(hf, arch)
        missing = [k for k in _REQUIRED_HF_KEYS if k not in hf]
        if missing:
            raise ValueError(f"missing key(s) {', '.join(map(repr, missing))}")
        gemma2 = arch == "Gemma2ForCausalLM"
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim", 256 if gemma else None),
            rms_norm_eps=_number({"rms_norm_eps": 1e-6, **hf}, "rms_norm_eps"),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            sliding_window=window,
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM"),
            layer_types=None if layer_types is None else tuple(layer_types),
            local_rope_theta=local_theta,
            hidden_act=act,
            norm_unit_offset=gemma,
            sandwich_norms=gemma,
            scale_embeddings=gemma,
            query_pre_attn_scalar=(
                _number({"query_pre_attn_scalar": 256, **hf}, "query_pre_attn_scalar")
                if gemma
                else None
            ),
            attn_logit_softcap=_optional(hf, "attn_logit_softcapping", 50.0 if gemma2 else None),
            final_logit_softcap=_optional(hf, "final_logit_softcapping", 30.0 if gemma2 else None),
            **experts,
            attention_sinks=arch == "GptOssForCausalLM",
            architecture=arch,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        )


def _hf_architecture(hf: dict) -> str:
    """A Hugging Face config's architecture (its ``architectures``, else its
    ``model_type``'s), one this package supports."""
    archs = hf.get("architectures") or []
    arch = (
        archs[0]
        if archs
        else {
            "llama": "LlamaForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM",
            "mistral": "MistralForCausalLM",
            "gemma2": "Gemma2ForCausalLM",
            "gemma3_text": "Gemma3ForCausalLM",
            "mixtral": "MixtralForCausalLM",
            "qwen2_moe": "Qwen2MoeForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM",
            "gpt_oss": "GptOssForCausalLM",
        }.get(hf.get("model_type"))
    )
    if arch not in SUPPORTED_ARCHITECTURES:
        hint = (
            " (Gemma 3's multimodal checkpoints are not: only text-only "
            "Gemma3ForCausalLM ones, such as gemma-3-1b and gemma-3-270m)"
            if arch == "Gemma3ForConditionalGeneration"
            else ""
        )
        raise ValueError(
            f"architectures: {archs or hf.get('model_type')!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}{hint}"
        )
    return arch


def _hf_rope(hf: dict, arch: str) -> tuple:
    """``(theta, scaling, the sliding layers' theta or None)`` of a Hugging Face config:
    its ``rope_parameters`` (per layer type in transformers 5) or legacy fields."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = dict(hf.get("rope_scaling") or {})
    local_theta = None
    if set(params) & set(LAYER_TYPES):  # per layer type (transformers 5, Gemma 3)
        full, local = params.get("full_attention") or {}, params.get("sliding_attention")
        theta, scaling = _rope({**legacy, **full}, hf.get("rope_theta", 1_000_000.0))
        if local is not None:
            local_theta, local_scaling = _rope(local, hf.get("rope_local_base_freq", 1e4))
            if local_scaling is not None:
                raise ValueError(
                    "rope_parameters.sliding_attention: only the default RoPE is supported "
                    "on sliding layers"
                )
    else:
        default = 1_000_000.0 if arch == "Gemma3ForCausalLM" else 10000.0
        theta, scaling = _rope({**legacy, **params}, hf.get("rope_theta", default))
        if arch == "Gemma3ForCausalLM":
            local_theta = _number({"rope_local_base_freq": 1e4, **hf}, "rope_local_base_freq")
    return theta, scaling, local_theta


def _hf_windows(hf: dict, arch: str) -> tuple:
    """``(sliding window or None, layer types or None)`` of a Hugging Face config."""
    window, layer_types = None, None
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        window = hf.get("sliding_window")
    elif arch in _QWEN and hf.get("use_sliding_window"):
        types = hf.get("layer_types") or []
        if any(t != "sliding_attention" for t in types):
            raise ValueError(
                "layer_types: a mix of sliding and full attention layers is not supported "
                "for Qwen models"
            )
        window = hf.get("sliding_window")
    elif arch == "GptOssForCausalLM":  # transformers' defaults: 128, every other layer
        window = hf.get("sliding_window", 128)
        layer_types = hf.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 else "full_attention"
            for i in range(hf["num_hidden_layers"])
        ]
    elif arch in _GEMMA:
        if hf.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention: only causal Gemma is supported")
        window = hf.get("sliding_window", 4096)
        layer_types = hf.get("layer_types")
        if layer_types is None:  # transformers' default pattern
            every = 2 if arch == "Gemma2ForCausalLM" else hf.get("sliding_window_pattern", 6)
            layer_types = [
                "sliding_attention" if (i + 1) % every else "full_attention"
                for i in range(hf["num_hidden_layers"])
            ]
    return window, layer_types


_QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


def _hf_experts(hf: dict, arch: str) -> dict:
    """The ``LlamaConfig`` fields of a Hugging Face mixture of experts (none for a dense
    architecture); Qwen's dense layers among the sparse ones (``mlp_only_layers``,
    ``decoder_sparse_step``) as ``dense_layers``. Raises ValueError naming the key for a
    value not understood."""
    if arch not in _MOE:
        return {}
    if arch == "MixtralForCausalLM":
        return dict(
            num_experts=hf.get("num_local_experts", 8),
            num_experts_per_tok=hf.get("num_experts_per_tok", 2),
            moe_intermediate_size=hf.get("intermediate_size"),
            norm_topk_prob=True,
        )
    if arch == "GptOssForCausalLM":
        return dict(
            num_experts=hf.get("num_local_experts", 128),
            num_experts_per_tok=hf.get("num_experts_per_tok", 4),
            moe_intermediate_size=hf.get("intermediate_size"),
            norm_topk_prob=True,
            router_scoring="topk_softmax",
            moe_bias=True,
            swiglu_limit=_number({"swiglu_limit": 7.0, **hf}, "swiglu_limit"),
            swiglu_alpha=_number({"swiglu_alpha": 1.702, **hf}, "swiglu_alpha"),
        )
    layers = hf.get("num_hidden_layers", 0)
    only = hf.get("mlp_only_layers") or []
    step = hf.get("decoder_sparse_step", 1)
    if not isinstance(only, list) or not all(isinstance(i, int) and 0 <= i < layers for i in only):
        raise ValueError(
            f"mlp_only_layers: expected a list of layer indices in [0, {layers}), got {only!r}"
        )
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError(f"decoder_sparse_step: expected an int >= 1, got {step!r}")
    # transformers' rule: layer i is sparse unless listed, and only every step-th one
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    # (transformers 5 writes Qwen3-MoE's num_experts as num_local_experts)
    given = {k: hf[k] for k in ("num_experts", "num_local_experts") if k in hf}
    if len(set(map(repr, given.values()))) > 1:
        raise ValueError(f"num_experts: the config gives two counts, {given}")
    num = next(iter(given.values()), 60 if arch == "Qwen2MoeForCausalLM" else 128)
    if num == 0:
        raise ValueError(f"num_experts: 0 in a {arch} config (a dense model)")
    return dict(
        num_experts=num,
        num_experts_per_tok=hf.get("num_experts_per_tok", 4 if "Qwen2" in arch else 8),
        moe_intermediate_size=hf.get("moe_intermediate_size"),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=(
            hf.get("shared_expert_intermediate_size", 0) if arch == "Qwen2MoeForCausalLM" else 0
        ),
        dense_layers=dense,
    )


def _rope(src: dict, default_theta: float) -> tuple[float, Any]:
    """``(theta, scaling)`` from one RoPE parameter dict (``rope_parameters`` or a legacy
    ``rope_scaling``, merged)."""
    theta = _number({"rope_theta": default_theta, **src}, "rope_theta")
    rope_type = src.get("rope_type") or src.get("type")
    if rope_type in (None, "default"):
        return theta, None
    if rope_type == "linear":
        return theta, LinearRopeScaling(factor=_number(src, "factor", "rope_scaling."))
    if rope_type == "llama3":
        need = ("factor", "low_freq_factor", "high_freq_factor")
        missing = [k for k in (*need, "original_max_position_embeddings") if k not in src]
        if missing:
            raise ValueError(
                f"rope_scaling: llama3 rope scaling needs {', '.join(missing)}, which "
                "config.json does not give"
            )
        return theta, RopeScaling(
            factor=_number(src, "factor", "rope_scaling."),
            low_freq_factor=_number(src, "low_freq_factor", "rope_scaling."),
            high_freq_factor=_number(src, "high_freq_factor", "rope_scaling."),
            original_max_position_embeddings=int(
                _number(src, "original_max_position_embeddings", "rope_scaling.")
            ),
        )
    if rope_type == "yarn":
        return theta, _yarn(src)
    raise ValueError(f"rope_type: {rope_type!r} is not supported (default, linear, llama3, yarn)")


def _yarn(src: dict) -> YarnRopeScaling:
    """YaRN's settings; its attention factor as transformers derives it when not given
    (``0.1 * ln(factor) + 1``, or the ratio of two such with ``mscale`` and
    ``mscale_all_dim``)."""
    if "original_max_position_embeddings" not in src:
        raise ValueError(
            "rope_scaling: yarn rope scaling needs original_max_position_embeddings, which "
            "config.json does not give"
        )
    factor = _number(src, "factor", "rope_scaling.")

    def mscale(scale: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    attention = src.get("attention_factor")
    if attention is None:
        m, m_all = src.get("mscale"), src.get("mscale_all_dim")
        attention = mscale(m) / mscale(m_all) if m and m_all else mscale(1.0)
    return YarnRopeScaling(
        factor=factor,
        original_max_position_embeddings=int(
            _number(src, "original_max_position_embeddings", "rope_scaling.")
        ),
        beta_fast=float(src.get("beta_fast") or 32.0),
        beta_slow=float(src.get("beta_slow") or 1.0),
        truncate=bool(src.get("truncate", True)),
        attention_factor=float(attention),
    )


def _optional(src: dict, key: str, default: float | None) -> float | None:
    value = src.get(key, default)
    return None if value is None else _number({key: value}, key)


def _number(src: dict, key: str, prefix: str = "") -> float:
    value = src[key]
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{prefix}{key}: expected a number, got {value!r}")
    return float(value)


# A built-in model for demos and tests: random weights from a fixed seed, byte vocabulary
# (256 byte values + BOS + EOS + padding up to 320).
TINY_LLAMA = LlamaConfig(
    vocab_size=320,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    bos_token_id=256,
    eos_token_id=257,
)

PRESETS = {"tiny-llama": TINY_LLAMA}
