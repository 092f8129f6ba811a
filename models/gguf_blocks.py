"""A GGUF file's quantized tensors as paged-jax holds them: llama.cpp's blocks decoded
into a scale (and minimum) per group of inputs with the weights as integers, kept rather
than widened: by default as ``Nibbles`` (4 low bits two a byte, 1 or 2 high bits in a
plane, float16 scales: about the file's size) and Q8_0 as int8 groups; with
``quantization="int8"`` the 5- to 8-bit formats as int8 groups; or dequantized to f32 by
the gguf package (``_dequantize``). No JAX."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

F16_MAX = 65504.0  # and its largest finite one


@dataclasses.dataclass
class Nibbles:
    """One GGUF tensor's blocks as the model holds them by default (``load_gguf``): each
    weight an unsigned value ``u`` in ``[0, 2 ** (4 + bits))``, its low 4 bits two a byte
    and its high ``bits`` (0, 1 or 2) in a plane of their own, and per group of ``G``
    inputs a scale ``d`` and either a minimum ``m`` (weight ``d u + m``) or the tensor's
    ``offset`` (weight ``d (u - offset)``). Numpy, ``[out, in]`` order:

    - ``q`` uint8 ``[out, in / 2]``: byte j holds input 2j's low 4 bits in its low nibble
      and input 2j + 1's in its high one;
    - ``high`` uint8 ``[out, in bits / 8]`` or None: byte j holds input ``(8 / bits) j +
      t``'s high bits at bit ``t bits``;
    - ``d``, ``m`` float16 (the file's own precision: exact for the 32-weight formats;
      a K-quant's ``d * sc`` rounded once: within 2 ** -11 of the tensor's largest scale)
      or float32 where float16 cannot hold them so; ``[out, in / G]``;
      ``m`` None with an ``offset``.

    Q4_0 (offset 8), Q4_1, Q4_K, Q5_0 (bits 1, offset 16), Q5_1, Q5_K, Q6_K (bits 2,
    offset 32, G 16), Q3_K (offset 4, G 16) and Q2_K (G 16) come so: at most 1.11x the
    file's bytes for the first seven (Q3_K 1.45x, Q2_K 2.3x)."""

    q: np.ndarray
    d: np.ndarray
    m: np.ndarray | None
    high: np.ndarray | None = None
    bits: int = 0
    offset: int = 0

    @property
    def inputs(self) -> int:
        return 2 * self.q.shape[1]

    @property
    def group(self) -> int:
        return self.inputs // self.d.shape[1]

    def values(self) -> np.ndarray:
        """``u`` uint8 ``[out, in]``."""
        q = self.q
        u = np.stack([q & 15, q >> 4], axis=-1).reshape(q.shape[0], -1)
        if self.high is not None:
            u |= _unpack_bits(self.high, self.bits) << 4
        return u

    def as_int8(self) -> tuple[np.ndarray, ...]:
        """The same weights as int8 groups: ``(q int8 [out, in], d f32 [out, in / G](, m
        f32))``, ``q = u`` with a minimum, else ``u - offset``."""
        u = self.values()
        d = self.d.astype(np.float32)
        if self.m is not None:
            return u.astype(np.int8), d, self.m.astype(np.float32)
        return (u.astype(np.int16) - self.offset).astype(np.int8), d

    def dequantize(self) -> np.ndarray:
        """f32 ``[out, in]``."""
        q, d, *m = self.as_int8()
        g = self.group
        w = q.astype(np.float32) * np.repeat(d, g, axis=1)
        return w + np.repeat(m[0], g, axis=1) if m else w


def nibbles(
    u: np.ndarray,
    bits: int,
    d: np.ndarray,
    m: np.ndarray | None,
    offset: int = 0,
    dtype: Any = None,
) -> Nibbles:
    """``Nibbles`` of values ``u`` (``[out, in]``, in ``[0, 2 ** (4 + bits))``), with
    scales ``d`` and minimums ``m`` (f32 ``[out, in / G]``, held in ``dtype``; default
    float16 where it holds each of them within 2 ** -11 of its largest magnitude, else
    float32)."""
    u = u.astype(np.uint8)
    q = (u[:, 0::2] & 15) | ((u[:, 1::2] & 15) << 4)
    high = _pack_bits(u >> 4, bits) if bits else None
    scales = [d] if m is None else [d, m]
    if dtype is None:
        dtype = np.float16 if all(_fits_f16(a) for a in scales) else np.float32
    return Nibbles(
        q,
        d.astype(dtype),
        None if m is None else m.astype(dtype),
        high,
        bits,
        offset,
    )


def common_layout(parts: list[Nibbles], what: str = "tensors") -> list[Nibbles]:
    """The layers of one weight in one layout, each the same weights as before (a file
    mixing block formats across layers, as llama.cpp's Q4_K_M does with Q4_K and Q6_K):
    the smallest of their groups (each scale and minimum repeated over the smaller
    groups), minimums where any layer has them (``-offset * d`` for the others) or else
    the largest offset (the others' values raised by the difference, in as many high
    bits as that takes; minimums where it takes more than 2), and float16 scales where
    every layer's fit. Returns ``parts`` itself where they agree already. Raises
    ``ValueError`` naming ``what`` where the groups are not multiples of the smallest."""
    layouts = {(p.group, p.bits, p.m is None, p.offset, p.d.dtype) for p in parts}
    if len(layouts) == 1:
        return parts
    group = min(p.group for p in parts)
    if any(p.group % group for p in parts):
        raise ValueError(
            f"{what}: blocks of {sorted({p.group for p in parts})} inputs across layers, not "
            "all multiples of the smallest"
        )
    mins = any(p.m is not None for p in parts)
    top = max(p.offset for p in parts)
    need = max(2 ** (4 + p.bits) - 1 + top - p.offset for p in parts)
    mins = mins or need > 63
    bits = max(p.bits for p in parts) if mins else next(b for b in (0, 1, 2) if need < 2 ** (4 + b))
    out = []
    for p in parts:
        u, k = p.values(), p.group // group
        d = np.repeat(p.d.astype(np.float32), k, axis=1)
        if mins:
            m = np.repeat(p.m.astype(np.float32), k, axis=1) if p.m is not None else -p.offset * d
        else:
            m, u = None, u + np.uint8(top - p.offset)
        out.append((u, d, m))
    fits = all(_fits_f16(a) for _, d, m in out for a in (d, m) if a is not None)
    dtype = np.float16 if fits else np.float32
    return [nibbles(u, bits, d, m, 0 if mins else top, dtype) for u, d, m in out]


def _fits_f16(a: np.ndarray) -> bool:
    """Whether float16 holds ``a`` (f32) within 2 ** -11 of its largest magnitude: every
    entry finite and at most float16's largest, each rounded (a normal one within 2 ** -11
    of itself; a subnormal one within 2 ** -25) no further than that from itself."""
    mag = np.abs(a)
    top = float(mag.max()) if mag.size else 0.0
    if not np.isfinite(top) or top > F16_MAX:
        return False
    err = np.abs(a.astype(np.float16).astype(np.float32) - a)
    return bool(np.all(err <= 2.0**-11 * top))


def _pack_bits(h: np.ndarray, bits: int) -> np.ndarray:
    """uint8 ``[out, in]`` values below ``2 ** bits`` packed ``8 / bits`` a byte along
    ``in`` (value ``(8 / bits) j + t`` at bit ``t bits`` of byte j)."""
    per = 8 // bits
    h = h.reshape(h.shape[0], -1, per).astype(np.uint8)
    shifts = (np.arange(per, dtype=np.uint8) * bits).astype(np.uint8)
    return np.bitwise_or.reduce(h << shifts, axis=-1).astype(np.uint8)


def _unpack_bits(packed: np.ndarray, bits: int) -> np.ndarray:
    """``_pack_bits``' inverse: uint8 ``[out, in]``."""
    per = 8 // bits
    shifts = (np.arange(per, dtype=np.uint8) * bits).astype(np.uint8)
    h = (packed[..., None] >> shifts) & ((1 << bits) - 1)
    return h.reshape(packed.shape[0], -1).astype(np.uint8)


def _dequantize(t: Any, qtype: Any) -> np.ndarray:
    """float32 ``[out, in]`` (numpy order) of a GGUF tensor."""
    from gguf import quants

    if qtype.name == "F32":  # a copy: a view would keep the file's map open
        return np.array(t.data, np.float32)
    if qtype.name == "F16":
        return np.asarray(t.data).astype(np.float32)
    return quants.dequantize(t.data, qtype).astype(np.float32, copy=False)


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of each block of ``b`` (uint8 ``[..., block bytes]``),
    as float32 ``[...]``: a block's scale or minimum."""
    return np.ascontiguousarray(b[..., at : at + 2]).view(np.float16)[..., 0].astype(np.float32)


def _q4_blocks(t: Any, qtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(q uint8 [out, in / 2], d f32 [out, in / 32], m f32 [out, in / 32])`` (``q``:
    values in [0, 15] two a byte along ``in``, ``_pairs``) of a
    Q4_0 or Q4_1 tensor, block by block: weight ``d * q + m`` (Q4_0: ``m = -8 d``). A
    block is a float16 ``d`` (Q4_1: then a float16 ``m``) and 16 bytes holding its first
    16 weights in their low nibbles and its last 16 in the high ones."""
    raw = np.asarray(t.data, np.uint8)
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, 18 if qtype == "Q4_0" else 20)
    d = _f16(b, 0)
    if qtype == "Q4_0":
        m, qs = -8.0 * d, b[..., 2:]
    else:
        m = _f16(b, 2)
        qs = b[..., 4:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(rows, -1)
    return _pairs(q), d, m


def _pairs(q: np.ndarray) -> np.ndarray:
    """4-bit values ``[out, in]`` (uint8, in [0, 15]) two a byte along ``in``: ``[out,
    in / 2]``, byte j holding input 2j in its low nibble and 2j + 1 in its high one
    (``build_model``'s int4 blocks; half the memory while the load holds them)."""
    return q[:, 0::2] | (q[:, 1::2] << 4)


def _q4_k_blocks(t: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(q uint8 [out, in / 2], d f32 [out, in / 32], m f32 [out, in / 32])`` (``q`` as
    ``_q4_blocks``') of a
    Q4_K tensor: each super-block of 256 weights (144 bytes: f16 ``d`` and ``dmin``, 12
    bytes of 6-bit scales and minimums for its 8 groups of 32, then 128 bytes of 4-bit
    values) is 8 groups of the int4 format, group j's weights ``(d sc_j) q - dmin m_j``
    (in pairs of groups: the low nibbles of 32 bytes, then their high ones)."""
    raw = np.asarray(t.data, np.uint8)
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, 144)
    d = _f16(b, 0)
    dmin = _f16(b, 2)
    qs = b[..., 16:].reshape(rows, -1, 4, 32)  # four runs of 32 bytes: groups 2i, 2i + 1
    q = np.stack([qs & 15, qs >> 4], axis=-2).reshape(rows, -1)  # [rows, blocks * 256]
    dg, mg = _k_groups(b, d, dmin)
    return _pairs(q), dg, mg


def _k_groups(b: np.ndarray, d: np.ndarray, dmin: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each group of 32's scale and minimum ``(d sc_j, -dmin m_j)``, f32 ``[rows, blocks *
    8]``, of Q4_K or Q5_K super-blocks ``b`` (uint8 ``[rows, blocks, bytes]``; ``d``,
    ``dmin`` f32 ``[rows, blocks]``): bytes 4-16 hold the 8 groups' 6-bit ``sc`` and
    ``m``, groups 0-3 in the low 6 bits of bytes 0-3 and 4-7, groups 4-7 in the nibbles
    of bytes 8-11 with their top 2 bits in the top bits of bytes 0-7."""
    rows = b.shape[0]
    sc = b[..., 4:16]  # [rows, blocks, 12]
    scale = np.empty((*sc.shape[:2], 8), np.uint8)
    low = np.empty_like(scale)
    scale[..., :4], low[..., :4] = sc[..., 0:4] & 63, sc[..., 4:8] & 63
    scale[..., 4:] = (sc[..., 8:12] & 15) | ((sc[..., 0:4] >> 6) << 4)
    low[..., 4:] = (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)
    dg = (d[..., None] * scale.astype(np.float32)).reshape(rows, -1)
    mg = -(dmin[..., None] * low.astype(np.float32)).reshape(rows, -1)
    return dg, mg


def _q5_1_blocks(t: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(q int8 [out, in] in [0, 31], d f32 [out, in / 32], m f32 [out, in / 32])`` of a
    Q5_1 tensor: each block of 32 weights (24 bytes: f16 ``d`` and ``m``, 32 high bits,
    16 bytes of low nibbles, the first 16 weights in the low ones) is a group of int8
    weights ``d * q + m``."""
    raw = np.asarray(t.data, np.uint8)
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, 24)
    return _five_bits(b, 4).astype(np.int8).reshape(rows, -1), _f16(b, 0), _f16(b, 2)


def _q5_k_blocks(t: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(q int8 [out, in] in [0, 31], d f32 [out, in / 32], m f32 [out, in / 32])`` of a
    Q5_K tensor: each super-block of 256 weights (176 bytes: f16 ``d`` and ``dmin``, 12
    bytes of 6-bit scales and minimums as Q4_K's, 32 bytes of high bits, 128 of low
    nibbles) is 8 groups of int8 weights ``(d sc_j) q - dmin m_j``. Groups 2i and 2i + 1
    take the low and high nibbles of the i-th run of 32 bytes, and bits 2i and 2i + 1 of
    the high-bit bytes."""
    raw = np.asarray(t.data, np.uint8)
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, 176)
    d, dmin = _f16(b, 0), _f16(b, 2)
    qh = b[..., None, 16:48]  # [rows, blocks, 1, 32]
    qs = b[..., 48:].reshape(rows, -1, 4, 32)
    bit = np.arange(4, dtype=np.uint8)[:, None]  # run i: bits 2i, 2i + 1
    lo = (qs & 15) | (((qh >> (2 * bit)) & 1) << 4)
    hi = (qs >> 4) | (((qh >> (2 * bit + 1)) & 1) << 4)
    q = np.stack([lo, hi], axis=-2).astype(np.int8).reshape(rows, -1)
    dg, mg = _k_groups(b, d, dmin)
    return q, dg, mg


def _q6_k_blocks(t: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(q int8 [out, in] in [-32, 31], d f32 [out, in / 16])`` of a Q6_K tensor: each
    super-block of 256 weights (210 bytes: 128 bytes of low 4 bits, 64 of high 2 bits,
    16 int8 scales, f16 ``d``) is 16 groups of 16 int8 weights with the scale ``d *
    scales[j]``."""
    raw = np.asarray(t.data, np.uint8)
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, 210)
    ql = b[..., 0:128].reshape(rows, -1, 2, 64)  # two halves of 128 weights
    qh = b[..., 128:192].reshape(rows, -1, 2, 32)
    scales = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
    d = _f16(b, 208)
    lo = [ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4]
    hi = [(qh >> s) & 3 for s in (0, 2, 4, 6)]
    # each half: its four runs of 32 weights, in order
    q = np.stack([(a | (h << 4)).astype(np.int16) - 32 for a, h in zip(lo, hi, strict=True)], -2)
    q = q.astype(np.int8).reshape(rows, -1)
    return q, (d[..., None] * scales).reshape(rows, -1)


def _q3_k_blocks(t: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(q int8 [out, in] in [-4, 3], d f32 [out, in / 16])`` of a Q3_K tensor: each
    super-block of 256 weights (110 bytes: 32 bytes of high bits, 64 of low 2-bit pairs,
    12 bytes of 6-bit scales, f16 ``d``) is 16 groups of 16 int8 weights with the scale
    ``d * (s_j - 32)``. The low bits of weight ``128 h + 32 k + l`` (``l`` < 32) are bits
    ``2k, 2k + 1`` of byte ``32 h + l``, its high bit bit ``4 h + k`` of byte ``l`` of
    the high bits (clear: ``q`` less 4). Scale ``j``'s low 4 bits are the low (``j`` < 8)
    or high nibble of byte ``j mod 8``, its top 2 bits bits ``2 (j div 4)`` of byte
    ``8 + j mod 4``."""
    raw = np.asarray(t.data, np.uint8)
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, 110)
    hmask = b[..., None, 0:32]  # [rows, blocks, 1, 32]
    qs = b[..., 32:96].reshape(rows, -1, 2, 1, 32)  # two halves of 128 weights
    shift = np.arange(0, 8, 2, dtype=np.uint8)[:, None]  # [4, 1]
    low = ((qs >> shift) & 3).reshape(rows, -1, 8, 32)  # run 4h + k: 32 weights
    high = (hmask >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [rows, blocks, 8, 32]
    q = (low.astype(np.int8) - ((high ^ 1) << 2).astype(np.int8)).reshape(rows, -1)
    sc = b[..., 96:108]
    nib = np.concatenate([sc[..., 0:8] & 15, sc[..., 0:8] >> 4], axis=-1)  # [rows, blocks, 16]
    top = (sc[..., None, 8:12] >> np.arange(0, 8, 2, dtype=np.uint8)[:, None]) & 3
    scales = (nib | (top.reshape(rows, -1, 16) << 4)).astype(np.float32) - 32.0
    d = _f16(b, 108)
    return q, (d[..., None] * scales).reshape(rows, -1)


def _q2_k_blocks(t: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(q int8 [out, in] in [0, 3], d f32 [out, in / 16], m f32 [out, in / 16])`` of a
    Q2_K tensor: each super-block of 256 weights (84 bytes: 16 bytes of 4-bit scales
    and minimums, 64 of 2-bit values, f16 ``d`` and ``dmin``) is 16 groups of 16 int8
    weights ``(d sc_j) q - dmin m_j`` (``sc_j``, ``m_j``: the low and high nibbles of
    byte ``j``). Weight ``128 h + 32 k + l`` (``l`` < 32) is bits ``2k, 2k + 1`` of value
    byte ``32 h + l``."""
    raw = np.asarray(t.data, np.uint8)
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, 84)
    qs = b[..., 16:80].reshape(rows, -1, 2, 1, 32)
    shift = np.arange(0, 8, 2, dtype=np.uint8)[:, None]
    q = ((qs >> shift) & 3).astype(np.int8).reshape(rows, -1)
    sc = b[..., 0:16]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dg = (d[..., None] * (sc & 15).astype(np.float32)).reshape(rows, -1)
    mg = -(dmin[..., None] * (sc >> 4).astype(np.float32)).reshape(rows, -1)
    return q, dg, mg


def _q5_0_blocks(t: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(q int8 [out, in] in [-16, 15], d f32 [out, in / 32])`` of a Q5_0 tensor: each
    block of 32 weights (22 bytes: f16 ``d``, 32 high bits, 16 bytes of low nibbles, the
    first 16 weights in the low ones) is a group of int8 weights ``d * q``."""
    raw = np.asarray(t.data, np.uint8)
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, 22)
    q = (_five_bits(b, 2).astype(np.int16) - 16).astype(np.int8)
    return q.reshape(rows, -1), _f16(b, 0)


def _five_bits(b: np.ndarray, at: int) -> np.ndarray:
    """The 32 values in [0, 31] (uint8 ``[rows, blocks, 32]``) of Q5_0 / Q5_1 blocks ``b``
    (uint8 ``[rows, blocks, bytes]``) whose 4 bytes of high bits start at byte ``at``,
    followed by 16 bytes of low nibbles (the first 16 values in the low ones)."""
    high = np.unpackbits(b[..., at : at + 4], axis=-1, bitorder="little")  # bit k: value k's
    nibbles = b[..., at + 4 : at + 20]
    return np.concatenate([nibbles & 15, nibbles >> 4], axis=-1) | (high << 4)


def _q8_blocks(t: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(q int8 [out, in], d f32 [out, in / 32])`` of a Q8_0 tensor: each block of 32
    weights a float16 scale ``d`` and 32 int8 values, the weights ``d * q``."""
    raw = np.asarray(t.data, np.uint8)
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, 34)
    d = _f16(b, 0)
    q = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(rows, -1)
    return q, d


# How each of KEPT_INT8's formats is read into int8 groups
_EIGHT_BIT_BLOCKS = {
    "Q8_0": _q8_blocks,
    "Q6_K": _q6_k_blocks,
    "Q5_0": _q5_0_blocks,
    "Q5_1": _q5_1_blocks,
    "Q5_K": _q5_k_blocks,
    "Q3_K": _q3_k_blocks,
    "Q2_K": _q2_k_blocks,
}


def group_of(parts, inputs: int) -> int:
    """The inputs a scale covers in one tensor's kept blocks: ``Nibbles``, ``(q int8 [out,
    in], d [out, in / G](, m))`` int8 groups, or ``(q, scale [out])`` int8 per channel
    (the whole row)."""
    if isinstance(parts, Nibbles):
        return parts.group
    d = parts[1]
    return inputs if d.ndim == 1 else inputs // d.shape[-1]


def common_group(names, blocks, eight, want: tuple, source: str) -> int:
    """The group every layer's kept blocks can be cut into (the smallest of theirs, which
    the others are multiples of: 16, 32, or a whole row), for ``int8_groups``. Raises
    ValueError naming the tensor for blocks that do not fit the parameter's shape."""
    inputs = want[0]  # a linear kernel [in, out]
    groups = []
    for n, _ in names:
        parts = blocks.get(n) if n in blocks else eight[n]
        q = parts.q if n in blocks else parts[0]
        cols = q.shape[1] * (2 if n in blocks else 1)
        if (cols, q.shape[0]) != tuple(want):
            raise ValueError(
                f"{source}: tensor {n!r} has shape {(q.shape[0], cols)}, expected "
                f"{tuple(want)[::-1]}"
            )
        groups.append(group_of(parts, inputs))
    group = min(groups)
    if any(g % group for g in groups):
        raise ValueError(
            f"{source}: tensors {names[0][0]!r}...: blocks of {sorted(set(groups))} inputs "
            "across layers, not all multiples of the smallest"
        )
    return group


def int8_groups(
    parts: tuple[np.ndarray, ...], group: int, with_mins: bool
) -> tuple[np.ndarray, ...]:
    """One tensor's kept blocks (``group_of``'s kinds) as int8 groups of ``group`` inputs:
    ``(q int8 [out, in], d f32 [out, in / group])``, and ``with_mins`` ``m f32 [out, in /
    group]`` too, the weights ``d q (+ m)`` exactly as before (4-bit values unpacked, each
    scale and minimum repeated over the smaller groups, 0 where there was no minimum)."""
    if isinstance(parts, Nibbles):
        parts = parts.as_int8()
    q, d, *m = parts
    if d.ndim == 1:  # one scale a row
        d = d[:, None]
    k = q.shape[1] // d.shape[1] // group
    d = np.repeat(d.astype(np.float32), k, axis=1)
    if not with_mins:
        return q, d
    return q, d, np.repeat(m[0], k, axis=1) if m else np.zeros_like(d)


def kept_layout(blocks: Nibbles, transposed: bool, want: tuple, source: str, name: str):
    """``(packed, scale(, zero)(, high))`` of one tensor's ``Nibbles`` (``q [out, in / 2]``:
    two weights a byte along ``in``, the even index in the low nibble) as the model holds
    them: a linear kernel ``[in / 2, out]`` (``transposed``), an embedding table ``[V, E /
    2]`` as it comes (two entries of the groups' axis a byte either way)."""
    q = blocks.q
    parts = tuple(a for a in (q, blocks.d, blocks.m, blocks.high) if a is not None)
    out, half = q.shape
    if ((2 * half, out) if transposed else (out, 2 * half)) != tuple(want):
        raise ValueError(
            f"{source}: tensor {name!r} has shape {(out, 2 * half)}, expected "
            f"{tuple(want)[::-1] if transposed else tuple(want)}"
        )
    return tuple(a.T for a in parts) if transposed else parts


def nibble_blocks(t: Any, qtype: str) -> Nibbles:
    """A tensor in one of ``KEPT`` formats as ``Nibbles`` (its blocks decoded, never
    widened to float)."""
    if qtype in ("Q4_0", "Q4_1"):
        q, d, m = _q4_blocks(t, qtype)
        u = np.stack([q & 15, q >> 4], axis=-1).reshape(q.shape[0], -1)
        return nibbles(u, 0, d, None, 8) if qtype == "Q4_0" else nibbles(u, 0, d, m)
    if qtype == "Q4_K":
        q, d, m = _q4_k_blocks(t)
        return nibbles(np.stack([q & 15, q >> 4], axis=-1).reshape(q.shape[0], -1), 0, d, m)
    if qtype == "Q5_0":
        q, d = _q5_0_blocks(t)
        return nibbles((q.astype(np.int16) + 16).astype(np.uint8), 1, d, None, 16)
    if qtype in ("Q5_1", "Q5_K"):
        q, d, m = _q5_1_blocks(t) if qtype == "Q5_1" else _q5_k_blocks(t)
        return nibbles(q.astype(np.uint8), 1, d, m)
    if qtype == "Q6_K":
        q, d = _q6_k_blocks(t)
        return nibbles((q.astype(np.int16) + 32).astype(np.uint8), 2, d, None, 32)
    if qtype == "Q3_K":
        q, d = _q3_k_blocks(t)
        return nibbles((q.astype(np.int16) + 4).astype(np.uint8), 0, d, None, 4)
    if qtype == "Q2_K":
        q, d, m = _q2_k_blocks(t)
        return nibbles(q.astype(np.uint8), 0, d, m)
    raise ValueError(f"qtype: expected one of {KEPT}, got {qtype!r}")


# Formats load_gguf keeps as Nibbles by default (Q8_0: as int8 groups)
KEPT = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q3_K", "Q2_K")
