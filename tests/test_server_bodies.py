"""Request bodies a client gets wrong answer 400 naming the field, on every route and in
every text field (issue 86): a lone UTF-16 surrogate (valid JSON, but text no tokenizer
or encoder takes) in a prompt, a list of prompts, a stop string, a chat message, a tool,
a schema's pattern, a ``/tokenize`` or ``/v1/embeddings`` input, an object's key; and a
seeded fuzzing of valid bodies, each with one field replaced by a value drawn from an
alphabet of wrong types, edge numbers and unencodable strings, that never gets a 500."""

import json
import random

import pytest
from test_tools import TIME, WEATHER, serve_a_tools_model

BAD = "\ud800"  # a lone high surrogate; json.dumps writes it as the escape \ud800


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    yield from serve_a_tools_model(tmp_path_factory)


CHAT = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}}
# (route, a valid body): every text field of each is replaced in turn
BODIES = [
    ("/v1/completions", dict(model="t", prompt="Once", max_tokens=2, stop=["x", "y"], user="u")),
    ("/v1/completions", dict(model="t", prompt=["Once", "Twice"], max_tokens=2)),
    (
        "/v1/completions",
        dict(model="t", prompt="a", max_tokens=2, structured_outputs={"regex": "[ab]+"}),
    ),
    (
        "/v1/chat/completions",
        dict(
            model="t",
            messages=[
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            ],
            tools=[WEATHER, TIME],
            tool_choice="auto",
            max_tokens=2,
            stop="x",
        ),
    ),
    (
        "/v1/chat/completions",
        dict(
            model="t",
            messages=CHAT,
            max_tokens=2,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": SCHEMA | {"pattern": "a+"}},
            },
        ),
    ),
    ("/tokenize", dict(model="t", prompt="hello")),
    ("/tokenize", dict(model="t", messages=CHAT)),
    ("/v1/embeddings", dict(model="t", input="hello")),
    ("/v1/embeddings", dict(model="t", input=["hello", "world"])),
    ("/detokenize", dict(model="t", tokens=[65, 66])),
]


def _text_paths(value, path=()):
    """The path of every string in a JSON value (keys: str; list indices: int)."""
    if isinstance(value, str):
        yield path
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _text_paths(v, (*path, k))
    elif isinstance(value, list):
        for j, v in enumerate(value):
            yield from _text_paths(v, (*path, j))


def _named(path) -> str:
    """``("messages", 1, "content")`` as the server names it: ``messages[1].content``."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def _replaced(body, path, value):
    body = json.loads(json.dumps(body))  # a deep copy
    where = body
    for p in path[:-1]:
        where = where[p]
    where[path[-1]] = value
    return body


def _post(client, route, body):
    """``body`` posted as JSON text with every non-ASCII character (a lone surrogate too)
    as a \\u escape, which is how a client sends one."""
    raw = json.dumps(body).encode("ascii")
    return client.post(route, content=raw, headers={"content-type": "application/json"})


def _cases():
    for route, body in BODIES:
        for path in _text_paths(body):
            if path != ("model",):  # (the model's name is a case of its own, below)
                yield route, body, path


@pytest.mark.parametrize(
    "route,body,path",
    list(_cases()),
    ids=[f"{r}:{_named(p)}" for r, _, p in _cases()],
)
def test_a_lone_surrogate_in_any_text_field_is_a_400_naming_it(client, route, body, path):
    # Before: a completions prompt of "\ud800" alone was a 500 with a traceback ("internal
    # error: TypeError: TextInputSequence must be str"), and a stop string, a tool's
    # name, a regex or a schema's pattern got through to the engine.
    r = _post(client, route, _replaced(body, path, "ab" + BAD))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == path[0]
    assert error["message"] == (
        f"{_named(path)}: not valid Unicode text (a lone UTF-16 surrogate at character 2)"
    )


@pytest.mark.parametrize("route", sorted({r for r, _ in BODIES}))
def test_a_lone_surrogate_in_a_key_or_the_model_name_is_a_400(client, route):
    body = dict(next(b for r, b in BODIES if r == route))
    r = _post(client, route, body | {"x" + BAD: 1})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "x\\ud800"
    r = _post(client, route, body | {"model": BAD})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text


def test_a_surrogate_written_as_raw_bytes_is_a_400_and_a_pair_is_text(client):
    # Python's JSON reader takes a surrogate's three UTF-8-like bytes too (surrogatepass);
    # a well-formed pair written as two escapes is one character, and no error.
    raw = b'{"model": "t", "prompt": "a\xed\xa0\x80", "max_tokens": 2}'
    headers = {"content-type": "application/json"}
    r = client.post("/v1/completions", content=raw, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    raw = b'{"model": "t", "prompt": "a\\ud83d\\ude00", "max_tokens": 2}'
    assert client.post("/v1/completions", content=raw, headers=headers).status_code == 200


# The fuzzing's alphabet: wrong types, edge numbers, unencodable and odd strings
ALPHABET = [
    None,
    True,
    0,
    -1,
    1.5,
    2**63,
    10**30,
    -1e308,
    "",
    "x",
    BAD,
    "a\udfffb",
    "\udc80" * 3,
    "\ud83d",  # the high half of an emoji's pair, alone
    "\uffff",
    "\x00",
    "\u202e",
    "[" * 20,
    [],
    [BAD],
    [None],
    {},
    {BAD: BAD},
    {"type": BAD},
    [[["x"]]],
]


def _value_paths(value, path=()):
    """The path of every value inside a JSON value (the body's own fields first)."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield (*path, k)
            yield from _value_paths(v, (*path, k))
    elif isinstance(value, list):
        for j, v in enumerate(value):
            yield (*path, j)
            yield from _value_paths(v, (*path, j))


def _has_surrogate(value) -> bool:
    return "\\ud" in json.dumps(value).lower()


def _fuzz(client, seed: int, count: int) -> None:
    rng = random.Random(seed)
    seen = {}
    for _ in range(count):
        route, body = rng.choice(BODIES)
        paths = list(_value_paths(body))
        path = rng.choice(paths)
        value = rng.choice(ALPHABET)
        body = _replaced(body, path, value)
        if route != "/detokenize" and isinstance(body.get("max_tokens"), int):
            body["max_tokens"] = min(body["max_tokens"], 2)  # (fast either way)
        r = _post(client, route, body)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        case = f"{route} {_named(path)} = {value!r}: {r.status_code} {r.text[:200]}"
        assert r.status_code in (200, 400, 404), case
        if r.status_code == 200:
            continue
        error = r.json()["error"]
        param, message = error["param"], error["message"]
        if _has_surrogate(value):  # the one bad string is named, wherever it lies
            assert r.status_code == 400 and param == path[0], case
            assert message.startswith(_named(path)), case
            assert "lone UTF-16 surrogate" in message, case
        else:  # a field of the body is named, and the message starts with it
            assert param is None or param in body or param == "body", case
            field = message.split(":")[0].split("[")[0].split(".")[0]
            assert field in body or field in ("body", "request"), case
    assert seen.get(400, 0) > count // 3, seen  # (most mutations are mistakes)


def test_fuzzed_bodies_never_get_a_500(client):
    _fuzz(client, seed=0, count=300)


@pytest.mark.slow
def test_fuzzed_bodies_never_get_a_500_many(client):
    _fuzz(client, seed=1, count=2000)


def test_the_library_names_a_prompt_that_is_not_text(tmp_path):
    # LLM.generate on a tokenizers tokenizer raised its TypeError ("TextInputSequence must
    # be str") for a lone surrogate
    from test_gguf import _model, write_gguf

    import paged_jax as pj
    from paged_jax.models import load_gguf

    path = tmp_path / "m.gguf"
    write_gguf(path, _model(vocab_size=300))
    model, tok = load_gguf(path)
    llm = pj.LLM(model, tok, page_size=8, num_pages=32, compilation_cache=False)
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt: not valid Unicode text"):
        llm.generate(["ok", "a" + BAD], progress=False)
    assert not llm.has_unfinished()  # all or nothing: "ok" was not left queued
