"""Pallas TPU decode and ragged kernels against the reference, in TPU interpret mode."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.paged_attention import (
    paged_attention as jax_tpu_paged_attention,
)
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as jax_ragged
from paged_cases import assert_close_to_oracle, covering_sample, kernel_case, make_case, max_err

import paged_jax as pj
from paged_jax.kernels.tpu import decode_paged_attention, ragged_paged_attention

INTERPRET = jax.default_backend() != "tpu"
BATCH = [(1, 1), (1, 16), (1, 17), (1, 32), (1, 70)]
GQA = [(4, 4), (8, 2), (8, 1)]
OPTIONS = {
    "plain": {},
    "softcap": dict(soft_cap=2.5),
    "window": dict(sliding_window=20),
    "both": dict(sliding_window=33, soft_cap=4.0),
}


DTYPES = ["float32", "bfloat16", "float16", "int8", "float8_e4m3fn"]


def _grid(num, seed, pages=(16, 32), dims=(64, 128)):
    full = list(itertools.product(pages, GQA, dims, DTYPES, OPTIONS))
    return covering_sample(full, num, seed)


def _id(p):
    return f"P{p[0]}-H{p[1][0]}K{p[1][1]}-D{p[2]}-{p[3]}-{p[4]}"


def _refused(heads, d, dtype) -> str | None:
    """What the TPU kernels say of a pool they do not take (Mosaic could not compile
    them; ``paged_jax.kernels.tpu.supports``), or None."""
    if d > 128 and d % 128:
        return "the TPU kernels take a head dim up to 128 or a multiple of it"
    pack = 4 // jnp.dtype(dtype).itemsize
    words = 2 * heads[1] / pack
    if words not in (1, 2, 4, 8) and words % 8:
        return "the TPU kernels need each token's"
    return None


def _check(params, seed, **knobs):
    page, heads, d, dtype, opt = params
    case = kernel_case(seed, BATCH, page, heads, d, dtype, pad_seqs=0, pad_tokens=0, **OPTIONS[opt])
    # A padding row (kv_len 0, NaN query) must come out 0 and read nothing.
    q = jnp.concatenate([case.q, jnp.full((1,) + case.q.shape[1:], jnp.nan, case.q.dtype)])
    lens = jnp.concatenate([case.kv_lens, jnp.zeros(1, jnp.int32)])
    table = jnp.concatenate([case.page_indices, case.page_indices[:1] * 0])
    kw = dict(sm_scale=d**-0.5, k_scale=case.k_scale, v_scale=case.v_scale, **OPTIONS[opt])
    ref = pj.reference.paged_attention(q, case.kv_pages, lens, table, **kw)
    if why := _refused(heads, d, dtype):
        with pytest.raises(ValueError, match=why):
            decode_paged_attention(q, case.kv_pages, lens, table, interpret=INTERPRET, **kw)
        return
    out = decode_paged_attention(q, case.kv_pages, lens, table, interpret=INTERPRET, **kw, **knobs)
    assert out.dtype == case.q.dtype
    np.testing.assert_array_equal(np.asarray(out[-1], np.float32), 0.0)
    assert_close_to_oracle(out[:-1], ref[:-1], case.expected, what=_id(params))


def _first_by_default(grid, keep=1):
    """``grid`` with the cases after the first ``keep`` marked slow (each case takes 10-27
    s in interpret mode on 2 cores; .ci/run runs the rest with -m slow)."""
    return [c if i < keep else pytest.param(c, marks=pytest.mark.slow) for i, c in enumerate(grid)]


@pytest.mark.parametrize("params", _first_by_default(_grid(5, seed=11)), ids=_id)
def test_decode_kernel(params):
    _check(params, seed=0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "params", _grid(48, seed=12, pages=(8, 16, 32, 64, 128), dims=(64, 128, 256)), ids=_id
)
def test_decode_kernel_large_grid(params):
    _check(params, seed=1)


@pytest.mark.parametrize(
    "pages_per_block,table_chunk",
    [
        (1, 3),
        (4, 8),
        pytest.param(1, 1, marks=pytest.mark.slow),
        pytest.param(2, 2, marks=pytest.mark.slow),
    ],
)
def test_table_chunks_and_double_buffering(pages_per_block, table_chunk):
    # Small chunks force many SMEM table reloads and buffer swaps per sequence.
    _check(
        (16, (8, 2), 64, "float32", "window"),
        seed=3,
        pages_per_block=pages_per_block,
        table_chunk=table_chunk,
    )


def test_through_the_public_api_and_errors():
    case = make_case(4, BATCH, page_size=16, pad_seqs=0, pad_tokens=0)
    args = (case.q, case.kv_pages, case.kv_lens, case.page_indices)
    out = pj.paged_attention(*args, sm_scale=0.25, backend="pallas_tpu", interpret=INTERPRET)
    assert_close_to_oracle(out, pj.reference.paged_attention(*args, sm_scale=0.25), case.expected)
    with pytest.raises(ValueError, match="k_scale, v_scale: pass both as arrays or neither"):
        decode_paged_attention(*args, k_scale=jnp.ones((3, 16, 2)), interpret=True)
    with pytest.raises(
        ValueError, match="table_chunk: expected a multiple of pages_per_block=2, got 3"
    ):
        decode_paged_attention(*args, pages_per_block=2, table_chunk=3, interpret=True)


@pytest.mark.slow  # 13-17 s in interpret mode; .ci/run runs it
def test_matches_jax_tpu_paged_attention():
    # JAX's own TPU decode kernel, layout transposed to [K, N, P, D], identical inputs. It
    # computes in bf16 (it casts K/V): compare in bf16 with a bf16-sized tolerance.
    case = make_case(
        5,
        [(1, n) for n in (16, 32, 47, 64)],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=128,
        page_size=16,
        dtype=jnp.bfloat16,
        pad_seqs=0,
        pad_tokens=0,
        table_width=4,
    )
    kv = jnp.nan_to_num(case.kv_pages)
    with pltpu.force_tpu_interpret_mode():
        theirs = jax_tpu_paged_attention(
            case.q,
            jnp.transpose(kv[:, :, 0::2], (2, 0, 1, 3)),
            jnp.transpose(kv[:, :, 1::2], (2, 0, 1, 3)),
            case.kv_lens,
            case.page_indices,
            pages_per_compute_block=2,
        )
    ours = decode_paged_attention(case.q, kv, case.kv_lens, case.page_indices, interpret=INTERPRET)
    assert max_err(ours, np.asarray(theirs.astype(jnp.float32), np.float64)) < 2e-2


RAGGED = {
    "decode": [(1, 1), (1, 16), (1, 33)],
    "prefill": [(8, 8), (13, 13), (1, 1)],
    "mixed": [(5, 20), (1, 16), (0, 7), (16, 16), (3, 40)],
    # Prefill chunks longer than one query block, attending to cached pages before them.
    "long": [(40, 40), (33, 57), (1, 9)],
}


def _ragged_grid(num, seed, pages=(16, 32), dims=(64, 128)):
    full = list(itertools.product(RAGGED, pages, GQA, dims, DTYPES, OPTIONS))
    return covering_sample(full, num, seed)


def _rid(p):
    return f"{p[0]}-" + _id(p[1:])


def _check_ragged(params, seed, **knobs):
    batch, page, heads, d, dtype, opt = params
    case = make_case(
        seed,
        RAGGED[batch],
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=d,
        page_size=page,
        dtype=jnp.dtype(dtype),
        **OPTIONS[opt],
    )
    kw = dict(sm_scale=d**-0.5, k_scale=case.k_scale, v_scale=case.v_scale, **OPTIONS[opt])
    ref = pj.reference.ragged_paged_attention(*case.args, **kw)
    if why := _refused(heads, d, dtype):
        with pytest.raises(ValueError, match=why):
            ragged_paged_attention(*case.args, interpret=INTERPRET, **kw)
        return
    out = ragged_paged_attention(*case.args, interpret=INTERPRET, **kw, **knobs)
    assert_close_to_oracle(out, ref, case.expected, what=_rid(params))
    n = int(case.cu_q_lens[len(RAGGED[batch])])
    np.testing.assert_array_equal(np.asarray(out[n:], np.float32), 0.0)


@pytest.mark.parametrize("params", _first_by_default(_ragged_grid(5, seed=13)), ids=_rid)
def test_ragged_kernel(params):
    _check_ragged(params, seed=0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "params", _ragged_grid(40, seed=14, pages=(8, 16, 32, 64, 128), dims=(64, 128, 256)), ids=_rid
)
def test_ragged_kernel_large_grid(params):
    _check_ragged(params, seed=1)


@pytest.mark.slow  # 13-17 s in interpret mode; .ci/run runs it
def test_ragged_small_blocks_and_public_api():
    _check_ragged(
        ("mixed", 16, (8, 2), 64, "float32", "both"),
        seed=2,
        tokens_per_block=3,
        pages_per_block=1,
        table_chunk=2,
    )
    case = make_case(6, RAGGED["mixed"], page_size=16)
    out = pj.ragged_paged_attention(
        *case.args, sm_scale=0.25, backend="pallas_tpu", interpret=INTERPRET
    )
    assert_close_to_oracle(
        out, pj.reference.ragged_paged_attention(*case.args, sm_scale=0.25), case.expected
    )


@pytest.mark.slow  # 18-29 s in interpret mode; .ci/run runs it
def test_ragged_matches_jax_ref_ragged_paged_attention():
    case = make_case(
        7,
        RAGGED["mixed"],
        num_q_heads=8,
        num_kv_heads=2,
        page_size=16,
        head_dim=64,
        sliding_window=9,
        soft_cap=3.0,
    )
    kv, q = jnp.nan_to_num(case.kv_pages), jnp.nan_to_num(case.q)
    args = (q, kv, case.kv_lens, case.page_indices, case.cu_q_lens, case.num_seqs)
    theirs = jax_ragged.ref_ragged_paged_attention(
        *args, sm_scale=0.125, sliding_window=9, soft_cap=3.0
    )
    ours = ragged_paged_attention(
        *args, sm_scale=0.125, sliding_window=9, soft_cap=3.0, interpret=INTERPRET
    )
    assert max_err(ours[: theirs.shape[0]], np.asarray(theirs, np.float64)) < 2e-6


def test_wide_block_table_is_read_in_chunks():
    # A 4096-column block table (16 KiB of int32 per row; a 512-row batch of these would
    # not fit SMEM) is only ever read one small chunk at a time; past the live pages the
    # rows hold garbage ids, never followed.
    case = make_case(8, [(1, 20), (1, 5)], page_size=16, pad_seqs=0, pad_tokens=0)
    table = jnp.full((2, 4096), 10**6, jnp.int32).at[:, :2].set(case.page_indices[:, :2])
    args = (case.q, case.kv_pages, case.kv_lens, table)
    out = decode_paged_attention(*args, sm_scale=0.25, interpret=INTERPRET, table_chunk=8)
    ref = pj.reference.paged_attention(
        case.q, case.kv_pages, case.kv_lens, case.page_indices, sm_scale=0.25
    )
    assert_close_to_oracle(out, ref, case.expected)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8"])
@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_kv_write_kernel_matches_the_xla_scatter(dtype, seed):
    rng = np.random.default_rng(seed)
    cache = pj.PagedKVCache.create(2, 9, 4, 2, 8, dtype=jnp.dtype(dtype))
    T = 13
    live = rng.choice(np.arange(4, 36), size=T - 4, replace=False)  # distinct, off page 0
    slots = np.concatenate([live, [0, 2, -1, 36]])  # padding on page 0, two out of range
    rng.shuffle(slots)
    k = jnp.asarray(rng.standard_normal((T, 2, 8)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((T, 2, 8)), jnp.float32)
    slots = jnp.asarray(slots, jnp.int32)
    a = cache.write(1, k, v, slots)
    b = cache.write(1, k, v, slots, backend="pallas_tpu", interpret=INTERPRET)
    # Page 0 (the null page) may hold any padding row; everything else must be identical,
    # out-of-range slots dropped and layer 0 untouched.
    np.testing.assert_array_equal(
        np.asarray(a.kv_pages[:, 1:], np.float32), np.asarray(b.kv_pages[:, 1:], np.float32)
    )
    assert not np.asarray(b.kv_pages[0], np.float32).any()
    if cache.quantized:
        np.testing.assert_array_equal(
            np.asarray(a.kv_scales[:, 1:]), np.asarray(b.kv_scales[:, 1:])
        )
    with pytest.raises(ValueError, match="backend: expected 'xla' or 'pallas_tpu', got 'gpu'"):
        cache.write(1, k, v, slots, backend="gpu")


@pytest.mark.slow  # the default grid's "long" batch covers chunks over one query block
def test_ragged_long_prefill_spans_several_query_blocks():
    # Early query blocks of a long prefill fetch fewer pages than the sequence holds; the
    # unfetched buffer slots (NaN in interpret mode) must not leak into the output.
    _check_ragged(("long", 8, (8, 2), 64, "float32", "plain"), seed=5)
    _check_ragged(("long", 16, (4, 4), 64, "bfloat16", "both"), seed=6, tokens_per_block=8)


@pytest.mark.parametrize("dtype, kv_heads, head_dim", [("bfloat16", 3, 64), ("int8", 1, 64)])
def test_auto_falls_back_to_xla_for_pools_the_tpu_kernels_refuse(
    monkeypatch, dtype, kv_heads, head_dim
):
    # With the TPU kernels chosen ("auto" on a TPU; forced here), a pool they refuse goes
    # to the XLA path instead of failing; named explicitly, the kernel's error stands.
    monkeypatch.setenv("PAGED_JAX_BACKEND", "pallas_tpu")
    case = kernel_case(
        5, BATCH[:3], 16, (2 * kv_heads, kv_heads), head_dim, dtype, pad_seqs=0, pad_tokens=0
    )
    args = (case.q, case.kv_pages, case.kv_lens, case.page_indices)
    kw = dict(sm_scale=head_dim**-0.5, k_scale=case.k_scale, v_scale=case.v_scale)
    out = pj.paged_attention(*args, **kw)
    ref = pj.reference.paged_attention(*args, **kw)
    assert_close_to_oracle(out, ref, case.expected)
    with pytest.raises(ValueError, match="kv_pages: "):
        pj.paged_attention(*args, **kw, backend="pallas_tpu", interpret=True)


def test_table_chunk_on_a_tpu_is_whole_dma_runs():
    case = make_case(4, BATCH, page_size=16, pad_seqs=0, pad_tokens=0)
    args = (case.q, case.kv_pages, case.kv_lens, case.page_indices)
    with pytest.raises(ValueError, match="table_chunk: expected a multiple of 128 on a TPU"):
        decode_paged_attention(*args, pages_per_block=2, table_chunk=8, interpret=False)
