"""A draft model as the proposer of speculative decoding (``SpeculativeConfig(method=
"draft", draft_model=...)``).

``DraftModelProposer`` runs a second, smaller model that shares the target's tokenizer on
a paged KV pool and block manager of its own. For each sequence it keeps the tokens whose
K/V that pool holds; when asked to propose it rolls them back to what the sequence's
tokens still agree with (the target rejected the rest), computes the tokens it has not
seen in one ragged step with the other sequences' (the last sampled token at least), and
then decodes greedily, one step a token, all sequences together, until each has its
proposals. Its argmax proposals are certain ones, so the target keeps exactly the tokens
it samples without speculation (``paged_jax.engine.speculative``). Sequences it has not
been asked about lately are dropped when its pool runs short (least recently used
first); a sequence dropped or preempted is simply recomputed from its tokens when next
asked about.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.batch import ScheduledSeq, build_batch
from paged_jax.block_manager import BlockManager, OutOfPages
from paged_jax.engine.speculative import DraftRequest
from paged_jax.metadata import AttentionMetadata


@functools.lru_cache(maxsize=4)
def _draft_step(graphdef):
    """The draft's jitted step: ``(state, tokens i32[T], positions i32[T], cache,
    metadata) -> (argmax i32[R] of the logits of the metadata's rows, cache)``."""
    from flax import nnx

    @functools.partial(jax.jit, donate_argnums=(3,))
    def step(state, tokens, positions, cache, md):
        model = nnx.merge(graphdef, state)
        cache = cache.copy_pages(md.copy_src, md.copy_dst)
        logits, cache = model(tokens, positions, cache, md)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

    return step


class DraftModelProposer:
    """Greedy proposals of ``model`` (a ``PagedDecoder`` with the target's vocabulary) on
    a pool of ``num_pages`` pages of ``page_size`` tokens (``cache_dtype``: its K/V
    dtype, None for the model's default)."""

    def __init__(
        self,
        model: Any,
        *,
        vocab_size: int,
        page_size: int,
        num_pages: int,
        cache_dtype: Any = None,
    ):
        from flax import nnx

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
        self.cache = model.make_cache(num_pages, page_size, cache_dtype)
        graphdef, self.state = nnx.split(model)
        self._step = _draft_step(graphdef)
        self._recent: OrderedDict = OrderedDict()  # seq_id -> None, least recently asked first
        self.steps = 0  # draft steps run (metrics, tests)

    def release(self, seq_id) -> None:
        """Forgets a sequence (its pages back to the pool)."""
        if seq_id in self.bm:
            self.bm.free(seq_id)
        self._recent.pop(seq_id, None)

    def _run(self, scheduled: list[ScheduledSeq]) -> np.ndarray:
        """One draft step over ``scheduled``; the argmax token of each row's last position."""
        batch = build_batch(self.bm, scheduled, min_tokens=8, min_seqs=8)
        md = AttentionMetadata.from_batch(batch)
        ids, self.cache = self._step(
            self.state, jnp.asarray(batch.token_ids), jnp.asarray(batch.positions), self.cache, md
        )
        self.steps += 1
        for s in scheduled:
            self.bm.mark_computed(s.seq_id, s.stop)
        return np.asarray(ids)[: len(scheduled)]

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
        nxt = self._run(scheduled)
        for (i, _), tok in zip(live, nxt.tolist(), strict=True):
            out[i].append(tok)
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
            nxt = self._run([s for _, s in scheduled])
            for (i, _), tok in zip(scheduled, nxt.tolist(), strict=True):
                out[i].append(tok)
        return out
