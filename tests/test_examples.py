"""examples/: decoders written from scratch (NNX and Linen) served by LLM give the greedy
tokens of the same model run without a cache; the engine names what a model lacks."""

import ast
import contextlib
import io
import pathlib
import runpy

import pytest
from flax import nnx

import paged_jax as pj

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
