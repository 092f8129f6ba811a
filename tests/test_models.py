"""The Flax decoder on the paged cache: paged == unpaged, one compile per bucket, configs."""

import dataclasses
import functools
import gc
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_helpers import PagedGreedy, dense_greedy, dense_logits
from paged_cases import grid_case

from paged_jax import linear as paged_linear
from paged_jax.metadata import AttentionMetadata
from paged_jax.models import TINY_LLAMA, LlamaConfig, RopeScaling, init_model
from paged_jax.models.layers import Embed

PROMPTS = {"a": [256, 72, 105, 33], "b": list(range(60, 97)), "c": [256, 7]}


@pytest.fixture(scope="module")
def tiny():
    return init_model(TINY_LLAMA, seed=0)


def test_prefill_logits_match_dense(tiny):
    ids = np.array(PROMPTS["b"])
    cache = tiny.make_cache(16, 8)
    md = AttentionMetadata.prefill(
        len(ids), 8 + np.arange(len(ids)), [1, 2, 3, 4, 5], logits_all=True
    )
    logits, _ = tiny(jnp.asarray(ids, jnp.int32), jnp.arange(len(ids), dtype=jnp.int32), cache, md)
    ref = dense_logits(tiny, ids)
    assert np.abs(np.asarray(logits) - ref).max() <= 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize("page_size", [1, 8, 16, 32])
def test_paged_greedy_equals_unpaged(tiny, page_size):
    # Prompts of different lengths decoded together through the paged cache give the
    # tokens of a cache-free dense forward pass, on every page size.
    g = PagedGreedy(tiny, page_size=page_size, num_pages=4 + 160 // page_size * 3)
    out = g.decode(g.prefill(PROMPTS), max_new=12)
    for sid, prompt in PROMPTS.items():
        assert out[sid] == dense_greedy(tiny, prompt, 12), sid


def test_sliding_window_and_tied_embeddings_paged_equals_unpaged():
    cfg = dataclasses.replace(
        TINY_LLAMA, sliding_window=6, tie_word_embeddings=True, architecture="MistralForCausalLM"
    )
    model = init_model(cfg, seed=1)
    assert model.lm_head is None
    g = PagedGreedy(model, page_size=4)
    out = g.decode(g.prefill({"x": PROMPTS["b"][:13]}), max_new=10)
    assert out["x"] == dense_greedy(model, PROMPTS["b"][:13], 10)


def test_fork_and_prefix_hit_keep_outputs(tiny):
    g = PagedGreedy(tiny, page_size=8, prefix_caching=True)
    first = g.prefill({"p": PROMPTS["b"]})
    out = g.decode(first, max_new=8, forks={"child": "p"})
    expected = dense_greedy(tiny, PROMPTS["b"], 8)
    assert out["p"] == out["child"] == expected
    # A later prompt sharing the first 32 tokens reuses 4 pages and computes only the rest.
    before = g.computed_tokens
    prompt2 = PROMPTS["b"][:32] + [5, 6, 7]
    first2 = g.prefill({"q": prompt2})
    assert g.computed_tokens - before == 3
    assert g.decode(first2, max_new=6)["q"] == dense_greedy(tiny, prompt2, 6)


def test_decode_loop_compiles_once_per_bucket(tiny):
    # 60 decode steps while sequences join and leave: compilations == distinct shapes.
    g = PagedGreedy(tiny, page_size=16, num_pages=128)
    rng = np.random.default_rng(0)
    live, next_id, steps = {}, 0, 0
    compiled_before = g.step._cache_size()
    decode_shapes = set()
    while steps < 60:
        if len(live) < 6 and rng.random() < 0.3:
            sid = f"s{next_id}"
            next_id += 1
            live.update(g.prefill({sid: list(rng.integers(0, 256, rng.integers(3, 30)))}))
            continue
        if len(live) > 1 and rng.random() < 0.1:
            gone = sorted(live)[0]
            g.bm.free(gone)
            del live[gone]
        sched_ids = sorted(live)
        from paged_jax.batch import ScheduledSeq

        sched = []
        for sid in sched_ids:
            g.bm.append_slots(sid, [live[sid]])
            n = g.bm.num_tokens(sid)
            sched.append(ScheduledSeq(sid, n - 1, n))
        logits = g.run(sched)
        decode_shapes.add(g.shapes[-1])
        for sid, row in zip(sched_ids, logits, strict=True):
            live[sid] = int(np.argmax(row))
        steps += 1
    all_shapes = set(g.shapes)
    assert g.step._cache_size() - compiled_before == len(all_shapes)
    assert len(decode_shapes) <= 2, decode_shapes  # a steady loop stays in its bucket(s)
    assert steps == 60 and next_id >= 4


@pytest.mark.parametrize(
    "changes,msg",
    [
        (dict(num_heads=5), "num_heads: expected a multiple of num_kv_heads=2, got 5"),
        (dict(hidden_size=0), "hidden_size: expected a positive int, got 0"),
        (dict(head_dim=31), "head_dim: expected an even number (RoPE), got 31"),
        (dict(sliding_window=0), "sliding_window: expected None or >= 1, got 0"),
        (
            dict(architecture="GPT2LMHeadModel"),
            "architecture: expected one of ('LlamaForCausalLM', 'Qwen2ForCausalLM', "
            "'Qwen3ForCausalLM', 'MistralForCausalLM', 'Gemma2ForCausalLM', "
            "'Gemma3ForCausalLM', 'MixtralForCausalLM', 'Qwen2MoeForCausalLM', "
            "'Qwen3MoeForCausalLM', 'GptOssForCausalLM'), got 'GPT2LMHeadModel'",
        ),
    ],
)
def test_config_errors_name_field_and_value(changes, msg):
    with pytest.raises(ValueError) as info:
        dataclasses.replace(TINY_LLAMA, **changes)
    assert str(info.value) == msg


def test_rope_scaling_errors_and_from_hf():
    with pytest.raises(
        ValueError,
        match="rope_scaling: expected 0 < low_freq_factor < "
        "high_freq_factor, got low_freq_factor=4.0",
    ):
        RopeScaling(8.0, 4.0, 1.0, 64)
    cfg = LlamaConfig.from_hf(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 10,
            "hidden_size": 8,
            "intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "rope_theta": 500000.0,
        }
    )
    assert cfg.rope_scaling.factor == 8.0 and cfg.rope_theta == 500000.0
    assert cfg.num_kv_heads == 2 and cfg.head_dim == 4
    with pytest.raises(ValueError, match=r"architectures: \['BertModel'\] is not supported"):
        LlamaConfig.from_hf({"architectures": ["BertModel"]})


GEMMA3_1B_HUB = {  # the keys of google/gemma-3-1b-it's config.json (transformers 4.50)
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "vocab_size": 262144,
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "num_hidden_layers": 26,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256,
    "rope_local_base_freq": 10000,
    "rope_theta": 1000000,
    "rope_scaling": None,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "rms_norm_eps": 1e-06,
}


def test_gemma_configs_as_the_hub_writes_them():
    g3 = LlamaConfig.from_hf(GEMMA3_1B_HUB)
    assert (
        g3.layer_types
        == (("sliding_attention",) * 5 + ("full_attention",)) * 4 + ("sliding_attention",) * 2
    )
    assert g3.layer_period == 6  # 26 layers: 4 groups of 6, then 2
    local, full = g3.layer_kinds[0], g3.layer_kinds[5]
    assert (local.sliding_window, local.rope_theta, local.rope_scaling) == (512, 10000.0, None)
    assert (full.sliding_window, full.rope_theta, full.rope_scaling) == (None, 1e6, None)
    assert g3.qk_norm and g3.norm_unit_offset and g3.sandwich_norms and g3.scale_embeddings
    assert g3.hidden_act == "gelu_tanh" and g3.tie_word_embeddings
    assert g3.attn_logit_softcap is None and g3.query_pre_attn_scalar == 256
    # Gemma 3 4B's text model: linear RoPE scaling on the global layers only
    g3_4b = LlamaConfig.from_hf(
        {**GEMMA3_1B_HUB, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    )
    assert g3_4b.layer_kinds[5].rope_scaling.factor == 8.0
    assert g3_4b.layer_kinds[0].rope_scaling is None
    # Gemma 2 without layer_types (transformers 4.x): alternating, soft caps by default
    g2 = LlamaConfig.from_hf(
        {
            "architectures": ["Gemma2ForCausalLM"],
            **{k: GEMMA3_1B_HUB[k] for k in ("vocab_size", "hidden_size", "intermediate_size")},
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
        }
    )
    assert g2.layer_types == ("sliding_attention", "full_attention") * 2
    assert g2.layer_period == 2 and g2.sliding_window == 4096 and g2.head_dim == 256
    assert (g2.attn_logit_softcap, g2.final_logit_softcap) == (50.0, 30.0)
    assert not g2.qk_norm and g2.layer_kinds[0].rope_theta == 10000.0
    assert TINY_LLAMA.layer_period == 1


@pytest.mark.parametrize(
    "changes, msg",
    [
        (
            {"architectures": ["Gemma3ForConditionalGeneration"]},
            "only text-only Gemma3ForCausalLM ones",
        ),
        ({"use_bidirectional_attention": True}, "only causal Gemma is supported"),
        ({"hidden_activation": "relu"}, "hidden_act: 'relu' is not supported"),
        ({"layer_types": ["full_attention"]}, "layer_types: expected 26 entries"),
        ({"sliding_window": None}, "sliding layers need sliding_window"),
        (
            {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
            "only the default RoPE is supported on sliding layers",
        ),
        ({"rope_scaling": {"rope_type": "longrope"}}, "rope_type: 'longrope' is not supported"),
    ],
)
def test_gemma_config_errors(changes, msg):
    with pytest.raises(ValueError, match=msg):
        LlamaConfig.from_hf({**GEMMA3_1B_HUB, **changes})


def _prefill_logits(model, ids):
    """The prefill's logits, its compiled HLO's text and the program as JAX emits it
    (StableHLO, before XLA's passes, which may add loops of their own: XLA:CPU's older
    emitters, as the tests use, expand a scatter into one)."""
    cache = model.make_cache(16, 8)
    md = AttentionMetadata.prefill(len(ids), 8 + np.arange(len(ids)), [1, 2, 3, 4, 5])
    step = jax.jit(lambda ids, pos, cache: model(ids, pos, cache, md)[0])
    args = (jnp.asarray(ids, jnp.int32), jnp.arange(len(ids), dtype=jnp.int32), cache)
    lowered = step.lower(*args)
    return np.asarray(step(*args)), lowered.compile().as_text(), lowered.as_text()


def _copied_weights(hlo: str, *models) -> int:
    """Slices in ``hlo`` shaped like one layer's kernel (as any of ``models`` holds it):
    each layer's weights copied out of the stacked ``[L, in, out]`` arrays."""
    shapes = {
        "[" + ",".join(map(str, np.shape(w)[-2:])) + "]"
        for model in models
        for w in jax.tree.leaves(nnx.state(model.layers))
        if np.ndim(w) >= 2
    }
    result_types = [  # `%name = f32[a,b]{1,0} op(...)`, a slice or a fusion named for one
        m.group(1)
        for line in hlo.splitlines()
        if "dynamic-slice" in line and (m := re.search(r" = (\S+) ", line))
    ]
    return sum(any(s in t for s in shapes) for t in result_types)


def _layer_weights(model, i: int) -> dict[tuple[str, ...], np.ndarray]:
    """Layer ``i``'s weights (``model.layer(i)``) by path, linear kernels ``[in, out]``
    however held, a fused projection's kernel and bias split into its parts' (named as
    before fusing)."""
    from paged_jax.models.layers import FUSED

    layer, out = model.layer(i), {}
    for p, var in nnx.to_flat_state(nnx.state(layer, nnx.Param)):
        p = tuple(map(str, p))
        module = functools.reduce(getattr, p[:-1], layer)
        value = np.asarray(module.weight() if p[-1] == "kernel" else var.get_value())
        if getattr(module, "parts", None) is None:
            out[p] = value
            continue
        pieces = np.split(value, np.cumsum(module.parts)[:-1], axis=-1)
        for name, piece in zip(FUSED[p[-2]], pieces, strict=True):
            out[(*p[:-2], name, p[-1])] = piece
    return out


_needs_kernels = pytest.mark.skipif(
    not paged_linear.available(), reason="the CPU kernels did not build here (no C compiler)"
)


def _held_way(name: str, pack: bool):
    """The packed way for every model and XLA's for two by default; XLA's for all: -m slow."""
    if pack:
        return pytest.param(name, pack, id=f"{name}-packed", marks=_needs_kernels)
    return grid_case(name, pack, id=f"{name}-xla", by_default=name in ("tiny-llama", "gemma3"))


@pytest.mark.parametrize(
    "name, pack",
    [_held_way(n, p) for p in (False, True) for n in ("tiny-llama", "qwen2", "gemma3", "llama3")],
)
def test_hold_for_cpu_keeps_the_logits_and_reads_weights_in_place(name, pack, monkeypatch):
    # Qwen2: biases on q/k/v; Gemma 3: 5 layers, groups of 3 plus a last partial group;
    # Llama 3: a tied embedding, held [E, V] (xla) or packed with the linear kernels.
    # On CPU devices on any machine, with CPU attention: what XLA:CPU compiles is the point.
    monkeypatch.delenv("PAGED_JAX_BACKEND", raising=False)
    with jax.default_device(jax.devices("cpu")[0]):
        _hold_for_cpu_case(name, pack)


def _hold_for_cpu_case(name, pack):
    from paged_jax.models.hf import to_hf_tensors

    model = _held_out_model(name)
    ids = list(range(3, 40))
    before, hlo_before, _ = _prefill_logits(model, ids)
    loaded = nnx.clone(model)  # the layouts as loaded
    layer1 = _layer_weights(model, 1)
    exported = to_hf_tensors(model)
    if not pack or name in ("tiny-llama", "qwen2"):  # packing stacks split weights again
        assert model.split_layer_weights() is model
    assert model.hold_for_cpu(pack=pack) is model
    model.hold_for_cpu(pack=pack)  # a second call changes nothing
    L, V, E = model.config.num_layers, model.config.vocab_size, model.config.hidden_size
    # packed: gate and up in one product (and q, k and v), as on accelerators
    up = model.layers.mlp.gate_up_proj if pack else model.layers.mlp.up_proj
    kernel = up.kernel.get_value()
    inner = model.config.intermediate_size
    assert up.packed == pack
    if pack:  # one stack [L, P, E, NR], each layer's product reading its weight by index
        nr = kernel.shape[-1]
        assert up.parts == (inner, inner)
        assert kernel.shape == (L, -(-2 * inner // nr), E, nr)
        assert not hasattr(model.layers.self_attn, "q_proj")
    else:
        assert isinstance(kernel, tuple) and len(kernel) == L
        assert all(k.shape == (E, inner) for k in kernel)
    tied = model.config.tie_word_embeddings
    assert tied == (name == "llama3")
    emb = model.embed_tokens
    assert (emb.transposed, emb.packed) == ((tied and not pack), (tied and pack))
    if not pack:
        assert emb.embedding.get_value().shape == ((E, V) if tied else (V, E))
    after, hlo_after, _ = _prefill_logits(model, ids)
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5 * np.abs(before).max())
    assert (after.argmax(-1) == before.argmax(-1)).all()
    # model.layer(i) gives the same weights as before, and the export the same tensors
    again = _layer_weights(model, 1)
    assert again.keys() == layer1.keys()
    assert all(np.array_equal(again[k], layer1[k]) for k in again)
    out = to_hf_tensors(model)
    assert out.keys() == exported.keys()
    assert all(np.array_equal(out[k], exported[k]) for k in out)
    # the stacked model copied each layer's kernels out of the stack (tiny-llama; Gemma 3's
    # 32-wide products fuse their slices); the split one does not
    if name == "tiny-llama":
        assert _copied_weights(hlo_before, loaded) > 0
    assert _copied_weights(hlo_after, loaded, model) == 0
    # packed: the products are the kernel's (4 a layer: q/k/v and gate/up fused)
    calls = hlo_after.count('custom_call_target="paged_jax_cpu_linear"')
    assert calls >= 4 if pack else calls == 0, calls


def _held_out_model(name):
    """tiny-llama at random, or a golden checkpoint (tests/golden/hf) in f32."""
    from paged_jax.models import load_hf

    if name == "tiny-llama":
        return init_model(TINY_LLAMA, seed=3)
    model, _ = load_hf(pathlib.Path(__file__).parent / "golden" / "hf" / name, dtype=jnp.float32)
    return model


@pytest.mark.parametrize("name", ["tiny-llama", "qwen2", "gemma3", "llama3"])
def test_hold_for_accelerator_keeps_the_logits_and_unrolls_the_layers(name):
    # Qwen2: biases on q/k/v; Gemma 3: 5 layers in groups of 3 (window, RoPE) plus a
    # partial group; Llama 3: a tied embedding, held [E, V].
    from paged_jax.models.hf import to_hf_tensors

    model = _held_out_model(name)
    ids = list(range(3, 40))
    before, _, _ = _prefill_logits(model, ids)
    loaded = nnx.clone(model)
    exported = to_hf_tensors(model)
    assert model.hold_for_accelerator() is model
    model.hold_for_accelerator()  # a second call changes nothing
    cfg = model.config
    L, E, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    assert model.unrolled
    # q/k/v and gate/up fused: one product each, every layer's own array
    attn, mlp = model.layers.self_attn, model.layers.mlp
    assert not hasattr(attn, "q_proj") and not hasattr(mlp, "up_proj")
    kernel = mlp.gate_up_proj.kernel.get_value()
    assert isinstance(kernel, tuple) and len(kernel) == L
    assert all(k.shape == (E, 2 * F) for k in kernel)
    HD, KD = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    assert attn.qkv_proj.parts == (HD, KD, KD)
    assert all(k.shape == (E, HD + 2 * KD) for k in attn.qkv_proj.kernel.get_value())
    tied = model.config.tie_word_embeddings
    assert model.embed_tokens.transposed == tied
    after, hlo, program = _prefill_logits(model, ids)
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5 * np.abs(before).max())
    if name != "gemma3":  # (the unpaged reference computes Llama-style blocks only)
        # it reads the fused products too (the engine holds a user's model in place,
        # and tests then compute their reference from it); the last position's logits
        dense = dense_logits(model, ids)[-1:]
        # On a GPU, XLA's f32 dots take TF32 (a 10-bit mantissa) unless told otherwise and
        # the two programs order their products differently: 7e-4 of logits up to 4.3 on
        # an H200 (the Llama 3 config), against at most 1e-4 of the largest on CPU.
        tol = 2e-3 if jax.default_backend() == "gpu" else 1e-4
        np.testing.assert_allclose(dense, before, rtol=tol, atol=tol * np.abs(before).max())
    assert (after.argmax(-1) == before.argmax(-1)).all()
    # one body per layer: no loop over layers, no switch picking a layer's weights, and
    # no layer's weights sliced out of a stack
    assert "stablehlo.while" not in program and "stablehlo.case" not in program
    assert _copied_weights(hlo, loaded, model) == 0
    # the same weights, exported as before (the fused products split again)
    out = to_hf_tensors(model)
    assert out.keys() == exported.keys() and all(np.array_equal(out[k], exported[k]) for k in out)
    # back to the CPU's layouts: the scan again, the same logits
    model.hold_for_cpu(pack=False)
    assert not model.unrolled
    again, _, _ = _prefill_logits(model, ids)
    np.testing.assert_allclose(again, before, rtol=1e-5, atol=1e-5 * np.abs(before).max())


@pytest.mark.parametrize("name, fmt", [("qwen2", None), ("llama3", "int4")])
def test_hold_for_accelerator_keeps_no_weight_twice(name, fmt, monkeypatch):
    # The per-layer and fused arrays replace the loaded ones as they are made: while
    # fusing, at most one fused array more is alive than before (each layer's parts are
    # dropped once joined), and afterwards no more bytes than before (Qwen2: biases fused
    # too; int4: scales and minimums fused with their kernels).
    model = _held_out_model(name)
    if fmt is not None:
        model.quantize(fmt)
    model.split_layer_weights()
    gc.collect()
    before = sum(a.nbytes for a in jax.live_arrays())
    peaks, largest = [], [0]
    concatenate = jnp.concatenate

    def counted(*args, **kw):
        out = concatenate(*args, **kw)
        largest[0] = max(largest[0], out.nbytes)
        peaks.append(sum(a.nbytes for a in jax.live_arrays()))  # (freed by refcount)
        return out

    monkeypatch.setattr(jnp, "concatenate", counted)
    model.hold_for_accelerator()
    monkeypatch.undo()
    gc.collect()
    assert sum(a.nbytes for a in jax.live_arrays()) <= before
    assert peaks and max(peaks) <= before + largest[0]
    assert hasattr(model.layers.self_attn, "qkv_proj")


@pytest.mark.skipif(not paged_linear.available(), reason="the CPU kernels did not build here")
def test_hold_for_accelerator_refuses_weights_packed_for_the_cpu():
    model = init_model(TINY_LLAMA, seed=0).hold_for_cpu(pack=True)
    with pytest.raises(ValueError, match="model: its weights are packed for the CPU kernels"):
        model.hold_for_accelerator()


def test_transposed_embedding_looks_up_the_same_rows():
    emb = Embed(50, 8, rngs=nnx.Rngs(0))
    ids = jnp.asarray([[3, 0, 49], [7, 7, 1]], jnp.int32)  # any leading shape
    x = jax.random.normal(jax.random.key(1), (4, 8))
    rows, logits, table = emb(ids), emb.attend(x), emb.table()
    with pytest.raises(TypeError, match="inputs"):  # held either way
        emb(ids.astype(jnp.float32))
    assert emb.hold_transposed() is emb and emb.hold_transposed().transposed
    assert emb.embedding.get_value().shape == (8, 50)
    np.testing.assert_array_equal(emb(ids), rows)
    np.testing.assert_allclose(emb.attend(x), logits, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(emb.table(), table)  # [V, E], whichever way it lies
    # the head's product contracts the table's first axis: [R, E] x [E, V], no transpose
    graphdef, state = nnx.split(emb)
    hlo = jax.jit(lambda s, x: nnx.merge(graphdef, s).attend(x)).lower(state, x).as_text()
    assert re.findall(r"contracting_dims = \[1\] x \[(\d)\]", hlo) == ["0"], hlo
    with pytest.raises(TypeError, match="inputs"):
        emb(ids.astype(jnp.float32))


def test_engine_on_cpu_holds_its_weights_for_cpu(monkeypatch):
    from paged_jax.engine import LLM

    monkeypatch.delenv("PAGED_JAX_BACKEND", raising=False)

    with jax.default_device(jax.devices("cpu")[0]):  # on a GPU machine too
        model = init_model(dataclasses.replace(TINY_LLAMA, tie_word_embeddings=True), seed=0)
        llm = LLM(model, None, num_pages=64, page_size=8)
    # packed for the CPU kernels where they build (q/k/v fused), else split per layer
    # and the tied table held [E, V]
    packed = paged_linear.available()
    attn = llm.model.layers.self_attn
    q_proj = attn.qkv_proj if packed else attn.q_proj
    assert isinstance(q_proj.kernel.get_value(), tuple) == (not packed)
    assert q_proj.packed == packed and llm.model.embed_tokens.packed == packed
    assert llm.model.embed_tokens.transposed == (not packed)
    assert not llm.model.unrolled


def test_engine_off_the_cpu_holds_its_weights_per_layer_and_unrolls(monkeypatch):
    # What LLM does with a model on a GPU or TPU, here on CPU (the engine is told the
    # weights are elsewhere): hold_for_accelerator, and the same tokens as the CPU layout.
    from paged_jax.engine import LLM, SamplingParams
    from paged_jax.engine import devices as llm_module

    cfg = dataclasses.replace(TINY_LLAMA, tie_word_embeddings=True)
    prompts = [PROMPTS["a"], PROMPTS["b"], PROMPTS["c"]]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want = LLM(init_model(cfg, seed=0), num_pages=64, page_size=8).generate(
        prompts, params, progress=False
    )
    monkeypatch.setattr(llm_module, "_on_cpu", lambda model: False)
    llm = LLM(init_model(cfg, seed=0), num_pages=64, page_size=8)
    assert llm.model.unrolled and llm.model.embed_tokens.transposed
    assert isinstance(llm.model.layers.mlp.down_proj.kernel.get_value(), tuple)
    got = llm.generate(prompts, params, progress=False)
    assert [r.outputs[0].token_ids for r in got] == [r.outputs[0].token_ids for r in want]


def test_one_token_step_updates_the_pool_in_place(tiny):
    # A decode step of one token row (the CPU decode kernel reading the pool): XLA made
    # the one-row scatter an update that copied the whole pool, four times over
    # (PagedKVCache.write pads it to two rows).
    from paged_jax.batch import ScheduledSeq, build_batch
    from paged_jax.block_manager import BlockManager

    bm = BlockManager(num_pages=4096, page_size=8)
    bm.allocate("s", list(range(5)))
    bm.mark_computed("s", 5)
    assert bm.append_tokens(["s"], [7])
    batch = build_batch(bm, [ScheduledSeq("s", 5, 6)], min_tokens=1)
    md = AttentionMetadata.from_batch(batch)
    assert md.decode_only and batch.token_ids.shape == (1,)
    cache = tiny.make_cache(4096, 8)
    ids, pos = jnp.asarray(batch.token_ids), jnp.asarray(batch.positions)
    step = jax.jit(lambda c: tiny(ids, pos, c, md), donate_argnums=0)
    stats = step.lower(cache).compile().memory_analysis()
    assert stats.temp_size_in_bytes < cache.kv_pages.nbytes / 4, stats.temp_size_in_bytes
