"""Flax NNX decoders (Llama family: Llama 2/3, Qwen2, Mistral) on the paged KV cache, and a
Hugging Face checkpoint loader."""

from models.config import PRESETS, TINY_LLAMA, LlamaConfig, RopeScaling
from models.hf import load_hf
from models.llama import LlamaForCausalLM, init_model, make_step
from models.tokenizer import ByteTokenizer

__all__ = [
    "PRESETS",
    "TINY_LLAMA",
    "ByteTokenizer",
    "LlamaConfig",
    "LlamaForCausalLM",
    "RopeScaling",
    "init_model",
    "load_hf",
    "make_step",
]
