"""Replicas of ``paged-jax serve`` behind vLLM's router: what a replica answers to the
router's polls, and (``pip install vllm-router``; the slow grid, which ``.ci/run`` runs
after installing it) the fleet benchmark's script end to end on tiny-llama, each policy,
and a replica killed mid-run."""

import json
import shutil
import time

import pytest

from benchmarks import bench_fleet


@pytest.mark.slow
def test_replicas_behind_vllm_router_serve_every_request_and_routing_earns_hits(
    tmp_path, monkeypatch
):
    assert shutil.which("vllm-router"), "vLLM's router is not installed: pip install vllm-router"
    argv = ["--model", "tiny-llama", "--requests", "40", "--repeats", "1", "--kill",
            "--system-prompts", "4", "--system-words", "60", "--num-pages", "40",
            "--concurrency", "8", "--timeout", "120"]  # fmt: skip
    monkeypatch.setenv("PAGED_JAX_RESULTS_DIR", str(tmp_path))
    assert bench_fleet.main(argv) == 0
    result = json.loads((tmp_path / "fleet.json").read_text())
    runs = result["runs"]
    assert set(runs) == {"round_robin", "cache_aware", "kv_aware"}
    for policy, (run,) in runs.items():
        assert run["answered"] == 40 and run["failed"] == 0, (policy, run["errors"])
        assert 0 < run["prompt_tokens"] and run["output_tok_s"] > 0
    # the router sending each system prompt where it went before earns more hits (4
    # prompts, a pool that holds about two of them)
    assert runs["cache_aware"][0]["hit_rate"] > runs["round_robin"][0]["hit_rate"]
    killed = result["kill_run"]
    assert killed["requests"] == 40 and killed["hung"] == 0
    assert killed["answered"] + killed["failed"] == 40
    assert result["versions"]["router_version"]


def test_a_replica_answers_what_the_router_polls():
    # vllm-router 0.1.17 polls GET /get_load ({"load": n}) for power_of_two, GET /health
    # and /v1/models, and tokenizes through POST /tokenize
    from starlette.testclient import TestClient

    import paged_jax as pj
    from paged_jax import models
    from paged_jax.server.api import Server

    model, tokenizer = models.load("tiny-llama")
    llm = pj.LLM(model, tokenizer, num_pages=64, max_num_seqs=2, compilation_cache=False)
    app = Server(llm, model_name="t", api_key="k")
    long = pj.SamplingParams(max_tokens=400, ignore_eos=True)
    with TestClient(app.app) as client:
        assert client.get("/get_load").json() == {"load": 0}  # open, as /health is
        for rid in ("a", "b", "c"):
            app.loop.submit(rid, [1, 2, 3], long, lambda e: None)
        assert client.get("/get_load").json() == {"load": 3}  # 2 running, 1 waiting
        for rid in ("a", "b", "c"):
            app.loop.abort(rid)
        for _ in range(100):
            if client.get("/get_load").json() == {"load": 0}:
                break
            time.sleep(0.02)
        assert client.get("/get_load").json() == {"load": 0}
        assert client.get("/health").json() == {"status": "ok"}
        key = {"Authorization": "Bearer k"}
        r = client.post("/tokenize", json={"prompt": "hi"}, headers=key)
        assert r.status_code == 200 and r.json()["count"] >= 1
