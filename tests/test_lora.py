"""LoRA adapters (issue 55): PEFT adapters written by peft (tests/golden/lora, from
tests/golden/regenerate_lora.py) against the logits and greedy tokens transformers + peft
compute with them; several adapters and the base model in one batch; more adapters than
slots; prefix pages kept apart; what does not fit refused by name."""

import json
import pathlib
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_cases import PROMPTS
from safetensors.numpy import load_file, save_file

import paged_jax as pj
from paged_jax.metadata import AttentionMetadata
from paged_jax.models import lora as lora_mod
from paged_jax.models.hf import load_hf

GOLDEN = pathlib.Path(__file__).parent / "golden"
BASE = GOLDEN / "hf" / "llama"
NAMES = ("attn", "mlp", "all")


def _golden(name):
    return np.load((GOLDEN / "lora" / name if name else BASE) / "golden.npz")


def _base():
    return load_hf(BASE, dtype=jnp.float32)[0]


def _write(model, name, slot):
    """Golden adapter ``name`` written into slot ``slot`` of ``model``'s bank."""
    adapter = lora_mod.load_adapter(GOLDEN / "lora" / name, model.config)
    bank = model.lora
    arrays = {k: getattr(bank, k).get_value() for k in bank.arrays()}
    for k, v in model.lora_slot_arrays(adapter, slot, arrays).items():
        getattr(bank, k).set_value(v)


def _logits(model, slot_plus_one):
    ids = np.asarray(PROMPTS["long"])
    n = len(ids)
    cache = model.make_cache(8, 8)
    md = AttentionMetadata.prefill(n, 8 + np.arange(n), [1, 2, 3, 4], logits_all=True)
    adapter_ids = jnp.full(n, slot_plus_one, jnp.int32)
    logits, _ = model(
        jnp.asarray(ids, jnp.int32), jnp.arange(n, dtype=jnp.int32), cache, md,
        adapter_ids=adapter_ids,
    )  # fmt: skip
    return np.asarray(logits)


@pytest.mark.parametrize(
    "held, way",
    [
        ("as loaded", "cpu kernel"),
        ("as loaded", "masked"),
        ("for an accelerator", "grouped"),
        ("slots, then held for an accelerator", "grouped"),
    ],
)
def test_each_adapter_gives_the_logits_peft_gives(held, way, monkeypatch):
    # Each adapter in the second of two slots. The model as loaded (stacked layers,
    # scanned), each row through the CPU kernel (its own slot only) or XLA's products over
    # every slot and a mask; or as an accelerator holds it (per-layer weights, q/k/v and
    # gate/up fused), where the bank holds one pair a fused projection (A side by side,
    # B block-diagonal: two products for q/k/v), made with the slots (the bank grouped at
    # enable_lora) or before them (at hold_for_accelerator, the engine's order, an
    # adapter already in slot 0 carried over).
    from paged_jax import linear

    if way == "cpu kernel" and not linear.available():
        pytest.skip("the CPU kernels did not build here")
    monkeypatch.setattr(lora_mod, "CPU_KERNEL", way != "masked")
    model = _base()

    first = None
    if held == "for an accelerator":
        model.hold_for_accelerator()
        model.enable_lora(2, 8)
    else:
        model.enable_lora(2, 8)
        if held.startswith("slots"):
            first = NAMES[0]
            _write(model, first, 0)
            model.hold_for_accelerator()
    bank = model.lora
    grouped = [name for name, ts in bank.groups if len(ts) > 1]
    assert grouped == ([] if held == "as loaded" else ["qkv_proj", "gate_up_proj"])
    for name in NAMES:
        _write(model, name, 1)
        want = _golden(name)["logits"]
        got = _logits(model, 2)
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), name
        # slot 0 (id 1): empty, the base model's logits; or the adapter put there first
        base = _golden(first)["logits"]
        assert np.abs(_logits(model, 1) - base).max() <= 1e-4 * np.abs(base).max()
    _write(model, NAMES[2], 0)  # a slot written again, over another adapter
    want = _golden(NAMES[2])["logits"]
    assert np.abs(_logits(model, 1) - want).max() <= 1e-4 * np.abs(want).max()
    assert lora_mod.by_kernel(bank) == (way == "cpu kernel")
    ids = jnp.ones(5, jnp.int32)
    kind = jnp.int32 if way == "cpu kernel" else jnp.float32
    assert lora_mod.selector(bank, ids).dtype == kind


def test_an_accelerator_s_bank_is_read_per_layer_in_place(monkeypatch):
    # Held for an accelerator the layers run unrolled, each product reading its layer's
    # own array: the bank is split by layer as the weights are, so the compiled step
    # slices nothing out of a stacked bank (XLA materializes such a slice before its
    # product: one copy per array, layer and step), and an adapter written into a slot
    # still gives peft's logits.
    import re

    from flax import nnx

    def compiled(model):
        ids = np.asarray(PROMPTS["long"])
        n = len(ids)
        md = AttentionMetadata.prefill(n, 8 + np.arange(n), [1, 2, 3, 4], logits_all=True)
        graphdef, state = nnx.split(model)  # the weights as arguments, not constants
        step = jax.jit(lambda st, *a: nnx.merge(graphdef, st)(*a[:3], md, adapter_ids=a[3])[0])
        args = (state, jnp.asarray(ids, jnp.int32), jnp.arange(n, dtype=jnp.int32),
                model.make_cache(8, 8), jnp.full(n, 2, jnp.int32))  # fmt: skip
        return step.lower(*args).compile().as_text()

    def sliced(model, hlo):  # ops whose result has one layer's shape of a bank array
        bank = model.lora
        shapes = {
            "[" + ",".join(map(str, getattr(bank, k).get_value()[0].shape)) + "]"
            for k in bank.arrays()
        }
        return sum(
            1
            for line in hlo.splitlines()
            if " slice(" in line or ("bitcast(" in line and "slice" in line)
            if (m := re.search(r" = (\S+) ", line)) and any(s in m.group(1) for s in shapes)
        )

    model = _base()
    model.hold_for_accelerator()
    model.enable_lora(2, 8)
    bank = model.lora
    assert bank.per_layer and all(
        isinstance(getattr(bank, k).get_value(), tuple) for k in bank.arrays()
    )
    _write(model, "all", 1)
    want = _golden("all")["logits"]
    assert np.abs(_logits(model, 2) - want).max() <= 1e-4 * np.abs(want).max()
    assert sliced(model, compiled(model)) == 0
    # held for the CPU again (scanned layers): the bank one stack an array again
    model.hold_for_cpu(pack=False)
    assert not bank.per_layer and bank.a_qkv_proj.get_value().ndim == 3
    assert np.abs(_logits(model, 2) - want).max() <= 1e-4 * np.abs(want).max()
    # the same with the bank left stacked: a slice per array and layer
    stacked = _base()
    monkeypatch.setattr(lora_mod.LoraBank, "split_layers", lambda self: self)
    stacked.hold_for_accelerator()
    stacked.enable_lora(2, 8)
    layers = stacked.config.num_layers
    assert sliced(stacked, compiled(stacked)) >= layers * len(stacked.lora.arrays())


def test_the_adapters_products_take_their_projection_s_precision():
    # The adapters' products run at the projection's own precision (HIGHEST here): an f32
    # model's adapters stay as exact as its weights on a GPU (no TF32), and XLA:GPU's dot
    # merger, which merges only dots of one configuration, computes `x @ A` inside the
    # projection's GEMM (`python -m benchmarks step_kernels`, an H200's step compiled on a
    # CPU: 28 kernels a Llama-3-8B layer with 8 slots became 20 with JAX 0.10.2, 26 with
    # 0.11.2, whose merger is pickier: pad_for_merge, below; docs/DECISIONS.md).
    import re

    from flax import nnx

    model = _base()
    model.hold_for_accelerator()
    model.enable_lora(2, 8)
    ids = np.asarray(PROMPTS["long"])
    n = len(ids)
    md = AttentionMetadata.prefill(n, 8 + np.arange(n), [1, 2, 3, 4], logits_all=True)
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda st, *a: nnx.merge(graphdef, st)(*a[:3], md, adapter_ids=a[3])[0])
    args = (state, jnp.asarray(ids, jnp.int32), jnp.arange(n, dtype=jnp.int32),
            model.make_cache(8, 8), jnp.full(n, 2, jnp.int32))  # fmt: skip
    hlo = step.lower(*args).as_text(dialect="hlo")
    dots = [line for line in hlo.splitlines() if re.search(r" = \S+ dot\(", line)]
    bank_dots = [d for d in dots if "lora" in d]
    layers = model.config.num_layers
    assert len(bank_dots) == 2 * 4 * layers  # A and B of q/k/v, o, gate/up and down
    assert all("operand_precision={highest,highest}" in d for d in dots), [
        d for d in dots if "highest" not in d
    ][:2]


def test_a_bank_is_padded_for_the_dot_merger_and_still_gives_peft_s_logits(monkeypatch):
    # pad_for_merge widens A with zero columns to a sixteenth of the projection's outputs
    # (XLA:GPU 0.11.2 merges x @ A into the projection's GEMM only then), at most 4x its
    # own; delta reads only the real columns. Forced here on the tiny golden model (A as
    # wide as the outputs), an adapter written after the padding gives peft's logits.
    from paged_jax.models.config import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=512, intermediate_size=1024, num_layers=2, num_heads=8,
        num_kv_heads=2, head_dim=64, max_position_embeddings=64,
    )  # fmt: skip
    bank = lora_mod.LoraBank(cfg, 2, 8, jnp.float32)
    groups = (
        ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
        ("o_proj", ("o_proj",)),
        ("gate_up_proj", ("gate_proj", "up_proj")),
        ("down_proj", ("down_proj",)),
    )
    bank.regroup(groups)
    bank.pad_for_merge()
    width = {k: bank.__dict__[k].get_value().shape[-1] for k in bank.arrays() if k[0] == "a"}
    # 16 columns a target: o and down to 512 / 16 = 32 (2x); q/k/v's 48 >= 768 / 16; gate/up's
    # 32 would need 2048 / 16 = 128, 4x: padded too
    assert width == {"a_qkv_proj": 48, "a_o_proj": 32, "a_gate_up_proj": 128, "a_down_proj": 32}
    assert not lora_mod.by_kernel(bank)

    monkeypatch.setattr(lora_mod, "MERGE_FRACTION", 1)
    monkeypatch.setattr(lora_mod, "MERGE_MAX_PAD", 1000)
    model = _base()
    model.hold_for_accelerator()
    model.enable_lora(2, 8)
    padded = model.lora
    assert padded.a_o_proj.get_value()[0].shape[-1] > 2 * 8  # padded, then split by layer
    _write(model, "all", 1)
    want = _golden("all")["logits"]
    assert np.abs(_logits(model, 2) - want).max() <= 1e-4 * np.abs(want).max()


def test_adapters_scale_as_peft_says():
    cfg = _base().config
    attn = lora_mod.load_adapter(GOLDEN / "lora" / "attn", cfg)
    mlp = lora_mod.load_adapter(GOLDEN / "lora" / "mlp", cfg)
    only = lora_mod.load_adapter(GOLDEN / "lora" / "all", cfg)
    assert (attn.rank, attn.scale) == (4, 2.0)  # alpha 8 / r 4
    assert (mlp.rank, mlp.scale) == (8, pytest.approx(4 / 8**0.5))  # rsLoRA
    assert sorted(attn.weights) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    a, b = only.weights["down_proj"]  # layers_to_transform [1]: layer 0 is zeros
    assert not a[0].any() and not b[0].any() and a[1].any() and b[1].any()


def _run(llm, requests):
    """{request id: greedy tokens} of requests ``(id, prompt, lora)`` added at once."""
    p = pj.SamplingParams(max_tokens=32, ignore_eos=True)
    for rid, prompt, lora in requests:
        llm.add_request(rid, prompt, p, lora=lora)
    out = {}
    while llm.has_unfinished():
        for o in llm.step():
            out[o.request_id] = o.outputs[0].token_ids
    return out


@pytest.mark.parametrize("slots", [4, 1])
def test_a_batch_of_adapters_and_the_base_model_gives_each_row_its_own(slots):
    # Every adapter and the base model on every prompt, all at once: each row gets what
    # peft gives for its adapter. With one slot for three adapters, requests wait to be
    # admitted until the running ones release the slot.
    llm = pj.LLM(_base(), max_loras=slots, max_lora_rank=8, num_pages=64, page_size=8,
                 compilation_cache=False)  # fmt: skip
    for name in NAMES:
        llm.add_lora(name, GOLDEN / "lora" / name)
    assert llm.loras == list(NAMES)
    requests = [
        (f"{name}-{key}", PROMPTS[key], name)
        for key in ("short", "long", "mid")
        for name in (*NAMES, None)
    ]
    got = _run(llm, requests)
    for rid, _, name in requests:
        key = rid.split("-")[1]
        assert got[rid] == _golden(name)[f"greedy_{key}"].tolist(), rid


@pytest.mark.parametrize("slots", [4, 1])
def test_the_engine_on_an_accelerator_s_layout_gives_each_row_its_own(slots, monkeypatch):
    # The engine holding the model as it does off the CPU (per-layer weights, fused
    # projections: the bank in pairs a fused projection, B block-diagonal), on CPU:
    # adapters swapped into the slots by the engine give peft's tokens, mixed with the
    # base model in one batch.
    from paged_jax.engine import devices

    monkeypatch.setattr(devices, "_on_cpu", lambda model: False)
    llm = pj.LLM(_base(), max_loras=slots, max_lora_rank=8, num_pages=64, page_size=8,
                 compilation_cache=False)  # fmt: skip
    assert llm.runner.model.unrolled and llm.runner.model.lora.per_layer  # slots per layer
    assert [n for n, ts in llm.runner.model.lora.groups if len(ts) > 1] == [
        "qkv_proj",
        "gate_up_proj",
    ]
    for name in NAMES:
        llm.add_lora(name, GOLDEN / "lora" / name)
    requests = [
        (f"{name}-{key}", PROMPTS[key], name) for key in ("short", "mid") for name in (*NAMES, None)
    ]
    got = _run(llm, requests)
    for rid, _, name in requests:
        key = rid.split("-")[1]
        assert got[rid] == _golden(name)[f"greedy_{key}"].tolist(), rid


def test_prefix_pages_are_never_shared_across_adapters():
    llm = pj.LLM(_base(), max_loras=2, max_lora_rank=8, num_pages=64, page_size=8,
                 compilation_cache=False)  # fmt: skip
    llm.add_lora("attn", GOLDEN / "lora" / "attn")
    llm.add_lora("mlp", GOLDEN / "lora" / "mlp")
    p = pj.SamplingParams(max_tokens=4, ignore_eos=True)
    prompt = PROMPTS["long"]  # 30 tokens: 3 full pages of 8

    def cached(lora):
        return llm.generate([prompt], p, progress=False, lora=lora)[0].metrics.num_cached_tokens

    assert cached("attn") == 0
    assert cached("attn") == 24  # the same adapter again: its own pages
    assert cached("mlp") == 0 and cached(None) == 0  # another adapter, the base model


def test_deterministic_mode_applies_adapters_row_by_row():
    llm = pj.LLM(_base(), max_loras=1, max_lora_rank=8, num_pages=64, page_size=8,
                 deterministic=True, compilation_cache=False)  # fmt: skip
    llm.add_lora("mlp", GOLDEN / "lora" / "mlp")
    got = _run(llm, [("a", PROMPTS["mid"], "mlp"), ("b", PROMPTS["mid"], None)])
    assert got["a"] == _golden("mlp")["greedy_mid"].tolist()
    assert got["b"] == _golden(None)["greedy_mid"].tolist()


def test_what_does_not_fit_is_refused_by_name(tmp_path):
    model = _base()
    with pytest.raises(ValueError, match=r"add_lora: the engine has no LoRA slots"):
        pj.LLM(_base(), num_pages=16, page_size=8).add_lora("x", GOLDEN / "lora" / "attn")
    llm = pj.LLM(model, max_loras=1, max_lora_rank=4, num_pages=16, page_size=8)
    with pytest.raises(ValueError, match=r"rank 8 is above max_lora_rank=4"):
        llm.add_lora("mlp", GOLDEN / "lora" / "mlp")
    llm.add_lora("attn", GOLDEN / "lora" / "attn")
    with pytest.raises(ValueError, match=r"an adapter named 'attn' is registered already"):
        llm.add_lora("attn", GOLDEN / "lora" / "attn")
    with pytest.raises(ValueError, match=r"prompts\[0\]: lora: no adapter named 'nope'"):
        llm.generate([[1, 2, 3]], lora="nope")
    llm.add_request("r", [1, 2, 3], pj.SamplingParams(max_tokens=2), lora="attn")
    with pytest.raises(ValueError, match=r"1 unfinished requests use adapter 'attn'"):
        llm.remove_lora("attn")
    llm.abort("r")
    llm.remove_lora("attn")
    assert llm.loras == []
    # an adapter whose tensors do not fit the model names the tensor
    bad = tmp_path / "bad"
    shutil.copytree(GOLDEN / "lora" / "attn", bad)
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    tensors[name] = np.zeros((4, 31), np.float32)  # the model's hidden size is 32
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=f"tensor '{name}' has shape \\[4, 31\\], expected"):
        lora_mod.load_adapter(bad, model.config)
    tensors.pop(name)
    tensors[name.replace("q_proj", "lm_head")] = np.zeros((4, 32), np.float32)
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="target 'lm_head' is not one of"):
        lora_mod.load_adapter(bad, model.config)
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora: True is not supported"):
        lora_mod.load_adapter(bad, model.config)
    # a model of one's own without slots: adapters refused at the request
    plain = pj.LLM(_base(), num_pages=16, page_size=8)
    with pytest.raises(ValueError, match="the model has no LoRA slots"):
        plain.add_request("x", [1, 2], adapter=1)


def test_the_cli_runs_a_request_with_an_adapter(capsys):
    from paged_jax import cli

    argv = ["generate", "--no-progress", "--json", "--model", str(BASE), "--dtype", "float32"]
    argv += ["--prompt-ids", ",".join(map(str, PROMPTS["short"])), "--max-tokens", "32"]
    argv += ["--ignore-eos", "--lora", f"attn={GOLDEN / 'lora' / 'attn'}"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    got = out["outputs"][0]["completions"][0]["token_ids"]
    assert got == _golden("attn")["greedy_short"].tolist()
    assert cli.main([*argv[:-1], "attn"]) == 2  # not NAME=PATH
    assert "--lora: expected NAME=PATH, got 'attn'" in capsys.readouterr().err


def _random_adapter(cfg, name, seed, rank=4):
    rng = np.random.default_rng(seed)
    weights = {}
    for t in ("q_proj", "v_proj", "down_proj"):
        fan_in, fan_out = lora_mod.target_shape(cfg, t)
        A = rng.normal(size=(cfg.num_layers, fan_in, rank)).astype(np.float32)
        B = rng.normal(size=(cfg.num_layers, rank, fan_out)).astype(np.float32)
        weights[t] = (A * 0.3, B * 0.3)
    return lora_mod.LoraAdapter(name, rank, 1.0, weights)


def test_the_server_serves_adapters_by_model_name():
    import threading  # noqa: F401  (the server's engine thread)

    from starlette.testclient import TestClient

    from paged_jax import models
    from paged_jax.server.api import Server

    model, tokenizer = models.load("tiny-llama")
    llm = pj.LLM(model, tokenizer, num_pages=64, max_loras=1, max_lora_rank=4,
                 compilation_cache=False)  # fmt: skip
    llm.add_lora("styled", _random_adapter(model.config, "styled", 1))
    llm.add_lora("other", _random_adapter(model.config, "other", 2))
    p = pj.SamplingParams(max_tokens=8, ignore_eos=True)
    offline = {
        name: llm.generate(["hello there"], p, progress=False, lora=name)[0].outputs[0].text
        for name in ("styled", "other", None)
    }
    assert len(set(offline.values())) == 3  # each adapter changes the reply
    app = Server(llm, model_name="base")
    with TestClient(app.app) as client:
        listed = client.get("/v1/models").json()["data"]
        assert [m["id"] for m in listed] == ["base", "styled", "other"]
        assert listed[1]["parent"] == "base"
        for name, want in (("styled", offline["styled"]), ("base", offline[None]),
                           ("other", offline["other"])):  # fmt: skip
            body = dict(model=name, prompt="hello there", max_tokens=8, ignore_eos=True,
                        temperature=0)  # fmt: skip
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == name and r.json()["choices"][0]["text"] == want
        r = client.post("/v1/completions", json=dict(model="nope", prompt="hi"))
        assert r.status_code == 404
        assert "this server serves 'base', 'styled', 'other'" in r.json()["error"]["message"]


def test_serve_checks_its_adapter_flags_before_loading(capsys, tmp_path):
    from paged_jax import cli

    assert cli.main(["serve", "--lora-modules", f"a={tmp_path}"]) == 2
    assert f"--lora-modules: a: {tmp_path / 'adapter_config.json'}" in capsys.readouterr().err
    adapter = GOLDEN / "lora" / "attn"
    assert cli.main(["serve", "--lora-modules", f"a={adapter}", f"a={adapter}"]) == 2
    assert "--lora-modules: the name 'a' is given twice" in capsys.readouterr().err
    assert cli.main(["serve", "--max-loras", "2"]) == 2
    assert "--max-loras: expected an int >= 1 with --lora-modules" in capsys.readouterr().err
    assert cli.main(["serve", "--lora-allowed-dir", str(tmp_path / "nope")]) == 2
    assert f"--lora-allowed-dir: {tmp_path / 'nope'} is not a directory" in capsys.readouterr().err
    assert cli.main(["serve", "--lora-allowed-dir", str(tmp_path)]) == 2
    assert "--lora-allowed-dir: needs --max-loras N" in capsys.readouterr().err
    assert cli.main(["serve", "--max-loras", "1", "--max-lora-rank", "0"]) == 2
    assert "--max-loras: expected an int >= 1 with --lora-modules" in capsys.readouterr().err
    argv = ["serve", "--max-loras", "1", "--lora-allowed-dir", str(tmp_path), "--max-lora-rank"]
    assert cli.main([*argv, "0"]) == 2
    assert "--max-lora-rank: expected an int >= 1, got 0" in capsys.readouterr().err


def test_samples_of_a_request_share_its_adapter():
    # n = 2 seeded samples (forked sequences of one group) with an adapter: the same
    # tokens alone and beside requests of other adapters.
    p = pj.SamplingParams(max_tokens=12, n=2, temperature=0.9, seed=3, ignore_eos=True)

    def run(others):
        llm = pj.LLM(_base(), max_loras=3, max_lora_rank=8, num_pages=64, page_size=8,
                     compilation_cache=False)  # fmt: skip
        for name in NAMES:
            llm.add_lora(name, GOLDEN / "lora" / name)
        llm.add_request("x", PROMPTS["mid"], p, lora="mlp")
        for i, name in enumerate(others):
            llm.add_request(f"o{i}", PROMPTS["long"], p, lora=name)
        out = {}
        while llm.has_unfinished():
            for o in llm.step():
                out[o.request_id] = [c.token_ids for c in o.outputs]
        return out["x"]

    alone = run([])
    assert len(alone) == 2 and alone[0] != alone[1]
    assert run(["attn", "all", None]) == alone


def test_speculative_decoding_keeps_an_adapters_tokens(verify_freely):
    # Verify rows carry their request's adapter on every proposed token: n-gram
    # speculation gives the adapter's greedy tokens (some proposals accepted).
    llm = pj.LLM(_base(), max_loras=1, max_lora_rank=8, num_pages=64, page_size=8,
                 speculative={"method": "ngram", "num_speculative_tokens": 4},
                 compilation_cache=False)  # fmt: skip
    llm.add_lora("attn", GOLDEN / "lora" / "attn")
    p = pj.SamplingParams(max_tokens=32, ignore_eos=True)
    out = llm.generate([PROMPTS["long"], PROMPTS["mid"]], p, progress=False, lora="attn")
    assert out[0].outputs[0].token_ids == _golden("attn")["greedy_long"].tolist()
    assert out[1].outputs[0].token_ids == _golden("attn")["greedy_mid"].tolist()
    assert llm.metrics.spec_accepted_tokens > 0


@pytest.mark.slow  # 10 s (a process of its own); .ci/run runs it
def test_adapters_on_a_tensor_parallel_mesh_give_peft_s_tokens():
    # Two fake CPU devices, in a process of its own (tests/lora_mesh_worker.py): the
    # weights in their shards, the adapters' slots beside them; all three adapters and
    # the base model in one batch.
    import subprocess
    import sys

    worker = pathlib.Path(__file__).parent / "lora_mesh_worker.py"
    done = subprocess.run([sys.executable, str(worker)], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    for name in (*NAMES, None):
        for key in ("short", "long"):
            assert got[f"{name}/{key}"] == _golden(name)[f"greedy_{key}"].tolist(), (name, key)


@pytest.mark.slow  # 13 s; .ci/run runs it
def test_nothing_compiles_after_warm_up_with_adapters():
    # warm_up() compiles each step shape with adapter rows too (what a server with
    # --lora-modules runs): mixed traffic of adapters and the base model compiles nothing
    # afterwards and gives peft's tokens.
    llm = pj.LLM(_base(), max_loras=2, max_lora_rank=8, num_pages=64, page_size=8,
                 max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                 compilation_cache=False)  # fmt: skip
    n = len(llm.warm_up(progress=False))
    for name in NAMES:
        llm.add_lora(name, GOLDEN / "lora" / name)
    requests = [(f"{name}-{key}", PROMPTS[key], name) for key in ("short", "mid")
                for name in (*NAMES, None)]  # fmt: skip
    got = _run(llm, requests)
    assert len(llm.compiled_buckets) == n, llm.compiled_buckets[n:]
    for rid, _, name in requests:
        assert got[rid] == _golden(name)[f"greedy_{rid.split('-')[1]}"].tolist(), rid


def test_the_cpu_kernel_multiplies_each_row_by_its_own_slot_only():
    import jax

    from paged_jax import linear

    if not linear.available():
        pytest.skip("the CPU kernels did not build here")
    rng = np.random.default_rng(3)
    T, K, N, L, S, R = 9, 40, 37, 3, 4, 8  # N: two blocks of 16 outputs and 5 more
    x = rng.normal(size=(T, K)).astype(np.float32)
    a = rng.normal(size=(L, K, S * R)).astype(np.float32)
    b = rng.normal(size=(L, S * R, N)).astype(np.float32)
    ids = np.array([0, 1, 2, 3, 4, 1, 5, 0, 4], np.int32)  # 0: none; 5: past the slots
    f = jax.jit(lambda x, a, b, i, l: linear.lora_delta(x, a, b, i, l, R))
    for layer in (0, 2):
        got = np.asarray(f(x, a, b, ids, jnp.int32(layer)))
        for t in range(T):
            s = ids[t] - 1
            want = np.zeros(N)
            if 0 <= s < S:
                want = (x[t] @ a[layer][:, s * R : (s + 1) * R]) @ b[layer][s * R : (s + 1) * R]
            np.testing.assert_allclose(got[t], want, rtol=1e-5, atol=1e-4)
        # a row's result does not depend on the other rows (its group of one slot's rows)
        for t in range(T):
            alone = np.asarray(f(x[t : t + 1], a, b, ids[t : t + 1], jnp.int32(layer)))
            assert np.array_equal(alone[0], got[t]), t
        pairs = np.asarray(f(x[[1, 5]], a, b, ids[[1, 5]], jnp.int32(layer)))
        assert np.array_equal(pairs, got[[1, 5]])
    with pytest.raises(ValueError, match="rank"):
        linear.lora_delta(jnp.asarray(x), a, b, jnp.asarray(ids), 0, 5)
    with pytest.raises(ValueError, match="ids"):
        linear.lora_delta(jnp.asarray(x), a, b, jnp.asarray(ids[:3]), 0, R)
    with pytest.raises(ValueError, match="layer"):
        linear.lora_delta(jnp.asarray(x), a, b, jnp.asarray(ids), 3, R)
    with pytest.raises(ValueError, match="a, b"):
        linear.lora_delta(jnp.asarray(x), a[:, :5], b, jnp.asarray(ids), 0, R)


def _peft_dir(cfg, path: pathlib.Path, seed: int, rank: int = 4) -> pathlib.Path:
    """A random PEFT adapter for a model of ``cfg`` written to ``path`` as PEFT saves one."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True)
    tensors = {}
    for t in ("q_proj", "v_proj"):
        fan_in, fan_out = lora_mod.target_shape(cfg, t)
        for i in range(cfg.num_layers):
            stem = f"base_model.model.model.layers.{i}.self_attn.{t}"
            tensors[f"{stem}.lora_A.weight"] = rng.normal(0, 0.3, (rank, fan_in)).astype("f4")
            tensors[f"{stem}.lora_B.weight"] = rng.normal(0, 0.3, (fan_out, rank)).astype("f4")
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank,
              "target_modules": ["q_proj", "v_proj"]}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def test_adapters_load_and_unload_while_the_server_runs(tmp_path):
    # vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: behind the API key, only
    # from the allowed directories, and a request in flight meanwhile keeps its tokens
    from starlette.testclient import TestClient

    from paged_jax import models
    from paged_jax.server.api import Server

    model, tokenizer = models.load("tiny-llama")
    allowed = _peft_dir(model.config, tmp_path / "allowed" / "styled", 1).parent
    outside = _peft_dir(model.config, tmp_path / "outside", 2)
    (allowed / "link").symlink_to(outside)  # inside by name, outside once resolved
    llm = pj.LLM(model, tokenizer, num_pages=64, max_loras=1, max_lora_rank=4,
                 compilation_cache=False)  # fmt: skip
    p = pj.SamplingParams(max_tokens=8, ignore_eos=True)
    long = pj.SamplingParams(max_tokens=120, ignore_eos=True)
    llm.add_lora("ref", str(allowed / "styled"))
    want = llm.generate(["hello there"], p, progress=False, lora="ref")[0].outputs[0].text
    llm.remove_lora("ref")
    base = llm.generate(["hello there"], p, progress=False)[0].outputs[0].text
    base_long = llm.generate([[1, 2, 3]], long, progress=False)[0].outputs[0].token_ids
    assert want != base  # the adapter changes the reply
    key = {"Authorization": "Bearer k"}
    load = {"lora_name": "styled", "lora_path": str(allowed / "styled")}
    body = dict(model="styled", prompt="hello there", max_tokens=8, ignore_eos=True,
                temperature=0)  # fmt: skip
    app = Server(llm, model_name="base", api_key="k", lora_dirs=[allowed])
    with TestClient(app.app) as client:
        assert client.post("/v1/load_lora_adapter", json=load).status_code == 401
        for bad, param in (({**load, "lora_path": str(outside)}, "lora_path"),
                           ({**load, "lora_path": str(allowed / ".." / "outside")}, "lora_path"),
                           ({**load, "lora_path": str(allowed / "link")}, "lora_path"),
                           ({**load, "lora_name": "base"}, "lora_name"),
                           ({"lora_path": str(allowed / "styled")}, "lora_name"),
                           ({**load, "lora_path": str(allowed)}, "lora_path")):  # fmt: skip
            r = client.post("/v1/load_lora_adapter", json=bad, headers=key)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert client.post("/v1/completions", json=body, headers=key).status_code == 404
        events = []
        app.loop.submit("in-flight", [1, 2, 3], long, events.append)
        r = client.post("/v1/load_lora_adapter", json=load, headers=key)
        assert r.status_code == 200 and "styled" in r.text, r.text
        assert llm.loras == ["styled"]
        assert [m["id"] for m in client.get("/v1/models", headers=key).json()["data"]] == [
            "base", "styled"]  # fmt: skip
        r = client.post("/v1/completions", json=body, headers=key)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
        r = client.post("/v1/completions", json={**body, "model": "base"}, headers=key)
        assert r.json()["choices"][0]["text"] == base
        r = client.post("/v1/load_lora_adapter", json=load, headers=key)
        assert r.status_code == 400 and "is loaded" in r.text
        # a request using the adapter keeps it loaded
        app.loop.submit("user", [1, 2, 3], long, events.append, lora="styled")
        r = client.post("/v1/unload_lora_adapter", json={"lora_name": "styled"}, headers=key)
        assert r.status_code == 409, r.text
        app.loop.abort("user")
        for _ in range(200):
            r = client.post("/v1/unload_lora_adapter", json={"lora_name": "styled"}, headers=key)
            if r.status_code != 409:
                break
            time.sleep(0.05)
        assert r.status_code == 200, r.text
        assert client.post("/v1/completions", json=body, headers=key).status_code == 404
        r = client.post("/v1/unload_lora_adapter", json={"lora_name": "styled"}, headers=key)
        assert r.status_code == 404
        for _ in range(400):
            if any(e.kind == "done" for e in events):
                break
            time.sleep(0.05)
    done = [e.output for e in events if e.kind == "done"]
    assert done and done[0].outputs[0].token_ids == base_long  # in flight, untouched
    off = Server(llm, model_name="base")
    with TestClient(off.app) as client:
        assert client.post("/v1/load_lora_adapter", json=load).status_code == 404
