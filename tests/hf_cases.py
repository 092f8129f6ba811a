"""The tiny Hugging Face variants of the parity tests (golden files and live runs)."""

COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    # weights larger than transformers' default 0.02, so greedy tokens vary
    initializer_range=0.3,
)
MODEL_CLASSES = {
    "llama": "LlamaForCausalLM",
    # rope scaling, tied head, attention bias
    "llama3": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    # sliding window shorter than the prompts
    "mistral": "MistralForCausalLM",
    # QK-norm, head_dim not hidden / heads, no biases, tied head
    "qwen3": "Qwen3ForCausalLM",
}
PROMPTS = {
    "short": [1, 5, 9],
    "mid": list(range(10, 27)),
    "long": [3, 7] * 15,
    # its first two pages (page size 8) are "mid"'s: a prefix-cache hit
    "hit": list(range(10, 26)) + [4, 4, 2],
}


def hf_config(transformers, name: str):
    """The transformers config of variant ``name``."""
    if name == "llama":
        return transformers.LlamaConfig(**COMMON)
    if name == "llama3":
        return transformers.LlamaConfig(
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
        )
    if name == "qwen2":
        return transformers.Qwen2Config(**COMMON)
    if name == "mistral":
        return transformers.MistralConfig(**COMMON, sliding_window=8)
    if name == "qwen3":
        return transformers.Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=True)
    raise KeyError(name)


def hf_greedy(hf, prompt, n):
    """``n`` argmax tokens after ``prompt`` with transformers' own forward and KV cache (no
    generate() logits processors: min_new_tokens, for one, would forbid the EOS token)."""
    import torch

    out, past, inp = [], None, torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            r = hf(inp, past_key_values=past, use_cache=True)
            past = r.past_key_values
            out.append(int(r.logits[0, -1].argmax()))
            inp = torch.tensor([[out[-1]]])
    return out
