"""Names to models: ``load("tiny-llama")``, ``load("smollm2-135m-instruct")``,
``load("/path/to/checkpoint")``, ``load("/path/to/model.gguf")``.

The engine (``paged_jax.LLM``) takes a model object and never imports this layer; the
CLI and user code turn a name into ``(model, tokenizer)`` here and hand both to it::

    model, tokenizer = paged_jax.models.load("tiny-llama")
    llm = paged_jax.LLM(model, tokenizer)
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
from typing import Any

from .config import PRESETS
from .gguf_loader import load_gguf
from .hf import load_hf
from .llama import init_model
from .quantization import check_format
from .registry import ALIASES, fetch
from .tokenizer import ByteTokenizer

log = logging.getLogger("paged_jax")


def load(
    name: str | os.PathLike,
    *,
    dtype: Any = None,
    seed: int = 0,
    mesh: Any = None,
    quantization: str | None = None,
    dequantize: bool = False,
) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for a preset, a named real model, a Hugging Face checkpoint
    directory or a GGUF file.

    Args:
      name: a key of ``PRESETS`` (``"tiny-llama"``: random weights, byte tokenizer); a
        key of ``ALIASES`` (``"smollm2-135m-instruct"``: a real instruction-tuned model,
        downloaded once into the cache directory, see ``paged_jax.models.registry``); a
        directory with ``config.json`` and safetensors weights (``load_hf``); or a
        ``.gguf`` file (``load_gguf``).
      dtype: compute and weight dtype (default: a checkpoint's as stored, except that
        16-bit checkpoints run in float32 on a CPU without native bf16, with a one-line
        note: ``cpu_compute_dtype``; float32 for GGUF files and presets).
      seed: initialisation seed of a preset's random weights.
      mesh: a ``jax.sharding.Mesh`` with a ``"tp"`` axis
        (``paged_jax.tensor_parallel_mesh(n)``): every weight is placed straight into
        its tensor-parallel shards, never whole on one device; pass the same mesh to
        ``LLM``. None: one device.
      quantization: ``"int8"`` quantizes the float weights as they load (on the CPU a
        scale per output channel and group of 32 inputs, elsewhere per output channel:
        ``models.quantization``; on CPU the C kernel quantizes the activations too,
        W8A8): the linear weights and the embedding table take about a quarter of f32's
        memory; ``"int4"``: 4-bit groups of 32 inputs with a scale and a minimum each
        (0.75 bytes a weight, under a fifth of f32's). None: as stored: a GGUF file's
        quantized tensors keep their blocks (``load_gguf``: about the file's bytes),
        which ``"int4"`` keeps too; with ``"int8"`` its 5- to 8-bit ones become int8
        groups. With a ``mesh`` the float weights are placed
        in their shards first, then quantized and placed again (per output channel on
        accelerators; a GGUF file's blocks are not kept): the products are XLA's,
        weight-only (W8A16).
      dequantize: a GGUF file's tensors widened to float32 (``load_gguf``'s
        ``dequantize``) rather than kept; only with ``quantization`` None.

    Returns ``(model, tokenizer)``; the tokenizer is None for a checkpoint without
    ``tokenizer.json`` or a GGUF file without tokenizer metadata. Raises ``TypeError``
    for a name that is not a string or path, ``FileNotFoundError`` for a name that is
    none of the above, ``registry.FetchError`` when a named model cannot be downloaded,
    and what ``load_hf`` / ``load_gguf`` raise for a broken file.
    """
    if not isinstance(name, (str, os.PathLike)):
        raise TypeError(f"name: expected a preset name or a directory, got {type(name).__name__}")
    check_format(quantization)
    # With a mesh the loaders place float weights (a GGUF file's blocks, kept, have no
    # split layout); the whole model is quantized after and placed in its shards again
    model, tokenizer = _load(
        name, dtype, seed, mesh, quantization if mesh is None else None, dequantize
    )
    if quantization is not None:
        model.quantize(quantization)
        if mesh is not None:
            model.shard(mesh)
    return model, tokenizer


def _load(name, dtype, seed, mesh, quantization=None, dequantize=False) -> tuple[Any, Any]:
    if dequantize and isinstance(name, str) and name in PRESETS:
        raise ValueError(f"dequantize: only for a GGUF file, not the preset {name!r}")
    if isinstance(name, str) and name in PRESETS:
        kw = {} if dtype is None else {"dtype": dtype, "param_dtype": dtype}
        return init_model(PRESETS[name], seed=seed, mesh=mesh, **kw), ByteTokenizer()
    if isinstance(name, str) and name in ALIASES:
        path = fetch(name)
    else:
        path = pathlib.Path(name)
    if path.is_file() and _is_gguf(path):
        kw = dict(dtype=dtype, mesh=mesh, quantization=quantization, dequantize=dequantize)
        return load_gguf(path, **kw)
    if dequantize:
        raise ValueError(f"dequantize: only for a GGUF file, not {name!r}")
    if not path.is_dir():
        raise FileNotFoundError(
            f"{name}: neither a preset ({', '.join(sorted(PRESETS))}), a named model "
            f"({', '.join(sorted(ALIASES))}), a checkpoint directory nor a .gguf file"
        )
    return load_hf(path, dtype=dtype if dtype is not None else cpu_compute_dtype(path), mesh=mesh)


def _is_gguf(path: pathlib.Path) -> bool:
    """A ``.gguf`` name, or a file that starts with GGUF's magic bytes."""
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def cpu_compute_dtype(checkpoint: str | os.PathLike) -> Any:
    """float32 for a bf16/f16 checkpoint on a CPU without native bf16 math, else None.

    XLA:CPU runs 16-bit math by converting to f32 around every op, which measured 5x
    slower than f32 on this project's AVX2 machine; CPUs with AVX512-BF16 or AMX keep
    the stored dtype. Says so in one line (the "paged_jax" logger, WARNING).
    """
    import jax
    import jax.numpy as jnp

    if jax.default_backend() != "cpu":
        return None
    try:
        with open(os.path.join(checkpoint, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        stored = str(cfg.get("torch_dtype") or cfg.get("dtype") or "")
    except (OSError, ValueError, AttributeError):
        return None  # the loader reports a broken config itself
    if stored not in ("bfloat16", "float16") or _cpu_has_native_bf16():
        return None
    log.warning(
        "%s: %s weights computed in float32 (this CPU has no native bf16, which runs "
        "several times slower); pass dtype=%r to keep them as stored",
        checkpoint,
        stored,
        stored,
    )
    return jnp.float32


def _cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
