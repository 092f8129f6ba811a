"""Data-parallel routing (``paged_jax.engine.routing.PrefixRouter``): a request goes to
the replica its prompt's leading pages were sent to, within ``slack`` sequences of the
least loaded replica; otherwise, and with nothing shared, to the least loaded one (the
engine's rule before prefix routing). The engine under it, on 2 fake devices, is
checked in ``tests/test_sharding.py``."""

import numpy as np
import pytest

from paged_jax.engine.routing import PrefixRouter

P = 4  # tokens a page


def _router(replicas=2, slack=2, capacity=1000, enabled=True):
    return PrefixRouter(replicas, P, slack=slack, capacity=capacity, enabled=enabled)


def test_prompts_sharing_pages_follow_each_other_within_the_slack():
    r = _router(slack=2)
    a, b = list(range(1, 13)), list(range(50, 62))  # 2 pages each before the last token
    loads = [0, 0]
    got = []
    for prompt in (a, a + [7], b, b + [8], a + [9, 9], b + [1]):
        got.append(r.route(prompt, None, loads))
        loads[got[-1]] += 1
    # a -> 0 (least loaded); a again -> 0 (1 more than replica 1: within 2); b -> 1 (no
    # page shared: least loaded), then b's followers -> 1, a's -> 0
    assert got == [0, 0, 1, 1, 0, 1]
    assert r.matches(a + [5], None) == [3, 0]  # a + [7]'s 3 pages went to replica 0


def test_a_replica_beyond_the_slack_is_passed_over_and_then_shares_the_prefix():
    r = _router(slack=1)
    shared = list(range(1, 10))  # 2 full pages before its last token
    assert r.route(shared, None, [0, 0]) == 0
    assert r.route(shared, None, [1, 0]) == 0  # 1 more: within the slack
    assert r.route(shared, None, [2, 0]) == 1  # 2 more: the least loaded instead
    assert r.matches(shared, None) == [2, 2]  # both hold it now
    assert r.route(shared, None, [2, 1]) == 1  # both match: the less loaded


def test_salts_keep_prefixes_apart_and_unshared_prompts_go_to_the_least_loaded():
    r = _router(replicas=3)
    p = list(range(1, 20))
    assert r.route(p, "tenant-a", [0, 0, 0]) == 0
    assert r.route(p, "tenant-b", [1, 0, 0]) == 1  # another salt: no page shared
    assert r.route(p, "tenant-a", [1, 1, 0]) == 0  # its own salt's replica, within slack
    rng = np.random.default_rng(0)
    loads = [5, 2, 3]
    for _ in range(20):  # nothing shared: exactly the least loaded (ties: lowest index)
        q = rng.integers(1000, 2000, int(rng.integers(1, 30))).tolist()
        assert r.route(q, None, loads) == min(range(3), key=lambda i: (loads[i], i))


def test_disabled_or_one_replica_is_least_loaded_and_capacity_forgets_oldest():
    off = _router(enabled=False)
    p = list(range(1, 20))
    assert off.route(p, None, [0, 0]) == 0 and off.route(p, None, [1, 0]) == 1
    assert off.matches(p) == [0, 0]
    r = _router(capacity=3)
    r.route(list(range(1, 14)), None, [0, 0])  # 3 pages remembered, on replica 0
    r.route(list(range(100, 110)), None, [1, 0])  # 2 more pages: the oldest 2 forgotten
    assert r.matches(list(range(1, 14)), None) == [0, 0]  # its first page is gone
    assert r.matches(list(range(100, 110)), None) == [0, 2]
    with pytest.raises(ValueError, match="loads: expected 2, got 3"):
        r.route([1, 2], None, [0, 0, 0])
