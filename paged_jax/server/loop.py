"""The engine on a thread of its own, for the HTTP server.

``LLM`` is not thread-safe and its steps block, so one thread owns it: it takes requests
and aborts from a queue, steps while anything runs, and hands each request's progress
(new text, its final output, or an error) to a callback that the server turns into an
item on the request's asyncio queue. No JAX here beyond what ``LLM`` does.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Hashable
from typing import Any

from paged_jax.server.schema import api_error

log = logging.getLogger("paged_jax.server")


@dataclasses.dataclass(frozen=True)
class Event:
    """What a request learns after a step.

    ``kind``: "text" (``sample``'s new settled ``text``), "done" (``output``, the
    finished ``RequestOutput``), or "error" (``status``, an HTTP status, ``message``
    and ``param``, the request's field at fault or None).
    """

    kind: str
    sample: int = 0
    text: str = ""
    output: Any = None
    status: int = 0
    message: str = ""
    param: str | None = None
    piece: Any = None  # "text": the StreamOutput (its tokens and their log-probs)


# The loop running each LLM: two threads stepping one engine would use its donated
# buffers after each other's steps consumed them
_RUNNING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_RUNNING_LOCK = threading.Lock()


class Overloaded(RuntimeError):
    """The waiting queue is full (the server answers 429)."""


@dataclasses.dataclass
class _Live:
    notify: Callable[[Event], None]
    last_token_time: float | None = None


class EngineLoop:
    """Runs ``llm`` on a daemon thread.

    Args:
      llm: a ``paged_jax.LLM`` (with a tokenizer: the server streams text).
      max_waiting: requests that may wait beyond the ones a step can run
        (``max_num_seqs`` per replica): ``submit`` raises ``Overloaded`` past that.
      on_tokens: called on the engine thread with ``(new tokens, seconds since the
        request's previous token or None for its first)`` per request and step
        (metrics).
      on_step: called on the engine thread after each step with the ``LLM``, before
        that step's outputs are delivered (a finished request's answer never arrives
        ahead of the gauges that count it).

    Text is settled and sent ("text" events) only for requests submitted with
    ``stream=True``; the others get their text once, in their finished output.
    """

    def __init__(
        self,
        llm: Any,
        *,
        max_waiting: int = 256,
        on_tokens: Callable[[int, float | None], None] | None = None,
        on_step: Callable[[Any], None] | None = None,
    ):
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 0:
            raise ValueError(f"max_waiting: expected an int >= 0, got {max_waiting!r}")
        self.llm = llm
        running = sum(sc.max_num_seqs for sc in llm.schedulers)
        self.capacity = running + max_waiting
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[Hashable, _Live] = {}  # engine thread only
        self._lock = threading.Lock()
        self._in_flight = 0  # submitted, not yet done (any thread, under _lock)
        self._on_tokens = on_tokens
        self._on_step = on_step
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="paged-jax-engine", daemon=True)

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs."""
        return self._thread.is_alive()

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def start(self) -> None:
        """Starts the engine thread. RuntimeError if another loop's thread runs this
        ``llm`` (a second server on the same engine): ``LLM`` is not thread-safe."""
        with _RUNNING_LOCK:
            other = _RUNNING.get(self.llm)
            if other is not None and other is not self and other.alive:
                raise RuntimeError(
                    "llm: another EngineLoop (another server) runs this LLM already; an LLM "
                    "is not thread-safe, so give each server an LLM of its own"
                )
            _RUNNING[self.llm] = self
            self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Aborts whatever is still in flight (each gets an "error" 503 event) and joins
        the thread."""
        self._stopping.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout)

    def submit(
        self,
        request_id: Hashable,
        prompt: Any,
        params: Any,
        notify: Callable[[Event], None],
        *,
        stream: bool = False,
        lora: str | None = None,
        priority: int = 0,
    ) -> None:
        """Queues a request (any thread), with LoRA adapter ``lora`` (a registered name, or
        None) and ``priority`` (``LLM.add_request``'s). ``notify`` receives its events on
        the engine thread. Raises ``Overloaded`` when ``capacity`` requests are in flight,
        and RuntimeError once stopping."""
        with self._lock:
            if self._stopping.is_set():
                raise RuntimeError("the server is shutting down")
            if self._thread.ident is not None and not self._thread.is_alive():
                raise RuntimeError("the engine thread is not running")
            if self._in_flight >= self.capacity:
                raise Overloaded(
                    f"{self._in_flight} requests in flight, the limit is {self.capacity}"
                )
            self._in_flight += 1
        self._inbox.put(("add", request_id, prompt, params, notify, stream, lora, priority))

    def call(self, fn: Callable[[], Any], done: Callable[[Any, BaseException | None], None]):
        """Runs ``fn()`` on the engine thread between steps (any thread may ask; work that
        reads the engine, such as ``LLM.embed``) and then ``done(result, None)``, or
        ``done(None, error)`` if it raised or the loop stopped first. Raises RuntimeError
        once stopping."""
        with self._lock:
            if self._stopping.is_set():
                raise RuntimeError("the server is shutting down")
            if self._thread.ident is not None and not self._thread.is_alive():
                raise RuntimeError("the engine thread is not running")
        self._inbox.put(("call", fn, done))

    def abort(self, request_id: Hashable) -> None:
        """Stops a request (any thread): its pages are freed before the next step, and it
        gets no more events."""
        self._inbox.put(("abort", request_id))

    # ------------------------------------------------------------------ engine thread
    def _done(self, rid: Hashable, event: Event | None) -> None:
        live = self._live.pop(rid, None)
        if live is None:
            return
        with self._lock:
            self._in_flight -= 1
        if event is not None:
            live.notify(event)

    def _take(self, block: bool) -> None:
        """Recovers a stopped engine, then applies queued commands (waiting for one first
        when ``block``): commands that arrived while its step failed reach a reset one."""
        self._recover_if_stopped()
        try:
            cmd = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if cmd[0] == "add":
                _, rid, prompt, params, notify, stream, lora, priority = cmd
                self._live[rid] = _Live(notify)
                try:  # (every request reports its tokens each step: the metrics')
                    kw = dict(lora=lora, stream=True if stream else "tokens")
                    if priority:  # (engines of other policies take no keyword)
                        kw["priority"] = priority
                    self.llm.add_request(rid, prompt, params, **kw)
                except (ValueError, TypeError) as e:
                    err = api_error(e)
                    self._done(rid, Event("error", status=400, message=err.message,
                                          param=err.param))  # fmt: skip
            elif cmd[0] == "abort":
                if cmd[1] in self._live:
                    self.llm.abort(cmd[1])
                    self._done(cmd[1], None)
            elif cmd[0] == "call":
                _, fn, done = cmd
                if self._stopping.is_set():
                    done(None, RuntimeError("the server is shutting down"))
                else:
                    try:
                        result = fn()
                    except Exception as e:  # noqa: BLE001 (the caller gets it)
                        done(None, e)
                    else:
                        done(result, None)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
        if self._on_step is not None:  # aborts free pages without a step
            self._on_step(self.llm)

    def _recover_if_stopped(self) -> None:
        """When a step could not be undone (``LLM.failure``), every request in flight gets a
        500 and the engine is reset: the server goes on with the same compiled model."""
        error = self.llm.failure
        if error is not None:
            log.error("the engine stopped (%s: %s); it is reset", type(error).__name__, error)
            self._fail_all(500, f"the engine failed: {type(error).__name__}: {error}")
            self.llm.reset()

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._take(block=not self.llm.has_unfinished())
                if self._stopping.is_set() or not self.llm.has_unfinished():
                    continue
                res = self.llm.step()
                # The gauges first: a client that holds its answer then sees the step
                # that made it in /metrics.
                if self._on_step is not None:
                    self._on_step(self.llm)
                self._deliver(res)
            except Exception as e:  # noqa: BLE001 (the thread must outlive any one fault)
                if self.llm.failure is not None:  # stopped: _take recovers it next
                    continue
                # A step undone and requeued by the engine, or a fault of this loop's own
                # (a callback): logged, and the loop goes on.
                log.warning("a step failed and was undone (%s: %s)", type(e).__name__, e)
        self._take(block=False)
        for rid in list(self._live):
            if self.llm.num_generated(rid) is not None:
                self.llm.abort(rid)
        self._fail_all(503, "the server is shutting down")

    def _fail_all(self, status: int, message: str) -> None:
        """Ends every live request with an "error" event."""
        for rid in list(self._live):
            self._done(rid, Event("error", status=status, message=message))

    def _deliver(self, res) -> None:
        """A step's ``StepResult`` to the requests' callbacks: the tokens each generated
        (metrics), the text the streamed ones' pieces settled, the finished outputs."""
        now = time.perf_counter()
        for rid, n in res.new_tokens.items():
            live = self._live.get(rid)
            if live is None:
                continue
            if self._on_tokens is not None:
                gap = None if live.last_token_time is None else now - live.last_token_time
                self._on_tokens(n, gap)
            live.last_token_time = now
        for piece in res.streamed:
            live = self._live.get(piece.request_id)
            # (tokens whose text is held back wait, but not a prompt's log-probs)
            if live is not None and (
                piece.text or piece.logprobs or piece.prompt_logprobs is not None
            ):
                live.notify(Event("text", sample=piece.sample, text=piece.text, piece=piece))
        for out in res:
            self._done(out.request_id, Event("done", output=out))
