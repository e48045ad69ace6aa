"""Glue between config and the jax side: loading, KV sizing, attention backend, compile cache."""

from __future__ import annotations

import os
from typing import Any

from jaxbatch.config import CacheConfig, EngineConfig, ModelConfig


def cache_dir(configured: str | None = None) -> str:
    return configured or os.environ.get("JAXBATCH_CACHE") or os.path.expanduser("~/.cache/jaxbatch")


def enable_persistent_compile_cache(configured: str | None) -> None:
    import jax

    path = os.path.join(cache_dir(configured), "xla")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def load(cfg: ModelConfig) -> Any:
    from jaxbatch.model.loader import load_model

    loaded = load_model(cfg.model, cfg.dtype, cache_dir=cache_dir(cfg.cache_dir))
    if cfg.tokenizer:
        from transformers import AutoTokenizer

        loaded.tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
    return loaded


def jnp_dtype(name: str):
    import jax.numpy as jnp

    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def kv_bytes_per_token(arch, dtype: str) -> int:
    width = 4 if dtype == "float32" else 2
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * width


def num_kv_pages(arch, cfg: CacheConfig, dtype: str) -> int:
    if cfg.num_pages is not None:
        return cfg.num_pages
    gb = cfg.kv_cache_memory_gb if cfg.kv_cache_memory_gb is not None else 2.0
    per_page = kv_bytes_per_token(arch, dtype) * cfg.page_size
    return max(2, int(gb * 2**30 // per_page))


def eos_token_ids(loaded: Any) -> tuple[int, ...]:
    ids: set[int] = set()
    tok = loaded.tokenizer
    if tok is not None and tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    extra = getattr(loaded, "eos_token_ids", None) or ()
    ids.update(int(i) for i in extra)
    return tuple(sorted(ids))


def attention_fn(backend: str):
    import functools

    import jax

    from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference

    on_gpu = jax.default_backend() == "gpu"
    if backend == "reference" or (backend == "auto" and not on_gpu):
        # The engine's cache only ever holds finite values (zeros at start, then written KV), so
        # the reference may skip its NaN guard on the value side: one less pass over the blocks.
        return functools.partial(ragged_paged_attention_reference, nan_safe=False)
    from pallas_kernels.ragged_paged_attention.kernel import ragged_paged_attention

    return functools.partial(ragged_paged_attention, interpret=not on_gpu)


def planner_kwargs(config: EngineConfig) -> dict[str, Any]:
    if config.planner.planner != "dp":
        return {}
    return {"max_shapes": config.planner.max_compiled_shapes, "config": config}
