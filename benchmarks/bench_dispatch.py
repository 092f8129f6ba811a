"""Does a dispatched step overlap the host's work on this backend? A stand-alone model
of the engine's step loop, without the engine.

``python -m benchmarks dispatch [--layers 32] [--hidden 4096] [--ffn 14336] [--rows 256]
[--passes 4] [--host-ms 5] [--iters 30]``, written to ``dispatch_<backend>.json``.

The step is ``passes`` sweeps over ``layers`` pairs of per-layer weights (``x @ W1``, a
GELU, ``@ W2``, bf16, the engine's unrolled per-layer layout: on an H100 the defaults
read 30 GB a step, about 9 ms), taking what the engine's step takes: a state it donates
and returns (a stand-in for the KV pool), one packed ``i32`` host array of inputs, and
giving back a row of ``i32`` tokens. The host's work between steps is a busy wait of
``--host-ms``. Each way of driving it runs ``--iters`` steps after a warm-up, and reports
the wall time a step, the dispatch call's time and the wait for the tokens:

- ``one at a time``: dispatch, wait for the tokens, host work (wall = device + host);
- ``overlapped``: dispatch step n + 1, then wait for step n's tokens, then host work, as
  the engine's ``async_scheduling`` does (wall = max(device, host) when the dispatch
  does not wait for the device);
- ``overlapped, inputs put first``: the same with the inputs moved by ``jax.device_put``
  before the call;
- ``overlapped, nothing donated``: the state not donated;
- ``overlapped, merged tokens``: step n + 1's inputs hold step n's tokens, read on the
  device by a small jitted gather as the engine's ``_merge_tokens`` does;
- ``overlapped, no host inputs``: inputs already on the device (nothing moved per step);
- ``overlapped, inputs via pinned host memory``: inputs put in pinned host memory, and
  moved to the device inside the step (a backend without that memory kind reports an
  error for this way).

The dispatch time covers moving the inputs (``device_put``, the gather) and the call.

On a backend whose dispatch is asynchronous, the overlapped ways' wall is near
``max(device, host)``; a way near ``device + host`` names what serializes.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import numpy as np

from benchmarks.common import environment, positive_int, table, write_result


def _spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def build(layers: int, hidden: int, ffn: int, rows: int, passes: int, seed: int = 0):
    """``(step, weights, state, inputs)``: the jitted step ``step(weights, state, inputs)
    -> (tokens i32[rows], state)`` in its donating and non-donating forms
    (``step[True]``, ``step[False]``), per-layer bf16 weights, a state ``f32[rows,
    hidden]`` and host inputs ``i32[4 rows]``."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(seed), 2 * layers)
    scale = hidden**-0.5
    weights = tuple(
        (
            (jax.random.normal(keys[2 * i], (hidden, ffn), jnp.float32) * scale).astype(
                jnp.bfloat16
            ),
            (jax.random.normal(keys[2 * i + 1], (ffn, hidden), jnp.float32) * ffn**-0.5).astype(
                jnp.bfloat16
            ),
        )
        for i in range(layers)
    )

    def body(weights, state, inputs):
        x = state + inputs[:rows, None].astype(jnp.float32) * 1e-3
        for _ in range(passes):
            for w1, w2 in weights:
                h = jax.nn.gelu(x.astype(jnp.bfloat16) @ w1)
                x = x + (h @ w2).astype(jnp.float32) * 1e-2
        tokens = jnp.argmax(x, axis=-1).astype(jnp.int32)
        return tokens, x

    def from_pinned(weights, state, inputs):  # inputs arrive in pinned host memory
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device")
        return body(weights, state, jax.device_put(inputs, dev))

    step = {
        True: jax.jit(body, donate_argnums=1),
        False: jax.jit(body),
        "pinned": jax.jit(from_pinned, donate_argnums=1),
    }
    state = jnp.zeros((rows, hidden), jnp.float32)
    inputs = np.arange(4 * rows, dtype=np.int32) % 7
    return step, weights, state, inputs


@functools.cache
def _merge():
    import jax

    @jax.jit
    def merge(prev_tokens, inputs):  # the previous step's tokens into this one's inputs
        return inputs.at[: prev_tokens.shape[0]].set(prev_tokens % 7)

    return merge


def drive(way: str, step, weights, state, inputs, iters: int, host_ms: float) -> dict:
    """Runs ``iters`` steps driven ``way``; returns per-step wall, dispatch and wait
    milliseconds (medians of the steps) and the state to go on with."""
    import jax

    donate = way != "overlapped, nothing donated"
    fn = step["pinned" if way == PINNED else donate]
    pinned = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    walls, dispatches, waits = [], [], []

    resident = jax.device_put(inputs)  # (the device's copy, moved once, untimed)

    def dispatch(prev_tokens):
        nonlocal state
        t = time.perf_counter()
        x = inputs
        if way == "overlapped, inputs put first":
            x = jax.device_put(inputs)
        elif way == "overlapped, merged tokens" and prev_tokens is not None:
            x = _merge()(prev_tokens, inputs)
        elif way == "overlapped, no host inputs":
            x = resident
        elif way == PINNED:
            x = jax.device_put(inputs, pinned)
        tokens, state = fn(weights, state, x)
        dispatches.append(time.perf_counter() - t)
        return tokens

    def wait(tokens):
        t = time.perf_counter()
        np.asarray(tokens)
        waits.append(time.perf_counter() - t)

    running = None
    for i in range(iters + 1):
        t0 = time.perf_counter()
        if way == "one at a time":
            wait(dispatch(None))
            _spin(host_ms)
        else:
            nxt = dispatch(running)
            if running is not None:
                wait(running)
            _spin(host_ms)
            running = nxt
        if i:  # the first step of each way is its warm-up
            walls.append(time.perf_counter() - t0)
    if running is not None:
        np.asarray(running)
    ms = lambda xs: 1e3 * statistics.median(xs[1:] if len(xs) > 1 else xs)  # noqa: E731
    return dict(wall_ms=ms(walls), dispatch_ms=ms(dispatches), wait_ms=ms(waits)), state


PINNED = "overlapped, inputs via pinned host memory"
WAYS = (
    "one at a time",
    "overlapped",
    "overlapped, inputs put first",
    "overlapped, nothing donated",
    "overlapped, merged tokens",
    "overlapped, no host inputs",
    PINNED,
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=positive_int, default=32)
    ap.add_argument("--hidden", type=positive_int, default=4096)
    ap.add_argument("--ffn", type=positive_int, default=14336)
    ap.add_argument("--rows", type=positive_int, default=256)
    ap.add_argument("--passes", type=positive_int, default=4)
    ap.add_argument("--host-ms", type=float, default=5.0)
    ap.add_argument("--iters", type=positive_int, default=30)
    ap.add_argument("--repeats", type=positive_int, default=3)
    args = ap.parse_args(argv)
    if args.host_ms < 0:
        ap.error(f"--host-ms: expected >= 0, got {args.host_ms}")
    import jax

    step, weights, state, inputs = build(args.layers, args.hidden, args.ffn, args.rows, args.passes)
    for donate in (True, False):  # compile both forms before anything is timed
        tokens, state = step[donate](weights, state, inputs)
    np.asarray(_merge()(tokens, jax.numpy.asarray(inputs)))
    # the device's own step: back to back, each waited for
    dev = []
    for _ in range(args.iters):
        t = time.perf_counter()
        tokens, state = step[True](weights, state, inputs)
        np.asarray(tokens)
        dev.append(time.perf_counter() - t)
    device_ms = 1e3 * statistics.median(dev[1:])
    rows = []
    errors = {}
    for r in range(args.repeats):
        for way in WAYS:
            if way in errors:
                continue
            try:
                got, state = drive(way, step, weights, state, inputs, args.iters, args.host_ms)
            except Exception as e:  # a memory kind the backend lacks: say so, go on
                errors[way] = repr(e)[-400:]
                continue
            rows.append(dict(way=way, repeat=r, **got))
    results = []
    for way in WAYS:
        mine = [x for x in rows if x["way"] == way]
        if not mine:
            results.append(dict(way=way, error=errors.get(way)))
            continue
        out = dict(way=way)
        for k in ("wall_ms", "dispatch_ms", "wait_ms"):
            vals = sorted(x[k] for x in mine)
            out[k] = dict(min=vals[0], median=statistics.median(vals), max=vals[-1])
        results.append(out)
    ideal = max(device_ms, args.host_ms)
    path = write_result(
        f"dispatch_{jax.default_backend()}",
        dict(
            benchmark="dispatch",
            environment=environment(with_jax=True),
            parameters=vars(args),
            device_ms_per_step=device_ms,
            overlapped_ideal_ms=ideal,
            serial_ms=device_ms + args.host_ms,
            results=results,
        ),
    )
    print(
        f"device step {device_ms:.2f} ms, host {args.host_ms:.2f} ms: overlapped ideal "
        f"{ideal:.2f}, one at a time {device_ms + args.host_ms:.2f}"
    )
    print(
        table(
            [
                dict(
                    way=r["way"],
                    **{
                        k: f"{r[k]['median']:.2f}" if k in r else "-"
                        for k in ("wall_ms", "dispatch_ms", "wait_ms")
                    },
                    error=(r.get("error") or "")[-80:],
                )
                for r in results
            ],
            ["way", "wall_ms", "dispatch_ms", "wait_ms", "error"],
        )
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
