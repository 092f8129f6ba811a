"""The per-request adapter hook (issue 50, item 3; what LoRA adapters will fill): each
token of a request carries its adapter's index into the model (``adapter_ids``), rows of
other adapters in the same step are untouched, requests of different adapters share no
prefix-cache page, and a model without the argument refuses an adapter by name."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import paged_jax as pj
from paged_jax import models


class Biased(nnx.Module):
    """tiny-llama whose adapter k (> 0) adds a large logit to token k at every position
    of its requests' tokens: an adapter's outputs are all k, visibly its own."""

    def __init__(self, inner):
        self.inner = inner
        self.config = inner.config

    def make_cache(self, *args, **kw):
        return self.inner.make_cache(*args, **kw)

    def __call__(self, tokens, positions, cache, md, adapter_ids=None):
        logits, cache = self.inner(tokens, positions, cache, md)
        if adapter_ids is not None:
            ids = adapter_ids[md.logits_indices]
            bump = jnp.where(ids[:, None] > 0, 100.0, 0.0)
            logits = logits + bump * nnx.one_hot(ids, logits.shape[-1])
        return logits, cache


@pytest.fixture(scope="module")
def tiny():
    return models.load("tiny-llama")[0]


def _engine(model, **kw):
    return pj.LLM(model, num_pages=64, page_size=8, max_num_seqs=8, compilation_cache=False, **kw)


def _run(llm, requests):
    for rid, prompt, adapter in requests:
        llm.add_request(
            rid, prompt, pj.SamplingParams(max_tokens=6, ignore_eos=True), adapter=adapter
        )
    outs = {}
    while llm.has_unfinished():
        for o in llm.step():
            outs[o.request_id] = o
    return outs


def test_each_token_carries_its_requests_adapter(tiny):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in (5, 13, 9, 20)]
    plain = _engine(tiny).generate(prompts, pj.SamplingParams(max_tokens=6, ignore_eos=True),
                                   progress=False)  # fmt: skip
    llm = _engine(Biased(tiny))
    outs = _run(llm, [("a", prompts[0], 0), ("b", prompts[1], 3), ("c", prompts[2], 0),
                      ("d", prompts[3], 7)])  # fmt: skip
    assert outs["a"].outputs[0].token_ids == plain[0].outputs[0].token_ids  # base rows alike
    assert outs["c"].outputs[0].token_ids == plain[2].outputs[0].token_ids
    assert outs["b"].outputs[0].token_ids == [3] * 6
    assert outs["d"].outputs[0].token_ids == [7] * 6
    assert llm.bm.stats()["pages_used"] == 0


def test_adapters_share_no_prefix_cache_page(tiny):
    llm = _engine(Biased(tiny))
    prompt = list(range(1, 34))  # 4 full pages
    first = _run(llm, [("x", prompt, 0)])["x"]
    again = _run(llm, [("y", prompt, 0)])["y"]
    other = _run(llm, [("z", prompt, 5)])["z"]
    assert first.metrics.num_cached_tokens == 0 and again.metrics.num_cached_tokens == 32
    assert other.metrics.num_cached_tokens == 0  # another adapter: its own K/V


def test_adapter_is_refused_by_a_model_without_adapters(tiny):
    # (paged_jax.models' decoders take adapter_ids, and have adapters once given LoRA
    # slots: LLM(max_loras=N))
    llm = _engine(tiny)
    with pytest.raises(ValueError, match="adapter: 2, but the model has no LoRA slots"):
        llm.add_request("r", [1, 2], adapter=2)
    with pytest.raises(TypeError, match="adapter: expected an int >= 0"):
        llm.add_request("r", [1, 2], adapter=-1)
    assert not llm.has_unfinished()
