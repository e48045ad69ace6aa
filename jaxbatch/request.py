"""One request type, one status enum, progress as counters; and the outputs users get back."""

from __future__ import annotations

import dataclasses
import enum
import time

from jaxbatch.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; its KV is recomputed
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


@dataclasses.dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = dataclasses.field(default_factory=time.time)
    prompt: str | None = None
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    # Progress: how many of all_token_ids have their KV in the cache. The scheduler always runs
    # the tokens still owed, so prefill, chunked prefill, recompute and decode are one path.
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    page_table: list[int] = dataclasses.field(default_factory=list)
    num_preemptions: int = 0
    auto_seed: int = 0  # drawn by the engine at arrival; used when sampling_params.seed is None
    stop_reason: int | str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # per generated token, if asked: {token_id: Logprob} with the top-n and the sampled token
    logprobs: list[dict[int, Logprob]] = dataclasses.field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without concatenating prompt and output (hot path)."""
        n_p = len(self.prompt_token_ids)
        if end <= n_p:
            return self.prompt_token_ids[start:end]
        if start >= n_p:
            return self.output_token_ids[start - n_p : end - n_p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_owed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None

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
