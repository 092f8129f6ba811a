"""The CPU kernels' matrix product on packed weights (``paged_jax.kernels.cpu.linear``,
``paged_jax.linear``) against numpy's f64 product.

Built like the decode kernel, on first use with the machine's C compiler; without one the
tests that run it are skipped, saying so, and the model keeps XLA's products (checked
here everywhere).
"""

import concurrent.futures
import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_cases import HAS_CC

from paged_jax import linear
from paged_jax.kernels import cpu
from paged_jax.models import TINY_LLAMA, init_model

needs_cc = pytest.mark.skipif(not HAS_CC, reason="no C compiler here: products stay on XLA")


def _data(seed, m, k, n):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    return x, w


def _product(x, w, threads=None):
    packed = cpu.pack_weight(jnp.asarray(w))
    f = jax.jit(lambda x, p: cpu.linear(x, p, w.shape[1], threads=threads))
    return np.asarray(f(jnp.asarray(x), packed))


@needs_cc
def test_panel_width_is_three_registers():
    assert cpu.panel_width() in (12, 24, 48)
    assert linear.available()


@needs_cc
@pytest.mark.parametrize(
    "m,k,n",
    # rows: none, one, tails of 8-row tiles, past a 64-row block; columns: a partial
    # panel, exactly one (NR = 48, 24 or 12), one and a column, several and a part
    list(itertools.product([1, 7, 9, 70], [1, 64, 130], [1, 47, 48, 49, 149]))[::3]
    + [(0, 8, 16), (8, 0, 16), (37, 576, 192)],
)
def test_matches_the_f64_product(m, k, n):
    x, w = _data(m * 1000 + k * 10 + n, m, k, n)
    y = _product(x, w)
    assert y.shape == (m, n) and y.dtype == np.float32
    ref = x.astype(np.float64) @ w.astype(np.float64)
    # one f32 sum over K: at most about K ulps of the sum of magnitudes
    bound = 2 * max(k, 1) * np.finfo(np.float32).eps * (np.abs(x) @ np.abs(w)) + 1e-30
    assert (np.abs(y - ref) <= bound).all(), np.abs(y - ref).max()


@needs_cc
def test_rows_do_not_depend_on_the_batch_or_threads():
    # Enough products for several threads (at least 2**20 each): 32 x 576 x 7 panels. The
    # jobs past the first go to XLA's thread pool, kept busy by four Python threads.
    x, w = _data(1, 32, 576, 300)
    one = _product(x, w, threads=1)
    assert 32 * 576 * cpu.pack_weight(jnp.asarray(w)).shape[0] * cpu.panel_width() >= 3 * 2**20
    for threads in (2, 3):
        np.testing.assert_array_equal(_product(x, w, threads), one)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for out in pool.map(lambda t: _product(x, w, t), [2, 3] * 4):
            np.testing.assert_array_equal(out, one)
    np.testing.assert_array_equal(_product(x[5:6], w), one[5:6])  # a row alone
    np.testing.assert_array_equal(_product(x[3:20], w), one[3:20])


@needs_cc
def test_rows_computes_the_first_rows_and_zeroes_the_rest():
    """``rows`` (static or traced) computes rows [0, rows), bitwise as without it, and
    writes 0 to the others; a value
    outside [0, M] computes every row."""
    x, w = _data(7, 21, 64, 100)
    packed = cpu.pack_weight(jnp.asarray(w))
    full = _product(x, w)
    f = jax.jit(lambda x, p, r: cpu.linear(x, p, 100, rows=r))
    for r in (0, 1, 8, 13, 21):
        y = np.asarray(f(jnp.asarray(x), packed, jnp.int32(r)))
        np.testing.assert_array_equal(y[:r], full[:r])
        np.testing.assert_array_equal(y[r:], 0.0)
    for r in (-1, 22, 10**6):
        np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x), packed, jnp.int32(r))), full)
    y = np.asarray(cpu.linear(jnp.asarray(x).reshape(3, 7, 64), packed, 100, rows=9))
    np.testing.assert_array_equal(y.reshape(21, 100)[:9], full[:9])  # rows of the flattening
    np.testing.assert_array_equal(y.reshape(21, 100)[9:], 0.0)


@needs_cc
def test_packing_is_panels_of_columns_and_unpacks_exactly():
    nr = cpu.panel_width()
    x, w = _data(2, 1, 5, 2 * nr + 3)
    packed = np.asarray(linear.pack(jnp.asarray(w)))
    assert packed.shape == (3, 5, nr)
    np.testing.assert_array_equal(packed[1, :, 2], w[:, nr + 2])
    np.testing.assert_array_equal(packed[2, :, 3:], 0.0)  # past column N
    np.testing.assert_array_equal(np.asarray(linear.unpack(jnp.asarray(packed), w.shape[1])), w)
    np.testing.assert_array_equal(np.asarray(jax.jit(linear.pack)(w)), packed)  # traced: jnp
    y = jax.jit(lambda x, p: linear.matmul(x, p, w.shape[1]))(x.reshape(1, 1, 5), packed)
    assert y.shape == (1, 1, w.shape[1])  # leading dimensions kept


@needs_cc
def test_boundary_errors():
    nr = cpu.panel_width()
    x, w = _data(3, 4, 8, 20)
    packed = cpu.pack_weight(jnp.asarray(w))
    with pytest.raises(ValueError, match=r"x, packed: expected float32, got bfloat16"):
        cpu.linear(jnp.asarray(x, jnp.bfloat16), packed, 20)
    with pytest.raises(
        ValueError, match=rf"packed: expected \[\(L,\) P, K, {nr}\], got \[1, 8, 20\]"
    ):
        cpu.linear(x, jnp.asarray(w)[None], 20)
    with pytest.raises(ValueError, match=r"x: expected \[\.\.\., 8\]"):
        cpu.linear(x[:, :7], packed, 20)
    p = packed.shape[0]  # 1 panel of 48 or 2 of 12 or 24 hold the 20 columns
    with pytest.raises(
        ValueError, match=rf"n: expected an int in \({(p - 1) * nr}, {p * nr}\], got {p * nr + 1}"
    ):
        cpu.linear(x, packed, p * nr + 1)
    with pytest.raises(ValueError, match="threads: expected a positive int"):
        cpu.linear(x, packed, 20, threads=0)
    with pytest.raises(ValueError, match=r"layer: expected an int in \[0, 1\), got 1"):
        cpu.linear(x, packed, 20, layer=1)  # one weight, not a stack
    with pytest.raises(
        ValueError,
        match=r"w: expected a \[K, N\] or \[L, K, N\] float32, float16, int8, uint8 or "
        r"bfloat16 array, got int16",
    ):
        cpu.pack_weight(jnp.asarray(w, jnp.int16))


@needs_cc
@pytest.mark.parametrize("layers, k, n, rows", [(None, 100, 37, None), (3, 576, 96, 5)])
def test_bf16_weights_multiply_rows_rounded_to_bf16(layers, k, n, rows):
    # bf16 weights (fp8 ones are held so) by rows rounded to bf16, each product exact in
    # f32: the f64 reference within the f32 sums' rounding, with and without column
    # scales, a stack read by index, rows past `rows` zero; K = 100 leaves a tail
    # past the vector conversion's 32. Packing unpacks exactly and looks columns up.
    import ml_dtypes

    rng = np.random.default_rng(5)
    lead = () if layers is None else (layers,)
    w = rng.standard_normal((*lead, k, n)).astype(ml_dtypes.bfloat16)
    x = rng.standard_normal((2, 9, k)).astype(np.float32)
    scales = rng.uniform(0.5, 2.0, (*lead, n)).astype(np.float32)
    packed = cpu.pack_weight(jnp.asarray(w))
    assert packed.dtype == jnp.bfloat16 and packed.shape[-2:] == (k, cpu.panel_width())
    np.testing.assert_array_equal(
        np.asarray(cpu.unpack_weight(packed, n)).astype(np.float32), w.astype(np.float32)
    )
    layer = None if layers is None else layers - 1
    pick = (lambda a: a) if layers is None else (lambda a: a[layer])
    if layers is None:
        ids = jnp.asarray([[0, n - 1], [3, 3]])
        got = np.asarray(cpu.packed_columns(packed, ids)).astype(np.float32)
        np.testing.assert_array_equal(got, np.moveaxis(w.astype(np.float32)[:, ids], 0, -1))
    for sc in (None, scales):
        got = cpu.linear(
            jnp.asarray(x), packed, n, layer=layer, rows=rows,
            scales=None if sc is None else cpu.pack_scales(jnp.asarray(sc)),
        )  # fmt: skip
        want = cpu.reference_bf16(x.reshape(18, k), pick(w), None if sc is None else pick(sc))
        if rows is not None:
            want[rows:] = 0.0
        np.testing.assert_allclose(
            np.asarray(got).reshape(18, n), want, rtol=0, atol=1e-5 * np.abs(want).max()
        )
        # rounding the rows matters: the f32 rows' product is further off than that
        exact = x.reshape(18, k).astype(np.float64) @ pick(w).astype(np.float64)
        if sc is not None:
            exact = exact * pick(sc)
        if rows is not None:
            exact[rows:] = 0.0
        assert np.abs(exact - want).max() > 1e-4 * np.abs(want).max()
    with pytest.raises(ValueError, match="mins: bf16 weights take none"):
        cpu.linear(jnp.asarray(x), packed, n, layer=layer, mins=jnp.zeros(3))
    with pytest.raises(ValueError, match="scales: expected float32"):
        cpu.linear(jnp.asarray(x), packed, n, layer=layer, scales=jnp.zeros(3))
    with pytest.raises(ValueError, match="w: bf16 weights need K even"):
        cpu.pack_weight(jnp.zeros((5, 4), jnp.bfloat16))


def test_without_the_kernels_the_model_keeps_xla_products(monkeypatch):
    monkeypatch.setattr(cpu.build, "_state", {"ok": False, "why": "no C compiler", "lib": None})
    assert not linear.available()
    with pytest.raises(ValueError, match="not available: no C compiler"):
        linear.pack(jnp.zeros((2, 3)))
    model = init_model(TINY_LLAMA, seed=0).hold_for_cpu()
    assert not model.layers.mlp.up_proj.packed
    assert isinstance(model.layers.mlp.up_proj.kernel.get_value(), tuple)  # still split


@needs_cc
def test_a_padded_step_computes_its_real_tokens_only(monkeypatch):
    """The model hands its layers' packed products the step's real token count (the
    tokens past ``cu_q_lens[num_seqs]`` are padding up to the bucket): the real rows'
    logits are those of the step without padding."""
    from paged_jax import AttentionMetadata
    from paged_jax.models import llama

    model = init_model(TINY_LLAMA, seed=5).hold_for_cpu()
    assert model.layers.mlp.gate_up_proj.packed
    limited, real = [], linear.matmul

    def spy(x, packed, n, layer=None, rows=None, scales=None, mins=None, rotated=False):
        limited.append(rows is not None)
        return real(x, packed, n, layer, rows, scales=scales, mins=mins, rotated=rotated)

    monkeypatch.setattr(llama.linear, "matmul", spy)
    ids = list(range(3, 40))
    n = len(ids)

    def logits(pad):
        md = AttentionMetadata.prefill(n, [*range(8, 8 + n), *[0] * pad], [1, 2, 3, 4, 5])
        tokens = jnp.asarray(ids + [0] * pad, jnp.int32)
        positions = jnp.asarray([*range(n), *[0] * pad], jnp.int32)
        step = jax.jit(lambda t, p, c: model(t, p, c, md)[0])
        return np.asarray(step(tokens, positions, model.make_cache(16, 8)))

    alone = logits(0)
    limited.clear()
    padded = logits(27)
    np.testing.assert_allclose(padded, alone, rtol=1e-6, atol=1e-6)
    assert limited.count(True) == 4, limited  # the layer body's 4 products (fused), traced once


@needs_cc
def test_a_stack_of_weights_is_read_by_index():
    # [L, K, N] packed weight by weight; a traced index picks one in place (as each layer's
    # product does in the model's scan), bitwise the product with that weight alone.
    rng = np.random.default_rng(4)
    stack = rng.standard_normal((3, 64, 100)).astype(np.float32)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    packed = linear.pack(jnp.asarray(stack))
    assert packed.shape[:2] == (3, -(-100 // cpu.panel_width()))
    np.testing.assert_array_equal(np.asarray(linear.unpack(packed, 100)), stack)

    def body(carry, i):
        return carry, linear.matmul(x, packed, 100, i)

    _, ys = jax.jit(lambda: jax.lax.scan(body, 0, jnp.arange(3, dtype=jnp.int32)))()
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(ys[i]), _product(x, stack[i]))
        np.testing.assert_array_equal(np.asarray(linear.matmul(x, packed, 100, i)), ys[i])
    with pytest.raises(ValueError, match=r"layer: expected an index into packed's 3 weights"):
        linear.matmul(x, packed, 100)
    with pytest.raises(ValueError, match=r"layer: expected an int in \[0, 3\), got 3"):
        linear.matmul(x, packed, 100, 3)
    with pytest.raises(Exception, match="weight index out of range"):  # traced: the kernel's
        jax.block_until_ready(jax.jit(lambda i: linear.matmul(x, packed, 100, i))(jnp.int32(5)))


@needs_cc
def test_backend_xla_keeps_the_products_on_xla(monkeypatch):
    monkeypatch.setenv("PAGED_JAX_BACKEND", "xla")
    assert not linear.available()
    assert not init_model(TINY_LLAMA, seed=0).hold_for_cpu().layers.mlp.up_proj.packed
    monkeypatch.delenv("PAGED_JAX_BACKEND")
    assert init_model(TINY_LLAMA, seed=0).hold_for_cpu().layers.mlp.gate_up_proj.packed


@needs_cc
def test_f32_and_bf16_models_are_packed_with_their_own_weights():
    # f32 compute on bf16 weights: XLA's products (packing would round f32 rows to bf16),
    # split per layer as before. bf16 compute on bf16 weights: packed as bf16 (the
    # kernel's rounding of bf16 rows is exact), the tied table too, and the logits near
    # XLA's (bf16 outputs: their rounding apart).
    from paged_jax.metadata import AttentionMetadata

    model = init_model(TINY_LLAMA, seed=0, dtype=jnp.float32, param_dtype=jnp.bfloat16)
    up = model.hold_for_cpu().layers.mlp.up_proj
    assert not up.packed and isinstance(up.kernel.get_value(), tuple)
    if not linear.available():
        return

    def logits(cfg, pack):
        model = init_model(cfg, seed=0, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
        model.hold_for_cpu(pack=pack)
        ids = jnp.arange(3, 20, dtype=jnp.int32)
        md = AttentionMetadata.prefill(
            len(ids), 8 + np.arange(len(ids)), [1, 2, 3], logits_all=True
        )
        out, _ = model(ids, jnp.arange(len(ids), dtype=jnp.int32), model.make_cache(8, 8), md)
        return model, np.asarray(out, np.float32)

    tied = dataclasses.replace(TINY_LLAMA, tie_word_embeddings=True)
    for cfg in (TINY_LLAMA, tied):
        packed, got = logits(cfg, None)  # the default
        gate_up = packed.layers.mlp.gate_up_proj
        assert gate_up.packed and gate_up.kernel.get_value().dtype == jnp.bfloat16
        if cfg is tied:
            head = packed.embed_tokens
            assert head.packed and head.embedding.get_value().dtype == jnp.bfloat16
        else:
            head = packed.lm_head
            assert head.packed and head.kernel.get_value().dtype == jnp.bfloat16
        _, want = logits(cfg, False)
        assert got.shape == want.shape == (17, cfg.vocab_size)
        assert np.abs(got - want).max() <= 0.03 * np.abs(want).max()
        assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


@needs_cc
def test_packed_embedding_looks_up_the_same_rows():
    from flax import nnx

    from paged_jax.models.layers import Embed

    emb = Embed(101, 8, rngs=nnx.Rngs(0))  # 101: a last, partial panel
    ids = jnp.asarray([[3, 0, 100], [48, 47, 1]], jnp.int32)  # any leading shape
    x = jax.random.normal(jax.random.key(1), (4, 8))
    rows, logits, table = emb(ids), emb.attend(x), emb.table()
    assert emb.hold_packed() is emb and emb.hold_packed().packed and not emb.transposed
    assert emb.embedding.get_value().shape == (-(-101 // cpu.panel_width()), 8, cpu.panel_width())
    np.testing.assert_array_equal(emb(ids), rows)
    np.testing.assert_allclose(emb.attend(x), logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(emb.table(), table)  # [V, E], however it lies
    with pytest.raises(TypeError, match="inputs"):
        emb(ids.astype(jnp.float32))


@needs_cc
def test_splitting_a_packed_model_leaves_its_stacks_whole():
    model = init_model(TINY_LLAMA, seed=0).hold_for_cpu()
    kernel = model.layers.mlp.gate_up_proj.kernel.get_value()
    assert model.split_layer_weights().layers.mlp.gate_up_proj.kernel.get_value() is kernel


@needs_cc
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_grouped_rows_are_each_group_s_plain_product(dtype):
    """linear.c's grouped product (a mixture's experts): group g's rows by weight first + g,
    bit for bit each row as the plain product computes it alone; rows past the groups 0;
    a group of no rows, and rows choosing none of a stack's weights."""
    rng = np.random.default_rng(3)
    W, K, N = 7, 40, 2 * cpu.panel_width() + 5
    w = jnp.asarray(rng.normal(size=(W, K, N)).astype(np.float32)).astype(dtype)
    packed = cpu.pack_weight(w)
    sizes = np.array([2, 0, 5, 1], np.int32)
    x = rng.normal(size=(11, K)).astype(np.float32)
    for first in (0, 3):
        y = np.asarray(
            jax.jit(lambda x, s, f: cpu.grouped_linear(x, packed, N, s, f))(
                jnp.asarray(x), jnp.asarray(sizes), jnp.int32(first)
            )
        )
        row = 0
        for g, n in enumerate(sizes):
            if n:
                alone = cpu.linear(jnp.asarray(x[row : row + n]), packed, N, layer=first + g)
                np.testing.assert_array_equal(y[row : row + n], np.asarray(alone))
            row += n
        assert not y[row:].any()


@needs_cc
@pytest.mark.parametrize("group", [32, 8])
def test_grouped_int8_rows_are_each_group_s_plain_product(group):
    """int8 weights with scales per group of inputs (a mixture's quantized experts): each
    row bit for bit the plain int8 product by its group's weight (the rows quantized in
    blocks of the group, W8A8), and near the float product of the weights' values."""
    rng = np.random.default_rng(5)
    W, K, N = 5, 64, cpu.panel_width() + 3
    q = rng.integers(-127, 128, (W, K, N)).astype(np.int8)
    sc = (rng.uniform(0.5, 2, (W, K // group, N)) / 127).astype(np.float32)
    packed, scales = cpu.pack_weight(jnp.asarray(q)), cpu.pack_weight(jnp.asarray(sc))
    sizes = np.array([3, 0, 1, 4], np.int32)
    x = rng.normal(size=(10, K)).astype(np.float32)
    y = np.asarray(
        jax.jit(lambda x, s: cpu.grouped_linear(x, packed, N, s, 1, scales=scales))(
            jnp.asarray(x), jnp.asarray(sizes)
        )
    )
    row = 0
    for g, n in enumerate(sizes):
        if n:
            alone = cpu.linear(jnp.asarray(x[row : row + n]), packed, N, layer=1 + g, scales=scales)
            np.testing.assert_array_equal(y[row : row + n], np.asarray(alone))
            w = q[1 + g].astype(np.float64) * np.repeat(sc[1 + g], group, axis=0)
            want = x[row : row + n].astype(np.float64) @ w
            np.testing.assert_allclose(
                y[row : row + n], want, rtol=0.03, atol=0.03 * np.abs(want).max()
            )
        row += n
    assert not y[row:].any()
    with pytest.raises(ValueError, match="scales: int8 weights need f32"):
        cpu.grouped_linear(jnp.asarray(x), packed, N, jnp.asarray(sizes))
    with pytest.raises(ValueError, match="scales, mins: only int8 and 4-bit weights take them"):
        cpu.grouped_linear(
            jnp.asarray(x), cpu.pack_weight(jnp.ones((3, K, N), jnp.float32)), N,
            jnp.asarray(sizes[:2]), scales=scales,
        )  # fmt: skip


@needs_cc
def test_grouped_4_bit_rows_are_each_group_s_plain_product():
    """4-bit weights with a scale and a minimum per group of 32 inputs (a mixture's int4
    experts): each row bit for bit the plain 4-bit product by its group's weight."""
    from paged_jax.models.quantization import quantize_int4

    rng = np.random.default_rng(6)
    W, K, N = 4, 64, cpu.panel_width() + 7
    q, sc, mn = quantize_int4(rng.normal(size=(W, K, N)).astype(np.float32), axis=-2)
    packed = cpu.pack_weight(jnp.asarray(q))
    scales, mins = cpu.pack_weight(jnp.asarray(sc)), cpu.pack_weight(jnp.asarray(mn))
    sizes = np.array([2, 3, 0, 4], np.int32)
    x = rng.normal(size=(12, K)).astype(np.float32)
    y = np.asarray(cpu.grouped_linear(jnp.asarray(x), packed, N, jnp.asarray(sizes), 0,
                                      scales=scales, mins=mins))  # fmt: skip
    row = 0
    for g, n in enumerate(sizes):
        if n:
            alone = cpu.linear(
                jnp.asarray(x[row : row + n]), packed, N, layer=g, scales=scales, mins=mins
            )
            np.testing.assert_array_equal(y[row : row + n], np.asarray(alone))
        row += n
    assert not y[row:].any()
    with pytest.raises(ValueError, match="mins: uint8 weights need f32"):
        cpu.grouped_linear(jnp.asarray(x), packed, N, jnp.asarray(sizes), scales=scales)


@needs_cc
def test_grouped_product_boundary_errors():
    packed = cpu.pack_weight(jnp.ones((3, 8, 10), jnp.float32))
    x = jnp.ones((4, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"first: expected an int in \[0, 1\]"):
        cpu.grouped_linear(x, packed, 10, jnp.asarray([1, 1], jnp.int32), 2)
    with pytest.raises(ValueError, match=r"x: expected \[M, 8\]"):
        cpu.grouped_linear(jnp.ones((4, 9)), packed, 10, jnp.asarray([1], jnp.int32))
    with pytest.raises(ValueError, match="n: expected an int in"):
        cpu.grouped_linear(x, packed, 100, jnp.asarray([1], jnp.int32))
    with pytest.raises(Exception, match="the groups hold more rows than x"):
        jax.block_until_ready(cpu.grouped_linear(x, packed, 10, jnp.asarray([3, 2], jnp.int32)))
    with pytest.raises(Exception, match="out of range"):
        jax.block_until_ready(
            jax.jit(lambda f: cpu.grouped_linear(x, packed, 10, jnp.asarray([1, 1], jnp.int32), f))(
                jnp.int32(2)
            )
        )
