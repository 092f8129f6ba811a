"""A decoder's matrix products per layer, each projection its own weight against q/k/v
and gate/up fused into one weight each, at the engine's decode row counts.

``python -m benchmarks products [--shape llama3-8b] [--rows 64 256] [--repeats 20]``,
written to ``products_<backend>.json``.

Per-layer weights (the engine's layout off the CPU), the layers unrolled, bf16 off the
CPU (f32 on it), random weights: ``separate`` multiplies by q, k, v, o, gate, up and down
one at a time (7 products a layer, as ``models.llama`` computes them); ``fused`` by
``[q | k | v]``, o, ``[gate | up]`` and down (4 products a layer, the same FLOPs and
bytes). Each way's step (every layer, no attention: the heads' outputs are q itself)
is timed alone, the median of ``--repeats``, with the weights' bytes over that time and
the FLOPs over it. What fusing would save a decode step of the engine is the difference.
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.common import environment, positive_int, table, time_samples, write_result


def _weights(fields: dict, fused: bool, dtype, seed: int = 0):
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
        layers.append(w)
    return tuple(layers), HD, KD, F


def step_fn(fused: bool, HD: int, KD: int, F: int):
    """``f(layers, x[M, E]) -> x``: every layer's products (no attention), unrolled."""
    import jax

    def f(layers, x):
        for w in layers:
            if fused:
                qkv = x @ w["qkv"]
                q, k, v = qkv[:, :HD], qkv[:, HD : HD + KD], qkv[:, HD + KD :]
                gu_in = x + (q @ w["o"])
                gu = gu_in @ w["gate_up"]
                g, u = gu[:, :F], gu[:, F:]
            else:
                q, k, v = x @ w["q"], x @ w["k"], x @ w["v"]
                gu_in = x + (q @ w["o"])
                g, u = gu_in @ w["gate"], gu_in @ w["up"]
            x = gu_in + (jax.nn.silu(g) * u) @ w["down"]
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
    from benchmarks.bench_engine import SHAPE_FIELDS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPE_FIELDS))
    ap.add_argument("--rows", type=positive_int, nargs="+", default=[64, 256])
    ap.add_argument("--repeats", type=positive_int, default=20)
    args = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp

    fields = SHAPE_FIELDS[args.shape]
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    E, L = fields["hidden_size"], fields["num_layers"]
    results = []
    for fused in (False, True):
        layers, HD, KD, F = _weights(fields, fused, dtype)
        nbytes = sum(a.nbytes for w in layers for a in w.values())
        f = step_fn(fused, HD, KD, F)
        for m in args.rows:
            x = jax.random.normal(jax.random.key(m), (m, E), jnp.float32).astype(dtype)
            t = _time(f, layers, x, args.repeats)
            flops = 2 * m * nbytes / jnp.dtype(dtype).itemsize
            results.append(
                dict(
                    way="fused" if fused else "separate",
                    rows=m,
                    ms=1e3 * t,
                    weight_gb_per_s=nbytes / t / 1e9,
                    tflops=flops / t / 1e12,
                )
            )
            print(f"{results[-1]['way']} rows={m}: {1e3 * t:.2f} ms", flush=True)
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
    print(table(results, ["way", "rows", "ms", "weight_gb_per_s", "tflops"], digits=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
