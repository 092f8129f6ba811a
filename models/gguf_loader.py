"""Loads a GGUF file (llama.cpp's single-file format) into ``LlamaForCausalLM``, with the
tokenizer and chat template its metadata carries.

Weights go through the ``gguf`` package: ``GGUFReader`` maps the file; quantized blocks
are kept as they are (``gguf_blocks``: decoded into 4-bit values, high-bit planes and
float16 scales, about the file's bytes), or widened to float32 by
``gguf.quants.dequantize`` (``dequantize=True``). Tensors are renamed to Hugging Face
names and layouts, and the model is built by the same code as ``load_hf``
(``build_model``). Metadata is read by ``gguf_fields``, the tokenizer rebuilt by
``gguf_tokenizer``. Facts of the format this relies on:

* a 2-D tensor of GGUF shape ``[in, out]`` (fastest dimension first) reads as a numpy
  ``[out, in]`` matrix: Hugging Face's layout of a linear weight;
* for the ``llama`` architecture (Llama, Mistral) llama.cpp's converter reorders the
  rows of each head of ``attn_q`` / ``attn_k`` from rotate-half pairs ``(j, j + D/2)``
  to interleaved pairs ``(2j, 2j + 1)``; ``_unpermute`` puts them back. ``qwen2`` and
  ``qwen3`` files keep Hugging Face's order;
* the tokenizer is stored as its pieces (``tokenizer.ggml.tokens``), their kinds
  (``token_type``: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte) and
  either BPE merges (``model`` "gpt2": byte-level BPE) or piece scores (``model``
  "llama": SentencePiece BPE with byte fallback). ``gguf_tokenizer`` rebuilds it as a
  ``tokenizers.Tokenizer``.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import pathlib
import re
import sys
import types
from collections.abc import Callable
from typing import Any

import numpy as np

from paged_jax import linear

from .config import LlamaConfig
from .gguf_blocks import _EIGHT_BIT_BLOCKS, KEPT, _dequantize, nibble_blocks
from .gguf_fields import _REQUIRED, GGUFError
from .gguf_fields import field as _field
from .gguf_fields import token_id as _token_id
from .gguf_tokenizer import gguf_tokenizer
from .hf import _family_name, build_model, release_freed_memory
from .quantization import int8_group, quantize_fp8, quantize_int8

# GGUF architecture -> Hugging Face architecture (Mistral files usually say "llama").
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}  # (and "llama" files with experts: Mixtral)
_GEMMA = ("gemma2", "gemma3")
# Block formats a GGUF file's tensors may come in (by name of gguf.GGMLQuantizationType):
# every one can be dequantized by gguf's numpy code; ``KEPT`` ones are kept by default
# (``gguf_blocks.Nibbles``) and Q8_0 as int8 groups, and with ``quantization="int8"``
# ``KEPT_INT8`` ones as int8 groups
QUANT_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S",
    "TQ1_0", "TQ2_0",
)  # fmt: skip
# as int8 groups, with "int8" (Q8_0 always)
KEPT_INT8 = ("Q8_0", "Q6_K", "Q5_0", "Q5_1", "Q5_K", "Q3_K", "Q2_K")

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",
    # mixtures of experts: the router, the shared expert and its gate (Qwen2-MoE)
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# The experts' weights, one 3-D tensor a layer: numpy [X, out, in], each expert's matrix in
# Hugging Face's [out, in] layout (split into one tensor an expert when read)
_EXPERT_TENSORS = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
# Gemma's sandwich norms (the gguf package's tensor map): llama.cpp names the norm before
# the MLP ffn_norm, which in Llama files is the post-attention norm.
_GEMMA_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Tensors llama.cpp writes that the model recomputes or does not use.
_IGNORED = ("rope_freqs.weight",)

# Entries of one metadata array a file may declare: real vocabularies and merge lists hold
# up to ~300k (Gemma 3: 262,144 tokens; Llama 3: 280,147 merges).
MAX_METADATA_ARRAY = 1 << 21


def load_gguf(
    path: str | os.PathLike,
    *,
    dtype: Any = None,
    param_dtype: Any = None,
    mesh: Any = None,
    quantization: str | None = None,
    dequantize: bool = False,
) -> tuple[Any, Any]:
    """Loads a GGUF file: ``(LlamaForCausalLM, TextTokenizer | None)``.

    Args:
      path: a ``.gguf`` file of a ``llama`` (Mixtral's with experts), ``mistral``,
        ``qwen2``, ``qwen3``, ``gemma2``, ``gemma3`` (text), ``qwen2moe`` or ``qwen3moe``
        model whose
        tensors are in ``QUANT_TYPES``.
      dtype: compute dtype (default float32).
      param_dtype: storage dtype of the weights (default ``dtype``).
      mesh: a ``jax.sharding.Mesh`` with a ``"tp"`` axis: each weight goes straight into
        its tensor-parallel shards; None: one device.
      quantization: None (default): the file's quantized tensors as stored. Q4_0,
        Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q3_K and Q2_K keep their blocks as
        ``gguf_blocks.Nibbles`` (``Linear``'s int4 format: 4 low bits two a byte, 1 or 2
        high bits in a plane beside them for the 5- and 6-bit formats, a float16 scale
        and minimum or offset per group of 32 or 16 inputs), within 1.11x the file's
        bytes for the first seven (Q3_K 1.45x, Q2_K 2.3x); Q8_0 keeps its blocks as int8
        groups (an f32 scale per 32: 1.06x); an embedding table with high bits becomes
        int8 groups. Every weight is the one the file defines (the K-quants' scales
        rounded once to float16, within 2 ** -11 of themselves). F32 / F16 / BF16 tensors
        stay float. ``"int4"``: the same, and ``paged_jax.models.load`` quantizes the
        float weights to int4. ``"int8"``: Q8_0, Q6_K, Q5_0, Q5_1, Q5_K, Q3_K and Q2_K
        tensors keep their blocks as int8 groups (a scale per group of 32 inputs, 16 for
        Q6_K, Q3_K and Q2_K, and for Q5_1 / Q5_K / Q2_K a minimum per group), and the
        other linear weights are quantized to int8 (``models.quantization``'s scales:
        per group of 32 inputs for the CPU, else per output channel) a tensor at a time
        as they are read, so the load never holds them all in f32; ``"fp8"`` likewise
        with every linear weight quantized to fp8. A mixture's experts in ``KEPT``
        formats are kept by default too (``Experts``' int4, gate's and up's in one
        layout; Q8_0 ones as int8 groups); with ``quantization`` (or in F16...) they are
        read in float (and quantized with the model: ``LlamaForCausalLM.quantize``).
      dequantize: every tensor dequantized to float32 instead (``quantization``
        None), as the gguf package defines each format: a quantized file's weights at
        4 bytes each, multiplied as float (no rows quantized by the CPU's kernel).

    The tokenizer is None if the file has none; it carries the file's chat template
    (``tokenizer.apply_chat_template``). Raises FileNotFoundError, and ``GGUFError`` (a
    ValueError) naming the file and what it cannot read.
    """
    reader = _open(path)
    cfg = gguf_config(reader, path)  # checks the architecture
    arch = _field(reader, "general.architecture", path, kind="str")
    if dequantize and quantization is not None:
        raise ValueError(
            f"dequantize: widens the file's tensors to float32, which quantization="
            f"{quantization!r} would quantize again; pass one of them"
        )
    if cfg.sparse and quantization not in (None, "int8", "int4"):
        raise GGUFError(
            f"{path}: quantization: {quantization!r} for a mixture of experts is not supported "
            "yet (its experts take int8 and int4)"
        )
    # a mixture: read in float, then quantized whole (its experts included)
    after, quantization = (quantization, None) if cfg.sparse else (None, quantization)
    # the blocks kept: by default, and with "int4" (a mixture: by default only)
    keep = not dequantize and (not cfg.sparse or after is None)
    # int8 quantized here in groups for the CPU: rotated first (Linear.rotated), where
    # every layer's tensor of that weight is quantized here (none keeps its blocks)
    rotatable = _rotatable(reader, arch, path) if quantization == "int8" and mesh is None else set()
    tensors, blocks, eight, rotated = _read_tensors(
        reader, cfg, arch, path, quantization, rotatable, keep
    )
    # The tokenizer first, then the file's map is closed (every array above is a copy):
    # its pages no longer count while the model is built.
    tokenizer = gguf_tokenizer(reader, path)
    reader = None
    release_freed_memory()  # what dequantizing each tensor freed
    model = build_model(
        cfg,
        tensors,
        source=str(path),
        dtype=dtype if dtype is not None else np.float32,
        param_dtype=param_dtype,
        mesh=mesh,
        int4_blocks=blocks,
        quantized8=("fp8" if quantization == "fp8" else "int8", eight) if eight else None,
        rotated8=frozenset(rotated),
        float_rows=quantization is None,
    )
    return (model if after is None else model.quantize(after)), tokenizer


def _read_tensors(
    reader: Any, cfg: LlamaConfig, arch: str, path: Any, quantization, rotatable, keep: bool
):
    """``load_gguf``'s reading of every tensor: ``(tensors, blocks, eight, rotated)``,
    float tensors, ``KEPT`` ones kept as ``Nibbles`` (``keep``, unless ``quantization``
    is "int8" or "fp8"), 8-bit ones kept or quantized as ``(q, d(, m))``, and the names of
    the int8 ones rotated, by Hugging Face name."""
    import gguf

    tensors: dict[str, np.ndarray] = {}
    blocks: dict[str, Any] = {}  # KEPT tensors as gguf_blocks.Nibbles
    eight: dict[str, tuple[np.ndarray, ...]] = {}  # KEPT_INT8 as (q, d) or (q, d, m)
    rotated: set[str] = set()  # int8 quantized here, rotated first (Linear.rotated)
    for t in reader.tensors:
        name = _hf_tensor_name(t.name, arch, path)
        if name is None:
            continue
        name = _family_name(name, cfg.architecture)  # (Mixtral's names for its block)
        qtype = gguf.GGMLQuantizationType(int(t.tensor_type))
        if qtype.name not in QUANT_TYPES:
            raise GGUFError(
                f"{path}: tensor {t.name!r} is stored as {qtype.name}, which is not supported "
                f"(supported: {', '.join(QUANT_TYPES)})"
            )
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else None
        if kind == "ffn_gate_inp_shexp" and len(t.shape) == 1:  # llama.cpp's [E]: HF's [1, E]
            tensors[name] = _dequantize(t, qtype).reshape(1, -1)
            reader.release(t)
            continue
        if kind in _EXPERT_TENSORS:  # [X, out, in]: a tensor an expert
            if keep and quantization is None and qtype.name in KEPT:  # kept, by expert
                _split_kept_experts(t, qtype.name, name, cfg.architecture, blocks)
            elif keep and quantization is None and qtype.name == "Q8_0":  # int8 groups
                _split_kept_experts(t, qtype.name, name, cfg.architecture, eight)
            else:
                _split_experts(t, _dequantize(t, qtype), name, cfg.architecture, tensors)
            reader.release(t)
            continue
        matrix = len(t.shape) == 2
        nibble = keep and quantization in (None, "int4") and qtype.name in KEPT and matrix
        keep8 = matrix and (
            (quantization == "int8" and qtype.name in KEPT_INT8)
            or (keep and quantization in (None, "int4") and qtype.name == "Q8_0")
        )
        # int8 / fp8: the other linear weights quantized here, a tensor at a time, as
        # models.load would quantize the whole float model afterwards (the same scales):
        # the load never holds them all in f32
        requantize = (
            quantization in ("int8", "fp8") and matrix and name != "model.embed_tokens.weight"
        )
        if nibble:
            parts = nibble_blocks(t, qtype.name)
        elif keep8:
            parts = _EIGHT_BIT_BLOCKS[qtype.name](t)
        elif requantize and quantization == "fp8":  # [out, in] -> scale [out]
            parts = quantize_fp8(_dequantize(t, qtype), axis=1)
        elif requantize:  # [out, in] -> scale [out] or [out, in / 32] (int8_group)
            w = _dequantize(t, qtype)
            group = int8_group(w, 1)
            if group is not None and _weight_of(name) in rotatable:
                w = linear.rotate(w, 1)
                rotated.add(name)
            parts = quantize_int8(w, 1, group)
        else:
            parts = (_dequantize(t, qtype),)
        reader.release(t)  # (every part is a copy)
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else None
        if arch in ("llama", "mistral") and kind in ("attn_q", "attn_k"):
            heads = cfg.num_heads if kind == "attn_q" else cfg.num_kv_heads
            if nibble:  # (rows: each array's first axis)
                parts = dataclasses.replace(
                    parts,
                    **{
                        f: _unpermute(getattr(parts, f), heads, t.name, path)
                        for f in ("q", "d", "m", "high")
                        if getattr(parts, f) is not None
                    },
                )
            else:
                parts = tuple(_unpermute(w, heads, t.name, path) for w in parts)
        if nibble:
            blocks[name] = parts
        elif keep8 or requantize:
            eight[name] = parts
        else:
            tensors[name] = parts[0]
    return tensors, blocks, eight, rotated


def _weight_of(name: str) -> str:
    """A Hugging Face tensor name without its layer's index: the weight it is a layer of."""
    return re.sub(r"\.layers\.\d+\.", ".layers.*.", name)


def _rotatable(reader: Any, arch: str, path: Any) -> set[str]:
    """The weights (``_weight_of``) all of whose tensors ``load_gguf(...,
    quantization="int8")`` quantizes from float (matrices in no ``KEPT_INT8`` format,
    not the embedding table): those it may hold rotated, every layer alike."""
    import gguf

    kinds: dict[str, bool] = {}
    for t in reader.tensors:
        name = _hf_tensor_name(t.name, arch, path)
        if name is None:
            continue
        qtype = gguf.GGMLQuantizationType(int(t.tensor_type)).name
        ok = len(t.shape) == 2 and qtype not in KEPT_INT8 and name != "model.embed_tokens.weight"
        kind = _weight_of(name)
        kinds[kind] = kinds.get(kind, True) and ok
    return {k for k, ok in kinds.items() if ok}


def _check_layers(reader: Any, path: Any, arch: str, layers: int) -> None:
    """The layers the tensors hold (``blk.N.*``) are those ``block_count`` declares:
    checked before anything is built per declared layer."""
    present = set()
    for t in reader.tensors:
        parts = t.name.split(".")
        if parts[0] == "blk" and len(parts) > 1 and parts[1].isdigit():
            present.add(int(parts[1]))
    if len(present) != layers or (present and (min(present) != 0 or max(present) != layers - 1)):
        held = f"layers {min(present)}-{max(present)}" if present else "no layer"
        raise GGUFError(
            f"{path}: metadata key '{arch}.block_count' says {layers} layers, the tensors "
            f"hold {held} ({len(present)} of them)"
        )


def gguf_config(reader: Any, path: str | os.PathLike = "<gguf>") -> LlamaConfig:
    """The ``LlamaConfig`` a GGUF file's metadata describes (``reader``: a
    ``gguf.GGUFReader``). Raises ``GGUFError`` naming the key of a value that is missing,
    unsupported or of the wrong type, and a ``block_count`` other than the layers its
    tensors hold (when it holds tensors)."""
    arch = _field(reader, "general.architecture", path, kind="str")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{path}: architecture {arch!r} is not supported (supported: "
            f"{', '.join(ARCHITECTURES)})"
        )

    def key(name: str, default: Any = _REQUIRED, kind: str | None = None) -> Any:
        return _field(reader, f"{arch}.{name}", path, default, kind)

    scaling = key("rope.scaling.type", None, "str")
    if scaling not in (None, "none") and not (arch == "gemma3" and scaling == "linear"):
        raise GGUFError(f"{path}: {arch}.rope.scaling.type {scaling!r} is not supported")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise GGUFError(
            f"{path}: tensor 'rope_freqs.weight' (Llama 3.1 rope scaling stored as "
            "frequency factors) is not supported; load the Hugging Face checkpoint instead"
        )
    heads = key("attention.head_count", kind="count")
    tokens = _field(reader, "tokenizer.ggml.tokens", path, None, "strs")
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    # the embedding's rows, which may outnumber the token list (padded vocabularies)
    vocab = key("vocab_size", None, "count") or (int(embd.shape[-1]) if embd is not None else None)
    if vocab is None and tokens:
        vocab = len(tokens)
    hidden = key("embedding_length", kind="count")
    layers = key("block_count", kind="count")
    if reader.tensors:  # a file of metadata alone describes a model without checking it
        _check_layers(reader, path, arch, layers)
    hf = {
        "architectures": [ARCHITECTURES[arch]],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length", kind="count"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads, "count"),
        "head_dim": key("attention.key_length", None, "count"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-5, "float"),
        "rope_theta": key("rope.freq_base", 10000.0, "float"),
        "max_position_embeddings": key("context_length", 2048, "count"),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": _token_id(reader, "tokenizer.ggml.bos_token_id", path, vocab),
        "eos_token_id": _token_id(reader, "tokenizer.ggml.eos_token_id", path, vocab),
    }
    window = key("attention.sliding_window", None, "int")
    if window:
        if arch in ("qwen2", "qwen3"):
            hf["use_sliding_window"] = True
        hf["sliding_window"] = window
    if arch in _GEMMA:
        hf.update(_gemma_keys(arch, key, hf, window))
    hf.update(_expert_keys(arch, key, path))
    try:
        cfg = LlamaConfig.from_hf(hf)
    except ValueError as e:
        raise GGUFError(f"{path}: {e}") from None
    # llama.cpp stores Gemma's norm weights as 1 + w: the norms use them as they are
    return dataclasses.replace(cfg, norm_unit_offset=False) if arch in _GEMMA else cfg


def _expert_keys(arch: str, key: Callable[..., Any], path: Any) -> dict:
    """The Hugging Face config keys of a mixture of experts' file (none for a dense one):
    ``expert_count`` experts a layer, ``expert_used_count`` a token; a ``llama`` file
    with experts is Mixtral's (each expert ``feed_forward_length`` wide, its weights
    renormalized); ``qwen2moe`` / ``qwen3moe`` give ``expert_feed_forward_length``, the
    shared expert's ``expert_shared_feed_forward_length`` (Qwen2-MoE), and
    ``expert_weights_norm`` (default: as the families' checkpoints, Qwen3-MoE's
    renormalized)."""
    experts = key("expert_count", None, "int")
    if not experts:
        if arch in ("qwen2moe", "qwen3moe"):
            raise GGUFError(f"{path}: metadata key '{arch}.expert_count' is missing or 0")
        return {}
    out = {"num_experts_per_tok": key("expert_used_count", kind="count")}
    if arch == "llama":
        return {**out, "architectures": ["MixtralForCausalLM"], "num_local_experts": experts}
    if arch not in ("qwen2moe", "qwen3moe"):
        raise GGUFError(f"{path}: '{arch}.expert_count': experts in {arch} files are not supported")
    out |= {
        "num_experts": experts,
        "moe_intermediate_size": key("expert_feed_forward_length", kind="count"),
        "norm_topk_prob": key("expert_weights_norm", arch == "qwen3moe", "bool"),
    }
    if arch == "qwen2moe":
        out["shared_expert_intermediate_size"] = key("expert_shared_feed_forward_length", 0, "int")
    return out


def _gemma_keys(arch: str, key: Callable[..., Any], hf: dict, window: Any) -> dict:
    """The Hugging Face config keys of a Gemma 2 / 3 file that llama.cpp leaves implicit
    (its loader's rules for these architectures: ``llama-model.cpp``)."""
    layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    head_dim = hf["head_dim"] or 256
    # The 27B models (46 and 62 layers) scale queries by hidden / heads, others by head_dim.
    big = layers == (46 if arch == "gemma2" else 62)
    out = {
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": hf["hidden_size"] // heads if big else head_dim,
        "final_logit_softcapping": key("final_logit_softcapping", None, "float"),
    }
    if arch == "gemma2":  # sliding and global layers alternate, sliding first
        out["attn_logit_softcapping"] = key("attn_logit_softcapping", None, "float")
        return out
    # Gemma 3: five sliding layers per global one, sliding RoPE base 10,000 (fixed), the
    # file's rope.freq_base and linear scaling for the global layers
    out["rope_theta"] = key("rope.freq_base", 1_000_000.0, "float")
    out["rope_local_base_freq"] = 10000.0
    if window:
        out["sliding_window_pattern"] = 6
    else:
        out["layer_types"] = ["full_attention"] * layers
    if key("rope.scaling.type", None, "str") == "linear":
        out["rope_scaling"] = {
            "rope_type": "linear",
            "factor": key("rope.scaling.factor", kind="float"),
        }
    return out


def gguf_chat_template(path_or_reader: Any) -> str | None:
    """The chat template (a Jinja string) in a GGUF file's metadata, or None."""
    reader = path_or_reader
    if isinstance(path_or_reader, (str, os.PathLike)):
        reader = _open(path_or_reader)
    return _field(reader, "tokenizer.chat_template", "<gguf>", None, "str")


# ---------------------------------------------------------------------------- internals
def _open(path: str | os.PathLike) -> Any:
    import gguf

    class Reader(gguf.GGUFReader):
        """``gguf.GGUFReader`` over a plain ndarray view of its memory map: the reader
        slices the file once per metadata element (98k for SmolLM2's vocabulary and
        merges), and a ``np.memmap`` slice costs several times a plain one (reading
        SmolLM2's file: 4.0 s -> 1.4 s). Same bytes, no copy: the view keeps the map open."""

        @property
        def data(self):
            return self._plain

        def _get_field_parts(self, orig_offs, raw_type):
            # The reader keeps a few arrays per entry of a metadata array (~300 bytes
            # each): refuse a declared length beyond what any vocabulary needs first.
            if raw_type == gguf.GGUFValueType.ARRAY:
                n = int(self._get(orig_offs + 4, np.uint64)[0])
                if n > MAX_METADATA_ARRAY:
                    raise ValueError(
                        f"a metadata array of {n:,} entries (at most {MAX_METADATA_ARRAY:,})"
                    )
                parts = self._array_parts(orig_offs, n)
                if parts is not None:
                    return parts
            return super()._get_field_parts(orig_offs, raw_type)

        def _array_parts(self, orig_offs: int, n: int):
            """``_get_field_parts`` of a non-empty array of scalars or strings in a
            little-endian file, without the reader's numpy views per entry (2 per
            string, each a few microseconds: 2.6 s of a SmolLM2 load went to its 98k
            vocabulary pieces and merges). Scalars: one array of all ``n`` values as the
            only data part (``contents()`` gives the same list). Strings: each entry's
            length and bytes as ``memoryview`` slices of the file (``contents()`` reads
            them with ``tobytes()``). None for other arrays (the reader's own way)."""
            scalars = getattr(self, "gguf_scalar_to_np", None)  # (the reader's internals)
            if getattr(self, "byte_order", None) != "I" or sys.byteorder != "little":
                return None
            if scalars is None or n == 0:
                return None
            T = gguf.GGUFValueType
            head = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
            itype = T(int(head[0][0]))
            offs = orig_offs + 12
            size = len(self._plain)
            nptype = scalars.get(itype)
            if nptype is not None:
                end = offs + n * np.dtype(nptype).itemsize
                if end > size:
                    raise ValueError(f"a metadata array of {n:,} entries runs past the file")
                return end - orig_offs, [*head, self._get(offs, nptype, n)], [2], [T.ARRAY, itype]
            if itype != T.STRING:
                return None
            buf = memoryview(self._plain).cast("B")
            parts, data = head, []
            for _ in range(n):
                end = offs + 8 + int.from_bytes(buf[offs : offs + 8], "little")
                if end > size:
                    raise ValueError("a metadata string runs past the file")
                parts += (buf[offs : offs + 8], buf[offs + 8 : end])
                data.append(len(parts) - 1)
                offs = end
            return offs - orig_offs, parts, data, [T.ARRAY, T.STRING]

        @data.setter
        def data(self, value):
            self._map = getattr(value, "_mmap", None)
            self._plain = value.view(np.ndarray) if isinstance(value, np.memmap) else value

        def release(self, t) -> None:
            """Drops tensor ``t``'s pages of the map from this process's memory once it
            is read (``madvise(MADV_DONTNEED)``; the file's pages stay in the page
            cache, and a page shared with the next tensor is read again from there):
            a load then never holds the whole file besides the weights made of it.
            Nothing where the platform has no ``madvise``."""
            advise = getattr(self._map, "madvise", None)
            flag = getattr(mmap, "MADV_DONTNEED", None)
            if advise is None or flag is None:
                return
            start = t.data_offset - t.data_offset % mmap.PAGESIZE
            try:
                advise(flag, start, t.data_offset + t.n_bytes - start)
            except (OSError, ValueError):
                pass

    p = pathlib.Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such GGUF file")
    try:
        return Reader(p)
    except Exception as e:  # the reader raises ValueError / struct errors on bad bytes
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise GGUFError(f"{p}: not a readable GGUF file ({first})") from None


def _hf_tensor_name(name: str, arch: str, path: Any) -> str | None:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    if name in _IGNORED:
        return None
    layer = _GEMMA_LAYER_TENSORS if arch in _GEMMA else _LAYER_TENSORS
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer:
        return f"model.layers.{parts[1]}.{layer[parts[2]]}.{parts[3]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _EXPERT_TENSORS:
        return f"model.layers.{parts[1]}.mlp.experts"  # (split by _split_experts)
    raise GGUFError(f"{path}: tensor {name!r} is not a tensor of a Llama-family model")


def _split_experts(t: Any, stack: np.ndarray, name: str, arch: str, tensors: dict) -> None:
    """A layer's experts' weights ``stack [X, out, in]`` (GGUF tensor ``t``, named ``name``
    = ``model.layers.N.mlp.experts``) into ``tensors`` as one Hugging Face tensor an
    expert (``...experts.E.gate_proj.weight``, in ``arch``'s naming)."""
    part = _EXPERT_TENSORS[t.name.split(".")[2]]
    for e, w in enumerate(stack):
        tensors[_family_name(f"{name}.{e}.{part}.weight", arch)] = np.ascontiguousarray(w)


def _split_kept_experts(t: Any, qtype: str, name: str, arch: str, blocks: dict) -> None:
    """``_split_experts`` for a layer's experts kept as stored: each expert's rows of the
    GGUF tensor's blocks into ``blocks``, as ``gguf_blocks.Nibbles`` (Q8_0: as int8
    groups, ``(q, d)``)."""
    part = _EXPERT_TENSORS[t.name.split(".")[2]]
    raw = np.asarray(t.data, np.uint8)
    experts, out = raw.shape[0], raw.shape[1]
    flat = types.SimpleNamespace(data=raw.reshape(experts * out, -1))
    if qtype == "Q8_0":  # int8 groups of 32: (q [out, in], d [out, in / 32]) an expert
        q, d = _EIGHT_BIT_BLOCKS["Q8_0"](flat)
        for e in range(experts):
            rows_of = slice(e * out, (e + 1) * out)
            key = _family_name(f"{name}.{e}.{part}.weight", arch)
            blocks[key] = (np.ascontiguousarray(q[rows_of]), np.ascontiguousarray(d[rows_of]))
        return
    rows = nibble_blocks(flat, qtype)
    fields = ("q", "d", "m", "high")
    for e in range(experts):
        one = {
            f: np.ascontiguousarray(getattr(rows, f)[e * out : (e + 1) * out])
            for f in fields
            if getattr(rows, f) is not None
        }
        blocks[_family_name(f"{name}.{e}.{part}.weight", arch)] = dataclasses.replace(rows, **one)


def _unpermute(w: np.ndarray, heads: int, name: str, path: Any) -> np.ndarray:
    """Undoes llama.cpp's per-head row order of ``attn_q`` / ``attn_k`` (weights
    ``[heads * D, in]`` or biases ``[heads * D]``)."""
    rows = w.shape[0]
    if rows % (2 * heads):
        raise GGUFError(f"{path}: tensor {name!r} has {rows} rows, not a multiple of 2 x {heads}")
    half = rows // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
