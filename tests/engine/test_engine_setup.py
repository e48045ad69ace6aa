"""How Engine.from_config assembles the engine from the config and the loaded model, with a test
for each decision that used to be made apart from its owner (and was wrong): the --tokenizer
directory, generation_config's EOS ids, and the KV cache's size in the cache's real dtype."""

from __future__ import annotations

import json
import os
import shutil

import jax.numpy as jnp
import pytest

from jaxbatch import LLM, SamplingParams
from jaxbatch.cli import main as cli_main
from jaxbatch.config import CacheConfig
from jaxbatch.model.loader import load_model
from jaxbatch.worker.attention import attention_fn
from jaxbatch.worker.runner import Runner, kv_storage_dtype, num_kv_pages
from tests.helpers import TINY_CONFIG
from tests.helpers.tiny_models import make_tiny_model

ONE_BUCKET = dict(dtype="float32", max_model_len=128, page_size=16, num_pages=64, max_num_batched_tokens=32,
                  max_num_seqs=4, planner="fixed:[(32,4)]", attention_backend="reference",
                  compile_guard=True, progress=False)


def _weights_only_copy(src: str, dst: str) -> str:
    """The model of `src` without its tokenizer files (config + safetensors only)."""
    os.makedirs(dst)
    for f in os.listdir(src):
        if f == "config.json" or f.endswith(".safetensors"):
            shutil.copy(os.path.join(src, f), dst)
    return dst


def test_tokenizer_flag_supplies_a_tokenizer(tiny_chat_dir, tmp_path, capsys):
    """`--tokenizer DIR` gives a model directory without tokenizer files a tokenizer (it used
    to assign to a frozen dataclass: it could never work)."""
    bare = _weights_only_copy(tiny_chat_dir, str(tmp_path / "bare"))
    assert load_model(bare, "float32").tokenizer is None
    code = cli_main(["generate", "--config", TINY_CONFIG, "--model", bare, "--tokenizer",
                     tiny_chat_dir, "--raw", "--max-tokens", "3", "Hello there"])
    assert code == 0
    assert "### Hello there" in capsys.readouterr().out
    with pytest.raises(FileNotFoundError, match="holds no tokenizer files"):
        load_model(bare, "float32", tokenizer=bare)


def test_generation_config_eos_ids_end_generation(tmp_path):
    """generation_config.json's eos_token_id (a list, as Llama 3 instruct ships it) stops
    generation, not only the tokenizer's EOS (it used to be read from a field that did not
    exist, so these ids were ignored)."""
    d = str(tmp_path / "m")
    make_tiny_model("llama_gqa", d)
    prompt = {"prompt_token_ids": [1, 17, 33, 71, 5]}
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    first = LLM(d, **ONE_BUCKET).generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    assert first.finish_reason == "length"  # config eos 2 never came up: nothing stops it
    ids = first.token_ids
    # the first token that differs from those before it (a random model repeats itself)
    k = next((i for i in range(1, len(ids)) if ids[i] not in ids[:i]), 0)
    stop_at = ids[k]
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, stop_at]}, f)
    assert load_model(d, "float32").eos_token_ids == tuple(sorted({2, stop_at}))
    out = LLM(d, **ONE_BUCKET).generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids[: k + 1]
    assert out.finish_reason == "stop"
    ignored = LLM(d, **ONE_BUCKET).generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert ignored[0].outputs[0].token_ids == first.token_ids


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kv_pages_sized_in_the_cache_dtype(tmp_path, dtype):
    """A memory budget buys as many pages as fit at the element size really allocated (it used
    to be sized at 2 bytes for bf16 while the CPU cache was f32: twice the budget); bf16 values
    are stored as uint16 bits on CPU, 2 bytes each."""
    d = str(tmp_path / "m")
    make_tiny_model("llama_gqa", d)
    model = load_model(d, dtype)
    budget_gb = 0.001
    runner = Runner(model.arch, model.params, CacheConfig(page_size=16,
                                                          kv_cache_memory_gb=budget_gb),
                    128, attention_fn("reference", str(tmp_path)))
    cache_bytes = runner.kv_cache["k"].nbytes + runner.kv_cache["v"].nbytes
    assert runner.kv_cache["k"].dtype == kv_storage_dtype(model.params["embed"].dtype)
    assert cache_bytes <= budget_gb * 2**30 < cache_bytes + 2 * runner.kv_cache["k"][0, 0].nbytes \
        * model.arch.num_layers
    f32_pages = num_kv_pages(model.arch, CacheConfig(page_size=16, kv_cache_memory_gb=budget_gb),
                             jnp.float32)
    assert runner.num_pages == f32_pages * 4 // jnp.dtype(runner.cache_dtype).itemsize


def test_auto_attention_is_the_native_kernel_on_cpu(tmp_path, monkeypatch):
    """On a CPU machine with a C++ compiler (every CI machine), auto runs the native kernel;
    without one it falls back to the jnp reference instead of failing, and an explicit native
    is a clear error."""
    from jaxbatch.worker import attention
    from pallas_kernels import cpu_library

    assert attention.resolve_backend("auto", str(tmp_path)) == "native"
    assert attention.resolve_backend("reference", str(tmp_path)) == "reference"
    monkeypatch.setattr(cpu_library, "_registered", None)  # as in a fresh process
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    cpu_library.available.cache_clear()
    try:
        assert attention.resolve_backend("auto", str(tmp_path / "other")) == "reference"
        with pytest.raises(RuntimeError, match="did not build"):
            attention.resolve_backend("native", str(tmp_path / "other"))
    finally:
        cpu_library.available.cache_clear()
