"""Write MoE GGUF files from tiny HF models as llama.cpp's convert_hf_to_gguf does: the experts
of a layer merged into one 3-D tensor per projection (`blk.N.ffn_{gate,up,down}_exps`, numpy
[E, out, in]), the router `ffn_gate_inp`, Qwen2-MoE's shared expert and its gate, and the
expert metadata (count, used count, expert width). Mixtral is written as llama.cpp writes it: the
`llama` architecture with experts, q/k rows permuted.

The experts' type is chosen per tensor by `expert_qtype(gguf_name)`: F32, F16, a type the gguf
package quantises (Q8_0, Q4_0), or random blocks (`gguf_files.raw_blocks`: K-quants), which
both our loader and transformers' GGUF loader read back through `gguf.quants.dequantize`.
"""

from __future__ import annotations

import glob
import re

import gguf
import numpy as np
import safetensors.numpy
from gguf import GGMLQuantizationType as QT

from tests.helpers import gguf_files

GGUF_MOE_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(.*)\.weight$")


def _moe_tensors(cfg, model_dir: str) -> dict[str, np.ndarray]:
    """The checkpoint in llama.cpp's names, experts stacked [E, out, in] (float32)."""
    arch = GGUF_MOE_ARCH[cfg.model_type]
    ids = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    names = gguf.get_tensor_name_map(ids[arch], cfg.num_hidden_layers)
    state: dict[str, np.ndarray] = {}
    for f in sorted(glob.glob(f"{model_dir}/*.safetensors")):
        state.update(safetensors.numpy.load_file(f))
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, w in state.items():
        w = np.asarray(w, np.float32)
        m = _EXPERT.match(name)
        if m is not None:
            g = names.get_name(f"{m.group(1)}.{m.group(3)}")
            assert g is not None, name
            experts.setdefault(f"{g}.weight", {})[int(m.group(2))] = w
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        stem, _, suffix = name.rpartition(".")
        g = names.get_name(stem)
        assert g is not None, name
        if arch == "llama" and stem.endswith("self_attn.q_proj"):
            w = gguf_files._permute(w, cfg.num_attention_heads)
        if arch == "llama" and stem.endswith("self_attn.k_proj"):
            w = gguf_files._permute(w, cfg.num_key_value_heads)
        if g.endswith("ffn_gate_inp_shexp"):  # HF [1, H]; llama.cpp writes the vector [H]
            w = w.reshape(-1)
        out[f"{g}.{suffix}"] = w
    for g, by_e in experts.items():
        out[g] = np.stack([by_e[e] for e in sorted(by_e)])
    return out


def write_moe_gguf(path: str, model, model_dir: str, expert_qtype=lambda name: QT.F32,
                   seed: int = 0) -> str:
    """A GGUF of the MoE `model` saved (safetensors) in `model_dir`."""
    cfg = model.config
    arch = GGUF_MOE_ARCH[cfg.model_type]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch=arch)
    gguf_files.add_metadata(w, cfg)
    if cfg.model_type == "mixtral":
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_feed_forward_length(cfg.intermediate_size)
    else:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if cfg.model_type == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    for name, t in _moe_tensors(cfg, model_dir).items():
        q = expert_qtype(name) if t.ndim == 3 else QT.F32
        if q == QT.F32:
            w.add_tensor(name, t)
        elif q == QT.F16:
            w.add_tensor(name, t.astype(np.float16))
        elif q in (QT.Q8_0, QT.Q4_0):
            w.add_tensor(name, gguf.quants.quantize(t, q), raw_dtype=q)
        else:
            w.add_tensor(name, gguf_files.raw_blocks(q, t.shape, rng), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
