"""Write MoE GGUF files from tiny HF models as llama.cpp's convert_hf_to_gguf does: the experts
of a layer merged into one 3-D tensor per projection (`blk.N.ffn_{gate,up,down}_exps`, numpy
[E, out, in]), the router `ffn_gate_inp`, Qwen2-MoE's shared expert and its gate, and the
expert metadata (count, used count, expert width). Mixtral is written as llama.cpp writes it: the
`llama` architecture with experts, q/k rows permuted. gpt-oss (`write_gpt_oss_gguf`): its fused,
interleaved experts split, with biases, sinks and YaRN metadata.

The experts' type is chosen per tensor by `expert_qtype(gguf_name)`: F32, F16, a type the gguf
package quantises (Q8_0, Q4_0), or random blocks (`gguf_files.raw_blocks`: K-quants), which
both our loader and transformers' GGUF loader read back through `gguf.quants.dequantize`.
"""

from __future__ import annotations

import glob
import os
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


def _gpt_oss_tensors(cfg, model_dir: str) -> dict[str, np.ndarray]:
    """gpt-oss as convert_hf_to_gguf's GptOssModel writes a float checkpoint: the fused,
    interleaved gate_up_proj [E, H, 2I] split into ffn_gate_exps / ffn_up_exps [E, I, H] (numpy
    [E, out, in]), down_proj [E, I, H] as ffn_down_exps [E, H, I], their biases split alike
    (`ffn_*_exps.bias`), the sinks as `attn_sinks.weight`, the router as ffn_gate_inp."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, cfg.num_hidden_layers)
    state: dict[str, np.ndarray] = {}
    for f in sorted(glob.glob(f"{model_dir}/*.safetensors")):
        state.update(safetensors.numpy.load_file(f))
    out: dict[str, np.ndarray] = {}
    for name, w in state.items():
        w = np.asarray(w, np.float32)
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        m = re.match(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$",
                     name)
        if m is not None:
            blk, fused, bias = f"blk.{m.group(1)}", m.group(2), m.group(3)
            if bias:
                w = w[..., None]  # [E, out, 1]: split like the weights' rows
            else:
                w = np.swapaxes(w, -1, -2)  # [E, out, in]
            parts = {"gate": w[:, 0::2], "up": w[:, 1::2]} if fused == "gate_up_proj" else \
                {"down": w}
            for proj, t in parts.items():
                out[f"{blk}.ffn_{proj}_exps.{'bias' if bias else 'weight'}"] = \
                    np.ascontiguousarray(t[..., 0] if bias else t)
            continue
        if name.endswith(".sinks"):
            out[f"{names.get_name(name)}.weight"] = w
            continue
        stem, _, suffix = name.rpartition(".")
        g = names.get_name(stem)
        assert g is not None, name
        out[f"{g}.{suffix}"] = w
    return out


def write_gpt_oss_gguf(path: str, model, model_dir: str, expert_qtype=lambda name: QT.F32
                       ) -> str:
    """A gpt-oss GGUF as llama.cpp's converter writes one: arch `gpt-oss`, expert metadata,
    the sliding window and YaRN rope (`rope.scaling.*`); experts of type expert_qtype(name)."""
    cfg = model.config
    w = gguf.GGUFWriter(path, arch="gpt-oss")
    gguf_files.add_metadata(w, cfg)
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    rope = cfg.rope_parameters
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    for name, t in _gpt_oss_tensors(cfg, model_dir).items():
        _add(w, name, t, expert_qtype(name) if t.ndim == 3 else QT.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gpt_oss_reference_dir(path: str, hf_dir: str, cfg, out_dir: str) -> str:
    """An HF checkpoint dir for transformers (whose GGUF loader cannot read gpt-oss files: it
    fails on their YaRN metadata): `cfg` (the config derived from the file) and the checkpoint
    in `hf_dir` with each layer's experts replaced by the file's, dequantised by the gguf
    package and fused back (gate and up interleaved, [in, out])."""
    os.makedirs(out_dir, exist_ok=True)
    cfg.save_pretrained(out_dir)
    state: dict[str, np.ndarray] = {}
    for f in glob.glob(os.path.join(hf_dir, "*.safetensors")):
        state.update(safetensors.numpy.load_file(f))
    experts: dict[tuple[str, str], np.ndarray] = {}
    for t in gguf.GGUFReader(path).tensors:
        m = re.match(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$", t.name)
        if m is not None:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # [E, out, in]
            w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
            experts[m.groups()] = np.swapaxes(np.asarray(w, np.float32), -1, -2)  # [E, in, out]
    for (layer, proj), w in experts.items():
        prefix = f"model.layers.{layer}.mlp.experts"
        if proj == "down":
            state[f"{prefix}.down_proj"] = np.ascontiguousarray(w)
        elif proj == "gate":
            fused = np.empty((*w.shape[:2], 2 * w.shape[2]), np.float32)
            fused[..., 0::2], fused[..., 1::2] = w, experts[(layer, "up")]
            state[f"{prefix}.gate_up_proj"] = fused
    safetensors.numpy.save_file(state, os.path.join(out_dir, "model.safetensors"),
                                metadata={"format": "pt"})
    return out_dir


def _add(w: gguf.GGUFWriter, name: str, t: np.ndarray, q: QT,
         rng: np.random.Generator | None = None) -> None:
    if q == QT.F32:
        w.add_tensor(name, t)
    elif q == QT.F16:
        w.add_tensor(name, t.astype(np.float16))
    elif q in (QT.Q8_0, QT.Q4_0, QT.MXFP4):
        w.add_tensor(name, gguf.quants.quantize(t, q), raw_dtype=q)
    else:
        assert rng is not None
        w.add_tensor(name, gguf_files.raw_blocks(q, t.shape, rng), raw_dtype=q)


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
        _add(w, name, t, expert_qtype(name) if t.ndim == 3 else QT.F32, rng)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
