"""The real SmolLM2-135M-Instruct GGUF against transformers loading the same file
(``pytest -m hf``: needs transformers, a CPU torch, and the GGUF, which
``paged_jax.models.fetch`` downloads once into the cache directory).

Same weights (both dequantize with the ``gguf`` package), same tokenizer ids, prompt
logits within 1e-4 relative, and the engine's greedy tokens equal transformers'.
"""

import numpy as np
import pytest
from model_helpers import paged_prompt_logits

import paged_jax as pj
from paged_jax.models import fetch, load_gguf

pytestmark = pytest.mark.hf
PROMPTS = [
    "Paged attention stores the KV cache in",
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in 1999, 42 robots",
]


@pytest.fixture(scope="module")
def both():
    transformers = pytest.importorskip("transformers", reason="pytest -m hf needs transformers")
    torch = pytest.importorskip("torch", reason="pytest -m hf needs torch (a CPU build)")
    # transformers 5.x loads a GGUF file only with accelerate installed.
    pytest.importorskip("accelerate", reason="transformers' GGUF loader needs accelerate")
    path = fetch("smollm2-135m-instruct")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model, tok = load_gguf(path)
    return torch, hf, hf_tok, model, tok


def test_tokenizer_ids_match_transformers(both):
    _, _, hf_tok, _, tok = both
    # no runs of digits: llama.cpp's "smollm" pre-tokenizer splits them one by one, as
    # SmolLM2's own tokenizer does; transformers' GGUF reader does not (its vocabulary
    # has no multi-digit pieces either way, so the ids agree here too)
    for text in [*PROMPTS, "emoji 😀 and 日本語\n\ttabs", "<|im_start|>user\nhi<|im_end|>"]:
        assert tok.encode(text).ids == hf_tok(text)["input_ids"], text


def test_prompt_logits_match_transformers(both):
    torch, hf, hf_tok, model, tok = both
    for text in PROMPTS:
        ids = tok.encode(text).ids
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].numpy()
        rel = np.abs(paged_prompt_logits(model, ids) - ref).max() / np.abs(ref).max()
        assert rel <= 1e-4, f"{text!r}: relative error {rel:.2e}"


def test_greedy_tokens_match_transformers(both):
    torch, hf, _, model, tok = both
    llm = pj.LLM(model, tok, num_pages=256, page_size=16, max_num_seqs=8)
    outs = llm.generate(PROMPTS, pj.SamplingParams(max_tokens=24), progress=False)
    for text, out in zip(PROMPTS, outs, strict=True):
        ids = tok.encode(text).ids
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None
            )[0, len(ids) :].tolist()
        got = out.outputs[0].token_ids
        assert got == ref[: len(got)], text
        assert len(got) == 24 or got[-1] in model.config.eos_token_ids
