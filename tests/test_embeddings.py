"""Embeddings (``LLM.embed``, ``/v1/embeddings``): each prompt's final hidden states,
pooled, against the model's hidden states computed with no cache at all
(``model_helpers.dense_hidden``), with prompts longer than a step's token budget and more
of them than a step's rows; the engine's requests in flight untouched; and through the
server, with the ``openai`` client's ``embeddings.create`` among its callers."""

import base64

import numpy as np
import pytest
from model_helpers import dense_hidden

import paged_jax as pj
from paged_jax import models


@pytest.fixture(scope="module")
def tiny():
    model, tok = models.load("tiny-llama")
    llm = pj.LLM(model, tok, num_pages=64, page_size=8, max_num_batched_tokens=32,
                 max_num_seqs=4, compilation_cache=False)  # fmt: skip
    return model, tok, llm


def _prompts(seed=0, lengths=(5, 40, 17, 1, 9, 70, 33)):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 256, n).tolist() for n in lengths]


@pytest.mark.parametrize("pooling", ["last", "mean", "first"])
def test_embeddings_are_the_pooled_hidden_states(tiny, pooling):
    model, _, llm = tiny
    prompts = _prompts()  # 40, 70 and 33 tokens: split across steps of 32; 7 > 4 rows
    outs = llm.embed(prompts, pooling=pooling)
    raw = llm.embed(prompts, pooling=pooling, normalize=False)
    for p, o, r in zip(prompts, outs, raw, strict=True):
        h = dense_hidden(model, p)
        want = {"last": h[-1], "mean": h.mean(0), "first": h[0]}[pooling]
        np.testing.assert_allclose(r.embedding, want, atol=2e-5)
        np.testing.assert_allclose(o.embedding, want / np.linalg.norm(want), atol=2e-6)
        assert o.prompt_token_ids == p and o.embedding.dtype == np.float32
    assert llm.embed([]) == []


def test_text_prompts_and_generation_in_flight(tiny):
    """A text prompt embeds as its token ids do; embedding between the steps of running
    requests leaves their pages and tokens as they would be without it."""
    _, tok, llm = tiny
    text = "the cat sat on the mat"
    a, b = llm.embed([text, llm.encode(text)])
    assert a.prompt_token_ids == b.prompt_token_ids
    np.testing.assert_allclose(a.embedding, b.embedding, atol=1e-6)  # (other rows' sums)
    p = pj.SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = _prompts(1, (20, 7, 30))
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, p, progress=False)]
    for k, prompt in enumerate(prompts):
        llm.add_request(k, prompt, p)
    got, steps = {}, 0
    while llm.has_unfinished():
        for o in llm.step():
            got[o.request_id] = o.outputs[0].token_ids
        steps += 1
        if steps in (1, 3):  # with a step in flight
            llm.embed(_prompts(2, (50, 3)))
    assert [got[k] for k in range(3)] == want
    llm.bm.check_invariants()


def test_bad_arguments_name_themselves(tiny):
    _, _, llm = tiny
    with pytest.raises(ValueError, match="pooling: expected one of"):
        llm.embed(["x"], pooling="max")
    with pytest.raises(TypeError, match="normalize: expected a bool"):
        llm.embed(["x"], normalize=1)
    with pytest.raises(ValueError, match=r"prompts\[1\]: "):
        llm.embed(["x", []])


# ---------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def client():
    import openai
    from starlette.testclient import TestClient

    from paged_jax.server.api import Server

    model, tok = models.load("tiny-llama")
    llm = pj.LLM(model, tok, num_pages=64, page_size=8, max_model_len=64,
                 max_num_batched_tokens=32, compilation_cache=False)  # fmt: skip
    server = Server(llm, model_name="t")
    with TestClient(server.app) as http:
        oai = openai.OpenAI(base_url="http://testserver/v1", api_key="-", http_client=http)
        yield http, oai, llm, server


def test_the_embeddings_route_answers_as_openai_does(client):
    http, oai, llm, _ = client
    want = llm.embed(["hello there", "a b c"])
    got = oai.embeddings.create(model="t", input=["hello there", "a b c"])
    assert [d.index for d in got.data] == [0, 1]
    for d, w in zip(got.data, want, strict=True):
        np.testing.assert_allclose(d.embedding, w.embedding, atol=1e-6)
    tokens = sum(len(w.prompt_token_ids) for w in want)
    assert got.usage.prompt_tokens == got.usage.total_tokens == tokens
    ids = llm.encode("hello there")
    body = {"model": "t", "input": ids, "encoding_format": "base64", "dimensions": 8}
    r = http.post("/v1/embeddings", json=body)
    assert r.status_code == 200, r.text
    v = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), "<f4")
    first = want[0].embedding[:8]
    np.testing.assert_allclose(v, first / np.linalg.norm(first), atol=1e-6)


@pytest.mark.parametrize(
    "body,param,message",
    [
        ({"input": []}, "input", "input: expected at least one input"),
        ({"input": [[1, 2], 7]}, "input", "input: expected a string or a list of token ids"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format", "encoding_format: expec"),
        ({"input": "x", "dimensions": 0}, "dimensions", "dimensions: expected an int in [1, "),
        ({"input": [1] * 64}, "input", "input[0]: 64 tokens, more than the model's maximum"),
        ({"input": "x", "model": "other"}, "model", "model: 'other' does not exist"),
    ],
)
def test_bad_embedding_requests_are_400s_naming_the_field(client, body, param, message):
    http, _, _, _ = client
    r = http.post("/v1/embeddings", json={"model": "t"} | body)
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(message), err


def test_a_hybrid_pool_embeds_as_a_full_one():
    """Gemma 3's sliding layers on a hybrid pool (layer groups, pages dropped outside the
    window) give the embeddings of the same model on a pool that keeps every page."""
    import pathlib

    import jax.numpy as jnp

    golden = pathlib.Path(__file__).resolve().parent / "golden" / "hf" / "gemma3"
    got = {}
    for hybrid in (True, False):
        model, _ = models.load_hf(golden, dtype=jnp.float32)
        llm = pj.LLM(model, num_pages=96, page_size=4, max_num_batched_tokens=16,
                     hybrid_kv_cache=hybrid, compilation_cache=False)  # fmt: skip
        assert llm.hybrid_kv_cache == hybrid
        prompts = [[t % 64 for t in p] for p in _prompts(3, (40, 6, 23))]
        got[hybrid] = [o.embedding for o in llm.embed(prompts, pooling="mean")]
    for a, b in zip(got[True], got[False], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_a_large_request_is_embedded_a_step_at_a_time(client, monkeypatch):
    """Inputs beyond a step's token budget (32 here) go to the engine thread in groups
    that fit it, so the steps of requests in flight run between them; the vectors are
    those of one call."""
    http, _, llm, server = client
    rng = np.random.default_rng(7)
    inputs = [rng.integers(1, 256, n).tolist() for n in (20, 10, 20, 40, 5, 5)]
    calls = []
    real = server.loop.call
    monkeypatch.setattr(server.loop, "call", lambda fn, done: (calls.append(1), real(fn, done)))
    r = http.post("/v1/embeddings", json={"model": "t", "input": inputs})
    assert r.status_code == 200, r.text
    assert len(calls) == 4  # [20, 10], [20], [40], [5, 5]
    want = llm.embed(inputs)
    for d, w in zip(r.json()["data"], want, strict=True):
        np.testing.assert_allclose(d["embedding"], w.embedding, atol=1e-6)
