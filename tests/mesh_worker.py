"""Run by tests/test_sharding.py in fresh processes with fake CPU devices (the device
count is fixed when JAX starts): the engine (``LLM``) under tensor and data parallelism.

    python tests/mesh_worker.py engine MESH[,MESH...] [MODEL]  one process, 8 devices
    python tests/mesh_worker.py host PID PORT MESH[,MESH...] one of 2 processes x 4 devices
    python tests/mesh_worker.py routing                      2 replicas on 2 devices
    python tests/mesh_worker.py draft                        a draft and embeddings at tp 2

A MESH is ``TP`` or ``TPxDP`` (tensor- x data-parallel size). The MODEL is one with 8
query and 2 KV heads, the ``tiny-llama`` preset (4 and 2), or ``gemma3``, the golden
tiny Gemma 3 (4 and 2; sliding layers, so a hybrid pool of layer groups), or ``moe-ep``: a
mixture of 8 experts (2 a token) with 8 and 2 heads, its experts split by expert
(``model.shard(mesh, expert_parallel=True)``). Prints one JSON line: for
each mesh, every request's tokens and facts about the cache, the compiled steps and
their HLO.
"""

import contextlib
import dataclasses
import json
import math
import os
import pathlib
import sys

MODE = sys.argv[1]
MODEL = sys.argv[3] if MODE == "engine" and len(sys.argv) > 3 else "gqa-8-2"
DEVICES = {"engine": 8, "host": 4, "routing": 2, "draft": 2}[MODE]
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

if MODE == "host":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{sys.argv[3]}",
        num_processes=2,
        process_id=int(sys.argv[2]),
        initialization_timeout=120,
    )

from model_helpers import gqa_config, pool_collectives  # noqa: E402

import paged_jax as pj  # noqa: E402
from paged_jax import models  # noqa: E402
from paged_jax.engine.runner import STEP_STATIC_ARGS  # noqa: E402

PAGE = 8
GEMMA3 = pathlib.Path(__file__).resolve().parent / "golden" / "hf" / "gemma3"
# 8 query heads, 2 KV heads: tensor-parallel 4 and 8 repeat each KV head 2 and 4 times
GQA_2 = gqa_config(2)


def workload():
    """Greedy, seeded-sampled and n=2 requests (the samples fork the prompt's last page:
    copy-on-write), long enough that a 14-page pool must preempt (swap)."""
    g = dict(max_tokens=24, ignore_eos=True)
    prompts = [list(range(1, 30)), [5, 6, 7, 8, 9], [200, 3] * 9, list(range(100, 140))]
    params = [
        pj.SamplingParams(**g),
        pj.SamplingParams(temperature=0.9, top_p=0.9, seed=3, **g),
        pj.SamplingParams(n=2, temperature=1.0, seed=5, **g),
        pj.SamplingParams(temperature=0.7, top_k=20, seed=9, **g),
    ]
    return prompts, params


class Recorder:
    """Wraps the engine's jitted step, keeping the last call's arguments (to lower it)."""

    def __init__(self, run):
        self.run, self.last = run, None

    def _cache_size(self):
        return self.run._cache_size()  # noqa: SLF001

    def __call__(self, *args, **kw):
        self.last = (args, kw)
        return self.run(*args, **kw)


def run(spec: str) -> dict:
    tp, _, dp = spec.partition("x")
    tp, dp = int(tp), int(dp or 1)
    mesh = pj.parallel_mesh(tp, dp) if tp * dp > 1 else None
    # on a mesh: initialized straight into the shards, as models.load(name, mesh=) loads
    pages = 14
    if MODEL == "tiny-llama":
        model, _ = models.load("tiny-llama", mesh=mesh)
    elif MODEL == "gemma3":  # a hybrid pool: pages of 1 layer slot, 4 sliding groups
        model, _ = models.load_hf(GEMMA3, dtype=jnp.float32, mesh=mesh)
        pages = 62  # of one layer slot: each request fits alone (5 groups x 6 pages x n=2
        # at admission), together they preempt
    elif MODEL == "moe-ep":  # whole experts on each device, then the engine on the mesh
        cfg = dataclasses.replace(
            GQA_2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64
        )
        model = models.init_model(cfg, seed=1)
        if mesh is not None:
            model.shard(mesh, expert_parallel=True)
    else:
        model = models.init_model(GQA_2, seed=1, mesh=mesh)
    llm = pj.LLM(
        model,
        num_pages=pages * dp,  # per replica
        page_size=PAGE,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        preemption="swap" if jax.process_count() == 1 else "recompute",
        num_host_pages=64 * dp,
        watermark=0.0,
        mesh=mesh,
        compilation_cache=False,
    )
    llm.runner.step_fn = Recorder(llm.runner.step_fn)  # noqa: SLF001
    routed = [0] * dp  # requests each replica's scheduler received
    for r, sc in enumerate(llm.schedulers):
        sc.add = lambda g, add=sc.add, r=r: (routed.__setitem__(r, routed[r] + 1), add(g))
    prompts, params = workload()
    vocab = model.config.vocab_size  # gemma3: 64
    prompts = [[t % vocab for t in p] for p in prompts]
    outs = llm.generate(prompts, params, progress=False)
    args, kw = llm.runner.step_fn.last  # noqa: SLF001
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        compiled = llm.runner.step_fn.run.lower(*args, **kw).compile()  # noqa: SLF001
    hlo = compiled.as_text()
    pages = llm.cache.kv_pages
    # what the compiled step takes per device, less every argument but the pool: the
    # pool's bytes per device as XLA sees them (each argument's share as the compiled
    # step takes it: XLA may split a host array, such as the packed step inputs, over
    # the replicas that read it)
    dynamic = {k: v for k, v in kw.items() if k not in STEP_STATIC_ARGS}
    leaves = jax.tree.leaves((args, dynamic))
    shardings = jax.tree.leaves(compiled.input_shardings)
    others = sum(
        math.prod(sh.shard_shape(x.shape)) * x.dtype.itemsize
        for x, sh in zip(leaves, shardings, strict=True)
        if (x.shape, x.dtype) != (pages.shape, pages.dtype)
    )
    compiled_cache_bytes = compiled.memory_analysis().argument_size_in_bytes - others
    m = llm.metrics
    return dict(
        tokens=[[c.token_ids for c in o.outputs] for o in outs],
        device_cache_bytes=int(pages.addressable_shards[0].data.nbytes),
        total_cache_bytes=int(pages.nbytes),
        compiled_cache_bytes=int(compiled_cache_bytes),
        kv_heads=llm.cache.num_kv_heads,
        compilations=m.compilations,
        compiled_steps=llm.runner.step_fn._cache_size(),  # noqa: SLF001
        preemptions=m.preemptions_swap + m.preemptions_recompute,
        max_pages_shared=m.max_pages_shared,
        pool_collectives=pool_collectives(hlo, llm.cache),
        all_reduces=hlo.count("all-reduce("),
        replica_requests=routed,
        hybrid=llm.hybrid_kv_cache,
        process=jax.process_index(),
        devices=jax.device_count(),
    )


def errors() -> list[str]:
    """The messages of arguments that do not fit data parallelism."""
    model = models.init_model(GQA_2, seed=1)
    found = []
    for kw in (dict(num_pages=15, data_parallel_size=2), dict(num_pages=2, data_parallel_size=2)):
        try:
            pj.LLM(model, compilation_cache=False, **kw)
        except ValueError as e:
            found.append(str(e))
    llm = pj.LLM(model, num_pages=8, data_parallel_size=2, compilation_cache=False)
    try:
        llm.bm  # noqa: B018
    except AttributeError as e:
        found.append(str(e))
    return found


def routing() -> dict:
    """Two waves of requests on 2 replicas: first a prompt of family A and one of B (a
    24-token system prompt each), then two of each family in the order A A B B with
    other endings. Per router (prefix routing, and the least loaded replica alone): the
    replica of each request, the prefix-cache hits of the second wave, the tokens."""
    rng = __import__("numpy").random.default_rng(0)
    a, b = (rng.integers(1, 256, 24).tolist() for _ in range(2))
    ends = [rng.integers(1, 256, 5).tolist() for _ in range(6)]
    waves = [[a + ends[0], b + ends[1]], [a + ends[2], a + ends[3], b + ends[4], b + ends[5]]]
    p = pj.SamplingParams(max_tokens=6, ignore_eos=True)
    out = {}
    for name, kw in (("one", {}), ("prefix", {"data_parallel_size": 2}),
                     ("least_loaded", {"data_parallel_size": 2})):  # fmt: skip
        model, _ = models.load("tiny-llama")  # each engine its own (one device packs it)
        llm = pj.LLM(model, num_pages=64, page_size=PAGE, compilation_cache=False, **kw)
        llm.engine.router.enabled = name != "least_loaded"
        sent = []
        for r, sc in enumerate(llm.schedulers):
            sc.add = lambda g, add=sc.add, r=r, sent=sent: (sent.append(r), add(g))
        tokens, hits = [], 0
        for k, wave in enumerate(waves):
            outs = llm.generate(wave, p, progress=False)
            tokens += [o.outputs[0].token_ids for o in outs]
            hits += sum(o.metrics.num_cached_tokens for o in outs) if k else 0
        out[name] = dict(replicas=sent, hits=hits, tokens=tokens)
    return out


def draft() -> dict:
    """Speculative decoding with a draft model, and embeddings, on one device and at
    tensor-parallel size 2 (the draft's pool split along heads as the target's): the
    tokens, the draft's proposals and pool bytes per device, the embeddings."""
    np = __import__("numpy")
    prompts = [[5, 6, 7, 8] * 6, list(range(30, 50))]
    p = pj.SamplingParams(max_tokens=16, ignore_eos=True)
    spec = {"method": "draft", "draft_model": "tiny-llama", "num_speculative_tokens": 3}
    out = {}
    for tp in (1, 2):
        model, _ = models.load("tiny-llama")
        llm = pj.LLM(model, num_pages=64, page_size=PAGE, tensor_parallel_size=tp,
                     speculative=spec, compilation_cache=False)  # fmt: skip
        outs = llm.generate(prompts, p, progress=False)
        pool = llm.engine.speculator.proposer.cache.kv_pages
        out[tp] = dict(
            tokens=[o.outputs[0].token_ids for o in outs],
            proposed=llm.metrics.spec_draft_tokens,
            failed=llm.metrics.failed_steps,
            draft_pool_share=int(pool.addressable_shards[0].data.nbytes) / int(pool.nbytes),
            embeddings=np.stack([e.embedding for e in llm.embed(prompts)]).tolist(),
        )
    return out


def main() -> None:
    if MODE == "routing":
        print(json.dumps(routing()))
        return
    if MODE == "draft":
        print(json.dumps(draft()))
        return
    specs = sys.argv[2 if MODE == "engine" else 4].split(",")
    out = {spec: run(spec) for spec in specs}
    if MODE == "engine":
        out["errors"] = errors()
    print(json.dumps(out))
    if MODE == "host":
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
