"""Test helpers: greedy decoding through the paged cache, and an unpaged dense oracle."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax.batch import ScheduledSeq, build_batch
from paged_jax.block_manager import BlockManager, HybridBlockManager
from paged_jax.metadata import AttentionMetadata
from paged_jax.models.layers import apply_rope, rope_inv_freq
from paged_jax.models.llama import make_step


def gqa_config(num_kv_heads: int):
    """A small model with 8 query heads and ``num_kv_heads`` KV heads (head_dim 16),
    whose sizes every tensor-parallel size up to 8 divides."""
    from paged_jax.models import LlamaConfig

    return LlamaConfig(
        vocab_size=320,
        hidden_size=128,
        intermediate_size=256,
        num_layers=2,
        num_heads=8,
        num_kv_heads=num_kv_heads,
        head_dim=16,
        max_position_embeddings=512,
    )


def pool_collectives(hlo: str, cache) -> int:
    """HLO lines (``%x = f32[...] all-gather(...)``) that are collectives whose result is
    shaped like ``cache``'s pool or part of it (``[L, any pages, P, ...]``): a tensor- or
    data-parallel step has none."""
    L, _, P = cache.kv_pages.shape[:3]
    pool = re.compile(rf"\[{L},\d+,{P},")
    count = 0
    for line in hlo.splitlines():
        _, eq, rhs = line.partition("= ")
        shape, _, op = rhs.strip().partition(" ")
        if eq and op.startswith(("all-gather", "all-reduce", "all-to-all", "collective-permute")):
            count += bool(pool.search(shape))
    return count


def kernel_kwargs(backend: str) -> dict:
    """``backend`` / ``interpret`` for running ``backend`` here: Pallas kernels compile on
    their own platform and are interpreted on CPU; skips the test anywhere else."""
    import pytest

    platform = jax.default_backend()
    native = {"xla": platform, "pallas_tpu": "tpu", "pallas_gpu": "gpu"}[backend]
    if platform not in ("cpu", native):
        pytest.skip(f"{backend}: compiled on {native}, interpreted on CPU; this is {platform}")
    return dict(backend=backend, interpret=platform == "cpu" and backend != "xla")


class PagedGreedy:
    """A minimal continuous-batching loop: one ragged prefill step, then decode steps.

    ``forks``: {child: parent} sequences forked from a parent right after its prefill,
    sharing all of its pages. ``prefix_caching``: later prompts reuse earlier full pages.
    ``shapes`` records the bucketed shapes of every step and whether it was decode-only
    (what the jit cache keys on: to count compilations).
    """

    def __init__(
        self,
        model,
        *,
        page_size,
        num_pages=256,
        prefix_caching=False,
        backend="auto",
        hybrid=False,
        **kw,
    ):
        self.model = model
        self.step, self.state = make_step(model, backend=backend, **kw)
        self.cache = model.make_cache(num_pages, page_size, hybrid=hybrid)
        args = dict(enable_prefix_caching=prefix_caching, watermark=0.0)
        if self.cache.layer_groups is None:
            self.bm = BlockManager(num_pages, page_size, **args)
        else:  # sliding layers' pages freed outside the window
            windows = self.cache.layer_groups[0]
            self.bm = HybridBlockManager(num_pages, page_size, group_windows=windows, **args)
        self.shapes = []
        self.computed_tokens = 0

    def run(self, scheduled):
        batch = build_batch(self.bm, scheduled)
        md = AttentionMetadata.from_batch(batch)
        self.shapes.append(
            (
                batch.token_ids.shape,
                batch.page_indices.shape,
                batch.copy_src.shape,
                md.decode_only,
            )
        )
        self.computed_tokens += batch.num_tokens
        logits, self.cache = self.step(
            self.state,
            jnp.asarray(batch.token_ids),
            jnp.asarray(batch.positions),
            self.cache,
            md,
        )
        return np.asarray(logits)[: len(scheduled)]

    def prefill(self, prompts: dict):
        sched = []
        for sid, p in prompts.items():
            cached = self.bm.allocate(sid, p)
            sched.append(ScheduledSeq(sid, cached, len(p)))
        logits = self.run(sched)
        for s in sched:
            self.bm.mark_computed(s.seq_id, s.stop)
        return {s.seq_id: int(np.argmax(row)) for s, row in zip(sched, logits, strict=True)}

    def decode(self, first: dict, max_new: int, forks: dict | None = None):
        """Greedy decode from each sequence's first generated token; returns token lists."""
        out = {sid: [tok] for sid, tok in first.items()}
        for child, parent in (forks or {}).items():
            self.bm.fork(parent, child)
            out[child] = list(out[parent])
        for _ in range(max_new - 1):
            sched = []
            for sid, toks in out.items():
                self.bm.append_slots(sid, [toks[-1]])
                n = self.bm.num_tokens(sid)
                sched.append(ScheduledSeq(sid, n - 1, n))
            logits = self.run(sched)
            for s, row in zip(sched, logits, strict=True):
                out[s.seq_id].append(int(np.argmax(row)))
        return out


def dense_logits(model, ids) -> np.ndarray:
    """All-position logits of ``ids`` with plain causal attention and no cache at all.

    Causal attention makes positions independent of later ones, so ``ids`` are padded to
    a multiple of 64 and one compiled function serves every length.
    """
    n = len(ids)
    padded = np.zeros(-(-n // 64) * 64, np.int32)
    padded[:n] = ids
    return np.asarray(_dense_logits(model, jnp.asarray(padded)))[:n]


def _projections(a, h):
    """``(q, k, v)`` of attention module ``a`` on ``h``, before RoPE: three products, or
    one split where the model is held for an accelerator (``Attention.fuse_projections``)."""
    if not hasattr(a, "qkv_proj"):
        return a.q_proj(h), a.k_proj(h), a.v_proj(h)
    HD, KD, _ = a.qkv_proj.parts
    qkv = a.qkv_proj(h)
    return qkv[:, :HD], qkv[:, HD : HD + KD], qkv[:, HD + KD :]


def dense_hidden(model, ids) -> np.ndarray:
    """All-position final hidden states (after the last norm) of ``ids``, computed as
    ``dense_logits`` computes the logits: f32 ``[len(ids), E]``."""
    n = len(ids)
    padded = np.zeros(-(-n // 64) * 64, np.int32)
    padded[:n] = ids
    return np.asarray(_jit_dense_hidden(model, jnp.asarray(padded)), np.float32)[:n]


@nnx.jit
def _dense_logits(model, ids):
    x = _dense_hidden(model, ids)
    logits = model.embed_tokens.attend(x) if model.lm_head is None else model.lm_head(x)
    return logits.astype(jnp.float32)


def _dense_hidden(model, ids):
    cfg = model.config
    T = ids.shape[0]
    pos = jnp.arange(T)
    inv = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    x = model.embed_tokens(ids)
    mask = pos[None, :] <= pos[:, None]
    if cfg.sliding_window is not None:
        mask &= pos[:, None] - pos[None, :] < cfg.sliding_window
    for layer in (model.layer(i) for i in range(cfg.num_layers)):
        a = layer.self_attn
        h = layer.input_layernorm(x)
        q, k, v = _projections(a, h)
        q = apply_rope(q.reshape(T, a.num_heads, a.head_dim), pos, inv)
        k = apply_rope(k.reshape(T, a.num_kv_heads, a.head_dim), pos, inv)
        v = v.reshape(T, a.num_kv_heads, a.head_dim)
        g = a.num_heads // a.num_kv_heads
        k, v = jnp.repeat(k, g, axis=1), jnp.repeat(v, g, axis=1)
        s = jnp.einsum("qhd,khd->hqk", q, k, precision="highest") * a.head_dim**-0.5
        p = jax.nn.softmax(jnp.where(mask[None], s, -jnp.inf), axis=-1)
        o = jnp.einsum("hqk,khd->qhd", p, v, precision="highest").reshape(T, -1)
        x = x + a.o_proj(o)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.norm(x)


_jit_dense_hidden = nnx.jit(_dense_hidden)


def dense_greedy(model, prompt, max_new: int) -> list[int]:
    ids = list(prompt)
    out = []
    for _ in range(max_new):
        tok = int(np.argmax(dense_logits(model, ids)[-1]))
        out.append(tok)
        ids.append(tok)
    return out


def paged_prompt_logits(model, ids, page_size: int = 8, **kw) -> np.ndarray:
    """f32[T, V]: logits of every position of ``ids``, one prefill through a paged cache
    (pages 1, 2, ... in order); ``kw`` (backend, interpret) go to the model."""
    n_pages = -(-len(ids) // page_size)
    cache = model.make_cache(n_pages + 1, page_size)
    slots = page_size + np.arange(len(ids))
    md = AttentionMetadata.prefill(len(ids), slots, list(range(1, n_pages + 1)), logits_all=True)
    tokens = jnp.asarray(ids, jnp.int32)
    logits, _ = model(tokens, jnp.arange(len(ids), dtype=jnp.int32), cache, md, **kw)
    return np.asarray(logits)


def greedy_batch_fork_and_prefix_hit(
    model, prompts: dict, batch, hit: str, max_new: int = 32, **kw
):
    """Greedy tokens of ``prompts[k]`` for k in ``batch``, decoded together through a paged
    cache with prefix caching (page size 8), of "twin", forked from "mid" after its
    prefill, and of ``prompts[hit]``, prefilled afterwards on its own. Returns
    ``(outputs by name, tokens the hit's prefill computed)``; ``kw`` go to
    ``PagedGreedy`` (``hybrid``), which is ``outputs["_loop"]``."""
    g = PagedGreedy(model, page_size=8, prefix_caching=True, **kw)
    first = g.prefill({k: prompts[k] for k in batch})
    out = g.decode(first, max_new=max_new, forks={"twin": "mid"})
    before = g.computed_tokens
    first = g.prefill({hit: prompts[hit]})
    computed = g.computed_tokens - before
    out.update(g.decode(first, max_new=max_new))
    out["_loop"] = g
    return out, computed
