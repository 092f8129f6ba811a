"""Mixtures of experts: the router, the experts' products each way, the families' configs
and checkpoints, and the engine's features on a sparse model.

Parity with transformers (logits, greedy tokens, forks, prefix hits, the routers'
choices) is tests/test_hf_golden.py's, on the golden Mixtral, Qwen2-MoE and Qwen3-MoE.
"""

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_cases import PROMPTS
from safetensors.numpy import load_file, save_file

import paged_jax as pj
from paged_jax.models import LlamaConfig, LlamaForCausalLM, load_hf
from paged_jax.models.layers import moe

GOLDEN = pathlib.Path(__file__).resolve().parent / "golden" / "hf"


def _np_route(logits, k, normalize, scoring="softmax"):
    """Route as transformers does it, in numpy float64 (a stable sort: ties by index)."""
    logits = np.asarray(logits, np.float64)
    if scoring == "topk_softmax":
        ids = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
        top = np.take_along_axis(logits, ids, -1)
        w = np.exp(top - top.max(-1, keepdims=True))
        return w / w.sum(-1, keepdims=True), ids
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(p, ids, -1)
    return (w / w.sum(-1, keepdims=True) if normalize else w), ids


def _np_experts(x, w, ids, gate, up, down, gelu=False, biases=None, limit=None, alpha=1.702):
    """The reference: token by token, expert by expert, in float64; ``biases`` (gate, up,
    down) and ``limit`` as GPT-OSS's experts have them."""
    x, gate, up, down = (np.asarray(a, np.float64) for a in (x, gate, up, down))
    zero = (np.zeros(gate.shape[::2]), np.zeros(gate.shape[::2]), np.zeros(down.shape[::2]))
    bg, bu, bd = (np.asarray(b, np.float64) for b in (biases or zero))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t]):
            g, u = x[t] @ gate[e] + bg[e], x[t] @ up[e] + bu[e]
            if limit is not None:
                g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
                a = (u + 1) * g / (1 + np.exp(-alpha * g))
            elif gelu:
                a = 0.5 * g * (1 + np.tanh(0.7978845608 * (g + 0.044715 * g**3))) * u
            else:
                a = g / (1 + np.exp(-g)) * u
            out[t] += w[t, j] * (a @ down[e] + bd[e])
    return out


@pytest.mark.parametrize("scoring", ["softmax", "topk_softmax"])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("k", [1, 2, 8])
def test_route_picks_the_top_k_and_weighs_them_as_transformers(k, normalize, scoring):
    rng = np.random.default_rng(k)
    logits = rng.normal(size=(13, 8)).astype(np.float32) * 3
    logits[0, :4] = 1.0  # ties: the lower index first
    w, ids = moe.route(jnp.asarray(logits), k, normalize=normalize, scoring=scoring)
    ref_w, ref_ids = _np_route(logits, k, normalize, scoring)
    np.testing.assert_array_equal(np.asarray(ids), ref_ids)
    np.testing.assert_allclose(np.asarray(w), ref_w, rtol=2e-6, atol=1e-7)
    assert ids.dtype == jnp.int32 and w.dtype == jnp.float32
    if normalize or scoring == "topk_softmax":
        np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, rtol=1e-6)


def test_route_refuses_an_unknown_scoring():
    with pytest.raises(ValueError, match="scoring: expected"):
        moe.route(jnp.zeros((2, 4)), 2, normalize=True, scoring="sigmoid!")


@pytest.mark.parametrize("way", moe.EXPERT_PRODUCTS[1:])
@pytest.mark.parametrize(
    "tokens, experts, k, gelu",
    [(1, 4, 2, False), (5, 8, 2, True), (17, 4, 4, False), (9, 6, 1, False)],
)
def test_each_way_computes_the_weighted_sum_of_the_chosen_experts(way, tokens, experts, k, gelu):
    rng = np.random.default_rng(tokens * 10 + experts)
    H, F = 12, 20
    x = rng.normal(size=(tokens, H)).astype(np.float32)
    gate, up = (rng.normal(size=(experts, H, F)).astype(np.float32) * 0.3 for _ in range(2))
    down = rng.normal(size=(experts, F, H)).astype(np.float32) * 0.3
    w, ids = _np_route(rng.normal(size=(tokens, experts)), k, True)
    got = moe.expert_products(
        jnp.asarray(x), jnp.asarray(w, jnp.float32), jnp.asarray(ids, jnp.int32),
        jnp.asarray(gate), jnp.asarray(up), jnp.asarray(down), way=way, glu=moe.Glu(gelu),
    )  # fmt: skip
    np.testing.assert_allclose(
        np.asarray(got), _np_experts(x, w, ids, gate, up, down, gelu), rtol=2e-5, atol=2e-5
    )


@pytest.mark.parametrize("way", moe.EXPERT_PRODUCTS)
def test_each_way_adds_gpt_oss_s_biases_and_clamps_its_unit(way):
    """Gates and ups well past the limit, so that both clamps bite."""
    from paged_jax import linear
    from paged_jax.models.layers.linear import LAYER

    if way == "packed" and not linear.available():
        pytest.skip("the CPU kernels are not built here (no C compiler)")
    rng = np.random.default_rng(4)
    T, X, K, H, F, limit = 9, 6, 2, 16, 8, 1.5
    x = rng.normal(size=(T, H)).astype(np.float32)
    gate, up = (rng.normal(size=(X, H, F)).astype(np.float32) for _ in range(2))
    down = rng.normal(size=(X, F, H)).astype(np.float32) * 0.3
    biases = tuple(rng.normal(size=s).astype(np.float32) for s in ((X, F), (X, F), (X, H)))
    w, ids = _np_route(rng.normal(size=(T, X)), K, True, "topk_softmax")
    glu = moe.Glu(limit=limit, alpha=1.702)
    args = (jnp.asarray(x), jnp.asarray(w, jnp.float32), jnp.asarray(ids, jnp.int32))
    b = moe.Biases(*map(jnp.asarray, biases))
    if way == "packed":
        both = jnp.concatenate([jnp.asarray(gate), jnp.asarray(up)], -1)
        token = LAYER.set(jnp.int32(0))
        try:
            got = moe.packed_products(
                *args, linear.pack(both), linear.pack(jnp.asarray(down)), width=F, glu=glu,
                biases=b,
            )  # fmt: skip
        finally:
            LAYER.reset(token)
    else:
        got = moe.expert_products(
            *args, *map(jnp.asarray, (gate, up, down)), way=way, glu=glu, biases=b
        )
    want = _np_experts(x, w, ids, gate, up, down, biases=biases, limit=limit)
    g = np.einsum("th,xhf->txf", x, gate) + biases[0]
    assert (g > limit).mean() > 0.2 and (np.einsum("th,xhf->txf", x, up) < -limit).any()
    np.testing.assert_allclose(np.asarray(got), want, rtol=3e-5, atol=3e-5)


@pytest.mark.parametrize("way", moe.EXPERT_PRODUCTS[1:])
def test_each_way_takes_bf16_rows(way):
    """bf16 rows and experts (ragged: at the default precision, which TPU's grouped
    kernel takes) give the f64 sum of the bf16 values within bf16's rounding."""
    rng = np.random.default_rng(9)
    T, X, K, H, F = 7, 6, 2, 32, 16
    bf = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))  # noqa: E731
    x = bf(rng.normal(size=(T, H)))
    gate, up = (bf(rng.normal(size=(X, H, F)) * 0.3) for _ in range(2))
    down = bf(rng.normal(size=(X, F, H)) * 0.3)
    w, ids = _np_route(rng.normal(size=(T, X)), K, True)
    got = moe.expert_products(
        jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.float32), jnp.asarray(ids, jnp.int32),
        *(jnp.asarray(a, jnp.bfloat16) for a in (gate, up, down)), way=way,
    )  # fmt: skip
    assert got.dtype == jnp.bfloat16
    want = _np_experts(x, w, ids, gate, up, down)
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, rtol=0.05, atol=0.05)


def test_a_way_is_chosen_per_platform_and_overridden_by_expert_way(monkeypatch):
    from paged_jax import linear

    assert moe.current_way() == ("packed" if linear.available() else "dense")
    with moe.expert_way("gather"):
        assert moe.current_way() == "gather"
    monkeypatch.setattr(linear, "available", lambda: False)  # no C kernels: XLA's dense
    assert moe.current_way() == "dense"
    with pytest.raises(ValueError, match="way: expected one of"), moe.expert_way("loop"):
        pass


def _tiny(**kw) -> LlamaConfig:
    fields = dict(
        vocab_size=320, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
        num_kv_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        architecture="Qwen3MoeForCausalLM", qk_norm=True, max_position_embeddings=256,
    )  # fmt: skip
    return LlamaConfig(**{**fields, **kw})


def test_the_sparse_block_adds_its_gated_shared_expert():
    from flax import nnx

    cfg = _tiny(shared_expert_intermediate_size=24, architecture="Qwen2MoeForCausalLM")
    block = LlamaForCausalLM(cfg, rngs=nnx.Rngs(3)).layer(0).mlp
    x = jax.random.normal(jax.random.key(0), (6, 32))
    w, ids = block.choices(x)
    e = block.experts
    routed = moe.expert_products(
        x, w, ids, e.gate_proj[...], e.up_proj[...], e.down_proj[...], way="dense"
    )
    gate = jax.nn.sigmoid(block.shared_expert_gate(x))
    np.testing.assert_allclose(
        block(x), routed + gate * block.shared_expert(x), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            dict(num_experts_per_tok=5),
            r"num_experts_per_tok: expected an int in \[1, num_experts=4\]",
        ),
        (dict(num_experts_per_tok=0), r"num_experts_per_tok: expected an int in \[1"),
        (dict(num_experts=0), "num_experts: 0 .a dense model., but num_experts_per_tok"),
        (dict(moe_intermediate_size=0), "moe_intermediate_size: expected a positive int"),
        (dict(num_experts=-1), "num_experts: expected an int >= 0"),
    ],
)
def test_a_config_that_contradicts_itself_is_refused_by_field(fields, message):
    with pytest.raises(ValueError, match=message):
        _tiny(**fields)


def _hf(name):
    return json.loads((GOLDEN / name / "config.json").read_text())


@pytest.mark.parametrize(
    "name, change, message",
    [
        ("qwen3moe", dict(mlp_only_layers="0"), "mlp_only_layers: expected a list of layer"),
        ("qwen2moe", dict(decoder_sparse_step=0), "decoder_sparse_step: expected an int >= 1"),
        (
            "qwen2moe",
            dict(mlp_only_layers=[5]),
            r"mlp_only_layers: expected a list of layer indices in \[0, 2\), got \[5\]",
        ),
        ("qwen3moe", dict(num_experts=8, num_local_experts=4), "num_experts: the config gives two"),
        (
            "qwen3moe",
            dict(num_experts_per_tok=9),
            r"num_experts_per_tok: expected an int in \[1, num_experts=8\]",
        ),
    ],
)
def test_hugging_face_configs_name_what_is_not_supported(name, change, message):
    with pytest.raises(ValueError, match=message):
        LlamaConfig.from_hf({**_hf(name), **change})


def test_int4_experts_the_same_on_the_cpu_s_kernel_and_dequantized():
    """A mixture's 4-bit experts (groups of 32 with a minimum each): the CPU's grouped
    4-bit product and XLA's on the dequantized weights give the same logits within the
    rows' int8 rounding, and both near the float model's (4 bits move a tiny random
    model's logits by 10-30%)."""
    from flax import nnx
    from model_helpers import paged_prompt_logits

    from paged_jax import linear

    if not linear.available():
        pytest.skip("the CPU kernels are not built here (no C compiler)")
    logits = {}
    for held in ("cpu", "accelerator"):
        model, _ = load_hf(GOLDEN / "mixtral", dtype=jnp.float32)
        for _, node in nnx.iter_graph(model):
            if isinstance(node, moe.Experts):
                node.quantize("int4")
        model = model.hold_for_cpu() if held == "cpu" else model.hold_for_accelerator()
        assert model.layers.mlp.experts.packed == (held == "cpu")
        logits[held] = paged_prompt_logits(model, PROMPTS["long"])
    golden = np.load(GOLDEN / "mixtral" / "golden.npz")["logits"]
    scale = np.abs(golden).max()
    assert np.abs(logits["cpu"] - logits["accelerator"]).max() / scale <= 0.02
    assert np.abs(logits["cpu"] - golden).max() / scale <= 0.2


@pytest.mark.parametrize("held", ["cpu", "accelerator"])
def test_dense_layers_among_sparse_ones(held):
    """Qwen's mlp_only_layers and decoder_sparse_step: the layers they make dense run a
    dense MLP (each layer holds both blocks, the unused one zeros): the golden logits held
    for each device, and the checkpoint written back tensor for tensor (no placeholder
    among them)."""
    from model_helpers import paged_prompt_logits

    from paged_jax import linear
    from paged_jax.models.hf import to_hf_tensors

    cfg = LlamaConfig.from_hf(_hf("qwen3moe_mixed"))
    assert cfg.dense_layers == (0, 2) and cfg.layer_period == 2
    assert LlamaConfig.from_hf(_hf("qwen2moe_mixed")).dense_layers == (0,)
    for name in ("qwen2moe_mixed", "qwen3moe_mixed"):
        model, _ = load_hf(GOLDEN / name, dtype=jnp.float32)
        stored = load_file(GOLDEN / name / "model.safetensors")
        written = to_hf_tensors(model)
        assert set(written) == set(stored), set(written) ^ set(stored)
        if held == "cpu" and not linear.available():
            pytest.skip("the CPU kernels are not built here (no C compiler)")
        model = model.hold_for_cpu() if held == "cpu" else model.hold_for_accelerator()
        golden = np.load(GOLDEN / name / "golden.npz")["logits"]
        logits = paged_prompt_logits(model, PROMPTS["long"])
        assert np.abs(logits - golden).max() / np.abs(golden).max() <= 1e-4, name


def test_the_families_read_their_fields():
    mixtral = LlamaConfig.from_hf(_hf("mixtral"))
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.norm_topk_prob) == (
        4,
        2,
        True,
    )
    assert mixtral.moe_intermediate_size == _hf("mixtral")["intermediate_size"]
    qwen2 = LlamaConfig.from_hf(_hf("qwen2moe"))
    assert (qwen2.shared_expert_intermediate_size, qwen2.norm_topk_prob, qwen2.qkv_bias) == (
        48,
        False,
        True,
    )
    qwen3 = LlamaConfig.from_hf(_hf("qwen3moe"))
    assert (qwen3.num_experts, qwen3.qk_norm, qwen3.shared_expert_intermediate_size) == (8, True, 0)


def _copy(name, tmp_path) -> pathlib.Path:
    dst = tmp_path / name
    shutil.copytree(GOLDEN / name, dst)
    return dst


def test_a_checkpoint_with_other_experts_than_its_config_says_is_refused(tmp_path):
    ckpt = _copy("mixtral", tmp_path)
    (ckpt / "config.json").write_text(json.dumps({**_hf("mixtral"), "num_local_experts": 3}))
    with pytest.raises(
        ValueError,
        match=r"num_experts: the config says 3 experts a layer, the checkpoint holds "
        r"experts 0-3 \(4 of them\)",
    ):
        load_hf(ckpt)
    ckpt = _copy("qwen3moe", tmp_path)
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.7.up_proj.weight"]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"tensor 'model.layers.1.mlp.experts.7.up_proj.weight' is missing"
    ):
        load_hf(ckpt)


def test_quantizing_a_mixture_takes_int8_and_refuses_other_formats_by_name():
    from flax import nnx

    model, _ = load_hf(GOLDEN / "qwen3moe", dtype=jnp.float32)
    with pytest.raises(ValueError, match="quantization: 'fp8' for a mixture of experts"):
        model.quantize("fp8")
    model.quantize("int8")
    e = model.layers.mlp.experts
    assert e.quantized == "int8" and e.gate_proj.get_value().dtype == jnp.int8
    assert model.layers.mlp.gate.kernel.get_value().dtype == jnp.float32  # the router: float
    with pytest.raises(ValueError, match="quantization: 'fp8' for a mixture's experts"):
        moe.Experts(8, 8, 2, rngs=nnx.Rngs(0), param_dtype=jnp.float32).quantize("fp8")


@pytest.mark.parametrize("name", ["qwen3moe", "gptoss"])
@pytest.mark.parametrize("held", ["cpu", "accelerator"])
def test_int8_experts_keep_transformers_logits_within_their_rounding(name, held):
    """Only the experts in int8 (per group of 32 inputs; W8A8 through the CPU's grouped
    int8 product where packed, dequantized in the step elsewhere): the golden logits
    within 3% (the whole model's int8 moves a tiny random mixture's routing more: its
    near-tied experts differ a lot)."""
    from flax import nnx
    from model_helpers import paged_prompt_logits

    from paged_jax import linear

    if held == "cpu" and not linear.available():
        pytest.skip("the CPU kernels are not built here (no C compiler)")
    model, _ = load_hf(GOLDEN / name, dtype=jnp.float32)
    for _, node in nnx.iter_graph(model):
        if isinstance(node, moe.Experts):
            node.quantize("int8")
    model = model.hold_for_cpu() if held == "cpu" else model.hold_for_accelerator()
    assert model.layers.mlp.experts.packed == (held == "cpu")
    golden = np.load(GOLDEN / name / "golden.npz")["logits"]
    logits = paged_prompt_logits(model, PROMPTS["long"])
    assert np.abs(logits - golden).max() / np.abs(golden).max() <= 0.03


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_packed_quantized_experts_compute_their_dequantized_weights_product(fmt):
    """The grouped int8 or 4-bit product (the rows quantized in blocks of 32) against
    XLA's product by the dequantized weights, on the same quantized experts: within the
    rows' rounding; and a mixture quantized whole decodes in the engine."""
    from flax import nnx

    from paged_jax import linear

    if not linear.available():
        pytest.skip("the CPU kernels are not built here (no C compiler)")
    cfg = _tiny(hidden_size=64, moe_intermediate_size=64, num_experts=5)
    experts = LlamaForCausalLM(cfg, rngs=nnx.Rngs(2)).layer(1).mlp.experts.quantize(fmt)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(9, 64)).astype(np.float32))
    w, ids = _np_route(rng.normal(size=(9, 5)), 2, True)
    w, ids = jnp.asarray(w, jnp.float32), jnp.asarray(ids, jnp.int32)
    want = moe.expert_products(x, w, ids, *experts.weights(), way="dense")
    experts.hold_packed()
    got = moe.packed_products(
        x, w, ids, experts.gate_up[...], experts.down[...], width=64,
        scales=experts.packed_scales(),
    )  # fmt: skip
    scale = float(np.abs(np.asarray(want)).max())
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=0.02 * scale)
    assert np.abs(np.asarray(got) - np.asarray(want)).max() > 0  # (the rows were quantized)
    model, _ = load_hf(GOLDEN / "mixtral", dtype=jnp.float32)
    llm = pj.LLM(model.quantize(fmt), num_pages=64, page_size=8, compilation_cache=False)
    out = _greedy(llm, [PROMPTS["mid"], PROMPTS["short"]])
    assert [len(o) for o in out] == [12, 12]


@pytest.fixture(scope="module")
def golden_moe():
    model, _ = load_hf(GOLDEN / "qwen2moe", dtype=jnp.float32)
    return model


def _greedy(llm, prompts, **kw):
    sp = pj.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, **kw)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, progress=False)]


def test_every_way_gives_the_engine_the_same_tokens():
    """On CPU the engine packs the experts for the C kernel's grouped product ("packed");
    held as they are, each of XLA's ways: all give the same greedy tokens."""
    from paged_jax import linear

    prompts = [PROMPTS["mid"], PROMPTS["short"], PROMPTS["long"]]
    outs = {}
    for way in moe.EXPERT_PRODUCTS:
        with moe.expert_way(way):
            model, _ = load_hf(GOLDEN / "qwen3moe", dtype=jnp.float32)
            llm = pj.LLM(model, num_pages=64, page_size=8, compilation_cache=False)
            outs[way] = _greedy(llm, prompts)
        packed = llm.model.layers.mlp.experts.packed
        assert packed == (way == "packed" and linear.available()), way
    assert all(tokens == outs["dense"] for tokens in outs.values()), outs


def test_the_packed_experts_read_this_layer_s_weights_and_skip_padding_rows():
    from flax import nnx

    from paged_jax import linear
    from paged_jax.models.layers.linear import LAYER, ROWS

    if not linear.available():
        pytest.skip("the CPU kernels are not built here (no C compiler)")
    cfg = _tiny(num_layers=3, num_experts=5, num_experts_per_tok=2)
    experts = LlamaForCausalLM(cfg, rngs=nnx.Rngs(7)).layers.mlp.experts
    gate, up, down = (
        np.asarray(w[...]) for w in (experts.gate_proj, experts.up_proj, experts.down_proj)
    )
    experts.hold_packed()
    assert experts.packed and experts.gate_up[...].ndim == 5
    rng = np.random.default_rng(1)
    x = rng.normal(size=(6, 32)).astype(np.float32)
    w, ids = _np_route(rng.normal(size=(6, 5)), 2, True)
    for layer in range(3):
        LAYER_token, rows_token = LAYER.set(jnp.int32(layer)), ROWS.set((6, jnp.int32(4)))
        try:
            got = moe.packed_products(
                jnp.asarray(x), jnp.asarray(w, jnp.float32), jnp.asarray(ids, jnp.int32),
                experts.gate_up[...], experts.down[...], width=16,
            )  # fmt: skip
        finally:
            LAYER.reset(LAYER_token)
            ROWS.reset(rows_token)
        want = _np_experts(x, w, ids, gate[layer], up[layer], down[layer])
        np.testing.assert_allclose(np.asarray(got)[:4], want[:4], rtol=2e-5, atol=2e-5)
        assert not np.asarray(got)[4:].any(), "padding rows were computed"


def test_speculation_and_samples_keep_a_mixture_s_tokens(golden_moe):
    plain = pj.LLM(golden_moe, num_pages=96, page_size=8, compilation_cache=False)
    want = _greedy(plain, [PROMPTS["long"], PROMPTS["mid"]])
    spec = pj.LLM(
        golden_moe, num_pages=96, page_size=8, compilation_cache=False,
        speculative={"method": "ngram", "num_speculative_tokens": 3},
    )  # fmt: skip
    assert _greedy(spec, [PROMPTS["long"], PROMPTS["mid"]]) == want
    # n samples of one request, seeded: each its own, and the same again
    sp = pj.SamplingParams(max_tokens=8, temperature=1.0, n=3, seed=5)
    a = [c.token_ids for c in plain.generate([PROMPTS["mid"]], sp, progress=False)[0].outputs]
    b = [c.token_ids for c in plain.generate([PROMPTS["mid"]], sp, progress=False)[0].outputs]
    assert a == b and len({tuple(t) for t in a}) > 1


def test_attention_adapters_reach_a_mixture_and_feed_forward_ones_are_refused(golden_moe, tmp_path):
    from paged_jax.models import lora as lora_mod

    cfg = golden_moe.config
    rng = np.random.default_rng(0)
    tensors = {}
    for i in range(cfg.num_layers):
        for t in ("q_proj", "v_proj"):
            fan_in, fan_out = lora_mod.target_shape(cfg, t)
            tensors[f"base_model.model.model.layers.{i}.self_attn.{t}.lora_A.weight"] = rng.normal(
                size=(4, fan_in)
            ).astype(np.float32)
            tensors[f"base_model.model.model.layers.{i}.self_attn.{t}.lora_B.weight"] = rng.normal(
                size=(fan_out, 4)
            ).astype(np.float32)
    good = tmp_path / "attn"
    good.mkdir()
    (good / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8})
    )
    save_file(tensors, good / "adapter_model.safetensors")
    llm = pj.LLM(
        golden_moe, num_pages=96, page_size=8, compilation_cache=False, max_loras=1, max_lora_rank=4
    )
    llm.add_lora("attn", str(good))
    base = _greedy(llm, [PROMPTS["mid"]])
    adapted = _greedy_lora(llm, PROMPTS["mid"], "attn")
    assert adapted != base
    bad = tmp_path / "mlp"
    shutil.copytree(good, bad)
    extra = dict(tensors)
    extra["base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight"] = np.zeros(
        (4, 32), np.float32
    )
    extra["base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight"] = np.zeros(
        (48, 4), np.float32
    )
    save_file(extra, bad / "adapter_model.safetensors")
    with pytest.raises(
        ValueError,
        match="target 'gate_proj': a mixture of experts' feed-forward blocks take no adapters",
    ):
        llm.add_lora("mlp", str(bad))


def _greedy_lora(llm, prompt, name):
    sp = pj.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    return [llm.generate([prompt], sp, lora=name, progress=False)[0].outputs[0].token_ids]


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A real (tokenizers) byte-level tokenizer of 300 tokens, a GGUF file's."""
    from test_gguf import _model, write_gguf

    from paged_jax.models import load_gguf

    path = tmp_path_factory.mktemp("tok") / "m.gguf"
    write_gguf(path, _model(vocab_size=300))
    return load_gguf(path)[1]


def test_structured_output_on_a_mixture(tokenizer):
    from flax import nnx

    from paged_jax.engine.structured import StructuredOutput

    model = LlamaForCausalLM(_tiny(), rngs=nnx.Rngs(1))
    llm = pj.LLM(model, tokenizer, num_pages=96, page_size=8, compilation_cache=False)
    sp = pj.SamplingParams(
        max_tokens=40, temperature=0,
        structured=StructuredOutput(json=SCHEMA),
    )  # fmt: skip
    text = llm.generate(["x"], sp, progress=False)[0].outputs[0].text
    assert isinstance(json.loads(text)["a"], int), text


def test_the_server_serves_a_mixture(tokenizer):
    from flax import nnx
    from starlette.testclient import TestClient

    from paged_jax.server.api import Server

    model = LlamaForCausalLM(_tiny(), rngs=nnx.Rngs(2))
    llm = pj.LLM(model, tokenizer, num_pages=96, page_size=8, compilation_cache=False)
    offline = llm.generate(
        ["hello"], pj.SamplingParams(max_tokens=6, temperature=0), progress=False
    )
    with TestClient(Server(llm, model_name="moe").app) as c:
        r = c.post(
            "/v1/completions",
            json={"model": "moe", "prompt": "hello", "max_tokens": 6, "temperature": 0},
        )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == offline[0].outputs[0].text


# GGUF: the tensor names llama.cpp gives a mixture's weights (beside test_gguf's dense ones)
_GGUF_PARTS = {
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
_GGUF_EXPERTS = {
    "gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
    "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps",
}  # fmt: skip


def write_moe_gguf(path, model, arch: str, expert_qtype=None):
    """Writes a mixture as llama.cpp's converter would: its dense tensors as test_gguf's
    ``write_gguf`` names them (Q/K rows reordered for "llama", Mixtral's arch), each
    layer's experts as one 3-D tensor a projection (``ffn_gate_exps`` ..., numpy ``[X,
    out, in]``; in ``expert_qtype`` if given), the router ``ffn_gate_inp``, the shared
    expert's ``*_shexp`` and its gate as a vector. Returns the experts' float weights as
    the file holds them, by GGUF name."""
    import re

    import gguf
    from test_gguf import _NAMES, TEMPLATE, _add_byte_level_vocab, _llama_cpp_order, _writer

    from paged_jax.models.hf import to_hf_tensors

    c = model.config
    w = _writer(path, arch, c)
    w.add_rope_freq_base(c.rope_theta)
    w.add_vocab_size(c.vocab_size)
    _add_byte_level_vocab(w, c.vocab_size)
    w.add_chat_template(TEMPLATE)
    w.add_expert_count(c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if arch != "llama":
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_weights_norm(c.norm_topk_prob)
    if c.shared_expert_intermediate_size:
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, value in to_hf_tensors(model).items():
        value = value.astype(np.float32)
        m = re.fullmatch(r"model\.layers\.(\d+)\.\w+\.experts\.(\d+)\.(\w+)\.weight", name)
        if m:
            g = f"blk.{m.group(1)}.{_GGUF_EXPERTS[m.group(3)]}.weight"
            experts.setdefault(g, {})[int(m.group(2))] = value
            continue
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            g = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
                 "output_norm.weight", "lm_head.weight": "output.weight"}[name]  # fmt: skip
        else:
            _, _, i, *mod, leaf = name.split(".")
            mod = ".".join(mod)
            g = f"blk.{i}.{_GGUF_PARTS.get(mod) or _NAMES[mod]}.{leaf}"
        if arch == "llama" and (".attn_q." in g or ".attn_k." in g):
            value = _llama_cpp_order(value, c.num_heads if ".attn_q." in g else c.num_kv_heads)
        if g.endswith("ffn_gate_inp_shexp.weight"):
            value = value.reshape(-1)  # llama.cpp holds it as a vector
        w.add_tensor(g, value)
    held = {}
    for g, by_expert in experts.items():
        stack = np.stack([by_expert[e] for e in range(c.num_experts)])
        if expert_qtype is None:
            w.add_tensor(g, stack)
            held[g] = stack
        else:
            raw = gguf.quants.quantize(stack, expert_qtype)
            w.add_tensor(g, raw, raw_dtype=expert_qtype)
            held[g] = gguf.quants.dequantize(raw, expert_qtype).astype(np.float32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


@pytest.mark.parametrize(
    "name, arch", [("mixtral", "llama"), ("qwen2moe", "qwen2moe"), ("qwen3moe", "qwen3moe")]
)
def test_a_mixture_s_gguf_file_loads_as_its_checkpoint(name, arch, tmp_path):
    from paged_jax.models import load_gguf

    model, _ = load_hf(GOLDEN / name, dtype=jnp.float32)
    write_moe_gguf(tmp_path / "m.gguf", model, arch)
    loaded, tok = load_gguf(tmp_path / "m.gguf")
    assert loaded.config.architecture == model.config.architecture and tok is not None
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "shared_expert_intermediate_size", "qkv_bias", "qk_norm"):  # fmt: skip
        assert getattr(loaded.config, field) == getattr(model.config, field), field
    golden = np.load(GOLDEN / name / "golden.npz")
    llm = pj.LLM(loaded, num_pages=64, page_size=8, compilation_cache=False)
    sp = pj.SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    out = llm.generate([PROMPTS["long"]], sp, progress=False)[0].outputs[0].token_ids
    assert out == golden["greedy_long"].tolist()


def _assert_experts_are(got: dict, held: dict) -> None:
    """The experts' weights of ``got`` (``to_hf_tensors``) are the file's (``held``:
    ``write_moe_gguf``'s), exactly."""
    parts = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
    for g, stack in held.items():
        i, part = g.split(".")[1], parts[g.split(".")[2]]
        for e in range(stack.shape[0]):
            np.testing.assert_array_equal(
                got[f"model.layers.{i}.mlp.experts.{e}.{part}.weight"], stack[e]
            )


def test_a_gguf_file_s_quantized_experts_are_read_as_their_blocks_say(tmp_path):
    import gguf

    from paged_jax.models import load_gguf
    from paged_jax.models.hf import to_hf_tensors

    model, _ = load_hf(GOLDEN / "qwen3moe", dtype=jnp.float32)
    held = write_moe_gguf(tmp_path / "m.gguf", model, "qwen3moe", gguf.GGMLQuantizationType.Q8_0)
    loaded, _ = load_gguf(tmp_path / "m.gguf")
    got = to_hf_tensors(loaded)
    _assert_experts_are(got, held)
    with pytest.raises(ValueError, match="quantization: 'fp8' for a mixture of experts"):
        load_gguf(tmp_path / "m.gguf", quantization="fp8")
    eight, _ = load_gguf(tmp_path / "m.gguf", quantization="int8")
    e = eight.layers.mlp.experts
    assert e.quantized == "int8" and e.gate_proj.get_value().dtype == jnp.int8
    # Q8_0's blocks are groups of 32 along the inputs: quantized again, the same values
    back = to_hf_tensors(eight)
    name = "model.layers.0.mlp.experts.3.down_proj.weight"
    np.testing.assert_allclose(back[name], got[name], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("held", ["accelerator", "cpu"])
def test_a_mixture_held_for_each_device_gives_transformers_logits(held):
    """The layouts the engine holds a model in (per-layer weights and unrolled layers, for
    a GPU or TPU; packed for the CPU's kernels) keep the golden logits."""
    from model_helpers import paged_prompt_logits

    model, _ = load_hf(GOLDEN / "qwen2moe", dtype=jnp.float32)
    model = model.hold_for_accelerator() if held == "accelerator" else model.hold_for_cpu()
    if held == "accelerator":  # each layer's experts and router its own arrays, not slices
        mlp = model.layers.mlp
        for var in (mlp.experts.gate_proj, mlp.experts.down_proj, mlp.gate.kernel):
            assert isinstance(var.get_value(), tuple) and len(var.get_value()) == 2
    golden = np.load(GOLDEN / "qwen2moe" / "golden.npz")["logits"]
    logits = paged_prompt_logits(model, PROMPTS["long"])
    assert np.abs(logits - golden).max() / np.abs(golden).max() <= 1e-4


@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_0", "Q4_0", "Q8_0"])
def test_a_gguf_file_s_experts_are_kept_as_stored_and_computed_as_their_floats(
    tmp_path, qtype, monkeypatch
):
    # By default a mixture's 4- and 5-bit experts keep their blocks (gate's and up's in
    # one layout, down's in its own), the very weights the file defines; packed for the
    # CPU they multiply the rows as they are by each dequantized panel (float rows): the
    # dequantized load's tokens and log-probs; XLA's ways (held for an accelerator) its
    # tokens. Sharding them is refused (no split layout).
    import gguf

    from paged_jax.models import load_gguf
    from paged_jax.models.hf import to_hf_tensors

    Q = gguf.GGMLQuantizationType[qtype]
    model, _ = load_hf(GOLDEN / "qwen3moe", dtype=jnp.float32)
    held = write_moe_gguf(tmp_path / "m.gguf", model, "qwen3moe", Q)
    kept, _ = load_gguf(tmp_path / "m.gguf")
    floats, _ = load_gguf(tmp_path / "m.gguf", dequantize=True)
    e = kept.layers.mlp.experts
    if qtype == "Q8_0":  # int8 groups of 32, the file's f16 scales in f32
        assert e.quantized == "int8" and e.float_rows
        assert e.gate_proj.get_value().dtype == jnp.int8
        assert e.gate_scale.get_value().shape[-2] == e.gate_proj.get_value().shape[-2] // 32
    else:
        assert e.quantized == "int4" and e.float_rows
        assert e.gate_proj.get_value().dtype == jnp.uint8
        bits, offset = {"Q4_1": (0, 0), "Q5_0": (1, 16), "Q4_0": (0, 8)}[qtype]
        assert (e.gate_up_bits, e.gate_up_offset, e.down_bits, e.down_offset) == (
            bits, offset, bits, offset
        )  # fmt: skip
        assert e.gate_scale.get_value().dtype == jnp.float16
    _assert_experts_are(to_hf_tensors(kept), held)
    prompts = [PROMPTS["long"], PROMPTS["long"][:5]]
    sp = pj.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=True)
    kw = dict(num_pages=64, page_size=8, compilation_cache=False, cache_dtype="float32")
    want = pj.LLM(floats, **kw).generate(prompts, sp, progress=False)
    out = pj.LLM(kept, **kw).generate(prompts, sp, progress=False)
    from paged_jax import linear

    assert kept.layers.mlp.experts.packed == linear.available()
    for a, b in zip(out, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        np.testing.assert_allclose(a.outputs[0].logprobs, b.outputs[0].logprobs, atol=1e-5)
    monkeypatch.setenv("PAGED_JAX_BACKEND", "xla")  # (no packing: XLA's products)
    again, _ = load_gguf(tmp_path / "m.gguf")
    again.hold_for_accelerator()  # each layer's experts dequantized in the step
    held_out = pj.LLM(again, **kw).generate(prompts, sp, progress=False)
    for a, b in zip(held_out, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    with pytest.raises(ValueError, match="a GGUF file's blocks kept as stored have no split"):
        load_gguf(tmp_path / "m.gguf")[0].shard(pj.tensor_parallel_mesh(1))
