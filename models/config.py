"""Configuration of the Llama-family decoders: Llama 2/3, Qwen2, Qwen3, Mistral."""

from __future__ import annotations

import dataclasses
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
)
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
class LlamaConfig:
    """Shapes and options of a Llama-family decoder.

    ``qkv_bias`` / ``o_bias``: biases of the q/k/v and output projections (Llama's
    ``attention_bias`` sets both; Qwen2 has q/k/v biases only). ``sliding_window``: each
    token attends to at most this many most recent tokens (Mistral).
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
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    sliding_window: int | None = None
    qk_norm: bool = False  # RMSNorm of each query and key head before RoPE (Qwen3)
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
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture: expected one of {SUPPORTED_ARCHITECTURES}, got "
                f"{self.architecture!r}"
            )

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        e = self.eos_token_id
        if e is None:
            return ()
        return tuple(e) if isinstance(e, (tuple, list)) else (int(e),)

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
        archs = hf.get("architectures") or []
        arch = (
            archs[0]
            if archs
            else {
                "llama": "LlamaForCausalLM",
                "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM",
                "mistral": "MistralForCausalLM",
            }.get(hf.get("model_type"))
        )
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architectures: {archs or hf.get('model_type')!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        rope = dict(hf.get("rope_parameters") or {})
        legacy = hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type") or legacy.get("rope_type") or legacy.get("type")
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = None
        if rope_type == "llama3":
            src = {**legacy, **rope}
            need = ("factor", "low_freq_factor", "high_freq_factor")
            missing = [k for k in (*need, "original_max_position_embeddings") if k not in src]
            if missing:
                raise ValueError(
                    f"rope_scaling: llama3 rope scaling needs {', '.join(missing)}, which "
                    "config.json does not give"
                )
            scaling = RopeScaling(
                factor=_number(src, "factor", "rope_scaling."),
                low_freq_factor=_number(src, "low_freq_factor", "rope_scaling."),
                high_freq_factor=_number(src, "high_freq_factor", "rope_scaling."),
                original_max_position_embeddings=int(
                    _number(src, "original_max_position_embeddings", "rope_scaling.")
                ),
            )
        elif rope_type not in (None, "default"):
            raise ValueError(f"rope_type: {rope_type!r} is not supported (default, llama3)")

        window = None
        if arch == "MistralForCausalLM":
            window = hf.get("sliding_window")
        elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and hf.get("use_sliding_window"):
            types = hf.get("layer_types") or []
            if any(t != "sliding_attention" for t in types):
                raise ValueError(
                    "layer_types: a mix of sliding and full attention layers is not supported"
                )
            window = hf.get("sliding_window")
        if arch == "Qwen2ForCausalLM":
            qkv_bias, o_bias = True, False
        elif arch == "Qwen3ForCausalLM":  # q/k/v/o biases together, off by default
            qkv_bias = o_bias = bool(hf.get("attention_bias", False))
        else:
            qkv_bias = o_bias = bool(hf.get("attention_bias", False))
        if hf.get("mlp_bias"):
            raise ValueError("mlp_bias: MLP biases are not supported")
        eos = hf.get("eos_token_id")
        missing = [k for k in _REQUIRED_HF_KEYS if k not in hf]
        if missing:
            raise ValueError(f"missing key(s) {', '.join(map(repr, missing))}")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim"),
            rms_norm_eps=_number({"rms_norm_eps": 1e-6, **hf}, "rms_norm_eps"),
            rope_theta=_number({"rope_theta": theta}, "rope_theta"),
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            sliding_window=window,
            qk_norm=arch == "Qwen3ForCausalLM",
            architecture=arch,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        )


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
