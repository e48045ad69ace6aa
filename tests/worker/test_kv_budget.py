"""The KV cache on an accelerator sized as a share of the device's memory (worker/kv_budget.py,
vLLM's gpu_memory_utilization), JAX's pool set to match; checked with a fake device's memory
statistics (as a GPU's `memory_stats()` reports them)."""

from __future__ import annotations

import dataclasses
import logging

import jax.numpy as jnp
import pytest

from jaxbatch.config import CacheConfig
from jaxbatch.model.arch import ModelArch
from jaxbatch.worker import kv_budget
from jaxbatch.worker.runner import num_kv_pages
from tests.helpers.tiny_models import make_hf_config

GIB = 2**30


@dataclasses.dataclass
class FakeDevice:
    limit: int | None
    in_use: int
    platform: str = "gpu"
    device_kind: str = "NVIDIA H100 80GB HBM3"

    def memory_stats(self):
        return None if self.limit is None else {"bytes_limit": self.limit,
                                                "bytes_in_use": self.in_use}


ARCH = ModelArch.from_hf_config(make_hf_config("llama_gqa"))


def test_pool_fraction_follows_the_setting_unless_the_environment_says_otherwise(caplog):
    env: dict[str, str] = {}
    assert kv_budget.configure_xla_memory(0.9, env) == 0.9
    assert env == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}
    assert kv_budget.configure_xla_memory(0.9, env) == 0.9  # again: the same, quiet
    assert not caplog.text
    with caplog.at_level(logging.WARNING, logger="jaxbatch"):
        assert kv_budget.configure_xla_memory(0.5, env) == 0.9
    assert "overrides gpu_memory_utilization=0.5" in caplog.text


def test_cache_takes_the_pool_less_weights_and_the_step_reserve():
    per_page = 2 * ARCH.num_layers * ARCH.num_kv_heads * ARCH.head_dim * 2 * 16  # bf16, 16
    dev = FakeDevice(limit=72 * GIB, in_use=16 * GIB)
    want = (72 * GIB - 16 * GIB - kv_budget.activation_reserve(ARCH)) // per_page
    pages = num_kv_pages(ARCH, CacheConfig(), jnp.bfloat16, dev)
    assert pages == want and pages * per_page > 50 * GIB
    # a number the user gave wins; CPU keeps the fixed 2 GB default
    assert num_kv_pages(ARCH, CacheConfig(num_pages=7), jnp.bfloat16, dev) == 7
    assert num_kv_pages(ARCH, CacheConfig(kv_cache_memory_gb=1.0), jnp.bfloat16, dev) == \
        GIB // per_page
    cpu = FakeDevice(limit=None, in_use=0, platform="cpu")
    assert num_kv_pages(ARCH, CacheConfig(), jnp.bfloat16, cpu) == 2 * GIB // per_page


def test_no_room_is_a_clear_error():
    with pytest.raises(ValueError, match="no room for a KV cache.*raise gpu_memory_utilization"):
        num_kv_pages(ARCH, CacheConfig(), jnp.bfloat16, FakeDevice(limit=2 * GIB, in_use=GIB))
    with pytest.raises(ValueError, match="reports no memory limit"):
        num_kv_pages(ARCH, CacheConfig(), jnp.bfloat16, FakeDevice(limit=None, in_use=0))
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        CacheConfig(gpu_memory_utilization=1.5)


def test_the_flag_reaches_the_config_and_the_environment(monkeypatch):
    import argparse

    from jaxbatch.cli.engine_args import add_engine_args, engine_config_from_args

    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_config_from_args(p.parse_args(["--model", "m", "--gpu-memory-utilization",
                                                "0.8"]))
    assert cfg.cache.gpu_memory_utilization == 0.8
    import os

    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.8"
