"""The model runner on its own: a batch from a block manager goes in, the model's greedy
tokens come out; shape buckets compile once; swap page copies round-trip; the pool's
size is checked against the memory at hand."""

import numpy as np
import pytest
from model_helpers import dense_logits

import paged_jax as pj
from paged_jax import models
from paged_jax.engine.runner import ModelRunner
from paged_jax.engine.step_types import SamplingColumns, StepInputs

PAGE = 8


def _runner(model, **kw):
    args = dict(
        mesh=None,
        page_size=PAGE,
        num_pages=32,
        kv_cache_bytes=None,
        cache_dtype=None,
        hybrid_kv_cache=None,
        max_num_seqs=8,
        deterministic=False,
    )
    args.update(kw)
    return ModelRunner(model, **args)


def test_a_prefill_batch_gives_the_models_greedy_tokens():
    model, _ = models.load("tiny-llama")
    runner = _runner(model)
    bm = pj.BlockManager(runner.num_pages, PAGE, watermark=0.0)
    prompts = {"a": [5, 17, 99, 3], "b": list(range(40, 61))}
    for sid, ids in prompts.items():
        bm.allocate(sid, ids)
    batch = pj.build_batch(bm, [pj.ScheduledSeq(s, 0, len(ids)) for s, ids in prompts.items()])
    S_b = batch.kv_lens.shape[0]
    inputs = StepInputs(batch, batch.token_ids, SamplingColumns.idle(S_b))  # greedy rows
    d = runner.launch(inputs)
    out = d.outputs.read()
    toks = out.tokens[:, 0]
    assert d.outputs.last is None and d.compiled and d.seconds > 0
    assert out.candidates is None and out.scores is None
    for row, ids in enumerate(prompts.values()):
        assert toks[row] == int(np.argmax(dense_logits(runner.model, ids)[-1]))
    # the same shape again: no compile, and the bucket was recorded once
    assert not runner.launch(inputs).compiled and len(runner.compiled_buckets) == 1
    bucket = runner.compiled_buckets[0]
    assert (bucket["tokens"], bucket["seqs"]) == (batch.token_ids.shape[0], S_b)


def test_swap_copies_round_trip_through_the_host():
    model, _ = models.load("tiny-llama")
    runner = _runner(model, num_pages=16)
    shape = runner.cache.kv_pages.shape  # [L, N, P, 2K, D]
    rng = np.random.default_rng(0)
    pages = np.array([3, 7, 0, 0], np.int32)  # two pages, padded with the null page
    data = rng.normal(size=(shape[0], 4) + shape[2:]).astype(np.float32)
    data[:, 2:] = 0  # what padding writes to the null page
    runner.write_pages(pages, data, None)
    back, scales = runner.read_pages(np.array([7, 3], np.int32))
    assert scales is None
    np.testing.assert_array_equal(back[:, 0], data[:, 1])
    np.testing.assert_array_equal(back[:, 1], data[:, 0])


def test_the_pool_is_checked_against_the_memory_at_hand(monkeypatch):
    from paged_jax.engine import devices

    model, _ = models.load("tiny-llama")
    monkeypatch.setattr(devices, "_free_memory", lambda: (2**20, "this machine"))
    with pytest.raises(
        ValueError,
        match=r"num_pages: 4096 pages of 8 tokens need .* this machine has 0\.00 GiB free",
    ):
        _runner(model, num_pages=4096)
    with pytest.raises(ValueError, match="num_pages: expected an int >= 2"):
        _runner(model, num_pages=1)
    with pytest.raises(TypeError, match="hybrid_kv_cache: expected a bool or None, got 'x'"):
        _runner(model, hybrid_kv_cache="x")
