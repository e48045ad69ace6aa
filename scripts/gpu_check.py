"""The Python side of scripts/gpu_check.sh: each mode prints one JSON line per check
({"check": name, "ok": bool, ...}) and exits 0; the shell collects them and fails the run on any
"ok": false.

  python scripts/gpu_check.py mkmodel DIR       a tiny random Llama (HF layout), numpy only
  python scripts/gpu_check.py tokens DIR OUT BACKEND
                                                greedy float32 tokens of fixed prompts with that
                                                attention backend, saved to OUT (JSON)
  python scripts/gpu_check.py compare GOT WANT  the device's tokens equal the CPU reference's
  python scripts/gpu_check.py defaults DIR      dtype auto and the KV cache's default size here
  python scripts/gpu_check.py bench             decode attention GB/s against a measured copy
                                                rate, checked against the jnp reference; a
                                                cache past 2^31 elements (i64 offsets)

SMALL=1 (the shell's CPU dry run) shrinks every size so that interpret mode runs in seconds;
MIN_PCT_COPY (default 20): the decode kernel's share of the copy rate below which `bench` fails.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

import numpy as np

SMALL = os.environ.get("SMALL") == "1"


def out(check: str, ok: bool, **kw) -> None:
    print(json.dumps({"check": check, "ok": bool(ok), **kw}, default=str), flush=True)


def mkmodel(path: str) -> None:
    """A tiny random Llama: config through transformers, weights written with safetensors."""
    import transformers
    from safetensors.numpy import save_file

    H, I, L, NH, KV, D, V = (64, 128, 2, 4, 2, 16, 256) if SMALL else (256, 512, 2, 4, 2, 64, 512)
    transformers.LlamaConfig(
        vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=L,
        num_attention_heads=NH, num_key_value_heads=KV, head_dim=D, max_position_embeddings=1024,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2).save_pretrained(path)
    r = np.random.default_rng(0)

    def w(*shape):
        return (r.standard_normal(shape) * 0.08).astype(np.float32)

    def norm():
        return (1 + 0.1 * r.standard_normal(H)).astype(np.float32)

    t = {"model.embed_tokens.weight": w(V, H), "model.norm.weight": norm(),
         "lm_head.weight": w(V, H)}
    for i in range(L):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
                  p + "self_attn.q_proj.weight": w(NH * D, H), p + "self_attn.k_proj.weight": w(KV * D, H),
                  p + "self_attn.v_proj.weight": w(KV * D, H), p + "self_attn.o_proj.weight": w(H, NH * D),
                  p + "mlp.gate_proj.weight": w(I, H), p + "mlp.up_proj.weight": w(I, H),
                  p + "mlp.down_proj.weight": w(H, I)})
    save_file(t, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


# the requests: prompt lengths and greedy tokens (SMALL: fewer, for interpret mode), and the
# one bucket set both runs compile (a prefill-sized and a decode-sized step)
LENGTHS, MAX_TOKENS, PLANNER, STEP = ((5, 19, 1), (4, 6, 3), "fixed:[(16,4)]", 16) if SMALL \
    else ((5, 70, 17, 33, 1, 90), (12, 20, 3, 12, 15, 9), "fixed:[(8,4),(64,4)]", 64)


def _prompts(vocab: int) -> list[list[int]]:
    rs = np.random.RandomState(0)
    return [list(map(int, rs.randint(3, vocab, k))) for k in LENGTHS]


def _generate(llm, prompts, max_tokens) -> list[list[int]]:
    from jaxbatch import SamplingParams

    sp = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def tokens(model: str, path: str, backend: str) -> None:
    """Greedy float32 tokens (matmuls at full f32 precision: TF32 would differ from the CPU)."""
    import jax

    from jaxbatch import LLM

    with jax.default_matmul_precision("highest"):
        t = time.perf_counter()
        llm = LLM(model, dtype="float32", attention_backend=backend, page_size=16,
                  max_model_len=512, max_num_batched_tokens=STEP, max_num_seqs=4, num_pages=256,
                  planner=PLANNER, seed=0, progress=False)
        got = _generate(llm, _prompts(llm.engine.arch.vocab_size), MAX_TOKENS)
    with open(path, "w") as f:
        json.dump(got, f)
    out(f"tokens_{backend}", all(len(g) == m for g, m in zip(got, MAX_TOKENS)),
        platform=jax.default_backend(), seconds=round(time.perf_counter() - t, 1))


def compare(got_path: str, want_path: str) -> None:
    got, want = (json.load(open(p)) if os.path.exists(p) else None for p in (got_path, want_path))
    diff = None if not (got and want) else next(
        (i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    out("e2e_greedy_equals_cpu_reference", got is not None and got == want,
        missing=[p for p, v in ((got_path, got), (want_path, want)) if v is None],
        first_differing_request=diff)


def defaults(model: str) -> None:
    """dtype auto and the cache's default size (gpu_memory_utilization on a GPU)."""
    import jax

    from jaxbatch import LLM

    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu:
        out("dtype_auto_and_kv_budget", True, skipped="not on a GPU")
        return
    llm = LLM(model, page_size=16, max_model_len=512, max_num_batched_tokens=STEP, max_num_seqs=4,
              planner=PLANNER, seed=0, progress=False)
    r = llm.engine.runner
    dev = jax.devices()[0]
    stats = dev.memory_stats() or {}
    kv = 2 * r.kv_cache["k"].nbytes
    got = _generate(llm, _prompts(llm.engine.arch.vocab_size), MAX_TOKENS)
    import jax.numpy as jnp

    ok = (jnp.dtype(r.compute_dtype) == jnp.bfloat16  # auto on a GPU: bf16, untimed
          and kv > 0.3 * stats.get("bytes_limit", 0)  # the pool, not a fixed 2 GB
          and all(len(g) == m for g, m in zip(got, MAX_TOKENS)))
    out("dtype_auto_and_kv_budget", ok, compute_dtype=str(r.compute_dtype),
        kv_cache_gib=round(kv / 2**30, 2), pool_gib=round(stats.get("bytes_limit", 0) / 2**30, 2),
        num_pages=r.num_pages, device=dev.device_kind)


def _timed(f, *args, iters: int = 20) -> float:
    import jax

    jax.block_until_ready(f(*args))
    times = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(iters):
            o = f(*args)
        jax.block_until_ready(o)
        times.append((time.perf_counter() - t) / iters)
    return float(np.median(times))


def _case(name, q_lens, ctx, copy_gbs, *, N=None, tail=False, Hq=32, Hkv=8, D=128, P=16,
          time_it=True, min_pct=0.0):
    """The kernel against the jnp reference on one ragged batch (pages shuffled, or the last
    pages of a big cache with `tail`), timed: KV bytes read per second next to the copy rate."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.attention import tuning
    from pallas_kernels.attention.kernel import ragged_paged_attention as kernel
    from pallas_kernels.attention.reference import ragged_paged_attention_reference as reference

    on_gpu = jax.default_backend() == "gpu"
    rng = np.random.default_rng(0)
    kv = [c + q for c, q in zip(ctx, q_lens)]
    npg = [-(-k // P) for k in kv]
    used = sum(npg)
    N = N or used + 1
    ids = (N - 1 - np.arange(used)) if tail else 1 + rng.permutation(used)
    table = np.zeros((len(kv), max(npg)), np.int32)
    at = 0
    for s, m in enumerate(npg):
        table[s, :m] = ids[at:at + m]
        at += m
    k1, k2, k3 = jax.random.split(jax.random.key(len(name)), 3)
    dt = jnp.bfloat16
    zero = jnp.zeros((N, P, Hkv, D), dt)
    kp, vp = (zero.at[ids].set(jax.random.normal(k, (used, P, Hkv, D), dt)) for k in (k1, k2))
    del zero
    args = (jax.random.normal(k3, (sum(q_lens), Hq, D), dt), kp, vp, jnp.asarray(kv, jnp.int32),
            jnp.asarray(table), jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
            jnp.asarray([len(kv)], jnp.int32))
    knobs = tuning.for_device(jax.devices()[0]).kwargs()
    kern = jax.jit(functools.partial(kernel, sm_scale=D**-0.5, interpret=not on_gpu, **knobs))
    ref = jax.jit(functools.partial(reference, sm_scale=D**-0.5))
    got, want = (np.asarray(f(*args).astype(jnp.float32)) for f in (kern, ref))
    err = float(np.max(np.abs(got - want) / (1.5e-2 + 1.5e-2 * np.abs(want))))
    t = _timed(kern, *args) if time_it else 0.0
    nbytes = sum(kv) * 2 * Hkv * D * 2
    gbs = nbytes / t / 1e9 if t else None
    pct = 100 * gbs / copy_gbs if gbs else None
    correct = bool(np.isfinite(got).all() and err <= 1)
    out(f"attention_{name}", correct and (pct is None or pct >= min_pct), err_over_tol=err,
        us=round(t * 1e6, 1), gbs=gbs and round(gbs), pct_of_copy=pct and round(pct, 1),
        min_pct_of_copy=min_pct if time_it else None, interpret=not on_gpu)


def bench() -> None:
    import jax
    import jax.numpy as jnp

    dev = jax.devices()[0]
    x = jnp.ones((1 << (16 if SMALL else 29),), jnp.bfloat16)  # 1 GiB on a GPU
    copy_gbs = 2 * x.nbytes / _timed(jax.jit(lambda x: x + 1), x, iters=10) / 1e9
    del x
    out("copy_rate", copy_gbs > 0, device=dev.device_kind, gbs=round(copy_gbs))
    min_pct = 0.0 if SMALL else float(os.environ.get("MIN_PCT_COPY", "20"))
    if SMALL:  # interpret mode on CPU: correctness at tiny shapes, a rate for the record only
        _case("decode4x60", [1] * 4, [60] * 4, copy_gbs, Hq=4, Hkv=2, D=64, min_pct=min_pct)
        out("attention_offset_past_2^31_elements", True, skipped="needs 9 GB of device memory")
        return
    _case("decode64x4k", [1] * 64, [4095] * 64, copy_gbs, min_pct=min_pct)
    _case("decode256x1k", [1] * 256, [1023] * 256, copy_gbs, min_pct=min_pct)
    _case("decode8x16k", [1] * 8, [16383] * 8, copy_gbs, min_pct=min_pct)
    # 140,000 pages of 16 x 8 x 128: 2.3e9 elements each of K and V (the i64 offset path),
    # reading the cache's last pages
    _case("offset_past_2^31_elements", [1, 1, 64, 1], [3000, 100, 200, 5000], copy_gbs,
          N=140_000, tail=True, time_it=False)


if __name__ == "__main__":
    mode, rest = sys.argv[1], sys.argv[2:]
    try:
        {"mkmodel": mkmodel, "tokens": tokens, "compare": compare, "defaults": defaults,
         "bench": bench}[mode](*rest)
    except Exception as e:  # noqa: BLE001 - one failed check line, then the traceback
        out(f"{mode}_process", False, error=repr(e)[:400])
        raise
