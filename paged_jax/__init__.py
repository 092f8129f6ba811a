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

import importlib
import importlib.abc
import importlib.util
import pathlib
import sys

__version__ = "0.1.0"


class _CheckoutFolders(importlib.abc.MetaPathFinder):
    """A checkout used without an install (``PYTHONPATH=.``): the repository's ``models/``
    and ``pallas_kernels/`` import as ``paged_jax.models`` and ``paged_jax.kernels``, the
    names an install gives them (pyproject's package-dir). Last on ``sys.meta_path``, so
    an installed package is found first; only where both folders lie beside this one."""

    ROOT = pathlib.Path(__file__).resolve().parent.parent
    FOLDERS = {"paged_jax.models": "models", "paged_jax.kernels": "pallas_kernels"}

    @classmethod
    def present(cls) -> bool:
        return all((cls.ROOT / f / "__init__.py").is_file() for f in cls.FOLDERS.values())

    def find_spec(self, name, path=None, target=None):
        folder = self.FOLDERS.get(name)
        if folder is None:  # their submodules come from the package's __path__
            return None
        where = self.ROOT / folder
        return importlib.util.spec_from_file_location(
            name, where / "__init__.py", submodule_search_locations=[str(where)]
        )


if _CheckoutFolders.present() and not any(isinstance(f, _CheckoutFolders) for f in sys.meta_path):
    sys.meta_path.append(_CheckoutFolders())

# Everything is imported on first use: host-only processes (a scheduler, the block
# manager's tests) never import JAX, and the console script starts (and takes Ctrl-C
# properly) before NumPy is even loaded.
_LAZY = {
    "ScheduledSeq": ("paged_jax.batch", "ScheduledSeq"),
    "StepBatch": ("paged_jax.batch", "StepBatch"),
    "bucket": ("paged_jax.batch", "bucket"),
    "build_batch": ("paged_jax.batch", "build_batch"),
    "concat_batches": ("paged_jax.batch", "concat_batches"),
    "BlockManager": ("paged_jax.block_manager", "BlockManager"),
    "BlockManagerError": ("paged_jax.block_manager", "BlockManagerError"),
    "HybridBlockManager": ("paged_jax.block_manager", "HybridBlockManager"),
    "layer_groups": ("paged_jax.block_manager", "layer_groups"),
    "DuplicateSequence": ("paged_jax.block_manager", "DuplicateSequence"),
    "InvalidSequenceState": ("paged_jax.block_manager", "InvalidSequenceState"),
    "OutOfPages": ("paged_jax.block_manager", "OutOfPages"),
    "SeqRows": ("paged_jax.block_manager", "SeqRows"),
    "UnknownSequence": ("paged_jax.block_manager", "UnknownSequence"),
    "reference": ("paged_jax.reference", None),
    "validate_inputs": ("paged_jax._validation", "validate_inputs"),
    "validate_decode_inputs": ("paged_jax._validation", "validate_decode_inputs"),
    "validate_batch": ("paged_jax._validation", "validate_batch"),
    "BACKENDS": ("paged_jax.attention", "BACKENDS"),
    "available_backends": ("paged_jax.attention", "available_backends"),
    "paged_attention": ("paged_jax.attention", "paged_attention"),
    "ragged_paged_attention": ("paged_jax.attention", "ragged_paged_attention"),
    "paged_self_attention": ("paged_jax.decoder", "paged_self_attention"),
    "NULL_PAGE": ("paged_jax.cache", "NULL_PAGE"),
    "PagedKVCache": ("paged_jax.cache", "PagedKVCache"),
    "AttentionMetadata": ("paged_jax.metadata", "AttentionMetadata"),
    "LLM": ("paged_jax.engine", "LLM"),
    "SamplingParams": ("paged_jax.engine", "SamplingParams"),
    "SpeculativeConfig": ("paged_jax.engine", "SpeculativeConfig"),
    "RequestOutput": ("paged_jax.engine", "RequestOutput"),
    "StreamOutput": ("paged_jax.engine", "StreamOutput"),
    "EngineFailedError": ("paged_jax.engine", "EngineFailedError"),
    "PagedDecoder": ("paged_jax.engine", "PagedDecoder"),
    "tensor_parallel_mesh": ("paged_jax.sharding", "tensor_parallel_mesh"),
    "parallel_mesh": ("paged_jax.sharding", "parallel_mesh"),
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'paged_jax' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = importlib.import_module(module)
    if attr is not None:
        value = getattr(value, attr)
    globals()[name] = value
    return value


__all__ = [
    "AttentionMetadata",
    "BACKENDS",
    "BlockManager",
    "BlockManagerError",
    "DuplicateSequence",
    "EngineFailedError",
    "HybridBlockManager",
    "InvalidSequenceState",
    "LLM",
    "NULL_PAGE",
    "OutOfPages",
    "PagedKVCache",
    "RequestOutput",
    "StreamOutput",
    "SamplingParams",
    "ScheduledSeq",
    "SpeculativeConfig",
    "SeqRows",
    "StepBatch",
    "UnknownSequence",
    "available_backends",
    "bucket",
    "build_batch",
    "concat_batches",
    "layer_groups",
    "paged_attention",
    "parallel_mesh",
    "ragged_paged_attention",
    "reference",
    "tensor_parallel_mesh",
    "validate_batch",
    "validate_decode_inputs",
    "validate_inputs",
]
