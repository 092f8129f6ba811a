"""The Pallas kernels inside a real decoder step (interpreted on CPU, compiled on their own
hardware): the same logits as the XLA path on batches built by the block manager (buckets,
padding rows, prefix pages)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_helpers import kernel_kwargs

from paged_jax import AttentionMetadata, models
from paged_jax.batch import ScheduledSeq, build_batch
from paged_jax.block_manager import BlockManager


@pytest.fixture(scope="module")
def setup():
    model = models.init_model(models.TINY_LLAMA, seed=0)
    bm = BlockManager(64, 8, watermark=0.0)
    bm.allocate("a", list(range(20, 45)))  # 25-token prompt: prefill
    bm.allocate("b", list(range(5, 16)))
    bm.mark_computed("b", 11)
    bm.append_slots("b", [3])  # and a decode token
    batch = build_batch(bm, [ScheduledSeq("a", 0, 25), ScheduledSeq("b", 11, 12)])
    return model, batch


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu"])
def test_model_step_with_pallas_backend_matches_xla(setup, backend):
    kw = kernel_kwargs(backend)
    model, batch = setup
    step_xla, state = models.make_step(model, backend="xla")
    step_k, _ = models.make_step(model, **kw)
    args = (jnp.asarray(batch.token_ids), jnp.asarray(batch.positions))
    md = AttentionMetadata.from_batch(batch)
    ref, _ = step_xla(state, *args, model.make_cache(64, 8), md)
    out, _ = step_k(state, *args, model.make_cache(64, 8), md)
    np.testing.assert_allclose(np.asarray(out)[:2], np.asarray(ref)[:2], rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def decode_setup():
    """Three sequences prefilled through the XLA path, then a decode-only batch of them."""
    model = models.init_model(models.TINY_LLAMA, seed=0)
    bm = BlockManager(64, 8, watermark=0.0)
    lens = {"a": 25, "b": 11, "c": 3}
    for i, (sid, n) in enumerate(lens.items()):
        bm.allocate(sid, [(7 * i + j) % 50 + 1 for j in range(n)])
    prefill = build_batch(bm, [ScheduledSeq(s, 0, n) for s, n in lens.items()])
    step_xla, state = models.make_step(model, backend="xla")
    _, cache = step_xla(
        state,
        jnp.asarray(prefill.token_ids),
        jnp.asarray(prefill.positions),
        model.make_cache(64, 8),
        AttentionMetadata.from_batch(prefill),
    )
    for sid, n in lens.items():
        bm.mark_computed(sid, n)
        bm.append_slots(sid, [n % 40 + 2])
    dec = build_batch(bm, [ScheduledSeq(s, n, n + 1) for s, n in lens.items()])
    assert not AttentionMetadata.from_batch(prefill).decode_only
    return model, state, cache, dec


@pytest.mark.parametrize("backend", ["xla", "pallas_tpu", "pallas_gpu"])
def test_decode_only_step_uses_decode_kernel_and_matches_ragged(decode_setup, backend, monkeypatch):
    from paged_jax import decoder

    kw = kernel_kwargs(backend)
    model, state, cache, dec = decode_setup
    md = AttentionMetadata.from_batch(dec)
    assert md.decode_only and dec.num_tokens == 3
    assert dec.token_ids.shape[0] != dec.kv_lens.shape[0]  # 16 token rows, 8 sequence rows
    calls = []
    real = decoder.paged_attention
    monkeypatch.setattr(
        decoder, "paged_attention", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    step_k, _ = models.make_step(model, **kw)
    step_ref, _ = models.make_step(model, backend="xla")
    args = (jnp.asarray(dec.token_ids), jnp.asarray(dec.positions))
    copy = lambda c: jax.tree.map(jnp.copy, c)  # noqa: E731 (the steps donate the cache)
    out, new_cache = step_k(state, *args, copy(cache), md)
    assert len(calls) == 1  # traced once: the scanned layer body runs it for every layer
    ragged = dataclasses.replace(md, decode_only=False)
    ref, ref_cache = step_ref(state, *args, copy(cache), ragged)
    assert len(calls) == 1  # the ragged step did not call it
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-4, atol=1e-4)
    # The new tokens' K/V went to the same slots either way (layer 0 sees no attention
    # output yet, so it is bit-equal; later layers differ by rounding).
    new_kv, ref_kv = np.asarray(new_cache.kv_pages), np.asarray(ref_cache.kv_pages)
    np.testing.assert_array_equal(new_kv[0], ref_kv[0])
    np.testing.assert_allclose(new_kv, ref_kv, rtol=1e-4, atol=1e-4)
