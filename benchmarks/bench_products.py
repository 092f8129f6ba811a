"""A decoder's matrix products per layer, each projection its own weight against q/k/v
and gate/up fused into one weight each, at the engine's decode row counts.

``python -m benchmarks products [--shape llama3-8b] [--rows 64 256] [--repeats 20]
[--formats fp8 int8]``, written to ``products_<backend>.json``.

Per-layer weights (the engine's layout off the CPU), the layers unrolled, bf16 off the
CPU (f32 on it), random weights: ``separate`` multiplies by q, k, v, o, gate, up and down
one at a time (7 products a layer, as ``models.llama`` computes them); ``fused`` by
``[q | k | v]``, o, ``[gate | up]`` and down (4 products a layer, the same FLOPs and
bytes). With ``--formats``, the fused layout again with 8-bit weights (one f32 scale per
output channel, ``models.quantization``), each format two ways: ``W8A16`` widens the
weight to bf16 in the product (what ``models.llama`` computes), ``W8A8`` quantizes each
row of activations to the format too (one scale a row) and multiplies 8-bit by 8-bit
(fp8 accumulating in f32, int8 in int32), scales applied after; and for fp8 ``W8A8,
[out, in]``, the weight held transposed (the contracted axis minor, as the fp8 GEMMs of
Hopper read both operands). Each way's step (every layer, no attention: the heads'
outputs are q itself) is timed alone, the median of ``--repeats``, with the weights'
bytes over that time and the FLOPs over it; an 8-bit way also gives one layer's relative
error against the bf16 fused layer. What fusing would save a decode step of the engine
is the difference.
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.common import environment, positive_int, table, time_samples, write_result

WAYS = {  # --formats' ways: (weight format, 8-bit activations, weight [out, in], kernel)
    "fp8": [("fp8", False, False, None), ("fp8", True, False, None), ("fp8", True, True, None)],
    "int8": [("int8", False, False, None), ("int8", True, False, None)],
    # 4-bit groups of 32: XLA on the dequantized weight (what models.llama computes off the
    # GPU), and the Pallas kernel that reads the weight as it lies (its way on a GPU)
    "int4": [("int4", False, False, None), ("int4", False, False, "matmul_int4")],
}


def _label(fmt, a8, transposed, kernel) -> str:
    bits = 4 if fmt == "int4" else 8
    label = "fused" if fmt is None else f"fused, {fmt} W{bits}A{8 if a8 else 16}"
    label += ", [out, in]" if transposed else ""
    if isinstance(kernel, str):
        return label + f", Pallas {kernel}"
    return label + (f", Pallas {':'.join(map(str, kernel))}" if kernel else "")


def _kernel_config(text: str) -> tuple:
    """``BLOCK_N:BLOCK_K:WARPS:STAGES[:p]`` of ``--pallas`` (``p``: the weight's next chunk
    loaded ahead, ``matmul(prefetch=True)``)."""
    parts = text.split(":")
    ahead = len(parts) == 5 and parts[4] == "p"
    nums = parts[:4] if ahead else parts
    if len(nums) != 4 or not all(p.isdigit() and int(p) > 0 for p in nums):
        raise argparse.ArgumentTypeError(
            f"expected BLOCK_N:BLOCK_K:WARPS:STAGES[:p] (positive integers), got {text!r}"
        )
    return (*map(int, nums), "p") if ahead else tuple(map(int, nums))


def _weights(fields: dict, fused: bool, dtype, seed: int = 0, fmt=None):
    """Per-layer weights (``fmt``: ``(format, a8, transposed)`` of ``WAYS``: each weight a
    ``(q, scale)`` pair, ``q`` [out, in] when transposed), and the widths."""
    import jax
    import jax.numpy as jnp

    E, F, L = fields["hidden_size"], fields["intermediate_size"], fields["num_layers"]
    HD = fields["num_heads"] * fields["head_dim"]
    KD = fields["num_kv_heads"] * fields["head_dim"]
    shapes = {"q": (E, HD), "k": (E, KD), "v": (E, KD), "o": (HD, E), "gate": (E, F)}
    shapes |= {"up": (E, F), "down": (F, E)}
    key = jax.random.key(seed)
    layers = []
    for i in range(L):
        w = {}
        for j, (name, shape) in enumerate(shapes.items()):
            k = jax.random.fold_in(key, i * 16 + j)
            w[name] = (jax.random.normal(k, shape, jnp.float32) * shape[0] ** -0.5).astype(dtype)
        if fused:
            w = dict(
                qkv=jnp.concatenate([w.pop("q"), w.pop("k"), w.pop("v")], axis=1),
                gate_up=jnp.concatenate([w.pop("gate"), w.pop("up")], axis=1),
                o=w["o"],
                down=w["down"],
            )
        if fmt is not None and fmt[0] is not None:
            w = {n: _quantized(a, *fmt[:3]) for n, a in w.items()}
        layers.append(w)
    return tuple(layers), HD, KD, F


def _quantized(w, fmt: str, a8: bool, transposed: bool):
    """``(q, scale)``: ``w [in, out]`` in ``fmt`` with one scale an output channel, ``q``
    transposed to ``[out, in]`` when ``transposed``; for ``"int4"``, ``(packed, scale,
    zero)`` in groups of 32 inputs (``quantization.quantize_int4``)."""
    import jax.numpy as jnp

    from paged_jax.models import quantization as quant

    if fmt == "int4":
        return tuple(jnp.asarray(a) for a in quant.quantize_int4(w, -2))

    q, scale = (quant.quantize_fp8 if fmt == "fp8" else quant.quantize_int8)(w, -2)
    return (q.T if transposed else q), scale


def product(x, w, fmt=None):
    """``x [M, in] @ w`` for a float ``w [in, out]``, or a ``(q, scale)`` pair of ``fmt``
    (``(format, a8, transposed, kernel)``; ``kernel``: the Pallas GPU product's
    ``(block_n, block_k, warps, stages)``, None: XLA's): the output in ``x``'s dtype."""
    import jax
    import jax.numpy as jnp

    from paged_jax._quant import quantize_rows

    if fmt is None:
        return x @ w
    name, a8, transposed, kernel = fmt
    if name == "int4":
        from paged_jax.kernels.gpu import matmul as kmm
        from paged_jax.models.quantization import dequantize_int4

        packed, scale, zero = w
        if kernel is None:  # XLA: the weight dequantized first
            return x @ dequantize_int4(packed, scale, zero, axis=-2, dtype=x.dtype)
        config = kmm.grouped_config(x.shape[0], 2 * packed.shape[0], packed.shape[1])
        interpret = jax.default_backend() != "gpu"
        return kmm.matmul_int4(x, packed, scale, zero, interpret=interpret, **config)
    q, scale = (w, None) if name is None else w
    if kernel is not None:
        from paged_jax.kernels.gpu import matmul as kmm

        bn, bk, warps, stages = kernel[:4]
        M, (K, N) = x.shape[0], q.shape
        split = kmm.default_split_k(M, K, N, q.dtype.itemsize, bn, bk)
        interpret = jax.default_backend() != "gpu"
        return kmm.matmul(
            x, q, scale, block_n=bn, block_k=bk, split_k=split, num_warps=warps,
            num_stages=stages, interpret=interpret, prefetch=kernel[4:] == ("p",),
        )  # fmt: skip
    dims = (((1,), (1 if transposed else 0,)), ((), ()))
    if not a8:
        y = jax.lax.dot_general(x, q.astype(x.dtype), dims, preferred_element_type=jnp.float32)
        return (y * scale[None, :]).astype(x.dtype)
    dtype = jnp.float8_e4m3fn if name == "fp8" else jnp.int8
    xq, xs = quantize_rows(x, dtype)
    acc = jnp.float32 if name == "fp8" else jnp.int32
    y = jax.lax.dot_general(xq, q, dims, preferred_element_type=acc)
    return (y.astype(jnp.float32) * xs[:, None] * scale[None, :]).astype(x.dtype)


def step_fn(fused: bool, HD: int, KD: int, F: int, fmt=None):
    """``f(layers, x[M, E]) -> x``: every layer's products (no attention), unrolled."""
    import functools

    import jax

    mm = functools.partial(product, fmt=fmt)

    def f(layers, x):
        for w in layers:
            if fused:
                qkv = mm(x, w["qkv"])
                q, k, v = qkv[:, :HD], qkv[:, HD : HD + KD], qkv[:, HD + KD :]
                gu_in = x + mm(q, w["o"])
                gu = mm(gu_in, w["gate_up"])
                g, u = gu[:, :F], gu[:, F:]
            else:
                q, k, v = x @ w["q"], x @ w["k"], x @ w["v"]
                gu_in = x + (q @ w["o"])
                g, u = gu_in @ w["gate"], gu_in @ w["up"]
            x = gu_in + mm(jax.nn.silu(g) * u, w["down"])
            x = x + (k.sum() + v.sum()).astype(x.dtype) * 0  # k and v are used
        return x

    return jax.jit(f)


def _time(f, layers, x, repeats: int) -> float:
    """Median seconds of ``f(layers, x)`` after a compiling call."""
    import jax

    jax.block_until_ready(f(layers, x))
    return statistics.median(
        time_samples(lambda: jax.block_until_ready(f(layers, x)), repeats=repeats)
    )


def main(argv=None) -> int:
    from benchmarks.engine_roofline import SHAPE_FIELDS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPE_FIELDS))
    ap.add_argument("--rows", type=positive_int, nargs="+", default=[64, 256])
    ap.add_argument("--repeats", type=positive_int, default=20)
    ap.add_argument(
        "--formats",
        nargs="*",
        default=[],
        choices=sorted(WAYS),
        help="also the fused layout with 8-bit weights, each format's ways (W8A16, W8A8), "
        "or 4-bit groups (int4: XLA on the dequantized weight, the Pallas kernel)",
    )
    ap.add_argument(
        "--pallas",
        nargs="*",
        default=[],
        type=_kernel_config,
        metavar="BLOCK_N:BLOCK_K:WARPS:STAGES[:p]",
        help="also the fused layout through the Pallas GPU product (pallas_kernels.gpu."
        "matmul) at each configuration, for each of --pallas-formats (:p: the weight's "
        "next chunk loaded ahead)",
    )
    ap.add_argument(
        "--pallas-formats",
        nargs="+",
        default=["bf16", "int8", "fp8"],
        choices=["bf16", "int8", "fp8"],
        help="the weights --pallas multiplies by (8-bit ones W8A16)",
    )
    ap.add_argument("--no-separate", action="store_true", help="skip the 7-product way")
    args = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp

    fields = SHAPE_FIELDS[args.shape]
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    E, L = fields["hidden_size"], fields["num_layers"]
    results = []
    ways = [(False, None)] * (not args.no_separate) + [(True, None)]
    ways += [(True, f) for n in args.formats for f in WAYS[n]]
    ways += [
        (True, (None if n == "bf16" else n, False, False, cfg))
        for cfg in args.pallas
        for n in args.pallas_formats
    ]
    first_layer = None  # the float fused layout's first layer: the 8-bit ways' reference
    for fused, fmt in ways:
        layers, HD, KD, F = _weights(fields, fused, dtype, fmt=fmt)
        nbytes = sum(a.nbytes for w in layers for a in jax.tree.leaves(w))
        n_weights = sum(
            (a[0] if isinstance(a, tuple) else a).size
            * (2 if isinstance(a, tuple) and len(a) == 3 else 1)
            for w in layers
            for a in w.values()
        )  # (an int4 weight: two values a byte of its packed array)
        f = step_fn(fused, HD, KD, F, fmt)
        for m in args.rows:
            x = jax.random.normal(jax.random.key(m), (m, E), jnp.float32).astype(dtype)
            t = _time(f, layers, x, args.repeats)
            way = _label(*fmt) if fmt else ("fused" if fused else "separate")
            row = dict(
                way=way,
                rows=m,
                ms=1e3 * t,
                weight_gb_per_s=nbytes / t / 1e9,
                tflops=2 * m * n_weights / t / 1e12,
            )
            if fmt is not None:  # how far from the float product, one layer's worth
                ref = step_fn(True, HD, KD, F)(first_layer, x)
                got = f(layers[:1], x)
                err = jnp.linalg.norm((got - ref).astype(jnp.float32))
                row["relative_error"] = float(err / jnp.linalg.norm(ref.astype(jnp.float32)))
            results.append(row)
            print(f"{way} rows={m}: {1e3 * t:.2f} ms", flush=True)
        if fused and fmt is None:
            first_layer = layers[:1]
        del layers
    path = write_result(
        f"products_{jax.default_backend()}",
        dict(
            benchmark="products",
            environment=environment(with_jax=True),
            parameters=dict(
                shape=args.shape,
                fields=fields,
                rows=args.rows,
                layers=L,
                dtype=str(jnp.dtype(dtype)),
                repeats=args.repeats,
            ),  # fmt: skip
            results=results,
        ),
    )
    cols = ["way", "rows", "ms", "weight_gb_per_s", "tflops"]
    print(table(results, cols + ["relative_error"] * bool(args.formats or args.pallas), digits=3))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
