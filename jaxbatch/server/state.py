"""What the server's handlers share: the engine (only through AsyncEngine), what parsing needs
to know of the model, and the HTTP limits."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any

from aiohttp import web

from jaxbatch.api.protocol import RequestLimits
from jaxbatch.api.response_store import ResponseStore
from jaxbatch.server.async_engine import AsyncEngine
from jaxbatch.server.metrics import ServerMetrics


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """The server's protection against load and abuse (`jaxbatch serve` flags in brackets)."""

    # 429 (with Retry-After) when this many engine requests already wait; a 400 for one request
    # of more prompts x n than this, which could never wait [--max-waiting-requests]
    max_waiting_requests: int | None = 256
    # open connections beyond this are answered 503 (Retry-After) and closed [--max-connections]
    max_connections: int = 1024
    # a connection must send a request's headers within this many seconds of opening or of its
    # previous response, else it is closed (idle keep-alive connections too) [--header-timeout]
    header_timeout: float = 15.0
    # the body must arrive within this many seconds of the headers, else 408 [--body-timeout]
    body_timeout: float = 30.0
    # /health is 503 when no engine step has completed for this long with work pending
    step_timeout: float = 60.0  # [--step-timeout]
    # per request: body size (413), JSON depth, stop strings ... [--max-request-body-bytes ...]
    request: RequestLimits = RequestLimits()


@dataclasses.dataclass
class ServerState:
    engine: AsyncEngine
    served_names: list[str]
    metrics: ServerMetrics
    tokenizer: Any  # a transformers tokenizer, or None (token-id prompts only)
    max_model_len: int
    api_key: str | None = None
    limits: ServerLimits = ServerLimits()
    # JSON decoding, tokenisation and chat templates run here, off the event loop
    parse_pool: concurrent.futures.ThreadPoolExecutor | None = None
    draining: bool = False
    # /v1/models' account of the engine's numerics: whether a request's tokens are independent
    # of its batch, and why (tuning/invariance.py InvarianceChoice.describe())
    determinism: dict | None = None
    # --reasoning-parser (api/reasoning.py): chat answers' reasoning as reasoning_content
    reasoning_parser: str | None = None
    # --tool-call-parser (api/tool_parsers/): the format of the model's tool calls, resolved at
    # start (the flag, else the one the chat template shows)
    tool_call_parser: str | None = None
    # the engine's LoRA adapters, {name: path} (a request names one as its `model`); None:
    # the engine has no LoRA slots (enable_lora off). Changed only on the event loop.
    lora_modules: dict[str, str] | None = None
    # /v1/embeddings' view of the model (server/embeddings.py EmbeddingModel); None: an engine
    # that cannot embed (a test's fake)
    embedding_model: Any = None
    # /v1/responses kept for previous_response_id and GET / DELETE (api/response_store.py)
    responses: ResponseStore = dataclasses.field(default_factory=ResponseStore)

    def model_names(self) -> list[str]:
        """Every name a request's `model` may take: the served names, then the adapters."""
        return [*self.served_names, *(self.lora_modules or {})]


STATE = web.AppKey("state", ServerState)
# several models on one server (jaxbatch/multimodel/): the state of the model a request names,
# set by that server's routing middleware before the handler runs
MODEL_STATE = web.RequestKey("model_state", ServerState)


def state_of(request: web.Request) -> ServerState:
    """The state a handler serves the request with: its model's (a server of several models),
    else the app's one."""
    st = request.get(MODEL_STATE)
    return st if st is not None else request.app[STATE]
REQUEST_ID = web.RequestKey("request_id", str)  # the id a 500 body and its log line carry
