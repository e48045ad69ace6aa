"""POST /v1/embeddings: read, parse (off the event loop), one engine embedding request per input
(engine/pooling.py: prefill-only through the same bucketed steps as generation), answer in
OpenAI's shape (api/embeddings.py). The model's pooling mode is read once, at the first request
(its sentence-transformers config or GGUF metadata): a model that pools other than by its last
token is refused by name rather than answered with the wrong vector.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import uuid
from typing import Any

import numpy as np
from aiohttp import web

from jaxbatch.api import embeddings as api
from jaxbatch.api import protocol as protocol
from jaxbatch.api.protocol import ApiError
from jaxbatch.engine.pooling import EMBED_PARAMS, pooling_mode
from jaxbatch.server.async_engine import EngineDeadError, QueueFullError
from jaxbatch.server.generate import results
from jaxbatch.server.middleware import read_json_body
from jaxbatch.server.state import REQUEST_ID, ServerState, state_of


@dataclasses.dataclass
class EmbeddingModel:
    """What /v1/embeddings needs of the served model: its width and where its files are."""

    hidden_size: int
    source: str  # the loader's file or directory (its pooling config is read from it)
    mode: str | None = None  # its pooling mode, once read

    @classmethod
    def of(cls, engine: Any) -> EmbeddingModel | None:
        """From an Engine (one replica of a data-parallel set); None for anything else."""
        first = (getattr(engine, "replicas", None) or [engine])[0]
        model = getattr(first, "model", None)
        if model is None or not hasattr(model, "arch"):
            return None
        return cls(model.arch.hidden_size, model.source)

    def check_pooling(self) -> None:
        if self.mode is None:
            self.mode = pooling_mode(self.source)
        if self.mode != "last":
            raise protocol.bad_request(
                f"this model pools its embeddings by {self.mode!r} (its pooling config); this "
                f"server embeds by the last token only", "model", "unsupported_model")


def _parse(st: ServerState, em: EmbeddingModel, raw: bytes) -> api.EmbeddingRequest:
    em.check_pooling()
    body = protocol.load_json_body(raw, st.limits.request)
    return api.parse_embedding_request(body, st.tokenizer, st.max_model_len, em.hidden_size,
                                       st.model_names(), st.limits.request)


def served(request: web.Request) -> tuple[ServerState, EmbeddingModel]:
    """The server's state and its embedding model; 503 while draining, 404 without one."""
    st = state_of(request)
    if st.draining:
        raise ApiError(503, "the server is shutting down", "server_error")
    if st.embedding_model is None:
        raise ApiError(404, "this server's engine does not serve embeddings",
                       "invalid_request_error")
    return st, st.embedding_model


async def pooled_states(st: ServerState, response_id: str, inputs: list[list[int]]
                        ) -> list[np.ndarray]:
    """One engine embedding request per input -> their pooled states f32[H], in input order."""
    prompts = [{"prompt_token_ids": ids} for ids in inputs]
    try:
        stream = await st.engine.add(response_id, prompts, EMBED_PARAMS, embed=True)
    except ValueError as e:  # the engine refused an input (a token id out of range, KV capacity)
        raise protocol.bad_request(str(e), "input") from None
    except QueueFullError as e:
        raise ApiError(429, str(e), "rate_limit_error", None, "rate_limit_exceeded") from None
    except EngineDeadError as e:
        raise ApiError(503, str(e), "server_error") from None
    try:
        outs = await results(stream, response_id)
    finally:
        stream.close()  # aborts whatever did not finish (client gone, error)
    pooled = [o.pooled for o in outs]
    if any(p is None for p in pooled):  # never expected: a finished embedding has its state
        raise ApiError(500, f"internal error (request id {response_id})", "server_error")
    return pooled


async def embeddings(request: web.Request) -> web.Response:
    st, em = served(request)
    response_id = request[REQUEST_ID] = f"embd-{uuid.uuid4().hex}"
    raw = await read_json_body(request, st)
    loop = asyncio.get_running_loop()
    parsed = await loop.run_in_executor(st.parse_pool, functools.partial(_parse, st, em, raw))
    model = parsed.model or st.served_names[0]
    pooled = await pooled_states(st, response_id, parsed.inputs)
    body = await loop.run_in_executor(
        st.parse_pool, functools.partial(api.embedding_response, parsed, pooled, model))
    return web.json_response(body)
