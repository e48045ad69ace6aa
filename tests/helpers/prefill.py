"""One sequence's prefill through `llama.forward` with a small paged cache: the logits the
model tests compare against transformers."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from jaxbatch.model.archs import llama
from pallas_kernels.attention.reference import ragged_paged_attention_reference

PAGE = 4


def prefill_logits(arch, params, ids, cache_dtype) -> np.ndarray:
    """f32 logits [T, V] of `ids` (one sequence, pages of PAGE tokens, the jnp reference
    attention); `cache_dtype` as the runner would store K/V (uint16: bf16 bits)."""
    T = len(ids)
    num_pages, attn = llama.one_sequence_inputs(T, PAGE)
    cache = llama.init_kv_cache(arch, num_pages, PAGE, cache_dtype)
    rpa = functools.partial(ragged_paged_attention_reference, nan_safe=False)
    h, _ = llama.forward(params, cache, jnp.asarray(ids), jnp.arange(T), attn, arch=arch,
                         attention_fn=rpa)
    return np.asarray(llama.compute_logits(params, h, arch=arch), np.float32)
