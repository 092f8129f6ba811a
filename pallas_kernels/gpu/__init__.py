"""Pallas GPU kernels (Triton lowering; run under ``interpret=True`` on CPU).

* ``decode_paged_attention``: paged flash-decoding (``decode.py``).
* ``ragged_paged_attention``: prefill chunks + decode tokens in one launch (``ragged.py``).

A Mosaic GPU (Hopper) decode kernel would sit beside these as ``decode_mosaic.py`` with the
same signature; ``paged_jax.attention`` finds kernels by these two names.
"""

from .decode import decode_paged_attention
from .ragged import ragged_paged_attention

__all__ = ["decode_paged_attention", "ragged_paged_attention"]
