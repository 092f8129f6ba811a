"""Flax NNX decoders (Llama family: Llama 2/3, Qwen2, Qwen3, Mistral) on the paged KV cache, and a
Hugging Face checkpoint and GGUF loaders, and ``load(name)``: a preset, a named real model
(fetched once), a checkpoint directory or a GGUF file to ``(model, tokenizer)`` for
``paged_jax.LLM``.

Installed as ``paged_jax.models`` (the repository folder is ``models/``).
"""

from .config import PRESETS, TINY_LLAMA, LlamaConfig, RopeScaling
from .gguf_loader import GGUFError, gguf_chat_template, gguf_tokenizer, load_gguf
from .hf import load_hf
from .llama import LlamaForCausalLM, init_model, make_step
from .loading import cpu_compute_dtype, load
from .registry import ALIASES, FetchError, fetch
from .tokenizer import ByteTokenizer, TextTokenizer

__all__ = [
    "ALIASES",
    "PRESETS",
    "TINY_LLAMA",
    "ByteTokenizer",
    "FetchError",
    "GGUFError",
    "LlamaConfig",
    "LlamaForCausalLM",
    "RopeScaling",
    "TextTokenizer",
    "cpu_compute_dtype",
    "fetch",
    "gguf_chat_template",
    "gguf_tokenizer",
    "init_model",
    "load",
    "load_gguf",
    "load_hf",
    "make_step",
]
