"""Priority scheduling (``LLM(scheduling_policy="priority")``, ``add_request(priority=)``;
vLLM's sense: lower values first): the queues' order, the victims of preemption, a
waiting request of a higher priority making room, and an overloaded engine that loses
nothing and changes no token."""

import numpy as np
import pytest

import paged_jax as pj
from paged_jax import models
from paged_jax.block_manager import BlockManager
from paged_jax.engine.request import Group, Seq, Status
from paged_jax.engine.sampling import SamplingParams
from paged_jax.engine.scheduler import Scheduler


def _group(arrival: int, priority: int, tokens: int = 8) -> Group:
    ids = [100 * arrival + i for i in range(tokens)]  # (no prefix shared between groups)
    g = Group(arrival, arrival, ids, SamplingParams(max_tokens=4), 0, None, 0.0)
    g.priority = priority
    g.seqs.append(Seq(f"{arrival}/0", list(ids), tokens, 0))
    return g


def test_queues_follow_priority_then_arrival():
    sc = Scheduler(
        BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64, preemption="recompute",
        policy="priority",
    )  # fmt: skip
    for arrival, priority in [(0, 5), (1, 0), (2, 5), (3, -2), (4, 0)]:
        sc.add(_group(arrival, priority))
    assert [g.arrival for g in sc.waiting] == [3, 1, 4, 0, 2]
    fcfs = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64,
                     preemption="recompute")  # fmt: skip
    for arrival, priority in [(0, 5), (1, 0), (2, 5)]:
        fcfs.add(_group(arrival, priority))
    assert [g.arrival for g in fcfs.waiting] == [0, 1, 2]


def test_a_waiting_request_of_higher_priority_preempts_the_lowest_running_one():
    # 8 pages of 4 tokens (and the null page): two running groups of 12 tokens (3 pages
    # each, priorities 1 and 7) leave 2 free; a waiting group of 16 tokens (4 pages) of
    # priority 0 preempts the lowest running one (7), not the other, then runs. One of
    # priority 9 preempts no one.
    sc = Scheduler(
        BlockManager(9, 4, watermark=0.0), max_num_seqs=8, max_num_batched_tokens=64,
        preemption="recompute", policy="priority",
    )  # fmt: skip
    high, low = _group(0, 1, 12), _group(1, 7, 12)
    sc.add(high)
    sc.add(low)
    sc.schedule()  # both admitted, their prompts computed
    for g in (high, low):
        sc.bm.mark_computed(g.seqs[0].seq_id, 12)
    assert [g.arrival for g in sc.running] == [0, 1]
    sc.add(_group(2, 9, 16))
    sched = sc.schedule()
    assert not sched.preempted and low.status is Status.RUNNING
    urgent = _group(3, 0, 16)
    sc.add(urgent)
    sched = sc.schedule()
    assert [(g.arrival, how) for g, how in sched.preempted] == [(1, "recompute")]
    assert high.status is Status.RUNNING and low.status is Status.WAITING
    sc.schedule()  # (the step after: the room made is taken)
    assert urgent.status is Status.RUNNING
    assert [g.arrival for g in sc.waiting] == [1, 2]  # priority 7, then 9


def test_an_overloaded_engine_runs_the_high_priority_requests_first_and_loses_nothing():
    """Twelve requests on a pool that holds a few at a time (23 pages of 8 tokens, a
    request up to 8), the last two urgent (priority 0): every request finishes with the
    tokens an FCFS engine gives, no urgent request is preempted (the others are), and the
    urgent ones finish before the others on average."""
    model, _ = models.load("tiny-llama")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 256, int(rng.integers(20, 40))).tolist() for _ in range(12)]
    params = pj.SamplingParams(max_tokens=24, ignore_eos=True)
    kw = dict(num_pages=24, page_size=8, max_num_seqs=8, max_num_batched_tokens=64)
    kw |= dict(watermark=0.0, compilation_cache=False)
    want = pj.LLM(model, **kw).generate(prompts, params, progress=False)
    llm = pj.LLM(model, scheduling_policy="priority", **kw)
    priority = [5] * 10 + [0] * 2  # the urgent ones arrive last
    for i, p in enumerate(prompts):
        llm.add_request(i, p, params, priority=priority[i])
    done, order = {}, []
    while llm.has_unfinished():
        for o in llm.step():
            done[o.request_id] = o
            order.append(o.request_id)
    assert sorted(done) == list(range(12))
    for i, w in enumerate(want):
        assert done[i].outputs[0].token_ids == w.outputs[0].token_ids, i
    assert llm.metrics.preemptions_recompute > 0
    assert all(done[i].metrics.num_preemptions == 0 for i in (10, 11))
    assert any(done[i].metrics.num_preemptions > 0 for i in range(10))
    rank = {rid: k for k, rid in enumerate(order)}
    assert np.mean([rank[i] for i in (10, 11)]) < np.mean([rank[i] for i in range(10)])
    assert llm.bm.stats()["pages_used"] == 0
    llm.bm.check_invariants()


def test_priority_is_checked_and_needs_the_priority_policy():
    model, _ = models.load("tiny-llama")
    with pytest.raises(ValueError, match="scheduling_policy: expected one of"):
        pj.LLM(model, num_pages=16, scheduling_policy="lottery", compilation_cache=False)
    fcfs = pj.LLM(model, num_pages=16, compilation_cache=False)
    with pytest.raises(ValueError, match="priority: 3 needs scheduling_policy='priority'"):
        fcfs.add_request("a", [1, 2, 3], priority=3)
    prio = pj.LLM(model, num_pages=16, scheduling_policy="priority", compilation_cache=False)
    with pytest.raises(TypeError, match="priority: expected an int, got 1.5"):
        prio.add_request("a", [1, 2, 3], priority=1.5)
    assert not prio.has_unfinished() and not fcfs.has_unfinished()
