"""The models a server of several models may load: read from a directory (`--models-dir`, as
llama-server's router mode) or a JSON file (`--models-config`), each a `ModelSpec`: its name,
where its weights are, and its own engine options. Host only (no jax): the CLI reads and checks
the catalog before anything slow starts.

A directory: each `NAME.gguf` file is the model NAME (of a split GGUF, `NAME-00001-of-0000N.gguf`
only, named NAME), each subdirectory holding a `config.json` (a Hugging Face model) or exactly one
GGUF file is the model named by the subdirectory.

A JSON file: {"models": [{"name": ..., "model": ..., OPTION: value, ...}, ...]} (or the list
alone); "model" is anything `jaxbatch serve MODEL` takes (a file, a directory, a Hub name); the
options are the engine flags' names with underscores (`dtype`, `max_model_len`, `num_pages`,
`kv_cache_memory_gb`, `config` for a YAML preset, ...), `reasoning_parser`, `tool_call_parser`,
and `embedding` (true: only /v1/embeddings and Ollama's /api/embed serve it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from typing import Any

# the KV cache a model gets without num_pages or kv_cache_memory_gb (worker/runner.py
# DEFAULT_KV_CACHE_GB; tests/multimodel checks they agree)
DEFAULT_KV_GB = 2.0
_SHARD = re.compile(r"^(?P<stem>.+)-(?P<k>\d{5})-of-(?P<n>\d{5})$")
_SERVER_OPTIONS = {"reasoning_parser": str, "tool_call_parser": str, "embedding": bool}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str  # what a request's `model` names
    model: str  # the weights: a GGUF file, an HF directory, a Hub name
    # engine options over the server's own flags ({"dtype": "float32", "max_model_len": 2048})
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    embedding: bool = False  # an embedding model: generation routes refuse it

    def weight_bytes(self) -> int:
        """The size of its weight files on disk (0 for a Hub name not downloaded yet)."""
        path = self.model
        if os.path.isfile(path):
            return os.path.getsize(path)
        if os.path.isdir(path):
            return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                       if f.endswith((".safetensors", ".bin", ".gguf", ".pt")))
        return 0

    def estimated_bytes(self) -> int:
        """Weights (their files' size) plus the KV budget: what a load is expected to hold,
        before it is measured. num_pages without kv_cache_memory_gb: the KV part is unknown
        until the model's shapes are read (0; the load measures it)."""
        kv_gb = self.options.get("kv_cache_memory_gb")
        if kv_gb is None:
            kv_gb = 0.0 if self.options.get("num_pages") else DEFAULT_KV_GB
        return self.weight_bytes() + int(float(kv_gb) * 2**30)


def engine_option_types() -> dict[str, type]:
    """Every engine option a model may set, by its flag's name with underscores."""
    from jaxbatch.cli.engine_args import _ENGINE_ARGS  # a leaf module: the config only

    types = {flag[2:].replace("-", "_"): typ for flag, typ in _ENGINE_ARGS}
    types.pop("model")
    types.update(config=str, enable_prefix_caching=bool, batch_invariant=bool,
                 compile_guard=bool, live_replan=bool)
    return types


def spec_from_entry(entry: Any, where: str) -> ModelSpec:
    """One model of a --models-config file; ValueError naming the entry and what is wrong."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: each model must be a JSON object, got {type(entry).__name__}")
    name, model = entry.get("name"), entry.get("model")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{where}: 'name' must be a non-empty string")
    if not isinstance(model, str) or not model:
        raise ValueError(f"{where} ({name}): 'model' must be a path or a Hub name")
    allowed = {**engine_option_types(), **_SERVER_OPTIONS}
    options: dict[str, Any] = {}
    server: dict[str, Any] = {}
    for key, value in entry.items():
        if key in ("name", "model"):
            continue
        typ = allowed.get(key)
        if typ is None:
            raise ValueError(f"{where} ({name}): unknown option {key!r}; known: "
                             f"{', '.join(sorted(allowed))}")
        ok = isinstance(value, bool) if typ is bool else (
            isinstance(value, (int, float)) and not isinstance(value, bool) if typ is float
            else isinstance(value, typ) and not isinstance(value, bool))
        if not ok:
            raise ValueError(f"{where} ({name}): {key!r} must be {typ.__name__}, got {value!r}")
        (server if key in _SERVER_OPTIONS else options)[key] = value
    return ModelSpec(name, model, options, **server)


def read_models_config(path: str) -> list[ModelSpec]:
    """The models of a --models-config JSON file; ValueError for a bad one."""
    with open(path, encoding="utf-8") as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON: {e}") from None
    entries = doc.get("models") if isinstance(doc, dict) else doc
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected {{\"models\": [...]}} or a list of models")
    return check_unique([spec_from_entry(e, f"{path} model {i}") for i, e in enumerate(entries)])


def scan_models_dir(path: str) -> list[ModelSpec]:
    """The models of a --models-dir directory (see the module's docstring), sorted by name."""
    if not os.path.isdir(path):
        raise ValueError(f"--models-dir {path}: not a directory")
    specs = []
    for entry in sorted(os.listdir(path)):
        full = os.path.join(path, entry)
        if os.path.isfile(full) and entry.endswith(".gguf"):
            stem = entry.removesuffix(".gguf")
            shard = _SHARD.match(stem)
            if shard and int(shard["k"]) != 1:
                continue  # a later part of a split file: the first part names the model
            if stem.startswith("mmproj"):
                continue  # a vision projector, not a model
            specs.append(ModelSpec(shard["stem"] if shard else stem, full))
        elif os.path.isdir(full):
            if os.path.isfile(os.path.join(full, "config.json")):
                specs.append(ModelSpec(entry, full))
                continue
            ggufs = [f for f in os.listdir(full) if f.endswith(".gguf")
                     and not f.startswith("mmproj")]
            if len(ggufs) == 1:
                specs.append(ModelSpec(entry, os.path.join(full, ggufs[0])))
    return check_unique(specs)


def check_unique(specs: list[ModelSpec]) -> list[ModelSpec]:
    seen: set[str] = set()
    for s in specs:
        if s.name in seen:
            raise ValueError(f"two models are named {s.name!r}")
        seen.add(s.name)
    return specs


def catalog(models_dir: str | None, models_config: str | None) -> list[ModelSpec]:
    """Both sources together (the config's entries first; a name in both: the config's);
    ValueError when they hold no model."""
    specs = read_models_config(models_config) if models_config else []
    named = {s.name for s in specs}
    if models_dir:
        specs += [s for s in scan_models_dir(models_dir) if s.name not in named]
    if not specs:
        raise ValueError("no model found in " + " or ".join(
            p for p in (models_dir, models_config) if p))
    return specs


def parse_keep_alive(value: Any) -> float | None:
    """Ollama's keep_alive -> seconds (negative: forever), or None when absent: a number of
    seconds, or a duration string ("5m", "1h30m", "10s", "0", "-1"). ValueError otherwise."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"keep_alive must be a duration, got {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        try:
            return float(text)
        except ValueError:
            pass
        parts = re.fullmatch(r"(-?)((?:\d+(?:\.\d+)?(?:ms|h|m|s))+)", text)
        if parts:
            unit = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
            total = sum(float(n) * unit[u] for n, u in
                        re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", parts[2]))
            return -total if parts[1] else total
    raise ValueError(f"keep_alive must be a number of seconds or a duration like '5m', "
                     f"got {value!r}")
