"""Shared SmolLM2 helpers for tests (the session fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def torch_one_thread() -> Iterator[None]:
    """Torch's spinning threads fight XLA's on a small shared CPU; one thread is ~10x faster."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def load_smol():
    from jaxbatch.config import cache_dir
    from jaxbatch.model.loader import load_model

    t0 = time.perf_counter()
    m = load_model("smollm2-135m-instruct", "float32", cache_dir=cache_dir())
    print(f"\nsmollm2 load: {time.perf_counter() - t0:.2f}s (from_cache={m.from_cache})")
    return m


def load_hf_smol(smol):
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(smol.source)
    with torch_one_thread():
        return AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()


def chat_ids(tok, text: str) -> list[int]:
    msgs = [{"role": "user", "content": text}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    return list(enc["input_ids"])


