"""The CPU backend's C attention kernels (``paged_jax.kernels.cpu``: decode and ragged)
against the f64 oracle.

The kernel is compiled on first use with the machine's C compiler. On a machine with no
compiler at all the tests that run the kernel are skipped, saying so (the library then
uses XLA, which the last two tests check everywhere); with a compiler, a kernel that does
not build fails them.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_cases import (
    HAS_CC,
    assert_close_to_oracle,
    covering_sample,
    kernel_case,
    make_case,
)

import paged_jax as pj
from paged_jax import attention
from paged_jax.kernels import cpu

BATCH = [(1, 1), (1, 8), (1, 16), (1, 17), (1, 40), (1, 129)]
GQA = [(4, 4), (8, 2), (6, 2), (8, 1)]  # groups of 1, 4, 3, 8
needs_cc = pytest.mark.skipif(
    not HAS_CC, reason="no C compiler here: the CPU backend falls back to XLA"
)
OPTIONS = {
    "plain": {},
    "softcap": dict(soft_cap=2.5),
    "window": dict(sliding_window=6),
    "both": dict(sliding_window=11, soft_cap=4.0),
}


@needs_cc
def test_kernel_builds_here():
    assert cpu.available(), cpu.unavailable_reason()
    assert cpu.unavailable_reason() == ""


def _check(page, heads, d, dtype, opt, seed, threads=None):
    case = kernel_case(seed, BATCH, page, heads, d, dtype, pad_seqs=0, pad_tokens=0, **OPTIONS[opt])
    kw = dict(sm_scale=d**-0.5, **OPTIONS[opt])
    # Two padding rows: kv_len 0 and a negative kv_len, NaN queries, tables on NaN pages.
    pad = jnp.full((2,) + case.q.shape[1:], jnp.nan, case.q.dtype)
    q = jnp.concatenate([case.q, pad])
    lens = jnp.concatenate([case.kv_lens, jnp.array([0, -3], jnp.int32)])
    table = jnp.concatenate([case.page_indices, case.page_indices[-2:]])
    args = (q, case.kv_pages, lens, table)
    ref = pj.reference.paged_attention(case.q, case.kv_pages, case.kv_lens, case.page_indices, **kw)
    out = jax.jit(lambda *a: cpu.decode_paged_attention(*a, threads=threads, **kw))(*args)
    assert out.dtype == case.q.dtype and out.shape == q.shape
    np.testing.assert_array_equal(np.asarray(out[-2:], np.float32), 0.0)
    assert_close_to_oracle(out[:-2], ref, case.expected, what=f"{page} {heads} {dtype} {opt}")
    return out


def _grid(num, seed):
    full = list(itertools.product([8, 16], GQA, [64, 128], ["float32", "bfloat16"], OPTIONS))
    return covering_sample(full, num, seed)


@needs_cc
@pytest.mark.parametrize("params", _grid(5, seed=21), ids=str)
def test_decode_kernel(params):
    _check(*params, seed=0)


@needs_cc
@pytest.mark.slow
@pytest.mark.parametrize("params", _grid(64, seed=22), ids=str)
def test_decode_kernel_large_grid(params):
    _check(*params, seed=1)


@needs_cc
@pytest.mark.parametrize(
    "head_dim,dtype,q_dtype",
    [(20, "float32", None), (24, "bfloat16", None), (48, "bfloat16", None)]
    + [(48, "float32", None), (64, "bfloat16", "float32"), (128, "bfloat16", None)],
)
def test_each_code_path(head_dim, dtype, q_dtype):
    """decode.c goes token by token for a head_dim off the vector lanes (20; 24 with
    AVX-512's 16 lanes, not AVX2's 8) and on CPUs without AVX2, blocked otherwise; reads
    bf16 values two vectors at a time when head_dim allows (64, 128; 48 only with 8
    lanes); and, with AVX512-BF16, multiplies bf16 q by bf16 keys directly (not f32 q)."""
    opts = dict(sliding_window=21, soft_cap=4.0)
    case = kernel_case(
        8, BATCH, 16, (6, 2), head_dim, dtype, q_dtype=q_dtype, pad_seqs=0, pad_tokens=0, **opts
    )
    args = (case.q, case.kv_pages, case.kv_lens, case.page_indices)
    kw = dict(sm_scale=head_dim**-0.5, **opts)
    out = cpu.decode_paged_attention(*args, **kw)
    assert out.dtype == case.q.dtype
    ref = pj.reference.paged_attention(*args, **kw)
    assert_close_to_oracle(out, ref, case.expected, what=f"{head_dim} {dtype} q {q_dtype}")


@needs_cc
def test_a_far_larger_score_in_any_lane():
    """One key's score is ~200 above the rest (exp of the gap overflows f32), at every
    position of a block in turn: the block's max must find it wherever it sits, or the
    output is inf/NaN; the output is then that key's value."""
    rng = np.random.default_rng(5)
    D, P, L = 32, 16, 40
    q = rng.standard_normal((1, 2, D)).astype(np.float32)
    pool = (0.1 * rng.standard_normal((4, P, 2, D))).astype(np.float32)
    tables, lens = jnp.asarray([[2, 0, 3]], jnp.int32), jnp.asarray([L], jnp.int32)
    for pos in range(P, 2 * P):  # every lane of the second block
        kv = pool.copy()
        page, slot = int(tables[0, pos // P]), pos % P
        kv[page, slot, 0] = q[0, 0] * (200.0 * D**0.5 / float(q[0, 0] @ q[0, 0]))
        args = (jnp.asarray(q), jnp.asarray(kv), lens, tables)
        out = np.asarray(cpu.decode_paged_attention(*args, sm_scale=D**-0.5))
        ref = np.asarray(pj.reference.paged_attention(*args, sm_scale=D**-0.5))
        assert np.isfinite(out).all(), pos
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5, err_msg=str(pos))
        np.testing.assert_allclose(out[0, 0], kv[page, slot, 1], rtol=1e-5, atol=1e-5)


@needs_cc
def test_work_shared_with_xla_threads_matches_one_thread():
    # Enough K/V for 3 threads (a thread takes at least 2**18 elements); the jobs past the
    # first go to XLA's thread pool, and calls from several Python threads at once keep
    # that pool busy, so the calling thread must claim back work no worker started.
    import concurrent.futures

    B, M, P, K, H, D = 8, 40, 16, 2, 8, 64
    rng = np.random.default_rng(5)
    kv = jnp.asarray(rng.standard_normal((B * M + 1, P, 2 * K, D)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((B, H, D)), jnp.float32)
    lens = jnp.asarray(rng.integers(500, M * P, B), jnp.int32)
    tables = jnp.asarray(rng.permutation(np.arange(1, B * M + 1)).reshape(B, M), jnp.int32)
    assert int(lens.sum()) * 2 * K * D >= 3 * 2**18

    def run(threads):
        f = jax.jit(lambda *a: cpu.decode_paged_attention(*a, sm_scale=0.125, threads=threads))
        return np.asarray(f(q, kv, lens, tables))

    one = run(1)
    ref = pj.reference.paged_attention(q, kv, lens, tables, sm_scale=0.125)
    np.testing.assert_allclose(one, ref, rtol=1e-5, atol=1e-5)
    for threads in (2, 3):
        np.testing.assert_array_equal(run(threads), one)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for out in pool.map(run, [2, 3] * 6):
            np.testing.assert_array_equal(out, one)


@needs_cc
def test_rows_do_not_depend_on_batch_or_threads():
    """Each sequence is computed alone: bitwise the same alone, in a batch, on 1-3 threads."""
    full = _check(16, (8, 2), 64, "float32", "plain", seed=3, threads=3)
    for threads in (1, 2):
        np.testing.assert_array_equal(
            _check(16, (8, 2), 64, "float32", "plain", seed=3, threads=threads), full
        )
    case = make_case(
        3, BATCH, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16, pad_seqs=0, pad_tokens=0
    )
    alone = cpu.decode_paged_attention(
        case.q[4:5], case.kv_pages, case.kv_lens[4:5], case.page_indices[4:5], sm_scale=0.125
    )
    np.testing.assert_array_equal(np.asarray(alone[0]), np.asarray(full[4]))


@needs_cc
def test_bad_page_ids_read_the_null_page():
    """Ids outside the pool read page 0 (here zeros), never memory outside the pool."""
    case = make_case(4, [(1, 20), (1, 9)], page_size=8, pad_seqs=0, pad_tokens=0)
    pool = case.kv_pages.at[0].set(0.0)
    table = case.page_indices.at[0, 1].set(10**6).at[1, 0].set(-5)
    lens = case.kv_lens.at[1].set(10**6)  # past its table: clipped to the table's slots
    args = (case.q, pool, lens, table)
    out = cpu.decode_paged_attention(*args, sm_scale=0.25)
    xla = attention._xla.paged_attention(
        *args, sm_scale=0.25, sliding_window=None, soft_cap=None, k_scale=None, v_scale=None
    )
    np.testing.assert_allclose(np.asarray(out), np.asarray(xla), rtol=1e-5, atol=1e-5)


# Prefill chunks after cached keys, whole prompts, decode tokens, tails of a page and of
# the vector block, and one sequence whose chunk is longer than a page.
RAGGED = [(1, 1), (5, 5), (7, 40), (16, 16), (33, 129), (1, 17), (3, 20), (20, 23)]


def _check_ragged(page, heads, d, dtype, opt, seed, threads=None):
    case = kernel_case(
        seed, RAGGED, page, heads, d, dtype, pad_seqs=1, pad_tokens=3, **OPTIONS[opt]
    )
    kw = dict(sm_scale=d**-0.5, **OPTIONS[opt])
    args = (case.q, case.kv_pages, case.kv_lens, case.page_indices, case.cu_q_lens, case.num_seqs)
    out = jax.jit(lambda *a: cpu.ragged_paged_attention(*a, threads=threads, **kw))(*args)
    ref = pj.reference.ragged_paged_attention(*args, **kw)
    live = int(case.cu_q_lens[int(case.num_seqs[0])])
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    np.testing.assert_array_equal(np.asarray(out[live:], np.float32), 0.0)  # NaN q: padding
    assert_close_to_oracle(
        out[:live], ref[:live], case.expected[:live], what=f"{page} {heads} {dtype} {opt}"
    )
    return case, out, kw


@needs_cc
@pytest.mark.parametrize("params", _grid(5, seed=23), ids=str)
def test_ragged_kernel(params):
    _check_ragged(*params, seed=4)


@needs_cc
@pytest.mark.slow
@pytest.mark.parametrize("params", _grid(64, seed=24), ids=str)
def test_ragged_kernel_large_grid(params):
    _check_ragged(*params, seed=5)


@needs_cc
@pytest.mark.parametrize("opt", ["softcap", "both"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ragged_rows_are_decode_rows(opt, dtype):
    """A ragged row is bitwise the decode kernel's row for that token alone (its own
    length, its sequence's table), with or without a window (blocks of keys lie at fixed
    multiples, whichever tokens are computed together), on any thread count."""
    case, out, kw = _check_ragged(16, (6, 2), 64, dtype, opt, seed=6, threads=1)
    for threads in (2, 3):
        again = _check_ragged(16, (6, 2), 64, dtype, opt, seed=6, threads=threads)[1]
        np.testing.assert_array_equal(np.asarray(again), np.asarray(out))
    seq = np.repeat(np.arange(len(RAGGED)), [q for q, _ in RAGGED])
    pos = np.concatenate([np.arange(kv - q, kv) for q, kv in RAGGED])
    live = len(seq)
    rows = cpu.decode_paged_attention(
        case.q[:live], case.kv_pages, jnp.asarray(pos + 1, jnp.int32), case.page_indices[seq], **kw
    )
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(out[:live]))


@needs_cc
@pytest.mark.parametrize("kernel", ["decode", "ragged"])
def test_pages_before_every_window_are_never_read(kernel):
    """Pages that no token's window reaches may be freed (the engine drops them: the table
    then names the null page, whose contents are anything). Filling them with NaN changes
    no bit of the output, though 8-token pages put them inside the first 16-key block."""
    case = kernel_case(
        10,
        [(5, 70), (1, 45), (9, 33)],
        8,
        (4, 2),
        64,
        "float32",
        pad_seqs=0,
        pad_tokens=0,
        sliding_window=13,
    )
    # each sequence's first query position (decode: its last token alone)
    first_pos = [70 - 5, 45 - 1, 33 - 9] if kernel == "ragged" else [69, 44, 32]
    nan_page = case.kv_pages.shape[0]  # a page of NaN after the pool's others
    pool = jnp.concatenate([case.kv_pages, jnp.full_like(case.kv_pages[:1], jnp.nan)])
    table = np.asarray(case.page_indices).copy()
    for s, pos in enumerate(first_pos):
        table[s, : (pos + 1 - 13) // 8] = nan_page  # pages wholly before every window
    assert (table == nan_page).sum() >= 5
    kw = dict(sm_scale=0.125, sliding_window=13)
    if kernel == "ragged":
        run = lambda t: cpu.ragged_paged_attention(  # noqa: E731
            case.q, pool, case.kv_lens, t, case.cu_q_lens, case.num_seqs, **kw
        )
    else:  # each sequence's last token alone
        last = np.cumsum([5, 1, 9]) - 1
        run = lambda t: cpu.decode_paged_attention(  # noqa: E731
            case.q[last], pool, case.kv_lens, t, **kw
        )
    clean, dropped = np.asarray(run(case.page_indices)), np.asarray(run(jnp.asarray(table)))
    assert np.isfinite(dropped).all()
    np.testing.assert_array_equal(dropped, clean)


@needs_cc
def test_ragged_bad_offsets_stay_inside_q():
    """cu_q_lens past T, decreasing or negative, and num_seqs past S or negative, are
    clamped: no row outside q is read or written, and rows nobody owns are 0."""
    case = make_case(9, [(4, 10), (3, 3)], pad_seqs=1, pad_tokens=2)
    base = (case.q, case.kv_pages, case.kv_lens, case.page_indices)
    T = case.q.shape[0]
    for cu, n in [([0, 4, 10**6, 7], 2), ([0, 5, 2, 1], 3), ([-9, 4, 7, 7], 9), ([0, 4, 7, 7], -1)]:
        out = np.asarray(
            cpu.ragged_paged_attention(
                *base, jnp.asarray(cu, jnp.int32), jnp.asarray([n], jnp.int32), sm_scale=0.25
            )
        )
        assert out.shape == (T, 4, 16)
        owned = np.zeros(T, bool)
        for s in range(max(0, min(n, 3))):
            a = min(max(cu[s], 0), T)
            owned[a : min(max(cu[s + 1], a), T)] = True
        np.testing.assert_array_equal(out[~owned], 0.0)


@needs_cc
def test_auto_picks_it_for_decode_and_ragged_steps(monkeypatch):
    monkeypatch.delenv("PAGED_JAX_BACKEND", raising=False)
    assert pj.available_backends("cpu") == ("cpu", "xla")
    assert attention._auto("cpu") == "cpu"
    assert attention._resolve("cpu", "decode") is cpu.decode_paged_attention
    assert attention._resolve("cpu", "ragged") is cpu.ragged_paged_attention

    ragged_calls = []

    def fake_ragged(*a, **k):
        ragged_calls.append(k)
        return a[0] * 0

    fake_ragged.__module__ = cpu.__name__
    monkeypatch.setattr(cpu, "ragged_paged_attention", fake_ragged)
    case = make_case(5, [(3, 9), (1, 3)], pad_seqs=0, pad_tokens=0)
    rargs = (case.q, case.kv_pages, case.kv_lens, case.page_indices, case.cu_q_lens, case.num_seqs)
    pj.ragged_paged_attention(*rargs, sm_scale=0.25)
    pj.ragged_paged_attention(*rargs, sm_scale=0.25, batch_invariant=True)  # invariant as is
    assert len(ragged_calls) == 2

    calls = []

    def fake(*a, **k):
        calls.append(k)
        return a[0] * 0

    fake.__module__ = cpu.__name__  # how paged_jax.attention tells the backend of a kernel
    monkeypatch.setattr(cpu, "decode_paged_attention", fake)
    case = make_case(5, [(1, 9), (1, 3)], pad_seqs=0, pad_tokens=0)
    args = (case.q, case.kv_pages, case.kv_lens, case.page_indices)
    pj.paged_attention(*args, sm_scale=0.25, backend="cpu")
    assert len(calls) == 1
    pj.paged_attention(*args, sm_scale=0.25, backend="cpu", batch_invariant=True)
    assert len(calls) == 2
    # Other dtypes and quantized pools stay on XLA (no call, a finite result).
    half = tuple(a.astype(jnp.float16) if a.dtype == jnp.float32 else a for a in args)
    out16 = pj.paged_attention(*half, sm_scale=0.25, backend="cpu")
    scaled = pj.paged_attention(*args, sm_scale=0.25, backend="cpu", k_scale=1.0, v_scale=1.0)
    assert len(calls) == 2
    assert np.isfinite(np.asarray(out16)).all() and np.isfinite(np.asarray(scaled)).all()
    # f32 queries on a bf16 pool: the kernel reads each dtype as it is.
    pj.paged_attention(args[0], args[1].astype(jnp.bfloat16), *args[2:], sm_scale=0.25)
    assert len(calls) == 3


@needs_cc
def test_boundary_errors():
    case = make_case(6, [(1, 9)], pad_seqs=0, pad_tokens=0)
    args = (case.q, case.kv_pages, case.kv_lens, case.page_indices)
    with pytest.raises(ValueError, match="k_scale/v_scale"):
        cpu.decode_paged_attention(*args, k_scale=0.5)
    with pytest.raises(ValueError, match="q: expected float32 or bfloat16, got float16"):
        cpu.decode_paged_attention(case.q.astype(jnp.float16), *args[1:])
    with pytest.raises(ValueError, match="threads: expected a positive int"):
        cpu.decode_paged_attention(*args, threads=0)
    rargs = (*args[:2], case.kv_lens, case.page_indices, case.cu_q_lens, case.num_seqs)
    with pytest.raises(ValueError, match="v_scale"):
        cpu.ragged_paged_attention(*rargs, v_scale=0.5)
    with pytest.raises(ValueError, match="kv_pages: expected float32 or bfloat16, got float16"):
        cpu.ragged_paged_attention(rargs[0], rargs[1].astype(jnp.float16), *rargs[2:])


def test_unavailable_kernel_leaves_auto_on_xla(monkeypatch):
    monkeypatch.delenv("PAGED_JAX_BACKEND", raising=False)
    monkeypatch.setattr(cpu.build, "_state", {"ok": False, "why": "no C compiler", "lib": None})
    assert pj.available_backends("cpu") == ("xla",)
    assert attention._auto("cpu") == "xla"
    case = make_case(7, [(1, 9)], pad_seqs=0, pad_tokens=0)
    args = (case.q, case.kv_pages, case.kv_lens, case.page_indices)
    with pytest.raises(ValueError, match=r"backend='cpu'.*no C compiler"):
        pj.paged_attention(*args, backend="cpu")
    with pytest.raises(ValueError, match="not available: no C compiler"):
        cpu.decode_paged_attention(*args)


def test_failed_build_is_reported(monkeypatch, tmp_path):
    """A compiler that fails leaves the kernel unavailable with the compiler's words."""
    bad = tmp_path / "cc"
    bad.write_text("#!/bin/sh\necho 'cc: broken toolchain' >&2\nexit 1\n")
    bad.chmod(0o755)
    monkeypatch.setenv("CC", str(bad))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    lib, why = cpu.build.build_library()
    assert lib is None and "broken toolchain" in why


def test_an_empty_pool_and_min_p_above_one_are_refused_and_the_kernels_cope():
    """Issue 56, item 12: an empty pool with kv_lens > 0 read out of bounds in decode.c
    (page 0 did not exist either), and min_p > 1 kept no token, so the draw read the first
    entry of an empty order (SIGSEGV in sample.c)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import pytest

    import paged_jax as pj
    from paged_jax.kernels import cpu

    q = jnp.ones((2, 4, 16), jnp.float32)
    empty = jnp.zeros((0, 8, 4, 16), jnp.float32)
    with pytest.raises(ValueError, match="kv_pages: expected at least 1 page"):
        pj.paged_attention(
            q, empty, jnp.array([3, 5], jnp.int32), jnp.zeros((2, 2), jnp.int32), backend="cpu"
        )
    if not cpu.available():
        pytest.skip("the CPU kernels did not build here")
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 50)), jnp.float32)
    args = (jnp.ones(3, jnp.float32), jnp.zeros(3, jnp.int32), jnp.ones(3, jnp.float32))
    u = jnp.full((3, 2), 0.5, jnp.float32)
    with pytest.raises(ValueError, match="min_p: expected values in \\[0, 1\\]"):
        cpu.sample_tokens(x, *args, jnp.full(3, 1.5, jnp.float32), u)
    # traced (no values to check at the boundary): the kernel keeps the top token
    tokens, _ = jax.jit(cpu.sample_tokens)(x, *args, jnp.full(3, 1.5, jnp.float32), u)
    assert np.asarray(tokens).tolist() == [[int(np.argmax(r))] * 2 for r in np.asarray(x)]
