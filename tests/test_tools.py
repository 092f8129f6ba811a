"""Tool calls in the chat API (issue 54, item 4): each format's replies parsed into
OpenAI ``tool_calls`` (and what is not a call left as content), the request fields
checked, streamed text held only from where a call may begin, and through the server a
random model held by the grammar to calls of the given tools (``required``, a named
function), plain and streamed, and left alone with ``auto`` and ``none``."""

import json

import pytest
from test_gguf import _model, write_gguf

import paged_jax as pj
from paged_jax.models import load_gguf
from paged_jax.server.tools import StreamFilter, ToolError, ToolRequest, detect_format

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


def _req(fmt, choice="auto", tools=(WEATHER, TIME)):
    return ToolRequest.of({"tools": list(tools), "tool_choice": choice}, fmt)


def _calls(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize(
    "fmt,text,content,calls",
    [
        (
            "hermes",
            'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n'
            "</tool_call>",
            "Let me look.",
            [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "utc"})],
        ),
        (  # an unknown tool and broken JSON stay text
            "hermes",
            '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> <tool_call>{oops',
            '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> <tool_call>{oops',
            [],
        ),
        (
            "llama3_json",
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
            '{"name": "get_time", "parameters": {"zone": "cet"}}',
            None,
            [("get_weather", {"city": "Rome"}), ("get_time", {"zone": "cet"})],
        ),
        ("llama3_json", "It is sunny {really}.", "It is sunny {really}.", []),
        (
            "mistral",
            'ok [TOOL_CALLS][{"name": "get_time", "arguments": "{\\"zone\\": \\"utc\\"}"}]',
            "ok",
            [("get_time", {"zone": "utc"})],
        ),
    ],
)
def test_replies_parse_into_tool_calls(fmt, text, content, calls):
    got_content, got_calls = _req(fmt).parse(text)
    assert got_content == content and _calls(got_calls) == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got_calls)


def test_parallel_tool_calls_false_keeps_one_call():
    body = {"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False}
    req = ToolRequest.of(body, "hermes")
    text = (
        '<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>'
        '<tool_call>{"name": "get_time", "arguments": {"zone": "cet"}}</tool_call>'
    )
    assert _calls(req.parse(text)[1]) == [("get_time", {"zone": "utc"})]
    assert "*" not in req.grammar().splitlines()[0]  # one block, not one or more
    auto = ToolRequest.of(dict(body, tool_choice="auto"), "hermes")
    spaced = "Hi " + text.replace("</tool_call><", "</tool_call> mid <") + " end"
    f = StreamFilter(auto)  # streamed: the later call dropped too, not left as content
    sent = "".join(f.feed(ch) for ch in spaced)
    deltas = f.call_deltas()
    rest, last = f.finish()
    assert _calls(_assemble(deltas + last)) == _calls(auto.parse(spaced)[1])
    assert (sent + rest).split() == auto.parse(spaced)[0].split() == ["Hi", "mid", "end"]
    with pytest.raises(ToolError, match="parallel_tool_calls: expected a bool"):
        ToolRequest.of(dict(body, parallel_tool_calls="no"), "hermes")


def test_formats_follow_the_chat_template():
    assert detect_format("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert detect_format("<|python_tag|>{{ x }}") == "llama3_json"
    assert detect_format("[AVAILABLE_TOOLS] [TOOL_CALLS]") == "mistral"
    assert detect_format(None) == "hermes"


@pytest.mark.parametrize(
    "body,message",
    [
        ({"tools": []}, "tools: expected a non-empty list"),
        ({"tools": [{"type": "code"}]}, "tools[0]: expected"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name: 'get_weather' given twice"),
        (
            {"tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools[0].function.name: expected 1 to 64",
        ),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice: expected"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice: no tool named 'x'",
        ),
        ({"tool_choice": "required"}, "tool_choice: needs tools"),
    ],
)
def test_bad_tool_fields_name_the_field(body, message):
    with pytest.raises(ToolError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ToolRequest.of(body, "hermes")


@pytest.mark.parametrize("fmt", ["hermes", "mistral", "llama3_json"])
def test_streamed_text_is_held_only_where_a_call_may_begin(fmt):
    call = {
        "hermes": '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>',
        "mistral": '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "utc"}}]',
        "llama3_json": '{"name": "get_time", "parameters": {"zone": "utc"}}',
    }[fmt]
    lead = "" if fmt == "llama3_json" else "Checking <tool the clock. "
    f = StreamFilter(_req(fmt))
    sent = "".join(f.feed(ch) for ch in lead + call)
    assert sent == lead  # the text before the call went out as it came
    rest, calls = f.finish()
    assert rest == "" and _calls(_assemble(f.call_deltas() + calls)) == [
        ("get_time", {"zone": "utc"})
    ]
    g = StreamFilter(_req(fmt))  # no call: everything goes out, by the end at the latest
    text = "Plain answer, <tool> and [brackets]."
    out = "".join(g.feed(ch) for ch in text)
    rest, calls = g.finish()
    assert out + rest == text and not calls


def _assemble(deltas):
    """Streamed ``tool_calls`` deltas joined as OpenAI's clients join them: by index, the
    first with the id and name, the arguments' pieces concatenated."""
    calls = {}
    for d in deltas:
        c = calls.setdefault(d["index"], {"id": None, "type": None, "function": {}})
        for k in ("id", "type"):
            if d.get(k):
                assert c[k] is None, ("sent twice", d)
                c[k] = d[k]
        fn = d.get("function", {})
        if "name" in fn:
            c["function"]["name"] = fn["name"]
        c["function"]["arguments"] = c["function"].get("arguments", "") + fn.get("arguments", "")
    assert sorted(calls) == list(range(len(calls)))
    return [calls[i] for i in range(len(calls))]


@pytest.mark.parametrize("fmt", ["hermes", "mistral", "llama3_json"])
def test_streamed_calls_go_out_as_they_are_written(fmt):
    # Fed a character at a time, each call goes out with its id and name once the name is
    # complete, then its arguments piece by piece, before the reply ends; joined, they
    # are the non-streamed parse's calls. An unknown tool is not streamed; arguments
    # written as a JSON string go out whole.
    one = '{"name": "get_weather", "%s": {"city": "Oslo", "n": [1, {"a": "}"}]}}'
    two = '{"name": "get_time", "%s": "{\\"zone\\": \\"utc\\"}"}'
    bad = '{"name": "rm_rf", "%s": {}}'
    key = "parameters" if fmt == "llama3_json" else "arguments"
    objs = [o % key for o in (one, bad, two)]
    text = {
        "hermes": "Sure.\n" + "\n".join(f"<tool_call>\n{o}\n</tool_call>" for o in objs),
        "mistral": "Sure. [TOOL_CALLS][" + ", ".join(objs) + "]",
        "llama3_json": "<|python_tag|>" + "; ".join(objs),
    }[fmt]
    req = _req(fmt)
    f = StreamFilter(req)
    deltas, content, first_args_at = [], "", None
    for i, ch in enumerate(text):
        content += f.feed(ch)
        got = f.call_deltas()
        if first_args_at is None and any(d["function"].get("arguments") for d in got):
            first_args_at = i
        deltas += got
    rest, last = f.finish()
    streamed = _assemble(deltas + last)
    args_deltas = [d for d in deltas if d["index"] == 0 and d["function"].get("arguments")]
    assert len(args_deltas) > 5  # piece by piece, not at the end
    assert first_args_at < text.index("Oslo") + 4
    want_content, want = req.parse(text)
    known = [("get_weather", {"city": "Oslo", "n": [1, {"a": "}"}]}), ("get_time", {"zone": "utc"})]
    assert _calls(streamed) == known
    if fmt == "hermes":  # the unknown tool's block stays content, as unstreamed
        assert _calls(want) == known
        assert (content + rest).split() == want_content.split()
        assert "rm_rf" in rest
    else:
        # one unknown tool in the reply's calls makes it all content unstreamed; streamed,
        # the known calls have gone out before it
        assert want == [] and want_content == text
        assert content + rest == ("Sure. " if fmt == "mistral" else "")
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in streamed)
    assert f.called
    g = StreamFilter(_req(fmt, choice="required") if fmt != "llama3_json" else req)
    g.req.parallel = False
    for ch in text:
        g.feed(ch)
    _, last = g.finish()
    assert [c["function"]["name"] for c in _assemble(g.call_deltas() + last)] == ["get_weather"]


@pytest.mark.parametrize("fmt", ["hermes", "mistral", "llama3_json"])
def test_a_reply_cut_short_inside_a_call_reads_the_same_plain_and_streamed(fmt):
    # The token limit ends the reply inside its second call: streamed, that call went out
    # as far as it was written (its arguments not whole JSON); unstreamed (cut_short) the
    # reply reads the same, the finished call before it included, and in neither is the
    # cut call's text content as well.
    key = "parameters" if fmt == "llama3_json" else "arguments"
    done = '{"name": "get_weather", "' + key + '": {"city": "Oslo"}}'
    cut = '{"name": "get_time", "' + key + '": {"zone": "ut'
    text = {
        "hermes": f"Sure.\n<tool_call>\n{done}\n</tool_call>\n<tool_call>\n{cut}",
        "mistral": f"Sure. [TOOL_CALLS][{done}, {cut}",
        "llama3_json": f"{done}; {cut}",
    }[fmt]
    req = _req(fmt, "required")
    f = StreamFilter(req)
    content = "".join(f.feed(ch) for ch in text)
    deltas = f.call_deltas()
    rest, last = f.finish()
    streamed = _assemble(deltas + last)
    named = [(c["function"]["name"], c["function"]["arguments"]) for c in streamed]
    assert named == [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"zone": "ut')]
    assert (content + rest).strip() == ("" if fmt == "llama3_json" else "Sure.")
    plain_content, plain = req.parse(text, cut_short=True)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in plain] == named
    assert plain_content == (None if fmt == "llama3_json" else "Sure.")
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in plain)
    # a reply that ends where it should is read as before: the cut call is no call
    assert _calls(req.parse(text)[1]) == ([("get_weather", {"city": "Oslo"})] * (fmt == "hermes"))


# ---------------------------------------------------------------------- the server

TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>tools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
    "{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] or '' }}{% endfor %}"
    "<|assistant|>"
)


def serve_a_tools_model(tmp_path_factory):
    """A test client of a server (model "t") of a small random GGUF whose chat template
    renders tools (a generator: the body of a fixture)."""
    from starlette.testclient import TestClient

    from paged_jax.server.api import Server

    path = tmp_path_factory.mktemp("tools") / "m.gguf"
    write_gguf(path, _model(vocab_size=300), extra={"tokenizer.chat_template": TOOLS_TEMPLATE})
    model, tok = load_gguf(path)
    llm = pj.LLM(model, tok, page_size=8, num_pages=128, compilation_cache=False)
    app = Server(llm, model_name="t")
    with TestClient(app.app) as c:
        yield c


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    yield from serve_a_tools_model(tmp_path_factory)


def _body(choice, **kw):
    messages = [
        {"role": "user", "content": "weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "content": "12C", "tool_call_id": "call_1"},
    ]
    body = dict(model="t", messages=messages, tools=[WEATHER, TIME], tool_choice=choice)
    return body | dict(max_tokens=120, temperature=0.8, seed=3) | kw


def _chunks(client, body):
    """The chunks of ``body`` asked of the chat route streamed."""
    with client.stream("POST", "/v1/chat/completions", json=dict(body, stream=True)) as r:
        assert r.status_code == 200
        return [
            json.loads(line[6:])
            for line in r.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_required_and_named_choices_return_calls_of_the_given_tools(client, choice):
    r = client.post("/v1/chat/completions", json=_body(choice))
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "tool_calls", c
    calls = _calls(c["message"]["tool_calls"])
    assert calls
    for name, args in calls:
        if name == "get_weather":
            assert set(args) == {"city"} and len(args["city"]) <= 6
        else:
            assert choice == "required" and name == "get_time" and args["zone"] in ("utc", "cet")
    if choice != "required":
        assert [n for n, _ in calls] == ["get_weather"]


def test_a_streamed_call_arrives_as_a_tool_calls_delta(client):
    body = _body({"type": "function", "function": {"name": "get_time"}})
    chunks = _chunks(client, body)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls = _assemble([t for d in deltas for t in d.get("tool_calls", [])])
    assert len(calls) == 1 and calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "get_time"
    assert json.loads(calls[0]["function"]["arguments"])["zone"] in ("utc", "cet")
    # the arguments came in pieces, in chunks before the one that finishes
    pieces = [t for d in deltas[:-1] for t in d.get("tool_calls", []) if t["function"].get(
        "arguments")]  # fmt: skip
    assert len(pieces) > 1
    assert "".join(d.get("content") or "" for d in deltas) == ""  # nothing leaked as text
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_call_cut_short_by_max_tokens_finishes_length_plain_and_streamed(client):
    # Held to a call and cut short at every 8th token of it, a reply finishes "length"
    # (not "tool_calls": the call is not whole), and plain and streamed read the same:
    # the same calls (the last one's arguments as far as written), the same content.
    body = _body({"type": "function", "function": {"name": "get_time"}})
    whole = client.post("/v1/chat/completions", json=body).json()
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    seen = set()
    for k in range(8, whole["usage"]["completion_tokens"], 8):
        r = client.post("/v1/chat/completions", json=dict(body, max_tokens=k))
        c = r.json()["choices"][0]
        assert r.status_code == 200 and c["finish_reason"] == "length", (k, c)
        calls = c["message"].get("tool_calls") or []
        chunks = _chunks(client, dict(body, max_tokens=k))
        deltas = [ch["choices"][0]["delta"] for ch in chunks]
        streamed = _assemble([t for d in deltas for t in d.get("tool_calls", [])])
        assert [x["function"] for x in streamed] == [x["function"] for x in calls], k
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        content = "".join(d.get("content") or "" for d in deltas)
        assert content.strip() == (c["message"]["content"] or ""), k
        for x in calls:
            try:
                json.loads(x["function"]["arguments"])
                seen.add("whole")
            except ValueError:
                seen.add("cut")
        seen.add("text" if not calls else "call")
    assert seen == {"text", "call", "cut", "whole"}  # (before the name, in and past the args)


def test_a_streamed_call_s_log_probs_are_those_of_the_plain_reply(client):
    # Pieces held back while a call is written still have their tokens' log-probs
    # streamed (with the choice's next chunk): joined, they are the plain reply's.
    body = _body({"type": "function", "function": {"name": "get_time"}}, temperature=0.0,
                 logprobs=True, top_logprobs=2)  # fmt: skip
    plain = client.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]
    chunks = _chunks(client, body)
    streamed = [t for c in chunks for t in (c["choices"][0]["logprobs"] or {}).get("content", [])]
    assert len(plain["content"]) > 20 and len(streamed) == len(plain["content"])
    for s, p in zip(streamed, plain["content"], strict=True):  # (f32 sums in other batches)
        assert s["token"] == p["token"] and s["logprob"] == pytest.approx(p["logprob"], abs=1e-5)
        assert [a["token"] for a in s["top_logprobs"]] == [a["token"] for a in p["top_logprobs"]]


def test_auto_and_none_leave_a_reply_that_makes_no_call_alone(client):
    for choice in ("auto", "none"):
        r = client.post("/v1/chat/completions", json=_body(choice, max_tokens=8))
        c = r.json()["choices"][0]
        assert r.status_code == 200 and c["finish_reason"] == "length"
        assert "tool_calls" not in c["message"] and isinstance(c["message"]["content"], str)
        assert "<tool_call>" not in c["message"]["content"]


CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'


@pytest.fixture(scope="module")
def calling_client(tmp_path_factory):
    """A server (model "t") whose vocabulary has one more, user-defined token: ``CALL``, a
    whole call as one piece, which ``logit_bias`` then makes the model write (a random
    model never writes a call of its own)."""
    from gguf import GGUFValueType as V
    from starlette.testclient import TestClient
    from test_gguf import _byte_pieces

    from paged_jax.server.api import Server

    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
    tokens = ["<s>", "</s>", *_byte_pieces(), *(m.replace(" ", "") for m in merges), CALL]
    types = [3, 3] + [1] * (len(tokens) - 3) + [4]  # 4: user-defined, decoded as it is
    extra = {
        "tokenizer.chat_template": TOOLS_TEMPLATE,
        "tokenizer.ggml.tokens": (tokens, V.ARRAY, V.STRING),
        "tokenizer.ggml.token_type": (types, V.ARRAY, V.INT32),
    }
    path = tmp_path_factory.mktemp("calls") / "m.gguf"
    write_gguf(path, _model(vocab_size=300), extra=extra)
    model, tok = load_gguf(path)
    assert tok.decode([len(tokens) - 1]) == CALL
    llm = pj.LLM(model, tok, page_size=8, num_pages=128, compilation_cache=False)
    with TestClient(Server(llm, model_name="t").app) as c:
        c.call_token = len(tokens) - 1
        yield c


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_auto_parses_a_reply_s_calls_and_none_leaves_them_as_text(calling_client, stream):
    # A reply that does write calls (the call token, twice: max_tokens 2): "auto" returns
    # them as tool_calls, no content; "none" returns the very text, no tool_calls.
    bias = {str(calling_client.call_token): 100}
    for choice in ("auto", "none"):
        body = _body(choice, max_tokens=2, logit_bias=bias)
        if stream:
            chunks = _chunks(calling_client, body)
            deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"]]
            text = "".join(d.get("content") or "" for d in deltas)
            calls = _assemble([tc for d in deltas for tc in d.get("tool_calls") or []])
        else:
            r = calling_client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            message = r.json()["choices"][0]["message"]
            text, calls = message["content"] or "", message.get("tool_calls") or []
        if choice == "auto":
            assert text == ""
            assert [c["function"]["name"] for c in calls] == ["get_weather", "get_weather"]
            assert all(json.loads(c["function"]["arguments"]) == {"city": "Oslo"} for c in calls)
        else:
            assert text == CALL + CALL and calls == []


def test_bad_tools_are_a_400_naming_the_field(client):
    r = client.post("/v1/chat/completions", json=_body("sometimes"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    body = _body("required", response_format={"type": "json_object"})
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and "tool_choice: not with response_format" in r.text
