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
