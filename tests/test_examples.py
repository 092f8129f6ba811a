"""examples/: decoders written from scratch (NNX and Linen) served by LLM give the greedy
tokens of the same model run without a cache; the engine names what a model lacks."""

import ast
import contextlib
import io
import pathlib
import re
import runpy

import jax.numpy as jnp
import pytest
from flax import nnx

import paged_jax as pj
from paged_jax.engine.protocol import ModelContractError

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("name", ["nnx_decoder.py", "linen_decoder.py"])
def test_example_paged_tokens_equal_uncached_tokens(name):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    lines = out.getvalue().strip().splitlines()
    assert len(lines) == 3
    for line in lines:
        paged, uncached = line.split("] [")
        paged, uncached = ast.literal_eval(paged + "]"), ast.literal_eval("[" + uncached)
        assert len(paged) == 12 and paged == uncached, line


class _NoCache(nnx.Module):
    def __init__(self):
        self.config = type("C", (), {"vocab_size": 8})()

    def __call__(self, tokens, positions, cache, metadata):
        return tokens, cache


def test_engine_names_what_a_model_lacks():
    with pytest.raises(TypeError) as e:
        pj.LLM(_NoCache())
    msg = str(e.value)
    assert "_NoCache is not a PagedDecoder" in msg
    assert "config.max_position_embeddings (an int)" in msg
    assert "make_cache(num_pages, page_size, dtype=None)" in msg
    assert "config.vocab_size" not in msg and "__call__" not in msg
    assert not isinstance(_NoCache(), pj.PagedDecoder)


# ---------------------------------------------- issue 51, item 4: the guide's rules, checked
def _example_decoder():
    return runpy.run_path(str(EXAMPLES / "nnx_decoder.py"))


class _Variant:
    """The example decoder with one rule of the guide broken (or, ``"as written"``, its
    ``make_cache`` passing ``dtype`` straight through, as the guide's recipe writes it)."""

    def __new__(cls, how: str):
        ns = _example_decoder()
        base = ns["Decoder"]

        class Variant(base):
            def make_cache(self, num_pages, page_size, dtype=None):
                c = self.config
                return pj.PagedKVCache.create(
                    c.layers, num_pages, page_size, c.kv_heads, c.dim // c.heads, dtype
                )

            def __call__(self, tokens, positions, cache, metadata):
                if how == "as written":
                    return super().__call__(tokens, positions, cache, metadata)
                x = self.embed(tokens) + self.pos(positions)
                for i, block in enumerate(self.blocks):

                    def attend(q, k, v, i=i):
                        nonlocal cache
                        o, cache = pj.paged_self_attention(q, k, v, cache, i, metadata)
                        return o

                    x = block(x, attend)
                if how == "every row":
                    return self.head(x), cache
                return self.head(x[metadata.logits_indices])  # "logits only"

        return Variant(ns["Config"](), nnx.Rngs(0))


def test_the_guides_make_cache_recipe_works_as_written():
    """``LLM`` calls ``make_cache(..., dtype=None)``; ``PagedKVCache.create`` read None as
    float64 and refused it."""
    llm = pj.LLM(_Variant("as written"), num_pages=32, page_size=8, compilation_cache=False)
    assert llm.cache.kv_pages.dtype == jnp.float32
    out = llm.generate([[1, 2, 3]], pj.SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.failing_steps
@pytest.mark.parametrize(
    "how, message",
    [
        ("every row", "one row per entry of metadata.logits_indices"),
        ("logits only", "must return (logits, cache)"),
    ],
)
def test_a_model_that_breaks_the_contract_is_named_at_the_first_step(how, message):
    """Logits of every row used to give wrong tokens silently; logits alone failed with
    "too many values to unpack". Both now stop the engine at its first step, naming the
    rule, instead of being retried and blamed on requests."""
    llm = pj.LLM(_Variant(how), num_pages=32, page_size=8, compilation_cache=False)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [4, 5]]
    with pytest.raises(ModelContractError, match=re.escape(message)):
        llm.generate(prompts, pj.SamplingParams(max_tokens=3), progress=False)
    assert isinstance(llm.failure, ModelContractError)


def test_llm_takes_a_model_name_or_path_as_vllm_does(tmp_path):
    from test_gguf import _model, write_gguf

    llm = pj.LLM("tiny-llama", num_pages=16, page_size=8, compilation_cache=False)
    assert llm.tokenizer is not None
    out = llm.generate(["hi"], pj.SamplingParams(max_tokens=2), progress=False)
    assert len(out[0].outputs[0].token_ids) == 2
    path = tmp_path / "m.gguf"
    write_gguf(path, _model())
    llm = pj.LLM(path, num_pages=16, page_size=8, compilation_cache=False)
    assert llm.model.config.vocab_size == 300 and llm.tokenizer is not None
