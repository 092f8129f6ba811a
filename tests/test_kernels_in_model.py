"""The Pallas kernels inside a real decoder step (interpreted on CPU, compiled on their own
hardware): the same logits as the XLA path on batches built by the block manager (buckets,
padding rows, prefix pages)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from paged_jax import AttentionMetadata
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
    platform = jax.default_backend()
    native = {"pallas_tpu": "tpu", "pallas_gpu": "gpu"}[backend]
    if platform not in ("cpu", native):
        pytest.skip(f"{backend}: compiled on {native}, interpreted on CPU; this is {platform}")
    model, batch = setup
    step_xla, state = models.make_step(model, backend="xla")
    step_k, _ = models.make_step(model, backend=backend, interpret=platform == "cpu")
    args = (jnp.asarray(batch.token_ids), jnp.asarray(batch.positions))
    md = AttentionMetadata.from_batch(batch)
    ref, _ = step_xla(state, *args, model.make_cache(64, 8), md)
    out, _ = step_k(state, *args, model.make_cache(64, 8), md)
    np.testing.assert_allclose(np.asarray(out)[:2], np.asarray(ref)[:2], rtol=1e-4, atol=1e-4)
