"""Swapping whole sequence groups between the device pool and host page slots: the plans
the engine carries out (device page -> host slot before the step's writes, host slot ->
device page before the model's). ``Swapper`` is the ``BlockManager``'s part that makes
them. No JAX."""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from ._common import _DROPPED_SLOT, NULL_PAGE, InvalidSequenceState, OutOfPages


class Swapper:
    """The ``BlockManager``'s swap plans over its parts: the sequences' ``rows``, the
    device ``pool``, the ``host`` slots, and the ``appender`` that enters restored
    pages in the prefix cache again."""

    def __init__(self, rows, pool, host, appender):
        self.rows, self.pool, self.host, self.appender = rows, pool, host, appender

    def _group(self, seq_ids: Iterable[Hashable], swapped: bool, op: str) -> dict[Hashable, int]:
        """The group's distinct sequences and their rows, all on the device (``swapped``
        False) or all swapped out."""
        rows = {s: self.rows.row(s) for s in dict.fromkeys(seq_ids)}
        for s, row in rows.items():
            if self.rows.swapped[row] != swapped:
                where = "swapped out" if self.rows.swapped[row] else "on the device"
                raise InvalidSequenceState(f"{op}: seq_id {s!r} is {where}")
        return rows

    def can_swap_out(self, seq_ids: Iterable[Hashable]) -> bool:
        rows = self._group(seq_ids, False, "can_swap_out").values()
        return len({p for row in rows for p in self.rows.live(row)}) <= len(self.host.free)

    def can_swap_in(self, seq_ids: Iterable[Hashable]) -> bool:
        rows = self._group(seq_ids, True, "can_swap_in").values()
        return len({p for row in rows for p in self.rows.live(row)}) <= self.pool.num_free

    def swap_out(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """Moves a group of sequences to host slots, all or nothing.

        Returns ``[(device_page, host_slot), ...]``: read each device page to its host
        slot (``PagedKVCache.read_pages``) after this step's copies, before any write.
        A page shared inside the group goes to one host slot and comes back as one page.
        Raises ``OutOfPages`` when the host has too few free slots (nothing changes).
        """
        group = self._group(seq_ids, False, "swap_out")
        for seq_id, row in group.items():
            if self.rows.last[row] == self.rows.step:
                raise InvalidSequenceState(
                    f"swap_out: seq_id {seq_id!r} appended tokens this step whose K/V are "
                    "not written yet; preempt a sequence before appending to it"
                )
        distinct = list(dict.fromkeys(p for row in group.values() for p in self.rows.live(row)))
        if len(distinct) > len(self.host.free):
            raise OutOfPages(
                f"swap_out: {len(distinct)} host slots needed, {len(self.host.free)} free"
            )
        to_host = {}
        plan = []
        for page in distinct:
            slot = self.host.take()
            to_host[page] = slot
            plan.append((page, slot))
        to_host[NULL_PAGE] = _DROPPED_SLOT
        for row in group.values():
            live = self.rows.live(row)
            for page in live:
                self.host.refcount[to_host[page]] += 1
            entries = self.rows.table[row, : self.rows.npages(row)]
            entries[:] = [to_host[p] for p in entries.tolist()]
            self.rows.swapped[row] = True
            for page in reversed(live):
                self.pool.unref(page)
        return plan

    def swap_in(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """Brings a swapped-out group back, all or nothing: ``[(host_slot, device_page)]``.

        Write each host slot's data into its device page (``PagedKVCache.write_pages``)
        before the step's model writes. Raises ``OutOfPages`` when the device lacks pages.
        """
        group = self._group(seq_ids, True, "swap_in")
        distinct = list(dict.fromkeys(s for row in group.values() for s in self.rows.live(row)))
        if len(distinct) > self.pool.num_free:
            raise OutOfPages(
                f"swap_in: {len(distinct)} device pages needed, {self.pool.num_free} available"
            )
        to_device = {}
        plan = []
        for slot in distinct:
            page = self.pool.take()
            self.pool.refcount[page] = 0
            to_device[slot] = page
            plan.append((slot, page))
        to_device[_DROPPED_SLOT] = NULL_PAGE
        for row in group.values():
            for slot in self.rows.live(row):
                self.pool.refcount[to_device[slot]] += 1
                self.host.unref(slot)
            entries = self.rows.table[row, : self.rows.npages(row)]
            entries[:] = [to_device[s] for s in entries.tolist()]
            self.rows.swapped[row] = False
            # Re-register the restored full pages (their old device copies may be gone).
            self.rows.key[row], self.rows.nhash[row] = self.rows.root[row], 0
            self.appender.register(row, int(self.rows.ncomp[row]))
        return plan
