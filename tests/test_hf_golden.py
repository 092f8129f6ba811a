"""Parity with Hugging Face transformers through golden files (no torch needed).

tests/golden/hf holds tiny Llama, Llama-3 (rope scaling, tied head, attention bias), Qwen2,
Mistral (sliding window), Qwen3 (QK-norm), Gemma 2, Gemma 3 and the mixtures of experts
Mixtral, Qwen2-MoE (shared expert) and Qwen3-MoE checkpoints written by
transformers' ``save_pretrained``, with the prompt logits and greedy tokens transformers
computed from them
(tests/golden/regenerate_hf.py). Here they are loaded with ``models.load_hf`` and run in
f32; ``pytest -m hf`` runs the same comparison against a live transformers.
"""

import json
import pathlib
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from hf_cases import MODEL_CLASSES, MOE, PROMPTS
from model_helpers import (
    PagedGreedy,
    greedy_batch_fork_and_prefix_hit,
    kernel_kwargs,
    paged_prompt_logits,
)

from paged_jax.models import load_hf

GOLDEN = pathlib.Path(__file__).resolve().parent / "golden" / "hf"
BATCH = ("short", "mid", "long")


@pytest.fixture(scope="module", params=list(MODEL_CLASSES))
def variant(request):
    path = GOLDEN / request.param
    model, _ = load_hf(path, dtype=jnp.float32)
    return request.param, model, dict(np.load(path / "golden.npz"))


def test_prompt_logits_match_transformers(variant):
    name, model, golden = variant
    logits, ref = paged_prompt_logits(model, PROMPTS["long"]), golden["logits"]
    rel = np.abs(logits - ref).max() / np.abs(ref).max()
    assert rel <= 1e-4, f"{name}: relative error {rel:.2e}"


def test_greedy_batch_fork_and_prefix_match_transformers(variant):
    name, model, golden = variant
    out, computed = greedy_batch_fork_and_prefix_hit(model, PROMPTS, BATCH, "hit")
    for k in (*BATCH, "hit"):
        assert out[k] == golden[f"greedy_{k}"].tolist(), f"{name}/{k}"
    assert out["twin"] == golden["greedy_mid"].tolist(), f"{name}/twin"
    assert computed == 3, "the pages shared with 'mid' were prefilled again"


@pytest.mark.parametrize("name", MOE)
def test_routers_choose_the_experts_transformers_chose(name):
    """Each layer's router, given the input transformers' sparse block got on the "long"
    prompt, picks the same experts in the same order (by weight, descending)."""
    model, _ = load_hf(GOLDEN / name, dtype=jnp.float32)
    golden = np.load(GOLDEN / name / "golden.npz")
    inputs, chosen = golden["router_inputs"], golden["router_choices"]
    assert inputs.shape[:2] == (model.config.num_layers, len(PROMPTS["long"]))
    for i in range(model.config.num_layers):
        weights, ids = model.layer(i).mlp.choices(jnp.asarray(inputs[i]))
        np.testing.assert_array_equal(np.asarray(ids), chosen[i], err_msg=f"{name} layer {i}")
        assert np.all(np.diff(np.asarray(weights), axis=-1) <= 0), "weights not descending"


@pytest.mark.parametrize(
    "name",
    # Gemma 3 has the most groups (4 sliding, 1 global), GPT-OSS sinks in its sliding
    # layers; the others under -m slow
    [pytest.param(n, marks=pytest.mark.slow) for n in ("mistral", "gemma2")] + ["gemma3", "gptoss"],
)
def test_hybrid_pool_frees_sliding_pages_and_keeps_every_token(name):
    """The same tokens with a pool of layer groups whose sliding groups drop pages the
    window has passed (HybridBlockManager), through the batch, the fork and the prefix
    hit; the sliding groups hold about a window of pages per sequence."""
    model, _ = load_hf(GOLDEN / name, dtype=jnp.float32)
    golden = dict(np.load(GOLDEN / name / "golden.npz"))
    out, computed = greedy_batch_fork_and_prefix_hit(model, PROMPTS, BATCH, "hit", hybrid=True)
    for k in (*BATCH, "hit"):
        assert out[k] == golden[f"greedy_{k}"].tolist(), f"{name}/{k}"
    assert out["twin"] == golden["greedy_mid"].tolist(), f"{name}/twin"
    assert computed == 3, "the pages shared with 'mid' were prefilled again"
    bm = out["_loop"].bm
    bm.check_invariants()
    windows = bm.group_windows
    assert any(w is not None for w in windows), windows
    for sid in bm.seq_ids:  # window 8, pages of 8: the window spans 1 or 2 pages
        n = bm.num_tokens(sid)
        for w, table in zip(windows, bm.block_table(sid), strict=True):
            live = sum(1 for p in table if p != 0)
            if w is None:
                assert live == len(table) == -(-n // 8), (sid, table)
            else:
                assert 1 <= live <= 2 < len(table), (sid, w, table)


@pytest.mark.parametrize(
    "backend",
    [pytest.param("pallas_tpu", marks=pytest.mark.slow), "pallas_gpu"],  # TPU: 50 s on CPU
)
def test_gemma2_through_the_pallas_kernels(backend, name="gemma2"):
    """Soft-capped scores and alternating sliding / global layers inside the Pallas
    kernels (interpreted on CPU): the ragged kernel for the prompt, the decode kernel for
    the tokens after it."""
    kw = kernel_kwargs(backend)
    model, _ = load_hf(GOLDEN / name, dtype=jnp.float32)
    golden = np.load(GOLDEN / name / "golden.npz")
    logits = paged_prompt_logits(model, PROMPTS["long"], **kw)
    rel = np.abs(logits - golden["logits"]).max() / np.abs(golden["logits"]).max()
    assert rel <= 1e-4, f"relative error {rel:.2e}"
    g = PagedGreedy(model, page_size=8, **kw)
    out = g.decode(g.prefill({"long": PROMPTS["long"]}), max_new=4)
    assert out["long"] == golden["greedy_long"][:4].tolist()
    assert g.shapes[-1][-1], "the last step was not decode-only"


@pytest.mark.parametrize(
    "backend", [pytest.param("pallas_tpu", marks=pytest.mark.slow), "pallas_gpu"]
)
def test_gpt_oss_s_sinks_through_the_pallas_kernels(backend):
    """GPT-OSS's attention sinks in its sliding and full layers inside the Pallas kernels
    (interpreted): the golden logits and tokens, as for Gemma 2 above."""
    test_gemma2_through_the_pallas_kernels(backend, name="gptoss")


def _shard(src: pathlib.Path, dst: pathlib.Path) -> dict:
    """Copies checkpoint ``src`` to ``dst`` split in two safetensors files with the index
    file save_pretrained writes for sharded checkpoints; returns the tensors."""
    from safetensors.numpy import load_file, save_file

    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, dst / file)
        weight_map.update({n: file for n in part})
    index = {"metadata": {}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return tensors


def test_sharded_and_bf16_checkpoints(tmp_path):
    tensors = _shard(GOLDEN / "llama", tmp_path / "sharded")
    as_stored, _ = load_hf(tmp_path / "sharded")
    assert as_stored.embed_tokens.embedding[...].dtype == jnp.bfloat16
    upcast, _ = load_hf(tmp_path / "sharded", dtype=jnp.float32)
    w = upcast.layer(1).self_attn.q_proj.kernel[...]
    assert w.dtype == jnp.float32
    ref = tensors["model.layers.1.self_attn.q_proj.weight"].astype(np.float32).T
    np.testing.assert_array_equal(np.asarray(w), ref)
    whole, _ = load_hf(GOLDEN / "llama", dtype=jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(whole.layer(1).self_attn.q_proj.kernel[...]), np.asarray(w)
    )


def test_tokenizer_is_loaded_when_present(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    shutil.copytree(GOLDEN / "llama", tmp_path / "ckpt")
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "ckpt" / "tokenizer.json"))
    _, loaded = load_hf(tmp_path / "ckpt")
    assert loaded.encode("hello world").ids == [1, 2]
    assert load_hf(GOLDEN / "llama")[1] is None


def test_loader_errors(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(GOLDEN / "llama", ckpt)
    with pytest.raises(FileNotFoundError, match="not a checkpoint directory"):
        load_hf(tmp_path / "nope")
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"architectures: \['GPT2LMHeadModel'\] is not supported"):
        load_hf(ckpt)
    (ckpt / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 48}))
    with pytest.raises(
        ValueError,
        match=r"tensor 'model.layers.0.mlp.down_proj.weight' has "
        r"shape \(32, 64\), expected \(32, 48\)",
    ):
        load_hf(ckpt)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_hf(ckpt)
    (ckpt / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json: missing"):
        load_hf(ckpt)
