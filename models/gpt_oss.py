"""GPT-OSS checkpoints' tensors, in the names and layouts the other mixtures use.

A GPT-OSS checkpoint holds each layer's experts as one tensor a projection:
``mlp.experts.gate_up_proj [X, H, 2F]`` (``[in, out]``; gate's and up's outputs
interleaved: gate at even columns, up at odd), ``gate_up_proj_bias [X, 2F]``,
``down_proj [X, F, H]``, ``down_proj_bias [X, H]``, and its router as ``mlp.router``
(``weight [X, H]``, ``bias [X]``). The published checkpoints store the two expert
weights in MXFP4 instead (``quantization_config.quant_method == "mxfp4"``): ``*_blocks
uint8 [X, out, in / 32, 16]``, two 4-bit E2M1 values a byte (the low nibble first), and
``*_scales uint8 [X, out, in / 32]``, each group of 32's power of two plus 127.

``to_canonical`` rewrites such tensors into one ``[out, in]`` tensor per layer and
expert under Qwen's names (``mlp.experts.{e}.gate_proj.weight``, ``mlp.gate.weight``),
which ``models.hf.build_model`` reads for every mixture, with the experts' biases as
``mlp.experts.{gate,up,down}_bias``; ``from_canonical`` goes back.
"""

from __future__ import annotations

import re

import numpy as np

# The 16 values of a 4-bit E2M1 number (sign, 2 exponent bits, 1 mantissa bit).
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)_blocks$")


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 blocks ``uint8 [..., G, 16]`` and scales ``uint8 [..., G]`` -> ``f32 [...,
    G * 32]``: value ``2 * j`` of a group from byte j's low nibble, ``2 * j + 1`` from its
    high one, each times ``2 ** (scale - 127)``. Raises ValueError for shapes that do not
    pair."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(
            f"mxfp4: expected uint8 blocks and scales, got {blocks.dtype}, {scales.dtype}"
        )
    if blocks.ndim < 2 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"mxfp4: expected blocks [..., G, 16] and scales [..., G], got {blocks.shape} and "
            f"{scales.shape}"
        )
    out = np.empty((*blocks.shape[:-1], 32), np.float32)
    out[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    out[..., 1::2] = FP4_VALUES[blocks >> 4]
    out = np.ldexp(out, scales.astype(np.int32)[..., None] - 127)
    return out.reshape(*blocks.shape[:-2], -1)


def to_canonical(tensors: dict[str, np.ndarray], layers: int, experts: int, source: str) -> None:
    """In place: a GPT-OSS checkpoint's router and expert tensors (float, or MXFP4 blocks
    dequantized to f32) under the names ``build_model`` reads (module docstring). Raises
    ValueError naming ``source`` and the tensor for one missing or mis-shaped, and
    ``num_experts`` where a layer holds other than ``experts`` experts."""
    for name in [n for n in tensors if _EXPERTS.match(n)]:
        scales = name.removesuffix("_blocks") + "_scales"
        if scales not in tensors:
            raise ValueError(f"{source}: tensor {scales!r} is missing beside {name!r}")
        try:
            out_in = dequantize_mxfp4(tensors.pop(name), tensors.pop(scales))
        except ValueError as e:
            raise ValueError(f"{source}: tensor {name!r}: {e}") from None
        tensors[name.removesuffix("_blocks")] = np.swapaxes(out_in, 1, 2)  # [X, in, out]
    for i in range(layers):
        at = f"model.layers.{i}.mlp."
        for ours, theirs in (("gate.weight", "router.weight"), ("gate.bias", "router.bias")):
            if at + theirs in tensors:
                tensors[at + ours] = tensors.pop(at + theirs)
        gate_up, down = (
            _take(tensors, at + "experts.gate_up_proj", 3, source),
            _take(tensors, at + "experts.down_proj", 3, source),
        )
        if gate_up.shape[0] != experts or down.shape[0] != experts:
            raise ValueError(
                f"{source}: num_experts: the config says {experts} experts a layer, the "
                f"checkpoint's {at}experts tensors hold {gate_up.shape[0]}"
            )
        if gate_up.shape[2] % 2:
            raise ValueError(
                f"{source}: tensor {at}experts.gate_up_proj has shape {gate_up.shape}, "
                "expected an even last axis (gate's and up's columns interleaved)"
            )
        for e in range(gate_up.shape[0]):
            tensors[f"{at}experts.{e}.gate_proj.weight"] = np.ascontiguousarray(
                gate_up[e, :, 0::2].T
            )
            tensors[f"{at}experts.{e}.up_proj.weight"] = np.ascontiguousarray(gate_up[e, :, 1::2].T)
            tensors[f"{at}experts.{e}.down_proj.weight"] = np.ascontiguousarray(down[e].T)
        bias = _take(tensors, at + "experts.gate_up_proj_bias", 2, source)
        tensors[at + "experts.gate_bias"] = np.ascontiguousarray(bias[:, 0::2])
        tensors[at + "experts.up_bias"] = np.ascontiguousarray(bias[:, 1::2])
        tensors[at + "experts.down_bias"] = _take(tensors, at + "experts.down_proj_bias", 2, source)


def from_canonical(tensors: dict[str, np.ndarray], layers: int, experts: int) -> None:
    """In place: ``to_canonical``'s inverse for float tensors (what
    ``models.hf.to_hf_tensors`` writes for a GPT-OSS model)."""
    for i in range(layers):
        at = f"model.layers.{i}.mlp."
        for ours, theirs in (("gate.weight", "router.weight"), ("gate.bias", "router.bias")):
            tensors[at + theirs] = tensors.pop(at + ours)
        gate = np.stack(
            [tensors.pop(f"{at}experts.{e}.gate_proj.weight").T for e in range(experts)]
        )
        up = np.stack([tensors.pop(f"{at}experts.{e}.up_proj.weight").T for e in range(experts)])
        down = np.stack(
            [tensors.pop(f"{at}experts.{e}.down_proj.weight").T for e in range(experts)]
        )
        both = np.empty((*gate.shape[:2], 2 * gate.shape[2]), gate.dtype)
        both[..., 0::2], both[..., 1::2] = gate, up
        tensors[at + "experts.gate_up_proj"] = both
        tensors[at + "experts.down_proj"] = down
        bg, bu = tensors.pop(at + "experts.gate_bias"), tensors.pop(at + "experts.up_bias")
        bias = np.empty((bg.shape[0], 2 * bg.shape[1]), bg.dtype)
        bias[:, 0::2], bias[:, 1::2] = bg, bu
        tensors[at + "experts.gate_up_proj_bias"] = bias
        tensors[at + "experts.down_proj_bias"] = tensors.pop(at + "experts.down_bias")


def _take(tensors: dict, name: str, ndim: int, source: str) -> np.ndarray:
    if name not in tensors:
        raise ValueError(f"{source}: tensor {name!r} is missing from the checkpoint")
    value = tensors.pop(name)
    if value.ndim != ndim:
        raise ValueError(f"{source}: tensor {name!r} has shape {value.shape}, expected {ndim} axes")
    return value
