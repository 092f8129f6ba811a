"""Restricted rows drawn on the device: each way ``sample_rows`` can take, side by side.

``python -m benchmarks draw [--out DIR] [--rows 64 256] [--vocab 128256] [--repeats 3]
[--configs BLOCK:BITS:WARPS[:p[N]] ...]``, written to ``draw.json``.

Rows of ``--vocab`` random logits, top-p 0.9 at temperature 1 (one sample column), as
``sample_rows`` is jitted in the engine's step, on two kinds of rows: flat, N(0, 1), where
top-p keeps most of the vocabulary and the candidates' path falls back to a full sort;
and peaked (the same x 8, as trained models give), where the top-k candidates suffice.
Ways: "candidates" (the default: ``lax.top_k`` of 256, the full sort where a row needs
it), "xla" (``sort_free.draw``'s radix passes as XLA reductions) and "pallas_gpu" (the
passes in ``paged_jax.kernels.gpu.sample``, one program per row) at each of
``--configs`` (the first is the kernel's default; a trailing ``:p`` has each pass load
its next chunk ahead, ``:pN`` the chunk N ahead, ``prefetch``), and "pallas_gpu_split"
(XLA's passes with each radix round summed by ``trial_counts``, a row over several
programs, on a GPU only).
Greedy rows are timed beside them:
the sampler's floor. Each time: min/median/max over ``--repeats`` rounds of the median
of 20 samples (``time_samples``), the ways alternating within a round. The kernel's
tokens are checked against the XLA passes' (they may differ only where a decision falls
within rounding: the count of differing rows is recorded).

Issue 57's goal: top-p, top-k and min-p on flat rows at most 5% of the Llama-3-8B decode
step at 256 rows (10.0 ms on an H200, ``engine_gpu_h200.json``).
"""

from __future__ import annotations

import argparse
import functools
import statistics

from benchmarks.common import environment, positive_int, progress, table, time_samples, write_result


def _config(text: str) -> tuple[int, int, int, int]:
    """``BLOCK:BITS:WARPS[:p[N]]``: ``p`` loads each pass's next chunk ahead, ``pN`` the
    chunk N ahead (``prefetch=N``)."""
    parts = text.split(":")
    try:
        if len(parts) == 4:
            if not parts[3].startswith("p"):
                raise ValueError
            prefetch = int(parts[3][1:] or 1)
        elif len(parts) == 3:
            prefetch = 0
        else:
            raise ValueError
        block, bits, warps = (int(x) for x in parts[:3])
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected BLOCK:BITS:WARPS, BLOCK:BITS:WARPS:p or BLOCK:BITS:WARPS:pN, got {text!r}"
        ) from None
    return block, bits, warps, prefetch


def _label(config: tuple) -> str:
    ahead = {0: "", 1: ":p"}.get(int(config[3]), f":p{int(config[3])}")
    return ":".join(map(str, config[:3])) + ahead


def _ways(R: int, vocab: int, configs: list[tuple]) -> tuple[dict, dict]:
    """The calls to time at ``R`` rows (name -> a function returning the sampler's output)
    and the kernel's rows that differ from the XLA passes' (name -> count)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from paged_jax.engine.sampling import sample_rows

    samp = jax.jit(sample_rows, static_argnames=("greedy_only", "sort_free"))
    flat = jax.random.normal(jax.random.key(R), (R, vocab), jnp.float32)
    params = (
        jnp.ones(R, jnp.float32),  # temperature
        jnp.zeros(R, jnp.int32),  # top_k
        jnp.full(R, 0.9, jnp.float32),  # top_p
        jnp.arange(R, dtype=jnp.uint32)[:, None],  # seeds
        jnp.zeros(R, jnp.int32),  # positions
    )
    greedy = (jnp.zeros(R, jnp.float32), *params[1:])
    ways = {"greedy": functools.partial(samp, flat, *greedy, greedy_only=True)}
    differing = {}
    for kind, logits in (("flat", flat), ("peaked", flat * 8.0)):
        ways[f"candidates/{kind}"] = functools.partial(samp, logits, *params, sort_free=False)
        ways[f"xla/{kind}"] = functools.partial(samp, logits, *params, sort_free="xla")
        ref = np.asarray(ways[f"xla/{kind}"]()[0])
        if jax.default_backend() == "gpu":  # (elsewhere only interpreted: not a speed)
            name = f"pallas_gpu_split/{kind}"
            ways[name] = functools.partial(samp, logits, *params, sort_free="pallas_gpu_split")
            differing[name] = int((np.asarray(ways[name]()[0]) != ref).sum())
        for c in configs:
            name = f"pallas_gpu {_label(c)}/{kind}"
            ways[name] = _kernel_call(logits, params, c)
            differing[name] = int((np.asarray(ways[name]()[0]) != ref).sum())
    return ways, differing


def measure(rows: list[int], vocab: int, repeats: int, configs: list[tuple]) -> dict:
    import jax

    results = []
    for R in rows:
        ways, differing = _ways(R, vocab, configs)
        times: dict[str, list[float]] = {k: [] for k in ways}
        with progress(repeats * len(ways), f"{R} rows") as bar:
            for _ in range(repeats):
                for name, fn in ways.items():
                    samples = time_samples(lambda f=fn: jax.block_until_ready(f()), repeats=20)
                    times[name].append(statistics.median(samples))
                    bar.advance()
        for name, ts in times.items():
            ms = [1e3 * t for t in ts]
            results.append(
                dict(
                    rows=R,
                    vocab=vocab,
                    way=name,
                    ms=dict(min=min(ms), median=statistics.median(ms), max=max(ms)),
                    rows_differing_from_xla=differing.get(name),
                )
            )
    return dict(results=results)


def _kernel_call(logits, params, config):
    """A jitted ``sample_rows`` whose restricted rows go to the kernel at ``config``
    (``BLOCK:BITS:WARPS`` and prefetch): the kernel, so configured, stands in for the XLA
    passes while the function is traced, so everything around the draw is the engine's
    own."""
    import jax

    from paged_jax.engine import sampling
    from paged_jax.kernels.gpu.sample import restricted_draw

    block, bits, warps, prefetch = config
    interpret = jax.default_backend() != "gpu"  # off a GPU: a check that it runs, not speed
    draw = functools.partial(
        restricted_draw,
        block=block,
        bits=bits,
        num_warps=warps,
        prefetch=prefetch,
        interpret=interpret,
    )

    @jax.jit
    def run(logits, *params):
        saved = sampling.sort_free_draw
        sampling.sort_free_draw = draw  # traced once, here: the "xla" way's slot
        try:
            return sampling.sample_rows(logits, *params, sort_free="xla")
        finally:
            sampling.sort_free_draw = saved

    return lambda: run(logits, *params)


def main(argv=None) -> int:
    import jax

    from paged_jax.kernels.gpu import tuning

    block, warps = tuning.sample_block_and_warps(256)
    default = (block, tuning.SAMPLE_DIGIT_BITS, warps, tuning.SAMPLE_PREFETCH)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=positive_int, nargs="+", default=[64, 256])
    ap.add_argument("--vocab", type=positive_int, default=128256)
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--configs", type=_config, nargs="+", default=[default])
    a = ap.parse_args(argv)
    res = measure(a.rows, a.vocab, a.repeats, a.configs)
    payload = dict(
        environment=environment(with_jax=True),
        parameters=dict(
            rows=a.rows,
            vocab=a.vocab,
            repeats=a.repeats,
            configs=[_label(c) for c in a.configs],
            top_p=0.9,
            kernel_interpreted=jax.default_backend() != "gpu",
        ),
        goal="top-p on flat rows <= 5% of the Llama-3-8B decode step at 256 rows (issue 57)",
        **res,
    )
    path = write_result("draw", payload)
    print(
        table(
            [
                dict(
                    rows=r["rows"],
                    way=r["way"],
                    ms=f"{r['ms']['min']:.3f}/{r['ms']['median']:.3f}/{r['ms']['max']:.3f}",
                    differing=r["rows_differing_from_xla"],
                )
                for r in res["results"]
            ],
            ["rows", "way", "ms", "differing"],
        )
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
