"""LoRA adapters: what serving them costs the engine, and the product that applies them.

``python -m benchmarks lora [--out DIR] [--prompts 32] [--output-len 64] [--rank 16]
[--adapters 4] [--repeats 3]``, written to ``lora_<backend>.json``.

Engine (SmolLM2-135M-Instruct, the named real model; f32 on CPU): the peers workload
(``--prompts`` prompts of random ids, ``--output-len`` greedy tokens each, all at once),
min / median / max of ``--repeats`` runs alternated in one process, of

- ``base``: an engine without LoRA slots;
- ``slots, no adapter``: an engine with ``--adapters`` slots, every request on the base
  model (its steps skip the adapters' products);
- ``one adapter``: the same engine, every request with one adapter;
- ``N adapters``: the requests spread over ``--adapters`` adapters, one slot each.

The adapters are random, rank ``--rank`` on every projection. Product: the two ways of
adding each token's adapter to a projection of SmolLM2's MLP width (576 -> 1536, or
``--widths IN OUT``; f32 on CPU, bf16 off it) at
``T`` tokens spread over ``S`` slots, timed alone (median of 20): ``masked`` (what the
model does: every slot's columns, then a mask, ``models.lora.delta``) and ``ragged``
(rows sorted by slot, ``jax.lax.ragged_dot`` per group with the slot's own A and B, then
unsorted), and on CPU ``cpu_kernel`` (``paged_jax.linear.lora_delta``, what the models
do there: each row its own slot's A and B), each against the projection's own product.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from benchmarks.common import environment, positive_int, table, time_samples, write_result

MODEL = "smollm2-135m-instruct"


def random_adapter(cfg, name: str, rank: int, seed: int):
    """A ``LoraAdapter`` of rank ``rank`` on every projection, random weights."""
    from paged_jax.models import lora

    rng = np.random.default_rng(seed)
    weights = {}
    for t in lora.TARGETS:
        fan_in, fan_out = lora.target_shape(cfg, t)
        a = rng.normal(size=(cfg.num_layers, fan_in, rank)).astype(np.float32) / fan_in**0.5
        b = rng.normal(size=(cfg.num_layers, rank, fan_out)).astype(np.float32) * 0.01
        weights[t] = (a, b)
    return lora.LoraAdapter(name, rank, 1.0, weights)


def products(T: int, S: int, R: int, fan_in: int, fan_out: int) -> dict:
    """Milliseconds of the masked and the ragged way of one projection's adapters at
    ``T`` tokens over ``S`` slots of rank ``R``, and of the projection itself."""
    import jax
    import jax.numpy as jnp

    from paged_jax import linear
    from paged_jax.models import lora

    dt = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    k = jax.random.split(jax.random.key(T * 31 + S), 5)
    x = jax.random.normal(k[0], (T, fan_in), dt)
    w = jax.random.normal(k[1], (fan_in, fan_out), dt)
    a = jax.random.normal(k[2], (S, fan_in, R), dt) * fan_in**-0.5
    b = jax.random.normal(k[3], (S, R, fan_out), dt)
    slot = jax.random.randint(k[4], (T,), 0, S)
    a_bank = jnp.moveaxis(a, 0, 1).reshape(fan_in, S * R)  # [in, S R], slot s at s R
    b_bank = b.reshape(S * R, fan_out)

    @jax.jit
    def base(x):
        return x @ w

    @jax.jit
    def masked(x, slot):
        mask = lora.token_mask(slot + 1, S, R, dt)
        return x @ w + ((x @ a_bank) * mask) @ b_bank

    @jax.jit
    def ragged(x, slot):
        order = jnp.argsort(slot, stable=True)
        sizes = jnp.bincount(slot, length=S).astype(jnp.int32)
        xs = x[order]
        h = jax.lax.ragged_dot(xs, a, sizes)
        d = jax.lax.ragged_dot(h, b, sizes)
        return x @ w + jnp.zeros_like(d).at[order].set(d)

    got, want = (np.asarray(f(x, slot), np.float32) for f in (ragged, masked))
    tol = 1e-3 if dt == jnp.float32 else 5e-2  # (bf16 rounds each way differently)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())

    def ms(fn, *args):
        jax.block_until_ready(fn(*args))
        samples = time_samples(lambda: jax.block_until_ready(fn(*args)), repeats=20)
        return 1e3 * statistics.median(samples)

    kernel_ms = None
    if linear.available():  # the CPU's way: each row its own slot (lora.c)

        @jax.jit
        def kernel(x, slot):
            return x @ w + linear.lora_delta(x, a_bank[None], b_bank[None], slot + 1, 0, R)

        got = np.asarray(kernel(x, slot))
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
        kernel_ms = ms(kernel, x, slot)
    return dict(
        tokens=T,
        slots=S,
        rank=R,
        projection_ms=ms(base, x),
        masked_ms=ms(masked, x, slot),
        ragged_ms=ms(ragged, x, slot),
        cpu_kernel_ms=kernel_ms,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks lora")
    ap.add_argument("--prompts", type=positive_int, default=32)
    ap.add_argument("--output-len", type=positive_int, default=64)
    ap.add_argument("--rank", type=positive_int, default=16)
    ap.add_argument("--adapters", type=positive_int, default=4)
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--no-engine", action="store_true", help="the products only")
    ap.add_argument(
        "--widths",
        type=positive_int,
        nargs=2,
        default=None,
        metavar=("IN", "OUT"),
        help="the products' projection (default: SmolLM2's MLP, 576 -> 1536; "
        "Llama-3-8B's: 4096 14336)",
    )
    args = ap.parse_args(argv)
    import jax

    import paged_jax as pj
    from benchmarks.bench_peers import workload
    from paged_jax import models

    def say(msg):
        print(f"lora: {msg}", file=sys.stderr, flush=True)

    cfg = None
    rows = []
    if not args.no_engine:
        prompts = workload(args.prompts)
        p = pj.SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        model, tok = models.load(MODEL)
        cfg = model.config
        base = pj.LLM(model, tok, kv_cache_bytes=2**30, compilation_cache=False)
        model, tok = models.load(MODEL)
        slotted = pj.LLM(model, tok, kv_cache_bytes=2**30, compilation_cache=False,
                         max_loras=args.adapters, max_lora_rank=args.rank)  # fmt: skip
        names = [f"a{i}" for i in range(args.adapters)]
        for i, n in enumerate(names):
            slotted.add_lora(n, random_adapter(cfg, n, args.rank, seed=i))

        def run(engine, loras):
            for i, prompt in enumerate(prompts):
                engine.add_request(f"r{i}", prompt, p, lora=loras[i % len(loras)])
            while engine.has_unfinished():
                engine.step()

        ways = {
            "base": (base, [None]),
            "slots, no adapter": (slotted, [None]),
            "one adapter": (slotted, names[:1]),
            f"{args.adapters} adapters": (slotted, names),
        }
        for engine, loras in ways.values():  # compile every bucket first
            run(engine, loras)
        times = {w: [] for w in ways}
        for k in range(args.repeats):
            for w, (engine, loras) in ways.items():
                t = time.perf_counter()
                run(engine, loras)
                rate = len(prompts) * args.output_len / (time.perf_counter() - t)
                times[w].append(rate)
                say(f"round {k} {w}: {rate:.1f} tokens/s")
        ref = statistics.median(times["base"])
        for w, rates in times.items():
            rows.append(
                dict(
                    way=w,
                    tokens_per_s=dict(
                        min=min(rates), median=statistics.median(rates), max=max(rates)
                    ),
                    over_base=round(statistics.median(rates) / ref, 3),
                )
            )
    fan_in, fan_out = (576, 1536) if cfg is None else (cfg.hidden_size, cfg.intermediate_size)
    if args.widths:
        fan_in, fan_out = args.widths
    prods = [products(T, S, args.rank, fan_in, fan_out) for T in (32, 256) for S in (4, 16)]
    path = write_result(
        f"lora_{jax.default_backend()}",
        dict(
            environment=environment(with_jax=True),
            command="python -m benchmarks lora "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            model=MODEL,
            parameters=vars(args),
            engine=rows,
            products=prods,
        ),
    )
    if rows:
        print(
            table(
                [
                    dict(
                        way=r["way"],
                        tok_s=f"{r['tokens_per_s']['median']:.1f}",
                        over_base=r["over_base"],
                    )  # fmt: skip
                    for r in rows
                ],
                ["way", "tok_s", "over_base"],
            )
        )
    print(
        table(
            prods,
            ["tokens", "slots", "rank", "projection_ms", "masked_ms", "ragged_ms", "cpu_kernel_ms"],
            digits=3,
        )
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
