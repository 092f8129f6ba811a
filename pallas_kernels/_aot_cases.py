"""The shapes and case grid both ahead-of-time checks (``gpu/aot.py``, ``tpu/aot.py``)
build their kernels at: abstract arguments only, nothing is computed."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def attention_case(
    kernel: Callable,
    kind: str,
    dtype="bfloat16",
    *,
    seqs: int = 8,
    pages: int = 64,
    tokens: int = 256,
    heads: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    page: int = 16,
    **kernel_kw,
) -> tuple[Callable, list]:
    """``(fn, args)``: ``kernel`` (a decode or ragged attention with the project's argument
    order; ``kind``: "decode" or "ragged") over ``seqs`` sequences of ``pages`` pages
    (``tokens`` ragged query tokens). Quantized pools get per-token scales and bf16
    queries."""
    S = jax.ShapeDtypeStruct
    quantized = jnp.dtype(dtype).itemsize == 1
    n = seqs * pages + 1
    args = [
        S(
            (tokens if kind == "ragged" else seqs, heads, head_dim),
            "bfloat16" if quantized else dtype,
        ),
        S((n, page, 2 * kv_heads, head_dim), dtype),
        S((seqs,), "int32"),
        S((seqs, pages), "int32"),
    ]
    if kind == "ragged":
        args += [S((seqs + 1,), "int32"), S((1,), "int32")]
    num = len(args)
    if quantized:
        args += [S((n, page, kv_heads), "float32")] * 2

    def fn(*a):
        ks, vs = (a[num], a[num + 1]) if len(a) > num else (None, None)
        return kernel(*a[:num], sm_scale=0.1, k_scale=ks, v_scale=vs, **kernel_kw)

    return fn, args


def sinks_case(kernel: Callable, kind: str, **kernel_kw) -> tuple[Callable, list]:
    """``attention_case`` at GPT-OSS-20B's attention (64 query and 8 KV heads of 64, a
    window of 128) with its sinks, an ``f32[H]`` operand after the case's; ``kernel_kw``
    to the kernel."""
    _, args = attention_case(kernel, kind, heads=64, kv_heads=8, head_dim=64)

    def fn(*a):
        return kernel(*a[:-1], sm_scale=0.125, sliding_window=128, sinks=a[-1], **kernel_kw)

    return fn, [*args, jax.ShapeDtypeStruct((64,), "float32")]


def standard_grid(kind: str) -> dict[str, dict]:
    """Label -> ``attention_case`` keywords: every pool dtype at D 128 / page 16 / group 4;
    head dims 64 and 256; pages 8 and 32; groups 1 and 8; window + soft cap."""
    grid = {}
    for dtype in ("bfloat16", "float16", "float32", "int8", "float8_e4m3fn"):
        grid[f"{kind} {dtype} D128 P16 G4"] = dict(dtype=dtype)
    for head_dim in (64, 256):
        for dtype in ("bfloat16", "float32"):
            grid[f"{kind} {dtype} D{head_dim} P16 G4"] = dict(dtype=dtype, head_dim=head_dim)
    for page in (8, 32):
        grid[f"{kind} bfloat16 D128 P{page} G4"] = dict(page=page)
    grid[f"{kind} bfloat16 D128 P16 G1"] = dict(heads=8)
    grid[f"{kind} bfloat16 D128 P16 G8"] = dict(heads=64)
    grid[f"{kind} bfloat16 D128 P16 G4 window+softcap"] = dict(sliding_window=1024, soft_cap=30.0)
    return grid


def grouped_case(
    kernel: Callable,
    w_dtype="bfloat16",
    *,
    block_m: int = 16,
    pairs: int = 512,
    experts: int = 128,
    inputs: int = 2048,
    outputs: int = 768,
    **kernel_kw,
) -> tuple[Callable, list]:
    """``(fn, args)``: ``kernel`` (a ``grouped_matmul``) of bf16 rows by ``experts`` weights
    ``[inputs, outputs]`` of ``w_dtype`` (int8: with column scales) over the tiles of
    ``pairs`` (token, expert) pairs. The defaults: a Qwen3-30B-A3B-shaped decode step of
    64 sequences (8 experts each of 128) at gate's / up's product; down's is ``inputs=768,
    outputs=2048``."""
    from ._groups import num_tiles

    S = jax.ShapeDtypeStruct
    tiles = num_tiles(pairs, experts, block_m)
    args = [
        S((tiles * block_m, inputs), "bfloat16"),
        S((experts, inputs, outputs), w_dtype),
        S((tiles,), "int32"),
        S((1,), "int32"),
    ]
    if jnp.dtype(w_dtype) == jnp.int8:
        args.append(S((experts, outputs), "float32"))
    return (lambda *a: kernel(*a, block_m=block_m, **kernel_kw)), args
