"""Decode-attention kernels: time, achieved bandwidth, and the cost of paging.

``python -m benchmarks kernels [--batches ...] [--contexts ...] [--repeats N]``

Decode attention with Hq=32, Hkv=8, D=128, bf16, page 16, a random page permutation, for
each batch x context. Measured in one run on one device:

* copy bandwidth: a large device-to-device copy (read + write bytes / time);
* this project's kernel for the platform (Pallas GPU on NVIDIA, Pallas TPU on TPU once
  built) on the paged cache, and on a contiguous layout of the same cache (each sequence's
  pages consecutive: the cost of paging);
* JAX's Pallas GPU ``paged_attention`` (GPU only), and the ``"xla"`` gather + dot backend.

Achieved bandwidth = K and V bytes that must be read (B * context * 2 * Hkv * D * 2) / time.
On a machine without an accelerator only the XLA backend runs, at reduced sizes, and the
results say so: interpret-mode kernels are never timed (their times say nothing about speed).
Goals (GPU issue): >= 85% of copy bandwidth at batch 64 x 4k and above, >= 2x JAX's op,
paging overhead <= 10%.

``--tune`` (GPU): also times the Pallas GPU decode kernel over ``TUNE_GRID`` (pages per
block x warps x stages) for every case and reports the fastest next to the default, so one
run on a lent GPU says what ``pallas_kernels/gpu/tuning.py`` should choose.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import environment, progress, table, write_result

HQ, HKV, D, PAGE = 32, 8, 128, 16
DTYPE = jnp.bfloat16
# Peak HBM bandwidth / bf16 matmul throughput by device kind (vendor figures), for the
# fraction-of-peak columns; measured copy bandwidth is the primary reference.
PEAKS = {
    "TPU v5 lite": (819e9, 197e12),
    "TPU v6 lite": (1640e9, 918e12),
    "NVIDIA H100 80GB HBM3": (3.35e12, 989e12),
    "NVIDIA H200": (4.8e12, 989e12),
}


def _time(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(repeats: int) -> float:
    nbytes = (1 << 30) if jax.default_backend() != "cpu" else (1 << 28)
    x = jnp.ones(nbytes // 4, jnp.float32)
    f = jax.jit(lambda a: a + 0.0)  # reads and writes every byte once
    return 2 * nbytes / _time(f, x, repeats=repeats)


def make_inputs(batch: int, context: int, *, contiguous: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    pages_per_seq = context // PAGE
    num_pages = batch * pages_per_seq + 1
    order = np.arange(1, num_pages) if contiguous else rng.permutation(np.arange(1, num_pages))
    table = order.reshape(batch, pages_per_seq).astype(np.int32)
    key = jax.random.key(seed)
    kv = jax.random.normal(key, (num_pages, PAGE, 2 * HKV, D), DTYPE)
    q = jax.random.normal(jax.random.fold_in(key, 1), (batch, HQ, D), DTYPE)
    lens = jnp.full((batch,), context, jnp.int32)
    return q, kv, lens, jnp.asarray(table)


# Knobs swept by --tune: pages of 16 tokens per block (2-8: 32-128 tokens), warps, stages.
# Every point compiles for sm_90 within the SM's limits (tests/test_benchmarks.py).
TUNE_GRID = [
    dict(pages_per_block=bp, num_warps=w, num_stages=st)
    for bp in (2, 4, 8)
    for w in (4, 8)
    for st in (2, 3)
]


def tune_decode(inputs, repeats: int) -> list[dict]:
    """Times the Pallas GPU decode kernel at every ``TUNE_GRID`` point (GPU only)."""
    from pallas_kernels.gpu import decode_paged_attention

    out = []
    for knobs in TUNE_GRID:
        f = jax.jit(functools.partial(decode_paged_attention, **knobs))
        try:
            out.append(dict(knobs, ms=1e3 * _time(f, *inputs, repeats=repeats)))
        except Exception as e:  # a point that cannot launch says why
            out.append(dict(knobs, error=str(e)[:200]))
    return out


def kernels_for_platform(platform: str) -> dict:
    import paged_jax as pj

    out = {"xla (gather + dot)": functools.partial(pj.paged_attention, backend="xla")}
    if platform == "gpu":
        from jax.experimental.pallas.ops.gpu import paged_attention as jax_gpu

        out["pallas_gpu (this project)"] = functools.partial(
            pj.paged_attention, backend="pallas_gpu"
        )

        def jax_op(q, kv, lens, table):
            k = jnp.transpose(kv[:, :, 0::2], (2, 0, 1, 3))
            v = jnp.transpose(kv[:, :, 1::2], (2, 0, 1, 3))
            return jax_gpu.paged_attention(q, k, v, table, lens)

        out["jax pallas gpu paged_attention"] = jax_op
    if platform == "tpu":
        out["pallas_tpu (this project)"] = functools.partial(
            pj.paged_attention, backend="pallas_tpu"
        )
    return out


def main(argv=None) -> int:
    platform = jax.default_backend()
    on_cpu = platform == "cpu"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--batches", type=int, nargs="+", default=[1, 8, 64] if on_cpu else [1, 8, 64, 256]
    )
    ap.add_argument(
        "--contexts", type=int, nargs="+", default=[512, 4096] if on_cpu else [512, 4096, 32768]
    )
    ap.add_argument("--repeats", type=int, default=5 if on_cpu else 20)
    ap.add_argument("--tune", action="store_true", help="GPU: sweep the decode kernel's knobs")
    args = ap.parse_args(argv)
    if args.tune and platform != "gpu":
        ap.error("--tune times the Pallas GPU kernel: it needs a GPU")
    tuned = []
    env = environment(with_jax=True)
    bw = copy_bandwidth(args.repeats)
    kernels = kernels_for_platform(platform)
    peaks = PEAKS.get(env["device_kind"])
    rows = []
    cases = [(b, c) for b in args.batches for c in args.contexts]
    with progress(len(cases), "kernels") as bar:
        for b, c in cases:
            kv_bytes = b * c * 2 * HKV * D * jnp.dtype(DTYPE).itemsize
            paged = make_inputs(b, c, contiguous=False)
            contiguous = make_inputs(b, c, contiguous=True)
            for name, fn in kernels.items():
                f = jax.jit(fn)
                try:
                    t = _time(f, *paged, repeats=args.repeats)
                except Exception as e:  # a kernel that cannot run a shape says why
                    rows.append(dict(batch=b, context=c, kernel=name, error=str(e)[:200]))
                    continue
                row = dict(
                    batch=b,
                    context=c,
                    kernel=name,
                    ms=1e3 * t,
                    gbps=kv_bytes / t / 1e9,
                    frac_copy_bw=kv_bytes / t / bw,
                )
                if peaks:  # fractions of the chip's published HBM and matmul peaks
                    flops = 4 * b * c * HQ * D  # q.k and p.v, 2 FLOP per multiply-add
                    row["frac_peak_hbm"] = kv_bytes / t / peaks[0]
                    row["mxu_util"] = flops / t / peaks[1]
                if "this project" in name or name.startswith("xla"):
                    tc = _time(f, *contiguous, repeats=args.repeats)
                    row["paging_overhead"] = t / tc - 1
                rows.append(row)
            if args.tune:
                points = tune_decode(paged, args.repeats)
                timed = [p for p in points if "ms" in p]
                best = min(timed, key=lambda p: p["ms"]) if timed else None
                tuned.append(dict(batch=b, context=c, best=best, points=points))
                if best:
                    rows.append(
                        dict(
                            batch=b,
                            context=c,
                            kernel="pallas_gpu tuned: "
                            + ",".join(f"{k}={best[k]}" for k in TUNE_GRID[0]),
                            ms=best["ms"],
                            gbps=kv_bytes / (best["ms"] / 1e3) / 1e9,
                            frac_copy_bw=kv_bytes / (best["ms"] / 1e3) / bw,
                        )
                    )
            bar.advance()
    shown = [{k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows]
    print(f"device: {env['device_kind']} ({platform}); copy bandwidth {bw / 1e9:.1f} GB/s")
    if on_cpu:
        print(
            "no accelerator: only the XLA backend is timed; Pallas kernels run in interpret "
            "mode in the tests, and interpret-mode times are not speed"
        )
    print(
        table(
            shown,
            [
                "batch",
                "context",
                "kernel",
                "ms",
                "gbps",
                "frac_copy_bw",
                "paging_overhead",
                "frac_peak_hbm",
                "mxu_util",
            ],
        )
    )
    path = write_result(
        f"kernels_{platform}",
        {
            "benchmark": "kernels",
            "environment": env,
            "copy_bandwidth_gbps": bw / 1e9,
            "peaks": peaks,
            "parameters": dict(
                hq=HQ,
                hkv=HKV,
                head_dim=D,
                page_size=PAGE,
                dtype="bfloat16",
                batches=args.batches,
                contexts=args.contexts,
                repeats=args.repeats,
            ),
            "results": rows,
            "tuning": tuned,
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
