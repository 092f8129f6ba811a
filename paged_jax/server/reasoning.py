"""Reasoning models' thinking, apart from their answer: ``paged-jax serve
--reasoning-parser`` puts what a chat reply writes between ``<think>`` and ``</think>``
into ``message.reasoning_content`` (streamed: ``delta.reasoning_content``) and the rest
into ``content``, as vLLM's reasoning parsers and DeepSeek's API do. No JAX here.

One rule serves the ``<think>`` family (DeepSeek-R1 and its distills, Qwen3, QwQ):

- a reply whose prompt ends inside a thinking block (the chat template opened
  ``<think>`` after the last ``</think>``, as DeepSeek-R1's and the Qwen3 2507 thinking
  models' do) starts in its reasoning; any other starts in its reasoning only if it
  opens with ``<think>`` (after whitespace);
- the reasoning ends at the first ``</think>``; everything after it is content. A reply
  cut short before it has reasoning and no content; one that never thinks (Qwen3 with
  ``enable_thinking: false``, whose template closes an empty block in the prompt) is
  all content, as written;
- whitespace that opens the reasoning or the content after it is dropped (Qwen3 writes
  ``<think>\\n...\\n</think>\\n\\n``).

``ReasoningStream`` applies the rule as text arrives, holding back only what may still
become a tag; ``split`` runs the same machine on a whole reply, so the deltas of a
streamed reply join to what the unstreamed one returns. Tool calls are read from the
content alone. The tags must survive detokenization (Qwen3's and the R1 distills'
tokenizers keep them: they are not special tokens).
"""

from __future__ import annotations

PARSERS = ("deepseek_r1", "qwen3")  # vLLM's names for the <think> rule
OPEN, CLOSE = "<think>", "</think>"


def starts_inside(prompt_text: str) -> bool:
    """Whether a reply to a prompt ending in ``prompt_text`` starts inside a thinking
    block (the last ``<think>`` after the last ``</think>``)."""
    return prompt_text.rfind(OPEN) > prompt_text.rfind(CLOSE)


def prompt_starts_inside(llm, prompt_ids) -> bool:
    """``starts_inside`` of a prompt given as token ids, from its decoded tail (the
    generation prompt, where a template opens the block) under ``llm.decode``."""
    return starts_inside(llm.decode(list(prompt_ids)[-32:]) or "")


def _held_tail(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag``."""
    most = min(len(tag) - 1, len(text))
    return next((k for k in range(most, 0, -1) if text.endswith(tag[:k])), 0)


class ReasoningStream:
    """One streamed chat choice: ``feed`` each piece of text and get ``(reasoning,
    content)``, the parts that can go out now (empty strings when none); ``finish`` once
    the choice ends gives what was held back. ``inside``: the reply starts in its
    reasoning (``starts_inside`` of its prompt)."""

    def __init__(self, inside: bool):
        self.state = "reasoning" if inside else "start"
        self.buf = ""
        self.strip = inside  # drop whitespace that opens the current part
        self.reasoned = inside  # whether the reply has a reasoning part

    def feed(self, piece: str) -> tuple[str, str]:
        self.buf += piece
        reasoning, content = [], []
        while True:
            if self.strip:  # whitespace opening a part is dropped
                self.buf = self.buf.lstrip()
                if not self.buf:
                    break
                self.strip = False
            if self.state == "start":
                head = self.buf.lstrip()
                if head.startswith(OPEN):
                    self.state, self.reasoned, self.strip = "reasoning", True, True
                    self.buf = head[len(OPEN) :]
                    continue
                if not head or OPEN.startswith(head):
                    break  # undecided yet
                self.state = "content"
            if self.state == "reasoning":
                end = self.buf.find(CLOSE)
                if end >= 0:
                    reasoning.append(self.buf[:end])
                    self.buf = self.buf[end + len(CLOSE) :]
                    self.state, self.strip = "content", True
                    continue
                keep = _held_tail(self.buf, CLOSE)
                reasoning.append(self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep :]
                break
            content.append(self.buf)  # "content"
            self.buf = ""
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What was held back, once the choice has ended: a tag's beginning that never
        completed is text of the part it was in."""
        rest, self.buf = self.buf, ""
        if self.state == "reasoning":
            return rest, ""
        if self.strip:  # (the content after the reasoning: its opening whitespace)
            rest = rest.lstrip()
        return "", rest


def split(text: str, inside: bool) -> tuple[str | None, str | None]:
    """``(reasoning_content, content)`` of a whole reply (None for a part it does not
    have, and for an empty content after reasoning), by ``ReasoningStream``'s rule."""
    s = ReasoningStream(inside)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    reasoning, content = r1 + r2, c1 + c2
    if not s.reasoned:
        return None, text
    return reasoning, content or None
