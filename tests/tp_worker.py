"""Run by tests/test_sharding.py in a fresh process with 8 fake CPU devices (the device
count is fixed when JAX starts): a paged step under tensor parallelism against one device.

    python tests/tp_worker.py BACKEND MODEL:TP[,TP...] [MODEL:TP...]

MODEL is tiny-llama (4 query, 2 KV heads), gqa-8-4, gqa-8-2, vocab-211, moe-4 or gpt-oss-4,
or a mixture's name with "-ep": its experts split by expert (expert_parallel); "#int8"
after a name quantizes the weights first (the experts too), "@ragged" multiplies the
experts that way; each against one device. Prints one
JSON line."""

import contextlib
import dataclasses
import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from model_helpers import gqa_config, pool_collectives  # noqa: E402

from paged_jax import (  # noqa: E402
    AttentionMetadata,
    BlockManager,
    ScheduledSeq,
    build_batch,
    models,  # noqa: E402
)
from paged_jax.models.config import YarnRopeScaling  # noqa: E402
from paged_jax.models.layers import moe  # noqa: E402
from paged_jax.models.sharding import shard_model  # noqa: E402
from paged_jax.sharding import shard_cache, tensor_parallel_mesh  # noqa: E402

PROMPTS = {"a": list(range(1, 30)), "b": [5, 6, 7, 8, 9], "c": [200, 3] * 9}


def run(cfg, tp: int, backend: str, steps: int = 4, expert_parallel: bool = False, fmt=None):
    """Prefill, then ``steps`` greedy decode steps (the weights quantized to ``fmt`` first,
    if given); returns (all logits, tokens, facts)."""
    model = models.init_model(cfg, seed=1)
    if fmt:
        model.quantize(fmt)
    mesh = tensor_parallel_mesh(tp)
    model = shard_model(model, mesh, expert_parallel=expert_parallel)
    interpret = backend != "xla"
    step, state = models.make_step(model, backend=backend, interpret=interpret)
    cache = shard_cache(model.make_cache(num_pages=64, page_size=8), mesh)
    bm = BlockManager(64, 8)
    for sid, ids in PROMPTS.items():
        bm.allocate(sid, ids)
    sched = [ScheduledSeq(s, 0, len(p)) for s, p in PROMPTS.items()]
    logits_all, tokens = [], {s: [] for s in PROMPTS}
    with jax.set_mesh(mesh):
        for k in range(steps + 1):
            batch = build_batch(bm, sched)
            md = AttentionMetadata.from_batch(batch)
            if k == steps:
                hlo = step.lower(state, batch.token_ids, batch.positions, cache, md)
                hlo = hlo.compile().as_text()
            logits, cache = step(state, batch.token_ids, batch.positions, cache, md)
            logits = np.asarray(logits)[: len(PROMPTS)]
            logits_all.append(logits)
            for i, s in enumerate(sched):
                bm.mark_computed(s.seq_id, s.stop)
                tok = int(logits[i].argmax())
                tokens[s.seq_id].append(tok)
                bm.append_slots(s.seq_id, [tok])
            sched = [ScheduledSeq(s.seq_id, s.stop, s.stop + 1) for s in sched]
    shard = cache.kv_pages.addressable_shards[0].data
    facts = dict(
        device_cache_bytes=int(shard.nbytes),
        total_cache_bytes=int(cache.kv_pages.nbytes),
        cache_collectives=pool_collectives(hlo, cache),
        all_reduces=hlo.count("all-reduce"),
    )
    if cfg.sparse:  # one device's slice of the experts' gate weights [L, X, H, F]
        gate = model.layers.mlp.experts.gate_proj.get_value()
        facts["expert_shard"] = list(gate.addressable_shards[0].data.shape)
    return logits_all, tokens, facts


CONFIGS = {
    "tiny-llama": models.TINY_LLAMA,
    "gqa-8-4": gqa_config(4),
    "gqa-8-2": gqa_config(2),
    # a vocabulary no tensor-parallel size divides: padded (models.sharding.pad_vocab)
    "vocab-211": dataclasses.replace(gqa_config(2), vocab_size=211),
    # a mixture of experts with a shared expert: each expert's width split over the mesh;
    # its first layer dense (dense_layers: that layer's MLP split as a dense model's)
    "moe-4": dataclasses.replace(
        gqa_config(4),
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        dense_layers=(0,),
    ),
    # GPT-OSS's parts: attention sinks (split with the heads), sliding and full layers,
    # YaRN, biases on attention, router and experts, the clamped unit
    "gpt-oss-4": dataclasses.replace(
        gqa_config(4),
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        router_scoring="topk_softmax",
        moe_bias=True,
        swiglu_limit=7.0,
        attention_sinks=True,
        qkv_bias=True,
        o_bias=True,
        sliding_window=8,
        layer_types=("sliding_attention", "full_attention"),
        rope_scaling=YarnRopeScaling(factor=4.0, original_max_position_embeddings=32),
        architecture="GptOssForCausalLM",
    ),
}


def main() -> None:
    backend, grid = sys.argv[1], sys.argv[2:]
    out = {}
    for entry in grid:
        name, _, sizes = entry.partition(":")
        base, _, way = name.partition("@")  # "@ragged": the experts' products that way
        base, _, fmt = base.partition("#")  # "#int8": the weights quantized first
        ep = base.endswith("-ep")
        cfg = CONFIGS[base.removesuffix("-ep")]
        ref_logits, ref_tokens, _ = run(cfg, 1, backend, fmt=fmt)
        for tp in map(int, sizes.split(",")):
            try:
                with moe.expert_way(way) if way else contextlib.nullcontext():
                    logits, tokens, facts = run(cfg, tp, backend, expert_parallel=ep, fmt=fmt)
            except ValueError as e:
                out[f"{name}/tp{tp}"] = {"error": str(e)}
                continue
            err = max(float(np.abs(a - b).max()) for a, b in zip(logits, ref_logits, strict=True))
            out[f"{name}/tp{tp}"] = dict(
                max_logit_error=err, same_tokens=tokens == ref_tokens, **facts
            )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
