"""Decode attention of every layer of one step, with each layer's pages passed three ways.

``python -m benchmarks layer_view [--out DIR] [--layers 32] [--pages 4608] [--batch 64]
[--context 192] [--repeats 20]``

The pool is one ``[L, N, P, 2K, D]`` array (Hq 32, Hkv 8, D 128, bf16, page 16: the
Llama-3-8B shape). Per step, ``paged_attention`` runs once per layer on:

* ``slice``: ``cache.layer(l)``, i.e. ``kv_pages[l]``. Feeding a slice to a Pallas kernel
  makes XLA copy the layer out of the pool first (``N * P * 2K * D`` elements per layer).
* ``view``: ``cache.attention_inputs(l, tables)``, the pool reshaped to ``[L * N, ...]``
  (a bitcast) with the tables shifted by ``l * N``; what the models use.
* ``separate arrays``: L arrays of ``[N, P, 2K, D]`` built beforehand, the lower bound.

Prints the median ms per step (all layers) of each way and writes ``layer_view_<platform>
.json``. On a CPU (the XLA backend, no kernel) the three should be about equal.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from benchmarks.common import environment, positive_int, table, time_samples, write_result

HQ, HKV, D, PAGE = 32, 8, 128, 16


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=positive_int, default=32)
    ap.add_argument("--pages", type=positive_int, default=4608, help="pages per layer (N)")
    ap.add_argument("--batch", type=positive_int, default=64)
    ap.add_argument("--context", type=positive_int, default=192)
    ap.add_argument("--repeats", type=positive_int, default=20)
    ap.add_argument(
        "--heads", type=positive_int, nargs=3, default=[HQ, HKV, D], metavar=("HQ", "HKV", "D")
    )
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    M = -(-args.context // PAGE)
    if args.batch * M >= args.pages:
        ap.error(f"--pages: expected > batch * pages per sequence = {args.batch * M}")
    import jax
    import jax.numpy as jnp
    import numpy as np

    import paged_jax as pj

    hq, hkv, d = args.heads
    L, N, B = args.layers, args.pages, args.batch
    rng = np.random.default_rng(0)
    pages = rng.permutation(np.arange(1, N))[: B * M].reshape(B, M).astype(np.int32)
    tables = jnp.asarray(pages)
    lens = jnp.full((B,), args.context, jnp.int32)
    q = jax.random.normal(jax.random.key(0), (B, hq, d), jnp.bfloat16)
    kv = jax.random.normal(jax.random.key(1), (L, N, PAGE, 2 * hkv, d), jnp.bfloat16)
    cache = pj.PagedKVCache(kv, None, L, PAGE, hkv, d)
    layers = [kv[i] for i in range(L)]
    scale = d**-0.5

    @jax.jit
    def by_slice(q, cache):
        return sum(
            pj.paged_attention(q, cache.layer(i)[0], lens, tables, sm_scale=scale).astype(
                jnp.float32
            )
            for i in range(L)
        )

    @jax.jit
    def by_view(q, cache):
        out = 0.0
        for i in range(L):
            pool, t, _, _ = cache.attention_inputs(i, tables)
            out += pj.paged_attention(q, pool, lens, t, sm_scale=scale).astype(jnp.float32)
        return out

    @jax.jit
    def by_arrays(q, layers):
        return sum(
            pj.paged_attention(q, a, lens, tables, sm_scale=scale).astype(jnp.float32)
            for a in layers
        )

    ways = {
        "slice": (by_slice, cache),
        "view": (by_view, cache),
        "separate arrays": (by_arrays, layers),
    }
    ref = np.asarray(by_arrays(q, layers))
    rows = []
    for name, (fn, arg) in ways.items():
        err = float(np.max(np.abs(np.asarray(fn(q, arg)) - ref)))
        samples = time_samples(
            lambda f=fn, a=arg: jax.block_until_ready(f(q, a)), repeats=args.repeats
        )
        ms = [1e3 * s for s in samples]
        rows.append(
            dict(
                way=name,
                ms_min=min(ms),
                ms=statistics.median(ms),
                ms_max=max(ms),
                max_abs_diff_vs_arrays=err,
            )
        )
    kv_bytes = B * args.context * 2 * hkv * d * 2 * L
    layer_bytes = N * PAGE * 2 * hkv * d * 2
    print(
        table(
            [{k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows],
            ["way", "ms_min", "ms", "ms_max", "max_abs_diff_vs_arrays"],
        )
    )
    path = write_result(
        f"layer_view_{jax.default_backend()}",
        {
            "benchmark": "layer_view",
            "environment": environment(with_jax=True),
            "parameters": dict(
                vars(args), page_size=PAGE, dtype="bfloat16", backend=pj.attention._auto()
            ),
            "kv_bytes_read_per_step": kv_bytes,
            "layer_pool_bytes": layer_bytes,
            "results": rows,
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
