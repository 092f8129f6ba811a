"""The hybrid pool: layer groups with tables of their own, sliding groups dropping the
pages their window has passed (``layer_groups``, ``HybridBlockManager``, the engine's
``hybrid_kv_cache``). Model-level parity with transformers through it is in
tests/test_hf_golden.py."""

import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
from hf_cases import PROMPTS

import paged_jax as pj
from paged_jax.block_manager import BlockManager, HybridBlockManager, OutOfPages, layer_groups
from paged_jax.models import load_hf

GOLDEN = pathlib.Path(__file__).resolve().parent / "golden" / "hf"
W, P = 8, 4  # window and page size of the host tests


def test_layer_groups_fill_pages_of_one_window():
    # Gemma 3 1B: 22 sliding, 4 global -> pages of 4 layer slots; 1 global group, 6 sliding
    gemma3 = ([512] * 5 + [None]) * 4 + [512, 512]
    windows, group, slot = layer_groups(gemma3)
    assert windows == (512,) * 6 + (None,)
    assert max(slot) + 1 == 4
    assert [group[i] for i in (5, 11, 17, 23)] == [6, 6, 6, 6]  # the global layers
    pairs = list(zip(group, slot, strict=True))
    assert len(pairs) == len(set(pairs))  # no slot twice
    # Gemma 2: alternating -> two groups of half the layers
    assert layer_groups([4096, None] * 3) == ((4096, None), (0, 1) * 3, (0, 0, 1, 1, 2, 2))
    # full layers 10, sliding 4: k divides the full count (no wasted slot where pages grow)
    windows, group, slot = layer_groups([None] * 10 + [8] * 4)
    assert max(slot) + 1 == 2 and windows.count(None) == 5
    assert layer_groups([8] * 3) == ((8,), (0, 0, 0), (0, 1, 2))  # Mistral: one group
    with pytest.raises(ValueError, match="windows: expected at least one layer"):
        layer_groups([])


def _live(bm, sid):
    return [p for p in bm.block_table(sid) if p != 0]


def test_a_window_drops_the_pages_no_later_token_reads():
    bm = BlockManager(64, P, num_host_pages=16)
    assert bm.allocate("a", list(range(1, 23)), sliding_window=W) == 0
    assert len(_live(bm, "a")) == 6  # the whole prompt until it is computed
    bm.mark_computed("a", 22)
    # the next token (position 22) reads keys 15..22: pages 3.. (page 3 = tokens 12..15)
    assert bm.block_table("a")[:3] == [0, 0, 0] and len(_live(bm, "a")) == 3
    free = bm.num_free_pages
    for t in range(6):  # decode: a page leaves the window every 4 tokens
        bm.append_slots("a", [t])
        bm.take_copies()
    bm.mark_computed("a", bm.num_tokens("a"))
    n = bm.num_tokens("a")  # 28 tokens computed: the next reads 21..28 -> pages 5, 6, 7
    assert n == 28 and len(_live(bm, "a")) == 2 and bm.num_free_pages == free - 1 + 2
    bm.check_invariants()
    # fork shares the live pages only; swap moves them and brings them back
    bm.fork("a", "b")
    assert bm.block_table("b") == bm.block_table("a")
    plan = bm.swap_out(["a", "b"])
    assert len(plan) == 2 and bm.block_table("a")[:5] == [-1] * 5
    bm.check_invariants()
    bm.swap_in(["a", "b"])
    assert bm.block_table("a")[:5] == [0] * 5 and len(_live(bm, "a")) == 2
    bm.check_invariants()
    bm.free("a")
    bm.free("b")
    assert bm.num_free_pages == 63
    bm.check_invariants()
    with pytest.raises(ValueError, match="sliding_window: expected None or an int >= 1"):
        bm.allocate("c", [1, 2], sliding_window=0)


def test_a_prefix_hit_past_the_window_holds_only_the_window():
    bm = BlockManager(64, P)
    prompt = list(range(1, 30))
    bm.allocate("a", prompt, sliding_window=W)
    bm.mark_computed("a", len(prompt))
    bm.free("a")  # its full pages stay cached (dropped ones too, until evicted)
    assert bm.cached_tokens(prompt) == 28
    assert bm.allocate("b", prompt, sliding_window=W, max_cached_tokens=20) == 20
    # position 20 reads keys 13..20: pages 3.. are held, 0..2 are not
    assert bm.block_table("b")[:3] == [0, 0, 0] and all(bm.block_table("b")[3:])
    bm.check_invariants()


def test_hybrid_manager_keeps_its_groups_in_step():
    bm = HybridBlockManager(40, P, group_windows=(W, None), num_host_pages=32)
    prompt = list(range(1, 19))  # 18 tokens: 5 pages per group at admission
    assert bm.pages_needed(18) == 10
    assert bm.allocate("a", prompt) == 0
    assert bm.pages_np("a").shape == (2, 5) and bm.slots("a", 0, 18).shape == (2, 18)
    bm.mark_computed("a", 18)
    tables = bm.block_table("a")
    # the next token (18) reads keys 11..18: the sliding group dropped pages 0 and 1
    assert tables[0][:3] == [0, 0, tables[0][2]] and tables[0][2] and all(tables[1])
    assert bm.append_slots("a", [7]).shape == (2, 1)
    bm.take_copies()
    # the groups agree on prefix hits: the shortest of theirs
    bm.allocate("b", prompt)
    assert bm.num_computed_tokens("b") == 16
    bm.check_invariants()
    stats = bm.stats()
    assert stats["num_seqs"] == 2 and stats["layer_groups"] == 2
    # all or nothing: too few pages leaves nothing allocated
    before = bm.num_free_pages
    with pytest.raises(OutOfPages, match="in 2 layer groups"):
        bm.allocate("c", list(range(100, 200)))
    assert "c" not in bm and bm.num_free_pages == before
    bm.swap_out(["a"])
    assert bm.is_swapped("a") and len(bm.host_slots("a")) == 3 + 5  # 19 tokens
    bm.swap_in(["a"])
    bm.fork("a", "a2")
    for s in ("a", "a2", "b"):
        bm.free(s)
    assert bm.num_free_pages == 39 and bm.seq_ids == []
    bm.check_invariants()


@pytest.mark.parametrize("windows", [(None, None), (W, None)])
def test_hybrid_allocation_never_evicts_what_another_group_matched(windows):
    # Every page of a freed 8-token prompt is cached; the pool has no free page left, so
    # a new prompt's fresh pages come from the LRU, whose oldest pages are the last
    # group's (freed first). Group 0's fresh pages used to evict group 1's hit before
    # group 1 looked it up: the groups then held 4 and 0 computed tokens, 4 was returned,
    # and the engine skipped K/V that group 1 never had (issue 56, item 1).
    bm = HybridBlockManager(9, P, group_windows=windows, watermark=0.0)  # 8 usable pages
    for sid, prompt in (("a", list(range(1, 9))), ("c", list(range(21, 29)))):
        bm.allocate(sid, prompt)
        bm.mark_computed(sid, 8)
        bm.free(sid)
    assert bm.num_free_pages == 8 and not bm.inner.pool.free  # all cached, none free
    prompt = [1, 2, 3, 4, 31, 32, 33, 34, 35]  # a's first page, then new tokens
    cached = bm.allocate("b", prompt)
    bm.check_invariants()  # "groups out of step" before
    assert cached == 4
    assert [bm.inner.num_computed_tokens(("b", g)) for g in range(2)] == [4, 4]
    # both groups' first pages hold a's tokens (they are a's cached pages)
    assert all(bm.inner.token_ids(("b", g))[:4].tolist() == [1, 2, 3, 4] for g in range(2))
    bm.free("b")
    assert bm.num_free_pages == 8
    bm.check_invariants()


def test_hybrid_allocation_failing_late_leaves_every_cached_page():
    # All or nothing with prefix hits: a prompt whose last group cannot get its pages
    # leaves the pool, the cache and the LRU as they were.
    bm = HybridBlockManager(9, P, group_windows=(None, None), watermark=0.0)
    bm.allocate("a", list(range(1, 9)))
    bm.mark_computed("a", 8)
    bm.free("a")
    inner = bm.inner

    def state():
        return (bm.num_free_pages, list(inner.pool.evictable), dict(inner.prefix.cached))

    before = state()
    with pytest.raises(OutOfPages):
        bm.allocate("b", list(range(1, 9)) + list(range(40, 60)))
    assert state() == before
    assert "b" not in bm
    bm.check_invariants()


@pytest.fixture(scope="module")
def gemma3():
    model, _ = load_hf(GOLDEN / "gemma3", dtype=jnp.float32)
    return model  # 5 layers: sliding, sliding, global, sliding, sliding; window 8


def test_engine_on_a_hybrid_pool_gives_transformers_tokens(gemma3):
    """The engine's default for a model with sliding layers: the hybrid pool, with the
    golden greedy tokens of transformers for prompts longer than the window (every step's
    arrays checked), and after the prefill the sliding groups hold 1-2 pages each."""
    golden = dict(np.load(GOLDEN / "gemma3" / "golden.npz"))
    llm = pj.LLM(gemma3, num_pages=64, page_size=8, compilation_cache=False, checked=True)
    assert llm.hybrid_kv_cache and llm.bm.group_windows == (8, 8, 8, 8, None)
    keys = ("short", "mid", "long")
    outs = llm.generate([PROMPTS[k] for k in keys], pj.SamplingParams(max_tokens=32))
    for k, o in zip(keys, outs, strict=True):
        assert o.outputs[0].token_ids == golden[f"greedy_{k}"].tolist(), k
    long = PROMPTS["long"]
    llm.add_request("again", long, pj.SamplingParams(max_tokens=4))
    while not llm.num_generated("again")[0]:  # until its prefill has run
        llm.step()
    (sid,) = llm.bm.seq_ids
    for w, table in zip(llm.bm.group_windows, llm.bm.block_table(sid), strict=True):
        live = sum(1 for p in table if p)
        assert live == len(table) if w is None else 1 <= live <= 2 < len(table), table
    with pytest.raises(TypeError, match="hybrid_kv_cache: expected a bool or None, got 'yes'"):
        pj.LLM(gemma3, num_pages=8, hybrid_kv_cache="yes", compilation_cache=False)


def test_engine_prefix_hit_on_a_full_hybrid_pool_keeps_its_groups_in_step(gemma3, monkeypatch):
    # Issue 56, item 1, through the engine: R's pages are cached, then Q's (younger), and
    # running requests hold every free page. R again hits 4 pages in each of the 5 groups,
    # and its fresh pages come from the LRU, whose oldest pages are R's last group's.
    # Before the fix groups 1-4 lost their hits (computed 0) while the engine skipped 32
    # tokens: K/V nobody wrote.
    rng = np.random.default_rng(0)
    R, Q = rng.integers(1, 64, 33).tolist(), rng.integers(1, 64, 16).tolist()
    g = pj.SamplingParams(max_tokens=6, ignore_eos=True)
    kw = dict(page_size=8, compilation_cache=False, watermark=0.0, async_scheduling=False)
    want = pj.LLM(gemma3, num_pages=64, **kw).generate([R], g, progress=False)
    llm = pj.LLM(gemma3, num_pages=41, **kw)
    assert llm.generate([R], g, progress=False)[0].outputs == want[0].outputs
    llm.generate([Q], pj.SamplingParams(max_tokens=8, ignore_eos=True), progress=False)
    bm = llm.bm
    assert (len(bm.inner.pool.free), len(bm.inner.pool.evictable)) == (10, 30)
    for j in range(2):  # 1 page in each of 5 groups each: the free list empties
        llm.add_request(f"f{j}", [1 + j, 2, 3], pj.SamplingParams(max_tokens=4, ignore_eos=True))
    llm.step()
    assert not bm.inner.pool.free
    admitted = []  # (cached tokens the engine skips, each group's computed tokens)
    allocate = bm.allocate

    def spy(seq_id, tokens, **kw):
        cached = allocate(seq_id, tokens, **kw)
        groups = range(bm.num_groups)
        admitted.append((cached, [bm.inner.num_computed_tokens((seq_id, k)) for k in groups]))
        return cached

    monkeypatch.setattr(bm, "allocate", spy)
    llm.add_request("R", R, g)
    outs = llm.step()
    assert admitted == [(32, [32] * 5)]  # [32, 0, 0, 0, 0] before
    bm.check_invariants()
    while not any(o.request_id == "R" and o.finished for o in outs):
        outs = llm.step()
    got = next(o for o in outs if o.request_id == "R")
    assert got.outputs[0].token_ids == want[0].outputs[0].token_ids


@pytest.mark.slow  # 42 s; the default suite runs the test above
def test_engine_on_a_hybrid_pool_gives_the_same_tokens_in_less_memory(gemma3):
    """Greedy, seeded and n=2 requests, a prefix hit and swap preemption in a small pool:
    token for token as with every layer on every page, with the step arrays checked, and
    the sliding layers holding only their window."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 64, n).tolist() for n in (37, 21, 30)]
    prompts.append(prompts[0][:33] + [5, 6])  # shares 4 full pages with the first
    g = dict(max_tokens=20, ignore_eos=True)
    params = [
        pj.SamplingParams(**g),
        pj.SamplingParams(temperature=0.9, top_p=0.9, seed=3, **g),
        pj.SamplingParams(n=2, temperature=1.0, seed=5, **g),
        pj.SamplingParams(**g),
    ]
    kw = dict(page_size=8, max_num_batched_tokens=64, compilation_cache=False, checked=True)
    plain = pj.LLM(gemma3, num_pages=24, hybrid_kv_cache=False, preemption="swap", **kw)
    assert plain.cache.layer_groups is None
    want = [
        [c.token_ids for c in o.outputs] for o in plain.generate(prompts, params, progress=False)
    ]
    assert plain.metrics.preemptions_swap > 0  # the small pool preempted

    # the same bytes of pool: pages of 1 layer slot instead of 5
    llm = pj.LLM(gemma3, num_pages=24 * 5, preemption="swap", **kw)
    assert llm.hybrid_kv_cache and isinstance(llm.bm, HybridBlockManager)
    assert llm.cache.nbytes == plain.cache.nbytes
    assert llm.bm.group_windows == (8, 8, 8, 8, None)
    outs = llm.generate(prompts, params, progress=False)
    got = [[c.token_ids for c in o.outputs] for o in outs]
    assert got == want
    assert llm.bm.stats()["prefix_hits"] > 0

    # one long request: after its prefill the sliding groups hold 1-2 pages each
    long = rng.integers(1, 64, 60).tolist()
    for engine in (plain, llm):
        engine.add_request("long", long, pj.SamplingParams(max_tokens=8, ignore_eos=True))
        while not engine.num_generated("long")[0]:  # until its prefill has run
            engine.step()
    slots_plain = (plain.bm.num_pages - 1 - plain.bm.num_free_pages) * 5
    slots_hybrid = llm.bm.num_pages - 1 - llm.bm.num_free_pages
    assert slots_plain == 8 * 5  # 61 tokens: 8 pages of 5 layers
    assert slots_hybrid <= 8 + 4 * 2  # the global layer's 8 pages, 2 per sliding layer
