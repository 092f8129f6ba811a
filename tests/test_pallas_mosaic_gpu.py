"""The Mosaic GPU (Hopper) decode kernel against the reference and the f64 oracle.

Off a GPU it runs under Mosaic GPU's interpret mode, which simulates shared memory, the
TMA copies and their barriers, and wgmma. That interpreter takes transposed wgmma operands
from JAX 0.11 on (the GPU machines' JAX and ``.ci/jax011``); with JAX 0.10 those tests
skip and only the lowering and argument checks run. On an H100 or H200 the same tests run
the compiled kernel. The lowering tests lower for CUDA on any machine (no GPU needed):
that is where Mosaic GPU checks layouts, tilings and copy sizes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_cases import assert_close_to_oracle, covering_sample, kernel_case, make_case

import paged_jax as pj
from paged_jax.kernels.gpu import decode_mosaic
from paged_jax.kernels.gpu import decode_paged_attention as triton_decode

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
runs = pytest.mark.skipif(
    INTERPRET and jax.__version_info__ < (0, 11),
    reason="JAX < 0.11: Mosaic GPU's interpreter takes no transposed wgmma operand "
    "(.ci/jax011 and GPU machines run this)",
)
DECODE_BATCH = [(1, 1), (1, 16), (1, 17), (1, 64), (1, 100)]
OPTIONS = {
    "plain": {},
    "softcap": dict(soft_cap=2.5),
    "window": dict(sliding_window=21),
    "both": dict(sliding_window=70, soft_cap=4.0),
}
GRID = covering_sample(
    [
        (page, heads, d, dtype, opt)
        for page in (8, 16, 32)
        for heads in ((4, 4), (8, 2), (8, 1))
        for d in (64, 128)
        for dtype in ("bfloat16", "float16")
        for opt in OPTIONS
    ],
    4,
    seed=21,
)


def _id(p):
    return f"P{p[0]}-H{p[1][0]}K{p[1][1]}-D{p[2]}-{p[3]}-{p[4]}"


def _decode_args(case):
    """The case's decode inputs plus a padding row: kv_len 0, NaN query, table on page 0."""
    q = jnp.concatenate([case.q, jnp.full((1,) + case.q.shape[1:], jnp.nan, case.q.dtype)])
    lens = jnp.concatenate([case.kv_lens, jnp.zeros(1, jnp.int32)])
    table = jnp.concatenate([case.page_indices, case.page_indices[:1] * 0])
    return q, case.kv_pages, lens, table


def _bf16_decode(seed, lens, *, heads=(8, 2), head_dim=64, page_size=16):
    """A bf16 decode case (one query token per sequence of ``lens`` tokens), no padding
    rows: ``(case, (q, kv_pages, kv_lens, page_indices))``."""
    case = make_case(
        seed,
        [(1, n) for n in lens],
        page_size=page_size,
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        dtype=jnp.dtype(jnp.bfloat16),
        pad_seqs=0,
        pad_tokens=0,
    )
    return case, (case.q, case.kv_pages, case.kv_lens, case.page_indices)


@runs
@pytest.mark.parametrize("params", GRID, ids=_id)
def test_decode_kernel(params):
    page, heads, d, dtype, opt = params
    # Unwritten slots, unused pages and page 0 hold NaN: a kernel that reads one fails.
    case = kernel_case(
        31, DECODE_BATCH, page, heads, d, dtype, pad_seqs=0, pad_tokens=0, **OPTIONS[opt]
    )
    args = _decode_args(case)
    kw = dict(sm_scale=d**-0.5, **OPTIONS[opt])
    out = decode_mosaic.decode_paged_attention(*args, interpret=INTERPRET, num_splits=2, **kw)
    assert out.dtype == case.q.dtype and out.shape == args[0].shape
    np.testing.assert_array_equal(np.asarray(out[-1], np.float32), 0.0)
    ref = pj.reference.paged_attention(*args, **kw)
    assert_close_to_oracle(out[:-1], ref[:-1], case.expected, what=_id(params))


@runs
@pytest.mark.parametrize(
    "splits,stages,pages_per_block",
    [(1, 1, 4), (3, 2, 8), pytest.param(1, 3, 4, marks=pytest.mark.slow)],
)
def test_splits_stages_and_blocks(splits, stages, pages_per_block):
    # More blocks than buffers (the ring refills), splits that end mid-sequence or hold
    # nothing, blocks of 64 and 128 tokens.
    case, args = _bf16_decode(32, (1, 63, 64, 65, 300), heads=(4, 2))
    out = decode_mosaic.decode_paged_attention(
        *args,
        sm_scale=0.125,
        interpret=INTERPRET,
        num_splits=splits,
        num_stages=stages,
        pages_per_block=pages_per_block,
    )
    ref = pj.reference.paged_attention(*args, sm_scale=0.125)
    assert_close_to_oracle(out, ref, case.expected)


@runs
def test_matches_the_triton_kernel_and_takes_per_tensor_scales():
    _, args = _bf16_decode(33, (5, 40, 129))
    kw = dict(sm_scale=0.125, k_scale=0.5, v_scale=2.0)
    out = decode_mosaic.decode_paged_attention(*args, interpret=INTERPRET, **kw)
    tri = triton_decode(*args, interpret=INTERPRET, **kw)
    ref = pj.reference.paged_attention(*args, **kw)
    a, t, r = (np.asarray(x, np.float32) for x in (out, tri, ref))
    # Both take bf16 dot operands and accumulate in f32: they agree as closely as each
    # agrees with the f32 reference.
    assert np.max(np.abs(a - t)) <= 2 * np.max(np.abs(t - r)) + 1e-2


def _lower(**kw):
    _, args = _bf16_decode(
        34, (3, 70), head_dim=kw.pop("head_dim", 128), page_size=kw.pop("page_size", 16)
    )

    def f(*a):
        return decode_mosaic.decode_paged_attention(*a, sm_scale=0.1, **kw)

    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    "kw",
    [
        {},
        dict(head_dim=64, page_size=32, num_stages=2),
        dict(pages_per_block=8, sliding_window=50, soft_cap=3.0, num_splits=2),
        dict(head_dim=256),
    ],
    ids=["default", "D64-P32", "block128-window-cap", "D256"],
)
def test_lowers_for_cuda_without_a_gpu(kw):
    text = _lower(**kw)
    assert "mosaic_gpu" in text  # the kernel is a Mosaic GPU custom call in the module


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(dtype=jnp.float32), "q: the Mosaic GPU kernel takes bf16 or f16"),
        (dict(pool=jnp.int8), "kv_pages: the Mosaic GPU kernel takes bf16 or f16"),
        (dict(head_dim=80), "head_dim: expected a multiple of 64"),
        (dict(pages_per_block=2), "pages_per_block: pages_per_block \\* page_size"),
        (dict(num_stages=0), "num_stages: expected an int >= 1"),
        (dict(k_scale=True), "k_scale: the Mosaic GPU kernel takes a per-tensor float"),
        (dict(num_stages=6, head_dim=256), "shared memory"),
    ],
)
def test_refuses_what_it_does_not_take(change, match):
    d = change.pop("head_dim", 64)
    q = jnp.zeros((2, 4, d), change.pop("dtype", jnp.bfloat16))
    kv = jnp.zeros((8, 16, 4, d), change.pop("pool", q.dtype))
    if change.pop("k_scale", False):
        change["k_scale"] = jnp.ones((8, 16, 2), jnp.float32)
    with pytest.raises(ValueError, match=match):
        decode_mosaic.decode_paged_attention(
            q, kv, jnp.ones(2, jnp.int32), jnp.zeros((2, 4), jnp.int32), **change
        )
