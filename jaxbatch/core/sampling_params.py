"""SamplingParams in vLLM's shape, validated on construction.

Every value must be one the engine can represent in its step inputs, so the Python API
(`LLM.generate`) is protected as much as the OpenAI server: floats are finite and fit float32,
integers fit int32 (token ids, top_k, max_tokens, min_tokens) or 63 bits (seed). Penalties and
logit_bias follow OpenAI's / vLLM's ranges; that logit_bias ids are within the vocabulary is
checked by the engine, which knows it. A refusal is a ValueError "SamplingParams.<name>: <why>"
(the OpenAI protocol maps <name> to the error's `param`).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

from jaxbatch.core.structured_outputs import StructuredOutputsParams, structured_outputs_from

MAX_LOGPROBS = 20  # top-n logprobs are computed for a static n on device; requests ask for <= n
MAX_N = 128  # choices per prompt (OpenAI's limit); each runs as its own sequence
# While min_tokens is not reached, stop_token_ids and the model's EOS ids are banned. Up to
# MAX_BANNED_IDS of them ride in a small per-row array of the plain sampler; a row with more
# bans them through the dense bias of the adjusted sampler (worker/sampler.py): no limit.
MAX_BANNED_IDS = 8
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
MAX_PENALTY = 2.0  # OpenAI's range for presence_penalty / frequency_penalty: [-2, 2]
INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
MIN_TEMPERATURE = 1e-2  # vLLM's floor: 0 < temperature < 0.01 overflows the scaled logits


def show(value: Any, limit: int = 40) -> str:
    """A short, safe rendering of a caller's value for an error message: never a huge string
    (long text is cut), never str() of a huge int (which Python refuses past 4300 digits)."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        return repr(value) if value.bit_length() <= 64 else \
            f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        text = repr(value[:limit])  # repr escapes lone surrogates: the message stays valid
        return text if len(value) <= limit else f"{text[:-1]}...{text[-1]} ({len(value)} chars)"
    if isinstance(value, (list, tuple, dict)):
        return f"a {type(value).__name__} of {len(value)} items"
    return f"a value of type {type(value).__name__}"


def _is_int(x: Any) -> bool:
    if isinstance(x, bool):
        return False
    try:
        operator.index(x)  # int, numpy integers; not floats or strings
    except TypeError:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # choices (sequences) per prompt, sharing its KV: core/parallel_sampling.py
    temperature: float = 1.0  # 0: greedy; 0 < t < MIN_TEMPERATURE is raised to it (as vLLM)
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0  # OpenAI: - presence * (count in the output > 0)
    frequency_penalty: float = 0.0  # OpenAI: - frequency * count in the output
    repetition_penalty: float = 1.0  # HF/vLLM: seen (prompt or output) logits / p if > 0 else * p
    # token id -> bias added to its logit, in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]
    logit_bias: dict[int, float] | None = None
    prompt_logprobs: int | None = None  # top-n logprobs of each prompt token (vLLM's shape)
    # JSON schema, regex, choice or Lark grammar the output must match (or its dict of fields)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}: {why}")

        object.__setattr__(self, "structured_outputs",
                           structured_outputs_from(self.structured_outputs))

        def number(name: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, float) or _is_int(value)
                                               or hasattr(value, "__float__")):
                raise bad(name, f"must be a number, got {show(value)}")
            try:
                x = float(value)
            except (OverflowError, TypeError, ValueError):
                x = math.inf
            if not math.isfinite(x) or abs(x) > FLOAT32_MAX:
                raise bad(name, f"must be a finite number, got {show(value)}")
            object.__setattr__(self, name, x)
            return x

        def integer(name: str, lo: int, hi: int, why: str, optional: bool = False) -> None:
            value = getattr(self, name)
            if value is None and optional:
                return
            if not _is_int(value) or not lo <= operator.index(value) <= hi:
                raise bad(name, f"{why}, got {show(value)}")
            object.__setattr__(self, name, operator.index(value))

        integer("n", 1, MAX_N, f"must be an integer in [1, {MAX_N}]")
        if number("temperature") < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        if not 0.0 < number("top_p") <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        integer("top_k", -1, INT32_MAX, f"must be -1, 0 (off) or in [1, {INT32_MAX}]")
        if not 0.0 <= number("min_p") <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        integer("max_tokens", 1, INT32_MAX, f"must be an integer in [1, {INT32_MAX}]",
                optional=True)
        if self.max_tokens is None:
            integer("min_tokens", 0, INT32_MAX, f"must be an integer in [0, {INT32_MAX}]")
        else:
            integer("min_tokens", 0, self.max_tokens, "must be an integer in [0, max_tokens]")
        integer("logprobs", 0, MAX_LOGPROBS, f"must be an integer in [0, {MAX_LOGPROBS}]",
                optional=True)
        integer("seed", 0, 2**63 - 1, "must be a non-negative 64-bit integer", optional=True)
        stop = self.stop
        stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
        if not isinstance(stop, (list, tuple)) or any(not isinstance(s, str) or not s
                                                      for s in stop):
            raise bad("stop", "must be a non-empty string or a list of them")
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        ids = () if ids is None else ids
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__") or \
                any(not _is_int(t) or not 0 <= operator.index(t) <= INT32_MAX for t in ids):
            raise bad("stop_token_ids", f"must be a list of token ids in [0, {INT32_MAX}]")
        object.__setattr__(self, "stop_token_ids", tuple(operator.index(t) for t in ids))
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= number(name) <= MAX_PENALTY:
                raise bad(name, f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got "
                          f"{getattr(self, name)}")
        if not number("repetition_penalty") > 0.0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias, bad))
        integer("prompt_logprobs", 0, MAX_LOGPROBS,
                f"must be an integer in [0, {MAX_LOGPROBS}]", optional=True)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """`stop` as normalised on construction (a str or list given is a tuple here)."""
        return tuple(self.stop or ())

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return tuple(self.stop_token_ids or ())

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or \
            self.repetition_penalty != 1.0


def _logit_bias(value: Any, bad: Any) -> dict[int, float] | None:
    """logit_bias as {token id: float bias}; None or {} is none."""
    if value is None or (isinstance(value, dict) and not value):
        return None
    if not isinstance(value, dict):
        raise bad("logit_bias", f"must be a mapping of token id to bias, got {show(value)}")
    out: dict[int, float] = {}
    for tok, bias in value.items():
        if not _is_int(tok) or not 0 <= operator.index(tok) <= INT32_MAX:
            raise bad("logit_bias", f"keys must be token ids in [0, {INT32_MAX}], got "
                      f"{show(tok)}")
        if isinstance(bias, bool) or not (isinstance(bias, float) or _is_int(bias)):
            raise bad("logit_bias", f"values must be numbers, got {show(bias)} for token "
                      f"{operator.index(tok)}")
        try:
            b = float(bias)
        except OverflowError:  # an int too large for a float
            b = math.inf
        if not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:  # also refuses nan
            raise bad("logit_bias", f"values must be in [-{MAX_LOGIT_BIAS:g}, "
                      f"{MAX_LOGIT_BIAS:g}], got {show(bias)} for token {operator.index(tok)}")
        out[operator.index(tok)] = b
    return out
