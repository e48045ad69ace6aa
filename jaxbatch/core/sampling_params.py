"""SamplingParams in vLLM's shape, validated on construction."""

from __future__ import annotations

import dataclasses

MAX_LOGPROBS = 20  # top-n logprobs are computed for a static n on device; requests ask for <= n
MAX_BANNED_IDS = 8  # eos/stop ids masked while min_tokens is not reached (static width on device)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
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

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}: {why}")

        if self.n != 1:
            raise bad("n", f"only n=1 is supported, got {self.n}")
        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise bad("top_k", f"must be -1, 0 (off) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise bad("seed", f"must be a non-negative 64-bit integer, got {self.seed}")
        stop = self.stop
        stop = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise bad("stop", "must be non-empty strings")
        object.__setattr__(self, "stop", stop)
        ids = tuple(int(i) for i in (self.stop_token_ids or ()))
        object.__setattr__(self, "stop_token_ids", ids)

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
