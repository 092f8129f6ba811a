"""``paged-jax serve`` in a real process on a free loopback port, driven by the official
``openai`` client: outputs equal to offline ``LLM.generate``, concurrent streams, a client
that disconnects, bad requests, SIGTERM. The model: a small random GGUF with a byte-level
vocabulary and a chat template (tests/test_gguf.py's writer)."""

import asyncio
import concurrent.futures
import json
import re
import signal
import socket
import subprocess
import sys
import time

import httpx2 as httpx
import numpy as np
import pytest
from test_gguf import _model, write_gguf
from test_tools import TIME

import paged_jax as pj
from paged_jax.models import load_gguf

openai = pytest.importorskip("openai")

KEY = "test-key"
NAME = "tiny"
ENGINE = dict(page_size=8, num_pages=256, max_num_seqs=16, compilation_cache=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("server") / "m.gguf"
    write_gguf(path, _model())
    port = _free_port()
    cmd = [sys.executable, "-m", "paged_jax.cli", "serve", "--model", str(path)]
    cmd += ["--served-model-name", NAME, "--port", str(port), "--api-key", KEY]
    cmd += ["--page-size", "8", "--num-pages", "256", "--max-num-seqs", "16"]
    cmd += ["--max-waiting", "64", "--compilation-cache", "off", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    seen = ""
    deadline = time.monotonic() + 180
    while "paged-jax: serving" not in seen:
        assert time.monotonic() < deadline and proc.poll() is None, seen
        seen += proc.stderr.readline()
    base = f"http://127.0.0.1:{port}"
    model, tokenizer = load_gguf(path)
    try:
        yield dict(base=base, proc=proc, model=model, tokenizer=tokenizer)
        # SIGTERM: requests in flight finish or are aborted, and the process exits 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def _client(server, key=KEY):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key=key, max_retries=0, timeout=120)


def _offline(server, prompts, params, chat=False):
    llm = pj.LLM(server["model"], server["tokenizer"], **ENGINE)
    if chat:
        return llm.chat(prompts, params, progress=False)
    return llm.generate(prompts, params, progress=False)


def _metrics(server) -> dict[str, float]:
    text = httpx.get(server["base"] + "/metrics").text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_completions_and_chat_equal_offline_generation_streamed_or_not(server):
    client = _client(server)
    params = pj.SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, n=2)
    want = _offline(server, ["Paged attention"], params)[0]
    kw = dict(model=NAME, prompt="Paged attention", max_tokens=12, temperature=0.8, top_p=0.9)
    got = client.completions.create(seed=7, n=2, **kw)
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [
        c.text for c in want.outputs
    ]
    assert got.usage.completion_tokens == sum(len(c.token_ids) for c in want.outputs)
    texts = {0: "", 1: ""}
    usage = None
    for chunk in client.completions.create(
        seed=7, n=2, stream=True, stream_options={"include_usage": True}, **kw
    ):
        for c in chunk.choices:
            texts[c.index] += c.text
        usage = chunk.usage or usage
    assert [texts[0], texts[1]] == [c.text for c in want.outputs]
    assert usage.prompt_tokens == len(want.prompt_token_ids)

    conversation = [{"role": "user", "content": "Hello there"}]
    greedy = pj.SamplingParams(max_tokens=10, temperature=0.0, logprobs=True)
    want = _offline(server, [conversation], greedy, chat=True)[0].outputs[0]
    got = client.chat.completions.create(
        model=NAME, messages=conversation, max_tokens=10, temperature=0.0, logprobs=True
    )
    assert got.choices[0].message.content == want.text
    assert got.choices[0].message.role == "assistant"
    assert [t.logprob for t in got.choices[0].logprobs.content] == pytest.approx(
        want.logprobs, abs=1e-5
    )
    text = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=NAME, messages=conversation, max_tokens=10, temperature=0.0, stream=True
        )
        if c.choices
    )
    assert text == want.text
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME]


@pytest.mark.slow  # 20 s; .ci/run runs it
def test_64_concurrent_streams_lose_nothing(server):
    prompts = [f"request {k}" for k in range(64)]
    params = [pj.SamplingParams(max_tokens=8, temperature=0.7, seed=k) for k in range(64)]
    want = [o.outputs[0].text for o in _offline(server, prompts, params)]

    async def one(client, k):
        text = ""
        stream = await client.completions.create(
            model=NAME, prompt=prompts[k], max_tokens=8, temperature=0.7, seed=k, stream=True
        )
        async for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
        return text

    async def run():
        client = openai.AsyncOpenAI(
            base_url=server["base"] + "/v1", api_key=KEY, max_retries=0, timeout=120
        )
        return await asyncio.wait_for(
            asyncio.gather(*(one(client, k) for k in range(64)), return_exceptions=True), 240
        )

    got = asyncio.run(run())
    assert [g for g in got if isinstance(g, BaseException)] == []
    assert got == want


def test_nothing_compiles_while_serving_after_the_start_up_warm_up(server):
    """Issue 51, item 1: ``serve`` compiles every step shape before it says it is ready,
    so bursts of requests of any length, greedy or sampled, streamed or not, scoring
    their prompts (``echo`` with log-probs) or with penalties, top log-probs and n > 1,
    compile nothing (each new shape cost a stall of a second or more per bucket)."""
    before = _metrics(server)["paged_jax_compiled_step_buckets"]
    assert before >= 1  # the warm-up's
    headers = {"Authorization": f"Bearer {KEY}"}
    rng = np.random.default_rng(3)

    def one(k: int) -> int:
        words = " ".join(["page"] * int(rng.integers(1, 60)))
        body = dict(model=NAME, max_tokens=int(rng.integers(1, 24)), stream=k % 2 == 0)
        body.update(temperature=0.0 if k % 3 else 0.9, top_p=1.0 if k % 4 else 0.8)
        if k % 5 == 0:
            url, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": words}]
        else:
            url, body["prompt"] = "/v1/completions", words
        chat = "messages" in body
        if k % 7 == 3 and not chat:  # scoring the prompt, as evaluation harnesses ask
            body.update(echo=True, logprobs=1, stream=False)
        elif k % 7 == 5:  # sampled extras: penalties, top log-probs, n > 1
            lp = dict(logprobs=True, top_logprobs=2) if chat else dict(logprobs=2)
            body.update(presence_penalty=0.5, n=2, stream=False, **lp)
        r = httpx.post(server["base"] + url, json=body, headers=headers, timeout=120)
        return r.status_code

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        assert set(pool.map(one, range(36))) == {200}
    assert _metrics(server)["paged_jax_compiled_step_buckets"] == before


def test_a_client_gone_mid_stream_frees_its_pages(server):
    before = _metrics(server).get(
        'paged_jax_requests_total{endpoint="completions",status="499"}', 0
    )
    body = dict(model=NAME, prompt="a long one", max_tokens=480, stream=True, ignore_eos=True)
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream(
        "POST", server["base"] + "/v1/completions", json=body, headers=headers, timeout=60
    ) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        assert _metrics(server)["paged_jax_kv_pages_used"] > 0
    deadline = time.monotonic() + 30  # the connection closed: the request is aborted
    while True:
        m = _metrics(server)
        key = 'paged_jax_requests_total{endpoint="completions",status="499"}'
        if m["paged_jax_kv_pages_used"] == 0 and m.get(key, 0) == before + 1:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.2)
    assert m["paged_jax_requests_in_flight"] == 0
    # the steps compiled so far (the serve benchmark counts those during measured runs)
    assert m["paged_jax_compiled_step_buckets"] >= 1 and m["paged_jax_compile_seconds"] > 0


@pytest.mark.parametrize(
    "body,status,param,message",
    [
        (dict(model="gpt-4"), 404, "model", "model: 'gpt-4' does not exist"),
        (dict(max_tokens=-3), 400, "max_tokens", "max_tokens: expected an int >= 1, got -3"),
        (dict(temperature="hot"), 400, "temperature", "temperature: expected a number, got 'hot'"),
        (dict(prompt=[1.5]), 400, "prompt", "prompt: expected a string or a list of token ids"),
        (dict(prompt=[7] * 5000), 400, "prompt", "prompt: 5000 tokens, the model's maximum"),
        (dict(n="2"), 400, "n", "n: expected an int, got '2'"),
        (dict(logprobs=25), 400, "logprobs", "logprobs: expected an int in [0, 20], got 25"),
        (
            dict(response_format={"type": "xml"}),
            400,
            "response_format",
            "response_format.type: expected one of 'text', 'json_object' or 'json_schema', "
            "got 'xml'",
        ),
        (
            dict(response_format=False),
            400,
            "response_format",
            "response_format: expected an object, got False",
        ),
        (dict(echo="yes"), 400, "echo", "echo: expected a bool, got 'yes'"),
        (
            dict(logit_bias={"5": 300}),
            400,
            "logit_bias",
            "logit_bias['5']: expected a float in [-100, 100], got 300",
        ),
        (
            dict(logit_bias={"5": 1, "9999": 1}),
            400,
            "logit_bias",
            "logit_bias: token ids must lie in",
        ),
        (dict(max_tokens=0), 400, "max_tokens", "max_tokens: expected an int >= 1, got 0"),
        # issue 51, item 2: the engine used to cap it silently (a newcomer's 1,000,000
        # decoded for minutes)
        (
            dict(prompt=[7] * 10, max_tokens=1_000_000),
            400,
            "max_tokens",
            "max_tokens: the prompt's 10 tokens and max_tokens 1000000 make 1000010, more "
            "than the model's maximum length of 512 tokens",
        ),
    ],
)
def test_bad_requests_get_their_status_and_the_server_goes_on(server, body, status, param, message):
    full = dict(model=NAME, prompt="hi", max_tokens=4) | body
    r = httpx.post(
        server["base"] + "/v1/completions", json=full, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(message), error
    ok = _client(server).completions.create(model=NAME, prompt="hi", max_tokens=2)
    assert ok.choices[0].finish_reason == "length"


def test_top_k_minus_one_is_every_token_as_vllm_reads_it(server):
    def complete(top_k):
        body = dict(model=NAME, prompt="hi", max_tokens=6, temperature=1.0, seed=7, top_k=top_k)
        headers = {"Authorization": f"Bearer {KEY}"}
        return httpx.post(server["base"] + "/v1/completions", json=body, headers=headers)

    a, b = complete(-1), complete(0)
    assert a.status_code == b.status_code == 200, a.text
    assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]
    bad = complete(-2)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_k", bad.text


def test_openai_and_vllm_conformance(server):
    """Issue 51, item 2: unknown roles, routes and methods, and invalid JSON are OpenAI
    JSON errors that say what is wrong; vLLM's /tokenize and /detokenize (its benchmark
    client calls /tokenize first) agree with the tokenizer and with generation."""
    headers = {"Authorization": f"Bearer {KEY}"}
    base, tok = server["base"], server["tokenizer"]

    def post(path, headers=headers, **kw):
        return httpx.post(base + path, headers=headers, **kw)

    messages = [{"role": "wizard", "content": "hi"}]
    r = post("/v1/chat/completions", json=dict(model=NAME, messages=messages))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("messages[0].role: expected one of ")
    json_type = headers | {"content-type": "application/json"}
    r = post("/v1/completions", content=b'{"model": "x", "prompt": }', headers=json_type)
    assert r.status_code == 400
    assert (
        r.json()["error"]["message"] == "body: invalid JSON (Expecting value at line 1, column 26)"
    )
    r = httpx.get(base + "/v1/nothing-here", headers=headers)
    assert (
        r.status_code == 404 and r.json()["error"]["message"] == "/v1/nothing-here: no such route"
    )
    r = httpx.get(base + "/v1/completions", headers=headers)
    assert r.status_code == 405 and r.json()["error"]["code"] == 405
    assert "allow" in r.headers
    # /tokenize: a prompt with and without special tokens, and a conversation
    r = post("/tokenize", json=dict(model=NAME, prompt="paged attention"))
    assert r.status_code == 200, r.text
    ids = list(tok.encode("paged attention").ids)
    assert r.json() == dict(count=len(ids), max_model_len=512, tokens=ids, token_strs=None)
    r = post("/tokenize", json=dict(prompt="paged attention", add_special_tokens=False))
    assert r.json()["tokens"] == list(tok.encode("paged attention", add_special_tokens=False).ids)
    chat = [{"role": "user", "content": "hi"}]
    r = post("/tokenize", json=dict(model=NAME, messages=chat))
    assert r.json()["tokens"] == list(tok.apply_chat_template(chat, tokenize=True))
    r = post("/detokenize", json=dict(model=NAME, tokens=ids))
    assert r.status_code == 200 and r.json() == {"prompt": tok.decode(ids)}
    for path, body, param in (
        ("/tokenize", dict(prompt=3), "prompt"),
        ("/detokenize", dict(tokens=[-1]), "tokens"),
        ("/detokenize", dict(tokens="abc"), "tokens"),
    ):
        r = post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert post("/tokenize", json=dict(model="gpt-4", prompt="x")).status_code == 404
    assert httpx.post(base + "/tokenize", json=dict(prompt="x")).status_code == 401
    # /tokenizer_info: what lm-evaluation-harness's remote tokenizer reads (it needs
    # "eos_token", then encodes it through /tokenize without special tokens)
    r = httpx.get(base + "/tokenizer_info", headers=headers)
    info = r.json()
    assert r.status_code == 200 and info["chat_template"] == tok.chat_template
    assert info["eos_token"] == tok.special_tokens["eos_token"]
    assert info["model_max_length"] == 512
    eos = post("/tokenize", json=dict(prompt=info["eos_token"], add_special_tokens=False))
    assert eos.json()["tokens"] == [tok.token_to_id(info["eos_token"])]
    assert httpx.get(base + "/tokenizer_info").status_code == 401


def test_logit_bias_steers_the_tokens_as_offline(server):
    """OpenAI's ``logit_bias`` (JSON's string keys): a ban and a push, as
    ``SamplingParams.logit_bias`` gives offline."""
    client = _client(server)
    kw = dict(model=NAME, prompt="Paged attention", max_tokens=6, temperature=0.0)
    free = client.completions.create(**kw).choices[0].text
    first = server["tokenizer"].encode(free, add_special_tokens=False).ids[0]
    bias = {str(first): -100, "66": 5}
    want = _offline(
        server,
        ["Paged attention"],
        pj.SamplingParams(max_tokens=6, logit_bias={first: -100, 66: 5}),
    )[0].outputs[0]
    got = client.completions.create(logit_bias=bias, **kw).choices[0].text
    assert got == want.text and got != free and first not in want.token_ids


def test_min_tokens_and_stop_token_ids_as_offline(server):
    """vLLM's ``stop_token_ids`` and ``min_tokens`` extensions: the first greedy token as
    a stop token ends the text at once, unless ``min_tokens`` holds it back."""
    client = _client(server)
    kw = dict(model=NAME, prompt="Paged attention", max_tokens=8, temperature=0.0)
    first = _offline(server, ["Paged attention"], pj.SamplingParams(max_tokens=1))[0]
    stop = first.outputs[0].token_ids[0]
    want = _offline(
        server,
        ["Paged attention"],
        pj.SamplingParams(max_tokens=8, stop_token_ids=(stop,), min_tokens=3),
    )[0].outputs[0]
    at_once = client.completions.create(extra_body={"stop_token_ids": [stop]}, **kw).choices[0]
    # (a stop token stays in the output: its text, if it has one, is all there is)
    assert at_once.text == first.outputs[0].text and at_once.finish_reason == "stop"
    body = {"stop_token_ids": [stop], "min_tokens": 3}
    held = client.completions.create(extra_body=body, **kw).choices[0]
    assert held.text == want.text and len(want.token_ids) >= 3
    assert stop not in want.token_ids[:3]
    r = httpx.post(
        server["base"] + "/v1/completions",
        json=dict(kw, min_tokens=9),
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text


def test_prompt_logprobs_as_vllm_returns_them(server):
    """vLLM's ``prompt_logprobs`` extension: per choice (completions) or beside the
    choices (chat), None for the first prompt token, then each token's log-prob and its
    position's most likely tokens, keyed by token id; refused with a stream."""
    headers = {"Authorization": f"Bearer {KEY}"}
    want = _offline(server, ["Paged attention"], pj.SamplingParams(max_tokens=2, prompt_logprobs=2))
    body = dict(model=NAME, prompt="Paged attention", max_tokens=2, prompt_logprobs=2)
    r = httpx.post(server["base"] + "/v1/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["prompt_logprobs"]
    w = want[0]
    assert len(got) == len(w.prompt_token_ids) and got[0] is None
    for t in range(1, len(got)):
        token = str(w.prompt_token_ids[t])
        assert got[t][token]["logprob"] == pytest.approx(w.prompt_logprobs[t], abs=1e-5)
        best = [str(a) for a, _ in w.prompt_top_logprobs[t]]
        assert set(got[t]) == {token, *best}  # the token itself and the top 2
    chat = dict(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    r = httpx.post(
        server["base"] + "/v1/chat/completions", json=chat | {"prompt_logprobs": 0},
        headers=headers,
    )  # fmt: skip
    scored = r.json()["prompt_logprobs"]
    assert r.status_code == 200 and scored[0] is None and all(len(d) == 1 for d in scored[1:])
    for bad in (dict(prompt_logprobs=21), dict(prompt_logprobs=1, stream=True)):
        r = httpx.post(server["base"] + "/v1/completions", json=body | bad, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_echo_scores_the_prompt_as_evaluation_harnesses_ask(server):
    """``echo`` with ``logprobs`` on /v1/completions: the prompt's tokens, their
    log-probs (the first None) and top log-probs, then the generated token's, as
    lm-evaluation-harness's ``local-completions`` asks for a log-likelihood (token-id
    prompts, ``max_tokens`` 1, ``logprobs`` 1, ``echo``) and reads them back
    (``token_logprobs[ctxlen:-1]``, greedy when each equals its position's best)."""
    tok = server["tokenizer"]
    ctx, cont = [5, 17, 42, 8, 99, 3], [13, 21, 13]
    prompts = [ctx + cont, [7, 8, 9]]
    greedy = pj.SamplingParams(max_tokens=1, logprobs=True, prompt_logprobs=1)
    want = _offline(server, prompts, greedy)
    body = dict(model=NAME, prompt=prompts, temperature=0, max_tokens=1, logprobs=1, echo=True)
    r = httpx.post(
        server["base"] + "/v1/completions", json=body | {"seed": 1234},
        headers={"Authorization": f"Bearer {KEY}"},
    )  # fmt: skip
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for choice, w in zip(choices, want, strict=True):
        lp = choice["logprobs"]
        ids = w.prompt_token_ids
        assert len(lp["tokens"]) == len(ids) + 1 == len(lp["top_logprobs"])
        assert lp["tokens"][: len(ids)] == [tok.decode([t]) for t in ids]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1:-1] == pytest.approx(w.prompt_logprobs[1:], abs=1e-5)
        assert lp["token_logprobs"][-1] == pytest.approx(w.outputs[0].logprobs[0], abs=1e-5)
        assert choice["text"] == tok.decode(ids) + w.outputs[0].text
        assert all(len(d) == 1 for d in lp["top_logprobs"][1:])  # (logprobs 1)
    lp = choices[0]["logprobs"]
    is_greedy = all(
        t == max(d.values())
        for t, d in zip(lp["token_logprobs"][len(ctx) : -1], lp["top_logprobs"][len(ctx) : -1],
                        strict=True)
    )  # fmt: skip
    best = [top[0][0] for top in want[0].prompt_top_logprobs[len(ctx) :]]
    assert is_greedy == (best == cont)
    assert sum(lp["token_logprobs"][len(ctx) : -1]) == pytest.approx(
        sum(want[0].prompt_logprobs[len(ctx) :]), abs=1e-4
    )
    # echo with max_tokens 0: the prompt alone, and its log-probs
    client = _client(server)
    got = client.completions.create(
        model=NAME, prompt="Paged attention", max_tokens=0, echo=True, logprobs=2
    )
    c = got.choices[0]
    assert c.text == "Paged attention" and c.finish_reason == "length"
    assert got.usage.completion_tokens == 0
    n = got.usage.prompt_tokens
    assert len(c.logprobs.tokens) == n and c.logprobs.token_logprobs[0] is None
    # (keyed by text: two tokens of the same text, bytes of a character, share a key)
    assert all(1 <= len(d) <= 2 for d in c.logprobs.top_logprobs[1:])
    # streamed: the echo first, then the generated text; the same log-probs
    kw = dict(model=NAME, prompt="Paged attention", max_tokens=4, echo=True, logprobs=0)
    whole = client.completions.create(temperature=0.0, **kw).choices[0]
    assert whole.text.startswith("Paged attention") and len(whole.text) > len("Paged attention")
    chunks = list(client.completions.create(temperature=0.0, stream=True, **kw))
    texts = [c.text for ch in chunks for c in ch.choices]
    assert texts[0] == "Paged attention" and "".join(texts) == whole.text
    streamed = [
        x for ch in chunks for c in ch.choices if c.logprobs for x in c.logprobs.token_logprobs
    ]
    assert streamed[0] is None
    assert streamed[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-5)
    assert whole.logprobs.top_logprobs is None
    r = httpx.post(
        server["base"] + "/v1/chat/completions",
        json=dict(model=NAME, messages=[{"role": "user", "content": "hi"}], echo=True),
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text


def test_top_logprobs_streamed_or_not_equal_the_engines(server):
    """Issue 51, item 2: top log-probabilities and log-probabilities in streams (both
    refused before), completions and chat, against the engine's own outputs."""
    client, tok = _client(server), server["tokenizer"]
    greedy = pj.SamplingParams(max_tokens=8, ignore_eos=True, top_logprobs=3)
    want = _offline(server, ["Paged attention"], greedy)[0].outputs[0]
    assert len(want.top_logprobs) == 8 and all(len(t) == 3 for t in want.top_logprobs)
    kw = dict(model=NAME, prompt="Paged attention", max_tokens=8, temperature=0.0)
    got = client.completions.create(logprobs=3, extra_body={"ignore_eos": True}, **kw)
    lp = got.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert lp.tokens == [tok.decode([t]) for t in want.token_ids]
    assert [len(d) <= 3 for d in lp.top_logprobs] == [True] * 8
    assert lp.text_offset[0] == 0
    streamed, offsets = [], []
    for chunk in client.completions.create(
        logprobs=3, stream=True, extra_body={"ignore_eos": True}, **kw
    ):
        for c in chunk.choices:
            if c.logprobs:
                streamed += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
    assert streamed == pytest.approx(want.logprobs, abs=1e-5)
    assert offsets == lp.text_offset
    conversation = [{"role": "user", "content": "Hello there"}]
    chat_params = pj.SamplingParams(max_tokens=6, top_logprobs=2)
    want = _offline(server, [conversation], chat_params, chat=True)[0].outputs[0]
    ckw = dict(model=NAME, messages=conversation, max_tokens=6, temperature=0.0)
    entries = []
    for chunk in client.chat.completions.create(logprobs=True, top_logprobs=2, stream=True, **ckw):
        for c in chunk.choices:
            if c.logprobs and c.logprobs.content:
                entries += c.logprobs.content
    assert [e.logprob for e in entries] == pytest.approx(want.logprobs, abs=1e-5)
    for e, top in zip(entries, want.top_logprobs, strict=True):
        assert [a.logprob for a in e.top_logprobs] == pytest.approx([b for _, b in top], abs=1e-5)
    bad = httpx.post(
        server["base"] + "/v1/chat/completions",
        json=dict(ckw, top_logprobs=2),
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert bad.status_code == 400 and "needs logprobs: true" in bad.text


@pytest.mark.parametrize(
    "body, message",
    [
        (dict(n=17), "n: 17 sequences, more than max_num_seqs=16"),
        (dict(n=16, max_tokens=400), "request needs up to"),
    ],
)
def test_refusals_by_the_engines_limits_come_before_a_stream_starts(server, body, message):
    """Issue 56, item 9: they came from the engine thread after the stream had begun
    (HTTP 200, an error event, [DONE]); the same request unstreamed got a 400."""
    full = dict(model=NAME, prompt="hi", max_tokens=4, stream=True) | body
    r = httpx.post(
        server["base"] + "/v1/completions", json=full, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"] and r.json()["error"]["param"] == (
        "n" if "n:" in message else None
    )


def test_cross_site_requests_are_refused(server):
    """Issue 56, item 7: a "simple" cross-site request (text/plain, no CORS preflight)
    was served, and a DNS-rebinding page's Host header was not checked."""
    body = b'{"model": "%s", "prompt": "hi", "max_tokens": 2}' % NAME.encode()
    auth = {"Authorization": f"Bearer {KEY}"}
    for kind in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = dict(auth) | ({} if kind is None else {"content-type": kind})
        r = httpx.post(server["base"] + "/v1/completions", content=body, headers=headers)
        assert r.status_code == 415, (kind, r.text)
        assert "expected Content-Type application/json" in r.json()["error"]["message"]
    ok = auth | {"content-type": "application/json; charset=utf-8"}
    assert (
        httpx.post(server["base"] + "/v1/completions", content=body, headers=ok).status_code == 200
    )
    evil = ok | {"host": "attacker.example"}
    r = httpx.post(server["base"] + "/v1/completions", content=body, headers=evil)
    assert r.status_code == 400
    from paged_jax.server import default_allowed_hosts

    assert default_allowed_hosts("0.0.0.0") is None
    assert "localhost" in default_allowed_hosts("127.0.0.1")


def test_a_wrong_api_key_gets_401(server):
    with pytest.raises(openai.AuthenticationError):
        _client(server, key="wrong").completions.create(model=NAME, prompt="hi", max_tokens=2)
    r = httpx.post(server["base"] + "/v1/chat/completions", json={})
    assert r.status_code == 401 and "api key" in r.json()["error"]["message"]
    assert httpx.get(server["base"] + "/health").json() == {"status": "ok"}


def test_a_full_waiting_queue_answers_429():
    """In process (Starlette's test client): with room for one running and one waiting
    request, both taken, a third is refused."""
    from starlette.testclient import TestClient

    from paged_jax import models
    from paged_jax.server.api import Server

    model, tokenizer = models.load("tiny-llama")
    llm = pj.LLM(model, tokenizer, num_pages=64, max_num_seqs=1, compilation_cache=False)
    app = Server(llm, model_name="t", max_waiting=1)
    long = pj.SamplingParams(max_tokens=300, ignore_eos=True)
    with TestClient(app.app) as client:
        events = []
        for rid in ("a", "b"):
            app.loop.submit(rid, [1, 2, 3], long, events.append)
        r = client.post("/v1/completions", json=dict(model="t", prompt="x", max_tokens=2))
        assert r.status_code == 429, r.text
        assert r.json()["error"]["type"] == "rate_limit_error"
        metrics = client.get("/metrics").text
    assert re.search(r'paged_jax_requests_total\{endpoint="completions",status="429"\} 1', metrics)
    # the server stopped with "b" (or both) unfinished: they were told why
    assert any(e.kind == "error" and e.status == 503 for e in events), events


def test_serve_flags_are_checked(capsys):
    from paged_jax import cli

    assert cli.main(["serve", "--port", "70000"]) == 2
    assert "--port: expected an int in [0, 65535], got 70000" in capsys.readouterr().err


def test_a_port_in_use_is_one_line_before_the_model_loads(capsys, monkeypatch):
    """Issue 51, item 2: it used to take the model's load, then a 50-line traceback."""
    from paged_jax import cli

    def no_load(*a, **kw):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(cli.serve, "load_model", no_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["serve", "--port", str(port), "--model", "tiny-llama"]) == 2
    err = capsys.readouterr().err
    assert f"--port: {port} on 127.0.0.1 is in use by another program" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.failing_steps
def test_a_step_that_stops_the_engine_fails_its_requests_and_the_server_goes_on(monkeypatch):
    """Issue 56, item 2: a fault while a step's results are applied stops the engine. Its
    requests get a 500, the engine is reset, and requests arriving meanwhile and afterwards
    are served (the engine thread used to die on the next add_request, EngineFailedError,
    and the server then accepted requests it never answered)."""
    import queue

    from paged_jax import models
    from paged_jax.server.loop import EngineLoop

    model, tokenizer = models.load("tiny-llama")
    llm = pj.LLM(model, tokenizer, num_pages=64, compilation_cache=False)
    real, faults = llm.engine.applier.process, [RuntimeError("while applying")]
    events = {rid: queue.Queue() for rid in ("a", "b", "c", "d")}
    params = pj.SamplingParams(max_tokens=3, ignore_eos=True)

    def process(*a, **k):
        if faults:  # while the step fails, a request and an abort arrive
            loop.submit("b", [4, 5, 6], params, events["b"].put)
            loop.abort("a")
            raise faults.pop()
        return real(*a, **k)

    monkeypatch.setattr(llm.engine.applier, "process", process)
    loop = EngineLoop(llm)
    loop.start()
    try:
        loop.submit("a", [1, 2, 3], params, events["a"].put)
        event = events["a"].get(timeout=60)  # running when the engine stopped: told so
        assert (event.kind, event.status) == ("error", 500), event
        assert "the engine failed" in event.message and "while applying" in event.message
        # "b", which arrived while the step failed, reaches the reset engine: served
        done = events["b"].get(timeout=60)
        assert done.kind == "done" and len(done.output.outputs[0].token_ids) == 3, done
        for rid in ("c", "d"):  # later ones too, an abort too
            loop.submit(rid, [4, 5, 6], params, events[rid].put)
        loop.abort("d")
        done = events["c"].get(timeout=60)
        assert done.kind == "done" and len(done.output.outputs[0].token_ids) == 3, done
        assert loop.alive and loop.in_flight == 0
    finally:
        loop.stop()


def test_a_second_loop_on_the_same_engine_is_refused_until_the_first_stops():
    """Two servers on one LLM ran two engine threads on it: a step used buffers the
    other's step had donated (500s, and a process that could die). The second loop's
    start is refused with the reason; once the first stops, it runs."""
    from paged_jax import models
    from paged_jax.server.loop import EngineLoop

    model, tokenizer = models.load("tiny-llama")
    llm = pj.LLM(model, tokenizer, num_pages=64, compilation_cache=False)
    first, second = EngineLoop(llm), EngineLoop(llm)
    first.start()
    try:
        with pytest.raises(RuntimeError, match="another EngineLoop .another server. runs this"):
            second.start()
        assert not second.alive
    finally:
        first.stop()
    second.start()
    second.stop()


def test_the_gauges_see_a_step_before_its_answers_are_delivered():
    """/metrics scraped right after an answer arrived showed the step before it (CI:
    paged_jax_spec_decode_draft_tokens 18 while the engine had counted 19): on_step ran
    after the step's outputs were delivered."""
    import queue

    from paged_jax import models
    from paged_jax.server.loop import EngineLoop

    model, tokenizer = models.load("tiny-llama")
    llm = pj.LLM(model, tokenizer, num_pages=64, compilation_cache=False)
    seen, at_done, events = [], [], queue.Queue()

    def notify(event):  # engine thread: what the gauges had when the answer went out
        if event.kind == "done":
            at_done.append((seen[-1] if seen else 0, llm.metrics.steps))
        events.put(event)

    loop = EngineLoop(llm, on_step=lambda llm: seen.append(llm.metrics.steps))
    loop.start()
    try:
        loop.submit("a", [1, 2, 3], pj.SamplingParams(max_tokens=4, ignore_eos=True), notify)
        assert events.get(timeout=60).kind == "done"
    finally:
        loop.stop()
    assert at_done and at_done[0][0] == at_done[0][1] > 0, at_done


def _in_process(max_request_bytes=None, scheduling_policy="fcfs", **kw):
    """A Server on tiny-llama with its engine thread started (no HTTP socket)."""
    from paged_jax import models
    from paged_jax.server.api import Server

    model, tokenizer = models.load("tiny-llama")
    llm = pj.LLM(
        model, tokenizer, num_pages=64, compilation_cache=False,
        scheduling_policy=scheduling_policy,
    )  # fmt: skip
    app = Server(llm, model_name="t", max_request_bytes=max_request_bytes, **kw)
    app.loop.start()
    return app


def test_a_body_over_the_limit_is_refused_before_it_is_read_whole():
    """Issue 56, item 3: bodies were read whole, whatever their size."""
    app = _in_process(max_request_bytes=4096)

    async def go():
        transport = httpx.ASGITransport(app=app.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            big = dict(model="t", prompt="x" * 5000, max_tokens=2)
            declared = await client.post("/v1/completions", json=big)

            async def chunks():  # no Content-Length: counted as it arrives
                for _ in range(10):
                    yield b" " * 1000

            streamed = await client.post(
                "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
            )
            small = await client.post(
                "/v1/completions", json=dict(model="t", prompt="hi", max_tokens=2)
            )
            return declared, streamed, small

    try:
        declared, streamed, small = asyncio.run(go())
    finally:
        app.loop.stop()
    for r in (declared, streamed):
        assert r.status_code == 413, r.text
        assert r.json()["error"]["message"] == (
            "body: larger than this server's limit of 4096 bytes (--max-request-bytes)"
        )
    assert small.status_code == 200, small.text
    with pytest.raises(ValueError, match="max_request_bytes: expected an int >= 1024, got 10"):
        from paged_jax.server.api import Server

        Server(app.llm, model_name="t", max_request_bytes=10)


def test_tokenizing_a_prompt_does_not_hold_up_other_routes(monkeypatch):
    """Issue 56, item 3: prompts were tokenized (and chat templates rendered) on the event
    loop, so a large one froze every route; /health now answers while one is tokenized."""
    import threading

    app = _in_process()
    encode, started, began = app.llm.encode, threading.Event(), []

    def slow_encode(prompt):
        began.append(time.perf_counter())
        started.set()
        time.sleep(1.5)
        return encode(prompt)

    monkeypatch.setattr(app.llm, "encode", slow_encode)

    async def go():
        transport = httpx.ASGITransport(app=app.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            body = dict(model="t", prompt="a slow prompt", max_tokens=2)
            completion = asyncio.create_task(client.post("/v1/completions", json=body))
            while not started.is_set():
                await asyncio.sleep(0.01)
            health = await client.get("/health")
            waited = time.perf_counter() - began[0]  # from the tokenizing's start
            return health, waited, await completion

    try:
        health, waited, completion = asyncio.run(go())
    finally:
        app.loop.stop()
    assert health.status_code == 200 and waited < 0.75, waited  # over 1.5 s on the loop before
    assert completion.status_code == 200, completion.text


def test_requests_are_refused_while_the_engine_thread_is_not_running():
    # /health says 503 then; /v1 answered nothing and waited for 429 before (item 2)
    import threading

    from starlette.testclient import TestClient

    from paged_jax import models
    from paged_jax.server.api import Server

    model, tokenizer = models.load("tiny-llama")
    app = Server(pj.LLM(model, tokenizer, num_pages=64, compilation_cache=False), model_name="t")
    app.loop._thread = threading.Thread(target=lambda: None)  # an engine thread that ends
    with TestClient(app.app) as client:
        app.loop._thread.join(10)
        r = client.post("/v1/completions", json=dict(model="t", prompt="hi", max_tokens=2))
        assert r.status_code == 503 and "engine thread is not running" in r.text, r.text
        assert client.get("/health").status_code == 503


def test_client_mistakes_that_were_500s_get_400s():
    # Issue 56, item 8: 100,000 nested arrays (200 kB, under the default limit) were a
    # RecursionError, and a completions prompt holding a lone UTF-16 surrogate (valid
    # JSON) a UnicodeEncodeError, each a 500 with a traceback.
    app = _in_process()

    async def go():
        transport = httpx.ASGITransport(app=app.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            deep = await client.post(
                "/v1/completions",
                content=b"[" * 100_000 + b"]" * 100_000,
                headers={"content-type": "application/json"},
            )
            surrogate = await client.post(
                "/v1/completions",
                content=b'{"model": "t", "prompt": "abc\\ud800", "max_tokens": 2}',
                headers={"content-type": "application/json"},
            )
            return deep, surrogate

    try:
        deep, surrogate = asyncio.run(go())
    finally:
        app.loop.stop()
    assert deep.status_code == 400 and deep.json()["error"]["message"] == "body: nested too deeply"
    assert surrogate.status_code == 400, surrogate.text
    error = surrogate.json()["error"]
    assert error["param"] == "prompt" and error["message"].startswith("prompt: not valid Unicode")


def test_allowed_token_ids_restrict_a_completion():
    # vLLM's extension field, mapped to SamplingParams.allowed_token_ids (tiny-llama's
    # tokens 0-255 are bytes: only "a" and "b" may come out)
    app = _in_process()

    async def go():
        transport = httpx.ASGITransport(app=app.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            body = dict(model="t", prompt="x", max_tokens=12, temperature=1.0, seed=3)
            ok = await client.post("/v1/completions", json=dict(body, allowed_token_ids=[97, 98]))
            bad = await client.post("/v1/completions", json=dict(body, allowed_token_ids=[]))
            return ok, bad

    try:
        ok, bad = asyncio.run(go())
    finally:
        app.loop.stop()
    assert ok.status_code == 200, ok.text
    text = ok.json()["choices"][0]["text"]
    assert text and set(text) <= {"a", "b"}, text
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "allowed_token_ids"


def test_idle_slow_and_surplus_connections_are_closed():
    """Issue 56, item 4: a connection that sent nothing, or part of a request's headers,
    stayed open forever (1,100 of them exhausted the descriptors), and a body could
    trickle in as slowly as its sender liked. Over a real socket: headers late, headers
    cut short, a body late (408), a connection beyond the cap, a kept-alive connection
    gone quiet mid-headers; the server answers normally throughout."""
    import socket
    import threading

    import uvicorn

    from paged_jax.server.connections import bounded_protocol

    app = _in_process(body_timeout=0.5)
    port = _free_port()
    cap = 4
    config = uvicorn.Config(
        app.app,
        host="127.0.0.1",
        port=port,
        http=bounded_protocol(0.6, cap),
        log_level="error",
        lifespan="off",
    )
    runner = uvicorn.Server(config)
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not runner.started:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.02)

    def connect():
        c = socket.create_connection(("127.0.0.1", port), timeout=5)
        return c

    def closed_after(c, t0=None):  # (seconds until the server closed c, what it sent)
        t0 = time.monotonic() if t0 is None else t0
        got = b""
        while chunk := c.recv(4096):
            got += chunk
        c.close()
        return time.monotonic() - t0, got

    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    try:
        t0 = time.monotonic()
        silent = connect()
        partial = connect()
        partial.sendall(head)
        for c in (silent, partial):
            waited, got = closed_after(c, t0)
            assert 0.5 < waited < 3 and got == b""
        slow = connect()
        slow.sendall(
            head + b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"model"'
        )
        waited, got = closed_after(slow)
        assert waited < 3 and got.startswith(b"HTTP/1.1 408"), got[:200]
        assert b"arrived in 0.5 s, the rest did not (--body-timeout)" in got
        idle = [connect() for _ in range(cap)]
        time.sleep(0.1)
        extra = connect()
        waited, got = closed_after(extra)  # at once, not after the header deadline
        assert waited < 0.3 and got == b""
        for c in idle:
            c.close()
        time.sleep(0.1)
        kept = connect()  # one request answered, then part of another: closed
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        first = kept.recv(4096)
        assert first.startswith(b"HTTP/1.1 200"), first
        kept.sendall(b"GET /health HTTP/1.1\r\n")
        waited, got = closed_after(kept)
        assert waited < 3 and got == b""
        r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
        assert r.status_code == 200, r.text
    finally:
        runner.should_exit = True
        thread.join(30)
        app.loop.stop()
    with pytest.raises(ValueError, match="header_timeout: expected seconds > 0, got 0"):
        bounded_protocol(0, 4)
    with pytest.raises(ValueError, match="body_timeout: expected seconds > 0, got -1"):
        from paged_jax.server.api import Server

        Server(app.llm, model_name="t", body_timeout=-1)


def test_structured_output_through_the_openai_client(server):
    """Issue 54: response_format json_schema (streamed or not), vLLM's structured_outputs
    choice, and a schema the grammar library refuses (400 naming it)."""
    client = _client(server)
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}
    msgs = [{"role": "user", "content": "a number"}]
    r = client.chat.completions.create(
        model=NAME, messages=msgs, max_tokens=40, response_format=fmt
    )
    assert r.choices[0].finish_reason == "stop"
    assert set(json.loads(r.choices[0].message.content)) == {"n"}
    text = ""
    for chunk in client.chat.completions.create(
        model=NAME,
        messages=msgs,
        max_tokens=40,
        response_format=fmt,
        stream=True,
        seed=3,
        temperature=1.0,
    ):
        text += chunk.choices[0].delta.content or "" if chunk.choices else ""
    assert 0 <= json.loads(text)["n"] <= 99
    c = client.completions.create(
        model=NAME,
        prompt="pick",
        max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["on", "off"]}},
    )
    assert c.choices[0].text in ("on", "off")
    headers = {"Authorization": f"Bearer {KEY}"}
    bad = dict(
        model=NAME,
        prompt="x",
        response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}},
    )
    r = httpx.post(server["base"] + "/v1/completions", json=bad, headers=headers, timeout=60)
    error = r.json()["error"]  # named as the request named it
    assert r.status_code == 400 and error["param"] == "response_format", error
    assert error["message"] == "response_format: Invalid type: nonsense"


def test_speculative_decoding_counters_reach_metrics():
    from starlette.testclient import TestClient

    from paged_jax import models
    from paged_jax.server.api import Server

    model, tokenizer = models.load("tiny-llama")
    spec = {"num_speculative_tokens": 4, "prompt_lookup_min": 1}
    llm = pj.LLM(model, tokenizer, num_pages=64, max_num_seqs=2, speculative=spec)
    plain = pj.LLM(model, tokenizer, num_pages=64, max_num_seqs=2)
    prompt = "one two three one two three one two three"
    want = plain.generate([prompt], pj.SamplingParams(max_tokens=40), progress=False)
    app = Server(llm, model_name="t")
    with TestClient(app.app) as client:
        body = dict(model="t", prompt=prompt, max_tokens=40, temperature=0)
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want[0].outputs[0].text
        text = client.get("/metrics").text
    values = dict(
        line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("paged_jax_spec")
    )
    m = llm.metrics
    assert m.spec_draft_tokens > 0
    assert float(values["paged_jax_spec_decode_draft_tokens"]) == m.spec_draft_tokens
    assert float(values["paged_jax_spec_decode_accepted_tokens"]) == m.spec_accepted_tokens
    rate = float(values["paged_jax_spec_decode_acceptance_rate"])
    assert rate == pytest.approx(m.spec_accepted_tokens / m.spec_draft_tokens)


def test_tool_calls_through_the_openai_client(server):
    """Issue 54, item 4: a named tool choice, plain and streamed, read by the openai
    client's own types (the call's name, its arguments as JSON, finish_reason)."""
    client = _client(server)
    choice = {"type": "function", "function": {"name": "get_time"}}
    msgs = [{"role": "user", "content": "time?"}]
    kw = dict(model=NAME, messages=msgs, max_tokens=120, tools=[TIME], tool_choice=choice)
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.function.name == "get_time" and call.id.startswith("call_")
    assert json.loads(call.function.arguments)["zone"] in ("utc", "cet")
    name, args, finish, pieces = "", "", None, 0
    for chunk in client.chat.completions.create(**kw, stream=True):
        for d in chunk.choices[0].delta.tool_calls or []:
            assert d.index == 0
            name += d.function.name or ""
            args += d.function.arguments or ""
            pieces += bool(d.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    assert name == "get_time" and json.loads(args)["zone"] in ("utc", "cet")
    assert finish == "tool_calls" and pieces > 1  # the arguments as they were written
    # the client's own accumulator of streamed deltas (ChatCompletionStreamState)
    with client.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "get_time" and call.id.startswith("call_")
    assert json.loads(call.function.arguments)["zone"] in ("utc", "cet")
    assert final.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_request_s_priority_reaches_the_engine_or_is_refused(policy, monkeypatch):
    # vLLM's "priority" field: with --scheduling-policy priority it is the request's
    # (lower first); first come, first served refuses any but 0; a non-integer is a 400
    app = _in_process(scheduling_policy=policy)
    seen = []
    add = app.llm.add_request
    monkeypatch.setattr(
        app.llm, "add_request", lambda *a, **kw: (seen.append(kw.get("priority", 0)), add(*a, **kw))
    )

    async def go():
        transport = httpx.ASGITransport(app=app.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            body = dict(model="t", prompt="x", max_tokens=4, temperature=0.0)
            return [
                await client.post("/v1/completions", json=dict(body, priority=p))
                for p in (-3, 0, "high", True)
            ]

    try:
        urgent, plain, text, flag = asyncio.run(go())
    finally:
        app.loop.stop()
    assert plain.status_code == 200, plain.text
    for r in (text, flag):
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
    if policy == "priority":
        assert urgent.status_code == 200 and seen == [-3, 0], (urgent.text, seen)
    else:
        assert urgent.status_code == 400 and "--scheduling-policy priority" in urgent.text
        assert seen == [0]
