"""KV-cache events for cache-aware routers: the prefix cache's pages entered and evicted,
published over ZeroMQ in vLLM's format (``--kv-events-config``). No JAX.

What goes on the wire, as vLLM (0.34) sends it, so its subscribers read it unchanged:

- a PUB socket (``endpoint``: bound when it has ``*``, ``::``, or is ``ipc://`` /
  ``inproc://``, else connected) sends each batch as three frames: ``topic`` (utf-8),
  the batch's sequence number (8 bytes, big-endian, from 0), and the batch, msgpack;
- a batch is the array ``[ts, events, data_parallel_rank]`` (``ts`` seconds since the
  epoch; the rank is the engine's data-parallel replica), each event a map tagged by
  ``"type"``: ``BlockStored`` (``block_hashes``, ``parent_block_hash``, ``token_ids``,
  ``block_size``, ``lora_id``, ``medium``, ``lora_name``), ``BlockRemoved``
  (``block_hashes``, ``medium``) or ``AllBlocksCleared``; ``medium`` is ``"GPU"``
  (vLLM's name for the accelerator's pool, whatever the backend);
- with ``replay_endpoint``, a ROUTER socket answers a request of one frame (a start
  sequence number, 8 bytes big-endian) with every buffered batch from that number on
  (``topic``, number, batch), then ``(b"", -1 as 8 signed bytes, b"")``; the last
  ``buffer_steps`` batches are kept (ask from a DEALER socket: a REQ one takes only the
  first reply).

The hashes are paged-jax's page keys (``paged_jax.block_manager.events``), not vLLM's:
a consumer matches prompts by the events' ``token_ids`` or computes the keys with
``paged_jax.block_manager.page_key``. The engine thread only queues batches
(``max_queue_size``; past it a batch is dropped and its sequence number skipped, so a
subscriber sees the gap); a thread of this module encodes and sends them.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import queue
import threading
import time
from typing import Any

import msgspec
import zmq

from paged_jax.block_manager import events as cache_events

log = logging.getLogger("paged_jax.server")

MEDIUM = "GPU"


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` fields (the same names and defaults).

    ``enable_kv_cache_events``: publish at all; ``publisher``: ``"zmq"`` or ``"null"``
    (default: ``"zmq"`` when enabled); ``endpoint``: the PUB socket's address;
    ``replay_endpoint``: the ROUTER socket's (None: no replay); ``buffer_steps``: batches
    kept for replay; ``hwm``: the PUB socket's high-water mark (messages queued per
    subscriber before ZeroMQ drops); ``max_queue_size``: batches waiting for the sending
    thread; ``topic``: the first frame of each message.
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self):
        def bad(field: str, want: str) -> None:
            got = getattr(self, field)
            raise ValueError(f"kv_events_config: {field}: expected {want}, got {got!r}")

        if not isinstance(self.enable_kv_cache_events, bool):
            bad("enable_kv_cache_events", "true or false")
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in ("zmq", "null"):
            bad("publisher", "'zmq' or 'null'")
        for field in ("endpoint", "topic"):
            if not isinstance(getattr(self, field), str):
                bad(field, "a string")
        if not self.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            bad("endpoint", "a ZeroMQ address (tcp://, ipc:// or inproc://)")
        if self.replay_endpoint is not None and (
            not isinstance(self.replay_endpoint, str)
            or not self.replay_endpoint.startswith(("tcp://", "ipc://", "inproc://"))
        ):
            bad("replay_endpoint", "null or a ZeroMQ address to bind")
        for field in ("buffer_steps", "hwm", "max_queue_size"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                bad(field, "an int >= 1")

    @property
    def active(self) -> bool:
        """Whether events are published (enabled, with the ``zmq`` publisher)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, value: str | dict) -> KVEventsConfig:
        """From a JSON object's text (the flag's value) or a dict. ValueError naming the
        field for an unknown one or a wrong value."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"kv_events_config: not JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError(f"kv_events_config: expected a JSON object, got {value!r:.60}")
        known = [f.name for f in dataclasses.fields(cls)]
        for k in value:
            if k not in known:
                raise ValueError(
                    f"kv_events_config: unknown field {k!r}; expected some of {', '.join(known)}"
                )
        return cls(**value)


# ---------------------------------------------------------------------- wire format
class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """An event: a map whose ``"type"`` is the class name."""


class BlockStored(_Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(_Event):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(_Event):
    pass


def wire_event(event: Any) -> _Event:
    """A ``paged_jax.block_manager.events`` event as it goes on the wire."""
    if isinstance(event, cache_events.BlockStored):
        return BlockStored(
            event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
            event.lora_id, MEDIUM, None,
        )  # fmt: skip
    if isinstance(event, cache_events.BlockRemoved):
        return BlockRemoved(event.block_hashes, MEDIUM)
    if isinstance(event, cache_events.AllBlocksCleared):
        return AllBlocksCleared()
    raise TypeError(f"event: not a KV-cache event: {event!r:.80}")


_END = (-1).to_bytes(8, "big", signed=True)


class KVEventPublisher:
    """Sends event batches from a thread of its own (``config``: a ``KVEventsConfig``).
    Its sockets are made, used and closed on that thread; a socket that cannot bind or
    connect is a ValueError naming the field, raised here."""

    def __init__(self, config: KVEventsConfig):
        self.config = config
        self.dropped = 0  # batches dropped because the queue was full
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._seq = 0  # the next batch's sequence number (the engine thread's)
        self._ready = threading.Event()
        self._error: str | None = None
        self._thread = threading.Thread(target=self._run, name="paged-jax-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise ValueError(self._error)

    def publish(self, events: list, rank: int = 0) -> None:
        """Queues one batch of ``events`` (``paged_jax.block_manager.events``) of
        data-parallel replica ``rank``; never blocks (a full queue drops the batch)."""
        seq, self._seq = self._seq, self._seq + 1
        batch = _Batch(time.time(), [wire_event(e) for e in events], rank)
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning(
                    "kv events: %d batches dropped (the sending thread is behind; "
                    "max_queue_size %d)", self.dropped, self.config.max_queue_size,
                )  # fmt: skip

    def close(self, timeout: float = 5.0) -> None:
        """Sends what is queued, then closes the sockets."""
        self._queue.put(None)
        self._thread.join(timeout)

    # ------------------------------------------------------------------ its thread
    def _open(self, ctx) -> tuple[Any, Any]:
        c = self.config
        pub = ctx.socket(zmq.PUB)
        pub.set_hwm(c.hwm)
        where = "endpoint"
        try:
            bind = "*" in c.endpoint or "::" in c.endpoint
            if bind or c.endpoint.startswith(("ipc:", "inproc:")):
                pub.bind(c.endpoint)
            else:
                pub.connect(c.endpoint)
            replay = None
            if c.replay_endpoint is not None:
                where = "replay_endpoint"
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.SNDHWM, 2 * (c.buffer_steps + 1))
                replay.bind(c.replay_endpoint)
        except zmq.ZMQError as e:
            pub.close(linger=0)
            address = getattr(c, where)
            raise ValueError(f"kv_events_config: {where}: {address}: {e}") from None
        return pub, replay

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        try:
            pub, replay = self._open(ctx)
        except ValueError as e:
            self._error = str(e)
            self._ready.set()
            return
        self._ready.set()
        topic = self.config.topic.encode()
        kept: collections.deque = collections.deque(maxlen=self.config.buffer_steps)
        encode = msgspec.msgpack.Encoder().encode
        try:
            while True:
                if replay is not None and replay.poll(0):
                    self._replay(replay, topic, kept)
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if item is None:
                    break
                seq, batch = item
                payload = encode(batch)
                number = seq.to_bytes(8, "big")
                pub.send_multipart((topic, number, payload))
                kept.append((number, payload))
        finally:
            pub.close(linger=200)
            if replay is not None:
                replay.close(linger=0)

    @staticmethod
    def _replay(replay, topic: bytes, kept) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv events: a replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for number, payload in kept:
            if int.from_bytes(number, "big") >= first:
                replay.send_multipart((client, b"", topic, number, payload))
        replay.send_multipart((client, b"", b"", _END, b""))


class KVEventsFeed:
    """The server's part that turns on the engine's event records (each replica's
    scheduler, ``Scheduler.record_kv_events``) and, after each step, publishes what each
    replica's block manager recorded as one batch of that replica's rank."""

    def __init__(self, llm: Any, config: KVEventsConfig):
        for sc in llm.schedulers:
            sc.record_kv_events()  # ValueError on a pool of several layer groups
        self.publisher = KVEventPublisher(config)

    def step(self, llm: Any) -> None:
        """On the engine thread, after a step or its commands."""
        for rank, sc in enumerate(llm.schedulers):
            events = sc.bm.take_events()
            if events:
                self.publisher.publish(events, rank)

    def close(self) -> None:
        self.publisher.close()
