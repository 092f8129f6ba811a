"""The host-side scheduler of the engine: which sequences compute which tokens this step.

Pure Python (no JAX), deterministic. Requests become sequence groups (one sequence, or
``n`` samples / beams sharing the prompt's pages) that move between queues, each in the
order of the scheduling ``policy``: "fcfs", by arrival; "priority", by ``Group.priority``
(lower first), then arrival:

    waiting --admit (pages + watermark)--> running --preempt--> swapped (swap mode)
       ^                                      |                     |
       +------------ preempt (recompute) -----+     <--swap in------+

Each step takes running groups first in that order (decode tokens, then prefill chunks)
within a token budget; when pages run out the last running group in it is preempted,
by swap (all or nothing per group) or by recompute (pages freed, its prompt and
generated tokens prefilled again later, outputs unchanged). Swapped groups come back
before new requests are admitted. With "priority", a waiting group that finds no pages
preempts running groups of a lower priority (a larger value), the last first, until it
fits. While ``only`` is set (the engine isolating a request
it suspects of making steps fail) the other groups wait, whatever their queue.
"""

from __future__ import annotations

import bisect
import dataclasses

from paged_jax.block_manager import BlockManager, OutOfPages
from paged_jax.engine.request import Group, Seq, Status, Work


@dataclasses.dataclass
class Schedule:
    work: list[Work]
    swap_out: list[tuple[int, int]]  # (device page, host slot), read before the step
    swap_in: list[tuple[int, int]]  # (host slot, device page), written before the step
    preempted: list[tuple[Group, str]]  # (group, "swap" | "recompute")
    stalled: bool = False  # a speculative schedule stopped where it would have preempted


POLICIES = ("fcfs", "priority")


class Scheduler:
    def __init__(
        self,
        bm: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preemption: str,
        policy: str = "fcfs",
    ):
        if policy not in POLICIES:
            raise ValueError(f"scheduling_policy: expected one of {POLICIES}, got {policy!r}")
        self.policy = policy
        # the queues' order: arrival, or (priority, arrival)
        self.order = (
            (lambda g: g.arrival) if policy == "fcfs" else (lambda g: (g.priority, g.arrival))
        )
        self.bm = bm
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption = preemption
        self.waiting: list[Group] = []  # sorted by self.order
        self.running: list[Group] = []  # so
        self.swapped: list[Group] = []  # so
        self.num_preempted = {"swap": 0, "recompute": 0}
        # Arrival numbers of the only groups that may run, or None (all). The engine sets
        # it while it isolates a request suspected of making steps fail.
        self.only: set[int] | None = None
        # The engine's LoRA slots (None: no limit): a group is admitted or swapped in only
        # while the adapters of the running groups and its own fit in them.
        self.adapter_slots: int | None = None
        self.kv_events = False  # record_kv_events

    # ------------------------------------------------------------------ queues
    def reset(self, bm: BlockManager, waiting: list[Group]) -> None:
        """A fresh block manager ``bm``, nothing running or swapped, and ``waiting`` (to be
        recomputed from their tokens) queued in the policy's order: what follows a failed
        step."""
        self.bm = bm
        if self.kv_events:  # the cache the consumers followed is gone
            bm.record_events(cleared=True)
        self.running, self.swapped = [], []
        self.waiting = sorted(waiting, key=self.order)
        for g in waiting:
            g.status = Status.WAITING

    def record_kv_events(self) -> None:
        """From now on the block manager records its prefix cache's pages entered and
        evicted (``BlockManager.take_events``), and a manager that replaces it
        (``reset``: the engine's reset, or its rebuild after a fault) starts with
        ``AllBlocksCleared``. ValueError on a pool of several layer groups (sliding-window
        layers: each group caches its pages apart)."""
        if not hasattr(self.bm, "record_events"):
            raise ValueError(
                "kv_events: not supported on a pool of several layer groups (a model with "
                "sliding-window layers), whose prefix caches hold each group's pages apart"
            )
        self.kv_events = True
        self.bm.record_events()

    def add(self, group: Group) -> None:
        bisect.insort(self.waiting, group, key=self.order)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def remove(self, group: Group) -> None:
        for q in (self.waiting, self.running, self.swapped):
            if group in q:
                q.remove(group)

    def _allowed(self, queue: list[Group]) -> list[Group]:
        return list(queue) if self.only is None else [g for g in queue if g.arrival in self.only]

    def _next_waiting(self) -> Group | None:
        """The oldest waiting group the step may admit (O(1) unless isolating)."""
        if self.only is None:
            return self.waiting[0] if self.waiting else None
        return next((g for g in self.waiting if g.arrival in self.only), None)

    def _seq_ids(self, g: Group) -> list[str]:
        return [s.seq_id for s in g.seqs]

    def _adapter_fits(self, g: Group) -> bool:
        """Whether ``g``'s adapter fits beside the running groups' (``adapter_slots``)."""
        if self.adapter_slots is None or not g.adapter:
            return True
        held = {x.adapter for x in self.running if x.adapter}
        return g.adapter in held or len(held) < self.adapter_slots

    # ------------------------------------------------------------------ preemption
    def _preempt(self, g: Group, sched: Schedule, swap: bool = True) -> None:
        ids = self._seq_ids(g)
        g.num_preemptions += 1
        if swap and self.preemption == "swap" and self.bm.can_swap_out(ids):
            sched.swap_out += self.bm.swap_out(ids)
            g.status = Status.SWAPPED
            self.running.remove(g)
            bisect.insort(self.swapped, g, key=self.order)
            sched.preempted.append((g, "swap"))
            self.num_preempted["swap"] += 1
            return
        for sid in ids:
            self.bm.free(sid)
        g.status = Status.WAITING
        self.running.remove(g)
        bisect.insort(self.waiting, g, key=self.order)
        sched.preempted.append((g, "recompute"))
        self.num_preempted["recompute"] += 1

    def _make_room(self, sched: Schedule) -> None:
        """With policy "priority": the waiting group first in order preempts running groups
        of a lower priority (a larger value), the last in order first, until the pages its
        prompt needs (and the watermark) are free. They are recomputed later, not swapped
        (a swapped group would come back before it)."""
        g = self._next_waiting()
        if g is None:
            return
        need = sum(self.bm.pages_needed(len(s.tokens)) for s in g.seqs)
        while self.bm.num_free_pages - need < self.bm.watermark_pages:
            running = self._allowed(self.running)
            if not running or running[-1].priority <= g.priority:
                return
            self._preempt(running[-1], sched, swap=False)

    # ------------------------------------------------------------------ the step
    def schedule(self, *, speculative: bool = False) -> Schedule:
        """The next step's work, swaps and preemptions.

        ``speculative``: scheduled while the previous step still runs (the engine's
        overlapped steps). Each sequence that samples in that step already ends in a
        placeholder for the token it will get; a sequence at its ``Group.max_len`` is not
        decoded (it finishes whatever it samples), and a group whose decode would need a
        preemption waits instead (``stalled``: preemptions, swap-ins and admissions wait
        for a step scheduled with every token known).
        """
        sched = Schedule([], [], [], [])
        if self.policy == "priority" and not speculative:
            self._make_room(sched)
        groups = self._allowed(self.running)
        budget, seq_budget = self.max_num_batched_tokens, self.max_num_seqs
        taken = self._decode_prefix(groups, sched, speculative)
        if taken is not None:
            k, budget, seq_budget, out_of_budget = taken
            groups = [] if out_of_budget else groups[k:]
        budget, seq_budget = self._running_groups(groups, sched, speculative, budget, seq_budget)
        if sched.preempted or sched.stalled:
            return sched
        head = self._next_waiting() if self.policy == "priority" else None
        for g in self._allowed(self.swapped):
            ids = self._seq_ids(g)
            if not self.bm.can_swap_in(ids) or seq_budget < len(g.seqs):
                break
            if head is not None and self.order(head) < self.order(g):
                break  # (priority: a waiting group first in order is admitted first)
            if not self._adapter_fits(g):
                break
            sched.swap_in += self.bm.swap_in(ids)
            self.swapped.remove(g)
            g.status = Status.RUNNING
            bisect.insort(self.running, g, key=self.order)
            seq_budget -= len(g.seqs)  # decodes from the next step
        swapped = self._allowed(self.swapped)
        if self.policy == "priority" and head is not None:  # the ones it does not precede
            swapped = [g for g in swapped if self.order(g) < self.order(head)]
        if swapped:
            return sched  # swapped groups come back before new admissions
        while budget > 0 and (g := self._next_waiting()) is not None:
            if seq_budget < len(g.seqs) or not self._adapter_fits(g):
                break
            pages = sum(self.bm.pages_needed(len(s.tokens)) for s in g.seqs)
            if self.bm.num_free_pages - pages < self.bm.watermark_pages:
                break
            try:
                for s in g.seqs:
                    cached = self.bm.allocate(s.seq_id, s.tokens, extra_key=g.salt)
                    g.num_cached_tokens += cached
            except OutOfPages:  # pages were counted, but be safe: undo and wait
                for s in g.seqs:
                    if s.seq_id in self.bm:
                        self.bm.free(s.seq_id)
                break
            self.waiting.remove(g)
            g.status = Status.RUNNING
            bisect.insort(self.running, g, key=self.order)
            budget -= self._prefill(g, budget, sched)
            seq_budget -= len(g.seqs)
        return sched

    def _decode_prefix(
        self, groups: list[Group], sched: Schedule, speculative: bool
    ) -> tuple[int, int, int, bool] | None:
        """The leading decoding groups of ``groups`` (the running ones, oldest first) in
        one pass, their tokens appended in one ``append_tokens`` call: the common step,
        where the groups still prefilling, if any, are the newest. Returns (groups
        taken, token budget left, sequence budget left, whether the budgets ran out),
        or None, changing nothing, when the pages for all those tokens are not free
        (``_running_groups`` then takes every group, preempting or stalling). A group
        a preemption could take is never among those taken: victims are the newest."""
        budget, seq_budget = self.max_num_batched_tokens, self.max_num_seqs
        ids, last, work = [], [], []
        k, out_of_budget = 0, False
        for g in groups:
            seqs = g.seqs
            n_seqs = len(seqs)
            if budget <= 0 or seq_budget < n_seqs:
                out_of_budget = True
                break
            if not self._decoding(g):
                break  # the general loop goes on from here
            if n_seqs > budget:
                out_of_budget = True
                break
            for s in self._live(g, speculative):
                tokens = s.tokens
                n = len(tokens)
                ids.append(s.seq_id)
                last.append(tokens[-1])
                work.append(Work(g, s, n - 1, n, True))
                budget -= 1
            seq_budget -= n_seqs
            k += 1
        if not self.bm.append_tokens(ids, last):
            return None
        sched.work += work
        return k, budget, seq_budget, out_of_budget

    def _running_groups(
        self, groups: list[Group], sched: Schedule, speculative: bool, budget: int, seq_budget: int
    ) -> tuple[int, int]:
        """The step of running ``groups``, oldest first: decode tokens and prefill chunks
        within the budgets, preempting the newest running groups when pages run out (a
        speculative schedule stalls instead). Returns the token and sequence budgets
        left."""
        for g in groups:
            if g.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            if budget <= 0 or seq_budget < len(g.seqs):
                break
            if self._decoding(g):
                if len(g.seqs) > budget:
                    break
                live = self._live(g, speculative)
                ids, last = [s.seq_id for s in live], [s.tokens[-1] for s in live]
                waits = False
                while not self.bm.append_tokens(ids, last):
                    if speculative:  # no preemption: this group waits, the others go on
                        sched.stalled = waits = True
                        break
                    victim = self._allowed(self.running)[-1]  # the most recently arrived
                    self._preempt(victim, sched)
                    if victim is g:
                        break
                if waits or g.status is not Status.RUNNING:
                    continue
                for s in live:
                    n = len(s.tokens)
                    sched.work.append(Work(g, s, n - 1, n, True))
                budget -= len(live)
                seq_budget -= len(g.seqs)
            else:
                used = self._prefill(g, budget, sched)
                budget -= used
                seq_budget -= len(g.seqs)
        return budget, seq_budget

    @staticmethod
    def _live(g: Group, speculative: bool) -> list[Seq]:
        """The sequences of decoding group ``g`` that decode this step: all of them, but
        in a speculative schedule not one at its ``max_len`` (it finishes whatever the
        running step samples)."""
        if not speculative or g.max_len is None:
            return g.seqs
        return [s for s in g.seqs if len(s.tokens) < g.max_len]

    def _decoding(self, g: Group) -> bool:
        """Every sequence has its K/V written but for the last sampled token."""
        return all(self.bm.num_tokens(s.seq_id) == len(s.tokens) - 1 for s in g.seqs)

    def _prefill(self, g: Group, budget: int, sched: Schedule) -> int:
        """Schedules prefill chunks of ``g`` within ``budget``; returns the tokens used.

        The group samples once every sequence is computed to its end this step; a
        sequence finished in an earlier step recomputes its last token for its logits.
        """
        chunks, used = [], 0
        for s in g.seqs:
            done = self.bm.num_computed_tokens(s.seq_id)
            take = min(len(s.tokens) - done, budget - used)
            if take > 0:
                chunks.append((s, done, done + take))
                used += take
        complete = all(
            self.bm.num_computed_tokens(s.seq_id) == len(s.tokens)
            or any(c[0] is s and c[2] == len(s.tokens) for c in chunks)
            for s in g.seqs
        )
        if complete:
            have = {id(c[0]) for c in chunks}
            for s in g.seqs:
                if id(s) not in have:
                    if used + 1 > budget:
                        complete = False
                        break
                    chunks.append((s, len(s.tokens) - 1, len(s.tokens)))
                    used += 1
        for s, a, b in chunks:
            sched.work.append(Work(g, s, a, b, complete))
        return used
