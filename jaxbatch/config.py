"""Engine configuration: a few frozen dataclasses, validated on construction, loaded from
configs/*.yaml (flat keys) with overrides from keyword arguments or the CLI (host only).

Each component receives only its part: ModelConfig -> loader, CacheConfig -> page allocator and
runner, SchedulerConfig -> scheduler, PlannerConfig -> planner, RunnerConfig -> runner.
`max_model_len` belongs to the model; `Engine.from_config` resolves a None against the loaded
model once (`ModelConfig.resolve_max_model_len`) and every part reads it from there.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

DEFAULT_MODEL = "smollm2-135m-instruct"
ATTENTION_BACKENDS = ("auto", "native", "pallas", "reference")
DTYPES = ("float32", "bfloat16")
QUANTIZATIONS = ("int8",)  # weight-only (model/quantize.py); None: weights in the compute dtype
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16"}
POLICIES = ("mixed", "prefill_first", "decode_first")
DEFAULT_MAX_MODEL_LEN_CAP = 4096  # max_model_len None: the model's positions, capped here


def cache_dir(configured: str | None = None) -> str:
    """Where downloads, converted params and XLA's compilation cache live: the configured
    directory, else $JAXBATCH_CACHE, else ~/.cache/jaxbatch."""
    return configured or os.environ.get("JAXBATCH_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "jaxbatch")


def canonical_dtype(name: str) -> str:
    """'fp32' -> 'float32', 'bf16' -> 'bfloat16'; ValueError for anything else."""
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {name!r}")
    return name


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model: str = DEFAULT_MODEL
    # float32 | bfloat16 | auto: the faster on this device, measured at start-up (engine/precision)
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's max_position_embeddings (capped 4096)
    tokenizer: str | None = None  # a directory with a tokenizer, when the model has none
    cache_dir: str | None = None  # None: $JAXBATCH_CACHE or ~/.cache/jaxbatch
    # int8: linear weights stored int8 with per-output-column scales, converted in the step
    quantization: str | None = None
    # a Hugging Face Hub model name's branch, tag or commit, and the huggingface_hub cache
    # folder it is downloaded into (None: $HF_HUB_CACHE / $HF_HOME/hub); model/hub.py
    revision: str | None = None
    download_dir: str | None = None

    def __post_init__(self) -> None:
        if self.dtype != "auto":
            object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        if self.quantization in ("none", ""):
            object.__setattr__(self, "quantization", None)
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or none, got "
                             f"{self.quantization!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    def resolve_max_model_len(self, max_position_embeddings: int) -> ModelConfig:
        """This config with max_model_len set: the given one (checked against the model's
        positions) or the model's positions capped at DEFAULT_MAX_MODEL_LEN_CAP."""
        n = self.max_model_len or min(max_position_embeddings, DEFAULT_MAX_MODEL_LEN_CAP)
        if n > max_position_embeddings:
            raise ValueError(f"max_model_len {n} exceeds the model's {max_position_embeddings} "
                             f"positions")
        return dataclasses.replace(self, max_model_len=n)


KV_EVENT_PUBLISHERS = ("null", "zmq")


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config` JSON (engine/kv_events.py): the prefix cache's changes
    published for routers. `endpoint`: a ZeroMQ address the PUB socket binds (one with `*`, `::`,
    ipc:// or inproc://) or connects to (any other: a router's SUB that binds); `replay_endpoint`
    (None: no replay): a ROUTER socket that resends buffered batches from a sequence number;
    `buffer_steps`: how many batches replay keeps; `hwm`: the PUB socket's send high-water mark;
    `max_queue_size`: batches waiting for the publisher thread before the engine blocks;
    `topic`: the first frame of every message."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in KV_EVENT_PUBLISHERS:
            raise ValueError(f"kv_events_config.publisher must be one of {KV_EVENT_PUBLISHERS}, "
                             f"got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv_events_config.{name} must be >= 1, got "
                                 f"{getattr(self, name)}")

    @property
    def active(self) -> bool:
        """Events are recorded and sent: enabled, with a real publisher."""
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def parse(cls, value: Any) -> KVEventsConfig | None:
        """A JSON string, a dict (vLLM's keys) or None; ValueError naming an unknown key."""
        if value is None or isinstance(value, KVEventsConfig):
            return value
        fields = json_config_fields(value, "kv_events_config", cls)
        # vLLM: enabling events without naming a publisher means zmq
        if fields.get("enable_kv_cache_events") and "publisher" not in fields:
            fields["publisher"] = "zmq"
        return cls(**fields)


def json_config_fields(value: Any, name: str, cls: type) -> dict[str, Any]:
    """A JSON-object option (`--kv-events-config`, `--speculative-config`) given as JSON text or
    a dict -> a new dict of `cls`'s fields; ValueError naming a key `cls` does not have."""
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {value!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name}: unknown key(s) {unknown}; known: {sorted(known)}")
    return dict(value)


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16
    num_pages: int | None = None
    kv_cache_memory_gb: float | None = None  # used when num_pages is None; default 2 GB
    # on a GPU (or TPU) with neither of those: JAX's memory pool is this share of the device's
    # memory and the KV cache takes what the weights and a step's temporaries leave of it
    # (vLLM's gpu_memory_utilization; worker/kv_budget.py); not used on CPU
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"  # auto: the compute dtype | float32 | bfloat16
    # automatic prefix caching: full KV pages shared by every request with the same prefix
    enable_prefix_caching: bool = True
    # the prefix cache's changes published for routers (KVEventsConfig; None: none)
    kv_events_config: KVEventsConfig | None = None
    # hybrid (Gated DeltaNet) models: recurrent-state checkpoints the prefix cache keeps, each a
    # whole sequence's state at a page boundary (core/state_checkpoints.py); None: as many as
    # a quarter of the KV budget holds, at most 4 per max_num_seqs; 0: no prefix caching
    state_checkpoints: int | None = None

    def __post_init__(self) -> None:
        if self.state_checkpoints is not None and self.state_checkpoints < 0:
            raise ValueError(f"state_checkpoints must be >= 0, got {self.state_checkpoints}")
        object.__setattr__(self, "kv_events_config",
                           KVEventsConfig.parse(self.kv_events_config))
        if self.kv_events_config is not None and self.kv_events_config.active \
                and not self.enable_prefix_caching:
            raise ValueError("kv_events_config: KV-cache events need enable_prefix_caching")
        if self.kv_cache_dtype != "auto":
            object.__setattr__(self, "kv_cache_dtype", canonical_dtype(self.kv_cache_dtype))
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2, got {self.num_pages}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError("kv_cache_memory_gb must be > 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    batching_policy: str = "mixed"
    long_prefill_token_threshold: int | None = None  # None: half the token budget
    max_consecutive_prefill_steps: int = 8

    def __post_init__(self) -> None:
        if self.batching_policy not in POLICIES:
            raise ValueError(f"batching_policy must be one of {POLICIES}, got "
                             f"{self.batching_policy!r}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError(f"max_num_seqs ({self.max_num_seqs}) cannot exceed "
                             f"max_num_batched_tokens ({self.max_num_batched_tokens})")

    @property
    def chunk_cap(self) -> int:
        t = self.long_prefill_token_threshold
        return max(1, t if t else self.max_num_batched_tokens // 2)


@dataclasses.dataclass(frozen=True)
class PlannerConfig:
    planner: str = "dp"  # dp | pow2 | linear:STEP | fixed:[...]
    max_compiled_shapes: int = 8
    trace_path: str | None = None
    # dp: the workload (JSONL/JSON) or step trace whose step shapes the buckets are chosen for;
    # None: bench64's lengths, shipped in the package
    planner_workload: str | None = None
    # dp: the workload is also simulated arriving as Poisson traffic at these fractions of the
    # capacity (simulate.load_rates), so the set covers a server's lighter steps too (a lone
    # prompt beside a few decodes) and not only an offline burst; () = offline only
    planner_loads: tuple[float, ...] = ()
    # tensor parallelism: the all-reduce rate (GB/s per device) the analytic cost prices the
    # collectives with; None: measured on the mesh at start (jaxbatch plan: a nominal 10)
    collective_gbps: float | None = None
    # live re-planning (planner/live.py): every replan_interval_steps, the shapes of the last
    # replan_window_steps steps are re-planned with the step-time model fitted on the executed
    # steps; a set predicted >= replan_min_gain cheaper is compiled in the background, swapped in
    # between two steps, and saved in the cache dir for the next start
    live_replan: bool = False
    replan_interval_steps: int = 512
    replan_window_steps: int = 4096
    replan_min_gain: float = 0.10

    def __post_init__(self) -> None:
        loads = self.planner_loads
        if isinstance(loads, str):  # "0.25,0.5" (CLI)
            loads = [x for x in loads.split(",") if x.strip()]
        object.__setattr__(self, "planner_loads", tuple(float(u) for u in loads))
        if any(not 0.0 < u <= 1.0 for u in self.planner_loads):
            raise ValueError(f"planner_loads are fractions of capacity in (0, 1], got "
                             f"{self.planner_loads}")
        if self.max_compiled_shapes < 1:
            raise ValueError("max_compiled_shapes must be >= 1")
        if self.replan_interval_steps < 1 or self.replan_window_steps < 1:
            raise ValueError("replan_interval_steps and replan_window_steps must be >= 1")
        if not 0.0 < self.replan_min_gain < 1.0:
            raise ValueError(f"replan_min_gain must be in (0, 1), got {self.replan_min_gain}")


DP_ROUTINGS = ("prefix", "shortest_queue")


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    attention_backend: str = "auto"
    seed: int = 0
    compile_guard: bool = False  # raise if anything compiles after warm-up
    # every row's numbers computed in an order that does not depend on the other rows of its step
    # (the same request gives the same tokens alone or in any batch; tuning/invariance.py).
    # True: an error where this engine cannot promise it; "auto" (the default): on where it can
    # and the start-up measurement finds it no slower than the default mode on this model's
    # step shapes (tuning/invariance_cost.py), else off, logged with why; False: off
    batch_invariant: bool | str = "auto"
    progress: bool = True
    # tensor parallelism over this many devices per engine (executor/sharding.py); data-parallel
    # replicas: that many engines, each on its own tensor_parallel_size devices (engine/replicas)
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    # how the replicas' router picks one: "prefix" (longest cached prefix, then the shortest
    # queue) or "shortest_queue"
    data_parallel_routing: str = "prefix"

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.data_parallel_size < 1:
            raise ValueError("tensor_parallel_size and data_parallel_size must be >= 1")
        if self.data_parallel_routing not in DP_ROUTINGS:
            raise ValueError(f"data_parallel_routing must be one of {DP_ROUTINGS}, got "
                             f"{self.data_parallel_routing!r}")
        if self.batch_invariant not in (True, False, "auto"):
            raise ValueError(f"batch_invariant must be true, false or auto, got "
                             f"{self.batch_invariant!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got "
                             f"{self.attention_backend!r}")


SPEC_METHODS = ("ngram", "draft_model")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config` JSON (spec_decode/speculation.py): proposals checked in the
    ordinary step. ngram: the request's own prompt and output (prompt_lookup_min..max tokens
    matched); draft_model: a smaller model with the same vocabulary (`model`). `adaptive`
    (jaxbatch's): each step picks how many proposals each request verifies, 0..
    num_speculative_tokens, from the planner's step costs and the request's acceptance so far;
    false: always as many as there are."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {SPEC_METHODS}, got "
                             f"{self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("speculative_config.num_speculative_tokens must be in 1..16, got "
                             f"{self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative_config: need 1 <= prompt_lookup_min <= "
                             f"prompt_lookup_max, got {self.prompt_lookup_min}, "
                             f"{self.prompt_lookup_max}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config: method draft_model needs a `model` (and only "
                             "it takes one)")

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """A JSON string, a dict (vLLM's keys) or None; ValueError naming an unknown key."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        fields = json_config_fields(value, "speculative_config", cls)
        if fields.get("method") is None:
            fields["method"] = "draft_model" if fields.get("model") else "ngram"
        return cls(**fields)


@dataclasses.dataclass(frozen=True)
class SpeculationConfig:
    """The engine's speculative decoding, None: off (one flat key, as vLLM's)."""

    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.parse(self.speculative_config))


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters served beside the base model (lora/adapters.py, lora/runtime.py), as vLLM's
    flags: `enable_lora`; `max_loras` adapters in one step (fixed device slots: loading one into
    a slot never compiles); `max_lora_rank` the largest rank a slot holds (smaller ranks are
    zero-padded, exactly); `lora_modules` adapters loaded at start, {name: path} (a PEFT
    directory or a llama.cpp GGUF LoRA file); a request chooses one by its `model`."""

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    lora_modules: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "lora_modules", parse_lora_modules(self.lora_modules))
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules need enable_lora")


def parse_lora_modules(value: Any) -> tuple[tuple[str, str], ...]:
    """{name: path}, "name=path" strings, vLLM's JSON objects ({"name", "path"}) or pairs ->
    ((name, path), ...); ValueError for anything else or a name given twice."""
    if isinstance(value, dict):
        items: list[Any] = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise ValueError(f"lora_modules: expected {{name: path}} or a list, got {value!r}")
    out: list[tuple[str, str]] = []
    for item in items:
        if isinstance(item, str):
            if item.lstrip().startswith("{"):
                import json
                item = json.loads(item)
            elif "=" in item:
                item = tuple(item.split("=", 1))
        if isinstance(item, dict):
            item = (item.get("name"), item.get("path"))
        if not (isinstance(item, (list, tuple)) and len(item) == 2
                and all(isinstance(x, str) and x for x in item)):
            raise ValueError(f"lora_modules: {item!r} is not name=path")
        out.append((item[0], item[1]))
    names = [n for n, _ in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"lora_modules: the name(s) {dup} are given twice")
    return tuple(out)


_PARTS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
          "planner": PlannerConfig, "runner": RunnerConfig, "speculation": SpeculationConfig,
          "lora": LoRAConfig}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    planner: PlannerConfig = PlannerConfig()
    runner: RunnerConfig = RunnerConfig()
    speculation: SpeculationConfig = SpeculationConfig()
    lora: LoRAConfig = LoRAConfig()

    @classmethod
    def from_flat(cls, **kwargs: Any) -> EngineConfig:
        """Flat keys (as in vLLM's LLM(...) and the YAML presets) -> the nested config."""
        parts: dict[str, dict[str, Any]] = {name: {} for name in _PARTS}
        owners: dict[str, str] = {}
        for name, c in _PARTS.items():
            for f in dataclasses.fields(c):
                owners.setdefault(f.name, name)
        unknown = sorted(k for k in kwargs if k not in owners)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known: {sorted(owners)}")
        for k, v in kwargs.items():
            parts[owners[k]][k] = v
        return cls(**{name: _PARTS[name](**vals) for name, vals in parts.items()})

    def flat(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in _PARTS:
            out.update(dataclasses.asdict(getattr(self, name)))
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
