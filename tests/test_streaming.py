"""Stop strings (SamplingParams.stop) and LLM.stream's incremental text."""

import re

import pytest
from test_gguf import spm_tokenizer

import paged_jax as pj
from paged_jax import models
from paged_jax.engine.request import Seq

PROMPTS = ["Hello there", "Paged attention", "Once upon"]


def _engine():
    return pj.LLM(*models.load("tiny-llama"), num_pages=64, page_size=16, max_num_seqs=8)


def _texts(llm, params):
    return [o.outputs[0] for o in llm.generate(PROMPTS, params, progress=False)]


def test_stop_strings_cut_the_text_across_token_boundaries():
    llm = _engine()
    free = _texts(llm, pj.SamplingParams(max_tokens=40, ignore_eos=True))
    for out in free:
        text = out.text
        # a 3-character ASCII stop string past the start (each token is one byte here, so
        # it always spans 3 tokens); its first occurrence is where the text must end
        found = re.search(r"[ -~]{3}", text[2:])
        assert found, repr(text)
        cut = found.group()
        first = text.find(cut)
        for include in (False, True):
            p = pj.SamplingParams(
                max_tokens=40,
                ignore_eos=True,
                stop=[cut, "never-there"],
                include_stop_str_in_output=include,
            )
            got = llm.generate([out_prompt(free, out)], p, progress=False)[0].outputs[0]
            assert got.finish_reason == "stop"
            assert got.text == text[: first + (3 if include else 0)]
            # token ids: every token up to the one that completed the stop string
            assert got.token_ids == out.token_ids[: len(got.token_ids)]
            assert llm.decode(got.token_ids).endswith(cut)
            assert not llm.decode(got.token_ids[:-1]).endswith(cut)


def out_prompt(free, out):
    return PROMPTS[free.index(out)]


def test_stop_strings_are_checked_where_requests_enter():
    with pytest.raises(ValueError, match="stop: expected a string or a list of non-empty"):
        pj.SamplingParams(stop=[""])
    with pytest.raises(ValueError, match="stop: not supported with beam search"):
        pj.SamplingParams(stop="x", beam_width=2)
    assert pj.SamplingParams(stop="ab").stop == ("ab",)
    model, _ = models.load("tiny-llama")
    llm = pj.LLM(model, None, num_pages=16)
    with pytest.raises(ValueError, match="params.stop: stop strings need a tokenizer"):
        llm.add_request("a", [1, 2], pj.SamplingParams(stop="x"))


@pytest.mark.parametrize(
    "params",
    [
        pj.SamplingParams(max_tokens=24, ignore_eos=True),
        pj.SamplingParams(max_tokens=24, temperature=1.0, seed=3, n=2, ignore_eos=True),
        pj.SamplingParams(max_tokens=24, ignore_eos=True, stop=["e", "zz"]),
    ],
    ids=["greedy", "n2", "stop"],
)
def test_stream_deltas_join_into_generate_text(params):
    want = [
        [c.text for c in o.outputs] for o in _engine().generate(PROMPTS, params, progress=False)
    ]
    llm = _engine()
    got = {}
    last = {}
    for piece in llm.stream(PROMPTS, params):
        key = (piece.index, piece.sample)
        assert key not in last, "a sample yielded after its last piece"
        got[key] = got.get(key, "") + piece.text
        if piece.finished:
            last[key] = piece.finish_reason
    assert {k: v for k, v in got.items()} == {
        (i, j): t for i, texts in enumerate(want) for j, t in enumerate(texts)
    }
    assert len(last) == sum(len(w) for w in want)
    assert not llm.has_unfinished()


def test_incremental_text_never_splits_a_character():
    """UTF-8 bytes of emoji and CJK text arrive one token (byte) at a time: the settled
    text only ever grows by whole characters."""
    llm = _engine()
    target = "日本語 😀 ok ü".encode()
    seq = Seq("s", [256], 1, 0)
    seen = ""
    for b in target:
        seq.tokens.append(b)
        text = llm.outputs.settled_text(seq, ())
        assert text.startswith(seen) and "\ufffd" not in text
        seen = text
    assert seen == "日本語 😀 ok ü"
    # a stop string's possible beginning is held back
    seq = Seq("s", [256, *b"abcEN"], 1, 0)
    assert llm.outputs.settled_text(seq, ("END",)) == "abc"


def test_incremental_text_of_sentencepiece_words_and_byte_fallback(tmp_path):
    """Word pieces ("▁hello") and byte-fallback tokens (the emoji's 4 bytes): decoded one
    by one they would lose spaces or show replacement characters; the settled text is
    always a prefix of the whole text and ends equal to it."""
    tok = spm_tokenizer(tmp_path / "spm.gguf")
    llm = pj.LLM(models.load("tiny-llama")[0], tok, num_pages=16)
    ids = tok.encode("hello world 😀 hello", add_special_tokens=False).ids
    whole = tok.decode(ids)
    assert whole == "hello world 😀 hello"
    assert "".join(tok.decode([i]) for i in ids) != whole  # why per-token decoding fails
    seq, seen = Seq("s", [1], 1, 0), ""
    for i in ids:
        seq.tokens.append(i)
        text = llm.outputs.settled_text(seq, ())
        assert whole.startswith(text) and text.startswith(seen), (seen, text)
        seen = text
    assert seen == whole


def test_closing_a_stream_early_aborts_its_requests():
    llm = _engine()
    it = llm.stream(PROMPTS, pj.SamplingParams(max_tokens=50, ignore_eos=True))
    next(it)
    it.close()
    assert not llm.has_unfinished()
    with pytest.raises(ValueError, match=r"sampling_params\[0\]: beam search cannot be streamed"):
        next(llm.stream(["a"], pj.SamplingParams(beam_width=2)))


def test_a_stream_keeps_other_requests_outputs_for_step():
    """Requests added with add_request that finish during a stream come out of the next
    step() call, not lost inside the stream."""
    llm = _engine()
    llm.add_request("mine", [256, 5, 6], pj.SamplingParams(max_tokens=2, ignore_eos=True))
    pieces = list(llm.stream(["Hello"], pj.SamplingParams(max_tokens=8, ignore_eos=True)))
    assert pieces[-1].finished
    assert [o.request_id for o in llm.step()] == ["mine"]


def test_each_step_pushes_the_streamed_requests_pieces_and_token_counts():
    # Issue 82, item 3: streams were polled (the server asked every live request for its
    # count and text deltas after each step, keeping what it had sent itself); now the
    # engine pushes them: step() returns each streamed request's new text and tokens.
    llm = _engine()
    p = pj.SamplingParams(max_tokens=12, ignore_eos=True, n=2, temperature=0.9, seed=3)
    want = llm.generate(PROMPTS[:2], p, progress=False)
    llm.add_request("text", PROMPTS[0], p, stream=True)
    llm.add_request("counts", PROMPTS[1], p, stream="tokens")
    llm.add_request("plain", PROMPTS[1], p)
    text, tokens, counts, finished = {}, {}, {}, {}
    while llm.has_unfinished():
        res = llm.step()
        assert set(res.new_tokens) <= {"text", "counts"}
        assert all(piece.request_id == "text" for piece in res.streamed)
        for rid, n in res.new_tokens.items():
            counts[rid] = counts.get(rid, 0) + n
        for piece in res.streamed:
            text[piece.sample] = text.get(piece.sample, "") + piece.text
            tokens[piece.sample] = tokens.get(piece.sample, []) + piece.token_ids
            assert piece.finished == (piece.output is not None)
        finished.update((o.request_id, o) for o in res)
    assert set(finished) == {"text", "counts", "plain"}
    for c in finished["text"].outputs:  # the pieces join into the output, text and tokens
        assert text[c.index] == c.text and tokens[c.index] == c.token_ids
    assert [c.token_ids for c in finished["text"].outputs] == [c.token_ids for c in want[0].outputs]
    assert counts == {"text": 24, "counts": 24}  # every token counted once, both samples
    with pytest.raises(ValueError, match="stream: expected False, True or 'tokens'"):
        llm.add_request("x", PROMPTS[0], p, stream="text")


def test_an_aborted_stream_pushes_nothing_more():
    llm = _engine()
    p = pj.SamplingParams(max_tokens=30, ignore_eos=True)
    llm.add_request("a", PROMPTS[0], p, stream=True)
    llm.add_request("b", PROMPTS[1], p, stream=True)
    llm.step()
    llm.abort("a")
    seen = set()
    while llm.has_unfinished():
        res = llm.step()
        seen |= {piece.request_id for piece in res.streamed} | set(res.new_tokens)
    assert seen == {"b"}
