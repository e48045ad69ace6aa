"""POST /v1/embeddings bodies in OpenAI's shape (vLLM's and llama.cpp's too), host only.

  {model?, input, encoding_format = "float", dimensions?, user?, add_special_tokens = true}
  input: a string, a list of strings, a list of token ids, or a list of token-id lists
  -> {"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
      "usage": {"prompt_tokens", "total_tokens"}}

Each input is one engine request (engine/pooling.py): its last prompt position's hidden state
after the final norm, cut to `dimensions` (matryoshka models such as Qwen3-Embedding are
trained so that a leading slice embeds on its own), then L2-normalised, as vLLM's embedding
pooler does (truncate, then normalise). `encoding_format: "base64"` is the float32 values,
little-endian, base64-encoded: what the `openai` client asks for by default and decodes. Strings
are tokenised with the tokenizer's special tokens (`add_special_tokens`, vLLM's field), which
for Qwen3-Embedding appends the end-of-text token its pooling reads.
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxbatch.api.body import DEFAULT_LIMITS, RequestLimits, bad_request
from jaxbatch.api.protocol import _check_keys, _check_model, _get, _int_list
from jaxbatch.core.prompts import encode_text
from jaxbatch.core.sampling_params import show

_KEYS = {"model", "input", "encoding_format", "dimensions", "add_special_tokens"}
ENCODINGS = ("float", "base64")


@dataclasses.dataclass(frozen=True)
class EmbeddingRequest:
    model: str | None
    inputs: list[list[int]]  # token ids, one list per input
    encoding_format: str
    dimensions: int | None


def parse_embedding_request(body: Any, tokenizer: Any, max_model_len: int,
                            hidden_size: int | None, served_models: Sequence[str] | None = None,
                            limits: RequestLimits = DEFAULT_LIMITS, context: int | None = None,
                            truncate: bool = False) -> EmbeddingRequest:
    """A /v1/embeddings body -> its inputs as token ids; ApiError (400/404) on a bad body.
    `hidden_size` None (an engine that does not tell, Ray replicas): `dimensions` is checked
    against the pooled state's width when the response is built. An input longer than
    `context` tokens (at most, and by default, max_model_len - 1: the engine runs one token
    after the prompt) is a 400, or with `truncate` cut to its first `context` tokens (Ollama's
    `truncate` and `num_ctx`)."""
    body = _check_keys(body, _KEYS, limits)
    model = _check_model(body, served_models)
    fmt = _get(body, "encoding_format", str, "float")
    if fmt not in ENCODINGS:
        raise bad_request(f"'encoding_format' must be one of {list(ENCODINGS)}, got {show(fmt)}",
                          "encoding_format")
    dims = _get(body, "dimensions", int)
    if dims is not None and not 1 <= dims <= (hidden_size or dims):
        raise bad_request(f"'dimensions' must be between 1 and this model's "
                          f"{hidden_size or 'width'}, got {dims}", "dimensions")
    special = _get(body, "add_special_tokens", bool, True)
    inputs = [_ids(x, tokenizer, special) for x in _inputs(body.get("input"), limits)]
    most = max_model_len - 1 if context is None else min(context, max_model_len - 1)
    for i, ids in enumerate(inputs):
        if not ids:
            raise bad_request(f"input {i} is empty", "input")
        if len(ids) > most and truncate:
            inputs[i] = ids[:most]
        elif len(ids) > most:
            raise bad_request(f"This model's maximum context length is {max_model_len} tokens; "
                              f"input {i} has {len(ids)} (at most {most} can be embedded)",
                              "input", "context_length_exceeded")
    return EmbeddingRequest(model, inputs, fmt, dims)


def _inputs(value: Any, limits: RequestLimits) -> list[str | list[int]]:
    """`input` -> one item per embedding: a string or a token-id list."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, list) and value and all(isinstance(t, int) and
                                                   not isinstance(t, bool) for t in value):
        items = [value]  # one input given as token ids
    elif isinstance(value, list) and value:
        items = value
    else:
        raise bad_request("'input' must be a non-empty string, a list of strings, a list of "
                          "token ids or a list of token-id lists", "input")
    if len(items) > limits.max_prompts_per_request:
        raise bad_request(f"'input' holds {len(items)} inputs; at most "
                          f"{limits.max_prompts_per_request} are allowed per request", "input")
    for i, x in enumerate(items):
        if isinstance(x, list):
            _int_list(x, "input", f"a list of strings or token-id lists (input {i} is not)")
        elif not isinstance(x, str):
            raise bad_request(f"input {i} must be a string or a list of token ids, got "
                              f"{show(x)}", "input")
    return items


def _ids(x: str | list[int], tokenizer: Any, special: bool) -> list[int]:
    if isinstance(x, list):
        return x
    if tokenizer is None:
        raise bad_request("this model has no tokenizer: give 'input' as token ids", "input")
    if not x:
        raise bad_request("'input' cannot hold an empty string", "input")
    try:
        return encode_text(tokenizer, x, special)
    except Exception as e:  # noqa: BLE001 - the text is the caller's: a 400, with no repr
        raise bad_request(f"the tokenizer could not encode this input ({type(e).__name__})",
                          "input") from None


def finish(pooled: np.ndarray, dimensions: int | None = None, normalize: bool = True
           ) -> np.ndarray:
    """A pooled hidden state f32[H] -> the embedding: its first `dimensions` values, then
    L2-normalised (a zero vector stays zero)."""
    v = np.asarray(pooled, np.float32)[:dimensions]
    if normalize:
        norm = float(np.linalg.norm(v))
        v = v / np.float32(max(norm, 1e-12))
    return v


def encode(v: np.ndarray, fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(np.asarray(v, "<f4").tobytes()).decode("ascii")
    return [float(x) for x in v]


def embedding_response(req: EmbeddingRequest, pooled: Sequence[np.ndarray], model: str
                       ) -> dict[str, Any]:
    """The response body for the inputs' pooled states (in input order)."""
    n = sum(len(ids) for ids in req.inputs)
    width = min(len(p) for p in pooled)
    if req.dimensions is not None and req.dimensions > width:
        raise bad_request(f"'dimensions' must be between 1 and this model's {width}, got "
                          f"{req.dimensions}", "dimensions")
    data = [{"object": "embedding", "index": i,
             "embedding": encode(finish(p, req.dimensions), req.encoding_format)}
            for i, p in enumerate(pooled)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": n, "total_tokens": n}}
