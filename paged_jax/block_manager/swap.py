"""Swapping whole sequence groups between the device pool and host page slots: the plans
the engine carries out (device page -> host slot before the step's writes, host slot ->
device page before the model's). ``Swapping`` is the ``BlockManager``'s part that makes
them. No JAX."""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from ._common import _DROPPED_SLOT, NULL_PAGE, InvalidSequenceState, OutOfPages


class Swapping:
    """``BlockManager``'s swap plans (a mixin: it reads and updates the manager's rows,
    refcounts and host slots)."""

    def _group(self, seq_ids: Iterable[Hashable], swapped: bool, op: str) -> dict[Hashable, int]:
        """The group's distinct sequences and their rows, all on the device (``swapped``
        False) or all swapped out."""
        rows = {s: self._row(s) for s in dict.fromkeys(seq_ids)}
        for s, row in rows.items():
            if self._swapped[row] != swapped:
                where = "swapped out" if self._swapped[row] else "on the device"
                raise InvalidSequenceState(f"{op}: seq_id {s!r} is {where}")
        return rows

    def _live(self, row: int) -> list[int]:
        """The row's table entries not dropped outside the window."""
        return self._table[row, self._dropped[row] : self._npages(row)].tolist()

    def can_swap_out(self, seq_ids: Iterable[Hashable]) -> bool:
        rows = self._group(seq_ids, False, "can_swap_out").values()
        return len({p for row in rows for p in self._live(row)}) <= len(self._host_free)

    def can_swap_in(self, seq_ids: Iterable[Hashable]) -> bool:
        rows = self._group(seq_ids, True, "can_swap_in").values()
        return len({p for row in rows for p in self._live(row)}) <= self.num_free_pages

    def swap_out(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """Moves a group of sequences to host slots, all or nothing.

        Returns ``[(device_page, host_slot), ...]``: read each device page to its host
        slot (``PagedKVCache.read_pages``) after this step's copies, before any write.
        A page shared inside the group goes to one host slot and comes back as one page.
        Raises ``OutOfPages`` when the host has too few free slots (nothing changes).
        """
        group = self._group(seq_ids, False, "swap_out")
        for seq_id, row in group.items():
            if self._last[row] == self._step:
                raise InvalidSequenceState(
                    f"swap_out: seq_id {seq_id!r} appended tokens this step whose K/V are "
                    "not written yet; preempt a sequence before appending to it"
                )
        distinct = list(dict.fromkeys(p for row in group.values() for p in self._live(row)))
        if len(distinct) > len(self._host_free):
            raise OutOfPages(
                f"swap_out: {len(distinct)} host slots needed, {len(self._host_free)} free"
            )
        to_host = {}
        plan = []
        for page in distinct:
            slot = self._host_free.pop()
            to_host[page] = slot
            plan.append((page, slot))
        to_host[NULL_PAGE] = _DROPPED_SLOT
        for row in group.values():
            live = self._live(row)
            for page in live:
                self._host_refcount[to_host[page]] += 1
            entries = self._table[row, : self._npages(row)]
            entries[:] = [to_host[p] for p in entries.tolist()]
            self._swapped[row] = True
            for page in reversed(live):
                self._unref(page)
        return plan

    def swap_in(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """Brings a swapped-out group back, all or nothing: ``[(host_slot, device_page)]``.

        Write each host slot's data into its device page (``PagedKVCache.write_pages``)
        before the step's model writes. Raises ``OutOfPages`` when the device lacks pages.
        """
        group = self._group(seq_ids, True, "swap_in")
        distinct = list(dict.fromkeys(s for row in group.values() for s in self._live(row)))
        if len(distinct) > self.num_free_pages:
            raise OutOfPages(
                f"swap_in: {len(distinct)} device pages needed, {self.num_free_pages} available"
            )
        to_device = {}
        plan = []
        for slot in distinct:
            page = self._take_page()
            self._refcount[page] = 0
            to_device[slot] = page
            plan.append((slot, page))
        to_device[_DROPPED_SLOT] = NULL_PAGE
        for row in group.values():
            for slot in self._live(row):
                self._refcount[to_device[slot]] += 1
                self._host_refcount[slot] -= 1
                if self._host_refcount[slot] == 0:
                    self._host_free.append(slot)
            entries = self._table[row, : self._npages(row)]
            entries[:] = [to_device[s] for s in entries.tolist()]
            self._swapped[row] = False
            # Re-register the restored full pages (their old device copies may be gone).
            self._key[row], self._nhash[row] = self._root[row], 0
            self._register(row, int(self._ncomp[row]))
        return plan
