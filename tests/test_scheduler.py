"""The scheduler's one-pass decode step (``Scheduler._decode_all``) against its general
loop (``_running_groups``): the same schedules, step after step, and the same outputs,
with every kind of request, a tight pool (recompute and swap preemptions) and overlapped
steps (speculative schedules). The block manager's ``append_tokens``, which that pass
uses, has its unit tests and a stateful rule in ``test_block_manager.py``."""

import pytest

import paged_jax as pj
from paged_jax.engine.scheduler import Scheduler
from tests.test_overlap import _engine, _requests, _summary

_SCHEDULE, _DECODE_ALL = Scheduler.schedule, Scheduler._decode_all


def _run(monkeypatch, fast: bool, overlapped: bool, pool: dict):
    """Outputs, every step's schedule, and how often the one-pass decode took the step."""
    steps, taken = [], []

    def schedule(self, **kw):
        sched = _SCHEDULE(self, **kw)
        steps.append(
            (
                [(w.seq.seq_id, w.start, w.stop, w.sample) for w in sched.work],
                list(sched.swap_out),
                list(sched.swap_in),
                [(g.request_id, how) for g, how in sched.preempted],
                sched.stalled,
            )
        )
        return sched

    def decode_all(self, sched, speculative):
        left = _DECODE_ALL(self, sched, speculative) if fast else None
        taken.append(left is not None)
        return left

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    monkeypatch.setattr(Scheduler, "_decode_all", decode_all)
    prompts, params = _requests(stop_token=5)
    llm = _engine(overlapped, **pool)
    outs = llm.generate(prompts, params, progress=False)
    llm.bm.check_invariants()
    assert llm.bm.stats()["pages_used"] == 0
    return _summary(outs), steps, sum(taken), llm.metrics


@pytest.mark.parametrize("overlapped", [False, True])
@pytest.mark.parametrize(
    "pool",
    [
        dict(),
        dict(num_pages=12, watermark=0.0),  # recompute preemptions
        dict(num_pages=14, preemption="swap", num_host_pages=64, watermark=0.0),
        dict(max_num_seqs=3, max_num_batched_tokens=4),  # budgets cut the decode pass
    ],
    ids=["roomy", "recompute", "swap", "small-budgets"],
)
def test_one_pass_decode_schedules_as_the_general_loop(monkeypatch, overlapped, pool):
    ref, ref_steps, _, ref_m = _run(monkeypatch, False, overlapped, pool)
    outs, steps, fast_steps, m = _run(monkeypatch, True, overlapped, pool)
    assert steps == ref_steps
    assert outs == ref
    assert fast_steps > 0  # the one-pass decode took some steps
    assert (m.preemptions_recompute, m.preemptions_swap) == (
        ref_m.preemptions_recompute,
        ref_m.preemptions_swap,
    )
    if "num_pages" in pool:  # the tight pools did preempt
        assert m.preemptions_recompute + m.preemptions_swap > 0


def test_one_pass_decode_declines_a_prefilling_group():
    """A step with a group still prefilling goes to the general loop, changing nothing."""
    llm = _engine(False)
    llm.add_request("a", [1, 2, 3], pj.SamplingParams(max_tokens=4))
    sc = llm.scheduler
    sched = sc.schedule()  # admits "a": its prompt is prefilled in this step
    assert [(w.start, w.stop) for w in sched.work] == [(0, 3)]
    before = llm.bm.stats()
    assert sc._decode_all(type(sched)([], [], [], []), False) is None
    assert llm.bm.stats() == before
