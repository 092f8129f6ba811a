"""What requests get back, and the output processor that makes it: finish reasons from
stop tokens, stop strings and lengths; text, settled for streaming; ``RequestOutput``.

The engine core (``paged_jax.engine.core``) applies sampled tokens to its sequences and
asks the ``OutputProcessor`` whether each one ends its sequence; the facade (``LLM``) and
the server turn sequences into text and outputs through it. No JAX here.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from paged_jax.engine.request import Group, Seq, Status
from paged_jax.engine.sampling import SamplingParams


@dataclasses.dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    cumulative_logprob: float
    logprobs: list[float] | None
    # per token, [(token, log-prob)] of the step's most likely tokens (top_logprobs)
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclasses.dataclass
class StreamOutput:
    """New text of one sample of a streamed request (``add_request(stream=True)``,
    ``LLM.stream``): ``index`` is the prompt's position (``LLM.stream``; 0 from ``step``),
    ``sample`` the sample's; ``finish_reason`` is set on its last piece."""

    index: int
    sample: int
    text: str
    finished: bool = False
    finish_reason: str | None = None
    output: RequestOutput | None = None  # the request's whole output, on its last piece
    # the tokens generated since the sample's previous piece (their text may come in a
    # later piece, while held back), with their log-probs when the request asked
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # on the request's first piece, when it asked (SamplingParams.prompt_logprobs): as
    # RequestOutput's (every prompt token's is known once the first token is)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    request_id: Hashable = None  # the request's


class StepResult(list):
    """What ``step()`` returns: the requests that finished in the step (the list, of
    ``RequestOutput``), and for the streamed requests (``add_request(stream=...)``) what
    the engine pushes: ``streamed``, the new pieces of every text stream
    (``StreamOutput``: the text that settled since the sample's last piece and the tokens
    generated meanwhile; a finished request's last pieces carry its output), and
    ``new_tokens``, the tokens each streamed request generated in the step (``{request
    id: count}``). Its ``OutputProcessor`` keeps what each stream has been sent."""

    def __init__(self, finished=(), streamed=(), new_tokens=None):
        super().__init__(finished)
        self.streamed: list[StreamOutput] = list(streamed)
        self.new_tokens: dict[Hashable, int] = {} if new_tokens is None else new_tokens

    def add_others(self, res: StepResult, mine) -> None:
        """Adds what ``res`` holds of the requests not in ``mine`` (a loop over ``step``
        keeps what it does not own, for ``EngineCore.deliver_later``)."""
        self.extend(o for o in res if o.request_id not in mine)
        self.streamed += [p for p in res.streamed if p.request_id not in mine]
        for rid, n in res.new_tokens.items():
            if rid not in mine:
                self.new_tokens[rid] = self.new_tokens.get(rid, 0) + n


@dataclasses.dataclass
class _Stream:
    """What the engine has pushed of one streamed request."""

    text: bool  # text pieces (else token counts only)
    tokens: int = 0  # tokens generated so far (reported in StepResult.new_tokens)
    sent: dict = dataclasses.field(default_factory=dict)  # text_deltas' record


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served by the prefix cache (summed over preemptions)
    num_generated_tokens: int
    num_preemptions: int

    @property
    def cached_prompt_tokens(self) -> int:
        """The prompt tokens the prefix cache served, counted once (``num_cached_tokens``
        sums them over the request's preemptions)."""
        return min(self.num_cached_tokens, self.num_prompt_tokens)

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclasses.dataclass
class RequestOutput:
    request_id: Hashable
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None  # set when the engine failed the request (finish_reason "error")
    # SamplingParams.prompt_logprobs: each prompt token's log-prob given the tokens before
    # it (None for the first), and each one's most likely tokens as [(token, log-prob)]
    # (with prompt_logprobs k > 0; [] for the first); None when not asked
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None


class IncrementalText:
    """The text of a growing list of token ids, decoding a few tokens per update.

    ``text`` = ``committed`` (the text of ``ids[:read]``) + ``tail`` (of the ids after,
    held back while it ends in half a UTF-8 sequence, U+FFFD). Each update decodes the
    window ``ids[prefix:]`` and appends what it adds to ``done``, the text of
    ``ids[prefix:read]`` alone: tokenizers that drop a leading space at the start of a
    decode, or merge bytes across tokens, treat both alike. ``prefix`` moves up only to
    ids whose text alone is not empty (skipped special tokens, a space a decoder strips),
    so ``done`` has the window's first characters. Where the window's text does not
    extend ``done`` (a decoder that rewrites text across the boundary) the whole list
    is decoded once. ``checked``: how much of ``committed`` the stop-string search has
    seen.
    """

    __slots__ = ("n", "prefix", "read", "done", "committed", "tail", "checked")

    def __init__(self):
        self.n = self.prefix = self.read = self.checked = 0
        self.done = self.committed = self.tail = ""

    @property
    def text(self) -> str:
        return self.committed + self.tail

    def update(self, decode: Callable[[list[int]], str], ids: list[int]) -> str:
        """The text of ``ids``, which extend the ids of the last update (a shorter list
        starts over)."""
        if len(ids) < self.n:
            self.__init__()
        if len(ids) == self.n:
            return self.text
        self.n = len(ids)
        window = decode(ids[self.prefix :])
        if not window.startswith(self.done):  # decode everything, then go on from there
            self.__init__()
            self.n, window = len(ids), decode(ids)
        new = window[len(self.done) :]
        if new.endswith("\ufffd"):
            self.tail = new
            return self.text
        self.committed += new
        self.tail = ""
        chunk = decode(ids[self.read :])
        if chunk:
            self.prefix, self.done = self.read, chunk
        else:
            self.done = window
        self.read = len(ids)
        return self.text


class StreamedText:
    """``IncrementalText``'s interface over the ``tokenizers`` library's own incremental
    decoder (``tokenizers.decoders.DecodeStream``, special tokens skipped) for a
    ``tokenizers.Tokenizer``: each new id is stepped through it once, and what it emits
    (whole characters, the decoder's spacing rules applied across tokens) is appended
    to ``committed``; ``tail`` is the text of the ids it holds back (half a UTF-8
    sequence: U+FFFD), by ``decode``. A list that does not extend the ids seen (shorter,
    or another id where the last one was) starts over."""

    __slots__ = ("_tokenizer", "stream", "n", "last", "pending", "committed", "tail", "checked")

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._start()

    def _start(self) -> None:
        from tokenizers.decoders import DecodeStream

        self.stream = DecodeStream(skip_special_tokens=True)
        self.n = self.checked = 0
        self.last = None
        self.pending: list[int] = []
        self.committed = self.tail = ""

    @property
    def text(self) -> str:
        return self.committed + self.tail

    def update(self, decode: Callable[[list[int]], str], ids: list[int]) -> str:
        """The text of ``ids``, which extend the ids of the last update."""
        if len(ids) < self.n or (self.n and ids[self.n - 1] != self.last):
            self._start()
        if len(ids) == self.n:
            return self.text
        step, tok = self.stream.step, self._tokenizer
        for t in ids[self.n :]:
            piece = step(tok, t)
            if piece is None:
                self.pending.append(t)
            else:
                self.committed += piece
                self.pending = []
        self.n, self.last = len(ids), ids[-1]
        self.tail = decode(self.pending) if self.pending else ""
        return self.text


def _stream_decodable(tokenizer: Any) -> Any | None:
    """The ``tokenizers.Tokenizer`` of a tokenizer that says its ``decode`` is that
    tokenizer's with special tokens skipped, as ``StreamedText``'s stream decodes
    (``stream_decodable``: ``models.tokenizer.TextTokenizer``), or None (another
    tokenizer: the byte tokenizer, a user's object)."""
    if not getattr(tokenizer, "stream_decodable", False):
        return None
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream  # noqa: F401  (tokenizers >= 0.21)
    except ImportError:
        return None
    inner = tokenizer.tokenizer
    return inner if isinstance(inner, Tokenizer) else None


@functools.lru_cache(maxsize=256)
def _stop_pattern(stops: tuple[str, ...]) -> re.Pattern:
    """One pattern matching any of ``stops``: at the leftmost position, the first of them
    in sorted order (the smallest (position, string) pair)."""
    return re.compile("|".join(re.escape(x) for x in sorted(stops)))


class OutputProcessor:
    """Detokenization, stop conditions and outputs for one engine.

    Args:
      tokenizer: object with ``decode(ids)`` (None: outputs carry no text, and stop
        strings are refused when a request is added).
      eos_token_ids: the model's end-of-sequence tokens.
      max_model_len: a sequence ends ("length") when it holds this many tokens.
    """

    def __init__(self, tokenizer: Any, eos_token_ids: set, max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        # a TextTokenizer's tokenizers.Tokenizer: outputs decoded by its DecodeStream
        self._streamable = _stream_decodable(tokenizer)
        # streamed requests (request id -> what their stream has been sent), in order
        self._streams: dict[Hashable, _Stream] = {}

    # ------------------------------------------------------------------ streams
    def open_stream(self, request_id: Hashable, text: bool = True) -> None:
        """Request ``request_id`` is streamed: each step reports its new tokens, and with
        ``text`` its new settled text (``stream_pieces``)."""
        self._streams[request_id] = _Stream(text)

    def close_stream(self, request_id: Hashable) -> None:
        """Forgets a stream (its request was aborted: it gets no more pieces)."""
        self._streams.pop(request_id, None)

    def close_streams(self) -> None:
        self._streams.clear()

    def stream_pieces(self, group_of, finished: list[RequestOutput]) -> tuple[list, dict]:
        """``(pieces, new tokens)`` of the open streams after a step: each unfinished
        request's (``group_of(request id)``: its ``Group``) new settled text and tokens,
        and for a request among ``finished`` its last pieces (its stream is then closed);
        ``{request id: tokens generated since the last report}`` for those with any."""
        if not self._streams:
            return [], {}
        done = {o.request_id: o for o in finished if o.request_id in self._streams}
        pieces, counts = [], {}
        for rid, st in list(self._streams.items()):
            out = done.get(rid)
            g = None if out is not None else group_of(rid)
            if out is None and g is None:
                continue  # (finished in a step whose outputs are not out yet)
            if out is not None:
                n = sum(len(c.token_ids) for c in out.outputs)
                del self._streams[rid]
            else:
                n = sum(len(sq.tokens) - sq.prompt_len for sq in (*g.seqs, *g.done))
            if n > st.tokens:
                counts[rid], st.tokens = n - st.tokens, n
            if st.text:
                pieces += self.text_deltas(rid, g, out, st.sent)
        return pieces, counts

    def decode(self, ids: Sequence[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(list(ids))

    def finish_reason(self, s: Seq, p: SamplingParams, token: int) -> str | None:
        """Why ``s``, which has just had ``token`` appended, ends ("stop", "length"), or
        None: a stop token (or the model's end of sequence unless ``ignore_eos``), a stop
        string in its text (``cut_at_stop_string`` sets ``s.stop_text``), ``max_tokens``
        generated or the model's length reached; only the last two before ``min_tokens``
        (whose stop tokens the sampler never picks, and whose text so far is never
        searched for a stop string)."""
        n = len(s.tokens)
        if n - s.prompt_len < p.min_tokens:
            if p.stop:  # the text so far is not searched, now or later
                self.text(s)
                s.detok.checked = len(s.detok.committed)
        else:
            if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
                return "stop"
            if p.stop and self.cut_at_stop_string(s, p):
                return "stop"
        if n - s.prompt_len >= p.max_tokens or n >= self.max_model_len:
            return "length"
        return None

    def text(self, s: Seq) -> str | None:
        """``s``'s generated text so far, decoded incrementally (``IncrementalText``)."""
        if self.tokenizer is None:
            return None
        if s.detok is None:
            s.detok = (
                StreamedText(self._streamable)
                if self._streamable is not None
                else IncrementalText()
            )
        return s.detok.update(self.decode, s.output)

    def cut_at_stop_string(self, s: Seq, p: SamplingParams) -> bool:
        """Whether ``s``'s text now contains one of ``p.stop``; if so ``s.stop_text`` is the
        text up to the earliest one (and through it with ``include_stop_str_in_output``).
        Only text the newest tokens can have completed is searched, in one pass of a
        pattern of all the stop strings: the cost of a token does not grow with the
        output, and grows with the stop strings only through the compiled pattern."""
        text = self.text(s)
        st = s.detok
        longest = max(map(len, p.stop))
        hit = _stop_pattern(p.stop).search(text, max(st.checked - longest + 1, 0))
        st.checked = len(st.committed)
        if hit is None:
            return False
        i, x = hit.start(), hit.group()
        s.stop_text = text[: i + len(x)] if p.include_stop_str_in_output else text[:i]
        return True

    def settled_text(self, s: Seq, stops: tuple[str, ...]) -> str:
        """The text of ``s`` that later tokens cannot change: without a trailing
        replacement character (half a UTF-8 sequence) and without a tail that could be
        the start of a stop string."""
        if s.stop_text is not None:  # finished at a stop string: final
            return s.stop_text
        text = self.text(s) or ""
        text = text.rstrip("\ufffd")
        if stops:
            hold = max(map(len, stops)) - 1
            text = text[: max(len(text) - hold, 0)] if hold else text
        return text

    def text_deltas(
        self,
        rid: Hashable,
        g: Group | None,
        out: RequestOutput | None,
        sent: dict,
        index: int = 0,
    ) -> list[StreamOutput]:
        """The new settled text of each sample of request ``rid`` (its group ``g`` while
        unfinished) since ``sent`` (the stream's record of what it was sent, updated
        here), as ``StreamOutput``s with ``index``; ``out``: the request's output if it
        finished in the last step (each sample then gets a last piece with its final
        text)."""
        pieces = []
        if out is not None:
            for c in out.outputs:
                text, prev = c.text or "", sent.get((rid, c.index), "")
                delta = text[len(prev) :] if text.startswith(prev) else ""
                piece = StreamOutput(index, c.index, delta, True, c.finish_reason, out)
                piece.request_id = rid
                n = sent.get((rid, c.index, "tokens"), 0)
                piece.token_ids = c.token_ids[n:]
                if c.logprobs is not None:
                    piece.logprobs = c.logprobs[n:]
                if c.top_logprobs is not None:
                    piece.top_logprobs = c.top_logprobs[n:]
                pieces.append(piece)
            if pieces and out.prompt_logprobs is not None and (rid, "prompt") not in sent:
                sent[(rid, "prompt")] = True
                pieces[0].prompt_logprobs = out.prompt_logprobs
                pieces[0].prompt_top_logprobs = out.prompt_top_logprobs
            return pieces
        for sq in [] if g is None else [*g.seqs, *g.done]:
            text = self.settled_text(sq, g.params.stop)
            prev = sent.get((rid, sq.sample_index), "")
            if len(text) > len(prev) and text.startswith(prev):
                sent[(rid, sq.sample_index)] = text
                piece = StreamOutput(index, sq.sample_index, text[len(prev) :])
                piece.request_id = rid
                key = (rid, sq.sample_index, "tokens")
                p = g.params
                n = sent.get(key, 0)
                piece.token_ids = sq.tokens[sq.prompt_len + n :]  # the new ones only
                if p.logprobs:
                    piece.logprobs = sq.logprobs[n : n + len(piece.token_ids)]
                if p.top_logprobs:
                    piece.top_logprobs = sq.top_logprobs[n : n + len(piece.token_ids)]
                sent[key] = sent.get(key, 0) + len(piece.token_ids)
                if g.prompt_lp is not None and (rid, "prompt") not in sent:
                    sent[(rid, "prompt")] = True
                    piece.prompt_logprobs = list(g.prompt_lp)
                    piece.prompt_top_logprobs = None if g.prompt_top is None else list(g.prompt_top)
                pieces.append(piece)
        return pieces

    def request_output(self, g: Group) -> RequestOutput:
        """``g``'s output as it stands: its samples in order (beams ranked by
        ``logprob / len ** length_penalty``, the best ``n``), their text (cut at a stop
        string) and the request's metrics."""
        p = g.params
        seqs = list(g.done) + list(g.seqs)
        if p.use_beam_search:
            seqs.sort(key=lambda s: -s.cum_logprob / max(len(s.output), 1) ** p.length_penalty)
            seqs = seqs[: p.n]
        else:
            seqs.sort(key=lambda s: s.sample_index)
        outs = []
        for k, s in enumerate(seqs):
            ids = s.output  # a new list (a slice of the sequence's tokens)
            outs.append(
                CompletionOutput(
                    index=k,
                    token_ids=ids,
                    text=s.stop_text if s.stop_text is not None else self.decode(ids),
                    finish_reason=s.finish_reason,
                    cumulative_logprob=s.cum_logprob,
                    logprobs=list(s.logprobs) if p.logprobs else None,
                    top_logprobs=list(s.top_logprobs) if p.top_logprobs else None,
                )
            )
        m = RequestMetrics(
            g.arrival_time,
            g.first_token_time,
            g.finish_time,
            len(g.prompt),
            g.num_cached_tokens,
            sum(len(o.token_ids) for o in outs),
            g.num_preemptions,
        )
        return RequestOutput(
            g.request_id,
            list(g.prompt),
            outs,
            g.status is Status.FINISHED,
            m,
            g.error,
            prompt_logprobs=None if g.prompt_lp is None else list(g.prompt_lp),
            prompt_top_logprobs=None if g.prompt_top is None else list(g.prompt_top),
        )
