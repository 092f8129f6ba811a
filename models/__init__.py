"""Flax NNX decoders (Llama family: Llama 2/3, Qwen2, Mistral) on the paged KV cache, and a
Hugging Face checkpoint loader, and ``load(name)``: a preset or a checkpoint directory to
``(model, tokenizer)`` for ``paged_jax.LLM``.

Installed as ``paged_jax.models`` (the repository folder is ``models/``).
"""

from .config import PRESETS, TINY_LLAMA, LlamaConfig, RopeScaling
from .hf import load_hf
from .llama import LlamaForCausalLM, init_model, make_step
from .loading import cpu_compute_dtype, load
from .tokenizer import ByteTokenizer

__all__ = [
    "PRESETS",
    "TINY_LLAMA",
    "ByteTokenizer",
    "LlamaConfig",
    "LlamaForCausalLM",
    "RopeScaling",
    "cpu_compute_dtype",
    "init_model",
    "load",
    "load_hf",
    "make_step",
]
