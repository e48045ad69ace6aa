"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter, as vLLM serves them.

Bodies: {"lora_name": ..., "lora_path": ...} and {"lora_name": ...}; answers are vLLM's plain
text ("Success: LoRA adapter 'x' added successfully.") or OpenAI-shaped errors (400: a missing
field, an adapter already loaded or unknown, one that does not fit the model, one in use). The
routes read a path on the server's machine, so they exist only when the engine has LoRA slots
(--enable-lora) and runtime updates are allowed, as vLLM gates them:
JAXBATCH_ALLOW_RUNTIME_LORA_UPDATING=1 (or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=True); the
server logs a warning at start when they are (`warn_if_allowed`). The adapter is read and
converted in an executor thread (lora/runtime.py's `read_for`: the engine keeps stepping) and
the finished adapter handed to the engine between steps (host memory only: it reaches a device
slot when a request uses it); loading never compiles.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from aiohttp import web

from jaxbatch.api import protocol as protocol
from jaxbatch.server.middleware import read_json_body
from jaxbatch.server.state import STATE

ALLOW_ENV = ("JAXBATCH_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")
log = logging.getLogger("jaxbatch.server")


def runtime_updates_allowed() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true") for v in ALLOW_ENV)


def warn_if_allowed(api_key: str | None) -> bool:
    """Log a warning when the load route is on (it makes the server read any path its clients
    name); True when it is."""
    if not runtime_updates_allowed():
        return False
    log.warning("runtime LoRA updating is on (%s): POST /v1/load_lora_adapter reads a path on "
                "this machine that the client names%s; keep it off where clients are not "
                "trusted", next(v for v in ALLOW_ENV if os.environ.get(v)),
                "" if api_key else ", and this server has no API key")
    return True


def served_adapters(engine: Any) -> dict[str, str] | None:
    """The engine's adapters {name: path}, or None when it has no LoRA slots."""
    config = getattr(engine, "config", None)
    lora = getattr(config, "lora", None)
    if lora is None or not lora.enable_lora or not hasattr(engine, "lora_modules"):
        return None
    return dict(engine.lora_modules())


async def _body(request: web.Request, fields: tuple[str, ...]) -> dict[str, str]:
    st = request.app[STATE]
    body = protocol.load_json_body(await read_json_body(request, st), st.limits.request)
    if not isinstance(body, dict):
        raise protocol.bad_request("the body must be a JSON object")
    out = {}
    for f in fields:
        v = body.get(f)
        if not isinstance(v, str) or not v:
            raise protocol.bad_request(f"'{f}' must be a non-empty string", f)
        out[f] = v
    return out


async def load_lora_adapter(request: web.Request) -> web.Response:
    st = request.app[STATE]
    body = await _body(request, ("lora_name", "lora_path"))
    name, path = body["lora_name"], body["lora_path"]
    if name in st.model_names():
        raise protocol.bad_request(f"The lora adapter '{name}' has already been loaded.",
                                   "lora_name")
    from jaxbatch.lora.adapters import LoRALoadError
    from jaxbatch.lora.runtime import read_for

    def add(engine: Any) -> None:
        engine.add_lora(adapter)

    try:  # read and converted off the engine thread; only the hand-over runs between steps
        adapter = await asyncio.get_running_loop().run_in_executor(
            None, read_for, st.engine.engine, name, path)
        await st.engine.call(add)
    except (ValueError, LoRALoadError) as e:
        raise protocol.bad_request(str(e), "lora_path") from None
    assert st.lora_modules is not None
    st.lora_modules[name] = path
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    st = request.app[STATE]
    name = (await _body(request, ("lora_name",)))["lora_name"]
    def remove(engine: Any) -> None:
        engine.remove_lora(name)

    try:
        await st.engine.call(remove)
    except ValueError as e:
        raise protocol.bad_request(str(e), "lora_name") from None
    assert st.lora_modules is not None
    st.lora_modules.pop(name, None)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

