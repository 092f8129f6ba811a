"""Agreement with JAX's own paged-attention ops on identical inputs.

JAX's ops only ever see finite pools (their own masking is not designed for NaN pages),
so the NaN-filled pools of ``make_case`` are zeroed outside the live tokens first.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.gpu import paged_attention as jax_gpu_paged
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as jax_ragged
from paged_cases import grid_case, make_case, max_err

import paged_jax as pj

_RAGGED_CASES = [
    ([(1, 9), (4, 4), (0, 3), (6, 30)], {}),
    ([(3, 17), (1, 1), (8, 40)], dict(sliding_window=7, soft_cap=3.0)),
    ([(1, 16), (1, 33), (1, 2)], dict(soft_cap=1.5)),
]


# JAX's reference takes seconds a case: each batch with one head layout by default (both
# layouts each: -m slow).
@pytest.mark.parametrize(
    "heads, seqs, opts",
    [
        grid_case(heads, *case, id=f"heads{h}-seqs{c}", by_default=(h + c) % 2 == 0)
        for h, heads in enumerate([(4, 4), (8, 2)])
        for c, case in enumerate(_RAGGED_CASES)
    ],
)
def test_matches_jax_ref_ragged_paged_attention(seqs, opts, heads):
    case = make_case(
        20, seqs, num_q_heads=heads[0], num_kv_heads=heads[1], page_size=8, head_dim=32, **opts
    )
    kv = jnp.nan_to_num(case.kv_pages)
    q = jnp.nan_to_num(case.q)
    args = (q, kv, case.kv_lens, case.page_indices, case.cu_q_lens, case.num_seqs)
    theirs = jax_ragged.ref_ragged_paged_attention(*args, sm_scale=0.2, **opts)
    ours = pj.ragged_paged_attention(*args, sm_scale=0.2, **opts)
    n = theirs.shape[0]  # JAX's reference returns only the live tokens
    assert n == int(case.cu_q_lens[len(seqs)])
    assert max_err(ours[:n], np.asarray(theirs, np.float64)) < 2e-6
    np.testing.assert_array_equal(ours[n:], 0.0)


@pytest.mark.parametrize("heads", [(16, 4), (16, 16)])
@pytest.mark.parametrize("soft_cap", [None, 2.0])
def test_matches_jax_gpu_paged_attention_interpret(heads, soft_cap):
    # JAX's Pallas GPU decode kernel, in interpret mode, after the layout transpose
    # [N, P, 2K, D] -> K and V as [K, N, P, D]. It has no sm_scale (it uses 1).
    lens = [5, 16, 17, 64]
    case = make_case(
        21,
        [(1, n) for n in lens],
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        page_size=8,
        head_dim=32,
        pad_seqs=0,
        pad_tokens=0,
        table_width=8,
    )
    kv = jnp.nan_to_num(case.kv_pages)
    k_pages = jnp.transpose(kv[:, :, 0::2], (2, 0, 1, 3))
    v_pages = jnp.transpose(kv[:, :, 1::2], (2, 0, 1, 3))
    theirs = jax_gpu_paged.paged_attention(
        case.q,
        k_pages,
        v_pages,
        case.page_indices,
        case.kv_lens,
        k_splits=2,
        pages_per_compute_block=2,
        interpret=True,
        attn_logits_soft_cap=soft_cap,
    )
    ours = pj.paged_attention(case.q, kv, case.kv_lens, case.page_indices, soft_cap=soft_cap)
    assert max_err(ours, np.asarray(theirs, np.float64)) < 1e-5
