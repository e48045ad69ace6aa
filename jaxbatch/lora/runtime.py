"""The engine's LoRA adapters: which are loaded (by name), and writing them into device slots.

Loading an adapter (`add`) only reads it into host memory (lora/adapters.py); it reaches a device
slot when the scheduler admits a request that uses it (lora/slots.py), written by the
runner's compiled slot writer before that step runs (`write_pending`), so serving never
compiles for it. An adapter is unloaded only while no unfinished request uses it: nothing that
was accepted loses its adapter half-way.

The server's load route reads and converts an adapter off the engine thread (`read_for`, in an
executor thread: file reads, GGUF dequantisation, row splits) and hands the finished adapter to
the engine between steps (`Engine.add_lora`), so loading never stalls the streams being served.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from typing import Any

from jaxbatch.core.request import Request, lora_cache_key
from jaxbatch.lora.adapters import LoRAAdapter, load_adapter
from jaxbatch.lora.slots import LoRASlots

log = logging.getLogger("jaxbatch")


def read_for(engine: Any, name: str, path: str) -> LoRAAdapter:
    """`name` read from `path` and checked against `engine`'s model and slot rank (a
    ReplicaRouter: its first replica's; every replica serves the same model): host work only,
    for any thread (the engine's arch and config never change); LoRALoadError saying why it
    does not fit. Hand the result to engine.add_lora on the engine thread."""
    one = getattr(engine, "replicas", [engine])[0]
    return load_adapter(name, path, one.arch, one.config.lora.max_lora_rank)


class LoRAAdapters:
    def __init__(self, slots: LoRASlots, runner) -> None:
        self.slots = slots
        self.runner = runner
        self.by_name: dict[str, LoRAAdapter] = {}
        self.keys: dict[str, str] = {}  # name -> key of this load (also its prefix-cache key)
        self._by_key: dict[str, LoRAAdapter] = {}
        self._loads = itertools.count(1)

    def add(self, adapter: LoRAAdapter) -> None:
        if adapter.name in self.by_name:
            raise ValueError(f"The lora adapter '{adapter.name}' has already been loaded.")
        key = lora_cache_key(adapter.name, next(self._loads))
        self.by_name[adapter.name] = adapter
        self.keys[adapter.name] = key
        self._by_key[key] = adapter
        log.info("LoRA adapter %r loaded from %s (rank %d, %s)", adapter.name, adapter.path,
                 adapter.rank, ", ".join(adapter.modules))

    def remove(self, name: str, unfinished: Iterable[Request], check_only: bool = False) -> None:
        """Unload `name`; ValueError when it is unknown or unfinished requests still use it."""
        if name not in self.by_name:
            raise ValueError(f"The lora adapter '{name}' cannot be found.")
        key = self.keys[name]
        users = sum(1 for r in unfinished if r.lora_name is not None
                    and r.prefix_cache_key == key)
        if users:
            raise ValueError(f"The lora adapter '{name}' is in use by {users} unfinished "
                             f"request(s); unload it when they have finished.")
        if check_only:
            return
        del self.by_name[name], self.keys[name], self._by_key[key]
        self.slots.retire(key)
        log.info("LoRA adapter %r unloaded", name)

    def key(self, name: str) -> str:
        """The key requests of `name` carry; ValueError for an adapter not loaded."""
        if name not in self.keys:
            raise ValueError(f"The lora adapter '{name}' cannot be found (loaded: "
                             f"{sorted(self.keys) or 'none'}).")
        return self.keys[name]

    def write_pending(self) -> None:
        """Write the adapters the last schedule placed into slots (before its step runs)."""
        for slot, key in self.slots.take_loads():
            adapter = self._by_key[key]
            self.runner.load_lora(slot, adapter.weights, adapter.scale)
