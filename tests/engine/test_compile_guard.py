"""The no-recompile guard: silent after warm-up across every bucket, loud on a stray compile,
and not tripped by a second engine warming up in the same process."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jaxbatch import LLM, SamplingParams
from jaxbatch.engine.compile_guard import RecompileError
from tests.helpers.tiny_models import make_tiny_model


def test_guard(tmp_path):
    path = str(tmp_path / "m")
    make_tiny_model("llama_gqa", path)
    opts = dict(max_num_seqs=4, compile_guard=True, progress=False, max_model_len=128,
                num_pages=64)
    a = LLM(path, dtype="float32", planner="fixed:[(4,4),(16,4)]", max_num_batched_tokens=16, **opts)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 3, 15, 40, 7)]
    a.generate(prompts, sp, use_tqdm=False)  # touches both buckets, chunked and decode steps
    assert a.engine.compiles_since_warmup == 0
    b = LLM(path, dtype="float32", planner="fixed:[(32,4)]", max_num_batched_tokens=32, **opts)  # compiles
    a.generate(prompts, sp, use_tqdm=False)
    assert a.engine.compiles_since_warmup == 0 and b.engine.compiles_since_warmup == 0
    jnp.arange(17).astype(jnp.float32).sum()  # a stray shape compiled outside any warm-up
    with pytest.raises(RecompileError, match="after warm-up"):
        a.generate(prompts, sp, use_tqdm=False)
