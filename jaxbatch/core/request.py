"""One request type, one status enum, progress as counters (host only)."""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Any

from jaxbatch.core.outputs import Logprob
from jaxbatch.core.prompts import Prompt
from jaxbatch.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; its KV is recomputed
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the engine could not run this request (Request.error says why)

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
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
    # Prefix caching: prompt tokens served from the cache at first admission (vLLM's name); the
    # extra key of the hash chain (anything besides the token ids that changes the KV: a LoRA or
    # model id, a cache salt); and the hash chain of this request's full pages, grown lazily
    # (tokens are only ever appended, so it stays valid across steps and preemptions).
    num_cached_tokens: int = 0
    prefix_cache_key: str = ""
    # LoRA: the adapter's name (None: the base model) and the device slot it holds while it runs
    # (lora/slots.py; 0: none)
    lora_name: str | None = None
    lora_slot: int = 0
    # its recurrent-state slot while running, for hybrid models (core/state_slots.py; 0: none)
    state_slot: int = 0
    # with speculative decoding, the slot a step that verifies proposals writes (state_slots.py)
    spare_state_slot: int = 0
    page_hashes: list[bytes] = dataclasses.field(default_factory=list, repr=False)
    auto_seed: int = 0  # drawn by the engine at arrival; used when sampling_params.seed is None
    stop_reason: int | str | None = None
    error: str | None = None  # set with FINISHED_ERROR
    first_scheduled_time: float | None = None  # the first step that ran it (the engine sets it)
    first_token_time: float | None = None
    finish_time: float | None = None
    # per generated token, if asked: {token_id: Logprob} with the top-n and the sampled token
    logprobs: list[dict[int, Logprob]] = dataclasses.field(default_factory=list)
    # per prompt token, if asked (engine/prompt_logprobs.py): None first, then {token_id: Logprob}
    prompt_logprobs: list[dict[int, Logprob] | None] = dataclasses.field(default_factory=list)
    # Parallel sampling (n > 1, core/parallel_sampling.py): which choice this sequence is; the
    # choices waiting for this one to compute their shared prompt (then it computes all but the
    # prompt's last token, and they fork off it); the one this choice waits for.
    choice_index: int = 0
    forks: list[Request] = dataclasses.field(default_factory=list, repr=False, compare=False)
    fork_parent: Request | None = dataclasses.field(default=None, repr=False, compare=False)
    # an embedding request (NewRequest.embed): its pooled hidden state, f32[H], once the step
    # that computes its prompt's last position has run (engine/pooling.py)
    embed: bool = False
    pooled: Any = dataclasses.field(default=None, repr=False, compare=False)

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
    def num_tokens_to_compute(self) -> int:
        """Tokens whose KV this sequence computes before it samples: all of them, but the
        prompt's last one while choices wait to fork off it (each computes that one itself)."""
        return self.num_tokens - 1 if self.forks else self.num_tokens

    @property
    def num_tokens_owed(self) -> int:
        return self.num_tokens_to_compute - self.num_computed_tokens

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None


@dataclasses.dataclass(frozen=True)
class NewRequest:
    """What a caller hands `Engine.add_requests`: an id (None: the engine picks one), the
    prompt (text, token ids or a prompt dict; see core/prompts.py), its sampling params, and
    when it arrived (time.time(); None: when the engine adds it). A front end that queues
    requests before the engine sees them (the server's engine thread) stamps the arrival itself,
    so time to first token and queue time include that wait."""

    request_id: str | None
    prompt: Prompt
    sampling_params: SamplingParams | None = None
    arrival_time: float | None = None
    lora_name: str | None = None  # a LoRA adapter the engine has (None: the base model)
    # an embedding: run the prompt as one greedy token's request and hand back its last
    # position's hidden state (RequestOutput.pooled; engine/pooling.py), sampling_params ignored
    embed: bool = False


def lora_cache_key(name: str, load_id: int) -> str:
    """The prefix-cache key of one load of adapter `name` (its `load_id`: 1, 2, ... per engine,
    vLLM's lora_int_id): pages cached under it serve that load's requests only."""
    return f"lora:{name}:{load_id}"


def lora_id_of(prefix_cache_key: str) -> int | None:
    """The adapter load id in a key lora_cache_key made (KV events' `lora_id`); None for the
    base model's requests."""
    if not prefix_cache_key.startswith("lora:"):
        return None
    return int(prefix_cache_key.rpartition(":")[2])


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """vLLM's LoRARequest: an adapter by name, read from `lora_path` (a PEFT directory or a GGUF
    LoRA file) the first time a request uses it. `lora_int_id` is vLLM's numeric id, kept for
    callers that pass it; the name identifies the adapter here."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""
