"""Attention kernels: time, achieved bandwidth, the cost of paging, ragged prefill FLOP/s.

``python -m benchmarks kernels [--out DIR] [--batches ...] [--contexts ...] [--repeats N]
[--tune [--tune-contexts ...]] [--no-prefill]``

Decode attention with Hq=32, Hkv=8, D=128, bf16, page 16, a random page permutation, for
each batch x context. Measured in one run on one device:

* copy bandwidth: a large device-to-device copy (read + write bytes / time), and on a GPU
  a large bf16 matrix product (the two ceilings);
* this project's decode kernel for the platform (Pallas GPU on NVIDIA, Pallas TPU on TPU;
  on a GPU also the Mosaic GPU kernel, ``gpu/decode_mosaic.py``) on the paged cache, and
  on the same pool read through a contiguous table (each sequence's pages consecutive: the
  cost of paging); its ragged kernel on the same decode batch (one query token per
  sequence: what the engine's step runs);
* JAX's Pallas GPU ``paged_attention`` with its default knobs (GPU only; given K and V in
  its own ``[Hkv, N, P, D]`` layout, built outside the timed call), and the ``"xla"``
  backend;
* ragged prefill: causal prefill chunks on the same head shapes, TFLOP/s against the
  measured matrix-product rate and the chip's bf16 peak (GPU); on a CPU, smaller chunks
  (``PREFILL_CASES_CPU``) through the CPU ragged kernel and the XLA backend.

Achieved bandwidth = K and V bytes that must be read (B * context * 2 * Hkv * D * 2) / time.
Each figure is min / median / max over ``--repeats`` samples; a sample enqueues enough
back-to-back calls to last ~2 ms and divides (dispatch is asynchronous), so small cases
show per-call cost including launch, and cases under ~50 MB of K/V may sit in L2.
On a machine without an accelerator the XLA backend and the CPU kernels
(``paged_jax.kernels.cpu``, where they build) run, at reduced sizes, and the results say so:
interpret-mode kernels are never timed (their times say nothing about speed).
Goals (GPU issue): >= 85% of copy bandwidth at batch 64 x 4k and above, >= 2x JAX's op,
paging overhead <= 10%.

``--tune`` (GPU): also times the Pallas GPU decode kernel over ``TUNE_GRID`` (pages per
block x warps x stages; ``SHORT_TUNE_GRID``, with splits, up to ``SHORT_CONTEXT`` tokens)
and the Mosaic GPU one over ``MOSAIC_TUNE_GRID`` at the contexts
``--tune-contexts`` names (default 4k and 32k; ``--contexts 256 --batches 256
--tune-contexts 256`` asks for the engine benchmark's short contexts, where the decode
kernel read its K/V at about 2 TB/s on an H200 against 4.8), and the ragged kernel over
``RAGGED_TUNE_GRID`` on the prefill cases, and reports
the fastest next to the default, so one run on a lent GPU says what
``pallas_kernels/gpu/tuning.py`` should choose and which decode kernel is faster.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import environment, positive_int, progress, table, time_samples, write_result
from paged_jax._hugepages import thp_mode, use_huge_pages

HQ, HKV, D, PAGE = 32, 8, 128, 16
DTYPE = jnp.bfloat16
# Peak HBM bandwidth / dense bf16 matmul throughput by device kind (vendor figures), for the
# fraction-of-peak columns; measured copy bandwidth and matmul rate are the primary references.
PEAKS = {
    "TPU v5 lite": (819e9, 197e12),
    "TPU v6 lite": (1640e9, 918e12),
    "NVIDIA H100 80GB HBM3": (3.35e12, 989e12),
    "NVIDIA H200": (4.8e12, 989e12),
}
# Ragged prefill cases: (sequences, new tokens each, kv length each); the chunk is the last
# q_len tokens of the sequence (cached pages before it), causal within it.
PREFILL_CASES = [(1, 4096, 4096), (8, 2048, 2048), (32, 512, 512), (16, 512, 8192)]
# On a CPU: one 2048-token prompt, four 512-token ones, and 32 short chunks after cached
# pages (what a step of the engine computes for repeated prompts).
PREFILL_CASES_CPU = [(1, 2048, 2048), (4, 512, 512), (32, 16, 112)]


def _stats(samples: list[float]) -> dict:
    return dict(
        ms=1e3 * statistics.median(samples),
        ms_min=1e3 * min(samples),
        ms_max=1e3 * max(samples),
    )


def copy_bandwidth(repeats: int) -> float:
    """Bytes read + written per second by a large elementwise copy (median).

    On CPU the copy is in place (the input donated): XLA:CPU allocates a fresh output for
    every call, and first touching its pages cost more than the copy (5.6-6.4 GB/s at
    64-512 MiB against 34-39 GB/s in place, 2-core AMD EPYC, 2026-11-23), which made this
    ceiling a page-fault rate, not the memory's. Its buffer is backed as the pools are
    (2 MiB pages where the kernel allows, ``cpu_buffer``), so both read the same kind of
    memory."""
    on_cpu = jax.default_backend() == "cpu"
    nbytes = (1 << 28) if on_cpu else (1 << 31)
    if not on_cpu:
        x = jax.random.normal(jax.random.key(0), (nbytes // 4,), jnp.float32)
        f = jax.jit(lambda a: a * 1.0001)  # reads and writes every byte once
        return 2 * nbytes / statistics.median(time_samples(f, x, repeats=repeats))
    x = cpu_buffer(
        (nbytes // 4,),
        jnp.float32,
        lambda key: jax.random.normal(key, (nbytes // 4,), jnp.float32),
        jax.random.key(0),
    )
    f = jax.jit(lambda a: a * 1.0001, donate_argnums=0)
    state = [x]

    def in_place():
        state[0] = f(state[0])
        return state[0]

    return 2 * nbytes / statistics.median(time_samples(in_place, repeats=repeats))


def matmul_rate(repeats: int) -> float:
    """FLOP/s of an 8192^3 bf16 matrix product on random data (median)."""
    n = 8192
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    return 2 * n**3 / statistics.median(time_samples(f, a, b, repeats=repeats))


def cpu_buffer(shape, dtype, fill, *args):
    """``fill(*args)`` (a ``shape`` ``dtype`` array; ``args``: arrays) written in place into
    a CPU buffer backed as the engine backs its pool: zeros first, given 2 MiB pages where
    the kernel allows (``paged_jax._hugepages.use_huge_pages``), then filled by a donated
    call (XLA writes into the same buffer)."""
    buf = jnp.zeros(shape, dtype)
    use_huge_pages(buf)
    return jax.jit(lambda buf, *a: buf.at[...].set(fill(*a)), donate_argnums=0)(buf, *args)


def random_pool(num_pages: int, seed: int = 0, dtype=DTYPE):
    """``[num_pages, PAGE, 2 * HKV, D]`` random values: at most 4096 random pages repeated to
    size by one gather, so pools of tens of GiB never need a temporary of their size. On a
    CPU the pool's memory is backed as the engine's pool is (``cpu_buffer``)."""
    base_pages = min(num_pages, 4096)
    base = jax.random.normal(jax.random.key(seed), (base_pages, PAGE, 2 * HKV, D), dtype)

    def pool(base):
        return jnp.take(base, jnp.arange(num_pages) % base_pages, axis=0)

    if jax.default_backend() == "cpu":
        return cpu_buffer((num_pages, PAGE, 2 * HKV, D), dtype, pool, base)
    return pool(base)


def make_inputs(seqs: int, kv_len: int, q_len: int = 1, seed: int = 0):
    """``(q, pool, lens, paged_table, contiguous_table, cu_q_lens, num_seqs)``: ``seqs``
    sequences of ``kv_len`` tokens whose last ``q_len`` are new (``q_len = 1``: a decode
    batch); one pool, a random-order table and a contiguous table over it."""
    rng = np.random.default_rng(seed)
    pages_per_seq = kv_len // PAGE
    num_pages = seqs * pages_per_seq + 1
    ids = np.arange(1, num_pages, dtype=np.int32)
    paged = rng.permutation(ids).reshape(seqs, pages_per_seq)
    contiguous = ids.reshape(seqs, pages_per_seq)
    kv = random_pool(num_pages, seed)
    q = jax.random.normal(jax.random.key(seed + 1), (seqs * q_len, HQ, D), DTYPE)
    lens = jnp.full((seqs,), kv_len, jnp.int32)
    cu = jnp.arange(seqs + 1, dtype=jnp.int32) * q_len
    num = jnp.full((1,), seqs, jnp.int32)
    return q, kv, lens, jnp.asarray(paged), jnp.asarray(contiguous), cu, num


# Knobs swept by --tune: pages of 16 tokens per block (2-8: 32-128 tokens), warps, stages,
# and the walk that loads a block ahead by hand (``prefetch``, one stage: see
# ``tuning.DECODE_PREFETCH``). Every point compiles for sm_90 within the SM's limits
# (tests/test_aot.py).
TUNE_GRID = [
    dict(pages_per_block=bp, num_warps=w, num_stages=st, prefetch=False)
    for bp in (2, 4, 8)
    for w in (4, 8)
    for st in (2, 3)
] + [dict(pages_per_block=bp, num_warps=4, num_stages=1, prefetch=True) for bp in (2, 4)]
# At short contexts (the engine workload's 128-256 tokens: 8-16 pages a sequence) a program
# walks few blocks, each waiting on its table entries and then its K/V (compiled for sm_90,
# Triton's two-stage pipelining issues a block's copies after the previous block's dots, and
# a third stage compiles to the same walk), and the kernel read its K/V at 25-42% of an
# H200's bandwidth in the engine: there the sweep also splits each sequence (more programs in
# flight, a merge after), tries blocks of 1 page (more loads a program) to 8, one stage (no
# copies to shared memory: less of it, more programs a SM) and the walk loading ahead (its
# next block held in registers: fewer programs a SM; not at 8 pages, where it spills).
SHORT_CONTEXT = 1024
SHORT_TUNE_GRID = [
    dict(pages_per_block=bp, num_splits=sp, num_warps=4, num_stages=st, prefetch=pf)
    for bp in (1, 2, 4, 8)
    for sp in (1, 2, 4)
    for st, pf in ((2, False), (1, False), (1, True))
    if not (pf and bp == 8)
]
# The Mosaic GPU decode kernel (Hopper): tokens per block x K/V blocks in flight.
MOSAIC_TUNE_GRID = [dict(pages_per_block=bp, num_stages=st) for bp in (4, 8) for st in (1, 2, 3)]
RAGGED_TUNE_GRID = [
    dict(tokens_per_block=bq, pages_per_block=bp, num_warps=w, prefetch=False)
    for bq in (8, 16, 32)
    for bp in (2, 4)
    for w in (4, 8)
] + [  # the walk loading a block ahead: 8 warps (at 4 its registers spill)
    dict(tokens_per_block=bq, pages_per_block=bp, num_warps=8, prefetch=True)
    for bq, bp in ((8, 2), (16, 2), (16, 4), (32, 2))
]


def _sweep(kernel, grid, args, repeats: int) -> list[dict]:
    out = []
    for knobs in grid:
        f = jax.jit(functools.partial(kernel, **knobs))
        try:
            out.append(dict(knobs, **_stats(time_samples(f, *args, repeats=repeats))))
        except Exception as e:  # a point that cannot launch says why
            out.append(dict(knobs, error=str(e)[:200]))
    return out


def decode_tunings(context: int) -> dict:
    """Name -> (kernel, grid) of the GPU decode kernels ``--tune`` sweeps at ``context``
    tokens a sequence: Triton's (``SHORT_TUNE_GRID`` up to ``SHORT_CONTEXT`` tokens,
    ``TUNE_GRID`` above) and Mosaic GPU's."""
    from paged_jax.kernels.gpu import decode_mosaic, decode_paged_attention

    grid = SHORT_TUNE_GRID if context <= SHORT_CONTEXT else TUNE_GRID
    return {
        "decode": (decode_paged_attention, grid),
        "mosaic decode": (decode_mosaic.decode_paged_attention, MOSAIC_TUNE_GRID),
    }


def decode_kernels(platform: str) -> dict:
    """Name -> ``fn(q, kv, lens, table)`` for the decode table."""
    import paged_jax as pj

    scale = D**-0.5
    out = {"xla": functools.partial(pj.paged_attention, backend="xla", sm_scale=scale)}
    mine = {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(platform)
    if platform == "cpu":
        from paged_jax.kernels import cpu

        if cpu.available():  # the ragged kernel: the prefill table
            out["cpu decode"] = functools.partial(pj.paged_attention, backend="cpu", sm_scale=scale)
    if mine:
        out[f"{mine} decode"] = functools.partial(pj.paged_attention, backend=mine, sm_scale=scale)

        def ragged(q, kv, lens, table):
            b = q.shape[0]
            cu = jnp.arange(b + 1, dtype=jnp.int32)
            n = jnp.full((1,), b, jnp.int32)
            return pj.ragged_paged_attention(
                q, kv, lens, table, cu, n, backend=mine, sm_scale=scale
            )

        out[f"{mine} ragged"] = ragged
    if platform == "gpu":  # the Hopper kernel beside the Triton one (not yet a backend)
        from paged_jax.kernels.gpu import decode_mosaic

        out["pallas_gpu mosaic decode"] = functools.partial(
            decode_mosaic.decode_paged_attention, sm_scale=scale
        )
    return out


def jax_gpu_op(k_pages, v_pages, q, lens, table):
    """JAX's Pallas GPU paged attention, default knobs, K/V already in its layout."""
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_gpu

    return jax_gpu.paged_attention(q * D**-0.5, k_pages, v_pages, table, lens)


def _row(b, c, name, samples, kv_bytes, bw, peaks) -> dict:
    row = dict(batch=b, context=c, kernel=name, **_stats(samples))
    t = row["ms"] / 1e3
    row.update(gbps=kv_bytes / t / 1e9, frac_copy_bw=kv_bytes / t / bw)
    if peaks:
        row["frac_peak_hbm"] = kv_bytes / t / peaks[0]
    return row


def run_decode(args, platform, bw, peaks, tuned) -> list[dict]:
    kernels = decode_kernels(platform)
    rows = []
    cases = [(b, c) for b in args.batches for c in args.contexts]
    with progress(len(cases), "decode") as bar:
        for b, c in cases:
            kv_bytes = b * c * 2 * HKV * D * jnp.dtype(DTYPE).itemsize
            q, kv, lens, paged, contiguous, _, _ = make_inputs(b, c)
            for name, fn in kernels.items():
                f = jax.jit(fn)
                try:
                    row = _row(
                        b,
                        c,
                        name,
                        time_samples(f, q, kv, lens, paged, repeats=args.repeats),
                        kv_bytes,
                        bw,
                        peaks,
                    )
                    if name != "xla" or platform == "cpu":
                        tc = time_samples(f, q, kv, lens, contiguous, repeats=args.repeats)
                        row["contiguous_ms"] = 1e3 * statistics.median(tc)
                        row["paging_overhead"] = row["ms"] / row["contiguous_ms"] - 1
                except Exception as e:  # a kernel that cannot run a shape says why
                    row = dict(batch=b, context=c, kernel=name, error=str(e)[:300])
                rows.append(row)
            for tname, (kernel, grid) in (
                decode_tunings(c).items() if args.tune and c in args.tune_contexts else ()
            ):
                f = functools.partial(kernel, sm_scale=D**-0.5)
                points = _sweep(f, grid, (q, kv, lens, paged), args.repeats)
                timed = [p for p in points if "ms" in p]
                best = min(timed, key=lambda p: p["ms"]) if timed else None
                tuned.append(dict(kernel=tname, batch=b, context=c, best=best, points=points))
                if best:
                    label = ",".join(f"{k}={best[k]}" for k in grid[0])
                    rows.append(
                        dict(
                            _row(
                                b,
                                c,
                                f"tuned {tname} ({label})",
                                [best["ms"] / 1e3],
                                kv_bytes,
                                bw,
                                peaks,
                            ),
                            ms_min=best["ms_min"],
                            ms_max=best["ms_max"],
                        )
                    )
            if platform == "gpu":
                del kv
                # JAX's op wants [Hkv, N, P, D] K and V: built outside the timed call, from
                # fresh random values (only their size matters here), the pool freed first.
                n = b * (c // PAGE) + 1
                idx = jnp.arange(n) % min(n, 4096)
                k_pages, v_pages = (
                    jnp.take(
                        jax.random.normal(jax.random.key(s), (HKV, min(n, 4096), PAGE, D), DTYPE),
                        idx,
                        axis=1,
                    )
                    for s in (3, 4)
                )
                try:
                    s = time_samples(
                        jax.jit(jax_gpu_op), k_pages, v_pages, q, lens, paged, repeats=args.repeats
                    )
                    rows.append(
                        _row(b, c, "jax pallas gpu paged_attention", s, kv_bytes, bw, peaks)
                    )
                except Exception as e:
                    rows.append(
                        dict(
                            batch=b,
                            context=c,
                            kernel="jax pallas gpu paged_attention",
                            error=str(e)[:300],
                        )
                    )
                del k_pages, v_pages
            bar.advance()
    return rows


def prefill_flops(seqs: int, q_len: int, kv_len: int) -> int:
    """q.k and p.v FLOPs of causal chunks: token i of a chunk sees kv_len - q_len + i + 1
    keys."""
    pairs = q_len * (kv_len - q_len) + q_len * (q_len + 1) // 2
    return 4 * seqs * pairs * HQ * D


def prefill_cases(platform: str) -> list[tuple[int, int, int]]:
    return PREFILL_CASES_CPU if platform == "cpu" else PREFILL_CASES


def run_prefill(args, platform, mm_rate, peaks, tuned) -> list[dict]:
    import paged_jax as pj
    from paged_jax.kernels import cpu
    from paged_jax.kernels.gpu import ragged_paged_attention as gpu_ragged

    rows = []
    backends = {}
    if platform == "gpu":
        backends["pallas_gpu ragged"] = functools.partial(gpu_ragged, sm_scale=D**-0.5)
    if platform == "cpu" and cpu.available():
        backends["cpu ragged"] = functools.partial(
            pj.ragged_paged_attention, backend="cpu", sm_scale=D**-0.5
        )
    backends["xla"] = functools.partial(pj.ragged_paged_attention, backend="xla", sm_scale=D**-0.5)
    cases = prefill_cases(platform)
    with progress(len(cases), "prefill") as bar:
        for s, ql, kl in cases:
            q, kv, lens, paged, _, cu, num = make_inputs(s, kl, ql)
            inputs = (q, kv, lens, paged, cu, num)
            flops = prefill_flops(s, ql, kl)
            for name, fn in backends.items():
                try:
                    row = dict(
                        seqs=s,
                        q_len=ql,
                        kv_len=kl,
                        kernel=name,
                        **_stats(time_samples(jax.jit(fn), *inputs, repeats=args.repeats)),
                    )
                except Exception as e:
                    rows.append(dict(seqs=s, q_len=ql, kv_len=kl, kernel=name, error=str(e)[:300]))
                    continue
                row["tflops"] = flops / (row["ms"] / 1e3) / 1e12
                if mm_rate:
                    row["frac_measured_matmul"] = row["tflops"] * 1e12 / mm_rate
                if peaks:
                    row["frac_peak_bf16"] = row["tflops"] * 1e12 / peaks[1]
                rows.append(row)
            if args.tune and (s, ql, kl) in PREFILL_CASES[1:3]:
                points = _sweep(gpu_ragged, RAGGED_TUNE_GRID, inputs, args.repeats)
                for p in points:
                    if "ms" in p:
                        p["tflops"] = flops / (p["ms"] / 1e3) / 1e12
                timed = [p for p in points if "ms" in p]
                best = min(timed, key=lambda p: p["ms"]) if timed else None
                tuned.append(
                    dict(kernel="ragged", seqs=s, q_len=ql, kv_len=kl, best=best, points=points)
                )
                if best:
                    label = ",".join(f"{k}={best[k]}" for k in RAGGED_TUNE_GRID[0])
                    rows.append(
                        dict(
                            seqs=s,
                            q_len=ql,
                            kv_len=kl,
                            kernel=f"tuned ragged ({label})",
                            ms=best["ms"],
                            ms_min=best["ms_min"],
                            ms_max=best["ms_max"],
                            tflops=best["tflops"],
                        )
                    )
            del inputs
            bar.advance()
    return rows


def _fmt(rows: list[dict]) -> list[dict]:
    return [{k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows]


def main(argv=None) -> int:
    platform = jax.default_backend()
    on_cpu = platform == "cpu"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--batches", type=positive_int, nargs="+", default=[1, 8, 64] if on_cpu else [1, 8, 64, 256]
    )
    ap.add_argument(
        "--contexts",
        type=positive_int,
        nargs="+",
        default=[512, 4096] if on_cpu else [512, 4096, 32768],
    )
    ap.add_argument("--repeats", type=positive_int, default=5 if on_cpu else 7)
    ap.add_argument("--tune", action="store_true", help="GPU: sweep the kernels' knobs")
    ap.add_argument(
        "--tune-contexts",
        type=positive_int,
        nargs="+",
        default=[4096, 32768],
        help="contexts whose decode cases --tune sweeps (default: 4096 32768; the engine "
        "benchmark's 128/128 workload decodes at 128-256 tokens)",
    )
    ap.add_argument("--no-prefill", action="store_true", help="skip the ragged prefill table")
    args = ap.parse_args(argv)
    if args.tune and platform != "gpu":
        ap.error("--tune times the Pallas GPU kernels: it needs a GPU")
    for c in args.contexts:
        if c % PAGE:
            ap.error(f"--contexts: expected multiples of the page size {PAGE}, got {c}")
    tuned: list[dict] = []
    env = environment(with_jax=True)
    bw = copy_bandwidth(args.repeats)
    mm = matmul_rate(args.repeats) if platform == "gpu" else None
    peaks = PEAKS.get(env["device_kind"])

    def save(rows, prefill):
        return write_result(
            f"kernels_{platform}",
            {
                "benchmark": "kernels",
                "environment": env,
                "copy_bandwidth_gbps": bw / 1e9,
                # the kernel's transparent huge page mode (CPU pools use 2 MiB pages with
                # "madvise" or "always"); None off Linux
                "thp_mode": thp_mode() if on_cpu else None,
                "matmul_bf16_tflops": None if mm is None else mm / 1e12,
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
                    prefill_cases=None if not prefill else prefill_cases(platform),
                ),
                "results": rows,
                "prefill": prefill,
                "tuning": tuned,
            },
        )

    rows = run_decode(args, platform, bw, peaks, tuned)
    save(rows, [])  # the decode table survives a prefill run cut short
    prefill = [] if args.no_prefill else run_prefill(args, platform, mm, peaks, tuned)
    print(
        f"device: {env['device_kind']} ({platform}); copy bandwidth {bw / 1e9:.1f} GB/s"
        + (f"; bf16 matmul {mm / 1e12:.0f} TFLOP/s" if mm else "")
    )
    if on_cpu:
        print(
            "no accelerator: the XLA backend and the CPU kernels are timed; Pallas "
            "kernels run in interpret mode in the tests, and interpret-mode times are not speed"
        )
    cols = [
        "batch",
        "context",
        "kernel",
        "ms_min",
        "ms",
        "ms_max",
        "gbps",
        "frac_copy_bw",
        "paging_overhead",
        "error",
    ]
    print(table(_fmt(rows), cols))
    if prefill:
        print(
            table(
                _fmt(prefill),
                [
                    "seqs",
                    "q_len",
                    "kv_len",
                    "kernel",
                    "ms_min",
                    "ms",
                    "ms_max",
                    "tflops",
                    "frac_measured_matmul",
                    "frac_peak_bf16",
                    "error",
                ],
            )
        )
    path = save(rows, prefill)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
