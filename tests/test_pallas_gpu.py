"""Pallas GPU kernels (Triton lowering) against the reference, in interpret mode on CPU.

On a machine with an NVIDIA GPU the same tests run the compiled kernels (``interpret``
is then False): ``pytest -m "gpu or not gpu" tests/test_pallas_gpu.py`` there.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.gpu import paged_attention as jax_gpu_paged
from paged_cases import assert_close_to_oracle, covering_sample, kernel_case, make_case, max_err

import paged_jax as pj
from paged_jax.kernels.gpu import decode_paged_attention, ragged_paged_attention, tuning

INTERPRET = jax.default_backend() != "gpu"
DECODE_BATCH = [(1, 1), (1, 8), (1, 16), (1, 17), (1, 40)]
RAGGED_BATCHES = {
    "decode": [(1, 1), (1, 16), (1, 33)],
    "prefill": [(8, 8), (13, 13), (1, 1)],
    "mixed": [(5, 20), (1, 16), (0, 7), (16, 16), (3, 40)],
    # Prefill chunks longer than one query block, attending to cached pages before them.
    "long": [(40, 40), (33, 57), (1, 9)],
}
GQA = [(4, 4), (8, 2), (8, 1)]  # groups of 1, 4, 8
DTYPES = ["float32", "bfloat16", "float16", "int8", "float8_e4m3fn"]
OPTIONS = {
    "plain": {},
    "softcap": dict(soft_cap=2.5),
    "window": dict(sliding_window=6),
    "both": dict(sliding_window=11, soft_cap=4.0),
}


def _same_walk(ahead, plain, what):
    """The walk loading ahead against the plain one: the same bits interpreted (the same
    folds in the same order); compiled, within a unit in the last place of the output's
    dtype (the two walks' code is scheduled apart, and a compiler may contract a multiply
    and an add in one and not the other)."""
    a, b = np.asarray(ahead, np.float32), np.asarray(plain, np.float32)
    if INTERPRET:
        np.testing.assert_array_equal(a, b, what)
    else:
        ulp = 2.0 ** -(7 if jnp.dtype(ahead.dtype).itemsize == 2 else 22)
        np.testing.assert_allclose(a, b, rtol=ulp, atol=ulp * np.abs(b).max(), err_msg=what)


def _grid(batches, num, seed):
    full = list(itertools.product(batches, [8, 16, 32], GQA, [64, 128], DTYPES, OPTIONS))
    return covering_sample(full, num, seed)


def _id(p):
    return "-".join(
        str(x) for x in (p[0], f"P{p[1]}", f"H{p[2][0]}K{p[2][1]}", f"D{p[3]}", p[4], p[5])
    )


def _case(seqs, page, heads, d, dtype, opt, seed, **kw):
    return kernel_case(seed, seqs, page, heads, d, dtype, **OPTIONS[opt], **kw)


def _check_decode(params, seed):
    _, page, heads, d, dtype, opt = params
    case = _case(DECODE_BATCH, page, heads, d, dtype, opt, seed, pad_seqs=0, pad_tokens=0)
    kw = dict(sm_scale=d**-0.5, k_scale=case.k_scale, v_scale=case.v_scale, **OPTIONS[opt])
    # A padding row: kv_len 0, NaN query, block-table row on NaN pages / page 0.
    q = jnp.concatenate([case.q, jnp.full((1,) + case.q.shape[1:], jnp.nan, case.q.dtype)])
    lens = jnp.concatenate([case.kv_lens, jnp.zeros(1, jnp.int32)])
    table = jnp.concatenate([case.page_indices, case.page_indices[:1] * 0])
    args = (q, case.kv_pages, lens, table)
    ref = pj.reference.paged_attention(*args, **kw)
    # one split (the kernel writes each group's rows normalized in place) and two (f32
    # partials merged after it); each walk plain and loading a block ahead, which must
    # give the same bits (the same sums in the same order)
    for splits in (1, 2):
        out = decode_paged_attention(*args, interpret=INTERPRET, num_splits=splits, **kw)
        assert out.dtype == case.q.dtype
        np.testing.assert_array_equal(np.asarray(out[-1], np.float32), 0.0)
        assert_close_to_oracle(out[:-1], ref[:-1], case.expected, what=f"{_id(params)} {splits=}")
        ahead = decode_paged_attention(
            *args, interpret=INTERPRET, num_splits=splits, prefetch=True, **kw
        )
        _same_walk(ahead, out, f"{splits=} prefetch")


def _check_ragged(params, seed):
    batch, page, heads, d, dtype, opt = params
    case = _case(RAGGED_BATCHES[batch], page, heads, d, dtype, opt, seed)
    kw = dict(sm_scale=d**-0.5, k_scale=case.k_scale, v_scale=case.v_scale, **OPTIONS[opt])
    ref = pj.reference.ragged_paged_attention(*case.args, **kw)
    out = ragged_paged_attention(*case.args, interpret=INTERPRET, **kw)
    assert_close_to_oracle(out, ref, case.expected, what=_id(params))
    n = int(case.cu_q_lens[len(RAGGED_BATCHES[batch])])
    np.testing.assert_array_equal(np.asarray(out[n:], np.float32), 0.0)  # padding rows
    # the walk loading each next block ahead: the same sums in the same order
    ahead = ragged_paged_attention(*case.args, interpret=INTERPRET, prefetch=True, **kw)
    _same_walk(ahead, out, "prefetch")


@pytest.mark.parametrize("params", _grid(["decode"], 5, seed=5), ids=_id)
def test_decode_kernel(params):
    _check_decode(params, seed=0)


@pytest.mark.parametrize("params", _grid(list(RAGGED_BATCHES), 5, seed=6), ids=_id)
def test_ragged_kernel(params):
    _check_ragged(params, seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("params", _grid(["decode"], 60, seed=7), ids=_id)
def test_decode_kernel_large_grid(params):
    _check_decode(params, seed=2)


@pytest.mark.slow
@pytest.mark.parametrize("params", _grid(list(RAGGED_BATCHES), 60, seed=8), ids=_id)
def test_ragged_kernel_large_grid(params):
    _check_ragged(params, seed=3)


@pytest.mark.parametrize(
    "splits,pages_per_block",
    [
        (2, 4),
        pytest.param(1, 1, marks=pytest.mark.slow),
        pytest.param(4, 1, marks=pytest.mark.slow),
    ],
)
def test_decode_split_and_block_knobs(splits, pages_per_block):
    case = make_case(
        9,
        [(1, n) for n in (1, 7, 8, 9, 31, 64)],
        page_size=8,
        num_q_heads=6,
        num_kv_heads=2,
        pad_seqs=0,
        pad_tokens=0,
        sliding_window=13,
    )
    args = (case.q, case.kv_pages, case.kv_lens, case.page_indices)
    kw = dict(sm_scale=16**-0.5, sliding_window=13)
    ref = pj.reference.paged_attention(*args, **kw)
    for prefetch in (False, True):
        out = decode_paged_attention(
            *args,
            interpret=INTERPRET,
            num_splits=splits,
            pages_per_block=pages_per_block,
            prefetch=prefetch,
            **kw,
        )
        assert_close_to_oracle(out, ref, case.expected, what=f"{prefetch=}")


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_decode_walk_loading_a_block_ahead_gives_the_same_bits(dtype):
    # Many blocks a program (1-2 pages of 4 tokens, up to 19 blocks), pages permuted in a
    # NaN pool, a table wider than any sequence, a window, splits: the walk that loads
    # each next block (and the table entries of the one after) ahead must fold the same
    # blocks in the same order as the plain walk.
    case = make_case(
        11,
        [(1, n) for n in (1, 4, 5, 23, 40, 75)],
        page_size=4,
        num_q_heads=4,
        num_kv_heads=2,
        dtype=dtype,
        pad_seqs=0,
        pad_tokens=0,
        table_width=24,
    )
    args = (case.q, case.kv_pages, case.kv_lens, case.page_indices)
    base = dict(sm_scale=16**-0.5, k_scale=case.k_scale, v_scale=case.v_scale)
    ref = pj.reference.paged_attention(*args, **base)
    for bp, splits, window in itertools.product((1, 2), (1, 3), (None, 9)):
        kw = dict(base, pages_per_block=bp, num_splits=splits, sliding_window=window)
        plain = decode_paged_attention(*args, interpret=INTERPRET, prefetch=False, **kw)
        ahead = decode_paged_attention(*args, interpret=INTERPRET, prefetch=True, **kw)
        what = f"{bp=} {splits=} {window=}"
        _same_walk(ahead, plain, what)
        if window is None:
            assert_close_to_oracle(ahead, ref, case.expected, what=what)


def test_ragged_walk_loading_a_block_ahead_gives_the_same_bits():
    # Prefill chunks and decode rows walking up to 19 blocks of 1-2 pages (4 tokens),
    # pages permuted in a NaN pool, a window: both walks fold the same blocks in order.
    case = make_case(
        12,
        [(5, 20), (1, 16), (0, 7), (16, 75), (3, 40)],
        page_size=4,
        num_q_heads=4,
        num_kv_heads=2,
        table_width=24,
    )
    base = dict(sm_scale=16**-0.5)
    for bp, window in itertools.product((1, 2), (None, 9)):
        kw = dict(base, pages_per_block=bp, tokens_per_block=4, sliding_window=window)
        plain = ragged_paged_attention(*case.args, interpret=INTERPRET, **kw)
        ahead = ragged_paged_attention(*case.args, interpret=INTERPRET, prefetch=True, **kw)
        _same_walk(ahead, plain, f"{bp=} {window=}")


def test_ragged_non_power_of_two_group_and_small_blocks():
    case = make_case(
        10, RAGGED_BATCHES["mixed"], page_size=4, num_q_heads=6, num_kv_heads=2, sliding_window=9
    )
    kw = dict(sm_scale=0.25, sliding_window=9)
    ref = pj.reference.ragged_paged_attention(*case.args, **kw)
    out = ragged_paged_attention(
        *case.args, interpret=INTERPRET, tokens_per_block=2, pages_per_block=2, **kw
    )
    assert_close_to_oracle(out, ref, case.expected)


def test_through_the_public_api():
    case = make_case(12, RAGGED_BATCHES["mixed"], page_size=8)
    ref = pj.reference.ragged_paged_attention(*case.args, sm_scale=0.25)
    out = pj.ragged_paged_attention(
        *case.args, sm_scale=0.25, backend="pallas_gpu", interpret=INTERPRET
    )
    assert_close_to_oracle(out, ref, case.expected)
    dec = make_case(13, RAGGED_BATCHES["decode"], page_size=8, pad_seqs=0, pad_tokens=0)
    args = (dec.q, dec.kv_pages, dec.kv_lens, dec.page_indices)
    out = pj.paged_attention(*args, sm_scale=0.25, backend="pallas_gpu", interpret=INTERPRET)
    assert_close_to_oracle(out, pj.reference.paged_attention(*args, sm_scale=0.25), dec.expected)


@pytest.mark.parametrize("heads", [(16, 4), (8, 8)])
def test_decode_matches_jax_gpu_paged_attention(heads):
    # JAX's own Pallas GPU op (no sm_scale: scale 1), identical inputs, finite pool.
    case = make_case(
        14,
        [(1, n) for n in (5, 16, 17, 64)],
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        page_size=8,
        head_dim=32,
        pad_seqs=0,
        pad_tokens=0,
        table_width=8,
    )
    kv = jnp.nan_to_num(case.kv_pages)
    theirs = jax_gpu_paged.paged_attention(
        case.q,
        jnp.transpose(kv[:, :, 0::2], (2, 0, 1, 3)),
        jnp.transpose(kv[:, :, 1::2], (2, 0, 1, 3)),
        case.page_indices,
        case.kv_lens,
        k_splits=2,
        pages_per_compute_block=2,
        interpret=INTERPRET,
    )
    ours = decode_paged_attention(case.q, kv, case.kv_lens, case.page_indices, interpret=INTERPRET)
    # Interpreted, both compute in exact f32. Compiled on a GPU, JAX's op takes the default
    # dot precision, one TF32 pass (10-bit mantissa; it differed from ours by 4e-3 on an
    # H100), while ours runs three (about f32): there ours must also match the oracle.
    tol = 1e-5 if INTERPRET else 1e-2
    assert max_err(ours, np.asarray(theirs, np.float64)) < tol
    if not INTERPRET:
        ref = pj.reference.paged_attention(case.q, kv, case.kv_lens, case.page_indices)
        assert_close_to_oracle(ours, ref, case.expected)


@pytest.mark.slow  # the default grid's "long" batch covers chunks over one query block
def test_ragged_long_prefill_spans_several_query_blocks():
    _check_ragged(("long", 8, (8, 2), 64, "float32", "plain"), seed=5)
    _check_ragged(("long", 16, (4, 4), 64, "bfloat16", "both"), seed=6)


@pytest.mark.parametrize(
    "kernel,q_dtype",
    [
        ("decode", "bfloat16"),
        ("ragged", "float32"),
        pytest.param("decode", "float32", marks=pytest.mark.slow),
        pytest.param("ragged", "bfloat16", marks=pytest.mark.slow),
    ],
)
def test_per_tensor_scales_equal_per_token_arrays_of_that_value(kernel, q_dtype):
    # JAX's convention (one float per tensor) is folded into q and the output instead of a
    # pass over the pool; it must agree with per-token scale arrays holding that value,
    # alone (k float, v array) and together, and with the reference.
    seqs = [(1, 21), (1, 9)] if kernel == "decode" else [(6, 30), (1, 9)]
    case = make_case(8, seqs, dtype=jnp.int8, q_dtype=q_dtype, pad_seqs=0, pad_tokens=0)
    n, p, k = case.k_scale.shape
    ks, vs = 0.031, 0.047
    ks_arr, vs_arr = jnp.full((n, p, k), ks), jnp.full((n, p, k), vs)
    if kernel == "decode":
        args = (case.q, case.kv_pages, case.kv_lens, case.page_indices)
        run, ref_fn = decode_paged_attention, pj.reference.paged_attention
    else:
        args = case.args
        run, ref_fn = ragged_paged_attention, pj.reference.ragged_paged_attention
    ref = ref_fn(*args, sm_scale=0.3, k_scale=ks, v_scale=vs)
    tol = 1e-5 if q_dtype == "float32" else 2e-2
    # decode: one split (the V scale applied in the kernel) and two (after the merge)
    for extra in [dict(num_splits=1), dict(num_splits=2)] if kernel == "decode" else [{}]:
        kw = dict(sm_scale=0.3, interpret=INTERPRET, **extra)
        floats = run(*args, k_scale=ks, v_scale=vs, **kw)
        arrays = run(*args, k_scale=ks_arr, v_scale=vs_arr, **kw)
        mixed = run(*args, k_scale=ks, v_scale=vs_arr, **kw)
        assert floats.dtype == case.q.dtype
        for out, want in ((floats, arrays), (mixed, arrays), (floats, ref)):
            np.testing.assert_allclose(
                np.asarray(out, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol
            )


@pytest.mark.parametrize("max_pages", [1, 2, 3, 5, 7, 8, 9, 33, 100])
@pytest.mark.parametrize("block_bytes", [tuning.KV_BLOCK_BYTES, tuning.FULL_GRID_KV_BLOCK_BYTES])
def test_default_pages_per_block_is_a_power_of_two_within_the_table(max_pages, block_bytes):
    # Triton's lowering takes only power-of-two array sizes: a 5-page-wide table once gave
    # 5-page blocks (interpret mode ran them; the GPU compile refused).
    for d, kv, q in (
        (64, "int8", "bfloat16"),
        (128, "bfloat16", "bfloat16"),
        (64, "float32", "float32"),
    ):
        bp = tuning.pages_per_block(d, kv, 8, max_pages, q, block_bytes)
        assert bp >= 1 and bp & (bp - 1) == 0 and bp <= max_pages, (d, kv, bp)


@pytest.mark.parametrize(
    "kernel,knob,value",
    [
        ("decode", "pages_per_block", 3),
        ("decode", "pages_per_block", 0),
        ("ragged", "tokens_per_block", 6),
        ("ragged", "pages_per_block", 5),
    ],
)
def test_block_knobs_must_be_powers_of_two(kernel, knob, value):
    case = make_case(15, [(1, 9), (1, 20)], pad_seqs=0, pad_tokens=0)
    if kernel == "decode":
        args, run = (case.q, case.kv_pages, case.kv_lens, case.page_indices), decode_paged_attention
    else:
        args, run = case.args, ragged_paged_attention
    # No "$": JAX 0.11 appends a note on filtered frames to errors raised while tracing.
    with pytest.raises(ValueError, match=rf"^{knob}: expected a power of two >= 1, got {value}\b"):
        run(*args, interpret=INTERPRET, **{knob: value})
