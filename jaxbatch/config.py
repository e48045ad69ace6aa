"""Engine configuration: a few frozen dataclasses, validated on construction, loaded from
configs/*.yaml (flat keys) with overrides from keyword arguments or the CLI.

Each component receives only its part: ModelConfig -> loader, CacheConfig -> block manager and
runner, SchedulerConfig -> scheduler, PlannerConfig -> planner, RunnerConfig -> runner.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxbatch.scheduler import SchedulerConfig

DEFAULT_MODEL = "smollm2-135m-instruct"
ATTENTION_BACKENDS = ("auto", "pallas", "reference")
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "float32"
    max_model_len: int | None = None  # None: the model's max_position_embeddings (capped 4096)
    tokenizer: str | None = None  # a directory with a tokenizer, when the model has none
    cache_dir: str | None = None  # None: $JAXBATCH_CACHE or ~/.cache/jaxbatch

    def __post_init__(self) -> None:
        aliases = {"fp32": "float32", "bf16": "bfloat16", "auto": "float32"}
        object.__setattr__(self, "dtype", aliases.get(self.dtype, self.dtype))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16
    num_pages: int | None = None
    kv_cache_memory_gb: float | None = None  # used when num_pages is None; default 2 GB

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2, got {self.num_pages}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError("kv_cache_memory_gb must be > 0")


@dataclasses.dataclass(frozen=True)
class PlannerConfig:
    planner: str = "dp"  # dp | pow2 | linear:STEP | fixed:[...]
    max_compiled_shapes: int = 8
    trace_path: str | None = None
    # dp: the workload (JSONL/JSON) or step trace whose step shapes the buckets are chosen for;
    # None: bench64's lengths, shipped in the package
    planner_workload: str | None = None

    def __post_init__(self) -> None:
        if self.max_compiled_shapes < 1:
            raise ValueError("max_compiled_shapes must be >= 1")


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    attention_backend: str = "auto"
    seed: int = 0
    compile_guard: bool = False  # raise if anything compiles after warm-up
    progress: bool = True

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got "
                             f"{self.attention_backend!r}")


_PARTS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
          "planner": PlannerConfig, "runner": RunnerConfig}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    planner: PlannerConfig = PlannerConfig()
    runner: RunnerConfig = RunnerConfig()

    @classmethod
    def from_flat(cls, **kwargs: Any) -> EngineConfig:
        """Flat keys (as in vLLM's LLM(...) and the YAML presets) -> the nested config."""
        parts: dict[str, dict[str, Any]] = {name: {} for name in _PARTS}
        owners: dict[str, str] = {}
        for name, c in _PARTS.items():  # max_model_len belongs to the model (scheduler copies it)
            for f in dataclasses.fields(c):
                owners.setdefault(f.name, name)
        unknown = sorted(k for k in kwargs if k not in owners)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known: {sorted(owners)}")
        for k, v in kwargs.items():
            parts[owners[k]][k] = v
        # the scheduler needs max_model_len too; the engine fills it in once the model is known
        parts["scheduler"]["max_model_len"] = kwargs.get("max_model_len") or 2048
        return cls(**{name: _PARTS[name](**vals) for name, vals in parts.items()})

    def flat(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in _PARTS:
            for k, v in dataclasses.asdict(getattr(self, name)).items():
                out.setdefault(k, v)
        return out

    def replace(self, **kwargs: Any) -> EngineConfig:
        return EngineConfig.from_flat(**{**self.flat(), **kwargs})


def load_yaml(path: str) -> dict[str, Any]:
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of engine options")
    return data


def config_from_sources(config_path: str | None = None, **overrides: Any) -> EngineConfig:
    """YAML preset (if any) then overrides (None values are ignored: 'not given on the CLI')."""
    flat = load_yaml(config_path) if config_path else {}
    flat.update({k: v for k, v in overrides.items() if v is not None})
    return EngineConfig.from_flat(**flat)
