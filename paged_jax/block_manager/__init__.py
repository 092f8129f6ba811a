"""Host-side owner of "which physical page holds which token". Pure Python + numpy, no JAX.

The ``BlockManager`` hands out pages of a ``PagedKVCache`` pool to sequences on demand,
counts references so sequences can share pages (``fork`` for parallel sampling and beam
search, prefix-cache hits for common prompts), copies a shared page before it is written
(copy-on-write; the copies reach the device through ``take_copies`` and
``PagedKVCache.copy_pages``), keeps freed full pages in a prefix cache evicted
least-recently-used, and plans swaps of whole sequence groups to and from host memory.

Every decision is deterministic: the same calls give the same page ids in any process
(free pages are reused last-freed-first; prefix-cache keys are blake2b digests, never
Python's ``hash()``).

Order of device work within one engine step, which the manager's plans assume:
``cache.copy_pages(*take_copies())``, then swap-out reads, then swap-in writes, then the
model's K/V writes. Copies read pages as they were before the step.

Parts: ``manager.py`` (``BlockManager``: the pool and the block tables), ``rows.py`` (the
sequences' rows of arrays and the batched operations of a step), ``prefix.py``
(prefix-cache keys and lookups), ``swap.py`` (swap plans), ``stats.py`` (statistics,
invariants), ``hybrid.py`` (``HybridBlockManager``, ``layer_groups``), ``_common.py``
(errors, ``SeqRows``).
"""

from ._common import (
    NULL_PAGE,
    BlockManagerError,
    DuplicateSequence,
    InvalidSequenceState,
    OutOfPages,
    SeqRows,
    UnknownSequence,
    write_spans,
)
from .hybrid import HybridBlockManager, layer_groups
from .manager import BlockManager
from .prefix import page_key, prefix_root_key

__all__ = [
    "NULL_PAGE",
    "BlockManager",
    "BlockManagerError",
    "DuplicateSequence",
    "HybridBlockManager",
    "InvalidSequenceState",
    "OutOfPages",
    "SeqRows",
    "UnknownSequence",
    "layer_groups",
    "page_key",
    "prefix_root_key",
    "write_spans",
]
