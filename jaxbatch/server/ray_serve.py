"""jaxbatch's OpenAI server as a Ray Serve application: N engine replicas behind Serve's HTTP
proxy, each request routed to the replica that served its prompt's prefix before.

    import ray
    from ray import serve
    from jaxbatch.server.ray_serve import build_app

    ray.init(address="auto")
    serve.run(build_app({"model": "/models/model.gguf"}, num_replicas=4), route_prefix="/")

Each replica (`EngineReplica`, one Ray actor) builds one engine and runs jaxbatch's own server
on a local port, so every route, streaming, error body, limit and metric is `jaxbatch serve`'s;
the ingress (`OpenAIIngress`) forwards each HTTP request to a replica through a deployment
handle and streams the answer back (the replica's id in the `x-jaxbatch-replica` header).

Routing (`PrefixAffinityRouter`, a Serve request router): the prompt's text (a completion's
`prompt`, a chat's messages) is hashed at a few prefix lengths; a request goes to the replica
that was last sent the longest of its prefixes, so a conversation's turns and the requests
sharing a system prompt meet that replica's prefix cache, unless that replica's queue is longer
than the shortest by more than `imbalance` requests; otherwise (and for prompts shorter than the
shortest prefix) to the least loaded replica. Needs Ray with Serve (`pip install "ray[serve]"`).

API key: `build_app(api_key=...)`, else $JAXBATCH_API_KEY where build_app runs, as `jaxbatch
serve` takes it. Each replica's server requires it on /v1/* (the ingress forwards the client's
Authorization header), so a client without it gets serve's 401 and a process on a replica's node
that calls the replica's local port directly needs it too. Without a key build_app logs a
warning: Serve's proxy then serves the model to whoever reaches it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any

log = logging.getLogger("jaxbatch.server")
_HOP = {"content-length", "transfer-encoding", "connection", "keep-alive", "host"}


def _router_class() -> type:
    # Serve finds a request router by its module and name: its own module, which imports Ray
    from jaxbatch.server.ray_serve_router import PrefixAffinityRouter

    return PrefixAffinityRouter


class EngineReplica:
    """One engine and jaxbatch's server on 127.0.0.1 (its own thread and event loop)."""

    def __init__(self, engine_kwargs: dict[str, Any], served_model_name: str | None = None,
                 api_key: str | None = None) -> None:
        from jaxbatch.config import EngineConfig
        from jaxbatch.executor.replicas import build_engine
        from jaxbatch.server.app import Server

        engine = build_engine(EngineConfig.from_flat(**engine_kwargs))
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="jaxbatch-server",
                         daemon=True).start()
        names = [served_model_name] if served_model_name else None
        self._server = asyncio.run_coroutine_threadsafe(
            Server.start(engine, "127.0.0.1", 0, names, api_key), self._loop).result()
        try:
            from ray import serve

            self._id = str(serve.get_replica_context().replica_id.unique_id)
        except Exception:  # noqa: BLE001 - outside Serve (tests): no id
            self._id = "local"
        self._session: Any = None

    async def proxy(self, method: str, path: str, headers: dict[str, str], body: bytes):
        """The local server's answer: first (status, headers), then the body in chunks."""
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        fwd = {k: v for k, v in headers.items() if k.lower() not in _HOP}
        async with self._session.request(method, self._server.url + path, headers=fwd,
                                         data=body) as resp:
            out = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
            out["x-jaxbatch-replica"] = self._id
            yield resp.status, out
            async for chunk in resp.content.iter_any():
                yield chunk


class OpenAIIngress:
    """Serve's HTTP requests -> an engine replica (streamed both ways)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine.options(stream=True)

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import StreamingResponse

        body = await request.body()
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        gen = self._engine.proxy.remote(request.method, path, dict(request.headers), body)
        status, headers = await gen.__anext__()

        async def rest():
            async for chunk in gen:
                yield chunk

        return StreamingResponse(rest(), status_code=status, headers=headers)


def build_app(engine_kwargs: dict[str, Any], num_replicas: int = 2,
              served_model_name: str | None = None, cpus_per_replica: float = 1.0,
              imbalance: int = 4, api_key: str | None = None) -> Any:
    """The Serve application: `num_replicas` EngineReplicas (engine options as `LLM(...)` takes
    them) routed by prefix, behind one OpenAIIngress. serve.run(app, route_prefix="/").
    `api_key` (default: $JAXBATCH_API_KEY here; an empty one is none): what every replica
    requires on /v1/*."""
    from jaxbatch.cli.serve import API_KEY_ENV

    api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
    if not api_key:
        log.warning("the Ray Serve application has no API key (api_key= or $%s): whoever "
                    "reaches Serve's HTTP proxy can use the model", API_KEY_ENV)
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    router: Any = RequestRouterConfig(request_router_class=_router_class(),  # type: ignore[arg-type]
                                      request_router_kwargs={"imbalance": imbalance})
    engines: Any = serve.deployment(EngineReplica, name="jaxbatch-engine",
                                    num_replicas=num_replicas,
                                    ray_actor_options={"num_cpus": cpus_per_replica},
                                    max_ongoing_requests=1024, request_router_config=router)
    ingress: Any = serve.deployment(OpenAIIngress, name="jaxbatch-openai",
                                    ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
    return ingress.bind(engines.bind(dict(engine_kwargs), served_model_name, api_key))
