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
    # alternating sliding (window 8) and global layers, attention and final logit
    # soft-capping (small caps, so they bend the scores), GeGLU, sandwich norms, (1 + w)
    # norms, scaled embeddings, query_pre_attn_scalar
    "gemma2": "Gemma2ForCausalLM",
    # two sliding layers per global one over 5 layers (a partial group at the end), local
    # and global RoPE bases, linear RoPE scaling on the global layers, QK-norm
    "gemma3": "Gemma3ForCausalLM",
    # mixtures of experts: 4 experts, top 2, renormalized
    "mixtral": "MixtralForCausalLM",
    # a shared expert with its sigmoid gate, q/k/v biases, top-2 weights not renormalized
    "qwen2moe": "Qwen2MoeForCausalLM",
    # 8 experts, top 2 renormalized, QK-norm, head_dim not hidden / heads
    "qwen3moe": "Qwen3MoeForCausalLM",
    # alternating sliding (window 8) and full layers, attention sinks, YaRN RoPE, q/k/v/o
    # biases, a router with a bias (top-k logits, then their softmax), experts with biases
    # and a clamped unit (a small limit, so that it clamps)
    "gptoss": "GptOssForCausalLM",
    # dense layers among the sparse ones: mlp_only_layers=[0] (a dense first layer, as
    # DeepSeek's), and decoder_sparse_step=2 over 4 layers (dense, sparse, dense, sparse)
    "qwen2moe_mixed": "Qwen2MoeForCausalLM",
    "qwen3moe_mixed": "Qwen3MoeForCausalLM",
}
# The mixtures: their golden files also hold the routers' inputs and choices
MOE = ("mixtral", "qwen2moe", "qwen3moe", "gptoss")
# Gemma's RMSNorm weights start at 0 (the scale is 1 + w): randomized too, or the golden
# files would not see the offset.
RANDOM_NORMS = ("gemma2", "gemma3")


def randomize(hf, name: str) -> None:
    """Draws the weights transformers initializes to constants: biases (zero) and, for
    ``RANDOM_NORMS`` variants, norm weights."""
    import torch

    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if pname.endswith("bias") or (name in RANDOM_NORMS and pname.endswith("norm.weight")):
                p.normal_(0, 0.5)


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
    if name == "gemma2":
        return transformers.Gemma2Config(
            **{**COMMON, "num_hidden_layers": 4},
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=8,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
            tie_word_embeddings=False,  # tied, greedy decoding repeated one token
        )
    if name == "gemma3":
        sliding, full = "sliding_attention", "full_attention"
        return transformers.Gemma3TextConfig(
            **{**COMMON, "num_hidden_layers": 5},
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=8,
            layer_types=[sliding, sliding, full, sliding, sliding],
            rope_parameters={
                sliding: {"rope_type": "default", "rope_theta": 10000.0},
                full: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
            },
            tie_word_embeddings=False,
        )
    if name == "mixtral":
        return transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2)
    if name == "qwen2moe":
        return transformers.Qwen2MoeConfig(
            **COMMON,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
        )
    if name == "qwen3moe":
        return transformers.Qwen3MoeConfig(
            **COMMON,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            head_dim=16,
            norm_topk_prob=True,
        )
    if name == "qwen2moe_mixed":
        return transformers.Qwen2MoeConfig(
            **COMMON,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[0],
        )
    if name == "qwen3moe_mixed":
        return transformers.Qwen3MoeConfig(
            **{**COMMON, "num_hidden_layers": 4},
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            head_dim=16,
            decoder_sparse_step=2,
        )
    if name == "gptoss":
        return transformers.GptOssConfig(
            **COMMON,
            num_local_experts=4,
            num_experts_per_tok=2,
            head_dim=16,
            sliding_window=8,
            swiglu_limit=1.0,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 32,
            },
        )
    raise KeyError(name)


def _router(mlp):
    """A sparse block's router module (``gate``; GPT-OSS: ``router``) or None."""
    return (
        getattr(mlp, "gate", None)
        if hasattr(mlp, "experts") and hasattr(mlp, "gate")
        else (getattr(mlp, "router", None))
    )


def router_choices(ref, prompt):
    """A mixture's routers on ``prompt``: ``(inputs f32[L, T, E], experts i32[L, T, K])``,
    each layer's sparse block's input and the experts its router chose (transformers'
    order: by weight, descending), caught by hooks on ``model.layers[i].mlp``."""
    import numpy as np
    import torch

    layers = ref.model.layers
    inputs, chosen = [None] * len(layers), [None] * len(layers)
    hooks = []
    for i, layer in enumerate(layers):

        def keep_input(module, args, i=i):
            inputs[i] = args[0].reshape(-1, args[0].shape[-1]).numpy().astype(np.float32)

        def keep_choice(module, args, out, i=i):
            chosen[i] = out[2].numpy().astype(np.int32)

        hooks.append(layer.mlp.register_forward_pre_hook(keep_input))
        hooks.append(_router(layer.mlp).register_forward_hook(keep_choice))
    try:
        with torch.no_grad():
            ref(torch.tensor([prompt]))
    finally:
        for h in hooks:
            h.remove()
    return np.stack(inputs), np.stack(chosen)


def hf_greedy(hf, prompt, n):
    """``n`` argmax tokens after ``prompt`` with transformers' own forward and KV cache (no
    generate() logits processors: min_new_tokens, for one, would forbid the EOS token)."""
    import inspect

    import torch

    # transformers 5.x renamed the KV cache argument and output from ``past_key_values`` to
    # ``cache`` (the old name warns, and goes in 5.40); older releases know only the old one.
    key = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    out, past, inp = [], None, torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            r = hf(inp, use_cache=True, **{key: past})
            past = getattr(r, key)
            out.append(int(r.logits[0, -1].argmax()))
            inp = torch.tensor([[out[-1]]])
    return out


def golden_arrays(ref, new_tokens: int) -> dict:
    """What a golden.npz holds for reference model ``ref`` (transformers, with or without
    a peft adapter): ``logits`` (f32[T, V], every position of the "long" prompt) and
    ``greedy_<prompt>`` (i32[new_tokens], ``hf_greedy``) for each of ``PROMPTS``; for a
    mixture also ``router_inputs`` and ``router_choices`` (``router_choices``, "long")."""
    import numpy as np
    import torch

    with torch.no_grad():
        logits = ref(torch.tensor([PROMPTS["long"]])).logits[0].numpy().astype(np.float32)
    arrays = {"logits": logits}
    for key, prompt in PROMPTS.items():
        arrays[f"greedy_{key}"] = np.asarray(hf_greedy(ref, prompt, new_tokens), np.int32)
    if _router(ref.model.layers[0].mlp) is not None:
        arrays["router_inputs"], arrays["router_choices"] = router_choices(ref, PROMPTS["long"])
    return arrays
