"""The scheduler's one-pass decode of the leading decoding groups
(``Scheduler._decode_prefix``) against its general loop (``_running_groups``) taking
every group: the same schedules, step after step, and the same outputs,
with every kind of request, a tight pool (recompute and swap preemptions) and overlapped
steps (speculative schedules). The block manager's ``append_tokens``, which that pass
uses, has its unit tests and a stateful rule in ``test_block_manager.py``."""

import pytest
from paged_cases import grid_case
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


_POOLS = {
    "roomy": dict(),
    "recompute": dict(num_pages=12, watermark=0.0),  # recompute preemptions
    "swap": dict(num_pages=14, preemption="swap", num_host_pages=64, watermark=0.0),
    "small-budgets": dict(max_num_seqs=3, max_num_batched_tokens=4),  # cut the decode pass
}


# Each pool one way by default, two each way; both ways for every pool: -m slow.
@pytest.mark.parametrize(
    "overlapped, pool",
    [
        grid_case(
            overlapped, pool, id=f"{overlapped}-{name}", by_default=overlapped == (i % 2 == 0)
        )
        for overlapped in (False, True)
        for i, (name, pool) in enumerate(_POOLS.items())
    ],
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


def test_token_log_rows_reach_their_sequences_in_order_when_read():
    """A TokenLog holds several launches' samples for its rows; a sequence reads its own
    (and its log-prob sum) when its tokens are read, in order with tokens appended to it
    directly between launches, and moves them over before it joins another log."""
    import numpy as np

    from paged_jax.engine.request import Seq, TokenLog

    rng = np.random.default_rng(0)
    seqs = [Seq(f"s{i}", [i] * 3, 3, 0) for i in range(5)]
    log = TokenLog(5)
    for i, s in enumerate(seqs):
        s.attach(log, i)
    want = [list(s.tokens) for s in seqs]
    a = rng.integers(0, 1000, (5, 4)).astype(np.int32)
    log.add(np.arange(5), a, np.full(5, 4), np.arange(5, dtype=np.float64))
    for i in range(5):
        want[i] += a[i].tolist()
    seqs[2].tokens.append(77)  # a token appended directly (the per-row path)
    want[2].append(77)
    b = rng.integers(0, 1000, (3, 12)).astype(np.int32)  # rows 4, 0, 2: other counts
    log.add(np.array([4, 0, 2]), b, np.array([12, 1, 7]), np.array([-1.0, -2.0, -3.0]))
    for i, k, row in ((4, 12, 0), (0, 1, 1), (2, 7, 2)):
        want[i] += b[row, :k].tolist()
    assert log.toks.shape[1] == 16 and log.count.tolist() == [5, 4, 11, 4, 16]
    c = rng.integers(0, 1000, (1, 3)).astype(np.int32)
    log.add(np.array([4]), c, np.array([3]), np.array([-9.0]))  # past 16 columns: widens
    want[4] += c[0].tolist()
    assert [s.tokens for s in seqs] == want
    assert [s.cum_logprob for s in seqs] == [-2.0, 1.0, -3.0, 3.0, -9.0]
    assert seqs[3].output == a[3].tolist()
    other = TokenLog(1)
    d = np.array([[5, 6]], np.int32)
    log.add(np.array([1]), d, np.array([2]), np.array([0.5]))
    seqs[1].attach(other, 0)  # row 1's waiting tokens move over first
    other.add(np.array([0]), d[:, ::-1].copy(), np.array([2]), np.array([0.25]))
    assert seqs[1].tokens == want[1] + [5, 6, 6, 5] and seqs[1].cum_logprob == 0.25
    seqs[0].cum_logprob = 4.0  # set directly: kept until the log adds to its row
    log.add(np.array([3]), d, np.array([1]), np.array([7.0]))
    assert seqs[0].cum_logprob == 4.0 and seqs[3].cum_logprob == 7.0
