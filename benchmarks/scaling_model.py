"""A decode step on paper: bytes, FLOPs and collectives per chip for Llama-3-8B and -70B
under Megatron-style tensor parallelism, on TPU v5e-8, TPU v6e-8 and 8 x H100.

``python -m benchmarks.scaling_model [--seqs 64] [--context 4096]`` prints the tables of
docs/SCALING.md (a test checks that the page shows this script's output). Nothing is
measured: it is a roofline with the assumptions below, to say what tensor parallelism
should buy before it is built and measured.

Assumptions (each a number below, so a reader can change it):
* bf16 weights and KV cache; a decode step reads every weight once (all but the
  embedding table, of which it reads one row per sequence) and the KV cache of every
  sequence at the given context, and computes 2 FLOPs per weight per sequence plus
  4 x context x heads x head_dim per sequence and layer for attention.
* Tensor parallelism as Megatron: q, k, v, gate, up split by output, o and down by input,
  the LM head by vocabulary; two all-reduces of ``seqs x hidden`` bf16 activations per
  layer (after o and after down), and one all-gather of the logits. KV heads are split
  (both models have 8, so up to 8 chips no KV head is replicated).
* Ring all-reduce: each chip sends and receives ``2 (p - 1) / p`` times the buffer,
  at half the chip's listed bidirectional link bandwidth (one direction), plus a fixed
  latency per collective.
* Step time = max(memory time, compute time) + collective time: memory and compute
  overlap perfectly, collectives do not overlap at all (decode layers are sequential).
"""

from __future__ import annotations

import argparse
import dataclasses


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int

    @property
    def layer_params(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return attn + 3 * self.hidden * self.ffn

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + 2 * self.vocab * self.hidden  # untied head


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    hbm_gb: float  # per chip
    hbm_gbps: float  # GB/s
    bf16_tflops: float  # dense peak
    link_gbps: float  # bidirectional chip-to-chip bandwidth, GB/s
    collective_us: float  # fixed cost of one collective


# Published figures: Llama 3 configs (Meta); TPU v5e and v6e (Cloud TPU documentation);
# H100 SXM (NVIDIA: 989 dense bf16 TFLOP/s, 3.35 TB/s HBM3, 900 GB/s NVLink 4).
MODELS = (
    Model("Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256),
    Model("Llama-3-70B", 80, 8192, 64, 8, 128, 28672, 128256),
)
CHIPS = (
    Chip("TPU v5e", 16, 819, 197, 400, 5),
    Chip("TPU v6e", 32, 1638, 918, 800, 5),
    Chip("H100 SXM", 80, 3350, 989, 900, 10),
)
BYTES = 2  # bf16
RESERVED = 0.9  # fraction of HBM usable for weights and KV (the rest: activations, XLA)


def step(m: Model, c: Chip, tp: int, seqs: int, context: int) -> dict:
    """Per-chip figures of one decode step (``seqs`` sequences at ``context`` tokens)."""
    weights = (m.layers * m.layer_params + m.vocab * m.hidden) * BYTES / tp  # read per step
    stored = m.params * BYTES / tp  # held: the embedding table too, split by vocabulary
    kv_token = m.layers * 2 * (m.kv_heads // tp or 1) * m.head_dim * BYTES  # per chip
    kv = seqs * context * kv_token
    flops = 2 * (m.layers * m.layer_params + m.vocab * m.hidden) * seqs / tp
    flops += 4 * context * m.heads * m.head_dim * m.layers * seqs / tp
    t_mem = (weights + kv) / (c.hbm_gbps * 1e9)
    t_flop = flops / (c.bf16_tflops * 1e12)
    n_coll = 2 * m.layers + 1 if tp > 1 else 0
    buf = seqs * m.hidden * BYTES
    per_coll = 2 * (tp - 1) / tp * buf / (c.link_gbps / 2 * 1e9) if tp > 1 else 0.0
    t_comm = n_coll * (per_coll + c.collective_us * 1e-6)
    fits = stored + kv <= RESERVED * c.hbm_gb * 1e9
    room = RESERVED * c.hbm_gb * 1e9 - stored
    max_seqs = max(int(room // (context * kv_token)), 0)
    total = max(t_mem, t_flop) + t_comm
    return dict(
        weights_gb=stored / 1e9,
        kv_gb=kv / 1e9,
        fits=fits,
        max_seqs=max_seqs,
        gflop=flops / 1e9,
        t_mem_ms=t_mem * 1e3,
        t_flop_ms=t_flop * 1e3,
        collectives=n_coll,
        t_comm_ms=t_comm * 1e3,
        step_ms=total * 1e3,
        tokens_per_s=seqs / total,
    )


def tables(seqs: int, context: int) -> str:
    out = []
    for m in MODELS:
        out.append(
            f"### {m.name} ({m.params / 1e9:.2f}B parameters), {seqs} sequences at "
            f"{context} tokens\n"
        )
        out.append(
            "| chips | TP | weights GB/chip | KV GB/chip | fits | max seqs at this context "
            "| GFLOP/chip | memory ms | compute ms | all-reduces | collective ms | step ms "
            "| tokens/s |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for c in CHIPS:
            for tp in (1, 2, 4, 8):
                r = step(m, c, tp, seqs, context)
                out.append(
                    f"| {c.name} | {tp} | {r['weights_gb']:.1f} | {r['kv_gb']:.1f} | "
                    f"{'yes' if r['fits'] else 'no'} | {r['max_seqs']} | {r['gflop']:.0f} | "
                    f"{r['t_mem_ms']:.2f} | {r['t_flop_ms']:.2f} | {r['collectives']} | "
                    f"{r['t_comm_ms']:.2f} | {r['step_ms']:.2f} | {r['tokens_per_s']:,.0f} |"
                )
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    args = ap.parse_args(argv)
    print(tables(args.seqs, args.context))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
