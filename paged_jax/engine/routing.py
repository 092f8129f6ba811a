"""Which data-parallel replica a new request goes to (``EngineCore.add_request``). No JAX.

Each replica has its own pool and prefix cache, so a prompt's cached pages help only on
the replica that computed them. ``PrefixRouter`` remembers, for the full pages of the
prompts it routed, the replicas it sent them to (keyed as the prefix cache keys pages:
``paged_jax.block_manager.prefix``'s chain from the request's salt), and sends a request
to the replica that was sent the longest run of its leading pages, as long as that
replica holds at most ``slack`` more unfinished sequences than the least loaded one;
otherwise, and when no replica was sent any of its pages, to the least loaded replica
(ties: the lowest index). It remembers routed prompts rather than asking the pools, so
requests sent together (whose pages no pool holds yet) follow each other too; a page a
pool has since evicted is still remembered, which costs only the hit. Deterministic: a
function of the requests in order and the loads, so every process of a multi-process
engine routes alike.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from paged_jax.block_manager.prefix import page_key, prefix_root_key


class PrefixRouter:
    """Routes requests over ``num_replicas`` replicas whose pages hold ``page_size``
    tokens, remembering the pages of up to ``capacity`` prompt pages (least recently
    routed forgotten first); ``slack``: the most unfinished sequences a replica chosen
    for its pages may hold beyond the least loaded one's; ``enabled`` False: always the
    least loaded replica (the engine without prefix caching)."""

    def __init__(
        self, num_replicas: int, page_size: int, *, slack: int, capacity: int, enabled: bool
    ):
        if num_replicas < 1 or page_size < 1 or slack < 0 or capacity < 0:
            raise ValueError(
                "num_replicas, page_size, slack, capacity: expected >= 1, >= 1, >= 0, >= 0, "
                f"got {num_replicas}, {page_size}, {slack}, {capacity}"
            )
        self.num_replicas = num_replicas
        self.page_size = page_size
        self.slack = slack
        self.capacity = capacity
        self.enabled = enabled and num_replicas > 1 and capacity > 0
        self._owners: OrderedDict[bytes, set[int]] = OrderedDict()  # page key -> replicas

    def _keys(self, tokens: Sequence[int], salt: Any) -> list[bytes]:
        """The prefix-cache keys of the prompt's pages a prefix hit may cover (its full
        pages short of its last token, as ``BlockManager.allocate`` looks them up)."""
        P = self.page_size
        full = max(len(tokens) - 1, 0) // P
        data = np.asarray(tokens[: full * P], np.int32).tobytes()
        key, keys = prefix_root_key(salt), []
        for i in range(full):
            key = page_key(key, data[4 * P * i : 4 * P * (i + 1)])
            keys.append(key)
        return keys

    def matches(self, tokens: Sequence[int], salt: Any = None) -> list[int]:
        """Per replica, how many of the prompt's leading pages were routed to it."""
        if not self.enabled:
            return [0] * self.num_replicas
        return self._matches(self._keys(tokens, salt))

    def _matches(self, keys: list[bytes]) -> list[int]:
        match = [0] * self.num_replicas
        for i, key in enumerate(keys):
            owners = self._owners.get(key)
            longer = [r for r in owners or () if match[r] == i]
            if not longer:
                break
            for r in longer:
                match[r] = i + 1
        return match

    def route(self, tokens: Sequence[int], salt: Any, loads: Sequence[int]) -> int:
        """The replica for a prompt of ``tokens`` (its prefix-cache salt ``salt``), given
        each replica's unfinished sequences ``loads``; remembers its pages there."""
        if len(loads) != self.num_replicas:
            raise ValueError(f"loads: expected {self.num_replicas}, got {len(loads)}")
        if not self.enabled:
            return min(range(self.num_replicas), key=lambda r: (loads[r], r))
        keys = self._keys(tokens, salt)  # (one digest a page, for the lookup and the record)
        match = self._matches(keys)
        least = min(loads)

        def rank(r: int) -> tuple:
            near = loads[r] - least <= self.slack
            return (-match[r] if near else 0, loads[r], r)

        chosen = min(range(self.num_replicas), key=rank)
        for key in keys:
            owners = self._owners.get(key)
            if owners is None:
                owners = self._owners[key] = set()
            else:
                self._owners.move_to_end(key)
            owners.add(chosen)
        while len(self._owners) > self.capacity:
            self._owners.popitem(last=False)
        return chosen
