"""End-to-end demo on CPU: ``python -m paged_jax.demo``.

Builds a paged cache, hands out pages to four sequences in shuffled order (as a block
manager would after some churn), writes a ragged step mixing a fresh prefill, a prefill
chunk after a cached prefix and two decode tokens, runs ``ragged_paged_attention`` under
``jax.jit`` with the cache donated, and checks every sequence against dense causal
attention on contiguous K/V computed in float64 with numpy. Exits non-zero on mismatch.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

import paged_jax as pj

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, PAGE, PAGES = 2, 2, 8, 64, 16, 64
# (tokens already cached, new tokens this step) per sequence
SEQUENCES = {
    "fresh prefill": (0, 37),
    "chunk after prefix": (48, 20),
    "decode A": (70, 1),
    "decode B": (15, 1),
}


def _dense(q, k, v, q_pos, sm_scale):
    """f64 causal attention. q: [Q, H, D], k/v: [C, K, D] -> [Q, H, D]."""
    group = q.shape[1] // k.shape[1]
    s = np.einsum("qhd,chd->hqc", q, np.repeat(k, group, 1)) * sm_scale
    s = np.where(np.arange(k.shape[0])[None, None] <= q_pos[None, :, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hqc,chd->qhd", p / p.sum(-1, keepdims=True), np.repeat(v, group, 1))


@functools.partial(jax.jit, donate_argnums=0, static_argnames="layer")
def _step(cache, k, v, slots, q, kv_lens, page_indices, cu_q_lens, num_seqs, *, layer):
    cache = cache.write(layer, k, v, slots)
    kv, page_indices, k_scale, v_scale = cache.attention_inputs(layer, page_indices)
    out = pj.ragged_paged_attention(
        q,
        kv,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        sm_scale=HEAD_DIM**-0.5,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    return cache, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "int8"])
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    cache = pj.PagedKVCache.create(LAYERS, PAGES, PAGE, KV_HEADS, HEAD_DIM, dtype=args.dtype)
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}; backend "
        f"{pj.available_backends()[0]!r}; cache {cache.dtype}, {PAGES} pages x {PAGE} tokens, "
        f"{cache.nbytes / 2**20:.2f} MiB"
    )

    # Host side: pages in shuffled order (page 0 is the null page), one block-table row each.
    free = list(rng.permutation(np.arange(1, PAGES)))
    names = list(SEQUENCES)
    totals = [sum(SEQUENCES[n]) for n in names]
    width = max(-(-t // PAGE) for t in totals)
    table = np.zeros((len(names) + 1, width), np.int32)  # one padding row
    for i, total in enumerate(totals):
        table[i, : -(-total // PAGE)] = [free.pop() for _ in range(-(-total // PAGE))]

    k_all = [rng.standard_normal((t, KV_HEADS, HEAD_DIM)) for t in totals]
    v_all = [rng.standard_normal((t, KV_HEADS, HEAD_DIM)) for t in totals]

    def slots_of(i, start, stop):
        pos = np.arange(start, stop)
        return (table[i, pos // PAGE] * PAGE + pos % PAGE).astype(np.int32)

    # Earlier steps: the cached prefixes, written in one batch.
    pre = [(i, SEQUENCES[n][0]) for i, n in enumerate(names) if SEQUENCES[n][0]]
    k_pre = np.concatenate([k_all[i][:c] for i, c in pre])
    v_pre = np.concatenate([v_all[i][:c] for i, c in pre])
    slots_pre = np.concatenate([slots_of(i, 0, c) for i, c in pre])
    for layer in range(LAYERS):
        cache = cache.write(
            layer,
            jnp.asarray(k_pre, jnp.float32),
            jnp.asarray(v_pre, jnp.float32),
            jnp.asarray(slots_pre),
        )

    # This step: every sequence's new tokens, concatenated and padded to a bucket of 64.
    new = [SEQUENCES[n][1] for n in names]
    T = 64
    cu = np.zeros(len(names) + 2, np.int32)
    cu[1 : len(names) + 1] = np.cumsum(new)
    cu[-1] = cu[-2]
    kv_lens = np.array(totals + [0], np.int32)
    pad = T - sum(new)
    k_new = np.concatenate([k_all[i][c:] for i, c in enumerate(SEQUENCES[n][0] for n in names)])
    v_new = np.concatenate([v_all[i][c:] for i, c in enumerate(SEQUENCES[n][0] for n in names)])
    slots = np.concatenate(
        [slots_of(i, SEQUENCES[n][0], totals[i]) for i, n in enumerate(names)]
        + [np.zeros(pad, np.int32)]
    )  # padding writes land on the null page
    k_new = np.concatenate([k_new, np.zeros((pad, KV_HEADS, HEAD_DIM))])
    v_new = np.concatenate([v_new, np.zeros((pad, KV_HEADS, HEAD_DIM))])
    q = rng.standard_normal((T, Q_HEADS, HEAD_DIM))
    batch = (
        jnp.asarray(q, jnp.float32),
        jnp.asarray(kv_lens),
        jnp.asarray(table),
        jnp.asarray(cu),
        jnp.array([len(names)], jnp.int32),
    )
    cache.validate_slot_mapping(slots)
    pj.validate_inputs(batch[0], cache.layer(0)[0], *batch[1:])

    worst = 0.0
    for layer in range(LAYERS):
        cache, out = _step(
            cache,
            jnp.asarray(k_new, jnp.float32),
            jnp.asarray(v_new, jnp.float32),
            jnp.asarray(slots),
            *batch,
            layer=layer,
        )
    out = np.asarray(out, np.float64)
    tol = {"float32": 1e-4, "bfloat16": 5e-2, "int8": 5e-2}[args.dtype]
    print(f"{'sequence':<20}{'cached':>8}{'new':>6}{'pages':>7}  max |paged - dense|")
    for i, n in enumerate(names):
        cached, q_len = SEQUENCES[n]
        q_pos = np.arange(cached, cached + q_len)
        ref = _dense(q[cu[i] : cu[i + 1]], k_all[i], v_all[i], q_pos, HEAD_DIM**-0.5)
        err = float(np.abs(out[cu[i] : cu[i + 1]] - ref).max())
        worst = max(worst, err)
        pages = [int(p) for p in table[i] if p]
        print(f"{n:<20}{cached:>8}{q_len:>6}{len(pages):>7}  {err:.2e}")
    used = sum(-(-t // PAGE) for t in totals) * PAGE
    print(
        f"KV slots in use: {used} paged vs {len(names) * 2048} for a contiguous cache "
        f"reserving a 2048-token max length per sequence ({used / (len(names) * 2048):.1%})"
    )
    ok = worst <= tol and np.isfinite(out).all()
    print(
        f"{'OK' if ok else 'MISMATCH'}: paged attention matches dense attention "
        f"(worst error {worst:.2e}, tolerance {tol:g})"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
