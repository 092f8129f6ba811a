"""The engine's output processor on its own (host only): finish reasons, stop strings,
settled text for streaming, and ``RequestOutput``s, on hand-made sequences."""

import pytest

from paged_jax.engine.outputs import OutputProcessor
from paged_jax.engine.request import Group, Seq, Status
from paged_jax.engine.sampling import SamplingParams


class Letters:
    """Token t is the letter chr(97 + t); 26 is half a character (a replacement one)."""

    def decode(self, ids):
        return "".join("\ufffd" if t == 26 else chr(97 + t) for t in ids)


EOS = 25  # "z"


def _proc(max_model_len=64):
    return OutputProcessor(Letters(), {EOS}, max_model_len)


def _seq(prompt, output=(), index=0, **kw):
    return Seq(f"s{index}", list(prompt) + list(output), len(prompt), index, **kw)


def _grown(proc, p, prompt, tokens):
    """``tokens`` appended one by one as the core does; (the sequence, each reason)."""
    s = _seq(prompt)
    reasons = []
    for t in tokens:
        s.tokens.append(t)
        reasons.append(proc.finish_reason(s, p, t))
    return s, reasons


def test_finish_reasons_stop_tokens_eos_and_lengths():
    proc = _proc(max_model_len=8)
    p = SamplingParams(max_tokens=4, stop_token_ids=(3,))
    assert _grown(proc, p, [0], [1, 3])[1] == [None, "stop"]  # a stop token
    assert _grown(proc, p, [0], [1, EOS])[1] == [None, "stop"]  # the model's end
    ignore = SamplingParams(max_tokens=4, ignore_eos=True)
    assert _grown(proc, ignore, [0], [EOS, 1, 2, 4])[1] == [None, None, None, "length"]
    # the model's length (8) comes before max_tokens (4 after a 6-token prompt: 10)
    assert _grown(proc, p, range(6), [1, 2])[1] == [None, "length"]


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_across_tokens_cuts_the_text(include):
    proc = _proc()
    p = SamplingParams(max_tokens=20, stop=("cd", "xyz"), include_stop_str_in_output=include)
    s, reasons = _grown(proc, p, [0], [0, 1, 2, 3])  # "abcd": "cd" ends at the 4th token
    assert reasons == [None, None, None, "stop"]
    assert s.stop_text == ("abcd" if include else "ab")


def _trained_tokenizers():
    """Two small tokenizers trained here: byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen)
    and SentencePiece-style BPE with byte fallback, whose decoder strips the text's first
    space (Llama 2, Mistral, Gemma); byte tokens are special there, so they decode to
    nothing when special tokens are skipped."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    corpus = [
        "The quick brown fox jumps over the lazy dog. It's 3.14!",
        "naïve café, 東京 → ünïcödé 🙂",
        "def f(x):\n    return x + 1\n",
    ] * 20
    byte = Tokenizer(models.BPE())
    byte.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet, show_progress=False)
    )
    spm = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    spm.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    spm.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    special = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    spm.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=500, special_tokens=special, show_progress=False)
    )
    return corpus, {"byte-level": byte, "sentencepiece": spm}


def test_incremental_text_is_the_whole_decode_after_every_token():
    # Random ids (partial UTF-8, skipped special tokens, stripped spaces at a window's
    # start) and real encodings, token by token: the incremental text equals decoding
    # every id each time, with each update decoding a few ids, not the whole list.
    import numpy as np

    from paged_jax.engine.outputs import IncrementalText

    corpus, tokenizers = _trained_tokenizers()
    rng = np.random.default_rng(0)
    for name, tok in tokenizers.items():
        decoded = 0

        def decode(ids, tok=tok):
            nonlocal decoded
            decoded += len(ids)
            return tok.decode(ids)

        total = 0
        for trial in range(200):
            if trial % 2:
                ids = tok.encode(corpus[trial % 3][: rng.integers(1, 60)]).ids
            else:
                ids = rng.integers(0, tok.get_vocab_size(), rng.integers(1, 40)).tolist()
            st = IncrementalText()
            for n in range(1, len(ids) + 1):
                assert st.update(decode, ids[:n]) == tok.decode(ids[:n]), (name, ids[:n])
            total += len(ids)
        assert decoded < 12 * total, (name, decoded, total)  # whole decodes: ~20x


def test_stop_strings_cost_per_token_does_not_grow_with_the_output():
    # 300 tokens with 64 stop strings that never match: the ids decoded over the whole
    # output stay linear in its length (decoding the output twice per token, as before,
    # is 90,000), and the stop strings are bounded.
    class Counting(Letters):
        decoded = 0

        def decode(self, ids):
            Counting.decoded += len(ids)
            return super().decode(ids)

    proc = OutputProcessor(Counting(), {EOS}, 1000)
    stops = tuple(f"{c}{c}{d}" for c in "abcdefgh" for d in "ijklmnop")  # never generated
    p = SamplingParams(max_tokens=400, stop=stops)
    s, reasons = _grown(proc, p, [0], [(i * 7) % 6 for i in range(300)])  # "a".."f"
    assert not any(reasons) and Counting.decoded < 3000
    assert proc.settled_text(s, stops) == Letters().decode(s.output)[:-2]
    with pytest.raises(ValueError, match="stop: expected at most 64 strings, got 65"):
        SamplingParams(stop=[f"s{i}" for i in range(65)])
    with pytest.raises(ValueError, match="characters, got one of 257"):
        SamplingParams(stop=["x" * 257])


def test_settled_text_holds_back_what_may_still_change():
    proc = _proc()
    assert proc.settled_text(_seq([0], [1, 2, 26]), ()) == "bc"  # half a character
    # "de" could start the stop string "def": held back until the next token
    assert proc.settled_text(_seq([0], [0, 3, 4]), ("def",)) == "a"
    assert proc.settled_text(_seq([0], [0], stop_text="done"), ("def",)) == "done"


def test_text_deltas_join_into_the_final_text():
    proc = _proc()
    p = SamplingParams(max_tokens=8, stop=("xx",))
    g = Group("r", 1, [0], p, 0, None, 0.0, max_len=9)
    s = _seq([0])
    g.seqs.append(s)
    sent, pieces = {}, []
    for t in [7, 4, 11, 11, 14]:  # "hello"
        s.tokens.append(t)
        pieces += proc.text_deltas("r", g, None, sent)
    # "xx" is 2 characters: the last one is held back (it could start the stop string)
    assert "".join(x.text for x in pieces) == "hell"
    g.seqs.remove(s)
    s.finish_reason = "length"
    g.done.append(s)
    g.status = Status.FINISHED
    out = proc.request_output(g)
    last = proc.text_deltas("r", None, out, sent)
    assert [x.finished for x in last] == [True] and last[0].finish_reason == "length"
    assert "".join(x.text for x in pieces + last) == out.outputs[0].text == "hello"


def test_request_output_orders_samples_and_ranks_beams():
    proc = _proc()
    g = Group("r", 1, [0, 1], SamplingParams(n=2, max_tokens=4), 0, None, 0.0)
    g.done += [_seq([0, 1], [5], index=1), _seq([0, 1], [2, 3], index=0)]
    g.status = Status.FINISHED
    out = proc.request_output(g)
    assert [o.text for o in out.outputs] == ["cd", "f"] and out.finished
    assert out.prompt_token_ids == [0, 1] and out.metrics.num_generated_tokens == 3
    # beams: the best n by logprob / len ** length_penalty (-3/3 = -1 beats -1.5/1)
    beams = SamplingParams(beam_width=3, n=2, max_tokens=4, length_penalty=1.0)
    g = Group("b", 2, [0], beams, 0, None, 0.0)
    g.done += [
        _seq([0], [1], cum_logprob=-1.5),
        _seq([0], [2, 2, 2], cum_logprob=-3.0),
        _seq([0], [3, 3], cum_logprob=-1.8),
    ]
    assert [o.text for o in proc.request_output(g).outputs] == ["dd", "ccc"]


def test_streamed_text_is_the_whole_decode_after_every_token():
    # StreamedText (tokenizers' DecodeStream, what a TextTokenizer's outputs use): the
    # same check as IncrementalText's, each id stepped through the stream once
    import numpy as np

    from paged_jax.engine.outputs import StreamedText

    corpus, tokenizers = _trained_tokenizers()
    rng = np.random.default_rng(1)
    for name, tok in tokenizers.items():
        for trial in range(200):
            if trial % 2:
                ids = tok.encode(corpus[trial % 3][: rng.integers(1, 60)]).ids
            else:
                ids = rng.integers(0, tok.get_vocab_size(), rng.integers(1, 40)).tolist()
            st = StreamedText(tok)
            for n in range(1, len(ids) + 1):
                assert st.update(tok.decode, ids[:n]) == tok.decode(ids[:n]), (name, ids[:n])
            # another list (not an extension): starts over
            other = ids[:-1] + [(ids[-1] + 1) % tok.get_vocab_size()]
            assert st.update(tok.decode, other) == tok.decode(other), (name, other)
    # a TextTokenizer's outputs take it; another tokenizer keeps IncrementalText
    from paged_jax.models.tokenizer import TextTokenizer

    assert OutputProcessor(TextTokenizer(tok), {EOS}, 100)._streamable is tok
    assert OutputProcessor(Letters(), {EOS}, 100)._streamable is None
