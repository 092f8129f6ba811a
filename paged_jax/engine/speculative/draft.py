"""A draft model as the proposer of speculative decoding (``SpeculativeConfig(method=
"draft", draft_model=...)``).

``DraftModelProposer`` runs a second, smaller model that shares the target's tokenizer on
a paged KV pool and block manager of its own. For each sequence it keeps the tokens whose
K/V that pool holds; when asked to propose it rolls them back to what the sequence's
tokens still agree with (the target rejected the rest), computes the tokens it has not
seen in one ragged step with the other sequences' (the last sampled token at least), and
then decodes greedily, all sequences together, the rest of each one's proposals in one
jitted launch (``decode_loop``, as the target's multi-step decoding: the block manager
reserves the proposals' slots before it and fills them after), or one step a token where
the pool cannot reserve them all. Its argmax proposals are certain ones, so the target
keeps exactly the tokens it samples without speculation (``paged_jax.engine.speculative``).
Sequences it has not been asked about lately are dropped when its pool runs short (least
recently used first); a sequence dropped or preempted is simply recomputed from its
tokens when next asked about.

A step computes at most ``max_step_tokens`` tokens (the target's
``max_num_batched_tokens``): tokens beyond go to further steps, prompts split into chunks
as chunked prefill splits them, so no draft step is larger than the target's. With static
shapes (``warm_up``, which ``LLM.warm_up()`` runs) every block table is padded to
``max_model_len``'s pages, and the draft's steps have one shape per pair of token and
sequence buckets, all compiled before real work.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.batch import ScheduledSeq, bucket, build_batch, null_batch
from paged_jax.block_manager import BlockManager, OutOfPages
from paged_jax.engine.devices import mesh_context
from paged_jax.engine.shapes import StepShape, step_shapes
from paged_jax.engine.speculative.proposers import DraftRequest
from paged_jax.metadata import AttentionMetadata
from paged_jax.sharding import create_cache

log = logging.getLogger("paged_jax")

_MIN_TOKENS = _MIN_SEQS = 8  # a draft step's smallest buckets


@functools.lru_cache(maxsize=4)
def _draft_step(graphdef, mesh):
    """The draft's jitted step (for ``mesh``, or None): ``(state, tokens i32[T],
    positions i32[T], cache, metadata) -> (argmax i32[R] of the logits of the metadata's
    rows, cache)``."""
    from flax import nnx

    @functools.partial(jax.jit, donate_argnums=(3,))
    def step(state, tokens, positions, cache, md):
        model = nnx.merge(graphdef, state)
        cache = cache.copy_pages(md.copy_src, md.copy_dst)
        logits, cache = model(tokens, positions, cache, md)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

    return step


@functools.lru_cache(maxsize=8)
def _draft_loop(graphdef, mesh, num_steps: int):
    """The draft's jitted multi-step decode (for ``mesh``, or None): ``(state, tokens
    i32[T], positions i32[T], cache, metadata, steps i32[S]) -> (argmax tokens i32[S,
    num_steps], cache)``, row ``r``'s first ``steps[r]`` columns its proposals after the
    token it computes first (``paged_jax.engine.multistep.decode_loop``)."""
    from flax import nnx

    from paged_jax.engine.multistep import decode_loop

    def argmax(logits, pos):
        t = jnp.argmax(logits, axis=-1).astype(jnp.int32)[:, None]
        return t, jnp.zeros(t.shape, jnp.float32)

    @functools.partial(jax.jit, donate_argnums=(3,))
    def loop(state, tokens, positions, cache, md, steps):
        model = nnx.merge(graphdef, state)
        cache = cache.copy_pages(md.copy_src, md.copy_dst)
        toks, _, cache = decode_loop(
            model, argmax, tokens, positions, cache, md, steps, jnp.zeros_like(steps), num_steps
        )
        return toks, cache

    return loop


class DraftModelProposer:
    """Greedy proposals of ``model`` (a ``PagedDecoder`` with the target's vocabulary) on
    a pool of ``num_pages`` pages of ``page_size`` tokens (``cache_dtype``: its K/V
    dtype, None for the model's default).

    ``mesh``: the target's tensor-parallel mesh, on which the draft's weights lie (its
    pool is split along heads as the target's); None: one device.
    ``max_model_len``: the longest sequence (the width of a static block table);
    ``max_step_tokens``: the most tokens one draft step computes (more go to further
    steps); ``max_num_seqs``: the most sequences one ``propose`` call names (what
    ``warm_up`` compiles for); ``max_proposals``: the most tokens a request asks for
    (``num_speculative_tokens``: the proposals after the first are decoded in one launch
    of that many steps less one; None: from each call's requests, a power of two);
    ``on_compile``: called with a dict (``draft``, ``tokens``, ``seqs``,
    ``pages_per_seq``, ``seconds``, and ``steps`` for a multi-step launch) for each step
    shape compiled (the engine's ``compiled_buckets`` take them)."""

    def __init__(
        self,
        model: Any,
        *,
        vocab_size: int,
        page_size: int,
        num_pages: int,
        cache_dtype: Any = None,
        max_model_len: int | None = None,
        max_step_tokens: int = 2048,
        max_num_seqs: int = 256,
        max_proposals: int | None = None,
        on_compile: Callable[[dict], None] | None = None,
        mesh: Any = None,
    ):
        from flax import nnx

        for name, v in (("max_step_tokens", max_step_tokens), ("max_num_seqs", max_num_seqs)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        bad = isinstance(max_proposals, bool) or not isinstance(max_proposals, int | None)
        if bad or (max_proposals is not None and max_proposals < 1):
            raise ValueError(f"max_proposals: expected an int >= 1 or None, got {max_proposals!r}")
        bad_len = isinstance(max_model_len, bool) or not isinstance(max_model_len, int | None)
        if bad_len or (max_model_len is not None and max_model_len < 2):
            raise ValueError(f"max_model_len: expected an int >= 2 or None, got {max_model_len!r}")

        draft_vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        if draft_vocab is None or not callable(getattr(model, "make_cache", None)):
            raise TypeError(
                "speculative.draft_model: expected a paged-jax model (a PagedDecoder with "
                f"config.vocab_size and make_cache), got {type(model).__name__}"
            )
        if draft_vocab > vocab_size:
            raise ValueError(
                f"speculative.draft_model: its vocabulary ({draft_vocab} tokens) is larger "
                f"than the target's ({vocab_size}); a draft must share the target's tokenizer"
            )
        self.model = model
        self.page_size = page_size
        self.bm = BlockManager(num_pages, page_size, enable_prefix_caching=False, watermark=0.0)
        self.mesh = mesh
        make = functools.partial(model.make_cache, num_pages, page_size, cache_dtype)
        self.cache = make() if mesh is None else create_cache(make, mesh)
        graphdef, self.state = nnx.split(model)
        self._graphdef = graphdef
        self._step = _draft_step(graphdef, mesh)
        self.max_proposals = max_proposals
        self.launches = 0  # multi-step launches run (metrics, tests)
        self._recent: OrderedDict = OrderedDict()  # seq_id -> None, least recently asked first
        self.steps = 0  # draft steps run (metrics, tests)
        self.max_model_len = max_model_len
        self.max_step_tokens = max_step_tokens
        self.max_num_seqs = max_num_seqs
        self.on_compile = on_compile
        self.static_shapes = False  # block tables padded to max_model_len (warm_up)

    def release(self, seq_id) -> None:
        """Forgets a sequence (its pages back to the pool)."""
        if seq_id in self.bm:
            self.bm.free(seq_id)
        self._recent.pop(seq_id, None)

    @property
    def table_width(self) -> int:
        """Pages per block-table row with static shapes (the bucket of ``max_model_len``'s
        pages)."""
        if self.max_model_len is None:
            raise ValueError("max_model_len: static shapes need the longest sequence, got None")
        return bucket(-(-self.max_model_len // self.page_size), 4)

    def step_shapes(self) -> list[StepShape]:
        """Every shape a draft step takes with static shapes: ``T`` a power of two from 8
        to the bucket of ``max_step_tokens``, ``S`` from 8 to that of ``max_num_seqs``
        (at most ``T``), a decode-only variant where ``T == S``."""
        return step_shapes(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_step_tokens,
            pages_per_seq=self.table_width,
            min_tokens=_MIN_TOKENS,
            min_seqs=lambda _: _MIN_SEQS,
        )

    def warm_up(self, progress: bool = True) -> int:
        """Switches to static shapes and compiles every ``step_shapes()`` shape, each run
        once on a batch that touches only the null page; returns how many compiled (the
        rest were compiled before, by this draft model's other proposers)."""
        self.static_shapes = True
        shapes = self.step_shapes()
        compiled = 0
        t0 = time.perf_counter()
        for k, shape in enumerate(shapes):
            batch = null_batch(
                shape.tokens, shape.seqs, shape.pages_per_seq, decode_only=shape.decode_only
            )
            ids, compiled_now = self._launch(batch)
            jax.block_until_ready(ids)
            compiled += compiled_now
            if shape.decode_only and (self.max_proposals or 0) > 1:  # the proposals' loop
                steps = np.zeros(shape.seqs, np.int32)
                ids, compiled_now = self._launch(batch, steps, self.max_proposals - 1)
                jax.block_until_ready(ids)
                compiled += compiled_now
            if progress and not (k + 1) % 8:
                log.info("%d of %d draft step shapes ready (%.1f s)", k + 1, len(shapes),
                         time.perf_counter() - t0)  # fmt: skip
        log.info("every draft step shape ready: %d compiled, %d already compiled, in %.1f s",
                 compiled, len(shapes) - compiled, time.perf_counter() - t0)  # fmt: skip
        return compiled

    def _launch(self, batch, steps=None, num_steps: int = 1) -> tuple[jax.Array, bool]:
        """Runs the jitted step on ``batch`` (the pool updated in place), or with ``steps``
        (``i32[S_b]``) the multi-step loop of ``num_steps`` steps; returns its argmax ids
        (on the device: ``i32[R]``, or ``i32[S_b, num_steps]``) and whether it compiled."""
        fn = self._step if steps is None else _draft_loop(self._graphdef, self.mesh, num_steps)
        before = fn._cache_size()
        t = time.perf_counter()
        md = AttentionMetadata.from_batch(batch)
        args = (self.state, jnp.asarray(batch.token_ids), jnp.asarray(batch.positions))
        with mesh_context(self.mesh):
            if steps is None:
                ids, self.cache = fn(*args, self.cache, md)
            else:
                ids, self.cache = fn(*args, self.cache, md, jnp.asarray(steps))
        if fn._cache_size() == before:
            return ids, False
        jax.block_until_ready(ids)
        b = dict(
            draft=True,
            tokens=int(batch.token_ids.shape[0]),
            seqs=int(batch.kv_lens.shape[0]),
            pages_per_seq=int(batch.page_indices.shape[-1]),
            seconds=round(time.perf_counter() - t, 2),
        )
        if steps is not None:
            b["steps"] = num_steps
        log.info("compiled a draft step in %.1f s: %s", b["seconds"], b)
        if self.on_compile is not None:
            self.on_compile(b)
        return ids, True

    def _run(self, scheduled: list[ScheduledSeq]) -> np.ndarray:
        """One draft step over ``scheduled`` (at most ``max_step_tokens`` tokens); the
        argmax token of each row's last position."""
        batch = build_batch(
            self.bm,
            scheduled,
            min_tokens=_MIN_TOKENS,
            min_seqs=_MIN_SEQS,
            min_pages=self.table_width if self.static_shapes else 4,
        )
        ids, _ = self._launch(batch)
        self.steps += 1
        for s in scheduled:
            self.bm.mark_computed(s.seq_id, s.stop)
        return np.asarray(ids)[: len(scheduled)]

    def _compute(self, scheduled: list[ScheduledSeq]) -> np.ndarray:
        """Computes the tokens of ``scheduled`` in as few steps of at most
        ``max_step_tokens`` tokens as they fit (a sequence's tokens split across steps in
        order, as chunked prefill splits a prompt); the argmax token after each
        sequence's last one."""
        out = np.zeros(len(scheduled), np.int32)
        step: list[ScheduledSeq] = []
        ends: list[tuple[int, int]] = []  # (index in scheduled, row in step) of last chunks
        used = 0
        for i, s in enumerate(scheduled):
            a = s.start
            while a < s.stop:
                take = min(s.stop - a, self.max_step_tokens - used)
                step.append(ScheduledSeq(s.seq_id, a, a + take))
                a += take
                used += take
                if a == s.stop:
                    ends.append((i, len(step) - 1))
                if used == self.max_step_tokens:
                    ids = self._run(step)
                    for j, r in ends:
                        out[j] = ids[r]
                    step, ends, used = [], [], 0
        if step:
            ids = self._run(step)
            for j, r in ends:
                out[j] = ids[r]
        return out

    def _sync(self, r: DraftRequest, keep: set) -> int | None:
        """Readies sequence ``r.seq_id`` to compute its unseen tokens; returns the first of
        them (None: no pages for it, even after dropping the least recently asked
        sequences outside ``keep``)."""
        t = r.tokens
        n = len(t)
        if r.seq_id in self.bm:
            known = self.bm.token_ids(r.seq_id)
            m = min(len(known), n - 1)
            differ = np.flatnonzero(known[:m] != t[:m])
            common = int(differ[0]) if len(differ) else m
            self.bm.truncate(r.seq_id, common, computed=True)
        else:
            common = 0
        while True:
            try:
                if r.seq_id in self.bm:
                    self.bm.append_slots(r.seq_id, t[common:])
                else:
                    self.bm.allocate(r.seq_id, t)
                return common
            except OutOfPages:
                victim = next((s for s in self._recent if s not in keep), None)
                if victim is None:
                    return None
                self.release(victim)

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        keep = {r.seq_id for r in requests}
        out: list[list[int]] = [[] for _ in requests]
        live = []  # (index, request)
        scheduled = []
        for i, r in enumerate(requests):
            if r.max_tokens <= 0 or len(r.tokens) == 0:
                continue
            start = self._sync(r, keep)
            self._recent.pop(r.seq_id, None)
            self._recent[r.seq_id] = None
            if start is None:
                continue
            live.append((i, r))
            scheduled.append(ScheduledSeq(r.seq_id, start, len(r.tokens)))
        if not live:
            return out
        nxt = self._compute(scheduled)
        for (i, _), tok in zip(live, nxt.tolist(), strict=True):
            out[i].append(tok)
        if self._decode_rest(live, out):
            return out
        for _ in range(1, max(r.max_tokens for _, r in live)):
            going = [(i, r) for i, r in live if len(out[i]) < r.max_tokens]
            scheduled = []
            for i, r in going:
                try:
                    self.bm.append_slots(r.seq_id, [out[i][-1]])
                except OutOfPages:
                    continue
                n = self.bm.num_tokens(r.seq_id)
                scheduled.append((i, ScheduledSeq(r.seq_id, n - 1, n)))
            if not scheduled:
                break
            nxt = self._compute([s for _, s in scheduled])
            for (i, _), tok in zip(scheduled, nxt.tolist(), strict=True):
                out[i].append(tok)
        return out

    def _decode_rest(self, live: list, out: list[list[int]]) -> bool:
        """Each live request's proposals after its first (``out[i]``, extended in place)
        in one multi-step launch: its first proposal appended, slots reserved for the
        proposals the launch computes, filled once it returned. Returns False, changing
        nothing, where the pool cannot hold them all (one step a token then)."""
        going = [(i, r) for i, r in live if r.max_tokens > 1]
        if not going:
            return True
        most = max(r.max_tokens for _, r in going) - 1
        num_steps = self.max_proposals - 1 if self.max_proposals else bucket(most, 1)
        if most > num_steps or len(going) > min(self.max_num_seqs, self.max_step_tokens):
            return False
        ids = [r.seq_id for _, r in going]
        steps = [r.max_tokens - 1 for _, r in going]
        firsts = [self.bm.num_tokens(r.seq_id) for _, r in going]
        try:
            for i, r in going:
                self.bm.append_slots(r.seq_id, [out[i][0]])
        except OutOfPages:
            for (_, r), n in zip(going, firsts, strict=True):
                self.bm.truncate(r.seq_id, n, computed=True)
            return False
        if not self.bm.reserve_tokens(ids, [k - 1 for k in steps]):
            for (_, r), n in zip(going, firsts, strict=True):
                self.bm.truncate(r.seq_id, n, computed=True)
            return False
        scheduled = [ScheduledSeq(s, n, n + 1) for s, n in zip(ids, firsts, strict=True)]
        batch = build_batch(
            self.bm,
            scheduled,
            min_tokens=_MIN_TOKENS,
            min_seqs=_MIN_SEQS,
            min_pages=self.table_width if self.static_shapes else 4,
            table_tokens=[n + k for n, k in zip(firsts, steps, strict=True)],
        )
        rows = np.zeros(batch.kv_lens.shape[0], np.int32)
        rows[: len(steps)] = steps
        toks, _ = self._launch(batch, rows, num_steps)
        toks = np.asarray(toks)
        self.steps += max(steps)
        self.launches += 1
        starts, counts = [n + 1 for n in firsts], [k - 1 for k in steps]
        self.bm.fill_reserved(ids, starts, toks[: len(ids)], counts=counts)
        for s, n, k in zip(ids, firsts, steps, strict=True):
            self.bm.mark_computed(s, n + k)
        for row, ((i, _), k) in enumerate(zip(going, steps, strict=True)):
            out[i].extend(toks[row, :k].tolist())
        return True
