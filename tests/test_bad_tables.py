"""Block tables and lengths that no valid batch holds: every attention path reads the null
page for an id outside the pool (never another page, never outside the pool) and stops at
the table's end for a length past it; the host validators name the offender."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import paged_jax as pj
from paged_jax import models
from paged_jax.block_manager import BlockManager

PLATFORM = {"pallas_gpu": "gpu", "pallas_tpu": "tpu"}


def _interpret(backend: str) -> bool:
    """Kernels run compiled where their hardware is, interpreted elsewhere."""
    return backend != "xla" and jax.default_backend() != PLATFORM[backend]


N, P, K, H, D, M = 7, 4, 2, 4, 16, 4
RAGGED = [(3, 10), (1, 5)]  # (q_len, kv_len) per sequence
TABLE = np.array([[1, 2, 3, 0], [4, 5, 0, 0]], np.int32)  # pages each sequence reads
BAD_IDS = [-1, -2, N, N + 1, 2**31 - 1, -(2**31)]

rng = np.random.default_rng(0)
POOL = jnp.asarray(rng.normal(size=(N, P, 2 * K, D)), jnp.float32)
Q_RAGGED = jnp.asarray(rng.normal(size=(sum(q for q, _ in RAGGED), H, D)), jnp.float32)
Q_DECODE = jnp.asarray(rng.normal(size=(len(RAGGED), H, D)), jnp.float32)
KV_LENS = jnp.array([kv for _, kv in RAGGED], jnp.int32)
CU = jnp.array([0, 3, 4], jnp.int32)
NUM_SEQS = jnp.array([2], jnp.int32)


def _ragged(table, backend="xla", interpret=False, kv_lens=KV_LENS):
    return pj.ragged_paged_attention(
        Q_RAGGED,
        POOL,
        kv_lens,
        jnp.asarray(table),
        CU,
        NUM_SEQS,
        sm_scale=D**-0.5,
        backend=backend,
        interpret=interpret,
    )


def _decode(table, backend="xla", interpret=False, kv_lens=KV_LENS):
    return pj.paged_attention(
        Q_DECODE,
        POOL,
        kv_lens,
        jnp.asarray(table),
        sm_scale=D**-0.5,
        backend=backend,
        interpret=interpret,
    )


def _spoil(table, where, ids):
    bad = table.copy()
    for (i, j), v in zip(where, ids, strict=False):
        bad[i, j] = v
    null = table.copy()
    for i, j in where[: len(ids)]:
        null[i, j] = 0
    return bad, null


USED = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]  # table cells within each kv_len


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    where=st.lists(st.sampled_from(USED), min_size=1, max_size=3, unique=True),
    ids=st.lists(
        st.one_of(st.sampled_from(BAD_IDS), st.integers(-(2**31), -1), st.integers(N, 2**31 - 1)),
        min_size=3,
        max_size=3,
    ),
)
def test_xla_reads_the_null_page_for_any_id_outside_the_pool(where, ids):
    bad, null = _spoil(TABLE, where, ids)
    np.testing.assert_array_equal(_ragged(bad), _ragged(null))
    np.testing.assert_array_equal(_decode(bad), _decode(null))


def test_the_bad_ids_change_the_output_where_they_are_read():
    # The comparison above could not fail if a bad id were never read: page 7 = -1 would
    # wrap onto page 6 (a live page) under plain indexing, and that differs from page 0.
    bad, null = _spoil(TABLE, [(0, 1)], [-1])
    wrapped = TABLE.copy()
    wrapped[0, 1] = N - 1
    assert not np.array_equal(_ragged(wrapped), _ragged(null))
    np.testing.assert_array_equal(_ragged(bad), _ragged(null))


@pytest.mark.parametrize(
    "backend", ["pallas_gpu", pytest.param("pallas_tpu", marks=pytest.mark.slow)]
)
def test_kernels_read_the_null_page_for_ids_outside_the_pool(backend):
    bad, null = _spoil(TABLE, [(0, 1), (1, 0), (0, 2)], [-1, N, 2**31 - 1])
    for fn in (_ragged, _decode):
        out = fn(bad, backend=backend, interpret=_interpret(backend))
        np.testing.assert_array_equal(out, fn(null, backend=backend, interpret=_interpret(backend)))
        # As the XLA path (compiled GPU dots on f32 take TF32 passes: a looser bound).
        np.testing.assert_allclose(out, fn(null), atol=2e-5 if _interpret(backend) else 5e-3)


@pytest.mark.parametrize(
    "backend", ["xla", "pallas_gpu", pytest.param("pallas_tpu", marks=pytest.mark.slow)]
)
def test_a_length_past_the_table_stops_at_the_table(backend):
    # 2**30 tokens with a 4-page table: reads the 4 pages (then stops), finite, no hang.
    huge = jnp.array([2**30, 5], jnp.int32)
    interpret = _interpret(backend)
    for fn in (_ragged, _decode):
        out = fn(TABLE, backend=backend, interpret=interpret, kv_lens=huge)
        assert np.isfinite(np.asarray(out)).all()
        ref = fn(TABLE, backend=backend, interpret=interpret, kv_lens=jnp.array([M * P, 5]))
        np.testing.assert_array_equal(out[-1], ref[-1])  # the other sequence is unchanged


def test_the_layer_view_keeps_bad_ids_in_their_layer():
    cache = pj.PagedKVCache.create(
        num_layers=3, num_pages=N, page_size=P, num_kv_heads=K, head_dim=D
    )
    _, tables, _, _ = cache.attention_inputs(2, jnp.asarray([[1, -1, N, 2**31 - 1]], jnp.int32))
    np.testing.assert_array_equal(tables, [[2 * N + 1, 2 * N, 2 * N, 2 * N]])


# ---------------------------------------------------------------- host validators
DECODE_CASES = [
    (dict(kv_lens=[-1, 5]), "kv_lens: kv_lens[0]=-1 is negative"),
    (dict(kv_lens=[17, 5]), "kv_lens: kv_lens[0]=17 exceeds the block table's capacity"),
    (dict(table=[[1, 2, 9, 0], [4, 5, 0, 0]]), "page_indices: sequence 0 reads page 9, outside"),
    (dict(table=[[1, 2, 3, 0], [-3, 5, 0, 0]]), "page_indices: sequence 1 reads page -3, outs"),
    (dict(table=[[1, 0, 3, 0], [4, 5, 0, 0]]), "page_indices: sequence 0 reads the null page 0"),
]


@pytest.mark.parametrize("over,msg", DECODE_CASES)
def test_validate_decode_inputs_names_the_offender(over, msg):
    lens = np.array(over.get("kv_lens", [10, 5]), np.int32)
    table = np.array(over.get("table", TABLE), np.int32)
    with pytest.raises(ValueError, match=re.escape(msg)):
        pj.validate_decode_inputs(Q_DECODE, POOL, lens, table)


def test_validate_decode_inputs_accepts_valid_rows_and_padding():
    pj.validate_decode_inputs(Q_DECODE, POOL, KV_LENS, TABLE)
    # A padding row (kv_len 0) may hold anything.
    pj.validate_decode_inputs(
        Q_DECODE,
        POOL,
        np.array([10, 0], np.int32),
        np.array([[1, 2, 3, 0], [-5, 99, 0, 0]], np.int32),
    )


def _step_batch():
    bm = BlockManager(num_pages=16, page_size=4, enable_prefix_caching=False)
    bm.allocate("a", list(range(10)))
    bm.allocate("b", list(range(20, 26)))
    bm.mark_computed("b", 6)
    bm.append_slots("b", [7])
    return pj.build_batch(bm, [pj.ScheduledSeq("a", 0, 10), pj.ScheduledSeq("b", 6, 7)])


BATCH_CASES = [
    ("token_ids", lambda b: b.token_ids.__setitem__(2, 300), "token_ids: token_ids[2]=300"),
    ("positions", lambda b: b.positions.__setitem__(10, 3), "positions: token 10 (sequence 1)"),
    (
        "slot_mapping",
        lambda b: b.slot_mapping.__setitem__(1, b.slot_mapping[0]),
        "slot_mapping: token 1 (sequence 0, position 1) writes slot",
    ),
    ("page_indices", lambda b: b.page_indices.__setitem__((1, 0), 16), "reads page 16, outside"),
    ("kv_lens", lambda b: b.kv_lens.__setitem__(0, 99), "kv_lens: kv_lens[0]=99 exceeds"),
    ("copy_dst", lambda b: b.copy_dst.__setitem__(0, 20), "copy_dst: page 20 is outside [1, 16)"),
]


@pytest.mark.parametrize("name,spoil,msg", BATCH_CASES, ids=[c[0] for c in BATCH_CASES])
def test_validate_batch_names_the_array_and_row(name, spoil, msg):
    batch = _step_batch()
    pj.validate_batch(batch, num_pages=16, page_size=4, vocab_size=256)
    arrays = {f.name: np.array(getattr(batch, f.name)) for f in dataclasses.fields(batch)}
    bad = dataclasses.replace(batch, **{k: v for k, v in arrays.items() if k != "seq_ids"})
    if name == "copy_dst":
        bad.copy_src[0] = 3
    spoil(bad)
    with pytest.raises(ValueError, match=re.escape(msg)):
        pj.validate_batch(bad, num_pages=16, page_size=4, vocab_size=256)


def test_checked_engine_validates_every_step(monkeypatch):
    from paged_jax.engine import launcher as engine_launch

    calls = []
    real = engine_launch.validate_batch
    monkeypatch.setattr(engine_launch, "validate_batch", lambda b, **k: calls.append(real(b, **k)))
    p = pj.SamplingParams(max_tokens=4, ignore_eos=True)
    plain = pj.LLM(*models.load("tiny-llama"), num_pages=32, page_size=8)
    ref = plain.generate([[1, 2, 3], [4, 5]], p, progress=False)
    assert not calls  # off by default
    monkeypatch.setenv("PAGED_JAX_CHECKED", "1")
    llm = pj.LLM(*models.load("tiny-llama"), num_pages=32, page_size=8)
    outs = llm.generate([[1, 2, 3], [4, 5]], p, progress=False)
    assert llm.checked and len(calls) == llm.metrics.steps >= 4
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    with pytest.raises(TypeError, match="checked: expected a bool or None, got 'yes'"):
        pj.LLM(*models.load("tiny-llama"), num_pages=32, checked="yes")


@pytest.mark.failing_steps
def test_checked_engine_fails_the_request_whose_step_is_invalid(monkeypatch):
    from paged_jax.engine import launcher as engine_launch

    real = engine_launch.build_batch

    def corrupt(bm, scheduled, **kw):  # request "bad" gets a page id past the pool
        batch = real(bm, scheduled, **kw)
        for row, s in enumerate(scheduled):
            if s.seq_id == bad_seq:
                batch.page_indices[row, 0] = 10_000
        return batch

    llm = pj.LLM(*models.load("tiny-llama"), num_pages=32, page_size=8, checked=True)
    monkeypatch.setattr(engine_launch, "build_batch", corrupt)
    p = pj.SamplingParams(max_tokens=3, ignore_eos=True)
    llm.add_request("good", [1, 2, 3], p)
    llm.add_request("bad", [4, 5, 6], p)
    bad_seq = llm.engine.requests.get("bad").seqs[0].seq_id
    done, errors = {}, 0
    while llm.has_unfinished():
        try:
            done.update({o.request_id: o for o in llm.step()})
        except ValueError:
            errors += 1
    assert "page_indices: sequence" in done["bad"].error and errors >= 2
    assert done["good"].error is None and len(done["good"].outputs[0].token_ids) == 3
