"""Write GGUF files from tiny HF models the way llama.cpp's convert_hf_to_gguf does, with the gguf
package's own writer: names through its tensor-name map, llama q/k rows permuted, Gemma norms
stored as 1 + w, metadata that transformers' GGUF loader reads back into the same config.

Each matrix's type is chosen by `qtype(gguf_name, w)`; quantised types the package can quantise
are written with `gguf.quants.quantize`, the others (K-quants, IQ-quants) from `raw_blocks`:
random blocks whose f16 scales are set small (MXFP4, with no f16 field: its exponent byte), so
`gguf.quants.dequantize` (what both our loader and transformers use) turns them into moderate
weights.
"""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

# byte offsets of the f16 scale fields (d, dmin) in one block, from ggml-common.h
_F16_FIELDS = {QT.Q2_K: (80, 82), QT.Q3_K: (108,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2),
               QT.Q6_K: (208,), QT.IQ4_NL: (0,), QT.IQ4_XS: (0,), QT.IQ2_XXS: (0,),
               QT.IQ2_XS: (0,), QT.IQ2_S: (0,), QT.IQ3_XXS: (0,), QT.IQ3_S: (0,),
               QT.IQ1_S: (0,), QT.TQ1_0: (52,), QT.TQ2_0: (64,), QT.Q8_0: (0,), QT.Q4_0: (0,),
               QT.Q4_1: (0, 2), QT.Q5_0: (0,), QT.Q5_1: (0, 2)}
# HF model_type -> GGUF architecture
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3"}


def raw_blocks(qt: QT, shape: tuple[int, ...], rng: np.random.Generator,
               scale: float = 2e-3) -> np.ndarray:
    """Random uint8 blocks for a float tensor of `shape` (numpy order), scales set to `scale`."""
    block, size = gguf.GGML_QUANT_SIZES[qt]
    rows, n = int(np.prod(shape[:-1])), shape[-1]
    assert n % block == 0, (qt.name, shape)
    data = rng.integers(0, 256, size=(rows * n // block, size), dtype=np.uint8)
    if qt == QT.MXFP4:  # byte 0: the E8M0 scale 2^(e - 128); e = 120..127: 2^-8..2^-1
        data[:, 0] = rng.integers(120, 128, len(data))
    for off in _F16_FIELDS.get(qt, ()):
        d = np.full(len(data), scale, np.float16) * rng.uniform(0.5, 1.5, len(data)).astype(
            np.float16)
        data[:, off:off + 2] = d.view(np.uint8).reshape(-1, 2)
    return data.reshape(*shape[:-1], n // block * size)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute (HF rotate_half rows -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def gguf_tensors(model) -> dict[str, np.ndarray]:
    """The model's state dict in llama.cpp's names and layout (float32)."""
    cfg = model.config
    arch = GGUF_ARCH[cfg.model_type]
    ids = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    names = gguf.get_tensor_name_map(ids[arch], cfg.num_hidden_layers)
    out = {}
    for name, p in model.state_dict().items():
        w = p.detach().float().numpy()
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        stem, _, suffix = name.rpartition(".")
        g = names.get_name(stem)
        assert g is not None, name
        if arch == "llama" and stem.endswith("self_attn.q_proj"):
            w = _permute(w, cfg.num_attention_heads)
        if arch == "llama" and stem.endswith("self_attn.k_proj"):
            w = _permute(w, cfg.num_key_value_heads)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            w = w + 1.0
        out[f"{g}.{suffix}"] = w
    return out


def add_metadata(w: gguf.GGUFWriter, cfg) -> None:
    """Model and tokenizer metadata (a 256-token byte-level BPE vocabulary with a template)."""
    w.add_name("tiny-" + cfg.model_type)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rope = getattr(cfg, "rope_parameters", None) or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
    w.add_vocab_size(cfg.vocab_size)
    byte_chars = gguf.vocab.bytes_to_unicode()  # GPT-2's byte -> printable character table
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [byte_chars[b] for b in range(3, 256)])
    w.add_token_types([3, 3, 3] + [1] * 253)
    w.add_token_scores([0.0] * 256)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_chat_template("{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}")


def write_gguf(path: str, model, qtype=lambda name, w: QT.F32, drop=(), edit=None, extra=None,
               seed: int = 0) -> str:
    """A GGUF of `model` (a transformers model): qtype(name, w) picks each matrix's type; `drop`
    leaves tensors out; edit(name, w) changes one; extra(writer) adds metadata or tensors."""
    cfg = model.config
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch=GGUF_ARCH[cfg.model_type])
    add_metadata(w, cfg)
    if extra is not None:
        extra(w)
    for name, t in gguf_tensors(model).items():
        if name in drop:
            continue
        t = edit(name, t) if edit else t
        q = qtype(name, t) if t.ndim == 2 else QT.F32
        if q == QT.F32:
            w.add_tensor(name, t)
        elif q == QT.F16:
            w.add_tensor(name, t.astype(np.float16))
        elif hasattr(gguf.quants, q.name) and _can_quantize(q):
            w.add_tensor(name, gguf.quants.quantize(t, q), raw_dtype=q)
        else:
            w.add_tensor(name, raw_blocks(q, t.shape, rng), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _can_quantize(q: QT) -> bool:
    try:
        gguf.quants.quantize(np.zeros((1, gguf.GGML_QUANT_SIZES[q][0]), np.float32), q)
        return True
    except NotImplementedError:
        return False
