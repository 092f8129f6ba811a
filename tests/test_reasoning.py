"""Reasoning models' thinking apart from their answer (``--reasoning-parser``,
``paged_jax/server/reasoning.py``): the ``<think>`` rule on whole replies, streamed
replies cut anywhere joining to the same parts, and through the server a random model
held by a regex to a reply that thinks (from a prompt that opened the block, or opening
it itself), plain and streamed, with tool calls read from the content alone, and
``chat_template_kwargs`` reaching the template."""

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_gguf import _model, write_gguf

import paged_jax as pj
from paged_jax.models import load_gguf
from paged_jax.server.reasoning import ReasoningStream, split, starts_inside


@pytest.mark.parametrize(
    "text,inside,want",
    [
        ("Let me see.\n</think>\n\nIt is 4.", True, ("Let me see.\n", "It is 4.")),  # R1
        ("<think>\nhmm\n</think>\n\nHi!", False, ("hmm\n", "Hi!")),  # Qwen3
        ("  <think>a</think>b <think>c</think>", False, ("a", "b <think>c</think>")),
        ("Hello <think>", False, (None, "Hello <think>")),  # not at the start: content
        ("<think>cut short", False, ("cut short", None)),
        ("\n\ncut short", True, ("cut short", None)),
        ("<think></think>\n\n", False, ("", None)),
        ("<thi", False, (None, "<thi")),  # a tag that never completed
        ("ok</thin", True, ("ok</thin", None)),
        ("", False, (None, "")),
    ],
)
def test_replies_split_into_reasoning_and_content(text, inside, want):
    assert split(text, inside) == want


def test_a_reply_starts_inside_when_the_prompt_left_a_block_open():
    assert starts_inside("<|assistant|><think>\n")
    assert not starts_inside("<|assistant|><think>\n\n</think>\n\n")  # Qwen3, no thinking
    assert not starts_inside("<|user|>hi<|assistant|>")
    assert not starts_inside("")


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(
        st.sampled_from(["<think>", "</think>", "<th", "</", "ink>", "a", " ", "\n", "b c", ">"]),
        max_size=12,
    ),
    cuts=st.lists(st.integers(0, 80), max_size=6),
    inside=st.booleans(),
)
def test_streamed_pieces_join_to_the_whole_replys_parts(parts, cuts, inside):
    text = "".join(parts)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    s = ReasoningStream(inside)
    reasoning, content = "", ""
    for a, b in zip(bounds, bounds[1:], strict=False):
        r, c = s.feed(text[a:b])
        reasoning, content = reasoning + r, content + c
    r, c = s.finish()
    reasoning, content = reasoning + r, content + c
    want_r, want_c = split(text, inside)
    assert reasoning == (want_r or "") and content == (want_c or "")


# ---------------------------------------------------------------------- the server

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] or '' }}{% endfor %}"
    "<|assistant|>{% if open_think %}<think>\n{% endif %}"
)
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object"}},
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from starlette.testclient import TestClient

    from paged_jax.server.api import Server

    path = tmp_path_factory.mktemp("reasoning") / "m.gguf"
    write_gguf(path, _model(vocab_size=300), extra={"tokenizer.chat_template": TEMPLATE})
    engines = []
    for _ in range(2):  # (a server each: one engine thread per LLM)
        model, tok = load_gguf(path)
        engines.append(pj.LLM(model, tok, page_size=8, num_pages=128, compilation_cache=False))
    parsed = Server(engines[0], model_name="t", reasoning_parser="deepseek_r1")
    plain = Server(engines[1], model_name="t")
    with TestClient(parsed.app) as a, TestClient(plain.app) as b:
        yield a, b


def _chat(client, regex, stream=False, **kw):
    # a Lark grammar holds the whole reply, thinking included (a regex would hold only
    # what follows the thinking)
    one_line = regex.replace("\\\n", "\\n").replace("\n", "\\n")  # (re.escape's too)
    whole = "start: /" + one_line.replace("/", "\\/") + "/"
    body = dict(
        model="t",
        messages=[{"role": "user", "content": "2 + 2?"}],
        structured_outputs={"grammar": whole},
        max_tokens=80,
        temperature=0.9,
        seed=11,
        stream=stream,
    )
    body |= kw
    if not stream:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]  # fmt: skip


def _joined(chunks, key):
    return "".join(c["choices"][0]["delta"].get(key) or "" for c in chunks)


@pytest.mark.parametrize(
    "regex,kwargs",
    [
        ("[a-z]{4,8}</think>\n\n[a-z]{3,6}", {"chat_template_kwargs": {"open_think": True}}),
        ("<think>\n[a-z]{4,8}</think>\n\n[a-z]{3,6}", {}),
    ],
    ids=["prompt-opens-it", "reply-opens-it"],
)
def test_thinking_goes_to_reasoning_content_plain_and_streamed(servers, regex, kwargs):
    parsed, plain = servers
    c = _chat(parsed, regex, **kwargs)
    m = c["message"]
    assert re.fullmatch("[a-z]{4,8}", m["reasoning_content"]), m
    assert re.fullmatch("[a-z]{3,6}", m["content"]), m
    chunks = _chat(parsed, regex, stream=True, **kwargs)
    assert _joined(chunks, "reasoning_content") == m["reasoning_content"]
    assert _joined(chunks, "content") == m["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == c["finish_reason"] == "stop"
    # without a reasoning parser the thinking stays in the content, as written
    whole = _chat(plain, regex, **kwargs)["message"]
    assert "reasoning_content" not in whole
    assert whole["content"].endswith(f"{m['reasoning_content']}</think>\n\n{m['content']}")


def test_tool_calls_are_read_from_the_content_after_the_thinking(servers):
    parsed, _ = servers
    regex = "<think>[a-z]{3,6}</think>\n" + re.escape(CALL)
    kw = dict(tools=[TIME], tool_choice="auto", max_tokens=160, logprobs=True, top_logprobs=2)
    c = _chat(parsed, regex, **kw)
    assert c["finish_reason"] == "tool_calls", c
    assert re.fullmatch("[a-z]{3,6}", c["message"]["reasoning_content"])
    assert [t["function"]["name"] for t in c["message"]["tool_calls"]] == ["get_time"]
    assert c["message"]["content"] is None
    chunks = _chat(parsed, regex, stream=True, **kw)
    assert _joined(chunks, "reasoning_content") == c["message"]["reasoning_content"]
    assert _joined(chunks, "content") == ""
    calls = [t for ch in chunks for t in ch["choices"][0]["delta"].get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_time"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # every token's log-probs, the held ones (a tag, the call) too, as unstreamed
    lps = [t for ch in chunks for t in (ch["choices"][0]["logprobs"] or {}).get("content", [])]
    assert [t["token"] for t in lps] == [t["token"] for t in c["logprobs"]["content"]]
    assert [t["logprob"] for t in lps] == pytest.approx(
        [t["logprob"] for t in c["logprobs"]["content"]], abs=1e-5
    )
    assert len(lps) > len(CALL)


def test_a_reply_cut_short_while_thinking_has_no_content(servers):
    parsed, _ = servers
    c = _chat(parsed, "<think>[a-z]{20}</think>x", max_tokens=12)  # a byte a token
    assert c["finish_reason"] == "length"
    assert c["message"]["content"] is None and len(c["message"]["reasoning_content"]) == 5


def test_bad_chat_template_kwargs_are_a_400_naming_the_field(servers):
    parsed, _ = servers
    body = dict(model="t", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    for value, message in (
        ([1], "chat_template_kwargs: expected an object, got [1]"),
        ({"messages": []}, "chat_template_kwargs: 'messages' is set by the server"),
    ):
        r = parsed.post("/v1/chat/completions", json=body | {"chat_template_kwargs": value})
        assert r.status_code == 400 and r.json()["error"]["message"] == message
        assert r.json()["error"]["param"] == "chat_template_kwargs"


def test_a_constraint_holds_after_the_thinking(servers):
    """With a reasoning parser, ``response_format`` constrains what follows the thinking
    (``StructuredOutput.think``): a reply that opens no block is the JSON itself, all
    content (the first token pushed to "{" by ``logit_bias``); one whose prompt opened
    the block is free until it closes (here it never does: all reasoning)."""
    parsed, _ = servers
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}  # fmt: skip
    body = dict(
        model="t",
        messages=[{"role": "user", "content": "json please"}],
        response_format={"type": "json_schema", "json_schema": {"schema": schema}},
        max_tokens=40,
        temperature=0.9,
        seed=5,
    )
    (brace,) = parsed.post("/tokenize", json={"prompt": "{", "add_special_tokens": False}).json()[
        "tokens"
    ]
    r = parsed.post("/v1/chat/completions", json=body | {"logit_bias": {str(brace): 100}})
    m = r.json()["choices"][0]["message"]
    assert r.status_code == 200 and m["reasoning_content"] is None, r.text
    assert set(json.loads(m["content"])) == {"a"}
    inside = body | {"chat_template_kwargs": {"open_think": True}, "max_tokens": 6}
    r = parsed.post("/v1/chat/completions", json=inside)
    c = r.json()["choices"][0]
    assert r.status_code == 200 and c["finish_reason"] == "length", r.text
    assert c["message"]["content"] is None and len(c["message"]["reasoning_content"]) > 0
