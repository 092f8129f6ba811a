"""Every error of the attention API, with its message: static (trace-time) and dynamic."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged_jax as pj

T, H, D, N, P, K, S, M = 5, 4, 8, 6, 4, 2, 3, 2


def _args(**over):
    args = dict(
        q=jnp.zeros((T, H, D)),
        kv_pages=jnp.zeros((N, P, 2 * K, D)),
        kv_lens=jnp.array([3, 5, 0], jnp.int32),
        page_indices=jnp.array([[1, 0], [2, 3], [0, 0]], jnp.int32),
        cu_q_lens=jnp.array([0, 1, 4, 4], jnp.int32),
        num_seqs=jnp.array([2], jnp.int32),
    )
    args.update(over)
    return args


def _call(**over):
    a = _args(**over)
    kw = {
        k: a.pop(k)
        for k in ("sm_scale", "sliding_window", "soft_cap", "k_scale", "v_scale")
        if k in a
    }
    return pj.ragged_paged_attention(*a.values(), **kw)


STATIC_CASES = [
    (dict(q=jnp.zeros((T, H))), ValueError, "q: expected rank 3 [T, H, D], got shape (5, 4)"),
    (
        dict(q=jnp.zeros((T, H, D), jnp.int32)),
        TypeError,
        "q: expected float32, bfloat16 or float16, got int32",
    ),
    (
        dict(kv_pages=jnp.zeros((N, P, D))),
        ValueError,
        "kv_pages: expected rank 4 [N, P, 2K, D], got shape (6, 4, 8)",
    ),
    (
        dict(kv_pages=jnp.zeros((N, P, 3, D))),
        ValueError,
        "kv_pages: dim 2 (2K, K and V interleaved) must be even, got 3",
    ),
    (
        dict(kv_pages=jnp.zeros((N, P, 2 * K, D), jnp.int32)),
        TypeError,
        "kv_pages: expected a float, int8 or float8 dtype, got int32",
    ),
    (dict(q=jnp.zeros((T, H, 4))), ValueError, "q: head_dim 4 does not match kv_pages head_dim 8"),
    (
        dict(q=jnp.zeros((T, 3, D))),
        ValueError,
        "q: num_q_heads (3) must be a multiple of num_kv_heads (2)",
    ),
    (dict(kv_lens=jnp.array([3, 5, 0])), None, None),  # int32 by default: accepted
    (
        dict(kv_lens=jnp.array([3.0, 5.0, 0.0])),
        TypeError,
        "kv_lens: expected dtype int32, got float32",
    ),
    (
        dict(kv_lens=jnp.zeros((3, 1), jnp.int32)),
        ValueError,
        "kv_lens: expected rank 1 [S], got shape (3, 1)",
    ),
    (
        dict(page_indices=jnp.zeros((S,), jnp.int32)),
        ValueError,
        "page_indices: expected rank 2 [S, M], got shape (3,)",
    ),
    (
        dict(page_indices=jnp.zeros((S, M), jnp.uint32)),
        TypeError,
        "page_indices: expected dtype int32, got uint32",
    ),
    (
        dict(page_indices=jnp.zeros((S + 1, M), jnp.int32)),
        ValueError,
        "page_indices: expected 3 rows (one per kv_lens entry), got shape (4, 2)",
    ),
    (
        dict(cu_q_lens=jnp.array([0, 1, 4], jnp.int32)),
        ValueError,
        "cu_q_lens: expected shape [4] (len(kv_lens) + 1), got (3,)",
    ),
    (
        dict(num_seqs=jnp.array([2, 2], jnp.int32)),
        ValueError,
        "num_seqs: expected shape [1] or [], got (2,)",
    ),
    (dict(num_seqs=2), ValueError, "num_seqs: expected an int32 array of shape [1] or [], got 2"),
    (dict(num_seqs=jnp.array([2.0])), TypeError, "num_seqs: expected dtype int32, got float32"),
    (
        dict(kv_pages=jnp.zeros((N, P, 2 * K, D), jnp.int8)),
        ValueError,
        "k_scale, v_scale: required for an int8 kv_pages, got None",
    ),
    (
        dict(k_scale=jnp.ones((N, P)), v_scale=1.0),
        ValueError,
        "k_scale: expected a scalar or shape (6, 4, 2) [N, P, K], got (6, 4)",
    ),
    (dict(sm_scale="0.1"), TypeError, "sm_scale: expected a Python float, got str"),
    (dict(sliding_window=0), ValueError, "sliding_window: expected None or an int >= 1, got 0"),
    (dict(soft_cap=-1.0), ValueError, "soft_cap: expected None or a finite float > 0, got -1.0"),
    (dict(soft_cap=float("nan")), ValueError, "soft_cap: expected None or a finite float > 0"),
    (dict(soft_cap=float("inf")), ValueError, "soft_cap: expected None or a finite float > 0"),
    (dict(sm_scale=float("nan")), ValueError, "sm_scale: expected a finite float, got nan"),
]


@pytest.mark.parametrize("over,exc,msg", STATIC_CASES)
def test_static_errors(over, exc, msg):
    if exc is None:
        _call(**over)
        return
    with pytest.raises(exc, match=re.escape(msg)):
        _call(**over)
    # The same check fires at trace time under jit (it needs shapes only).
    if all(hasattr(v, "shape") for v in over.values()):
        a = _args(**over)
        with pytest.raises(exc, match=re.escape(msg)):
            jax.jit(pj.ragged_paged_attention).lower(*a.values())


@pytest.mark.parametrize(
    "over,exc,msg",
    [
        (
            dict(kv_lens=jnp.array([1, 2], jnp.int32)),
            ValueError,
            "kv_lens: expected shape [3] (q's batch), got (2,)",
        ),
        (
            dict(page_indices=jnp.zeros((2, M), jnp.int32)),
            ValueError,
            "page_indices: expected 3 rows (q's batch), got shape (2, 2)",
        ),
        (
            dict(q=jnp.zeros((S, 3, D))),
            ValueError,
            "q: num_q_heads (3) must be a multiple of num_kv_heads (2)",
        ),
    ],
)
def test_decode_static_errors(over, exc, msg):
    a = dict(
        q=jnp.zeros((S, H, D)),
        kv_pages=jnp.zeros((N, P, 2 * K, D)),
        kv_lens=jnp.array([1, 2, 3], jnp.int32),
        page_indices=jnp.ones((S, M), jnp.int32),
    )
    a.update(over)
    with pytest.raises(exc, match=re.escape(msg)):
        pj.paged_attention(*a.values())


DYNAMIC_CASES = [
    (dict(num_seqs=jnp.array([4], jnp.int32)), "num_seqs: expected 0 <= num_seqs <= 3, got 4"),
    (
        dict(cu_q_lens=jnp.array([1, 1, 4, 4], jnp.int32)),
        "cu_q_lens: expected cu_q_lens[0] == 0, got 1",
    ),
    (
        dict(cu_q_lens=jnp.array([0, 3, 2, 2], jnp.int32)),
        "cu_q_lens: must not decrease, but cu_q_lens[2]=2 < cu_q_lens[1]=3",
    ),
    (
        dict(cu_q_lens=jnp.array([0, 1, 6, 6], jnp.int32), kv_lens=jnp.array([3, 5, 0], jnp.int32)),
        "cu_q_lens: cu_q_lens[num_seqs=2]=6 exceeds q's 5 tokens",
    ),
    (
        dict(kv_lens=jnp.array([3, 2, 0], jnp.int32)),
        "kv_lens: sequence 1 has q_len=3 > kv_len=2; kv_lens must include the new tokens",
    ),
    (
        dict(kv_lens=jnp.array([3, 9, 0], jnp.int32)),
        "kv_lens: kv_lens[1]=9 exceeds the block table's capacity M * P = 2 * 4 = 8",
    ),
    (
        dict(
            kv_lens=jnp.array([-1, 5, 0], jnp.int32), cu_q_lens=jnp.array([0, 0, 3, 3], jnp.int32)
        ),
        "kv_lens: kv_lens[0]=-1 is negative",
    ),
    (
        dict(page_indices=jnp.array([[1, 0], [2, 6], [0, 0]], jnp.int32)),
        "page_indices: sequence 1 reads page 6, outside [0, 6)",
    ),
    (
        dict(page_indices=jnp.array([[0, 0], [2, 3], [0, 0]], jnp.int32)),
        "page_indices: sequence 0 reads the null page 0 within its kv_len=3",
    ),
]


@pytest.mark.parametrize("over,msg", DYNAMIC_CASES)
def test_validate_inputs_errors(over, msg):
    with pytest.raises(ValueError, match=re.escape(msg)):
        pj.validate_inputs(*_args(**over).values())


def test_validate_inputs_accepts_valid_batches_and_numpy():
    pj.validate_inputs(*_args().values())
    # Padding rows past num_seqs may hold anything (here: kv_len 0 on page 0).
    host = {k: np.asarray(v) for k, v in _args().items()}
    pj.validate_inputs(*host.values())
    # Page 0 inside a sequence is allowed on request (JAX's own ops have no null page).
    a = _args(page_indices=jnp.array([[0, 0], [2, 3], [0, 0]], jnp.int32))
    pj.validate_inputs(*a.values(), allow_null_page=True)
