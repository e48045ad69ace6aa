#!/usr/bin/env python
"""Perplexity of a model on a fixed text, per dtype and quantisation, computed the way the engine
computes (llama.forward over paged sequences, weights and KV held as on this device).

    python scripts/perplexity.py [--model smollm2-135m-instruct] [--tokens 2000] \
        [--text tests/data/coriolanus_act1.txt] [--runs float32,bfloat16,float32+int8,...] [--hf]

    python scripts/perplexity.py --protocol llamacpp --files A.gguf B.gguf ... \
        [--runs float32,bfloat16] [--ctx 512] [--reference A.gguf=42.66,B.gguf=42.86 | refs.json]

Each run is DTYPE, DTYPE+int8 (`quantization: int8`) or DTYPE+q8act (the quantised weights'
kernel in its int8 activation mode, llama.cpp's CPU scheme: activations quantised per row to
int8 blocks before the dot, which is what `llama-perplexity` computes); every file (`--files`,
else `--model`) is loaded in each run's dtype (GGUF blocks of the kept formats stay blocks).

--protocol single (the default): the text's first `--tokens` tokens (no BOS added) are one
sequence; perplexity = exp(mean negative log-likelihood of tokens 2..N given those before).
`--hf` adds transformers' float32 forward on the same tokens (the loaded GGUF dequantised by
transformers) as the reference for the float32 number. Prints one line per run and the ratio to
the first run.

--protocol llamacpp: llama.cpp's `llama-perplexity` (tools/perplexity/perplexity.cpp,
`perplexity()`, default flags): the whole text is tokenized once (BOS first when the GGUF's
`tokenizer.ggml.add_bos_token` is true); n_chunk = n_tokens // ctx; chunk i is the tokens
[i*ctx, (i+1)*ctx) evaluated as a fresh sequence, its first token replaced by BOS when add_bos;
the NLL is summed over positions j in [ctx/2, ctx-1) (token j+1 from the logits at j, ctx/2 - 1
tokens a chunk) and PPL = exp(total NLL / count). Prints llama.cpp's running [chunk]ppl line per
run, then a table against `--reference` (llama.cpp's numbers, by file name); the exit status is 1
when a reference differs by more than `--tolerance`.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.model.archs import cpu_layout, llama
from jaxbatch.model.loader import LoadedModel, load_model
from jaxbatch.model.quantize import weight_bytes
from jaxbatch.worker.runner import kv_storage_dtype
from pallas_kernels.attention.reference import (
    ragged_paged_attention_reference,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PAGE = 16
CHUNK = 500  # logits rows per call: [CHUNK, V] f32 at a time instead of [T, V]
SINGLE_RUNS = "float32,bfloat16,float32+int8,bfloat16+int8"


def engine_params(model: LoadedModel, q8act: bool = False) -> dict:
    """The params as the runner holds them on CPU (bf16 as uint16 bits, a tied bf16 head as its
    own [H, V] copy), through the C++ kernels as the engine runs them (built into the cache
    if missing); `q8act`: every quantised weight's kernel in int8 activation mode."""
    from jaxbatch.config import cache_dir
    from pallas_kernels import cpu_library

    if jax.default_backend() == "cpu":
        cpu_library.available(cache_dir())
    if not q8act:
        return cpu_layout.as_run_on_cpu(model.params, model.arch)
    from pallas_kernels.matmul import quant

    dtype = model.params["final_norm"].dtype
    if not quant.available(dtype, act="int8"):
        raise SystemExit("q8act: this CPU has no int8 quantised matmul (AVX512-VNNI)")
    return cpu_layout.as_run_on_cpu(model.params, model.arch, quant_acts=lambda f, n, k: (
        "float" if f in quant.FLOAT_FORMATS else "int8"))


def run_spec(run: str) -> tuple[str, str | None, bool]:
    """DTYPE[+int8][+q8act] -> (dtype, quantization, q8act)."""
    dtype, *mods = run.split("+")
    if any(m not in ("int8", "q8act") for m in mods):
        raise SystemExit(f"unknown run {run!r}: DTYPE[+int8][+q8act]")
    return dtype, "int8" if "int8" in mods else None, "q8act" in mods


def sequence_nll(model: LoadedModel, T: int, first: int = 0, q8act: bool = False
                 ) -> Callable[[np.ndarray], np.ndarray]:
    """A function ids [T] -> -log p(ids[t+1] | ids[:t+1]) for t in [first, T-1), float64
    [T-1-first]: each call one fresh sequence (an empty KV cache), compiled once for `model`
    and `T`."""
    arch, params = model.arch, engine_params(model, q8act)
    n_pages, attn = llama.one_sequence_inputs(T, PAGE)
    cache_dtype = kv_storage_dtype(model.params["final_norm"].dtype)
    rpa = functools.partial(ragged_paged_attention_reference, nan_safe=False)
    rows = T - 1 - first
    block = min(CHUNK, rows)

    @jax.jit
    def hidden_of(params: dict, ids: jax.Array) -> jax.Array:
        cache = llama.init_kv_cache(arch, n_pages, PAGE, cache_dtype)
        hidden, _ = llama.forward(params, cache, ids, jnp.arange(T, dtype=jnp.int32), attn,
                                  arch=arch, attention_fn=rpa)
        return hidden

    @jax.jit
    def nll_rows(params: dict, h: jax.Array, targets: jax.Array) -> jax.Array:
        logits = llama.compute_logits(params, h, arch=arch)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]

    def nll(ids: np.ndarray) -> np.ndarray:
        assert len(ids) == T, (len(ids), T)
        hidden = hidden_of(params, jnp.asarray(ids, jnp.int32))[first:T - 1]
        targets = np.asarray(ids[first + 1:], np.int64)
        out = []
        for s in range(0, rows, block):
            h, t = hidden[s:s + block], targets[s:s + block]
            pad = block - len(t)  # one compiled shape for every block
            if pad:
                h = jnp.pad(h, ((0, pad), (0, 0)))
                t = np.pad(t, (0, pad))
            out.append(np.asarray(nll_rows(params, h, jnp.asarray(t, jnp.int32)),
                                  np.float64)[:block - pad])
        return np.concatenate(out)

    return nll


# ---------------------------------------------------------------------------------------------
# llama.cpp's protocol
# ---------------------------------------------------------------------------------------------
def gguf_add_bos(path: str) -> tuple[bool, int | None]:
    """(tokenizer.ggml.add_bos_token, tokenizer.ggml.bos_token_id) of a GGUF file; (False, None)
    when absent. llama.cpp adds BOS only when the key says so (llama-vocab.cpp reads it over
    the tokenizer type's default, and these files all carry it)."""
    import gguf

    reader = gguf.GGUFReader(path)

    def field(key: str):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    add_bos, bos = field("tokenizer.ggml.add_bos_token"), field("tokenizer.ggml.bos_token_id")
    return bool(add_bos), (None if bos is None else int(bos))


def model_bos(model: LoadedModel) -> tuple[bool, int | None]:
    """Whether llama.cpp would put BOS first, and BOS's id: the GGUF's metadata, else (an HF
    directory) the tokenizer's own `add_bos_token`."""
    if model.source.endswith(".gguf"):
        return gguf_add_bos(model.source)
    tok = model.tokenizer
    return bool(getattr(tok, "add_bos_token", False)), tok.bos_token_id


def llamacpp_tokens(tokenizer, text: str, add_bos: bool, bos_id: int | None) -> np.ndarray:
    """common_tokenize(ctx, text, add_special=true, parse_special=false): the text's tokens,
    BOS first when add_bos (never EOS: llama-perplexity asserts the vocab adds none)."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if add_bos:
        if bos_id is None:
            raise ValueError("add_bos is set but the vocabulary has no BOS token")
        ids = [bos_id, *ids]
    return np.asarray(ids, np.int64)


def llamacpp_chunks(ids: np.ndarray, ctx: int, add_bos: bool, bos_id: int | None,
                    max_chunks: int | None = None) -> list[np.ndarray]:
    """The sequences llama-perplexity evaluates: tokens [i*ctx, (i+1)*ctx) for i < n_tokens //
    ctx (at most `max_chunks`, like its --chunks), the first replaced by BOS when add_bos."""
    if len(ids) < 2 * ctx:
        raise ValueError(f"{len(ids)} tokens: llama-perplexity needs at least {2 * ctx} for "
                         f"a context of {ctx}")
    n = len(ids) // ctx
    if max_chunks is not None and max_chunks >= 0:
        n = min(n, max_chunks)
    chunks = []
    for i in range(n):
        c = np.array(ids[i * ctx:(i + 1) * ctx])
        if add_bos:
            c[0] = bos_id
        chunks.append(c)
    return chunks


def llamacpp_perplexity(chunk_nll: Callable[[np.ndarray], np.ndarray],
                        chunks: list[np.ndarray]) -> tuple[float, list[float], int]:
    """-> (PPL, llama.cpp's running PPL after each chunk, tokens scored); `chunk_nll` is
    `sequence_nll(model, ctx, first=ctx // 2)`: the NLLs of tokens ctx/2+1 .. ctx-1."""
    total, count, running = 0.0, 0, []
    for c in chunks:
        nll = chunk_nll(c)
        assert len(nll) == len(c) - len(c) // 2 - 1
        total += float(nll.sum())
        count += len(nll)
        running.append(math.exp(total / count))
    return running[-1], running, count


def parse_reference(spec: str | None) -> dict[str, float]:
    """`--reference`: a JSON file {file name: PPL}, or NAME=PPL,NAME=PPL; keyed by base name."""
    if not spec:
        return {}
    if spec.endswith(".json") and os.path.isfile(spec):
        with open(spec) as f:
            table = {str(k): float(v) for k, v in json.load(f).items()}
    else:
        table = {}
        for item in spec.split(","):
            name, sep, value = item.strip().rpartition("=")
            if not sep or not name:
                raise SystemExit(f"--reference item {item!r} is not NAME=PPL")
            table[name] = float(value)
    return {os.path.basename(k): v for k, v in table.items()}


def run_llamacpp(args: argparse.Namespace, files: list[str], runs: list[str], text: str) -> int:
    refs = parse_reference(args.reference)
    rows: list[tuple[str, str, float, int, float]] = []
    for path in files:
        for run in runs:
            dtype, quant, q8act = run_spec(run)
            t = time.perf_counter()
            model = load_model(path, dtype).quantized(quant)
            add_bos, bos_id = model_bos(model)
            ids = llamacpp_tokens(model.tokenizer, text, add_bos, bos_id)
            chunks = llamacpp_chunks(ids, args.ctx, add_bos, bos_id, args.chunks)
            ppl, running, count = llamacpp_perplexity(
                sequence_nll(model, args.ctx, first=args.ctx // 2, q8act=q8act), chunks)
            secs = time.perf_counter() - t
            name = os.path.basename(model.source)
            print(f"{name} {run}: {len(ids)} tokens (add_bos {add_bos}), {len(chunks)} chunks "
                  f"of {args.ctx}, {count} scored, {secs:.1f} s", flush=True)
            print("  " + "".join(f"[{i + 1}]{p:.4f}," for i, p in enumerate(running)), flush=True)
            rows.append((name, run, ppl, len(ids), secs))
    off = 0
    w = max(len(r[0]) for r in rows)
    print(f"\n{'file':{w}s}  {'run':14s} {'tokens':>6s}  {'PPL':>9s}  {'llama.cpp':>9s}  "
          f"{'rel diff':>8s}")
    for name, run, ppl, n_tok, _ in rows:
        ref = refs.get(name)
        if ref is None:
            print(f"{name:{w}s}  {run:14s} {n_tok:6d}  {ppl:9.4f}  {'-':>9s}  {'-':>8s}")
            continue
        rel = ppl / ref - 1
        bad = abs(rel) > args.tolerance
        off += bad
        print(f"{name:{w}s}  {run:14s} {n_tok:6d}  {ppl:9.4f}  {ref:9.4f}  {rel:+8.3%}"
              f"{'  OFF' if bad else ''}")
    if refs:
        print(f"{off} of {sum(r[0] in refs for r in rows)} compared runs differ from llama.cpp "
              f"by more than {args.tolerance:.2%}")
    return 1 if off else 0


# ---------------------------------------------------------------------------------------------
# one long sequence
# ---------------------------------------------------------------------------------------------
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


def run_single(args: argparse.Namespace, path: str, runs: list[str], text: str) -> None:
    base = load_model(path, "float32")
    ids = np.asarray(base.tokenizer(text)["input_ids"], np.int64)
    if len(ids) < args.tokens:
        raise SystemExit(f"{args.text} has {len(ids)} tokens, fewer than --tokens {args.tokens}")
    ids = ids[:args.tokens]
    print(f"{path}: {len(ids)} tokens of {os.path.basename(args.text)}")
    results: list[tuple[str, float, float | None, float]] = []
    if args.hf:
        t = time.perf_counter()
        nll = hf_nll(base, ids)
        results.append(("transformers float32", math.exp(nll.mean()), None,
                        time.perf_counter() - t))
    for run in runs:
        dtype, quant, q8act = run_spec(run)
        t = time.perf_counter()
        model = base.with_dtype(dtype).quantized(quant)
        nll = sequence_nll(model, len(ids), q8act=q8act)(ids)
        step_mb = weight_bytes(engine_params(model))["decode_step"] / 2**20
        results.append((run, math.exp(nll.mean()), step_mb, time.perf_counter() - t))
    ref = results[0][1]
    for name, ppl, row_mb, secs in results:
        mbs = f"{row_mb:7.1f} MB weights/step" if row_mb is not None else " " * 23
        print(f"{name:22s} perplexity {ppl:9.4f}  ({ppl / ref - 1:+.3%} vs {results[0][0]})  "
              f"{mbs}  {secs:5.1f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--files", nargs="+", metavar="FILE",
                   help="models to score in turn (GGUF files, HF directories, built-in names) "
                        "instead of --model")
    p.add_argument("--text", default=os.path.join(REPO, "tests", "data", "coriolanus_act1.txt"))
    p.add_argument("--protocol", choices=("single", "llamacpp"), default="single",
                   help="single: one sequence of --tokens tokens; llamacpp: llama-perplexity's "
                        "chunks")
    p.add_argument("--tokens", type=int, default=2000, help="single: the sequence's length")
    p.add_argument("--ctx", type=int, default=512, help="llamacpp: the chunk length (its -c)")
    p.add_argument("--chunks", type=int, default=None,
                   help="llamacpp: at most this many chunks (its --chunks)")
    p.add_argument("--runs", default=None,
                   help=f"comma-separated DTYPE[+int8][+q8act] (default: {SINGLE_RUNS} for the single "
                        "protocol, float32 for llamacpp)")
    p.add_argument("--reference", default=None,
                   help="llamacpp: llama.cpp's PPLs, NAME=PPL,... or a .json {name: PPL}; "
                        "names are file base names")
    p.add_argument("--tolerance", type=float, default=0.005,
                   help="llamacpp: the relative difference from --reference allowed (0.005)")
    p.add_argument("--hf", action="store_true", help="single: add transformers' float32 as a "
                                                     "reference")
    args = p.parse_args()
    files = args.files or [args.model]
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    if args.protocol == "llamacpp":
        runs = (args.runs or "float32").split(",")
        sys.exit(run_llamacpp(args, files, runs, text))
    for path in files:
        run_single(args, path, (args.runs or SINGLE_RUNS).split(","), text)


if __name__ == "__main__":
    main()
