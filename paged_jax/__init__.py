"""paged-jax: PagedAttention for JAX.

The KV cache is a pool of fixed-size pages; every sequence reaches its tokens through
a block table (a row of page ids), and attention reads the pages where they lie.

Shape letters used in names, einsum strings and docstrings across the package:

    S  sequences (rows of the block table, including padding rows)
    B  batch (decode: one query token per sequence)
    T  tokens in a step (all sequences' new tokens, concatenated)
    H  query heads          K  kv heads          G  query heads per kv head (H // K)
    D  head dim             P  page size (tokens per page)
    N  pages in the pool    L  layers            M  pages per sequence (block-table width)

Per layer the pool is ``kv_pages[N, P, 2K, D]``: K of kv head h at combined head 2h,
V at 2h + 1 (the layout of ``jax.experimental.pallas.ops.tpu.ragged_paged_attention``).
Page 0 is the null page: never allocated, the sink for padding writes and the target of
padding rows of block tables.
"""

from paged_jax import reference
from paged_jax._validation import validate_inputs
from paged_jax.attention import (
    BACKENDS,
    available_backends,
    paged_attention,
    ragged_paged_attention,
)
from paged_jax.cache import NULL_PAGE, PagedKVCache

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "NULL_PAGE",
    "PagedKVCache",
    "available_backends",
    "paged_attention",
    "ragged_paged_attention",
    "reference",
    "validate_inputs",
]
