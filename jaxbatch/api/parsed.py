"""A request body as the engine takes it: what protocol.py's parsers return and responses.py
reads (below both, so neither imports the other)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxbatch.core.sampling_params import SamplingParams


@dataclasses.dataclass
class ParsedRequest:
    kind: str  # "completion" | "chat"
    model: str | None
    # engine prompts, one per choice: {"prompt_token_ids": [...], "prompt": str | None}
    prompts: list[dict[str, Any]]
    # shared by every prompt; max_tokens None means "the room left in the context" per prompt
    sampling_params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    top_logprobs: int | None = None  # None: no logprobs; else top-n per token (0: sampled only)
    echo: bool = False  # completions: the prompt (and its logprobs) before each choice
    prompt_logprobs: int | None = None  # as the body asked (echo with logprobs computes them too)
    tool_calls: bool = False  # chat with tools: the output is read for calls (tool_parsers/)
    tool_parser: str = "hermes"  # the calls' format (a tool_parsers name)
    tools: list[dict[str, Any]] | None = None  # the request's tools (their schemas type values)
    # chat with a reasoning parser (reasoning.py): its name, and where the output starts (the
    # reader's state after the prompt: reasoning.start_state)
    reasoning_parser: str | None = None
    reasoning_start: str = "start"
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on each chunk
