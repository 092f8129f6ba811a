"""``HostSwap``: the engine core's part that moves swapped-out pages between the device
pool and host memory (``preemption="swap"``), as each step's schedules ask
(``Schedule.swap_out``, ``Schedule.swap_in``), and keeps them on the host meanwhile.
The block managers decide which page goes to which host slot; this part only copies."""

from __future__ import annotations

import numpy as np

from paged_jax.batch import bucket


class HostSwap:
    """Swapped-out K/V on the host, by ``(replica, host slot)``.

    Args:
      runner: the ``ModelRunner`` (its pool, ``read_pages`` and ``write_pages``).
    """

    def __init__(self, runner):
        self.runner = runner
        # (replica, slot) -> (K/V [L, P, 2K, D], scales [L, P, 2K] or None)
        self._pages: dict[tuple[int, int], tuple[np.ndarray, np.ndarray | None]] = {}

    def __len__(self) -> int:
        """Host slots holding a page."""
        return len(self._pages)

    def apply(self, scheds) -> None:
        """Swap-out reads, then swap-in writes, before the step (see ``BlockManager``), of
        every replica's schedule at once: replica r's pages (local ids, padded with its
        null page to the same count) at positions ``[r n, (r + 1) n)``."""
        outs = [sched.swap_out for sched in scheds]
        ins = [sched.swap_in for sched in scheds]
        if any(outs):
            n = max(map(len, outs))
            pages = np.zeros((len(outs), n), np.int32)
            for r, swap_out in enumerate(outs):
                pages[r, : len(swap_out)] = [d for d, _ in swap_out]
            data, scales = self.runner.read_pages(pages.reshape(-1))
            for r, swap_out in enumerate(outs):
                for k, (_, slot) in enumerate(swap_out):
                    j = r * n + k
                    self._pages[r, slot] = (
                        data[:, j],
                        None if scales is None else scales[:, j],
                    )
        if any(ins):
            self._write(ins)

    def _write(self, ins: list) -> None:
        n = bucket(max(map(len, ins)))
        pages = np.zeros(len(ins) * n, np.int32)  # padding rewrites a null page with 0s
        pool = self.runner.cache
        shape = pool.kv_pages.shape
        data = np.zeros((shape[0], len(pages)) + shape[2:], pool.kv_pages.dtype)
        scales = (
            np.zeros((shape[0], len(pages)) + shape[2:4], np.float32) if pool.quantized else None
        )
        for r, swap_in in enumerate(ins):
            for k, (slot, page) in enumerate(swap_in):
                j = r * n + k
                kv, sc = self._pages.pop((r, slot))
                pages[j], data[:, j] = page, kv
                if scales is not None:
                    scales[:, j] = sc
        self.runner.write_pages(pages, data, scales)

    def drop(self, replica: int, slots, bm) -> None:
        """Forgets the pages of host ``slots`` of ``replica`` that no sequence of its block
        manager ``bm`` holds any more (an aborted request's)."""
        for slot in slots:
            if bm.host_refcount(slot) == 0:
                self._pages.pop((replica, slot), None)

    def clear(self) -> None:
        self._pages.clear()
