"""What users get back: RequestOutput with one CompletionOutput per choice (vLLM's shape)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class RequestMetrics:
    """time.time() stamps: arrival (the engine's add, or the caller's NewRequest.arrival_time),
    first scheduled (its first step: arrival to it is its queue time), first token, finish."""
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    first_scheduled_time: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    # per token: {token_id: Logprob} holding the sampled token and the top-n
    logprobs: list[dict[int, Logprob]] | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # streaming: the text and token ids added since the previous output of this request
    delta_text: str = ""
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)
    # set when the engine failed this request (finish_reason "error"); the front end answers it
    # as an internal error, never as a normal completion
    error: str | None = None
    # when asked (SamplingParams.prompt_logprobs), vLLM's shape: None for the first prompt token,
    # then {token id: Logprob} per prompt token, the token itself with its rank and the top-n
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # an embedding request's (NewRequest.embed) last hidden state at its prompt's last position,
    # f32[H] after the final norm (engine/pooling.py); None for every other request
    pooled: Any = None


@dataclasses.dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclasses.dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding (vLLM's `LLM.embed` output shape)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput


def logprob_dict(tok: int, chosen: float, top: list[tuple[int, float]]) -> dict[int, Logprob]:
    """A sampled token's logprobs in vLLM's shape: the top-n by rank, plus the sampled token when
    it is not among them."""
    d = {t: Logprob(lp, rank=r + 1) for r, (t, lp) in enumerate(top)}
    d.setdefault(tok, Logprob(chosen))
    return d
