#!/usr/bin/env python
"""A random-block mixture-of-experts GGUF with a real model's shape, written straight to GGUF with
the gguf package's writer (a bf16 source of Qwen3-30B-A3B would be 61 GB), for measuring speed
and memory at the sizes users run (the blocks' values do not change the work; greedy with
ignore_eos fixes the lengths).

  python scripts/make_moe_gguf.py SHAPE OUT.gguf --tokenizer-gguf SmolLM2-135M-Instruct.Q4_1.gguf
      [--type Q4_K_M|Q8_0|BF16]

SHAPE: qwen3-30b-a3b (48 layers, hidden 2048, 32/4 heads of 128, q/k norms, 128 experts of 768,
top-8; `qwen3moe`), gpt-oss-20b (24 layers, hidden 2880, 64/8 heads of 64 with attention sinks
and biases, 32 experts of 2880 with biases, top-4, 128-token sliding window on alternate layers,
YaRN rope; `gpt-oss`; --type MXFP4: the experts in MXFP4, the other matrices in Q8_0, as the
published gpt-oss GGUFs), mixtral-2b (a small Mixtral, 2.6B parameters: 16 layers, hidden 1536, 24/8
heads of 64, 8 experts of 4096, top-2; llama.cpp's `llama` with experts). The vocabulary and tokenizer are
SmolLM2's (49,152 tokens, from --tokenizer-gguf) so bench64's token ids are valid prompts.
Types as llama.cpp's quantiser lays out Q4_K_M (llama-quantize's rules: attn_v and ffn_down(_exps)
in Q6_K on the first and last eighths of the layers and every third layer between, the head in
Q6_K, the rest Q4_K), or every matrix in Q8_0 / BF16; norms and the router in F32. Block scales
are small finite f16 values (random codes), so activations stay finite. Streams one tensor at a
time (memory stays at one layer's experts); seed 0, so the same SHAPE gives the same file.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

SHAPES = {
    "qwen3-30b-a3b": dict(arch="qwen3moe", layers=48, hidden=2048, heads=32, kv_heads=4,
                          head_dim=128, experts=128, used=8, expert_width=768, qk_norm=True,
                          rope_theta=1e6, tied=False),
    "gpt-oss-20b": dict(arch="gpt-oss", layers=24, hidden=2880, heads=64, kv_heads=8, head_dim=64,
                        experts=32, used=4, expert_width=2880, qk_norm=False, rope_theta=150000.0,
                        tied=False),
    "mixtral-2b": dict(arch="llama", layers=16, hidden=1536, heads=24, kv_heads=8, head_dim=64,
                       experts=8, used=2, expert_width=4096, qk_norm=False, rope_theta=1e6,
                       tied=False),
}
# byte offsets of each block's f16 scale fields (ggml-common.h)
_F16_FIELDS = {"Q4_K": (0, 2), "Q6_K": (208,), "Q8_0": (0,), "MXFP4": ()}


def more_bits(i: int, n: int) -> bool:
    """llama-quantize's use_more_bits: the first and last eighths, and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _qtype(kind: str, name: str, layer: int, layers: int) -> str:
    if name.endswith(("norm.weight", ".bias", "sinks.weight")) or "ffn_gate_inp" in name:
        return "F32"
    if kind == "MXFP4":
        return "MXFP4" if "_exps" in name else "Q8_0"
    if kind != "Q4_K_M":
        return kind
    if name == "output.weight":
        return "Q6_K"
    if ("attn_v" in name or "ffn_down" in name) and more_bits(layer, layers):
        return "Q6_K"
    return "Q4_K"


def random_blocks(qt, fmt: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random blocks for a float tensor of numpy `shape` ([..., out, in]), f16 scales small."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qt]
    rows = int(np.prod(shape[:-1]))
    data = rng.integers(0, 256, size=(rows * (shape[-1] // block), size), dtype=np.uint8)
    for off in _F16_FIELDS[fmt]:
        d = (rng.uniform(0.5, 1.5, len(data)) * (2e-3 if fmt != "Q6_K" else 5e-4)).astype(
            np.float16)
        data[:, off:off + 2] = d.view(np.uint8).reshape(-1, 2)
    if fmt == "MXFP4":  # the E8M0 exponent byte: weights up to 6 * 2^-7
        data[:, 0] = rng.integers(118, 122, len(data), dtype=np.uint8)
    return data.reshape(*shape[:-1], shape[-1] // block * size)


def _tensor(fmt: str, shape: tuple[int, ...], rng: np.random.Generator, norm: bool = False
            ) -> np.ndarray:
    if norm:
        return np.ones(shape, np.float32)
    if fmt == "F32":
        return (rng.standard_normal(shape, np.float32) * 0.02).astype(np.float32)
    if fmt == "BF16":
        import ml_dtypes

        return (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16).view(
            np.uint16)
    import gguf

    return random_blocks(gguf.GGMLQuantizationType[fmt], fmt, shape, rng)


def _plan(s: dict, kind: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape [..., out, in], type) of every tensor, in file order."""
    H, L, E, I = s["hidden"], s["layers"], s["experts"], s["expert_width"]
    q, kv, V = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"], VOCAB
    out = [("token_embd.weight", (V, H), {"Q4_K_M": "Q4_K", "MXFP4": "Q8_0"}.get(kind, kind))]
    if s["arch"] == "gpt-oss":
        return out + _gpt_oss_plan(s, kind) + [
            ("output_norm.weight", (H,), "F32"), ("output.weight", (V, H), "Q8_0")]
    for i in range(L):
        b = f"blk.{i}."
        names = [(b + "attn_norm.weight", (H,)), (b + "attn_q.weight", (q, H)),
                 (b + "attn_k.weight", (kv, H)), (b + "attn_v.weight", (kv, H)),
                 (b + "attn_output.weight", (H, q))]
        if s["qk_norm"]:
            names += [(b + "attn_q_norm.weight", (s["head_dim"],)),
                      (b + "attn_k_norm.weight", (s["head_dim"],))]
        names += [(b + "ffn_norm.weight", (H,)), (b + "ffn_gate_inp.weight", (E, H)),
                  (b + "ffn_gate_exps.weight", (E, I, H)), (b + "ffn_up_exps.weight", (E, I, H)),
                  (b + "ffn_down_exps.weight", (E, H, I))]
        out += [(n, sh, _qtype(kind, n, i, L)) for n, sh in names]
    out += [("output_norm.weight", (H,), "F32"), ("output.weight", (V, H), _qtype(
        kind, "output.weight", 0, L))]
    return out


VOCAB = 49152


def _gpt_oss_plan(s: dict, kind: str) -> list[tuple[str, tuple[int, ...], str]]:
    """gpt-oss's layers as llama.cpp's converter names them (biases, sinks, split experts)."""
    H, L, E, I = s["hidden"], s["layers"], s["experts"], s["expert_width"]
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    out = []
    for i in range(L):
        b = f"blk.{i}."
        names = [(b + "attn_norm.weight", (H,)), (b + "attn_q.weight", (q, H)),
                 (b + "attn_q.bias", (q,)), (b + "attn_k.weight", (kv, H)),
                 (b + "attn_k.bias", (kv,)), (b + "attn_v.weight", (kv, H)),
                 (b + "attn_v.bias", (kv,)), (b + "attn_output.weight", (H, q)),
                 (b + "attn_output.bias", (H,)), (b + "attn_sinks.weight", (s["heads"],)),
                 (b + "post_attention_norm.weight", (H,)), (b + "ffn_gate_inp.weight", (E, H)),
                 (b + "ffn_gate_inp.bias", (E,)), (b + "ffn_gate_exps.weight", (E, I, H)),
                 (b + "ffn_gate_exps.bias", (E, I)), (b + "ffn_up_exps.weight", (E, I, H)),
                 (b + "ffn_up_exps.bias", (E, I)), (b + "ffn_down_exps.weight", (E, H, I)),
                 (b + "ffn_down_exps.bias", (E, H))]
        out += [(n, sh, _qtype(kind, n, i, L)) for n, sh in names]
    return out


def copy_fields(w, r, keep) -> None:
    """The metadata keys `keep(key)` accepts of a GGUFReader `r`, added to the writer `w` as
    they are typed there."""
    import gguf

    for key, field in r.fields.items():
        if not keep(key):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, field.contents(), vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(key, field.contents(), vtype)


def _copy_tokenizer(w, tokenizer_gguf: str) -> None:
    """The tokenizer.* metadata of another GGUF file (SmolLM2's)."""
    import gguf

    copy_fields(w, gguf.GGUFReader(tokenizer_gguf), lambda key: key.startswith("tokenizer."))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("out")
    p.add_argument("--tokenizer-gguf", required=True)
    p.add_argument("--type", default="Q4_K_M", choices=["Q4_K_M", "Q8_0", "BF16", "MXFP4"])
    a = p.parse_args()
    import gguf

    s = SHAPES[a.shape]
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(a.out, arch=s["arch"])
    w.add_name(f"{a.shape}-random-{a.type}")
    w.add_file_type({"Q4_K_M": 15, "Q8_0": 7, "BF16": 32, "MXFP4": 38}[a.type])
    w.add_block_count(s["layers"])
    w.add_context_length(131072 if s["arch"] == "gpt-oss" else 32768)
    if s["arch"] == "gpt-oss":  # as llama.cpp's converter writes gpt-oss-20b
        w.add_sliding_window(128)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(32.0)
        w.add_rope_scaling_orig_ctx_len(4096)
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["expert_width"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_rope_dimension_count(s["head_dim"])
    w.add_rope_freq_base(s["rope_theta"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(s["experts"])
    w.add_expert_used_count(s["used"])
    w.add_expert_feed_forward_length(s["expert_width"])
    w.add_vocab_size(VOCAB)
    _copy_tokenizer(w, a.tokenizer_gguf)
    plan = _plan(s, a.type)
    for name, shape, fmt in plan:
        qt = gguf.GGMLQuantizationType[fmt]
        if fmt == "F32":
            nbytes, dtype = int(np.prod(shape)) * 4, np.float32
        else:
            block, size = gguf.GGML_QUANT_SIZES[qt]
            nbytes, dtype = int(np.prod(shape)) // block * size, np.uint8
        w.add_tensor_info(name, shape if fmt == "F32" else (*shape[:-1], nbytes // int(
            np.prod(shape[:-1]))), np.dtype(dtype), nbytes, raw_dtype=None if fmt == "F32" else qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, fmt in plan:
        t = _tensor(fmt, shape, rng, norm=name.endswith("norm.weight"))
        if name.endswith((".bias", "sinks.weight")):
            t = np.zeros(shape, np.float32)
        if fmt == "BF16":
            t = t.view(np.uint8)
        w.write_tensor_data(np.ascontiguousarray(t))
    w.close()
    print(f"wrote {a.out}: {os.path.getsize(a.out) / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
