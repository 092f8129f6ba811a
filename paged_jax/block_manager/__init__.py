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

Parts, each an object the ``BlockManager`` (``manager.py``) owns: ``PagePool`` and
``HostSlots`` (``pool.py``: pages, reference counts, the free stack, the cached pages
nobody holds, copy-on-write copies; host slots), ``PrefixCache`` (``prefix.py``: keys,
lookups), ``SequenceRows`` (``rows.py``: the sequences' rows of arrays), ``Appender``
(``appends.py``: the per-step appends and marking tokens computed), ``Swapper``
(``swap.py``: swap plans); ``stats.py`` reads them all (statistics, invariants).
``hybrid.py``: ``HybridBlockManager`` and ``layer_groups``; ``_common.py``: errors,
``SeqRows``.
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
