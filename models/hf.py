"""Loads a local Hugging Face checkpoint directory into ``LlamaForCausalLM`` without torch.

Reads ``config.json``, the safetensors weights (one file, or shards listed in
``model.safetensors.index.json``) through safetensors' numpy loader (bf16 included, as
``ml_dtypes.bfloat16``), and
``tokenizer.json`` when present (the ``tokenizers`` package).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax import linear
from paged_jax.sharding import tensor_parallel_size

from . import compressed
from . import gpt_oss as gpt_oss_tensors
from .config import LlamaConfig
from .gguf_blocks import common_group, common_layout, int8_groups, kept_layout
from .host_memory import _gather, release_freed_memory
from .llama import FUSED, LlamaForCausalLM
from .sharding import pad_vocab, place, sharder
from .tokenizer import TextTokenizer

# Tensors some checkpoints carry that the model recomputes.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def _hf_name(path: tuple) -> tuple[str, bool]:
    """Our parameter path -> (HF tensor name, whether HF stores it transposed)."""
    parts = [str(p) for p in path]
    if parts == ["embed_tokens", "embedding"]:
        return "model.embed_tokens.weight", False
    if parts == ["lm_head", "kernel"]:
        return "lm_head.weight", True
    *mod, leaf = parts
    mod = ["mlp" if m == "dense_mlp" else m for m in mod]  # a mixture's dense layers' MLP
    name = ".".join(["model", *mod])
    if leaf == "kernel":
        return f"{name}.weight", True
    return f"{name}.{leaf}", False  # norm weights, biases


# A mixture's expert weights: our [L, X, in, out] stacks, one HF tensor [out, in] per
# layer and expert (``_expert_names``).
_EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")
# Mixtral's names for the sparse block and its experts' projections (Qwen's are ours).
_MIXTRAL = (
    (".mlp.gate.", ".block_sparse_moe.gate."),
    (".mlp.experts.", ".block_sparse_moe.experts."),
)
_MIXTRAL_EXPERT = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")


def _is_expert_weight(path: tuple) -> bool:
    parts = [str(x) for x in path]
    return len(parts) >= 3 and parts[-2] == "experts" and parts[-1] in _EXPERT_WEIGHTS


def _family_name(name: str, arch: str) -> str:
    """An HF tensor name as ``_hf_name`` gives it (Llama's and Qwen's), in ``arch``'s own
    naming (Mixtral's sparse block)."""
    if arch != "MixtralForCausalLM":
        return name
    for ours, theirs in _MIXTRAL:
        name = name.replace(ours, theirs)
    for ours, theirs in _MIXTRAL_EXPERT.items():
        name = name.replace(f".{ours}.weight", f".{theirs}.weight") if ".experts." in name else name
    return name


def _expert_names(path: tuple, layers: int, experts: int, arch: str) -> list[tuple[str, bool]]:
    """The HF tensors of expert weight ``path`` (``("layers", "mlp", "experts",
    "gate_proj")``), layer by layer and expert by expert, each stored ``[out, in]``."""
    *mod, leaf = (str(x) for x in path[1:])
    return [
        (_family_name(".".join(["model.layers", str(i), *mod, str(e), leaf, "weight"]), arch), True)
        for i in range(layers)
        for e in range(experts)
    ]


def _placeholder(path: tuple, layer: int, cfg: LlamaConfig) -> bool:
    """Whether layer ``layer``'s part of parameter ``path`` is a placeholder of zeros: a
    mixture's dense layer's sparse block, or a sparse layer's dense MLP
    (``LlamaConfig.dense_layers``: every layer holds both)."""
    if not cfg.dense_layers or str(path[0]) != "layers":
        return False
    parts = [str(x) for x in path]
    if "dense_mlp" in parts:
        return layer not in cfg.dense_layers
    return "mlp" in parts and layer in cfg.dense_layers


def _add_placeholders(tensors: dict, p: tuple, names: list, per_layer: int, want: tuple, cfg):
    """Zeros under the names (``[(name, transposed)]``, ``per_layer`` a layer) of the
    layers whose part of ``p`` is a placeholder (``_placeholder``), each of shape
    ``want`` as stored."""
    for k, (name, transposed) in enumerate(names):
        if _placeholder(p, k // per_layer, cfg) and name not in tensors:
            tensors[name] = np.zeros(want[::-1] if transposed else want, np.float32)


def _weight_files(root: pathlib.Path) -> list[pathlib.Path]:
    index = root / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index}: no valid weight_map ({_first_line(e)})") from None
        files = [root / s for s in shards]
    elif (root / "model.safetensors").exists():
        files = [root / "model.safetensors"]
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{root}: no model.safetensors, model.safetensors.index.json or *.safetensors "
            "(PyTorch .bin checkpoints are not supported: convert them to safetensors)"
        )
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise FileNotFoundError(f"{root}: weight shards listed in the index are missing: {missing}")
    return files


def load_tokenizer(path: str | pathlib.Path) -> TextTokenizer | None:
    """The tokenizer of a checkpoint directory (``tokenizer.json``, with the chat template
    and special tokens of ``tokenizer_config.json`` or ``chat_template.jinja``), or None
    without tokenizer.json."""
    root = pathlib.Path(path)
    file = root / "tokenizer.json"
    if not file.exists():
        return None
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises plain Exceptions for any parse failure
        raise ValueError(f"{file}: not a valid tokenizer.json ({_first_line(e)})") from None
    config, template = {}, None
    cfg_file = root / "tokenizer_config.json"
    if cfg_file.exists():
        config = compressed.read_json_object(cfg_file)
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
    jinja = root / "chat_template.jinja"
    if jinja.exists():
        template = jinja.read_text(encoding="utf-8")
    special = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            special[key] = value
    return TextTokenizer(
        tok, chat_template=template if isinstance(template, str) else None, special_tokens=special
    )


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def load_hf(
    path: str | pathlib.Path,
    *,
    dtype: Any = None,
    param_dtype: Any = None,
    mesh: Any = None,
) -> tuple[LlamaForCausalLM, Any | None]:
    """Loads a local Hugging Face checkpoint of an architecture ``LlamaConfig`` supports
    (Llama, Qwen2, Qwen3, Mistral, Gemma 2 and 3, Mixtral, Qwen2-MoE, Qwen3-MoE, GPT-OSS).

    Args:
      path: directory with ``config.json`` and safetensors weights.
      dtype: compute dtype (default: the weights' dtype as stored, f32 if mixed).
      param_dtype: dtype to store the weights in (default: ``dtype``); e.g. load a bf16
        checkpoint with ``dtype=jnp.float32`` for f32 parity tests.
      mesh: a ``jax.sharding.Mesh`` with a ``"tp"`` axis: each weight goes straight into
        its tensor-parallel shards (``paged_jax.models.sharding``); None: one device.

    A ``quantization_config`` of compressed-tensors' 8-bit weights (the public FP8 and
    INT8 checkpoints) keeps each quantized linear weight in ``models.quantization``'s
    ``fp8`` or ``int8`` format as stored (``models.compressed``); other schemes are
    refused, naming what the config says. GPT-OSS's MXFP4 experts are dequantized
    (``models.gpt_oss``) to ``param_dtype``.

    Returns ``(model, tokenizer)``; the tokenizer is None without ``tokenizer.json``.
    Raises FileNotFoundError, ValueError (unsupported architecture, missing or
    mis-shaped tensors) with the file or tensor named.
    """
    from safetensors.numpy import load_file

    root = pathlib.Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: not a checkpoint directory")
    cfg_file = root / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{cfg_file}: missing (every Hugging Face checkpoint has one)")
    try:
        raw = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{cfg_file}: {_first_line(e)}") from None
    _check_layers(raw, root)  # before the config builds anything per declared layer
    try:
        cfg = LlamaConfig.from_hf(raw)
    except ValueError as e:
        raise ValueError(f"{cfg_file}: {_first_line(e)}") from None
    gpt_oss = cfg.architecture == "GptOssForCausalLM"
    mxfp4 = gpt_oss and (raw.get("quantization_config") or {}).get("quant_method") == "mxfp4"
    sch = compressed.scheme(raw, str(cfg_file)) if isinstance(raw, dict) and not mxfp4 else None
    # (numpy's safetensors loader has no float8: a quantized checkpoint's files are read
    # by compressed.read_safetensors)
    read = load_file if sch is None else compressed.read_safetensors
    tensors: dict[str, Any] = {}
    for f in _weight_files(root):
        try:
            tensors.update(read(str(f)))
        except Exception as e:  # safetensors' own error type, or OSError / ValueError
            raise ValueError(f"{f}: not a readable safetensors file ({_first_line(e)})") from None
    quantized8 = None
    if sch is not None:
        quantized8 = (sch.fmt, compressed.take_quantized(tensors, sch, str(root)))
    if gpt_oss:  # its experts as one tensor a projection: as the other mixtures' per expert
        gpt_oss_tensors.to_canonical(tensors, cfg.num_layers, cfg.num_experts, str(root))
    model = build_model(
        cfg,
        tensors,
        source=str(root),
        dtype=dtype,
        param_dtype=param_dtype,
        mesh=mesh,
        quantized8=quantized8,
    )
    return model, load_tokenizer(root)


def _check_layers(raw: Any, root: pathlib.Path) -> None:
    """``num_hidden_layers`` (of ``text_config`` for a multimodal config) equals the layers
    the safetensors files hold (``...layers.N....``), read from their headers."""
    from safetensors import safe_open

    hf = raw.get("text_config", raw) if isinstance(raw, dict) else raw
    declared = hf.get("num_hidden_layers") if isinstance(hf, dict) else None
    if not isinstance(declared, int) or isinstance(declared, bool):
        return  # the config's own check names it
    present = set()
    for f in _weight_files(root):
        try:
            with safe_open(str(f), "numpy") as st:
                names = list(st.keys())
        except Exception as e:  # safetensors' own error type, or OSError / ValueError
            raise ValueError(f"{f}: not a readable safetensors file ({_first_line(e)})") from None
        for name in names:
            m = _LAYER_INDEX.search(name)
            if m:
                present.add(int(m.group(1)))
    if len(present) != declared or (present and (min(present), max(present)) != (0, declared - 1)):
        held = f"layers {min(present)}-{max(present)}" if present else "no layer"
        raise ValueError(
            f"{root / 'config.json'}: num_hidden_layers: says {declared} layers, the "
            f"weights hold {held} ({len(present)} of them)"
        )


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def build_model(
    cfg: LlamaConfig,
    tensors: dict[str, np.ndarray],
    *,
    source: str,
    dtype: Any = None,
    param_dtype: Any = None,
    mesh: Any = None,
    int4_blocks: dict[str, tuple[np.ndarray, ...]] | None = None,
    quantized8: tuple[str, dict[str, tuple[np.ndarray, ...]]] | None = None,
    rotated8: frozenset[str] = frozenset(),
    float_rows: bool = False,
) -> LlamaForCausalLM:
    """A ``LlamaForCausalLM`` from numpy tensors under Hugging Face names and layouts
    (``[out, in]`` linear weights, one tensor per layer), as ``load_hf`` and ``load_gguf``
    read them.

    ``int4_blocks``: tensors given as 4-bit groups of 32 along ``in``, ``(q uint8 [out,
    in / 2], d f32 [out, in / 32], m f32 [out, in / 32])`` for weights ``d * q + m``
    (``q``'s byte j holds the values of inputs 2j, low nibble, and 2j + 1; ``load_gguf``'s
    Q4 blocks): a linear weight or embedding table all of whose
    tensors come so is held in ``models.quantization``'s int4 format as it is; one only
    some layers of which do (a file mixing block formats) is dequantized.

    ``quantized8``: ``(fmt, {name: (q [out, in], scale f32 [out] or [out, in / G])})``,
    8-bit weights ``q * scale`` (``"fp8"`` or ``"int8"``, ``compressed.take_quantized``;
    int8 with a scale per group of G inputs: ``load_gguf``'s Q8_0 blocks, an embedding
    table's too), held the same way in that format; with a mesh, or for a weight only
    some layers of which come so, dequantized. An int8 entry with groups may carry a
    third array, ``m f32 [out, in / G]``, each group's minimum: weights ``q * scale + m``
    (``load_gguf``'s Q5_1 and Q5_K blocks, ``q`` in [0, 31]). ``rotated8``: the names
    among them whose int8 weights are rotated along ``in`` (``Linear.rotated``,
    ``paged_jax.linear.rotate``; every layer of a weight or none), rotated
    back where dequantized. ``float_rows``: the modules holding ``int4_blocks`` or int8
    groups multiply float rows by their dequantized panels on the CPU (``Linear.
    float_rows``: a GGUF file's blocks kept by default, computed as their float weights).

    ``dtype`` defaults to the tensors' dtype (f32 if mixed), ``param_dtype`` to ``dtype``.
    ``mesh``: place each weight in its tensor-parallel shards (``sharding.sharder``).
    The dicts given (``tensors``, ``int4_blocks``, ``quantized8``'s) are emptied as the
    model takes their arrays, each dropped once copied into its parameter, so the load
    does not hold every weight twice.

    Raises ValueError naming ``source`` and the tensor for a missing, mis-shaped or
    unexpected tensor.
    """
    stored = {jnp.dtype(t.dtype) for t in tensors.values()}
    dtype = (
        jnp.dtype(dtype)
        if dtype is not None
        else (stored.pop() if len(stored) == 1 else jnp.dtype(jnp.float32))
    )
    param_dtype = jnp.dtype(param_dtype) if param_dtype is not None else dtype

    abstract = nnx.eval_shape(
        lambda: LlamaForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype)
    )
    graphdef, abstract_state = nnx.split(abstract)
    b = _Builder(cfg, tensors, source, param_dtype, mesh, int4_blocks, quantized8, rotated8)
    b.float_rows = float_rows
    arch = cfg.architecture
    for p, var in nnx.to_flat_state(abstract_state):
        expected = tuple(var.get_value().shape)
        if _is_expert_weight(p):  # [L, X, in, out]: one tensor per layer and expert
            names = _expert_names(p, cfg.num_layers, cfg.num_experts, arch)
            _add_placeholders(tensors, p, names, cfg.num_experts, expected[2:], cfg)
            b.filled.append((p, var.replace(b.experts(p, names, expected))))
            continue
        stacked = str(p[0]) == "layers"  # [L, ...]: one tensor per layer in the checkpoint
        if stacked:
            names = [_hf_name(("layers", i, *p[1:])) for i in range(cfg.num_layers)]
        else:
            names = [_hf_name(p)]
        names = [(_family_name(n, arch), t) for n, t in names]
        want = expected[1:] if stacked else expected
        _add_placeholders(tensors, p, names, 1, want, cfg)
        for take in (b.kept_int4, b.kept_int8, b.mixed_groups, b.floats):
            value = take(p, names, want, stacked)
            if value is not None:
                b.filled.append((p, var.replace(value)))
                break
    b.check_unused()
    return b.attach(nnx.merge(graphdef, nnx.from_flat_state(b.filled)))


class _Builder:
    """``build_model``'s work on the checkpoint's tensors, one parameter at a time: each
    of ``kept_int4``, ``kept_int8``, ``mixed_groups`` and ``floats`` returns the
    parameter's value (``[L, ...]`` for the layers' stacks) where the tensors fit its way,
    else None; the quantized ones' scales and minimums wait for the merged model
    (``attach``)."""

    def __init__(self, cfg, tensors, source, param_dtype, mesh, int4_blocks, quantized8, rotated8):
        self.cfg, self.tensors, self.source = cfg, tensors, source
        self.param_dtype, self.mesh = param_dtype, mesh
        self.sharding = None if mesh is None else sharder(cfg, mesh)
        self.blocks = int4_blocks if int4_blocks is not None else {}
        self.fmt8, self.eight = quantized8 if quantized8 is not None else (None, {})
        self.rotated8 = rotated8
        self.filled, self.used = [], set()
        self.int4 = {}  # module path: (scale, zero), set after the merge
        self.held8 = {}  # module path: [scale] or [scale, minimums], set after the merge
        self.rot8 = set()  # module paths of held8's whose weights are rotated
        self.mixed = {}  # module path: [scale, minimums] of int8 groups made of mixed formats
        self.common = set()  # kept experts' tensors already in their pair's layout
        self.kept_experts = {}  # Experts path: {"gate": (scale, zero, high, bits, offset), ...}

    def kept_int4(self, p, names, want, stacked):
        """A weight every layer of which came as ``Nibbles`` (a GGUF file's blocks): held
        so, in one layout (``gguf_blocks.common_layout``). An embedding table takes 4-bit
        values only, with minimums (an offset becomes them); one with high bits goes to
        int8 groups (``kept_int8``)."""
        blocks, source = self.blocks, self.source
        if not (names[0][0] in blocks and all(n in blocks for n, _ in names)) or self.mesh:
            return None
        table = not names[0][1]
        if table and any(blocks[n].bits for n, _ in names):  # as int8 groups
            for n, _ in names:
                self.eight[n] = blocks.pop(n).as_int8()
            self.fmt8 = self.fmt8 or "int8"
            return None
        parts = common_layout([blocks[n] for n, _ in names], f"{source}: tensors {names[0][0]!r}")
        if table and parts[0].m is None:  # an offset as minimums: -offset * d
            parts = [dataclasses.replace(b, m=-b.offset * b.d, offset=0) for b in parts]
        for (n, _), b in zip(names, parts, strict=True):
            blocks[n] = b
        first = parts[0]
        del parts
        self.used.update(n for n, _ in names)
        held = _gather(
            names,
            lambda n, t, want=want: kept_layout(blocks.pop(n), t, want, source, n),
            stacked,
        )
        scale = held[1]
        zero = held[2] if first.m is not None else None
        high = held[-1] if first.bits else None
        self.int4[p[:-1]] = (scale, zero, high, first.bits, first.offset)
        return jax.device_put(held[0])

    def kept_int8(self, p, names, want, stacked):
        """A weight every layer of which came as 8-bit values with the same scales' shape
        (and minimums in every layer or none): held so."""
        eight = self.eight
        if not (
            names[0][0] in eight
            # linear kernels, or a table whose scales are per group of E
            and all(n in eight and (t or eight[n][1].ndim == 2) for n, t in names)
            # the same scales' shape every layer, and minimums in every layer or none
            # (a file may mix Q8_0's groups, Q6_K's, Q5_1's with minimums and
            # quantize_int8's per channel across layers: those take the next way)
            and len({(eight[n][1].shape, len(eight[n])) for n, _ in names}) == 1
            and self.mesh is None
        ):
            return None
        for n, t in names:
            if tuple(eight[n][0].shape[:: -1 if t else 1]) != tuple(want):
                raise ValueError(
                    f"{self.source}: tensor {n!r} has shape {tuple(eight[n][0].shape)}, "
                    f"expected {tuple(want)[:: -1 if t else 1]}"
                )
        self.used.update(n for n, _ in names)

        def take8(n, t):  # [out, in] -> [in, out]; scales [out] or [out, in / G] likewise
            parts = eight.pop(n)  # (q, scale) or (q, scale, m)
            return tuple(a.T for a in parts) if t else parts

        if names[0][0] in self.rotated8:  # (every layer of a weight or none: load_gguf)
            self.rot8.add(p[:-1])
        kernel, *self.held8[p[:-1]] = _gather(names, take8, stacked)
        return jax.device_put(kernel)

    def mixed_groups(self, p, names, want, stacked):
        """The layers' weights kept in different ways (a Q4_K_M file's ffn_down in Q4_K and
        Q6_K, a Q5_K_M file's attn_v in Q5_1 and Q8_0): all as int8 groups (with minimums
        where any layer has them), the finest groups of them, exactly the same weights."""
        blocks, eight = self.blocks, self.eight
        if not (
            stacked
            and self.mesh is None
            and self.fmt8 != "fp8"
            and all(n in blocks or n in eight for n, _ in names)
        ):
            return None
        group = common_group(names, blocks, eight, want, self.source)
        with_mins = any(
            blocks[n].m is not None if n in blocks else len(eight[n]) == 3 for n, _ in names
        )
        self.used.update(n for n, _ in names)

        def take_mixed(n, t):
            parts = blocks.pop(n) if n in blocks else eight.pop(n)
            parts = int8_groups(parts, group, with_mins)
            return tuple(a.T for a in parts) if t else parts

        kernel, *self.mixed[p[:-1]] = _gather(names, take_mixed, stacked)
        release_freed_memory()
        return jax.device_put(kernel)

    def floats(self, p, names, want, stacked, shard=True):
        """A parameter in float: the checkpoint's tensors (kept blocks with a mesh, or
        beside float layers, dequantized), checked, stacked, cast and placed (on one
        device with ``shard=False``)."""
        tensors, source = self.tensors, self.source
        for n, _ in names:
            self._dequantize_kept(n)
        for name, transposed in names:
            if name not in tensors:
                raise ValueError(f"{source}: tensor {name!r} is missing from the checkpoint")
            got = tuple(tensors[name].shape)
            if got[:: -1 if transposed else 1] != want:
                want = want[::-1] if transposed else want
                raise ValueError(f"{source}: tensor {name!r} has shape {got}, expected {want}")
        self.used.update(n for n, _ in names)
        # Transposes, stacking and casts in numpy, then one transfer per parameter (eager
        # jnp ops here compiled one small program per shape: 3.6 s of SmolLM2's load);
        # each layer's tensor dropped once copied into the stack.
        (host,) = _gather(
            names,
            lambda n, t: ((tensors.pop(n).T if t else tensors.pop(n)),),
            stacked,
            dtype=self.param_dtype,
        )
        if self.sharding is None or not shard:
            value = jax.device_put(host)
        else:
            host = pad_vocab(p, host, tensor_parallel_size(self.mesh))
            value = place(host, self.sharding(p, host.ndim))
        release_freed_memory()  # the per-layer tensors just copied and dropped
        return value

    def experts(self, p, names, expected: tuple):
        """A mixture's expert weight ``[L, X, in, out]`` from one float tensor per layer
        and expert (``names``, in that order), checked, stacked, cast and placed. Raises
        ValueError naming a missing or mis-shaped tensor: a checkpoint holding fewer
        experts than the config's ``num_experts`` names the first one missing."""
        self._check_expert_count(expected[1])
        kept = self._kept_experts(p, names, expected)
        if kept is not None:
            return kept
        for n, _ in names:
            self._dequantize_kept(n)
        flat = self.floats(("experts",), names, expected[2:], True, shard=False)
        value = flat.reshape(expected)
        if self.sharding is not None:  # (each device its slice of every expert)
            value = jax.device_put(value, self.sharding(p, value.ndim))
        return value

    def _kept_experts(self, p, names, expected: tuple):
        """A mixture's expert weight ``[L, X, in / 2, out]`` every layer and expert of which
        came as ``Nibbles`` (a GGUF file's blocks kept), in one layout with its partner
        (gate's and up's are packed side by side, so they share one); its scales,
        minimums and high bits wait for ``attach``. None where some tensor came otherwise
        (float, a dense layer's placeholder), or on a mesh."""
        blocks, leaf = self.blocks, str(p[-1])
        if self.mesh is None and all(n in self.eight for n, _ in names):  # Q8_0's int8 groups
            self.used.update(n for n, _ in names)
            q, scale = _gather(names, lambda n, t: tuple(a.T for a in self.eight.pop(n)), True)
            q, scale = (a.reshape(*expected[:2], *a.shape[1:]) for a in (q, scale))
            self.kept_experts.setdefault(p[:-1], {})[leaf.removesuffix("_proj")] = (scale,)
            return jax.device_put(q)
        if self.mesh is not None or not all(n in blocks for n, _ in names):
            return None
        group = list(names)
        if leaf in ("gate_proj", "up_proj") and names[0][0] not in self.common:
            other = "up_proj" if leaf == "gate_proj" else "gate_proj"
            cfg = self.cfg
            partner = _expert_names(
                (*p[:-1], other), cfg.num_layers, cfg.num_experts, cfg.architecture
            )
            if not all(n in blocks for n, _ in partner):
                return None
            group += partner
        if names[0][0] not in self.common:
            what = f"{self.source}: tensors {names[0][0]!r}..."
            for (n, _), b in zip(
                group, common_layout([blocks[n] for n, _ in group], what), strict=True
            ):
                blocks[n] = b
                self.common.add(n)
        first = blocks[names[0][0]]
        self.used.update(n for n, _ in names)
        source, want = self.source, expected[2:]
        held = _gather(names, lambda n, t: kept_layout(blocks.pop(n), t, want, source, n), True)
        held = [a.reshape(*expected[:2], *a.shape[1:]) for a in held]
        zero = held[2] if first.m is not None else None
        high = held[-1] if first.bits else None
        self.kept_experts.setdefault(p[:-1], {})[leaf.removesuffix("_proj")] = (
            held[1],
            zero,
            high,
            first.bits,
            first.offset,
        )
        return jax.device_put(held[0])

    def _check_expert_count(self, experts: int) -> None:
        """ValueError naming ``num_experts`` where the checkpoint's experts (the distinct
        ``experts.N`` of its tensors' names) are not ``experts`` of them."""
        held = {int(m.group(1)) for n in self.tensors if (m := _EXPERT_INDEX.search(n))}
        if held and held != set(range(experts)):
            raise ValueError(
                f"{self.source}: num_experts: the config says {experts} experts a layer, the "
                f"checkpoint holds experts {min(held)}-{max(held)} ({len(held)} of them)"
            )

    def _dequantize_kept(self, n: str) -> None:
        """Tensor ``n`` in f32 where it came kept (``Nibbles`` or 8-bit groups)."""
        if n in self.blocks:
            self.tensors[n] = self.blocks.pop(n).dequantize()
        if n in self.eight:
            q, scale, *mins = self.eight.pop(n)
            if scale.ndim == 2:  # per group of the last axis
                g = q.shape[-1] // scale.shape[-1]
                self.tensors[n] = q.astype(np.float32) * np.repeat(scale, g, axis=-1)
                if mins:
                    self.tensors[n] += np.repeat(mins[0], g, axis=-1)
            else:
                self.tensors[n] = q.astype(np.float32) * scale[:, None]
            if n in self.rotated8:  # [out, in]: back along in
                self.tensors[n] = linear.rotate(self.tensors[n], 1)

    def check_unused(self) -> None:
        """ValueError naming the checkpoint's tensors no parameter took."""
        extra = sorted(
            n
            for n in [*self.tensors, *self.eight, *self.blocks]
            if n not in self.used and not _IGNORED.match(n)
        )
        if extra:
            raise ValueError(
                f"{self.source}: unexpected tensors for {self.cfg.architecture} (first 5): "
                f"{extra[:5]}"
            )

    def attach(self, model):
        """``model`` with the quantized modules' scales and minimums; returns it."""

        def node(path):
            return functools.reduce(lambda n, part: getattr(n, str(part)), path, model)

        for path, parts in self.kept_experts.items():  # a GGUF file's experts kept
            m = node(path)
            if all(len(v) == 1 for v in parts.values()):  # Q8_0's: int8 groups of 32
                for name, (scale,) in parts.items():
                    setattr(m, f"{name}_scale", nnx.Param(jax.device_put(scale)))
                m.quantized, m.float_rows = "int8", self.float_rows
                continue
            for name, (scale, zero, high, bits, offset) in parts.items():
                setattr(m, f"{name}_scale", nnx.Param(jax.device_put(scale)))
                if zero is not None:
                    setattr(m, f"{name}_zero", nnx.Param(jax.device_put(zero)))
                if high is not None:
                    setattr(m, f"{name}_high", nnx.Param(jax.device_put(high)))
                part = "down" if name == "down" else "gate_up"
                setattr(m, f"{part}_bits", bits)
                setattr(m, f"{part}_offset", offset)
            m.quantized, m.float_rows = "int4", self.float_rows
        for path, (scale, zero, high, bits, offset) in self.int4.items():
            m = node(path)
            m.scale = nnx.Param(jax.device_put(scale))
            if zero is not None:
                m.zero = nnx.Param(jax.device_put(zero))
            if high is not None:
                m.high = nnx.Param(jax.device_put(high))
            m.high_bits, m.offset = bits, offset
            m.quantized = "int4"
            m.float_rows = self.float_rows
        for fmt, held in ((self.fmt8, self.held8), ("int8", self.mixed)):
            for path, (scale, *mins) in held.items():
                m = node(path)
                m.scale = nnx.Param(jax.device_put(scale))
                if mins:  # int8 groups with minimums
                    m.zero = nnx.Param(jax.device_put(mins[0]))
                m.quantized = fmt
                if path in self.rot8:
                    m.rotated = True
                elif fmt == "int8":  # int8 groups (a table's or a kernel's rank)
                    w = m.embedding if hasattr(m, "embedding") else m.kernel
                    m.float_rows = self.float_rows and scale.ndim == w.get_value().ndim
        return model


def _dequantized_experts(
    q: np.ndarray, scale: np.ndarray, zero=None, high=None, offset: int = 0
) -> np.ndarray:
    """int8 experts ``q [L, X, in, out]`` times their scales (``[L, X, in / G, out]`` or
    ``[L, X, out]``), or 4-bit ones (uint8 ``q [L, X, in / 2, out]`` with ``zero``, the
    groups' minimums, or an ``offset``, and perhaps ``high`` bits: a GGUF file's experts
    kept), in f32."""
    if q.dtype == np.uint8:
        from .quantization import dequantize_int4

        return np.asarray(dequantize_int4(q, scale, zero, -2, None, high, offset))
    if scale.ndim == q.ndim:
        scale = np.repeat(scale, q.shape[-2] // scale.shape[-2], axis=-2)
    else:
        scale = scale[..., None, :]
    return q.astype(np.float32) * scale


def to_hf_tensors(model: LlamaForCausalLM) -> dict[str, np.ndarray]:
    """The model's weights under Hugging Face tensor names and layouts (numpy arrays):
    what ``load_hf`` reads back, e.g. to write with ``safetensors.numpy.save_file``.
    Quantized weights come dequantized (their scales and minimums are not tensors of
    their own)."""
    out = {}
    for p, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if str(p[-1]) in ("scale", "zero", "high"):
            node = functools.reduce(lambda n, part: getattr(n, str(part)), p[:-1], model)
            if getattr(node, "quantized", None):
                continue
        value = var.get_value()
        if tuple(map(str, p)) == ("embed_tokens", "embedding"):
            value = model.embed_tokens.table()  # [V, E], however it is held
        elif str(p[-1]) == "kernel":  # [in, out], even if packed (Linear.hold_packed)
            value = functools.reduce(lambda node, part: getattr(node, str(part)), p[:-1], model)
            value = value.weight()
        value = np.asarray(value)
        arch = model.config.architecture
        if (
            len(p) >= 2
            and str(p[-2]) == "experts"
            and str(p[-1]).endswith(("_scale", "_zero", "_high"))
        ):
            continue  # quantized experts' scales and minimums: their weights come dequantized
        if _is_expert_weight(p) and str(p[-1]).endswith("_proj"):
            node = functools.reduce(lambda n, part: getattr(n, str(part)), p[:-1], model)
            if node.quantized:  # quantized experts, dequantized
                part = str(p[-1]).removesuffix("_proj")
                scale = np.asarray(getattr(node, f"{part}_scale").get_value())
                zero, high = (getattr(node, f"{part}_{k}", None) for k in ("zero", "high"))
                offset = node.down_offset if part == "down" else node.gate_up_offset
                value = _dequantized_experts(
                    value,
                    scale,
                    None if zero is None else zero.get_value(),
                    None if high is None else high.get_value(),
                    offset,
                )
        cfg = model.config
        if _is_expert_weight(p):  # [L, X, in, out]: a tensor per layer and expert
            names = _expert_names(p, value.shape[0], value.shape[1], arch)
            for k, ((name, _), v) in enumerate(
                zip(names, value.reshape(-1, *value.shape[2:]), strict=True)
            ):
                if not _placeholder(p, k // value.shape[1], cfg):
                    out[name] = np.ascontiguousarray(v.T)
            continue
        parts = [(p, value)]
        if len(p) >= 2 and str(p[-2]) in FUSED:  # hold_for_accelerator's fused products
            node = functools.reduce(lambda n, part: getattr(n, str(part)), p[:-1], model)
            ends = np.cumsum(node.parts)[:-1]
            names = FUSED[str(p[-2])]
            pieces = np.split(value, ends, axis=-1)
            parts = [((*p[:-2], n, p[-1]), v) for n, v in zip(names, pieces, strict=True)]
        for path, value in parts:
            per_layer = enumerate(value) if str(path[0]) == "layers" else [(None, value)]
            for i, v in per_layer:
                if i is not None and _placeholder(path, i, cfg):
                    continue
                name, transposed = _hf_name(path if i is None else ("layers", i, *path[1:]))
                out[_family_name(name, arch)] = np.ascontiguousarray(v.T if transposed else v)
    if arch == "GptOssForCausalLM":
        gpt_oss_tensors.from_canonical(out, model.config.num_layers, model.config.num_experts)
    return out
