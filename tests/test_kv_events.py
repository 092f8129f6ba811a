"""KV-cache events: the prefix cache's pages entered and evicted, recorded by the block
manager and published by the server over ZeroMQ in vLLM's format (read back here with
plain msgpack, not with the publisher's own types)."""

import json
import time

import msgspec
import numpy as np
import pytest
import zmq

import paged_jax as pj
from paged_jax.block_manager import BlockManager, HybridBlockManager, page_key, prefix_root_key
from paged_jax.block_manager.events import AllBlocksCleared, BlockRemoved, BlockStored
from paged_jax.engine.scheduler import Scheduler
from paged_jax.server.kv_events import KVEventPublisher, KVEventsConfig

P = 4


def _names(tokens, salt=None) -> list[int]:
    """The published names of ``tokens``' full pages, computed from the documented rule
    (the page key's last 8 bytes, big-endian)."""
    key, names = prefix_root_key(salt), []
    data = np.asarray(tokens, np.int32)
    for i in range(len(tokens) // P):
        key = page_key(key, data[i * P : (i + 1) * P].tobytes())
        names.append(int.from_bytes(key[-8:], "big"))
    return names


def test_pages_entered_and_evicted_are_recorded_in_order():
    bm = BlockManager(num_pages=11, page_size=P, watermark=0.0)  # 10 usable pages
    bm.allocate("quiet", list(range(1, 10)))
    bm.mark_computed("quiet", 9)
    assert bm.take_events() == []  # not recording yet
    bm.free("quiet")
    bm.record_events()
    a = list(range(1, 14))  # 3 full pages, the first 2 cached already ("quiet"'s)
    bm.allocate("a", a)
    bm.mark_computed("a", 13)
    names = _names(a)
    # the hits are not entered again: one run of one page, its parent the second page
    assert bm.take_events() == [BlockStored([names[2]], names[1], a[8:12], P)]
    assert bm.take_events() == []
    b = list(range(100, 113))
    bm.allocate("b", b)  # 4 free pages of the 6 a left
    bm.mark_computed("b", 13)
    events = bm.take_events()
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored == [BlockStored(_names(b), None, b[:12], P)]
    assert not removed  # nothing was evicted
    bm.free("a")
    bm.free("b")
    bm.allocate("c", list(range(200, 240)))  # 10 pages: the 4 free, then the 6 cached

    events = bm.take_events()
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert len(removed) == 6 and set(removed) == set(names) | set(_names(b))
    bm.check_invariants()


def test_a_salted_chain_is_named_from_its_root():
    bm = BlockManager(num_pages=8, page_size=P)
    bm.record_events()
    toks = list(range(5, 14))
    bm.allocate("s", toks, extra_key="tenant")
    bm.mark_computed("s", 9)
    (event,) = bm.take_events()
    assert event.block_hashes == _names(toks, "tenant") != _names(toks)
    assert event.parent_block_hash is None


def test_a_scheduler_reset_publishes_the_cache_cleared_and_hybrid_pools_are_refused():
    sc = Scheduler(BlockManager(num_pages=8, page_size=P), max_num_seqs=4,
                   max_num_batched_tokens=64, preemption="recompute")  # fmt: skip
    sc.record_kv_events()
    sc.reset(BlockManager(num_pages=8, page_size=P), [])
    assert sc.bm.take_events() == [AllBlocksCleared()]
    hybrid = HybridBlockManager(9, P, group_windows=(8, None))
    sc = Scheduler(hybrid, max_num_seqs=4, max_num_batched_tokens=64, preemption="recompute")
    with pytest.raises(ValueError, match="kv_events: not supported on a pool of several"):
        sc.record_kv_events()


@pytest.mark.parametrize(
    "value, message",
    [
        ("{", "kv_events_config: not JSON"),
        ('{"enable_kv_cache_events": true, "port": 1}', "unknown field 'port'"),
        ({"enable_kv_cache_events": "yes"}, "enable_kv_cache_events: expected true or false"),
        ({"publisher": "kafka"}, "publisher: expected 'zmq' or 'null'"),
        ({"endpoint": "http://x"}, "endpoint: expected a ZeroMQ address"),
        ({"buffer_steps": 0}, "buffer_steps: expected an int >= 1"),
        ([1], "expected a JSON object"),
    ],
)
def test_bad_configs_name_the_field(value, message):
    with pytest.raises(ValueError, match=message):
        KVEventsConfig.parse(value)


def test_config_defaults_are_vllms():
    c = KVEventsConfig.parse('{"enable_kv_cache_events": true}')
    assert (c.publisher, c.endpoint, c.active) == ("zmq", "tcp://*:5557", True)
    assert not KVEventsConfig.parse("{}").active
    assert not KVEventsConfig(enable_kv_cache_events=True, publisher="null").active


def test_an_endpoint_in_use_is_an_error_naming_it(tmp_path):
    ctx = zmq.Context.instance()
    taken = ctx.socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}")
        with pytest.raises(ValueError, match=f"kv_events_config: endpoint: tcp://\\*:{port}"):
            KVEventPublisher(config)
    finally:
        taken.close(linger=0)


def _receive(sub, want, timeout=20.0):
    """Messages from ``sub`` until ``want(messages)`` holds (or the time is up)."""
    got, end = [], time.monotonic() + timeout
    while not want(got) and time.monotonic() < end:
        if sub.poll(100):
            got.append(sub.recv_multipart())
    return got


def test_the_server_publishes_what_its_cache_does_and_replays_it(tmp_path):
    from starlette.testclient import TestClient

    from paged_jax import models
    from paged_jax.server.api import Server

    model, tokenizer = models.load("tiny-llama")
    # 12 usable pages of 4 tokens: two 6-page prompts fill the pool, a third evicts
    llm = pj.LLM(model, tokenizer, page_size=P, num_pages=13, max_num_seqs=2,
                 compilation_cache=False)  # fmt: skip
    pub, replay = f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/kv-replay"
    config = json.dumps({"enable_kv_cache_events": True, "endpoint": pub,
                         "replay_endpoint": replay, "topic": "kv"})  # fmt: skip
    app = Server(llm, model_name="t", kv_events=config)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(pub)
    time.sleep(0.3)  # (a subscriber joining late misses what was sent before)
    prompts = [[int(t) for t in np.random.default_rng(s).integers(3, 200, 21)] for s in range(3)]
    with TestClient(app.app) as client:
        for ids in prompts:
            body = dict(model="t", prompt=ids, max_tokens=2, temperature=0, ignore_eos=True)
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text

        # the last prompt again: its 5 full pages come from the cache, as its usage says
        body = dict(model="t", prompt=prompts[2], max_tokens=2, temperature=0)
        usage = client.post("/v1/completions", json=body).json()["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": 20}
        assert "paged_jax_cached_prompt_tokens_total 20.0" in client.get("/metrics").text

        def stored_all(msgs):
            events = [e for m in msgs for e in msgspec.msgpack.decode(m[2])[1]]
            removed = [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
            return len(removed) > 0 and sum(e["type"] == "BlockStored" for e in events) >= 3

        msgs = _receive(sub, stored_all)
        assert msgs, "no events arrived"
        numbers = [int.from_bytes(m[1], "big") for m in msgs]
        assert numbers == list(range(len(msgs)))  # numbered from 0, none missed
        batches = [msgspec.msgpack.decode(m[2]) for m in msgs]
        assert all(m[0] == b"kv" for m in msgs)
        assert all(isinstance(b, list) and len(b) == 3 and b[2] == 0 for b in batches)
        events = [e for b in batches for e in b[1]]
        stored = [e for e in events if e["type"] == "BlockStored"]
        # each prompt's 5 full pages (the pages its generated tokens fill come later)
        for ids, e in zip(prompts, stored[:3], strict=True):
            assert e["block_hashes"] == _names(ids)[: len(e["block_hashes"])]
            assert len(e["block_hashes"]) >= 5 and e["parent_block_hash"] is None
            assert e["token_ids"] == ids[: 4 * len(e["block_hashes"])]
            assert (e["block_size"], e["medium"], e["lora_id"]) == (P, "GPU", None)
        published = {h for e in stored for h in e["block_hashes"]}
        removed = [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
        assert set(removed) <= published and set(removed) & set(_names(prompts[0]))
        # a subscriber that missed batches asks for them again from a number on (a DEALER
        # socket: a REQ one would take only the first of the replies)
        req = ctx.socket(zmq.DEALER)
        req.connect(replay)
        req.send_multipart((b"", (1).to_bytes(8, "big")))
        again = []
        while True:
            assert req.poll(5000), f"the replay stopped after {len(again)} batches"
            frames = req.recv_multipart()[1:]  # (the empty delimiter)
            if frames[1] == (-1).to_bytes(8, "big", signed=True):
                break
            again.append(frames)
        assert [f[1] for f in again[: len(msgs) - 1]] == [m[1] for m in msgs[1:]]
        assert [f[2] for f in again[: len(msgs) - 1]] == [m[2] for m in msgs[1:]]
        req.close(linger=0)
    sub.close(linger=0)


def test_serve_checks_its_kv_events_flag(capsys):
    from paged_jax import cli

    assert cli.main(["serve", "--kv-events-config", '{"hwm": -1}']) == 2
    assert "--kv-events-config: kv_events_config: hwm: expected an int >= 1, got -1" in (
        capsys.readouterr().err
    )
