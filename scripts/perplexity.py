#!/usr/bin/env python
"""Perplexity of a model on a fixed text, per dtype and quantisation, computed the way the engine
computes (llama.forward over one paged sequence, bf16 weights and KV held as on this device).

    python scripts/perplexity.py [--model smollm2-135m-instruct] [--tokens 2000] \
        [--text tests/data/coriolanus_act1.txt] [--runs float32,bfloat16,float32+int8,...] [--hf]

Each run is DTYPE or DTYPE+int8 (`quantization: int8`). The text's first `--tokens` tokens (no
BOS added) are one sequence; perplexity = exp(mean negative log-likelihood of tokens 2..N given
those before). `--hf` adds transformers' float32 forward on the same tokens (the loaded GGUF
dequantised by transformers) as the reference for the float32 number. Prints one line per run
and the ratio to the first run.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.engine.runner import kv_storage_dtype
from jaxbatch.model import llama
from jaxbatch.model.loader import LoadedModel, load_model
from jaxbatch.model.quantize import weight_bytes
from pallas_kernels.attention.reference import (
    ragged_paged_attention_reference,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PAGE = 16
CHUNK = 500  # logits rows per call: [CHUNK, V] f32 at a time instead of [T, V]


def engine_params(model: LoadedModel) -> dict:
    """The params as the runner holds them on CPU (bf16 as uint16 bits, a tied bf16 head as its
    own [H, V] copy)."""
    return llama.as_run_on_cpu(model.params, model.arch)


def token_nll(model: LoadedModel, ids: np.ndarray) -> np.ndarray:
    """-log p(ids[t] | ids[:t]) for t = 1..T-1, float64 [T-1]."""
    arch, params = model.arch, engine_params(model)
    T = len(ids)
    n_pages, attn = llama.one_sequence_inputs(T, PAGE)
    cache_dtype = kv_storage_dtype(model.params["embed"].dtype)
    cache = llama.init_kv_cache(arch, n_pages, PAGE, cache_dtype)
    rpa = functools.partial(ragged_paged_attention_reference, nan_safe=False)
    fwd = jax.jit(functools.partial(llama.forward, arch=arch, attention_fn=rpa))
    hidden, _ = fwd(params, cache, jnp.asarray(ids, jnp.int32), jnp.arange(T, dtype=jnp.int32),
                    attn)

    @jax.jit
    def nll_rows(h: jax.Array, targets: jax.Array) -> jax.Array:
        logits = llama.compute_logits(params, h, arch=arch)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]

    out = []
    targets = np.append(ids[1:], 0)  # the last row predicts nothing; dropped below
    for s in range(0, T, CHUNK):
        h, t = hidden[s:s + CHUNK], targets[s:s + CHUNK]
        pad = CHUNK - len(t)  # one compiled shape for every chunk
        if pad:
            h = jnp.pad(h, ((0, pad), (0, 0)))
            t = np.pad(t, (0, pad))
        out.append(np.asarray(nll_rows(h, jnp.asarray(t, jnp.int32)), np.float64)[:CHUNK - pad])
    return np.concatenate(out)[:T - 1]


def hf_nll(model: LoadedModel, ids: np.ndarray) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(model.source)
    kw = {"gguf_file": f} if f.endswith(".gguf") else {}
    hf = AutoModelForCausalLM.from_pretrained(d if kw else model.source, dtype=torch.float32,
                                              **kw).eval()
    with torch.no_grad():
        logits = hf(torch.tensor(ids)[None]).logits[0, :-1].double()
    logp = torch.log_softmax(logits, dim=-1)
    return -logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--text", default=os.path.join(REPO, "tests", "data", "coriolanus_act1.txt"))
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--runs", default="float32,bfloat16,float32+int8,bfloat16+int8")
    p.add_argument("--hf", action="store_true", help="add transformers' float32 as a reference")
    args = p.parse_args()
    base = load_model(args.model, "float32")
    with open(args.text, encoding="utf-8") as f:
        ids = np.asarray(base.tokenizer(f.read())["input_ids"], np.int64)
    if len(ids) < args.tokens:
        raise SystemExit(f"{args.text} has {len(ids)} tokens, fewer than --tokens {args.tokens}")
    ids = ids[:args.tokens]
    print(f"{args.model}: {len(ids)} tokens of {os.path.basename(args.text)}")
    results: list[tuple[str, float, float | None, float]] = []
    if args.hf:
        t = time.perf_counter()
        nll = hf_nll(base, ids)
        results.append(("transformers float32", math.exp(nll.mean()), None,
                        time.perf_counter() - t))
    for run in args.runs.split(","):
        dtype, _, quant = run.partition("+")
        t = time.perf_counter()
        model = base.with_dtype(dtype).quantized(quant or None)
        nll = token_nll(model, ids)
        step_mb = weight_bytes(engine_params(model))["decode_step"] / 2**20
        results.append((run, math.exp(nll.mean()), step_mb, time.perf_counter() - t))
    ref = results[0][1]
    for name, ppl, row_mb, secs in results:
        mbs = f"{row_mb:7.1f} MB weights/step" if row_mb is not None else " " * 23
        print(f"{name:22s} perplexity {ppl:9.4f}  ({ppl / ref - 1:+.3%} vs {results[0][0]})  "
              f"{mbs}  {secs:5.1f} s")


if __name__ == "__main__":
    main()
