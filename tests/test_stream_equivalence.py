"""A streamed reply is the plain reply in pieces: random requests (seeded) mixing what the
server offers (chat and completions, n, stop strings, log-probs, echo, tools with each
choice, JSON schemas, short token limits that cut replies anywhere) each asked plain and
streamed of a small random model, and every choice compared: its text, its tool calls,
its finish reason and its tokens' log-probs. (Two bugs this found: a call cut short read
differently plain and streamed, and held pieces' log-probs were not streamed.)"""

import json
import random

import pytest
from test_tools import TIME, WEATHER, _assemble, serve_a_tools_model

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 5}},
    "required": ["a", "b"],
}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    yield from serve_a_tools_model(tmp_path_factory)


def _request(rng: random.Random) -> tuple[str, dict]:
    chat = rng.random() < 0.7
    body = dict(
        model="t",
        max_tokens=rng.randint(1, 40),
        temperature=rng.choice([0.0, 0.8]),
        seed=rng.randint(0, 99),
        n=rng.choice([1, 1, 2]),
    )
    if rng.random() < 0.3:
        body["stop"] = [rng.choice(["a", "e ", "th", "\n", "}", '"'])]
    if rng.random() < 0.4:
        body["logprobs"] = True if chat else 2
        if chat and rng.random() < 0.5:
            body["top_logprobs"] = 2
    if not chat:
        body["prompt"] = rng.choice(["Once", "The list: ", "{"])
        body["echo"] = rng.random() < 0.2
        if rng.random() < 0.2:
            body["response_format"] = {"type": "json_object"}
        return "/v1/completions", body
    body["messages"] = [{"role": "user", "content": rng.choice(["hi", "weather?", "json"])}]
    pick = rng.random()
    if pick < 0.4:
        body["tools"] = [WEATHER, TIME]
        body["tool_choice"] = rng.choice(
            ["auto", "required", {"type": "function", "function": {"name": "get_time"}}]
        )
    elif pick < 0.6:
        schema = {"name": "s", "schema": SCHEMA}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    return "/v1/chat/completions", body


def _pairs(lps: dict) -> list:  # completions' (token, log-prob) pairs
    return list(zip(lps.get("tokens") or [], lps.get("token_logprobs") or [], strict=True))


def _streamed(client, url: str, body: dict) -> dict[int, dict]:
    out: dict[int, dict] = {}
    with client.stream("POST", url, json=dict(body, stream=True)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            piece = json.loads(line[6:])
            assert "error" not in piece, piece
            for c in piece["choices"]:
                o = out.setdefault(c["index"], dict(text="", calls=[], finish=None, lps=[]))
                lps = c.get("logprobs") or {}
                if "delta" in c:
                    o["text"] += c["delta"].get("content") or ""
                    o["calls"] += c["delta"].get("tool_calls") or []
                    o["lps"] += [(t["token"], t["logprob"]) for t in lps.get("content") or []]
                else:
                    o["text"] += c["text"]
                    o["lps"] += _pairs(lps)
                o["finish"] = c["finish_reason"] or o["finish"]
    return out


def _plain_choice(c: dict, chat: bool) -> dict:
    lps = c.get("logprobs") or {}
    if chat:
        calls = c["message"].get("tool_calls") or []
        return dict(
            text=c["message"]["content"] or "",
            calls=[(x["function"]["name"], x["function"]["arguments"]) for x in calls],
            finish=c["finish_reason"],
            lps=[(t["token"], t["logprob"]) for t in lps.get("content") or []],
        )
    return dict(
        text=c["text"],
        calls=[],
        finish=c["finish_reason"],
        lps=_pairs(lps),
    )


def _same_log_probs(a, b) -> bool:
    # the tokens exactly; the values within f32 (requests batched differently)
    return [t for t, _ in a] == [t for t, _ in b] and all(
        (x is None and y is None) or abs(x - y) <= 1e-5 for (_, x), (_, y) in zip(a, b, strict=True)
    )


@pytest.mark.parametrize(
    "seed,count", [(3, 16), pytest.param(1, 150, marks=pytest.mark.slow)], ids=["16", "150"]
)
def test_random_requests_read_the_same_plain_and_streamed(client, seed, count):
    rng = random.Random(seed)
    kinds = set()
    for _ in range(count):
        url, body = _request(rng)
        chat = url.endswith("chat/completions")
        r = client.post(url, json=body)
        assert r.status_code == 200, (body, r.text)
        streamed = _streamed(client, url, body)
        choices = r.json()["choices"]
        assert sorted(streamed) == sorted(c["index"] for c in choices), body
        for c in choices:
            want, got = _plain_choice(c, chat), streamed[c["index"]]
            calls = [(x["function"]["name"], x["function"]["arguments"]) for x in
                     _assemble(got["calls"])]  # fmt: skip
            where = (body, c)
            assert got["text"].strip() == want["text"].strip(), where
            assert calls == want["calls"], where
            assert got["finish"] == want["finish"], where
            assert _same_log_probs(got["lps"], want["lps"]), where
            kinds.add("call" if calls else want["finish"])
            kinds.add("log-probs" if want["lps"] else "no log-probs")
    assert {"call", "length", "stop", "log-probs"} <= kinds  # (the mix was a mix)
