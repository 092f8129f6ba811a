"""Parity with Hugging Face transformers (the `hf` extra: transformers + torch CPU).

Tiny random Llama, Llama-3 (rope scaling, tied head, attention bias), Qwen2 and Mistral
(sliding window) models are built with transformers, saved with ``save_pretrained`` and
loaded here with ``models.load_hf``; everything runs in f32.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from model_helpers import PagedGreedy

from models import load_hf
from paged_jax.metadata import AttentionMetadata

transformers = pytest.importorskip(
    "transformers", reason="the hf extra is not installed: pip install -e '.[hf]'"
)
torch = pytest.importorskip("torch", reason="the hf extra is not installed: pip install -e '.[hf]'")

COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
VARIANTS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON),
    "llama3": lambda: transformers.LlamaConfig(
        **COMMON,
        tie_word_embeddings=True,
        attention_bias=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=8),
}
MODEL_CLASSES = {
    "llama": "LlamaForCausalLM",
    "llama3": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}
PROMPTS = {"short": [1, 5, 9], "mid": list(range(10, 27)), "long": [3, 7] * 15}


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    cfg = VARIANTS[request.param]()
    hf = getattr(transformers, MODEL_CLASSES[request.param])(cfg).eval()
    with torch.no_grad():  # random biases: transformers initializes them to zero
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    model, tokenizer = load_hf(path, dtype=jnp.float32)
    return request.param, hf, model, path


def hf_greedy(hf, prompt, n):
    """Argmax decoding with transformers' own forward and KV cache (no generate() logits
    processors: min_new_tokens, for one, would forbid the EOS token)."""
    out, past, inp = [], None, torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            r = hf(inp, past_key_values=past, use_cache=True)
            past = r.past_key_values
            out.append(int(r.logits[0, -1].argmax()))
            inp = torch.tensor([[out[-1]]])
    return out


def test_prompt_logits_match(pair):
    name, hf, model, _ = pair
    ids = PROMPTS["long"]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    cache = model.make_cache(16, 8)
    md = AttentionMetadata.prefill(len(ids), 8 + np.arange(len(ids)), [1, 2, 3, 4], logits_all=True)
    logits, _ = model(jnp.asarray(ids, jnp.int32), jnp.arange(len(ids), dtype=jnp.int32), cache, md)
    rel = np.abs(np.asarray(logits) - ref).max() / np.abs(ref).max()
    assert rel <= 1e-4, f"{name}: relative error {rel:.2e}"


def test_greedy_batch_fork_and_prefix_match_transformers(pair):
    name, hf, model, _ = pair
    expected = {k: hf_greedy(hf, p, 32) for k, p in PROMPTS.items()}
    # Prompts of different lengths decoded together through the paged cache; "twin" is
    # forked from "mid" after its prefill and shares its pages.
    g = PagedGreedy(model, page_size=8, prefix_caching=True)
    out = g.decode(g.prefill(PROMPTS), max_new=32, forks={"twin": "mid"})
    for k in PROMPTS:
        assert out[k] == expected[k], f"{name}/{k}"
    assert out["twin"] == expected["mid"], f"{name}/twin"
    # A prompt whose first two pages come from "mid"'s prompt through the prefix cache.
    prompt = PROMPTS["mid"][:16] + [4, 4, 2]
    before = g.computed_tokens
    first = g.prefill({"hit": prompt})
    assert g.computed_tokens - before == 3, "the shared pages were prefilled again"
    got = g.decode(first, max_new=32)["hit"]
    assert got == hf_greedy(hf, prompt, 32), f"{name}/prefix-hit"


def test_sharded_and_bf16_checkpoints(tmp_path):
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).eval()
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    sharded, _ = load_hf(tmp_path / "sharded")
    assert sharded.embed_tokens.embedding[...].dtype == jnp.float32
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    as_stored, _ = load_hf(tmp_path / "bf16")
    assert as_stored.embed_tokens.embedding[...].dtype == jnp.bfloat16
    upcast, _ = load_hf(tmp_path / "bf16", dtype=jnp.float32)
    w = upcast.layer(0).self_attn.q_proj.kernel[...]
    assert w.dtype == jnp.float32
    ref = hf.model.layers[0].self_attn.q_proj.weight.detach().float().numpy().T
    np.testing.assert_array_equal(np.asarray(w), ref)


def test_tokenizer_is_loaded_when_present(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(2)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))
    hf.save_pretrained(tmp_path)
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    _, loaded = load_hf(tmp_path)
    assert loaded.encode("hello world").ids == [1, 2]


def test_loader_errors(tmp_path):
    torch.manual_seed(3)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))
    hf.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a checkpoint directory"):
        load_hf(tmp_path / "nope")
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"architectures: \['GPT2LMHeadModel'\] is not supported"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    with pytest.raises(
        ValueError,
        match=r"tensor 'model.layers.0.mlp.down_proj.weight' has "
        r"shape \(64, 128\), expected \(64, 96\)",
    ):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_hf(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json: missing"):
        load_hf(tmp_path)
