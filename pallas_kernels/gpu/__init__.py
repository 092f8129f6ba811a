"""Pallas GPU kernels (Triton lowering; run under ``interpret=True`` on CPU).

* ``decode_paged_attention``: paged flash-decoding (``decode.py``).
* ``ragged_paged_attention``: prefill chunks + decode tokens in one launch (``ragged.py``).

* ``decode_mosaic.decode_paged_attention``: the same decode with Mosaic GPU's lowering
  (Hopper: TMA page loads, wgmma), the Triton one's signature; imported on use, and no
  backend picks it until a GPU has measured it against the Triton kernel.

``paged_jax.attention`` finds kernels by the two names above.
"""

from .decode import decode_paged_attention
from .ragged import ragged_paged_attention

__all__ = ["decode_paged_attention", "ragged_paged_attention"]
