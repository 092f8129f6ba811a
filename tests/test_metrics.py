"""The engine's counters on their own: what ``record_step`` adds for a step call."""

import pytest

from paged_jax.block_manager import BlockManager
from paged_jax.engine.metrics import EngineMetrics, record_step
from paged_jax.engine.scheduler import Scheduler

P = 4


def test_record_step_adds_a_calls_time_and_the_pools_state():
    bm = BlockManager(16, P, watermark=0.0)
    sc = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, preemption="recompute")
    bm.allocate("a", list(range(6)))  # 2 pages, 6 of 8 slots hold a token
    bm.allocate("b", list(range(6)))  # no hit: a's pages are not computed yet
    m = EngineMetrics(step_s=0.5, compile_s=0.25)
    record_step(m, 1.0, 2, [sc], P, full=False)
    assert (m.steps, m.elapsed_s, m.host_s) == (2, 1.0, 0.25)  # host: the rest
    assert m.max_pages_used == 4 and m.kv_samples == 0  # no recount
    bm.free("b")
    record_step(m, 1.0, 1, [sc], P, full=True)
    assert m.max_pages_used == 4  # a peak
    assert m.kv_samples == 1 and m.kv_utilization_sum == pytest.approx(6 / 8)
    assert m.summary()["steps"] == 3 and m.preemptions_swap == 0


def test_rates_leave_out_the_time_spent_compiling():
    # Issue 87, item 4: a first --speculative ngram run reported 7.1 tok/s against 17.8
    # without it (34.9 on its second run): the rate divided by a wall time that was mostly
    # compiling. Now rates are per second of running; the compile time is a line of its own.
    m = EngineMetrics(elapsed_s=10.0, compile_s=8.0, tokens_generated=100, tokens_computed=300)
    m.requests_finished, m.compile_tokens = 4, 10  # (the compiling steps' own tokens)
    s = m.summary()
    assert s["tokens/s (generated)"] == pytest.approx(45.0)
    assert s["tokens/s (computed)"] == pytest.approx(150.0)
    assert s["requests/s"] == pytest.approx(2.0)
    assert (s["wall time (s)"], s["compile time (s)"]) == (10.0, 8.0)


def test_an_engine_counts_the_compiling_steps_tokens_apart():
    import paged_jax as pj
    from paged_jax import models

    llm = pj.LLM(*models.load("tiny-llama"), num_pages=57, compilation_cache=False)
    params = pj.SamplingParams(max_tokens=24, ignore_eos=True)
    llm.generate([[1, 2, 3], [4, 5]], params, progress=False)
    m = llm.metrics
    assert m.compilations > 0 and 0 < m.compile_tokens < m.tokens_generated == 48
    assert m.compile_s > 0 and m.running_s == pytest.approx(m.elapsed_s - m.compile_s)
    rate = m.summary()["tokens/s (generated)"]
    assert rate == pytest.approx((48 - m.compile_tokens) / m.running_s)
