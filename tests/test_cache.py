"""PagedKVCache: construction, functional ops, donation without pool copies, errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import paged_jax as pj
from paged_jax import linear

L, N, P, K, D = 2, 9, 4, 2, 8


def _cache(dtype=jnp.float32, num_pages=N):
    return pj.PagedKVCache.create(L, num_pages, P, K, D, dtype=dtype)


def _kv(seed, T, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    k = jnp.asarray(rng.standard_normal((T, K, D)), dtype)
    v = jnp.asarray(rng.standard_normal((T, K, D)), dtype)
    return k, v


def test_create_shapes_and_static_fields():
    c = _cache(jnp.bfloat16)
    assert c.kv_pages.shape == (L, N, P, 2 * K, D) and c.kv_pages.dtype == jnp.bfloat16
    assert c.kv_scales is None and not c.quantized
    assert (c.num_layers, c.page_size, c.num_kv_heads, c.head_dim, c.num_pages) == (L, P, K, D, N)
    leaves, treedef = jax.tree.flatten(c)
    assert len(leaves) == 1  # static fields live in the treedef, not the leaves
    other = pj.PagedKVCache.create(L, N, 2 * P, K, D // 2, dtype=jnp.bfloat16)
    assert jax.tree.structure(other) != treedef


def test_bytes_accounting():
    # bf16: per token 2 layers * 2*K=4 rows * D=8 * 2 bytes = 128 bytes; pool 9*4 slots.
    c = _cache(jnp.bfloat16)
    assert c.bytes_per_token == 2 * 4 * 8 * 2 == 128
    assert c.nbytes == N * P * 128 == c.kv_pages.nbytes
    # int8 with f32 per-row scales: 2 * 4 * (8 + 4) bytes per token.
    q = _cache(jnp.int8)
    assert q.bytes_per_token == 96
    assert q.nbytes == q.kv_pages.nbytes + q.kv_scales.nbytes


def test_write_then_read_pages_roundtrip():
    c = _cache()
    k, v = _kv(0, 6)
    slots = jnp.array([4 * 3 + 0, 4 * 3 + 1, 4 * 3 + 2, 4 * 3 + 3, 4 * 7 + 0, 4 * 7 + 1], jnp.int32)
    c = c.write(1, k, v, slots)
    pages = c.read_pages(jnp.array([3, 7], jnp.int32))  # [L, 2, P, 2K, D]
    assert pages.shape == (L, 2, P, 2 * K, D)
    got = pages[1].reshape(2 * P, 2 * K, D)[:6]
    np.testing.assert_array_equal(got[:, 0::2], k)
    np.testing.assert_array_equal(got[:, 1::2], v)
    np.testing.assert_array_equal(pages[0], 0.0)  # layer 0 untouched
    np.testing.assert_array_equal(pages[1, 1, 2:], 0.0)  # unwritten slots untouched


def test_copy_pages_copies_every_layer_and_reads_before_writes():
    c = _cache()
    rng = np.random.default_rng(1)
    c = pj.PagedKVCache(
        jnp.asarray(rng.standard_normal(c.kv_pages.shape), jnp.float32), None, L, P, K, D
    )
    before = np.asarray(c.kv_pages)
    # 2 -> 5 and 5 -> 6 in one call: page 6 must get page 5's *old* contents.
    out = c.copy_pages(jnp.array([2, 5, 0], jnp.int32), jnp.array([5, 6, 0], jnp.int32))
    after = np.asarray(out.kv_pages)
    np.testing.assert_array_equal(after[:, 5], before[:, 2])
    np.testing.assert_array_equal(after[:, 6], before[:, 5])
    keep = [1, 2, 3, 4, 7, 8]
    np.testing.assert_array_equal(after[:, keep], before[:, keep])


def test_write_pages_restores_swapped_out_pages():
    c = _cache()
    k, v = _kv(2, 8)
    c = c.write(0, k, v, jnp.arange(8, 16, dtype=jnp.int32))  # pages 2 and 3
    host = jax.device_get(c.read_pages(jnp.array([2, 3], jnp.int32)))
    assert isinstance(host, np.ndarray)
    fresh = _cache().write_pages(jnp.array([6, 1], jnp.int32), jnp.asarray(host))
    np.testing.assert_array_equal(fresh.kv_pages[:, 6], c.kv_pages[:, 2])
    np.testing.assert_array_equal(fresh.kv_pages[:, 1], c.kv_pages[:, 3])


@given(
    live=st.lists(st.integers(P, N * P - 1), unique=True, max_size=12),
    num_padding=st.integers(0, 6),
    seed=st.integers(0, 2**16),
)
def test_padding_slots_only_touch_page_zero(live, num_padding, seed):
    rng = np.random.default_rng(seed)
    padding = rng.integers(0, P, num_padding)  # slots of the null page
    slots = np.concatenate([np.array(live, np.int64), padding]).astype(np.int32)
    rng.shuffle(slots)
    T = slots.size
    if T == 0:
        return
    k, v = _kv(seed, T)
    c = _cache()
    c.validate_slot_mapping(slots)
    out = _jit_write(c, 1, k, v, jnp.asarray(slots))
    written = np.asarray(out.kv_pages[1]).reshape(N * P, 2 * K, D)
    kv = np.asarray(jnp.stack([k, v], axis=2).reshape(T, 2 * K, D))
    for t, s in enumerate(slots):
        if s >= P:
            np.testing.assert_array_equal(written[s], kv[t])
    untouched = np.ones(N * P, bool)
    untouched[slots] = False
    untouched[:P] = False  # the null page may hold anything
    assert not written[untouched].any(), "a slot outside slot_mapping was written"
    assert not np.asarray(out.kv_pages[0]).any(), "another layer was written"


@functools.partial(jax.jit, static_argnums=1)
def _jit_write(cache, layer, k, v, slots):
    return cache.write(layer, k, v, slots)


def test_out_of_range_slots_are_dropped_not_wrapped():
    # Under jit values cannot be checked; a negative slot must not wrap onto the last page.
    c = _cache()
    k, v = _kv(3, 2)
    out = _jit_write(c, 0, k, v, jnp.array([-1, N * P + 3], jnp.int32))
    assert not np.asarray(out.kv_pages).any()


def _donating(fn):
    return jax.jit(fn, donate_argnums=0)


OPS = {
    "write": lambda c: c.write(0, *_kv(4, 3), jnp.array([5, 6, 7], jnp.int32)),
    # one row: XLA would make the scatter an update that copies the pool (padded to 2)
    "write_one_row": lambda c: c.write(1, *_kv(4, 1), jnp.array([9], jnp.int32)),
    "copy_pages": lambda c: c.copy_pages(
        jnp.array([1, 2], jnp.int32), jnp.array([3, 4], jnp.int32)
    ),
    "write_pages": lambda c: c.write_pages(
        jnp.array([2], jnp.int32), jnp.ones((L, 1, P, 2 * K, D), c.dtype)
    ),
}


@pytest.mark.parametrize(
    "op,dtype",
    # write_pages of an int8 cache takes scales: test_donated_quantized_write_pages_in_place.
    [
        (o, d)
        for o in OPS
        for d in ("float32", "bfloat16", "int8")
        if (o, d) != ("write_pages", "int8")
    ],
)
def test_donated_ops_update_the_pool_in_place(op, dtype):
    cache = pj.PagedKVCache.create(L, 512, P, K, D, dtype=jnp.dtype(dtype))
    pool_bytes = cache.kv_pages.nbytes
    fn = _donating(OPS[op])
    stats = fn.lower(cache).compile().memory_analysis()
    # The output pool aliases the input pool and no pool-sized temporary exists...
    assert stats.alias_size_in_bytes >= pool_bytes, stats.alias_size_in_bytes
    limit = pool_bytes / 8
    if dtype == "bfloat16" and jax.default_backend() == "cpu" and not linear.available():
        # ...except that XLA:CPU has no bf16 scatter: its float-normalization pass scatters
        # into an f32 copy of the pool (2x its bytes; measured with jax 0.10.2), which is
        # why the CPU kernels write 8- and 16-bit pools where they are built. f32 and
        # int8 pools, and 16-bit pools on GPU/TPU, have no such copy.
        limit = 2 * pool_bytes + pool_bytes / 8
    assert stats.temp_size_in_bytes < limit, stats.temp_size_in_bytes
    ptr = cache.kv_pages.unsafe_buffer_pointer()
    out = fn(cache)
    assert out.kv_pages.unsafe_buffer_pointer() == ptr
    assert cache.kv_pages.is_deleted()


@pytest.mark.skipif(not linear.available(), reason="the CPU kernels did not build here")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "int8", "float8_e4m3fn"])
def test_cpu_kernels_write_and_move_narrow_pools_as_xla_does(dtype, monkeypatch):
    # 8- and 16-bit pools on CPU: rows and pages go through cache.c, bitwise what XLA's
    # scatter and gather give (PAGED_JAX_BACKEND=xla), out-of-range ids included.
    def run():
        c = pj.PagedKVCache.create(L, N, P, K, D, dtype=jnp.dtype(dtype))
        c = c.write(0, *_kv(1, 4), jnp.array([5, -1, N * P + 2, 17], jnp.int32))
        c = c.write(1, *_kv(2, 1), jnp.array([9], jnp.int32))
        c = c.write(1, *_kv(3, 3), jnp.array([18, 19, 9], jnp.int32))  # slot 9 again
        c = c.copy_pages(jnp.array([1, 2, 99], jnp.int32), jnp.array([3, N + 1, 4], jnp.int32))
        pages = c.read_pages(jnp.array([4, 1, -2], jnp.int32))
        scales = c.read_page_scales(jnp.array([4, 1, -2], jnp.int32)) if c.quantized else None
        c = c.write_pages(jnp.array([6, 7, -1], jnp.int32), pages, scales)
        return [np.asarray(a) for a in (c.kv_pages, c.kv_scales, pages) if a is not None]

    got = run()
    monkeypatch.setenv("PAGED_JAX_BACKEND", "xla")
    want = run()
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))
    assert got[0].view(np.uint8).any()  # something was written


@pytest.mark.skipif(not linear.available(), reason="the CPU kernels did not build here")
def test_a_bf16_step_never_widens_the_pool():
    # XLA:CPU's scatter and gather of a bf16 pool convert all of it to f32 and back: in a
    # compiled step with the CPU kernels, no op makes a pool-sized f32 array.
    cache = pj.PagedKVCache.create(L, 512, P, K, D, dtype=jnp.bfloat16)

    def step(c):
        c = c.copy_pages(jnp.array([1], jnp.int32), jnp.array([2], jnp.int32))
        return c.write(0, *_kv(4, 3), jnp.array([5, 6, 7], jnp.int32))

    hlo = _donating(step).lower(cache).compile().as_text()
    pool = ",".join(map(str, cache.kv_pages.shape))
    assert f"f32[{pool}]" not in hlo


def test_one_row_write_lands_in_its_slot_only():
    c = _cache()
    k, v = _kv(8, 1)
    out = np.array(jax.jit(lambda c: c.write(1, k, v, jnp.array([9], jnp.int32)))(c).kv_pages)
    np.testing.assert_array_equal(out[1, 9 // P, 9 % P], np.stack([k[0], v[0]], 1).reshape(-1, D))
    out[1, 9 // P, 9 % P] = 0
    assert not out.any()


def test_donated_quantized_write_pages_in_place():
    cache = pj.PagedKVCache.create(L, 512, P, K, D, dtype=jnp.int8)

    def op(c):
        return c.write_pages(
            jnp.array([2], jnp.int32),
            jnp.ones((L, 1, P, 2 * K, D), jnp.int8),
            jnp.ones((L, 1, P, 2 * K), jnp.float32),
        )

    stats = _donating(op).lower(cache).compile().memory_analysis()
    assert stats.alias_size_in_bytes >= cache.nbytes
    assert stats.temp_size_in_bytes < cache.kv_pages.nbytes / 8


@pytest.mark.parametrize("dtype,rel", [("int8", 1 / 127), ("float8_e4m3fn", 1 / 16)])
def test_quantized_write_dequantizes_within_format_precision(dtype, rel):
    c = _cache(jnp.dtype(dtype))
    k, v = _kv(5, 4)
    c = c.write(0, k, v, jnp.array([4, 5, 6, 7], jnp.int32))
    kv, k_scale, v_scale = c.layer(0)
    assert k_scale.shape == (N, P, K) and v_scale.shape == (N, P, K)
    k_back = kv[1, :, 0::2].astype(jnp.float32) * k_scale[1][..., None]
    v_back = kv[1, :, 1::2].astype(jnp.float32) * v_scale[1][..., None]
    # Per-row error bound: half a quantization step (int8) or fp8's relative precision,
    # both relative to the row's largest magnitude.
    for orig, back in ((k, k_back), (v, v_back)):
        amax = np.abs(np.asarray(orig)).max(-1, keepdims=True)
        assert (np.abs(np.asarray(back) - np.asarray(orig)) <= rel * amax + 1e-7).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_attention_inputs_view_reads_the_same_pages_as_the_layer_slice(dtype):
    # Every layer through the flat view (pool reshaped to [L * N, ...], tables shifted by
    # layer * N) attends exactly as through the layer's own slice; a traced layer works.
    rng = np.random.default_rng(3)
    c = _cache(jnp.dtype(dtype))
    table = jnp.asarray(rng.permutation(np.arange(1, N))[:4].reshape(1, 4).astype(np.int32))
    n = 3 * P + 2
    pos = np.arange(n)
    slots = jnp.asarray((np.asarray(table)[0, pos // P] * P + pos % P).astype(np.int32))
    for layer in range(L):
        k, v = _kv(layer + 10, n)
        c = c.write(layer, k, v, slots)
    q = jnp.asarray(rng.standard_normal((2, 4, D)), jnp.float32)
    args = (jnp.array([n], jnp.int32),)
    for layer in range(L):
        kv_l, ks_l, vs_l = c.layer(layer)
        ref = pj.paged_attention(q[:1], kv_l, *args, table, k_scale=ks_l, v_scale=vs_l)
        kv, t, ks, vs = c.attention_inputs(layer, table)
        if c.quantized:  # scales are interleaved per layer: the slice is returned
            assert kv.shape == kv_l.shape and t is table
        else:
            assert kv.shape == (L * N, P, 2 * K, D)
            np.testing.assert_array_equal(np.asarray(t), np.asarray(table) + layer * N)
        out = pj.paged_attention(q[:1], kv, *args, t, k_scale=ks, v_scale=vs)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
        traced = jax.jit(lambda c, i: c.attention_inputs(i, table)[:2])(c, jnp.int32(layer))
        np.testing.assert_array_equal(np.asarray(traced[1]), np.asarray(t))


# ---------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "kwargs,exc,msg",
    [
        (dict(num_pages=1), ValueError, "num_pages: expected >= 2, got 1"),
        (dict(page_size=0), ValueError, "page_size: expected >= 1, got 0"),
        (dict(head_dim=8.0), TypeError, "head_dim: expected a Python int, got float"),
        (dict(dtype=jnp.int32), TypeError, "dtype: expected one of .*, got int32"),
    ],
)
def test_create_errors(kwargs, exc, msg):
    args = dict(num_layers=L, num_pages=N, page_size=P, num_kv_heads=K, head_dim=D) | kwargs
    with pytest.raises(exc, match=msg):
        pj.PagedKVCache.create(**args)


def test_constructor_checks_shapes_and_scales():
    with pytest.raises(ValueError, match=r"kv_pages: expected shape .* got \(2, 9, 4, 4\)"):
        pj.PagedKVCache(jnp.zeros((2, 9, 4, 4)), None, L, P, K, D)
    with pytest.raises(ValueError, match="kv_scales: required for a int8 cache"):
        pj.PagedKVCache(jnp.zeros((L, N, P, 2 * K, D), jnp.int8), None, L, P, K, D)
    with pytest.raises(ValueError, match="kv_scales: only allowed for int8/fp8 caches"):
        pj.PagedKVCache(jnp.zeros((L, N, P, 2 * K, D)), jnp.ones((L, N, P, 2 * K)), L, P, K, D)


def test_write_errors():
    c = _cache()
    k, v = _kv(6, 3)
    slots = jnp.array([4, 5, 6], jnp.int32)
    with pytest.raises(
        ValueError,
        match=r"k: expected shape \[T, num_kv_heads=2, head_dim=8\], "
        r"got \(3, 2, 4\)",
    ):
        c.write(0, k[..., :4], v, slots)
    with pytest.raises(
        ValueError, match=r"v: expected shape \(3, 2, 8\) \(as k\), got \(2, 2, 8\)"
    ):
        c.write(0, k, v[:2], slots)
    with pytest.raises(TypeError, match="slot_mapping: expected dtype int32, got int64|float32"):
        c.write(0, k, v, slots.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"slot_mapping: expected shape \[3\]"):
        c.write(0, k, v, slots[:2])
    with pytest.raises(ValueError, match="layer: expected 0 <= layer < 2, got 2"):
        c.write(2, k, v, slots)
    with pytest.raises(TypeError, match="k: expected a floating dtype, got int32"):
        c.write(0, k.astype(jnp.int32), v, slots)


def test_copy_and_swap_errors():
    c = _cache()
    with pytest.raises(ValueError, match=r"dst: expected shape \(2,\) \(as src\)"):
        c.copy_pages(jnp.array([1, 2], jnp.int32), jnp.array([3], jnp.int32))
    with pytest.raises(ValueError, match=r"data: expected shape \(2, 1, 4, 4, 8\)"):
        c.write_pages(jnp.array([1], jnp.int32), jnp.zeros((2, 2, P, 2 * K, D)))
    with pytest.raises(TypeError, match="data: expected dtype float32 .*, got bfloat16"):
        c.write_pages(jnp.array([1], jnp.int32), jnp.zeros((2, 1, P, 2 * K, D), jnp.bfloat16))
    with pytest.raises(ValueError, match="read_page_scales: the cache is float32"):
        c.read_page_scales(jnp.array([1], jnp.int32))
    with pytest.raises(ValueError, match="pages: expected an int32 array of rank 1"):
        c.read_pages(jnp.array([[1]], jnp.int32))


def test_validate_slot_mapping_errors():
    c = _cache()
    with pytest.raises(ValueError, match=r"slot_mapping: slots must lie in \[0, 36\), got 36"):
        c.validate_slot_mapping(np.array([4, 36]))
    with pytest.raises(ValueError, match="slot_mapping: slot 9 is written twice"):
        c.validate_slot_mapping(np.array([9, 0, 9]))
    c.validate_slot_mapping(np.array([0, 0, 1, 9]))  # repeated null-page slots are fine


@given(
    ids=st.lists(
        st.one_of(st.integers(-(2**31), -1), st.integers(N, 2**31 - 1), st.integers(1, N - 1)),
        min_size=1,
        max_size=6,
    )
)
def test_page_ops_never_wrap_out_of_range_ids(ids):
    # Writes to ids outside [0, N) are dropped; reads of them read the null page; valid
    # ids still work (the issue: -1 overwrote the last page, a live one).
    rng = np.random.default_rng(len(ids))
    c = pj.PagedKVCache(
        jnp.asarray(rng.standard_normal((L, N, P, 2 * K, D)), jnp.float32), None, L, P, K, D
    )
    before = np.asarray(c.kv_pages)
    pages = jnp.asarray(ids, jnp.int32)
    valid = np.array([0 <= i < N for i in ids])
    read = np.asarray(c.read_pages(pages))
    for j, i in enumerate(ids):
        np.testing.assert_array_equal(read[:, j], before[:, i if valid[j] else 0])
    data = jnp.full((L, len(ids), P, 2 * K, D), 7.0, jnp.float32)
    after = np.asarray(c.write_pages(pages, data).kv_pages)
    touched = sorted({i for i in ids if 0 <= i < N})
    untouched = [p for p in range(N) if p not in touched]
    np.testing.assert_array_equal(after[:, untouched], before[:, untouched])
    assert (after[:, touched] == 7.0).all()
    # copy_pages: an invalid source reads the null page, an invalid destination is dropped.
    dst = jnp.asarray([N - 1] * len(ids), jnp.int32).at[0].set(pages[0])
    copied = np.asarray(c.copy_pages(pages[:1], dst[:1]).kv_pages)
    if valid[0]:
        np.testing.assert_array_equal(copied[:, ids[0]], before[:, ids[0]])
    else:
        np.testing.assert_array_equal(copied, before)  # dropped: the pool is unchanged
    last = np.asarray(c.copy_pages(pages[:1], jnp.asarray([N - 1], jnp.int32)).kv_pages)
    np.testing.assert_array_equal(last[:, N - 1], before[:, ids[0] if valid[0] else 0])
