"""LoRA adapters by name: ``LoraSlots``, the engine core's part that registers adapters,
holds up to ``max_loras`` of them in the model's device slots (``models.lora.LoraBank``),
swaps them in least recently used first, and gives each token of a step its slot
(``adapter_ids``).

A request names its adapter (``add_request(lora=...)``, ``generate``, ``chat``); its group
carries the adapter's id, a number never given twice (so a removed adapter's
prefix-cache pages can match no later one). The schedulers admit a request only while
the adapters of the running requests and its own fit in the slots
(``Scheduler.adapter_slots``), so a step's adapters always do; a step loads only the
adapters of its own rows that are not held yet, each into a free slot or the slot of
the adapter used least recently by no row of the step.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np


def enable_lora_slots(model: Any, max_loras: int, max_lora_rank: int, replicas: int) -> None:
    """Gives ``model`` ``max_loras`` LoRA slots of rank ``max_lora_rank`` (its
    ``enable_lora``), before the engine holds it; nothing for 0 slots."""
    if not max_loras:
        return
    if not callable(getattr(model, "enable_lora", None)):
        raise TypeError(
            f"max_loras: {type(model).__name__} has no enable_lora (LoRA slots); "
            "paged_jax.models' decoders have"
        )
    if replicas > 1:
        raise ValueError(f"max_loras: not with data_parallel_size={replicas} yet; pass 1")
    model.enable_lora(max_loras, max_lora_rank)


class LoraSlots:
    """Adapters by name on an engine whose model has LoRA slots (``LLM(max_loras=)``).

    Args:
      runner: the ``ModelRunner`` (its model reads adapters; its weights hold the slots).
      max_loras: slots on the device (0: none; adapters are then refused).
      max_lora_rank: the slots' width, the largest rank an adapter may have.
    """

    def __init__(self, runner, max_loras: int, max_lora_rank: int):
        self.runner = runner
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self._ids: dict[str, int] = {}  # name -> id
        self._host: dict[int, Any] = {}  # id -> models.lora.LoraAdapter
        self._next = 1
        self._slot_of: dict[int, int] = {}  # id -> device slot
        self._clock: dict[int, int] = {}  # id -> the last step that used it
        self._steps = 0
        # each bank array's leaves in the runner's weights: one, or a split bank's one a
        # layer (models.lora.LoraBank.split_layers), in order
        self._bank_leaves: dict[str, list[int]] = {}
        if not max_loras:
            return
        import jax
        from flax import nnx

        _, state = nnx.split(runner.model)
        for i, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(state)[0]):
            keys = [str(getattr(k, "key", k)) for k in path]
            if keys and keys[0] == "lora" and len(keys) >= 2:
                self._bank_leaves.setdefault(keys[1], []).append(i)

    @property
    def names(self) -> list[str]:
        """The names of the adapters registered (``add``), in the order added."""
        return list(self._ids)

    def add(self, name: str, adapter: str | os.PathLike | Any) -> int:
        """Registers a LoRA adapter under ``name``: a PEFT adapter directory
        (``adapter_config.json`` + ``adapter_model.safetensors``, read by the model's
        ``load_lora``) or a ``models.lora.LoraAdapter``. Returns its id. It reaches the
        device when a step first needs it. Raises ValueError without LoRA slots, for a
        name in use, or for an adapter that does not fit the model (naming the tensor)
        or whose rank exceeds ``max_lora_rank``."""
        if not self.max_loras:
            raise ValueError("add_lora: the engine has no LoRA slots; pass LLM(max_loras=N)")
        if not isinstance(name, str) or not name:
            raise TypeError(f"name: expected a non-empty str, got {name!r}")
        if name in self._ids:
            raise ValueError(f"name: an adapter named {name!r} is registered already")
        if isinstance(adapter, str | os.PathLike):  # the model reads its own adapters
            adapter = self.runner.model.load_lora(adapter, name=name)
        if adapter.rank > self.max_lora_rank:
            raise ValueError(
                f"adapter {name!r}: rank {adapter.rank} is above max_lora_rank="
                f"{self.max_lora_rank}; pass LLM(max_lora_rank={adapter.rank}) or more"
            )
        k = self._next
        self._next += 1
        self._ids[name] = k
        self._host[k] = adapter
        return k

    def remove(self, name: str, busy: int) -> None:
        """Unregisters adapter ``name`` and frees its slot; ``busy``: the unfinished
        requests that use it (refused unless 0). Raises ValueError for an unknown name."""
        k = self.id_of(name)
        if busy:
            raise ValueError(f"name: {busy} unfinished requests use adapter {name!r}")
        del self._ids[name], self._host[k]
        self._slot_of.pop(k, None)
        self._clock.pop(k, None)

    def id_of(self, name: Any) -> int:
        """The id of the adapter registered as ``name``; ValueError naming the known ones."""
        if name not in self._ids:
            known = ", ".join(map(repr, self._ids)) or "none (add_lora)"
            raise ValueError(f"lora: no adapter named {name!r}; registered: {known}")
        return self._ids[name]

    def check(self, adapter: Any) -> None:
        """``adapter``: an int >= 0; with LoRA slots, 0 or a registered adapter's id;
        otherwise 0 unless the model takes ``adapter_ids`` and has adapters of its own."""
        if isinstance(adapter, bool) or not isinstance(adapter, int | np.integer) or adapter < 0:
            raise TypeError(f"adapter: expected an int >= 0, got {adapter!r}")
        if not adapter:
            return
        if self.max_loras:
            if adapter not in self._host:
                raise ValueError(f"adapter: {adapter} is no registered adapter's id")
            return
        model = self.runner.model
        if not self.runner.takes_adapters:
            raise ValueError(
                f"adapter: {adapter}, but {type(model).__name__} takes no adapter_ids "
                "(its __call__ has no such argument); use 0"
            )
        if getattr(model, "lora_slots", None) == 0:
            raise ValueError(
                f"adapter: {adapter}, but the model has no LoRA slots: pass "
                "LLM(max_loras=N) and register adapters with add_lora"
            )

    def slots_for(self, ids: set[int]) -> dict[int, int]:
        """Each adapter id of a step -> its slot plus one (``adapter_ids``), loading the
        ones not held into free slots or those used least recently by none of ``ids``."""
        if not self.max_loras:
            return {k: k for k in ids}
        self._steps += 1
        for k in sorted(ids - set(self._slot_of)):
            taken = set(self._slot_of.values())
            free = [s for s in range(self.max_loras) if s not in taken]
            if free:
                slot = free[0]
            else:
                evict = min(
                    (j for j in self._slot_of if j not in ids),
                    key=lambda j: self._clock.get(j, 0),
                )
                slot = self._slot_of.pop(evict)
            self._write_slot(slot, self._host[k])
            self._slot_of[k] = slot
        for k in ids:
            self._clock[k] = self._steps
        return {k: self._slot_of[k] + 1 for k in ids}

    def _write_slot(self, slot: int, adapter) -> None:
        """Puts ``adapter`` in device slot ``slot`` (new bank arrays in the weights the
        step takes; a step still running keeps reading the old ones)."""
        weights = list(self.runner.weights)
        split = self.runner.model.lora.per_layer
        arrays = {
            name: tuple(weights[i] for i in at) if split else weights[at[0]]
            for name, at in self._bank_leaves.items()
        }
        new = self.runner.model.lora_slot_arrays(adapter, slot, arrays)
        for name, value in new.items():
            for i, v in zip(self._bank_leaves[name], value if split else (value,), strict=True):
                weights[i] = v
        self.runner.weights = tuple(weights)
