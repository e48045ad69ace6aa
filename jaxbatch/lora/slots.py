"""Which LoRA adapter each device slot holds while requests run (host only: never imports jax).

The device has `num_slots` adapter slots (lora/layers.py; slot 0 is the base model). A
request with an adapter takes a slot when the scheduler admits it and gives it back when it
finishes or is preempted; requests of the same adapter share its slot. An adapter not in a slot
gets one that no running request uses (an empty one first, else the least recently used), and
the engine writes its weights there before the step runs (`take_loads`). While every slot is
busy with other adapters, a request of a further adapter waits and the scheduler admits the
requests behind it that can run (vLLM's rule): nothing is dropped, it runs when a slot frees.

Adapters are identified by a key unique to one load (the engine's `lora:{name}:{n}`, also the
request's prefix-cache key), so an adapter unloaded and loaded again under the same name never
reuses the old weights.
"""

from __future__ import annotations

import itertools

from jaxbatch.core.request import Request


class LoRASlots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.keys: list[str | None] = [None] * (num_slots + 1)  # [0] unused: the base model
        self.users = [0] * (num_slots + 1)
        self._last_used = [0] * (num_slots + 1)
        self._clock = itertools.count(1)
        self._loads: list[tuple[int, str]] = []
        self._retired: set[str] = set()  # unloaded adapters: their slot is never matched again

    @staticmethod
    def key_of(req: Request) -> str | None:
        return req.prefix_cache_key if req.lora_name is not None else None

    def can_place(self, req: Request) -> bool:
        """Whether `acquire` would succeed now."""
        key = self.key_of(req)
        return key is None or self._resident(key) is not None or self._free_slot() is not None

    def acquire(self, req: Request) -> bool:
        """Give a request being admitted its adapter's slot (loading it where needed); False,
        and no change, when no slot can take it."""
        key = self.key_of(req)
        if key is None:
            req.lora_slot = 0
            return True
        slot = self._resident(key)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return False
            old = self.keys[slot]
            if old is not None:
                self._retired.discard(old)
            self.keys[slot] = key
            self._loads.append((slot, key))
        self.users[slot] += 1
        self._last_used[slot] = next(self._clock)
        req.lora_slot = slot
        return True

    def release(self, req: Request) -> None:
        """A request leaves the running set (finished, preempted): its slot may be reused."""
        if req.lora_slot:
            self.users[req.lora_slot] -= 1
            assert self.users[req.lora_slot] >= 0, req.request_id
            req.lora_slot = 0

    def retire(self, key: str) -> None:
        """The adapter was unloaded: its slot is not matched for new requests (running ones keep
        using it until they finish) and is the first to be reused."""
        if key in self.keys:
            self._retired.add(key)

    def take_loads(self) -> list[tuple[int, str]]:
        """(slot, key) pairs whose weights must be written before the next step."""
        loads, self._loads = self._loads, []
        return loads

    def _resident(self, key: str) -> int | None:
        if key in self._retired:
            return None
        try:
            return self.keys.index(key, 1)
        except ValueError:
            return None

    def _free_slot(self) -> int | None:
        idle = [s for s in range(1, self.num_slots + 1) if self.users[s] == 0]
        if not idle:
            return None
        empty = [s for s in idle if self.keys[s] is None or self.keys[s] in self._retired]
        return empty[0] if empty else min(idle, key=lambda s: self._last_used[s])
