"""``paged-jax serve`` in a real process on a free loopback port, driven by the official
``openai`` client: outputs equal to offline ``LLM.generate``, concurrent streams, a client
that disconnects, bad requests, SIGTERM. The model: a small random GGUF with a byte-level
vocabulary and a chat template (tests/test_gguf.py's writer)."""

import asyncio
import re
import signal
import socket
import subprocess
import sys
import time

import httpx2 as httpx
import pytest
from test_gguf import _model, write_gguf

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


def test_a_client_gone_mid_stream_frees_its_pages(server):
    before = _metrics(server).get(
        'paged_jax_requests_total{endpoint="completions",status="499"}', 0
    )
    body = dict(model=NAME, prompt="a long one", max_tokens=2000, stream=True, ignore_eos=True)
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
        (dict(temperature="hot"), 400, "temperature", "temperature: expected a finite float"),
        (dict(prompt=[1.5]), 400, "prompt", "prompt: expected a string or a list of token ids"),
        (dict(prompt=[7] * 5000), 400, "prompt", "prompt: 5000 tokens, the model's maximum"),
        (dict(n="2"), 400, "n", "n: expected an int >= 1"),
        (dict(logprobs=3), 400, "logprobs", "logprobs: only 0 is supported"),
        (dict(echo=True), 400, "echo", "echo: echoing the prompt is not supported"),
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
