"""Block tables as the kernels read them: padded, and unable to point outside the pool."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def safe_table(page_indices: jax.Array, num_pages: int, width: int) -> jax.Array:
    """``page_indices: i32[S, M]`` padded to ``i32[S, width]`` with the null page 0, every
    id outside ``[0, num_pages)`` replaced by 0.

    Kernels DMA or load whole pages by id; an id past the pool (a corrupt table) would
    read another allocation or fault. Valid tables pass unchanged; one elementwise select
    over a small int array is all it costs.
    """
    inside = (page_indices >= 0) & (page_indices < num_pages)
    table = jnp.where(inside, page_indices, 0)
    return jnp.pad(table, ((0, 0), (0, width - page_indices.shape[1])))


def safe_lens(kv_lens: jax.Array, max_len: int) -> jax.Array:
    """``kv_lens: i32[S]`` clamped to ``[0, max_len]`` (``M * P``, what a table can hold),
    so no kernel walks past the last table column."""
    return jnp.clip(kv_lens, 0, max_len)
