"""Quantized Hugging Face checkpoints: what ``load_hf`` reads from a ``quantization_config``.

Public FP8 and INT8 checkpoints of Llama-family models (those made with llm-compressor,
which vLLM serves) declare ``"quant_method": "compressed-tensors"``: each quantized linear
layer's ``weight`` holds 8-bit values ``[out, in]`` (``F8_E4M3`` for the
``float-quantized`` format, ``I8`` for ``int-quantized``; ``naive-quantized`` is either)
with a ``weight_scale`` beside it, one per output channel (``[out, 1]``, strategy
``channel``) or one for the tensor (``[1]`` or ``[]``, strategy ``tensor``), symmetric
(no zero point); ``input_scale`` may hold a static activation scale. Such a layer is held
in ``models.quantization``'s ``fp8`` or ``int8`` format as it is stored (a tensor's scale
repeated for every channel), never widened to float. The checkpoint's own activation
scheme is not followed: where it asks for 8-bit activations (W8A8), ``input_scale`` is
read and dropped, and the products run as the backend runs the format (on CPU the C
kernel quantizes int8 layers' rows in blocks of 32, each with its own scale; XLA's
products are weight-only; fp8 on GPUs with fp8 units quantizes rows to e4m3). Schemes
that do not fit (4-bit, groups, zero points, other quantization methods such as GPTQ,
AWQ or block-wise FP8) are refused, naming what was found.

``read_safetensors`` reads a file whose tensors numpy's safetensors loader cannot (it has
no float8 types): its header, then each tensor's bytes viewed as its dtype
(``ml_dtypes`` for bfloat16 and float8). No JAX here.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import struct
from typing import Any

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def read_safetensors(path: str | pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file, as numpy arrays (bfloat16 and float8 as
    ``ml_dtypes`` types). Raises ValueError naming the file for a malformed header or a
    dtype it does not know."""
    path = pathlib.Path(path)
    # Mapped, not read: each tensor is copied out once (the file is not held twice).
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    try:
        (n,) = struct.unpack("<Q", raw[:8].tobytes())
        header = json.loads(raw[8 : 8 + n].tobytes())
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a safetensors header ({e})") from None
    data = raw[8 + n :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = np.dtype(_DTYPES[info["dtype"]])
            start, stop = info["data_offsets"]
            shape = tuple(info["shape"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(
                f"{path}: tensor {name!r}: an entry of dtype, shape and data_offsets of "
                f"{sorted(_DTYPES)} expected, got {info!r}"
            ) from None
        if not 0 <= start <= stop <= len(data) or stop - start != dtype.itemsize * int(
            np.prod(shape)
        ):
            raise ValueError(f"{path}: tensor {name!r}: data_offsets {info['data_offsets']} "
                             f"do not hold {shape} of {info['dtype']}")  # fmt: skip
        out[name] = np.array(data[start:stop].view(dtype).reshape(shape))
    return out


def read_json_object(path: pathlib.Path) -> dict:
    """The JSON object in file ``path``; ValueError naming the file for anything else."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        lines = str(e).strip().splitlines()
        raise ValueError(f"{path}: {lines[0] if lines else type(e).__name__}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return value


@dataclasses.dataclass(frozen=True)
class Scheme:
    """The weights' scheme of a compressed-tensors checkpoint: ``fmt`` (``"fp8"`` or
    ``"int8"``, ``models.quantization``'s name) and ``strategy`` (``"channel"`` or
    ``"tensor"``)."""

    fmt: str
    strategy: str


def scheme(config: dict, source: str) -> Scheme | None:
    """The scheme a Hugging Face ``config.json`` (dict) declares in its
    ``quantization_config``; None without one. Raises ValueError naming ``source`` and the
    field for any scheme other than compressed-tensors' symmetric 8-bit weights (one
    group for every linear layer)."""
    qc = config.get("quantization_config")
    if qc is None:
        return None

    def refuse(what: str):
        raise ValueError(
            f"{source}: quantization_config: {what}; supported: compressed-tensors with "
            "8-bit symmetric weights (float or int) per channel or per tensor"
        )

    if not isinstance(qc, dict):
        refuse(f"expected an object, got {qc!r}")
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        refuse(f"quant_method {method!r} is not read")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        refuse(f"expected one entry in config_groups, got {groups!r}")
    group = next(iter(groups.values()))
    weights = group.get("weights") if isinstance(group, dict) else None
    if not isinstance(weights, dict):
        refuse("config_groups: a group without weights")
    kind, bits = weights.get("type"), weights.get("num_bits")
    strategy = weights.get("strategy")
    if bits != 8 or kind not in ("float", "int"):
        refuse(f"weights of {bits} bits of type {kind!r}")
    if strategy not in ("channel", "tensor"):
        refuse(f"weights' strategy {strategy!r}")
    if weights.get("symmetric") is False:
        refuse("asymmetric weights (a zero point)")
    if weights.get("dynamic"):
        refuse("dynamic weight scales")
    return Scheme("fp8" if kind == "float" else "int8", strategy)


def take_quantized(
    tensors: dict[str, Any], sch: Scheme, source: str
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Removes each quantized linear layer's tensors from ``tensors`` (those whose
    ``NAME.weight`` has a ``NAME.weight_scale`` beside it; ``NAME.input_scale`` is
    dropped) and returns them as ``{"NAME.weight": (q [out, in], scale f32 [out])}``:
    ``q`` float8_e4m3fn or int8 as ``sch`` says, one scale per output channel (a
    tensor's scale repeated). Raises ValueError naming the tensor where a value or a
    scale does not fit the scheme."""
    want = np.dtype(ml_dtypes.float8_e4m3fn if sch.fmt == "fp8" else np.int8)
    out = {}
    for scale_name in [n for n in tensors if n.endswith(".weight_scale")]:
        base = scale_name.removesuffix("_scale")
        if base not in tensors:
            raise ValueError(f"{source}: tensor {scale_name!r} has no {base!r} beside it")
        if f"{base}_zero_point" in tensors:
            raise ValueError(f"{source}: tensor {base!r} has a zero point (asymmetric)")
        q = np.asarray(tensors.pop(base))
        scale = np.asarray(tensors.pop(scale_name), np.float32)
        tensors.pop(base.removesuffix("weight") + "input_scale", None)
        if q.dtype != want or q.ndim != 2:
            raise ValueError(
                f"{source}: tensor {base!r}: expected a 2-d {want.name} weight for "
                f"{sch.fmt}, got {q.dtype.name}{list(q.shape)}"
            )
        out_features = q.shape[0]
        if scale.size == 1:
            scale = np.full(out_features, scale.reshape(()), np.float32)
        elif scale.shape in ((out_features, 1), (out_features,)):
            scale = scale.reshape(out_features)
        else:
            raise ValueError(
                f"{source}: tensor {scale_name!r} has shape {list(scale.shape)}, expected "
                f"[{out_features}, 1] (per channel) or [1] (per tensor)"
            )
        if not np.all(np.isfinite(scale)) or np.any(scale <= 0):
            raise ValueError(f"{source}: tensor {scale_name!r}: scales must be finite and > 0")
        out[base] = (q, scale)
    return out
