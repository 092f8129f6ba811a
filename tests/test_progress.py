"""generate()'s progress bar: generated tokens against the requests' budget (less what
requests that stopped early left), finished requests, tokens/s, and the step shape being
compiled."""

import re

import paged_jax as pj
from paged_jax import models
from paged_jax.engine import metrics as engine_metrics

SHAPE = re.compile(r"\d+ tokens x \d+ sequences x \d+ pages \(once per shape\)")


def test_the_bar_counts_tokens_and_ends_full_when_requests_stop_early(capsys, monkeypatch):
    told = []
    monkeypatch.setattr(engine_metrics.Progress, "compiling", lambda self, what: told.append(what))
    llm = pj.LLM(*models.load("tiny-llama"), num_pages=64, page_size=16, max_num_seqs=8)
    params = [
        pj.SamplingParams(max_tokens=12, ignore_eos=True, n=2, temperature=0.8, seed=1),
        pj.SamplingParams(max_tokens=9, stop_token_ids=list(range(320))),  # stops at once
    ]
    outs = llm.generate(["Hello", "Paged"], params, progress=True)
    assert [len(o.outputs[0].token_ids) for o in outs] == [12, 1]
    text = capsys.readouterr().out
    # budget: 12 x 2 samples + 9; the early stop's unused 8 leave the total, so the bar
    # ends full at the tokens generated (it showed 33/33 for 25 before: issue 87, item 6)
    assert re.search(r"25/25 tokens\s+2/2 requests, \d+ tok/s", text), text
    assert "33/33" not in text
    # every new step shape was announced before it ran, once
    assert told and all(SHAPE.fullmatch(w) for w in told), told
    assert len(told) == len(set(told))
    told.clear()
    llm.generate(["Hello", "Paged"], params, progress=True)
    assert told == []  # the same shapes again: nothing to announce
