"""Matrix products on the CPU (``linear.c``, ``lora.c``) against weights packed once in
column panels (``pack_weight``; f32, bf16, int8 per channel or in rotated groups, 4-bit
groups), with their references (``reference_bf16``, ``reference_quantized``) and LoRA
adapters' products row by row (``lora_delta``)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from . import build
from .build import (
    GROUPED_TARGET,
    LINEAR_TARGET,
    LORA_TARGET,
    require,
    threads_of,
)


def panel_width() -> int:
    """NR, the columns of a packed weight's panel in this build (48 with AVX-512, 24 with
    AVX2, 12 otherwise). Raises ``ValueError`` when the kernels are not available."""
    require()
    return build._state["panel_width"]


def pack_weight(w: jax.Array) -> jax.Array:
    """``w`` in the panel layout ``linear`` reads, NR = ``panel_width()``, ``P = ceil(N /
    NR)`` panels of NR columns (zero past column N), for a ``[K, N]`` weight or each of an
    ``[L, K, N]`` stack:

    - float32 ``[K, N] -> [P, K, NR]``, ``packed[p, k, j] = w[k, p * NR + j]``; the 4-bit
      groups' scales and minimums are packed this way too (float16 ones alike);
    - int8 ``[K, N] -> [P, K, NR]``, K a multiple of 4, in quads of rows: row i of
      ``packed[p].reshape(K / 4, 4 * NR)`` holds ``w[4i .. 4i + 3, p * NR + j]`` for each
      column j in turn (what an integer dot-product instruction reads);
    - bfloat16 ``[K, N] -> [P, K, NR]``, K even, in pairs of rows: row i of
      ``packed[p].reshape(K / 2, 2 * NR)`` holds ``w[2i, p * NR + j], w[2i + 1, p * NR +
      j]`` for each column j in turn (what a bf16 dot-product instruction reads);
    - uint8 4-bit weights, two rows a byte (row 2i in the low nibble), ``[K / 2, N] ->
      [P, K / 2, NR]``, K a multiple of 8, in octets of rows: row i of ``packed[p].
      reshape(K / 8, 4 * NR)`` holds, for each column j in turn and r = 0 .. 3, ``q[8i + r,
      j]`` in the low nibble and ``q[8i + 4 + r, j]`` in the high one.

    Raises ``ValueError`` for another dtype, rank or K. Outside ``jit`` the panels are
    filled in numpy (no XLA program compiled per weight shape)."""
    kinds = (jnp.float32, jnp.float16, jnp.int8, jnp.uint8, jnp.bfloat16)
    if w.ndim not in (2, 3) or w.dtype not in kinds:
        raise ValueError(
            f"w: expected a [K, N] or [L, K, N] float32, float16, int8, uint8 or bfloat16 "
            f"array, got {w.dtype}{list(w.shape)}"
        )
    if w.dtype == jnp.bfloat16 and w.shape[-2] % 2:
        raise ValueError(f"w: bf16 weights need K even, got {list(w.shape)}")
    if w.dtype == jnp.int8 and w.shape[-2] % 4:
        raise ValueError(f"w: int8 weights need K a multiple of 4, got {list(w.shape)}")
    if w.dtype == jnp.uint8 and w.shape[-2] % 4:
        raise ValueError(
            f"w: 4-bit weights need K a multiple of 8 (K / 2 rows of bytes a multiple of 4), "
            f"got {list(w.shape)}"
        )
    nr = panel_width()
    try:
        w = np.asarray(w)
    except jax.errors.TracerArrayConversionError:  # under jit: the same panels in jnp
        return _panels(w, nr, jnp)
    packed = _panels(w, nr, np)
    try:  # the new buffer as it is: nothing else holds it (3x faster than a copy)
        return jax.device_put(packed, may_alias=True)
    except TypeError:  # a JAX without may_alias
        return jnp.asarray(packed)


def _panels(w, nr: int, xp):
    """pack_weight's layout of ``w`` (numpy or jax.numpy as ``xp``)."""
    *lead, k, n = w.shape
    p = -(-n // nr)
    if w.dtype == np.uint8:  # two rows a byte -> the rows' values, then octets
        v = xp.stack([w & 15, w >> 4], axis=-2).reshape(*lead, 2 * k, n)
        v = v.reshape(*lead, k // 4, 2, 4, n)
        w = v[..., 0, :, :] | (v[..., 1, :, :] << 4)  # [.., K / 8, 4, N]
        w = w.reshape(*lead, k, n)  # rows (o, r): octet o, its r-th row pair
    w = xp.pad(w, [(0, 0)] * len(lead) + [(0, 0), (0, p * nr - n)])
    if w.dtype in (np.float32, np.float16):
        return xp.moveaxis(w.reshape(*lead, k, p, nr), -2, -3)
    g = _row_group(w.dtype)  # [.., K / g, g, P, NR] -> [.., P, K / g, NR, g]
    w = xp.moveaxis(w.reshape(*lead, k // g, g, p, nr), (-4, -3, -2, -1), (-3, -1, -4, -2))
    return w.reshape(*lead, p, k, nr)


def _row_group(dtype) -> int:
    """Rows of a column side by side in a packed panel: 2 for bf16 weights (a 32-bit
    lane's pair), 4 for 8-bit ones (a lane's quad)."""
    return 2 if jnp.dtype(dtype) == jnp.bfloat16 else 4


def pack_high(high: jax.Array, bits: int) -> jax.Array:
    """The high bits of 4-bit weights (``bits`` 1 or 2 a weight, above each weight's 4
    low bits) in the layout ``linear`` reads beside the weights ``pack_weight`` packed:
    ``u8[(L,) K bits / 8, N]`` (byte i holding inputs ``(8 / bits) i + t`` at bits ``t
    bits``, ``t < 8 / bits``) ``-> u8[(L,) P, K bits / 8, NR]``: a run of ``4 / bits``
    octets of rows (``pack_weight``'s) shares one row of ``4 NR`` bytes, byte ``4 j + r``
    of run ``u`` holding, for its ``o``-th octet, row ``8 o + r``'s bits at ``2 o bits``
    and row ``8 o + 4 + r``'s at ``(2 o + 1) bits`` (column j). K must be a multiple of
    32 (``bits`` 1) or 16 (2). Raises ``ValueError`` otherwise."""
    if bits not in (1, 2):
        raise ValueError(f"bits: expected 1 or 2, got {bits!r}")
    if high.dtype != jnp.uint8 or high.ndim not in (2, 3):
        raise ValueError(f"high: expected a uint8 [(L,) K bits / 8, N] array, got {high.dtype}")
    *lead, kb, n = high.shape
    k = kb * 8 // bits
    per = 4 // bits  # octets a row of the plane holds
    if k % (8 * per):
        raise ValueError(f"high: K = {k} is not a multiple of {8 * per} for {bits} bits")
    nr = panel_width()
    xp = np
    try:
        high = np.asarray(high)
    except jax.errors.TracerArrayConversionError:
        xp = jnp
    shifts = (xp.arange(8 // bits, dtype=np.uint8) * bits).reshape((1,) * (len(lead) + 1) + (-1, 1))
    h = (high[..., :, None, :] >> shifts) & ((1 << bits) - 1)  # [.., kb, 8 / bits, N]
    h = h.reshape(*lead, k // (8 * per), per, 2, 4, n)  # run, octet, half, r, column
    place = (2 * xp.arange(per)[:, None] + xp.arange(2)[None, :]).astype(np.uint8) * bits
    place = place.reshape((1,) * (len(lead) + 1) + (per, 2, 1, 1))
    rows = (h << place).sum(axis=(-4, -3), dtype=np.uint8)  # [.., runs, 4, N]
    p = -(-n // nr)
    rows = xp.pad(rows, [(0, 0)] * (len(lead) + 2) + [(0, p * nr - n)])
    rows = rows.reshape(*lead, k // (8 * per), 4, p, nr)
    # [.., runs, 4 (r), P, NR] -> [.., P, runs, NR, 4]: byte 4 j + r of each run's row
    rows = xp.moveaxis(rows, (-4, -3, -2, -1), (-3, -1, -4, -2))
    packed = rows.reshape(*lead, p, kb, nr)
    return packed if xp is jnp else jnp.asarray(packed)


def unpack_high(packed: jax.Array, n: int, bits: int) -> jax.Array:
    """The high bits ``pack_high`` packed (``bits`` a weight): ``u8[(L,) P, K bits / 8,
    NR] -> u8[(L,) K bits / 8, n]``."""
    *lead, p, kb, nr = packed.shape
    per = 4 // bits
    # [.., P, runs, NR, 4] -> [.., runs, 4, P, NR] -> [.., runs, 4, N]: each run's bytes
    rows = packed.reshape(*lead, p, kb // 4, nr, 4)
    rows = jnp.moveaxis(rows, (-3, -1, -4, -2), (-4, -3, -2, -1)).reshape(*lead, kb // 4, 4, p * nr)
    rows = rows[..., :n]
    place = (2 * jnp.arange(per)[:, None] + jnp.arange(2)[None, :]).astype(jnp.uint8) * bits
    place = place.reshape((1,) * (len(lead) + 1) + (per, 2, 1, 1))
    # [.., runs, per, 2, 4, N]: run, octet, half, r -> the K rows in order
    h = (rows[..., None, None, :, :] >> place) & ((1 << bits) - 1)
    h = h.reshape(*lead, kb, 8 // bits, n)
    shifts = (jnp.arange(8 // bits, dtype=jnp.uint8) * bits).reshape(
        (1,) * (len(lead) + 1) + (-1, 1)
    )
    return (h << shifts).sum(axis=-2, dtype=jnp.uint8)  # (disjoint bits: the sum is the or)


def pack_scales(scales: jax.Array) -> jax.Array:
    """Column scales ``f32[(L,) N]`` of int8 weights as ``linear`` reads them with the
    packed weights: ``f32[(L,) P * NR]``, zero past column N."""
    nr = panel_width()
    n = scales.shape[-1]
    pad = [(0, 0)] * (scales.ndim - 1) + [(0, -(-n // nr) * nr - n)]
    return jnp.pad(jnp.asarray(scales, jnp.float32), pad)


def unpack_weight(packed: jax.Array, n: int) -> jax.Array:
    """The weight ``pack_weight`` packed: ``[P, K, NR] -> [K, n]`` or
    ``[L, P, K, NR] -> [L, K, n]`` (any NR; 4-bit: ``[.., P, K / 2, NR] -> [.., K / 2,
    n]``, two rows a byte as before packing)."""
    *lead, p, k, nr = packed.shape
    if packed.dtype in (jnp.float32, jnp.float16):
        return jnp.moveaxis(packed, -3, -2).reshape(*lead, k, p * nr)[..., :n]
    g = _row_group(packed.dtype)  # [.., P, K / g, NR, g] -> [.., K / g, g, P, NR]
    w = packed.reshape(*lead, p, k // g, nr, g)
    w = jnp.moveaxis(w, (-3, -1, -4, -2), (-4, -3, -2, -1)).reshape(*lead, k, p * nr)[..., :n]
    if packed.dtype != jnp.uint8:
        return w
    w = w.reshape(*lead, k // 4, 4, n)  # octets: [.., K / 8, 4, N], two rows a byte
    v = jnp.stack([w & 15, w >> 4], axis=-3).reshape(*lead, 2 * k, n)  # the K rows in order
    v = v.reshape(*lead, k, 2, n)
    return v[..., 0, :] | (v[..., 1, :] << 4)


def packed_columns(packed: jax.Array, ids: jax.Array) -> jax.Array:
    """Columns ``ids`` (int ``[...]``) of the weight ``pack_weight`` packed, each as a row:
    ``[..., K]`` (4-bit: ``[..., K / 2]``, two rows a byte as before packing). An
    embedding table packed as its tied head's weight looks its tokens up this way."""
    nr = packed.shape[-1]
    if packed.dtype in (jnp.float32, jnp.float16):
        return packed[ids // nr, :, ids % nr]
    p, k, _ = packed.shape
    g = _row_group(packed.dtype)
    quads = packed.reshape(p, k // g, nr, g)[ids // nr, :, ids % nr, :]  # [..., K / g, g]
    if packed.dtype != jnp.uint8:
        return quads.reshape(*ids.shape, k)
    v = jnp.stack([quads & 15, quads >> 4], axis=-2).reshape(*ids.shape, k, 2)  # in order
    return v[..., 0] | (v[..., 1] << 4)


def linear(
    x: jax.Array,  # [..., K] f32
    packed: jax.Array,  # [(L,) P, K, NR] f32, int8 or bf16, or [(L,) P, K / 2, NR] uint8
    n: int,
    *,
    layer: jax.Array | int | None = None,
    rows: jax.Array | int | None = None,
    threads: int | None = None,
    scales: jax.Array | None = None,  # int8, bf16: f32[(L,) P * NR]; int8: [(L,) P, K / G, NR]
    mins: jax.Array | None = None,  # uint8, int8 with groups: f32[(L,) P, K / G, NR]
    rotated: bool = False,
    high: jax.Array | None = None,  # uint8 weights' high bits: u8[(L,) P, K hb / 8, NR]
    offset: int = 0,  # static: uint8 weights without mins are scales * (q - offset)
    float_rows: bool = False,  # static: weights dequantized, x not quantized
) -> jax.Array:  # [..., n] f32
    """``x @ w`` for the ``[K, n]`` weight ``w`` that ``pack_weight`` made ``packed`` (for an
    ``[L, ...]`` stack, weight ``layer``: an int or a traced i32 scalar, read in place,
    never sliced out), computed by ``linear.c``: each output one f32 sum over K in order, so
    a row's result does not depend on the other rows or on ``threads`` (default: the cores
    this process may use). ``rows`` (an int or a traced i32 scalar): only the first ``rows``
    rows of ``x`` (flattened to ``[M, K]``) are computed and the rest of the result is 0, so
    a batch padded to a bucket costs its real rows; None, or a value outside ``[0, M]``:
    every row. int8 weights come with ``scales``: the weight is ``q[k, j] * scales[j]``
    (``pack_scales`` of ``f32[(L,) n]``), or ``q[k, j] * scales[k // G, j]``
    (``pack_weight`` of ``f32[(L,) K / G, n]``, G a multiple of 4: groups as GGUF's Q8_0
    blocks), and with grouped scales ``mins`` too (the same layout): ``q[k, j] * scales[k //
    G, j] + mins[k // G, j]`` (GGUF's Q5_1 and Q5_K blocks). 4-bit weights (uint8, two rows
    of ``q`` in [0, 15] a byte, the even row in the low nibble) come with ``scales`` and
    ``mins`` per group of G rows (G a multiple of 8; ``pack_weight`` of their ``[K / G, n]``
    arrays): the weight is ``scales * q + mins``; or without ``mins`` ``scales * (q -
    offset)`` (GGUF's Q4_0 and Q6_K blocks, offset 8 and 32). Their ``scales`` and ``mins``
    may be float16 (a GGUF file's own scales, kept at their size), and ``high``
    (``pack_high``) adds 1 or 2 high bits above each 4-bit value: ``q`` in [0, 2 ** (4 +
    hb)) (GGUF's 5- and 6-bit blocks). ``float_rows`` (4-bit weights, or int8 ones with
    scales per group): each panel of the weights is dequantized to f32 (a product and a
    sum, unfused, as the gguf package dequantizes) and multiplied by ``x`` as it is, as
    the f32 kernel multiplies: the very sums of ``x @ w`` in f32 on the dequantized
    weights, at the quantized weights' bytes. bf16 weights (K even) may come with
    column ``scales`` (``pack_scales``; an fp8 weight held as bf16: ``q[k, j] *
    scales[j]``); they multiply the rows of ``x`` rounded to bf16, each product exact and
    added into an f32 sum per output (``reference_bf16``). Quantized weights multiply the rows of
    ``x`` quantized to int8 in blocks (32 inputs for int8 weights, the groups for 4-bit
    ones), each with a scale of its own (W8A8, as llama.cpp's Q8 and Q4 products): exact
    integer sums per block, scaled in f32 (``linear.c``'s header has the definition, and
    ``reference_quantized`` computes it in numpy). ``rotated`` (static; int8 or 4-bit
    weights, K a multiple of 32): the weights were rotated along K (``rotate_blocks`` of
    ``w`` along its rows: ``R w``), and each row of ``x`` is rotated the same way before
    it is quantized, so the product is still ``x @ w`` with w the weights before their
    rotation. Raises ``ValueError`` for other dtypes or shapes, a missing or out-of-range
    static ``layer``, ``rotated`` with f32 or bf16 weights or K not a multiple of 32, and
    when the kernels are not available."""
    p, k = _check_operands(x, packed, n, layer, scales, mins, rotated)
    _check_kept(packed, scales, mins, high, offset, k)
    if float_rows and (rotated or packed.dtype not in (jnp.int8, jnp.uint8)):
        raise ValueError(
            f"float_rows: needs 4-bit weights or int8 ones with scales per group, not rotated; "
            f"got {packed.dtype} weights{' (rotated)' if rotated else ''}"
        )
    if float_rows and packed.dtype == jnp.int8 and (scales is None or scales.ndim != packed.ndim):
        raise ValueError("float_rows: int8 weights need scales per group ([(L,) P, K / G, NR])")
    count = threads_of(threads)
    x2 = x.reshape(math.prod(x.shape[:-1]), k)
    params = jnp.stack(
        [
            jnp.asarray(0 if layer is None else layer, jnp.int32),
            jnp.int32(count),
            jnp.asarray(-1 if rows is None else rows, jnp.int32),
            jnp.int32(1 if rotated else 0),
            jnp.int32(offset),
            jnp.int32(1 if float_rows else 0),
        ]
    )
    call = jax.ffi.ffi_call(LINEAR_TARGET, jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32))
    extra = () if scales is None else (scales,) if mins is None else (scales, mins)
    _check_scales(packed, extra, p, k)
    if high is not None:
        extra = (*extra, high)
    return call(x2, packed, *extra, params).reshape(*x.shape[:-1], n)


def _check_kept(packed, scales, mins, high, offset, k: int) -> None:
    """``linear``'s checks of ``high`` and ``offset`` (4-bit weights only; ``offset`` an
    int >= 0 and only without ``mins``), and of ``high``'s shape against ``K``."""
    if not isinstance(offset, int) or offset < 0:
        raise ValueError(f"offset: expected an int >= 0, got {offset!r}")
    four = packed.dtype == jnp.uint8
    if (offset or high is not None) and not four:
        raise ValueError(f"high, offset: only uint8 (4-bit) weights take them, got {packed.dtype}")
    if offset and mins is not None:
        raise ValueError("offset: weights with mins take none (the mins hold it)")
    if four and scales is None:
        raise ValueError("scales: uint8 (4-bit) weights need their scales")
    if high is None:
        return
    lead, nr = packed.shape[:-2], packed.shape[-1]
    hb = high.shape[-2] * 8 // k if k else 0
    if (
        high.dtype != jnp.uint8
        or high.ndim != packed.ndim
        or hb not in (1, 2)
        or high.shape != (*lead, k * hb // 8, nr)
        or k % (16 // hb)
    ):
        raise ValueError(
            f"high: expected uint8[{', '.join(map(str, lead))}, K hb / 8, {nr}] (pack_high) "
            f"with hb 1 (K a multiple of 32) or 2 (of 16), K {k}; got {high.dtype}"
            f"{list(high.shape)}"
        )


def grouped_linear(
    x: jax.Array,  # f32[M, K], rows sorted by group
    packed: jax.Array,  # f32, bf16, int8 [W, P, K, NR] or uint8 [W, P, K / 2, NR]
    n: int,
    sizes: jax.Array,  # i32[G] rows of each group, in order; sum <= M
    first: jax.Array | int = 0,  # the weight of group 0 (group g's: first + g)
    *,
    scales: jax.Array | None = None,  # int8, 4-bit: f32[W, P, K / G, NR]
    mins: jax.Array | None = None,  # 4-bit: f32[W, P, K / G, NR]
    threads: int | None = None,
    high: jax.Array | None = None,  # 4-bit: u8[W, P, K hb / 8, NR] (pack_high)
    offset: int = 0,  # static: 4-bit without mins: scales * (q - offset)
    float_rows: bool = False,  # static: 4-bit weights dequantized, x as it is
) -> jax.Array:  # f32[M, n]
    """Each group's rows of ``x`` times its own weight (``linear.c``'s grouped product):
    group g's ``sizes[g]`` rows, after the groups before it, by weight ``first + g`` of
    ``packed``, each row computed as ``linear`` computes it alone; rows past the groups
    are 0. A weight no row chose is never read (a mixture of experts' rows sorted by
    expert, the experts of a layer stack ``[L * X, ...]`` from ``first = layer * X``).
    int8 weights come with ``scales`` per group of G rows (``pack_weight`` of each
    weight's ``f32[K / G, n]``, G a multiple of 4): the weight is ``q[k, j] * scales[k //
    G, j]``, and the rows are quantized in blocks of G (W8A8, as ``linear``); 4-bit ones
    (uint8, two rows a byte, as ``linear`` takes them) with ``scales`` and ``mins`` per
    group (G a multiple of 8): ``scales * q + mins``; as ``linear`` takes them, their
    scales and mins may be float16, the mins absent with an ``offset``, ``high`` bits
    above the 4 (a GGUF file's experts kept), and ``float_rows`` multiplies the rows as
    they are by each dequantized panel.
    ``first`` may be traced; the groups' weights must lie in ``packed`` (checked by the
    kernel, which fails the call otherwise). Raises ``ValueError`` for other dtypes or
    shapes and when the kernels are not available."""
    require()
    nr = panel_width()
    kinds = (jnp.float32, jnp.bfloat16, jnp.int8, jnp.uint8)
    if x.dtype != jnp.float32 or packed.dtype not in kinds:
        raise ValueError(
            f"x, packed: expected float32 and float32, bfloat16, int8 or uint8, got {x.dtype} "
            f"and {packed.dtype}"
        )
    if packed.ndim != 4 or packed.shape[-1] != nr:
        raise ValueError(f"packed: expected [W, P, K, {nr}], got {list(packed.shape)}")
    four = packed.dtype == jnp.uint8
    w, p, k, _ = packed.shape
    k = 2 * k if four else k
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"x: expected [M, {k}] (packed's K), got {list(x.shape)}")
    if not isinstance(n, int) or not p * nr - nr < n <= p * nr:
        raise ValueError(f"n: expected an int in ({p * nr - nr}, {p * nr}], got {n!r}")
    if sizes.ndim != 1 or not jnp.issubdtype(sizes.dtype, jnp.integer):
        raise ValueError(f"sizes: expected an int vector [G], got {sizes.dtype}{list(sizes.shape)}")
    if isinstance(first, int) and not 0 <= first <= w - sizes.shape[0]:
        raise ValueError(
            f"first: expected an int in [0, {w - sizes.shape[0]}] (the groups' "
            f"weights within packed's {w}), got {first}"
        )
    extra = ()
    if float_rows and packed.dtype not in (jnp.int8, jnp.uint8):
        raise ValueError(f"float_rows: needs int8 or 4-bit weights, got {packed.dtype}")
    # a GGUF file's experts kept: mins may be absent (an offset), scales float16
    kept = four and (
        high is not None or offset or (scales is not None and scales.dtype == jnp.float16)
    )
    if packed.dtype in (jnp.int8, jnp.uint8):
        multiple = 8 if four else 4
        dtypes = (jnp.float32, jnp.float16) if four else (jnp.float32,)
        checks = [("scales", scales)]
        if not four or mins is not None or not kept:
            checks.append(("mins", mins if four else scales))
        for name, a in checks:
            ok = (
                a is not None
                and a.dtype in dtypes
                and a.dtype == scales.dtype
                and a.ndim == 4
                and a.shape[:2] == (w, p)
                and a.shape[3] == nr
                and a.shape[2] > 0
                and k % a.shape[2] == 0
                and (k // a.shape[2]) % multiple == 0
            )
            if not ok:
                got = None if a is None else f"{a.dtype}{list(a.shape)}"
                raise ValueError(
                    f"{name}: {packed.dtype} weights need f32 [{w}, {p}, K / G, {nr}] {name}, "
                    f"G a multiple of {multiple} dividing K={k}; got {got}"
                )
        if four and mins is not None and mins.shape != scales.shape:
            raise ValueError(f"mins: expected scales' shape {scales.shape}, got {mins.shape}")
        extra = (scales, mins) if four and mins is not None else (scales,)
        if not four and mins is not None:
            raise ValueError("mins: int8 weights take no mins here")
    elif scales is not None or mins is not None:
        raise ValueError(
            f"scales, mins: only int8 and 4-bit weights take them, got {packed.dtype} weights"
        )
    _check_kept(packed, scales, mins, high, offset, k)
    if high is not None:
        extra = (*extra, high)
    params = [jnp.asarray(first, jnp.int32), jnp.int32(threads_of(threads))]
    if offset or float_rows:
        params += [jnp.int32(offset), jnp.int32(1 if float_rows else 0)]
    call = jax.ffi.ffi_call(GROUPED_TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    return call(x, packed, *extra, sizes.astype(jnp.int32), jnp.stack(params))


def _check_operands(x, packed, n, layer, scales, mins, rotated) -> tuple[int, int]:
    """``linear``'s checks of ``x``, ``packed``, ``n``, ``layer`` and ``rotated``; returns
    the weight's panels ``P`` and inputs ``K``."""
    four, half = packed.dtype == jnp.uint8, packed.dtype == jnp.bfloat16
    # f32 weights alone; int8 ones with scales (and with grouped scales perhaps mins);
    # 4-bit ones with scales and mins; bf16 ones perhaps with column scales
    if half:
        want = jnp.bfloat16
    elif scales is None:
        want = jnp.float32
    elif four:  # 4-bit: scales, perhaps mins (else an offset)
        want = jnp.uint8
    else:
        want = jnp.int8 if mins is None or packed.dtype == jnp.int8 else jnp.uint8
    if x.dtype != jnp.float32 or packed.dtype != want:
        expected = {
            jnp.float32: "float32",
            jnp.int8: "float32 and int8 (with scales)",
            jnp.uint8: "float32 and uint8 (with scales and mins)",
            jnp.bfloat16: "float32 and bfloat16",
        }[want]
        hint = ""
        if packed.dtype == jnp.int8:
            hint = " (int8 weights need their scales)"
        elif four:
            hint = " (4-bit weights need their scales and mins)"
        raise ValueError(f"x, packed: expected {expected}, got {x.dtype} and {packed.dtype}{hint}")
    nr = panel_width()
    if packed.ndim not in (3, 4) or packed.shape[-1] != nr:
        raise ValueError(f"packed: expected [(L,) P, K, {nr}], got {list(packed.shape)}")
    p, k, _ = packed.shape[-3:]
    if four:
        k *= 2
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(f"x: expected [..., {k}] (packed's K), got {list(x.shape)}")
    if not isinstance(n, int) or not p * nr - nr < n <= p * nr:
        raise ValueError(f"n: expected an int in ({p * nr - nr}, {p * nr}], got {n!r}")
    if packed.ndim == 4 and layer is None:
        raise ValueError(f"layer: expected an index into packed's {packed.shape[0]} weights")
    weights = packed.shape[0] if packed.ndim == 4 else 1
    if isinstance(layer, int) and not 0 <= layer < weights:
        raise ValueError(f"layer: expected an int in [0, {weights}), got {layer}")
    if rotated and (packed.dtype not in (jnp.int8, jnp.uint8) or k % ROTATION):
        raise ValueError(
            f"rotated: needs int8 or 4-bit weights and K a multiple of {ROTATION}, got "
            f"{packed.dtype} weights and K {k}"
        )
    if half:
        if mins is not None:
            raise ValueError("mins: bf16 weights take none (column scales at most)")
        if k % 2:
            raise ValueError(f"packed: bf16 weights need K even, got {list(packed.shape)}")
    return p, k


def _check_scales(packed, extra, p, k) -> None:
    """``linear``'s checks of the ``scales`` (and ``mins``) in ``extra`` against the
    weight's dtype and its ``P`` panels of ``K`` inputs."""
    if not extra:
        return
    nr, lead, scales = panel_width(), packed.shape[:-3], extra[0]
    if packed.dtype == jnp.bfloat16:
        if scales.dtype != jnp.float32 or scales.shape != (*lead, p * nr):
            raise ValueError(
                f"scales: expected float32{[*lead, p * nr]} (pack_scales), got "
                f"{scales.dtype}{list(scales.shape)}"
            )
        return
    groups = scales.shape[-2] if scales.ndim == packed.ndim else 0
    four = packed.dtype == jnp.uint8
    if len(extra) == 2 or four:  # 4-bit weights, or int8 ones with groups
        multiple = 8 if four else 4
        ok = groups > 0 and k % groups == 0 and (k // groups) % multiple == 0
        # 4-bit weights' scales (and mins alike) may be float16
        dtypes = (jnp.float32, jnp.float16) if four else (jnp.float32,)
        for name, a in zip(("scales", "mins")[: len(extra)], extra, strict=True):
            if (
                not ok
                or a.dtype not in dtypes
                or a.dtype != scales.dtype
                or a.shape != (*lead, p, groups, nr)
            ):
                kinds = " or ".join(str(jnp.dtype(d)) for d in dtypes)
                raise ValueError(
                    f"{name}: expected {kinds}[{', '.join(map(str, (*lead, p)))}, K / G, {nr}] "
                    f"(mins as scales) with K / G dividing {k} into groups G a multiple of "
                    f"{multiple}, got {a.dtype}{list(a.shape)}"
                )
        return
    grouped = groups > 0 and k % groups == 0 and (k // groups) % 4 == 0
    if scales.dtype != jnp.float32 or (
        scales.shape != (*lead, p * nr) and not (grouped and scales.shape == (*lead, p, groups, nr))
    ):
        raise ValueError(
            f"scales: expected float32{[*lead, p * nr]} (pack_scales) or float32"
            f"{[*lead, p, 'K / G', nr]} (pack_weight of [K / G, n] scales, G a multiple of 4 "
            f"dividing {k}), got {scales.dtype}{list(scales.shape)}"
        )


def reference_bf16(
    x: np.ndarray,  # f32[M, K]
    w: np.ndarray,  # bf16[K, N]
    scales: np.ndarray | None = None,  # f32[N]
) -> np.ndarray:  # f64[M, N]
    """What ``linear`` computes for bf16 weights (unpacked), in numpy: the rows of ``x``
    rounded to bf16 (to nearest, ties to even), times ``w``, in f64 (so it differs from
    the kernel's f32 sums by their rounding only), times the column ``scales``."""
    import ml_dtypes

    xb = np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    out = xb @ np.asarray(w).astype(np.float64)
    return out if scales is None else out * np.asarray(scales, np.float64)


ROTATION = 32  # inputs a rotation mixes: linear.c's ROTATION


def rotate_blocks(x, axis: int = -1, *, xp=np):
    """``x`` (float, its ``axis`` a multiple of ``ROTATION``) times the orthonormal
    Hadamard matrix of order 32 along ``axis``, each block of 32 entries on its own, in
    f32, as ``linear`` rotates the rows of ``x`` for rotated weights (the same bits: the
    butterflies in ``linear.c``'s order, then the f32 nearest ``1 / sqrt(32)``). The
    matrix is symmetric and its own inverse, so rotating twice gives ``x`` back (to f32
    rounding) and ``rotate_blocks(x) @ rotate_blocks(w, axis=0) = x @ w`` for ``w [K,
    N]``. ``xp``: ``numpy`` (default) or ``jax.numpy`` (traceable)."""
    x = xp.moveaxis(xp.asarray(x, xp.float32), axis, -1)
    shape = x.shape
    if shape[-1] % ROTATION:
        raise ValueError(f"x: expected axis {axis} a multiple of {ROTATION}, got {list(shape)}")
    v = x.reshape(-1, ROTATION)
    h = 1
    while h < ROTATION:
        v = v.reshape(-1, ROTATION // (2 * h), 2, h)
        a, c = v[:, :, 0], v[:, :, 1]
        v = xp.stack([a + c, a - c], axis=2)
        h *= 2
    v = v.reshape(shape) * xp.float32(0.17677669529663687)
    return xp.moveaxis(v, -1, axis)


def quantize_blocks(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows of ``x`` (f32 ``[M, K]``) quantized as ``linear`` quantizes them for
    quantized weights, in numpy: ``(xq int8[M, K], dx f32[M, ceil(K / block)])``. A block
    of ``block`` inputs (the last one the rest of K) with largest magnitude ``a`` has
    ``dx = a / 127`` and ``xq = round(x * (127 / a))`` (ties to even) in [-127, 127], or 0
    and 0 where ``a = 0``."""
    x = np.asarray(x, np.float32)
    m, k = x.shape
    blocks = -(-k // block)
    xq = np.zeros((m, k), np.int8)
    dx = np.zeros((m, blocks), np.float32)
    for g in range(blocks):
        part = x[:, g * block : (g + 1) * block]
        a = np.abs(part).max(axis=1)
        with np.errstate(divide="ignore"):
            inv = np.where(a > 0, np.float32(127) / a, np.float32(0)).astype(np.float32)
        xq[:, g * block : (g + 1) * block] = np.clip(np.rint(part * inv[:, None]), -127, 127)
        dx[:, g] = a / np.float32(127)
    return xq, dx


def reference_quantized(
    x: np.ndarray,  # f32[M, K]
    q: np.ndarray,  # int8[K, N], or uint8[K / 2, N] 4-bit (two rows a byte)
    scales: np.ndarray,  # int8: f32[N] or f32[K / G, N]; 4-bit: f32[K / G, N]
    mins: np.ndarray | None = None,  # 4-bit, int8 with groups: f32[K / G, N]
    rotated: bool = False,
    high: np.ndarray | None = None,  # 4-bit: u8[K bits / 8, N], each weight's high bits
    offset: int = 0,  # 4-bit without mins: the weights are scales * (q - offset)
) -> np.ndarray:  # f64[M, N]
    """What ``linear`` computes for quantized weights (unpacked), in numpy: the rows of
    ``x`` quantized in blocks (``quantize_blocks``: the weights' groups, or 32 inputs for
    int8 weights with a scale per column), each block's exact integer sum against the
    weights, scaled (int8 per column: ``scales[n] * sum over blocks of dx * isum``; int8
    groups: ``sum over blocks of isum * d * dx``; 4-bit and int8 groups with ``mins``:
    that ``+ m * dx * (the block's sum of xq)``: the dequantized weights times the
    quantized rows). ``rotated``: ``q`` holds rotated weights (``linear``'s ``rotated``),
    and the rows are rotated by ``rotate_blocks`` before they are quantized. 4-bit weights
    may come with ``high`` bits (``pack_high``'s input: ``q`` then ``q + 16 h``) and
    without ``mins`` (``mins = -offset * scales``); float16 scales are widened exactly. In
    f64, so it differs from the kernel's f32 sums by their rounding only."""
    x = np.asarray(x, np.float32)
    if rotated:
        x = rotate_blocks(x)
    four, grouped = q.dtype == np.uint8, np.ndim(scales) == 2
    scales = np.asarray(scales, np.float32)
    if four and mins is None:
        mins = np.float32(-offset) * scales
    if mins is not None:
        mins = np.asarray(mins, np.float32)
    if four:
        q = np.stack([q & 15, q >> 4], axis=-2).reshape(2 * q.shape[0], q.shape[1])
        if high is not None:
            bits = high.shape[0] * 8 // q.shape[0]
            shifts = np.arange(8 // bits, dtype=np.uint8) * bits
            h = (high[:, None, :] >> shifts[:, None]) & ((1 << bits) - 1)
            q = q | (h.reshape(q.shape) << 4)
    k = x.shape[1]
    block = k // scales.shape[0] if grouped else 32
    xq, dx = quantize_blocks(x, block)
    out = np.zeros((x.shape[0], q.shape[1]))
    for g in range(dx.shape[1]):
        sl = slice(g * block, (g + 1) * block)
        isum = xq[:, sl].astype(np.int64) @ q[sl].astype(np.int64)
        if grouped:
            out += isum * (scales[g].astype(np.float64) * dx[:, g, None])
            if mins is not None:
                xs = np.float32(xq[:, sl].astype(np.int64).sum(axis=1)) * dx[:, g]
                out += mins[g] * xs.astype(np.float64)[:, None]
        else:
            out += isum * dx[:, g, None].astype(np.float64)
    return out if grouped else out * scales.astype(np.float64)


def lora_delta(
    x: jax.Array,  # f32[T, K]
    a: jax.Array,  # f32[L, K, S R]
    b: jax.Array,  # f32[L, S R, N]
    ids: jax.Array,  # i32[T]: each row's slot plus one, 0 for none
    layer: jax.Array | int,
    rank: int,
    *,
    threads: int | None = None,
) -> jax.Array:  # f32[T, N]
    """``(x[t] @ a[layer][:, s R : s R + R]) @ b[layer][s R : s R + R]`` for each row t of
    slot ``s = ids[t] - 1`` (zeros where ``ids[t]`` is 0 or past the slots), by
    ``lora.c``: the layer's banks read in place (``layer``: an int or a traced i32
    scalar), each row only its own slot's columns, each output one f32 sum in a fixed
    order (a row's result depends on no other row). Raises ``ValueError`` for other
    dtypes or shapes, a ``rank`` that does not divide the banks' width, or a static
    ``layer`` out of range, and when the kernels are not available."""
    for name, v, nd in (("x", x, 2), ("a", a, 3), ("b", b, 3)):
        if v.dtype != jnp.float32 or v.ndim != nd:
            raise ValueError(
                f"{name}: expected a float32 array of rank {nd}, got {v.dtype}{list(v.shape)}"
            )
    T, K = x.shape
    L, _, SR = a.shape
    if a.shape[1] != K or b.shape[:2] != (L, SR):
        raise ValueError(
            f"a, b: expected [L, {K}, S R] and [L, S R, N] (x: {list(x.shape)}), got "
            f"{list(a.shape)} and {list(b.shape)}"
        )
    if ids.dtype != jnp.int32 or ids.shape != (T,):
        raise ValueError(f"ids: expected int32[{T}], got {ids.dtype}{list(ids.shape)}")
    if not isinstance(rank, int) or not 1 <= rank <= 1024 or SR % rank:
        raise ValueError(f"rank: expected an int in [1, 1024] dividing {SR}, got {rank!r}")
    if isinstance(layer, int) and not 0 <= layer < L:
        raise ValueError(f"layer: expected an int in [0, {L}), got {layer}")
    require()
    params = jnp.stack(
        [jnp.asarray(layer, jnp.int32), jnp.int32(rank), jnp.int32(threads_of(threads))]
    )
    call = jax.ffi.ffi_call(LORA_TARGET, jax.ShapeDtypeStruct((T, b.shape[2]), jnp.float32))
    return call(x, a, b, ids, params)
