"""The built-in SmolLM2-135M-Instruct (Q4_1 GGUF) against transformers reading the same file.

The model is fetched once into a persistent cache (`$JAXBATCH_CACHE`, else `<repo>/.cache/jaxbatch`)
so repeated runs neither download nor convert it again. Run with `-s` to see load times and logit
differences.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxbatch.model.archs import llama
from jaxbatch.model.loader import LoadedModel, load_model
from pallas_kernels.attention.reference import (
    ragged_paged_attention_reference as rpa,
)
from tests.helpers.smollm2 import chat_ids, torch_one_thread

pytestmark = pytest.mark.slow  # the real model, and transformers' on the same file

PAGE = 16
NEW_TOKENS = 32
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a CPU does.",
    "List three fruits.",
]


@functools.partial(jax.jit, static_argnames=("arch",), donate_argnames=("cache",))
def _step(params, cache, ids, pos, attn, rows, *, arch):
    """Forward the flattened tokens; float32 logits [S, V] of the token rows in `rows`."""
    h, cache = llama.forward(params, cache, ids, pos, attn, arch=arch, attention_fn=rpa)
    return llama.compute_logits(params, h[rows], arch=arch), cache


def greedy(m: LoadedModel, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy decode all prompts together: one ragged prefill, then one token per sequence a step.

    Sequence s owns pages 1 + s*W .. (s+1)*W (page 0 is the dummy page). Returns the new tokens.
    """
    S = len(prompts)
    W = -(-(max(map(len, prompts)) + steps) // PAGE)
    pages = 1 + np.arange(S * W).reshape(S, W)
    cache = llama.init_kv_cache(m.arch, 1 + S * W, PAGE, jnp.float32)
    lens = np.array([len(p) for p in prompts])

    def run(ids, seq, pos, kv_lens, cu):
        attn = llama.AttentionInputs(
            slot_mapping=jnp.asarray(pages[seq, pos // PAGE] * PAGE + pos % PAGE, jnp.int32),
            kv_lens=jnp.asarray(kv_lens, jnp.int32),
            page_indices=jnp.asarray(pages, jnp.int32),
            cu_q_lens=jnp.asarray(cu, jnp.int32),
            num_seqs=jnp.asarray([S], jnp.int32),
        )
        return _step(m.params, cache, jnp.asarray(ids, jnp.int32), jnp.asarray(pos, jnp.int32),
                     attn, jnp.asarray(cu[1:] - 1, jnp.int32), arch=m.arch)

    cu = np.concatenate([[0], np.cumsum(lens)])
    seq = np.repeat(np.arange(S), lens)
    pos = np.concatenate([np.arange(n) for n in lens])
    logits, cache = run(np.concatenate(prompts), seq, pos, lens, cu)
    out = [[int(t)] for t in np.asarray(logits).argmax(-1)]
    for i in range(1, steps):
        pos = lens + i - 1  # position of the token being fed
        ids = [o[-1] for o in out]
        logits, cache = run(ids, np.arange(S), pos, pos + 1, np.arange(S + 1))
        for o, t in zip(out, np.asarray(logits).argmax(-1), strict=True):
            o.append(int(t))
    return out


def _until_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def test_logits_match_hf(smol, hf_smol):
    ids = chat_ids(smol.tokenizer, PROMPTS[0])
    with torch.no_grad(), torch_one_thread():
        ref = hf_smol(torch.tensor([ids])).logits[0].numpy()
    T = len(ids)
    W = -(-T // PAGE)
    pages = np.arange(1, W + 1)
    pos = np.arange(T)
    attn = llama.AttentionInputs(
        jnp.asarray(pages[pos // PAGE] * PAGE + pos % PAGE, jnp.int32), jnp.asarray([T], jnp.int32),
        jnp.asarray(pages[None], jnp.int32), jnp.asarray([0, T], jnp.int32),
        jnp.asarray([1], jnp.int32),
    )
    cache = llama.init_kv_cache(smol.arch, W + 1, PAGE, jnp.float32)
    ours, _ = _step(smol.params, cache, jnp.asarray(ids), jnp.asarray(pos), attn,
                    jnp.arange(T), arch=smol.arch)
    ours = np.asarray(ours)
    diff, scale = float(np.abs(ours - ref).max()), float(np.abs(ref).max())
    print(f"\nsmollm2 logits ({T} tokens): max|diff| {diff:.3g}, max|logit| {scale:.3g}, "
          f"ratio {diff / scale:.2g}")
    assert diff <= 1e-4 * scale


def test_greedy_decode_matches_hf_generate(smol, hf_smol):
    prompts = [chat_ids(smol.tokenizer, p) for p in PROMPTS]
    eos = smol.tokenizer.eos_token_id
    ours = greedy(smol, prompts, NEW_TOKENS)
    for p, got in zip(prompts, ours, strict=True):
        with torch.no_grad(), torch_one_thread():
            ref = hf_smol.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW_TOKENS,
                                   attention_mask=torch.ones(1, len(p), dtype=torch.long))
        want = ref[0, len(p):].tolist()
        assert _until_eos(got, eos) == _until_eos(want, eos), smol.tokenizer.decode(want)
    print("\n" + smol.tokenizer.decode(_until_eos(ours[0], eos)))


def test_conversion_and_cache_times(smol, tmp_path):
    """First load converts the GGUF (dequantise + tokenizer + cache write); the second restores."""
    cache = str(tmp_path / "cache")
    first = load_model(smol.source, "float32", cache_dir=cache)
    second = load_model(smol.source, "float32", cache_dir=cache)
    print(f"\nsmollm2 first load (GGUF conversion): {first.load_seconds:.2f}s; "
          f"second load (orbax cache): {second.load_seconds:.2f}s")
    assert (first.from_cache, second.from_cache) == (False, True)
    # (times are printed, not asserted: timing asserts do not belong in tests)
    jax.tree.map(np.testing.assert_array_equal, smol.params, second.params)
