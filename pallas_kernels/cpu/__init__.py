"""C kernels for CPUs, called through XLA's FFI (the ``"cpu"`` backend).

XLA:CPU runs decode attention as a gather of every sequence's K/V pages, transposes and
small batched dot products: SmolLM2-135M (32 sequences at 256 tokens, f32) spent about
2.5 ms a layer there, 4-5 GB/s of K/V. ``decode.c`` instead reads each sequence's pages
in place, once, with an online softmax, split over the cores (0.6 ms a layer, 22 GB/s,
on the same 2-core machine); its ragged entry does the same for prefill chunks, 5-9x
XLA's ragged path. The kernels are compiled on first use by the system's C compiler
(``$CC``, else ``cc``) against the FFI header jaxlib ships, into one library in
``<user cache dir>/paged-jax/kernels/``, and registered with XLA as custom calls. No
compiler, or a failed build, leaves ``available()`` False and "auto" on the XLA path.

* ``decode_paged_attention``, ``ragged_paged_attention``: the signatures of
  ``paged_jax.paged_attention`` and ``paged_jax.ragged_paged_attention``; f32 or bf16
  queries and pools, sliding windows, soft caps. Not for quantized pools (scales):
  ``paged_jax.attention`` sends those to XLA. Batch invariant as they are.
* ``pack_weight``, ``pack_high``, ``unpack_weight``, ``linear``, ``panel_width``: matrix products
  against weights packed once in column panels (``linear.c``; ``paged_jax.linear``);
  ``grouped_linear``: each group of rows by its own weight (a mixture's experts).
* ``lora_delta``: LoRA adapters' products for rows of different adapters, each row
  multiplied by its own slot's A and B only (``lora.c``; ``paged_jax.linear``).
* ``greedy_rows``: each row's argmax and log-sum-exp (``sample.c``), for greedy steps.
* ``sample_tokens``: the whole sampler (temperature, top-k, top-p, min-p, the draw) without
  sorting the vocabulary (``sample.c``), for steps with sampled rows.
* ``uninitialized``: an array as XLA allocated it, not written (the KV pool, which
  ``paged_jax`` then zeroes lazily).
* ``available()``, ``unavailable_reason()``: whether the kernels built here, and why not.
"""

from .attention import decode_paged_attention, ragged_paged_attention
from .build import available, cache_dir, unavailable_reason
from .linear import (
    ROTATION,
    grouped_linear,
    linear,
    lora_delta,
    pack_high,
    pack_scales,
    pack_weight,
    packed_columns,
    panel_width,
    quantize_blocks,
    reference_bf16,
    reference_quantized,
    rotate_blocks,
    unpack_high,
    unpack_weight,
)
from .pages import copy_pages, read_pages, uninitialized, write_pages, write_rows
from .sample import greedy_rows, sample_tokens

__all__ = [
    "ROTATION",
    "available",
    "cache_dir",
    "copy_pages",
    "decode_paged_attention",
    "greedy_rows",
    "grouped_linear",
    "linear",
    "lora_delta",
    "pack_high",
    "pack_scales",
    "pack_weight",
    "packed_columns",
    "panel_width",
    "quantize_blocks",
    "ragged_paged_attention",
    "read_pages",
    "reference_bf16",
    "reference_quantized",
    "rotate_blocks",
    "sample_tokens",
    "uninitialized",
    "unavailable_reason",
    "unpack_high",
    "unpack_weight",
    "write_pages",
    "write_rows",
]
