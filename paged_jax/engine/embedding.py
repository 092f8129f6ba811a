"""Embeddings: each prompt's final hidden states (after the model's last norm) pooled into
one vector (``LLM.embed``; the server's ``/v1/embeddings``).

Decoder models trained as embedders (Qwen3-Embedding, gte-Qwen2, e5-mistral) take the
last token's hidden state, L2-normalized: ``pooling="last"``, the default; ``"mean"``
averages every prompt position's, ``"first"`` takes the first one's. The prompts run as
prefill steps of the serving model's weights (``model.hidden_states``), packed into steps
of at most the engine's ``max_num_batched_tokens`` tokens and ``max_num_seqs`` rows (a
long prompt split across steps, as chunked prefill splits it) on a KV pool of their own,
allocated for the call and sized to the plan, so the engine's pool, block tables and
prefix cache are untouched and generation may be in flight. One compiled step per
bucket of tokens, rows, pages and pool, as the engine's steps are.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.batch import ScheduledSeq, bucket, build_batch
from paged_jax.block_manager import BlockManager, HybridBlockManager
from paged_jax.engine.devices import mesh_context
from paged_jax.engine.sampling import SamplingParams
from paged_jax.errors import with_context
from paged_jax.metadata import AttentionMetadata

POOLINGS = ("last", "mean", "first")


def embed(core, prompts, *, pooling: str = "last", normalize: bool = True) -> list:
    """``LLM.embed``: each of ``prompts`` checked (an error names ``prompts[k]``) against
    engine ``core`` and embedded (``EmbeddingOutput``s, in order)."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling: expected one of {POOLINGS}, got {pooling!r}")
    if not isinstance(normalize, bool):
        raise TypeError(f"normalize: expected a bool, got {normalize!r}")
    model = core.runner.model
    if not callable(getattr(model, "hidden_states", None)):
        raise TypeError(
            f"model: {type(model).__name__} has no hidden_states(...) "
            "(paged_jax.models' decoders have); embeddings need it"
        )
    if len(core.schedulers) > 1:
        raise ValueError(
            "data_parallel_size: embeddings do not run on data-parallel replicas yet; "
            "use a tensor-parallel mesh or one device"
        )
    if isinstance(prompts, str):
        prompts = [prompts]
    if not prompts:
        return []
    ids = []
    probe = SamplingParams(max_tokens=1)
    for k, prompt in enumerate(prompts):
        try:
            ids.append(core.check_request(prompt, probe))
        except (ValueError, TypeError) as e:
            raise with_context(e, f"prompts[{k}]") from e
    sc = core.schedulers[0]
    vectors = embed_prompts(
        core.runner,
        ids,
        pooling=pooling,
        normalize=normalize,
        max_tokens=sc.max_num_batched_tokens,
        max_rows=sc.max_num_seqs,
    )
    return [EmbeddingOutput(list(p), v) for p, v in zip(ids, vectors, strict=True)]


@dataclasses.dataclass
class EmbeddingOutput:
    """One prompt's embedding: ``embedding`` f32 ``[E]`` (L2 norm 1 when normalized)."""

    prompt_token_ids: list[int]
    embedding: np.ndarray


@functools.lru_cache(maxsize=8)
def _hidden_step(graphdef, state_def, mesh):
    """``(weights, tokens i32[T], positions i32[T], cache, md) -> (f32[R, E], cache)``:
    the hidden states of the metadata's rows."""
    from flax import nnx

    @functools.partial(jax.jit, donate_argnums=(3,))
    def step(weights, tokens, positions, cache, md):
        model = nnx.merge(graphdef, jax.tree.unflatten(state_def, weights))
        return model.hidden_states(tokens, positions, cache, md)

    return step


def plan_steps(
    lengths: Sequence[int], max_tokens: int, max_rows: int
) -> list[list[tuple[int, int, int]]]:
    """Prompts of ``lengths`` tokens packed in order into steps of at most ``max_tokens``
    tokens and ``max_rows`` rows: each step a list of ``(prompt, start, stop)`` chunks (a
    prompt split across consecutive steps where it does not fit). No JAX."""
    steps: list[list[tuple[int, int, int]]] = []
    step: list[tuple[int, int, int]] = []
    used = 0
    for i, n in enumerate(lengths):
        a = 0
        while a < n:
            take = min(n - a, max_tokens - used)
            step.append((i, a, a + take))
            a += take
            used += take
            if used == max_tokens or len(step) == max_rows:
                steps.append(step)
                step, used = [], 0
    if step:
        steps.append(step)
    return steps


def embed_prompts(
    runner, prompts: Sequence[Sequence[int]], *, pooling: str, normalize: bool, max_tokens: int,
    max_rows: int,
) -> list[np.ndarray]:  # fmt: skip
    """The pooled hidden states (f32 ``[E]`` each) of token-id ``prompts`` under
    ``runner``'s model (a ``ModelRunner``; see the module docstring)."""
    P = runner.page_size
    steps = plan_steps([len(p) for p in prompts], max_tokens, max_rows)
    # a prompt's pages are allocated whole at its first chunk and freed after its last;
    # the prompts alive in a step are the ones it computes
    pages = max(sum(-(-len(prompts[i]) // P) for i, _, _ in s) for s in steps)
    # a hybrid pool (layer groups with windows, as the engine's): pages in every group
    windows = runner.group_windows if runner.hybrid_kv_cache else None
    groups = 1 if windows is None else len(windows)
    num_pages = bucket(pages * groups + 1, 16)  # (page 0 is the null page)
    kw = dict(enable_prefix_caching=False, watermark=0.0)
    if windows is None:
        bm = BlockManager(num_pages, P, **kw)
    else:
        bm = HybridBlockManager(num_pages, P, group_windows=windows, **kw)
    cache = runner.make_cache(num_pages)
    step_fn = _hidden_step(runner._graphdef, runner._state_def, runner.mesh)  # noqa: SLF001
    E = runner.model.config.hidden_size
    sums = np.zeros((len(prompts), E), np.float64)
    out: list[np.ndarray | None] = [None] * len(prompts)
    for s in steps:
        for i, a, _ in s:
            if a == 0:
                bm.allocate(i, np.asarray(prompts[i], np.int32))
        batch = build_batch(bm, [ScheduledSeq(i, a, b) for i, a, b in s], min_tokens=8)
        if pooling != "last":  # every token's row
            rows = np.arange(batch.token_ids.shape[0], dtype=np.int32)
            batch = dataclasses.replace(batch, logits_indices=rows)
        md = AttentionMetadata.from_batch(batch)
        with mesh_context(runner.mesh):
            hidden, cache = step_fn(
                runner.weights,
                jnp.asarray(batch.token_ids),
                jnp.asarray(batch.positions),
                cache,
                md,
            )
        h = np.asarray(hidden, np.float32)
        for k, (i, a, b) in enumerate(s):
            off = int(batch.cu_q_lens[k])
            if pooling == "last" and b == len(prompts[i]):
                out[i] = h[k]
            elif pooling == "mean":
                sums[i] += h[off : off + b - a].sum(0, dtype=np.float64)
            elif pooling == "first" and a == 0:
                out[i] = h[off]
            bm.mark_computed(i, b)
            if b == len(prompts[i]):
                bm.free(i)
    if pooling == "mean":
        out = [(sums[i] / len(p)).astype(np.float32) for i, p in enumerate(prompts)]
    vectors = [np.asarray(v, np.float32) for v in out]
    if normalize:
        vectors = [v / n if (n := float(np.linalg.norm(v))) > 0 else v for v in vectors]
    return vectors
