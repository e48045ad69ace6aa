"""transformers' greedy generation as the reference the engine must equal token for token."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _greedy(model, prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    model.generation_config.eos_token_id = None  # generate exactly n tokens, like ignore_eos
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones_like(ids))
    return tuple(out[0, len(prompt):].tolist())


def hf_greedy(model, prompt, n: int) -> list[int]:
    """The first n greedy tokens after `prompt` (cached per model, prompt and n)."""
    return list(_greedy(model, tuple(int(t) for t in prompt), n))
