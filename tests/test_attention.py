"""Reference oracle and XLA backend vs dense f64 attention on independently built K/V."""

import functools
import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_cases import (
    HAS_CC,
    assert_close_to_oracle,
    assert_reference_close,
    covering_sample,
    dense_attention,
    make_case,
    max_err,
)

import paged_jax as pj

# Batches of (q_len, kv_len): lengths 0, 1, page boundaries (8, 16, 32 with page 8/16/32),
# one past a boundary, decode-only, prefill-only, mixed, and a long context.
BATCHES = {
    "decode": [(1, 1), (1, 8), (1, 9), (1, 33), (1, 16)],
    "prefill": [(8, 8), (13, 13), (1, 1), (32, 32)],
    "mixed": [(5, 20), (1, 16), (0, 7), (16, 16), (1, 1), (3, 64)],
    "long": [(7, 300), (1, 129)],
}
GQA = [(4, 4), (4, 2), (8, 2), (8, 1)]  # (H, K): groups of 1, 2, 4, 8
OPTIONS = {
    "plain": {},
    "softcap": dict(soft_cap=2.5),
    "window": dict(sliding_window=5),
    "window+cap": dict(sliding_window=17, soft_cap=4.0),
}


def _grid(num: int, seed: int):
    """A seeded sample of the full product, so the default suite stays small."""
    full = list(
        itertools.product(
            BATCHES,
            [1, 8, 16, 32],
            GQA,
            [64, 128, 256],
            ["float32", "bfloat16", "float16"],
            OPTIONS,
        )
    )
    return covering_sample(full, num, seed)


def _id(p):
    batch, page, (h, k), d, dtype, opt = p
    return f"{batch}-P{page}-H{h}K{k}-D{d}-{dtype}-{opt}"


def _case(seed, batch, page, heads, head_dim, dtype, opt):
    h, k = heads
    return make_case(
        seed,
        BATCHES[batch],
        num_q_heads=h,
        num_kv_heads=k,
        head_dim=head_dim,
        page_size=page,
        dtype=jnp.dtype(dtype),
        **OPTIONS[opt],
    )


def test_hand_worked_single_key():
    # One sequence, one token, kv_len 1: softmax over a single key is 1, so the output is
    # exactly that key's V whatever q and sm_scale are. Page 3 of 4 holds it.
    kv = jnp.full((4, 2, 2, 2), jnp.nan, jnp.float32)
    kv = kv.at[3, 0, 0].set(jnp.array([1.0, 2.0]))  # K
    kv = kv.at[3, 0, 1].set(jnp.array([-3.0, 0.5]))  # V
    q = jnp.array([[[10.0, -7.0]]])
    args = (
        q,
        kv,
        jnp.array([1], jnp.int32),
        jnp.array([[3]], jnp.int32),
        jnp.array([0, 1], jnp.int32),
        jnp.array([1], jnp.int32),
    )
    for fn in (pj.reference.ragged_paged_attention, pj.ragged_paged_attention):
        np.testing.assert_array_equal(fn(*args, sm_scale=0.3), [[[-3.0, 0.5]]])


def test_hand_worked_two_keys():
    # Keys k0 = (1, 0), k1 = (0, 1), V rows v0 = (2, 0), v1 = (0, 4), q = (ln 3, 0),
    # sm_scale 1: scores (ln 3, 0), softmax (3/4, 1/4), output (1.5, 1.0).
    kv = jnp.zeros((2, 2, 2, 2), jnp.float32)
    kv = kv.at[1, :, 0].set(jnp.array([[1.0, 0.0], [0.0, 1.0]]))
    kv = kv.at[1, :, 1].set(jnp.array([[2.0, 0.0], [0.0, 4.0]]))
    q = jnp.array([[[np.log(3.0), 0.0]]], jnp.float32)
    lens, table = jnp.array([2], jnp.int32), jnp.array([[1]], jnp.int32)
    for fn in (pj.reference.paged_attention, pj.paged_attention):
        np.testing.assert_allclose(fn(q, kv, lens, table), [[[1.5, 1.0]]], rtol=1e-6)


def _check_reference(params):
    case = _case(0, *params)
    opts = OPTIONS[params[-1]]
    out = pj.reference.ragged_paged_attention(*case.args, sm_scale=params[3] ** -0.5, **opts)
    assert_reference_close(out, case.expected, params[4])


@pytest.mark.parametrize("params", _grid(4, seed=1), ids=_id)
def test_reference_matches_dense_oracle(params):
    _check_reference(params)


@pytest.mark.slow
@pytest.mark.parametrize("params", _grid(48, seed=4), ids=_id)
def test_reference_matches_dense_oracle_large_grid(params):
    _check_reference(params)


def _check_xla(params, seed):
    case = _case(seed, *params)
    kw = dict(sm_scale=params[3] ** -0.5, **OPTIONS[params[-1]])
    ref = pj.reference.ragged_paged_attention(*case.args, **kw)
    out = pj.ragged_paged_attention(*case.args, backend="xla", **kw)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert_close_to_oracle(out, ref, case.expected)


@pytest.mark.parametrize("params", _grid(4, seed=2), ids=_id)
def test_xla_matches_oracle(params):
    _check_xla(params, seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("params", _grid(240, seed=3), ids=_id)
def test_xla_matches_oracle_large_grid(params):
    _check_xla(params, seed=2)


@pytest.mark.parametrize("tokens_per_block,pages_per_block", [(1, 1), (2, 3), (4, 2), (64, 64)])
def test_xla_block_sizes_do_not_change_results(tokens_per_block, pages_per_block):
    # Several KV blocks and token blocks per call, blocks that straddle sequences, a
    # block count that does not divide the table width.
    case = make_case(3, BATCHES["mixed"] + [(2, 45)], page_size=4, sliding_window=11)
    from paged_jax import _xla

    out = _xla.ragged_paged_attention(
        *case.args,
        sm_scale=0.25,
        sliding_window=11,
        soft_cap=None,
        k_scale=None,
        v_scale=None,
        tokens_per_block=tokens_per_block,
        pages_per_block=pages_per_block,
    )
    expected = make_case(
        3, BATCHES["mixed"] + [(2, 45)], page_size=4, sliding_window=11, sm_scale=0.25
    ).expected
    assert max_err(out, expected) < 1e-5


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("batch", ["decode", "mixed"])
def test_quantized_kv(dtype, batch):
    case = make_case(4, BATCHES[batch], dtype=jnp.dtype(dtype), page_size=8)
    kw = dict(sm_scale=16**-0.5, k_scale=case.k_scale, v_scale=case.v_scale)
    ref = pj.reference.ragged_paged_attention(*case.args, **kw)
    # The oracle uses the dequantized stored values, so only f32 math error remains.
    assert_reference_close(ref, case.expected, jnp.float32)
    out = pj.ragged_paged_attention(*case.args, **kw)
    assert_close_to_oracle(out, ref, case.expected)


def test_scalar_kv_scales_as_in_jax():
    # JAX's op takes per-tensor float scales; int8 values times 0.05 must equal f32 pages.
    case = make_case(5, BATCHES["mixed"], page_size=8)
    kv8 = jnp.clip(jnp.round(jnp.nan_to_num(case.kv_pages) / 0.05), -127, 127).astype(jnp.int8)
    kv32 = kv8.astype(jnp.float32) * 0.05
    a = pj.ragged_paged_attention(*case.args[:1], kv8, *case.args[2:], k_scale=0.05, v_scale=0.05)
    b = pj.ragged_paged_attention(*case.args[:1], kv32, *case.args[2:])
    np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("page_size", [1, 8, 16])
@pytest.mark.parametrize("opt", ["plain", "window+cap"])
def test_decode_matches_oracle(page_size, opt):
    seqs = [(1, n) for n in (1, page_size, page_size + 1, 3 * page_size, 50)]
    case = make_case(
        6,
        seqs,
        page_size=page_size,
        num_q_heads=8,
        num_kv_heads=2,
        pad_seqs=0,
        pad_tokens=0,
        **OPTIONS[opt],
    )
    kw = dict(sm_scale=16**-0.5, **OPTIONS[opt])
    ref = pj.reference.paged_attention(case.q, case.kv_pages, case.kv_lens, case.page_indices, **kw)
    out = pj.paged_attention(case.q, case.kv_pages, case.kv_lens, case.page_indices, **kw)
    assert_close_to_oracle(out, ref, case.expected)
    ragged = pj.ragged_paged_attention(*case.args, **kw)
    np.testing.assert_allclose(out, ragged, atol=1e-6)


def test_decode_padding_rows_are_zero_and_read_nothing():
    case = make_case(7, [(1, 5), (1, 12)], pad_seqs=0, pad_tokens=0, page_size=4)
    # Append two padding rows: kv_len 0, tables pointing at NaN pages / page 0.
    q = jnp.concatenate([case.q, jnp.full((2,) + case.q.shape[1:], jnp.nan)], axis=0)
    lens = jnp.concatenate([case.kv_lens, jnp.zeros(2, jnp.int32)])
    table = jnp.concatenate(
        [case.page_indices, jnp.zeros((2, case.page_indices.shape[1]), jnp.int32)]
    )
    out = pj.paged_attention(q, case.kv_pages, lens, table, sm_scale=0.25)
    ref = pj.reference.paged_attention(q, case.kv_pages, lens, table, sm_scale=0.25)
    np.testing.assert_array_equal(out[2:], 0.0)
    np.testing.assert_allclose(out, ref, atol=1e-6)


def test_padding_tokens_and_rows_do_not_leak():
    # The same live sequences give the same outputs whatever the padding holds: strip the
    # padding rows and tokens of a padded batch and compare.
    b = make_case(8, BATCHES["mixed"], pad_seqs=3, pad_tokens=9)
    S, n = len(BATCHES["mixed"]), int(b.cu_q_lens[len(BATCHES["mixed"])])
    out_b = pj.ragged_paged_attention(*b.args, sm_scale=0.25)
    out_a = pj.ragged_paged_attention(
        b.q[:n],
        b.kv_pages,
        b.kv_lens[:S],
        b.page_indices[:S],
        b.cu_q_lens[: S + 1],
        b.num_seqs,
        sm_scale=0.25,
    )
    np.testing.assert_allclose(out_a, out_b[:n], atol=1e-6)
    np.testing.assert_array_equal(out_b[n:], 0.0)


def test_dense_oracle_is_plain_softmax_attention():
    # The oracle itself, on a case small enough to write out: one query at position 2,
    # three keys, window 2 -> keys 1 and 2 only.
    rng = np.random.default_rng(0)
    q, k, v = (
        rng.standard_normal((1, 1, 3)),
        rng.standard_normal((3, 1, 3)),
        rng.normal(size=(3, 1, 3)),
    )
    s = np.array([q[0, 0] @ k[1, 0], q[0, 0] @ k[2, 0]])
    w = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
    expected = w[0] * v[1, 0] + w[1] * v[2, 0]
    got = dense_attention(q, k, v, np.array([2]), sm_scale=1.0, sliding_window=2)
    np.testing.assert_allclose(got[0, 0], expected, rtol=1e-12)


class PublicApiVariantsTest(chex.TestCase):
    """The public functions behave the same traced under jit and called eagerly."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_ragged(self):
        case = make_case(9, BATCHES["mixed"], page_size=8, sliding_window=6, soft_cap=3.0)
        fn = self.variant(
            functools.partial(
                pj.ragged_paged_attention, sm_scale=0.25, sliding_window=6, soft_cap=3.0
            )
        )
        ref = pj.reference.ragged_paged_attention(
            *case.args, sm_scale=0.25, sliding_window=6, soft_cap=3.0
        )
        assert_close_to_oracle(fn(*case.args), ref, case.expected)

    @chex.variants(with_jit=True, without_jit=True)
    def test_decode(self):
        case = make_case(10, BATCHES["decode"], page_size=8, pad_seqs=0, pad_tokens=0)
        fn = self.variant(functools.partial(pj.paged_attention, sm_scale=0.25))
        ref = pj.reference.paged_attention(
            case.q, case.kv_pages, case.kv_lens, case.page_indices, sm_scale=0.25
        )
        out = fn(case.q, case.kv_pages, case.kv_lens, case.page_indices)
        assert_close_to_oracle(out, ref, case.expected)

    @chex.variants(with_jit=True, without_jit=True)
    def test_cache_write_then_attend(self):
        # A cache written through PagedKVCache.write reads back through attention.
        cache = pj.PagedKVCache.create(2, 6, 4, 2, 8, dtype=jnp.float32)
        rng = np.random.default_rng(0)
        k = jnp.asarray(rng.standard_normal((6, 2, 8)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((6, 2, 8)), jnp.float32)
        slots = jnp.array([20, 21, 22, 23, 8, 9], jnp.int32)  # pages 5 then 2

        @self.variant
        def step(cache, q):
            cache = cache.write(1, k, v, slots)
            kv, _, _ = cache.layer(1)
            return pj.paged_attention(
                q, kv, jnp.array([6], jnp.int32), jnp.array([[5, 2]], jnp.int32)
            )

        q = jnp.asarray(rng.standard_normal((1, 4, 8)), jnp.float32)
        expected = dense_attention(
            np.asarray(q), np.asarray(k), np.asarray(v), np.array([5]), sm_scale=1.0
        )
        np.testing.assert_allclose(step(cache, q), expected, atol=1e-5)


def test_backend_selection():
    from paged_jax import attention

    # The C kernel where a compiler is at hand (tests/test_cpu_kernel.py), else XLA.
    assert pj.available_backends("cpu") == (("cpu", "xla") if HAS_CC else ("xla",))
    assert pj.available_backends("gpu") == ("pallas_gpu", "xla")
    assert pj.available_backends("tpu") == ("pallas_tpu", "xla")
    # TPU and NVIDIA GPU: the Pallas kernels (the GPU ones since they ran on an H100).
    assert attention._auto("tpu") == "pallas_tpu" and attention._auto("gpu") == "pallas_gpu"
    assert attention._auto("cpu") == ("cpu" if HAS_CC else "xla")
    case = make_case(11, BATCHES["decode"][:2])
    with pytest.raises(ValueError, match=r"backend: expected one of .* got 'cuda'"):
        pj.ragged_paged_attention(*case.args, backend="cuda")


def test_backend_environment_override(monkeypatch):
    from paged_jax import attention

    monkeypatch.setenv("PAGED_JAX_BACKEND", "xla")
    assert attention._auto("tpu") == "xla"
    monkeypatch.setenv("PAGED_JAX_BACKEND", "fast")
    with pytest.raises(ValueError, match="PAGED_JAX_BACKEND: expected one of .*, got 'fast'"):
        attention._auto("tpu")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_xla_decode_never_copies_the_pool(dtype):
    # A pool of 4096 pages, two sequences of 3 pages: peak temporaries must be a small
    # fraction of the pool (the XLA path gathers only the sequences' own pages).
    kv = jax.ShapeDtypeStruct((65536, 16, 4, 64), jnp.dtype(dtype))  # lowered, never allocated
    q = jax.ShapeDtypeStruct((2, 4, 64), jnp.dtype(dtype))
    lens, table = jnp.array([40, 3], jnp.int32), jnp.array([[7, 9, 11], [5, 0, 0]], jnp.int32)
    compiled = jax.jit(pj.paged_attention).lower(q, kv, lens, table).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    pool_bytes = kv.size * kv.dtype.itemsize
    assert temp < pool_bytes / 64, f"temp {temp} bytes vs pool {pool_bytes} bytes"


def test_xla_blocked_loop_path_never_copies_an_f32_pool():
    # A long prefill takes the blocked (looping) path; with an f32 pool no pool-sized
    # temporary appears (16-bit pools on XLA:CPU: see paged_jax/_xla.py's docstring).
    kv = jax.ShapeDtypeStruct((65536, 16, 4, 64), jnp.float32)  # 1 GiB, lowered only
    q = jax.ShapeDtypeStruct((512, 4, 64), jnp.float32)
    lens, table = jnp.array([4096], jnp.int32), jnp.arange(1, 257, dtype=jnp.int32)[None]
    cu, n = jnp.array([0, 512], jnp.int32), jnp.array([1], jnp.int32)
    compiled = jax.jit(pj.ragged_paged_attention).lower(q, kv, lens, table, cu, n).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    pool_bytes = kv.size * kv.dtype.itemsize
    # One gathered block (the 32 MiB budget) and its K/V views, nothing pool-sized.
    assert temp < 80 * 2**20, f"temp {temp} bytes vs pool {pool_bytes} bytes"


def test_auto_follows_the_default_device_not_the_default_backend(monkeypatch):
    # On a GPU machine, work placed on its CPU devices (jax.default_device) must not get
    # the GPU's kernels: "auto" picks for the platform computations go to.
    from paged_jax import attention

    monkeypatch.delenv("PAGED_JAX_BACKEND", raising=False)
    monkeypatch.setattr(attention.jax, "default_backend", lambda: "gpu")
    assert attention.available_backends()[0] == "pallas_gpu"
    with jax.default_device(jax.devices("cpu")[0]):
        assert attention.available_backends() == attention.available_backends("cpu")
        assert attention._auto() in ("cpu", "xla")
    with jax.default_device("cpu"):
        assert attention._auto() in ("cpu", "xla")


def test_auto_takes_xla_for_batch_invariant_steps_on_a_gpu(monkeypatch):
    # Measured on an H100: deterministic mode is bitwise batch invariant with XLA's
    # attention, not with the Triton kernels. Named explicitly, the kernel is kept.
    from paged_jax import attention

    monkeypatch.delenv("PAGED_JAX_BACKEND", raising=False)
    monkeypatch.setattr(attention.jax, "default_backend", lambda: "gpu")
    for kind in ("ragged", "decode"):
        assert attention._resolve("auto", kind, batch_invariant=True) is None
        fast = attention._resolve("auto", kind)
        assert fast is not None and attention.backend_of(fast) == "pallas_gpu"
        named = attention._resolve("pallas_gpu", kind, batch_invariant=True)
        assert attention.backend_of(named) == "pallas_gpu"
    monkeypatch.setenv("PAGED_JAX_BACKEND", "pallas_gpu")  # the override is obeyed
    assert attention._resolve("auto", "decode", batch_invariant=True) is not None
