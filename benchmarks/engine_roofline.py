"""The engine benchmark's model shapes and ideals: the public checkpoints' shapes
(``SHAPE_FIELDS``), a decode step built from shapes alone (``abstract_decode_step``), how
often a compiled step reads each weight byte (``weight_reads``), a step compiled for a
TPU slice none of whose chips is attached (``compile_on_tpu_mesh``), and the roofline of a
workload on a device whose peaks are known (``device_peaks``, ``prefill_flops``,
``roofline_tokens_per_s``). Used by ``bench_engine``, ``bench_step_kernels`` and tests."""

from __future__ import annotations

# Shapes of the public checkpoints (config.json of each); weights are random here.
SHAPE_FIELDS = {
    "smollm2-135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    "llama3-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        max_position_embeddings=8192,
    ),
    # a mixture of experts: 128 experts of width 768 a layer, 8 a token (3.3 B active of
    # 30.5 B weights)
    "qwen3-30b-a3b": dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        qk_norm=True,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        architecture="Qwen3MoeForCausalLM",
    ),
}
PAGE = 16


def abstract_decode_step(make, seqs: int, context: int, page: int = PAGE):
    """A decode step of ``make()``'s model (a ``LlamaForCausalLM``) built from shapes
    alone (``nnx.eval_shape``: nothing allocated): ``(graphdef, state, cache, batch, md)``
    for ``seqs`` sequences of ``context - 1`` computed tokens computing one more each,
    the cache (``ShapeDtypeStruct``s) just large enough, in pages of ``page`` tokens."""
    import jax
    from flax import nnx

    import paged_jax as pj

    abstract = nnx.eval_shape(make)
    graphdef, state = nnx.split(abstract)
    pages = seqs * -(-context // page) + 1
    cache = jax.eval_shape(lambda: abstract.make_cache(pages, page))
    bm = pj.BlockManager(pages, page, enable_prefix_caching=False, watermark=0.0)
    for i in range(seqs):
        bm.allocate(i, list(range(context - 1)))
        bm.mark_computed(i, context - 1)
        bm.append_slots(i, [1])
    batch = pj.build_batch(bm, [pj.ScheduledSeq(i, context - 1, context) for i in range(seqs)])
    return graphdef, state, cache, batch, pj.AttentionMetadata.from_batch(batch)


def weight_reads(
    fields: dict,
    *,
    dtype="float32",
    seqs: int = 1,
    context: int = 8,
    layers=(2, 4),
    hold=None,
    backend: str = "xla",
    compile_fn=None,
    widen: float = 1.25,
) -> dict:
    """How many times XLA's cost analysis says one compiled decode step reads each byte of
    the layers' weights, for a model of config ``fields`` held as the engine holds a
    model off the CPU (``hold_for_accelerator``; or ``hold(model)`` when given, which
    returns the model), built from shapes alone (nothing allocated).

    The step (``seqs`` sequences at ``context`` tokens, the XLA attention backend, the
    model's own ``__call__``) is compiled for four models: ``layers[0]`` and
    ``layers[1]`` layers, each at the config's width and ``widen`` times it
    (``hidden_size``, ``intermediate_size`` and a mixture's ``moe_intermediate_size``;
    the same heads; keep the wide sizes multiples of 256 where a compiler pads others:
    TPU's grouped product read an expert width of 960 three times, 1536 once).
    ``bytes_per_weight_byte`` is the double difference of the bytes accessed over that
    of the weight bytes: 1.0 when each weight is read once, in place; about 3 when each
    layer's slice is copied out of a stack; far below 1 when the layers run in a loop
    whose body the analysis counts once. The differences cancel what the analysis
    charges that is not a layer's weights: the embedding lookup (a gather is charged its
    whole table) and the head do not grow with layers, attention and the pool do not
    grow with the width. The pool is kept small (default: one sequence's page and the
    null page), because each in-place scatter and gather is charged its whole ``[L, N,
    ...]`` operand, which grows with layers x layers. Also returns the four
    ``bytes_accessed`` and ``weight_bytes`` (``[narrow, wide]`` per layer count) and the
    compile seconds. ``backend``: the attention backend; ``compile_fn(fn, *args)``: what
    compiles the step (default: ``jax.jit(fn).lower(*args).compile()`` on the default
    device; for a TPU, ``paged_jax.kernels.tpu.aot.compile_for_tpu``)."""
    import time

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from paged_jax import models

    dt = jnp.dtype(dtype)

    def one(f):
        cfg = models.LlamaConfig(**f)

        def make():
            m = models.LlamaForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=dt, param_dtype=dt)
            return m.hold_for_accelerator() if hold is None else hold(m)

        graphdef, state, cache, batch, md = abstract_decode_step(make, seqs, context)

        def step(state, tokens, positions, cache):
            return nnx.merge(graphdef, state)(tokens, positions, cache, md, backend=backend)

        t = time.perf_counter()
        args = (state, jnp.asarray(batch.token_ids), jnp.asarray(batch.positions), cache)
        if compile_fn is None:
            compiled = jax.jit(step, donate_argnums=(3,)).lower(*args).compile()
        else:
            compiled = compile_fn(step, *args)
        seconds = time.perf_counter() - t
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
        return cost["bytes accessed"], weights, seconds

    def widths(num_layers):
        f = dict(fields, num_layers=num_layers)
        wide = dict(
            f,
            hidden_size=int(f["hidden_size"] * widen),
            intermediate_size=int(f["intermediate_size"] * widen),
        )
        if f.get("moe_intermediate_size"):  # a mixture: its experts' width too
            wide["moe_intermediate_size"] = int(f["moe_intermediate_size"] * widen)
        return one(f), one(wide)

    runs = [widths(n) for n in layers]
    (b00, w00, _), (b01, w01, _) = runs[0]
    (b10, w10, _), (b11, w11, _) = runs[1]
    return dict(
        bytes_per_weight_byte=((b11 - b10) - (b01 - b00)) / ((w11 - w10) - (w01 - w00)),
        bytes_accessed=[[r[0] for r in pair] for pair in runs],
        weight_bytes=[[r[1] for r in pair] for pair in runs],
        compile_s=sum(r[2] for pair in runs for r in pair),
    )


# Dense bf16 peak (FLOP/s) and memory bandwidth (bytes/s) by device kind, from the
# vendor's data sheets (SXM parts).
PEAKS = {"H100": (989e12, 3.35e12), "H200": (989e12, 4.8e12)}


def device_peaks(device_kind: str) -> tuple[float, float] | None:
    """``(bf16 FLOP/s, bytes/s)`` of a device kind ("NVIDIA H100 80GB HBM3"), or None."""
    for key, peaks in PEAKS.items():
        if key in device_kind:
            return peaks
    return None


def _feed_forward(fields: dict, tokens: int) -> tuple[int, int]:
    """``(parameters a token multiplies by, parameters a step of ``tokens`` tokens reads)``
    of one layer's feed-forward block: a dense MLP's, or a mixture's router and chosen
    experts (the experts ``tokens`` tokens choose, expected under uniform routing:
    ``X * (1 - (1 - k / X) ** tokens)``)."""
    E = fields["hidden_size"]
    X = fields.get("num_experts", 0)
    if not X:
        return 3 * E * fields["intermediate_size"], 3 * E * fields["intermediate_size"]
    k, F = fields["num_experts_per_tok"], fields["moe_intermediate_size"]
    chosen = X * (1 - (1 - k / X) ** tokens)
    return E * X + k * 3 * E * F, int(E * X + chosen * 3 * E * F)


def prefill_flops(fields: dict, concurrency: int, prompt_len: int) -> float:
    """FLOPs of one step prefilling ``concurrency`` prompts of ``prompt_len`` tokens: the
    layers' products for every token (a mixture's: its router and chosen experts), the
    head for each prompt's last, causal attention."""
    E, L, V = (fields[k] for k in ("hidden_size", "num_layers", "vocab_size"))
    H, K, D = fields["num_heads"], fields["num_kv_heads"], fields["head_dim"]
    layer = 2 * E * H * D + 2 * E * K * D + _feed_forward(fields, 1)[0]
    attn = 4 * L * H * D
    P = prompt_len
    return concurrency * (2 * L * layer * P + 2 * V * E + attn * P * (P + 1) / 2)


def roofline_tokens_per_s(
    fields: dict, concurrency: int, prompt_len: int, output_len: int, peaks, bytes_per=2
) -> float:
    """Output tokens/s of the workload if every step took the larger of its bytes over the
    bandwidth and its FLOPs over the peak (``peaks``: ``device_peaks``), with 16-bit
    weights and KV: one prefill step of every prompt (its products, logits for the last
    token only, causal attention), then ``output_len - 1`` decode steps, step k reading
    every weight (the embedding table included; of a mixture's experts, those its
    ``concurrency`` tokens choose, ``_feed_forward``) and the KV of ``prompt_len + k``
    tokens per sequence. (Issue 57's table counted every parameter's two FLOPs for every
    prompt token; this ideal is a few percent higher, so its fractions a few percent
    lower.)"""
    flops_peak, bandwidth = peaks
    E, L, V = (fields[k] for k in ("hidden_size", "num_layers", "vocab_size"))
    H, K, D = fields["num_heads"], fields["num_kv_heads"], fields["head_dim"]
    attention = 2 * E * H * D + 2 * E * K * D
    per_token, read = _feed_forward(fields, concurrency)
    products = L * (attention + per_token) + V * E  # the layers and the head
    tables = 1 if fields.get("tie_word_embeddings") else 2
    weights = bytes_per * (L * (attention + read + 2 * E) + E + tables * V * E)
    kv_per_token = bytes_per * L * 2 * K * D
    attn = 4 * L * H * D  # QK and PV FLOPs per (query, key) pair
    C, P = concurrency, prompt_len
    seconds = prefill_flops(fields, C, P) / flops_peak
    for k in range(1, output_len):
        context = P + k
        flops = C * (2 * products + attn * context)
        seconds += max((weights + C * context * kv_per_token) / bandwidth, flops / flops_peak)
    return C * output_len / seconds


def compile_on_tpu_mesh(
    fields: dict,
    topology: str,
    chips: tuple[int, int],
    *,
    seqs: int = 64,
    context: int = 1024,
    dtype="bfloat16",
    backend: str = "pallas_tpu",
) -> dict:
    """Compiles the decode step of a model of config ``fields`` (``seqs`` sequences at
    ``context`` tokens; weights and pool from shapes alone) for a TPU slice described,
    not attached (``topology``, e.g. ``"v6e:2x2"``, of ``chips`` (x, y) chips on one
    host), with the weights and the pool split over all its chips on a ``"tp"`` axis as
    ``paged_jax.models.sharding`` splits them (the layers scanned, as the engine runs a
    model on a mesh). Needs libtpu and ``JAX_PLATFORMS=cpu``
    (``paged_jax.kernels.tpu.aot``). Returns the compile seconds, the chips, the weight
    bytes and XLA's memory analysis per chip."""
    import os
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from paged_jax import models
    from paged_jax.models.sharding import state_shardings
    from paged_jax.sharding import cache_shardings, kv_head_replicas, replicate_kv_heads

    n = chips[0] * chips[1]
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")  # quiets libtpu's probing
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    desc = topologies.get_topology_desc(
        platform="tpu",
        topology_name=topology,
        chip_config_name="default",
        chips_per_host_bounds=(*chips, 1),
        num_slices=1,
    )
    mesh = Mesh(np.array(desc.devices), ("tp",))
    cfg = models.LlamaConfig(**fields)
    dt = jnp.dtype(dtype)

    def make():
        return models.LlamaForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=dt, param_dtype=dt)

    graphdef, state, cache, batch, md = abstract_decode_step(make, seqs, context)
    cache = jax.eval_shape(
        lambda c: replicate_kv_heads(c, kv_head_replicas(cfg.num_kv_heads, n)), cache
    )

    def placed(tree, shardings):
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings
        )

    state = placed(state, state_shardings(cfg, state, mesh))
    cache = placed(cache, cache_shardings(cache, mesh))
    whole = NamedSharding(mesh, PartitionSpec())
    tokens, positions = (
        jax.ShapeDtypeStruct(a.shape, jnp.int32, sharding=whole)
        for a in (batch.token_ids, batch.positions)
    )

    def step(state, tokens, positions, cache):
        return nnx.merge(graphdef, state)(tokens, positions, cache, md, backend=backend)

    with jax.set_mesh(mesh), jax.default_device(desc.devices[0]):
        t = time.perf_counter()
        compiled = jax.jit(step, donate_argnums=(3,)).lower(state, tokens, positions, cache)
        compiled = compiled.compile()
        seconds = time.perf_counter() - t
    mem = compiled.memory_analysis()
    return dict(
        compile_s=seconds,
        chips=n,
        weight_bytes=sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(state)),
        argument_bytes_per_chip=getattr(mem, "argument_size_in_bytes", None),
        temp_bytes_per_chip=getattr(mem, "temp_size_in_bytes", None),
    )
