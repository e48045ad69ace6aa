"""The one entry point that turns a model name into (arch, params, tokenizer).

`model` may be
  * a built-in name (`smollm2-135m-instruct`): fetched once into the cache, then a GGUF;
  * a `.gguf` file: converted once, then restored from the orbax param cache;
  * a local HF directory: config.json + safetensors (single or sharded), tokenizer if present.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import jax.numpy as jnp

from jaxbatch.model import param_cache, registry
from jaxbatch.model.arch import ModelArch
from jaxbatch.model.hf_loader import load_hf_dir

log = logging.getLogger(__name__)

_DTYPES = {"float32": jnp.float32, "fp32": jnp.float32, "bfloat16": jnp.bfloat16,
           "bf16": jnp.bfloat16}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    arch: ModelArch
    params: dict  # the stacked params pytree (see ModelArch.param_shapes), jnp arrays
    tokenizer: Any  # a transformers tokenizer; None for an HF directory without tokenizer files
    source: str  # the file or directory the weights came from
    load_seconds: float
    from_cache: bool  # params restored from the orbax cache rather than converted


def default_cache_dir() -> str:
    """`$JAXBATCH_CACHE`, else ~/.cache/jaxbatch."""
    return os.environ.get("JAXBATCH_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "jaxbatch"
    )


def resolve_dtype(dtype: str | Any) -> Any:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported (use 'float32' or 'bfloat16')")
        return _DTYPES[dtype]
    dt = jnp.dtype(dtype)
    if dt not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"dtype {dt} is not supported (use float32 or bfloat16)")
    return dt.type


def load_model(model: str, dtype: str | Any, cache_dir: str | None = None) -> LoadedModel:
    t0 = time.perf_counter()
    dt = resolve_dtype(dtype)
    cache_dir = cache_dir or default_cache_dir()
    if registry.is_builtin(model):
        model = registry.builtin_model_path(model, cache_dir)
    if os.path.isdir(model):
        arch, params = load_hf_dir(model, dt)
        return LoadedModel(arch, params, _dir_tokenizer(model), model,
                           time.perf_counter() - t0, from_cache=False)
    if model.endswith(".gguf") and os.path.isfile(model):
        arch, params, tok, hit = _load_gguf_cached(model, dt, cache_dir)
        return LoadedModel(arch, params, tok, model, time.perf_counter() - t0, from_cache=hit)
    raise FileNotFoundError(
        f"model {model!r} is neither a built-in name ({', '.join(sorted(registry.BUILTIN_MODELS))})"
        ", an existing .gguf file nor a local HF directory with config.json"
    )


def _dir_tokenizer(path: str) -> Any:
    if not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _load_gguf_cached(path: str, dtype: Any, cache_dir: str) -> tuple[ModelArch, dict, Any, bool]:
    """-> (arch, params, tokenizer, from_cache). A miss converts and then fills the cache."""
    from transformers import AutoConfig, AutoTokenizer

    from jaxbatch.model.gguf_loader import load_gguf, load_gguf_tokenizer

    entry = param_cache.entry_dir(cache_dir, param_cache.cache_key(path, dtype))
    if param_cache.is_complete(entry):
        hf = param_cache.hf_dir(entry)
        try:
            arch = ModelArch.from_hf_config(AutoConfig.from_pretrained(hf))
            tok = AutoTokenizer.from_pretrained(hf)
        except (OSError, ValueError) as e:  # damaged config/tokenizer files: rebuild the entry
            log.warning("param cache entry %s is unreadable (%s); rebuilding it", entry, e)
            param_cache.remove_entry(entry)
        else:
            params = param_cache.restore_params(entry, arch, dtype)
            if params is not None:
                return arch, params, tok, True
    arch, params, cfg = load_gguf(path, dtype)
    tok = load_gguf_tokenizer(path)

    def write_hf(d: str) -> None:
        cfg.save_pretrained(d)
        tok.save_pretrained(d)

    param_cache.save_entry(entry, params, write_hf)
    return arch, params, tok, False
