"""Embeddings: a prompt's last hidden state, read back from the step that computes it.

An embedding request (`NewRequest.embed`) is an ordinary request of one greedy token: it goes
through the same scheduler, planner and compiled buckets as every other (chunked prefill, the
prefix cache, preemption), beside generation requests in the same steps, and finishes after its
first step that reaches the prompt's last position. The step keeps its hidden states
[T, H] (before the final norm) on the device (worker/runner.py); that row, through the final
norm as `compute_logits` applies it, is the model's last hidden state at the last prompt token:
transformers' `AutoModel(...).last_hidden_state[:, -1]`, which last-token pooling embeds
(Qwen3-Embedding, gte-Qwen2, e5-mistral). The one token sampled on the way (one row of the head)
is dropped; the request's pages are freed as it finishes (the prefix cache keeps them as it keeps
any finished request's: a later prompt sharing the prefix reuses them).

Only last-token pooling is offered: a prefix-cache hit skips the positions mean or first-token
(CLS) pooling would need. `pooling_mode` reads what the model asks for (sentence-transformers'
`1_Pooling/config.json`, a GGUF's `{arch}.pooling_type`) so that the API can refuse the others.
Truncation (`dimensions`), normalisation and encoding are the API's (api/embeddings.py).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import jax
import numpy as np

from jaxbatch.core.sampling_params import SamplingParams
from jaxbatch.core.scheduler import ScheduledSeq

log = logging.getLogger(__name__)

# what an embedding request samples: one greedy token, then it has finished
EMBED_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)
# llama.cpp's enum llama_pooling_type (GGUF `{arch}.pooling_type`)
_GGUF_POOLING = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
# sentence-transformers' 1_Pooling/config.json flags
_ST_POOLING = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
               "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
               "pooling_mode_weightedmean_tokens": "weightedmean",
               "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len"}


def marked(requests: list[Any], embed: bool) -> list[Any]:
    """The engine's new requests, flagged as embeddings (or not)."""
    for req in requests:
        req.embed = embed
    return requests


def pooled_rows(seqs: list[ScheduledSeq]) -> tuple[list[int], list[Any]]:
    """(rows of the step's flattened tokens, their requests): the embedding requests whose
    prompt's last position this step computes, each that position's row."""
    rows, reqs = [], []
    off = 0
    for s in seqs:
        req, n_prompt = s.request, len(s.request.prompt_token_ids)
        if req.embed and req.pooled is None and s.start < n_prompt <= s.start + s.num_new_tokens:
            rows.append(off + n_prompt - 1 - s.start)
            reqs.append(req)
        off += s.num_new_tokens
    return rows, reqs


def collect(seqs: list[ScheduledSeq], runner: Any) -> None:
    """After a step: each embedding request whose last prompt position it computed gets that
    position's final hidden state (f32[H]) as request.pooled. Nothing is read when none did."""
    rows, reqs = pooled_rows(seqs)
    if not rows:
        return
    hidden = runner.hidden_rows(np.asarray(rows, np.int64))  # [N, H], the compute dtype
    arch = runner.arch
    out = final_norm(hidden, _host(runner.params["final_norm"]), arch.rms_norm_eps,
                     arch.plus_one_norms)
    for req, v in zip(reqs, out):
        req.pooled = v


def final_norm(h: np.ndarray, w: np.ndarray, eps: float, plus_one: bool) -> np.ndarray:
    """llama.rms_norm on the host: hidden [N, H] in the compute dtype, the final norm's weight
    [H] -> f32[N, H], rounded where the model rounds (to h's dtype, before the scale; Gemma's
    1 + w in float32, then rounded)."""
    x = h.astype(np.float32)
    x = x / np.sqrt((x * x).mean(-1, keepdims=True) + np.float32(eps))
    wf = w.astype(np.float32)
    if plus_one:
        return (x * (1.0 + wf)).astype(h.dtype).astype(np.float32)
    return (x.astype(h.dtype).astype(np.float32) * wf).astype(h.dtype).astype(np.float32)


def _host(w: Any) -> np.ndarray:
    """A stored weight on the host as values (uint16 holds bf16 bits: llama.store_bf16_as_bits)."""
    import ml_dtypes

    a = np.asarray(jax.device_get(w))
    return a.view(ml_dtypes.bfloat16) if a.dtype == np.uint16 else a


def pooling_mode(source: str) -> str:
    """How the model at `source` (an HF directory or a GGUF file) pools: 'last' unless its
    sentence-transformers pooling config or its GGUF metadata names another mode."""
    if os.path.isdir(source):
        path = os.path.join(source, "1_Pooling", "config.json")
        if not os.path.isfile(path):
            return "last"
        with open(path) as f:
            cfg = json.load(f)
        modes = [m for k, m in _ST_POOLING.items() if cfg.get(k)]
        return modes[0] if len(modes) == 1 else "+".join(modes) or "last"
    if source.endswith(".gguf") and os.path.isfile(source):
        import gguf

        reader = gguf.GGUFReader(source)
        arch = reader.fields.get("general.architecture")
        key = f"{arch.contents()}.pooling_type" if arch is not None else ""
        field = reader.fields.get(key)
        if field is None:
            return "last"
        return _GGUF_POOLING.get(int(field.contents()), f"type {int(field.contents())}")
    return "last"
