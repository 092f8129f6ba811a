"""What the prefix cache tells the outside world: pages entered and evicted, as events
a cache-aware router can follow (``BlockManager.record_events`` / ``take_events``; the
server publishes them in vLLM's KV-event format, ``paged_jax.server.kv_events``). No JAX.

A page is named by its prefix-cache key (``prefix.page_key``: a blake2b digest chained
from the request's salted root over the pages' int32 token ids), published as an int:
the key's last 8 bytes read big-endian, an unsigned 64-bit number (vLLM publishes its
own hashes so, by default). A consumer that wants to compute a prompt's names itself
uses ``page_key`` and ``prefix_root_key`` (vLLM's hashes are computed otherwise, so an
indexer that recomputes those will not match these)."""

from __future__ import annotations

import dataclasses


def external_hash(key: bytes) -> int:
    """The published name of a page of prefix-cache key ``key``: an int in [0, 2**64)."""
    return int.from_bytes(key[-8:], "big")


@dataclasses.dataclass(frozen=True)
class BlockStored:
    """Full pages of one sequence entered in the prefix cache, in order: ``block_hashes``
    (``external_hash`` of each key), ``parent_block_hash`` (the page before the first,
    None when the first is the prompt's first page), ``token_ids`` (the pages' tokens,
    ``block_size`` a page), ``lora_id`` (always None: an adapter salts the chain's root
    instead)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None


@dataclasses.dataclass(frozen=True)
class BlockRemoved:
    """Pages evicted from the prefix cache (no prompt finds them any more)."""

    block_hashes: list[int]


@dataclasses.dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache dropped (the engine reset or rebuilt after a fault)."""
