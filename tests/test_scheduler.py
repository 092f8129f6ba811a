"""The scheduler's one-pass decode of the leading decoding groups
(``Scheduler._decode_prefix``) against its general loop (``_running_groups``) taking
every group: the same schedules, step after step, and the same outputs,
with every kind of request, a tight pool (recompute and swap preemptions) and overlapped
steps (speculative schedules). The block manager's ``append_tokens``, which that pass
uses, has its unit tests and a stateful rule in ``test_block_manager.py``."""

import pytest
from test_overlap import _engine, _requests, _summary

import paged_jax as pj
from paged_jax.engine.scheduler import Scheduler

_SCHEDULE, _DECODE_PREFIX = Scheduler.schedule, Scheduler._decode_prefix


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

    def decode_prefix(self, groups, sched, speculative):
        took = _DECODE_PREFIX(self, groups, sched, speculative) if fast else None
        taken.append(took is not None and took[0] > 0)
        return took

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    monkeypatch.setattr(Scheduler, "_decode_prefix", decode_prefix)
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


def test_the_one_pass_decode_takes_the_decoders_ahead_of_a_new_prompt(monkeypatch):
    """In a step that admits a prompt, the running groups decode in one pass and the
    general loop prefills the newcomer after them."""
    llm = _engine(False)
    for rid, prompt in (("a", [1, 2, 3]), ("b", [4, 5])):
        llm.add_request(rid, prompt, pj.SamplingParams(max_tokens=6, ignore_eos=True))
    llm.step()  # both prompts, and their first tokens
    llm.add_request("c", list(range(30)), pj.SamplingParams(max_tokens=4, ignore_eos=True))
    seen = []

    def schedule(self, **kw):
        sched = _SCHEDULE(self, **kw)
        seen.append([(w.group.request_id, w.stop - w.start) for w in sched.work])
        return sched

    def decode_prefix(self, groups, sched, speculative):
        took = _DECODE_PREFIX(self, groups, sched, speculative)
        seen.append(took)
        return took

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    monkeypatch.setattr(Scheduler, "_decode_prefix", decode_prefix)
    llm.step()
    assert seen == [(2, 64 - 2, 8 - 2, False), [("a", 1), ("b", 1), ("c", 30)]]
