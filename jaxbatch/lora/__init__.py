"""LoRA adapters, one feature package: files, device layers, slots, the engine's hooks, the
server's routes.

  adapters.py  reading a PEFT directory or a GGUF adapter into host arrays (numpy only)
  slots.py     which adapter holds which device slot (host only: the scheduler admits by it)
  runtime.py   the engine's adapters by name, written into slots before a step (LoRAAdapters)
  layers.py    the jitted side: slot arrays, per-row deltas inside the model's matmuls (jax)
  admin.py     the server's load / unload routes

The face is lazy, so that importing `jaxbatch.lora.slots` from the host-only scheduler, or the
admin routes from the server, never imports jax.
"""

from __future__ import annotations

import importlib
from typing import Any

_FACE = {
    "LoRAAdapter": "adapters", "LoRALoadError": "adapters", "load_adapter": "adapters",
    "adapted_leaves": "adapters", "LoRASlots": "slots", "LoRAAdapters": "runtime",
}
__all__ = sorted(_FACE)


def __getattr__(name: str) -> Any:
    if name not in _FACE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_FACE[name]}"), name)
