"""Write `qwen35` / `qwen35moe` / `qwen3next` GGUF files from tiny HF checkpoints the way llama.cpp's
convert_hf_to_gguf does (conversion/qwen.py: Qwen3NextModel, _LinearAttentionVReorderBase,
Qwen2MoeModel), with the gguf package's writer, so tests run where llama.cpp is not installed.
`test_gguf_hybrid.py::test_writer_equals_llama_cpp_converter` checks, where the converter is
present, that every tensor and model key written here equals the converter's.

What the converter does, mirrored here (numpy [out, in] layout; ggml writes the dims reversed):
  * the value heads of Qwen3.5 / Qwen3.5-MoE (Hk != Hv) from grouped to tiled order on the v rows
    of in_proj_qkv and conv1d, in_proj_z / in_proj_a / in_proj_b rows, dt_bias, A_log and the
    columns of out_proj (`_reorder_v_heads`);
  * A_log -> -exp(A_log) (`ssm_a`), dt_bias -> `ssm_dt.bias`, conv1d [C, 1, K] -> [C, K], every
    `*norm.weight` but `linear_attn.norm` + 1;
  * Qwen3-Next's in_proj_qkvz -> `attn_qkv` (all q, all k, all v rows) + `attn_gate` (z),
    in_proj_ba -> `ssm_ba` as it is;
  * experts stacked [E, out, in] per projection (`ffn_{gate,up,down}_exps`; a fused
    gate_up_proj split into gate and up), `ffn_gate_inp`, `ffn_*_shexp`, `ffn_gate_inp_shexp`
    ([1, H] as in the checkpoint);
  * `mtp=True`: a multi-token-prediction block as the converter writes one without --no-mtp
    (`blk.{L}.*` with `nextn.*`, block_count L + 1, nextn_predict_layers 1), random.
Each matrix's type is `qtype(gguf_name, w)` (norms, conv, A, dt and the router stay F32 as
llama-quantize leaves them); Q8_0 / Q4_0 through `gguf.quants.quantize`, others as random blocks
(`gguf_files.raw_blocks`)."""

from __future__ import annotations

import glob
import re

import gguf
import numpy as np
import safetensors.numpy
from gguf import GGMLQuantizationType as QT

from tests.helpers import gguf_files

GGUF_HYBRID_ARCH = {"qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe",
                    "qwen3_next": "qwen3next"}
_LAYER = {  # HF leaf (within model.layers.N.) -> gguf leaf (within blk.N.)
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias", "linear_attn.A_log": "ssm_a",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
        "output_norm.weight", "lm_head.weight": "output.weight"}
_PER_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED_EXPERTS = re.compile(r"^mlp\.experts\.(gate_up_proj|down_proj)$")
# what llama-quantize never quantises (llama-quant.cpp: norms, ssm_conv1d, the router, 1-D)
F32_ONLY = re.compile(r"(norm\.weight|ssm_conv1d\.weight|ffn_gate_inp\.weight|ssm_a|"
                      r"ssm_dt\.bias)$")


def reorder_v_heads(x: np.ndarray, axis: int, hk: int, r: int) -> np.ndarray:
    """The converter's _reorder_v_heads: grouped (g, j, d) -> tiled (j, g, d) along `axis`."""
    shape = x.shape
    d = shape[axis] // (hk * r)
    y = x.reshape(*shape[:axis], hk, r, d, *shape[axis + 1:])
    return np.swapaxes(y, axis, axis + 1).reshape(shape)


def _checkpoint(model_dir: str) -> dict[str, np.ndarray]:
    state: dict[str, np.ndarray] = {}
    for f in sorted(glob.glob(f"{model_dir}/*.safetensors")):
        state.update(safetensors.numpy.load_file(f))
    return {k: np.asarray(v, np.float32) for k, v in state.items()}


def _linear_attn(leaf: str, w: np.ndarray, cfg, tiled: bool) -> list[tuple[str, np.ndarray]]:
    """One DeltaNet tensor -> [(gguf leaf, tensor)] (Qwen3-Next's qkvz gives two)."""
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, hv // hk
    qk = 2 * hk * dk
    if leaf == "linear_attn.in_proj_qkvz.weight":  # per key head [q dk, k dk, v r dv, z r dv]
        g = w.reshape(hk, 2 * dk + 2 * r * dv, -1)
        qkv = np.concatenate([g[:, :dk].reshape(-1, w.shape[1]),
                              g[:, dk:2 * dk].reshape(-1, w.shape[1]),
                              g[:, 2 * dk:2 * dk + r * dv].reshape(-1, w.shape[1])])
        return [("attn_qkv.weight", qkv), ("attn_gate.weight",
                                           g[:, 2 * dk + r * dv:].reshape(-1, w.shape[1]))]
    if leaf == "linear_attn.conv1d.weight":
        w = w[:, 0, :]
    if tiled and leaf in ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"):
        w = np.concatenate([w[:qk], reorder_v_heads(w[qk:], 0, hk, r)])
    elif tiled and leaf in ("linear_attn.in_proj_z.weight", "linear_attn.in_proj_a.weight",
                            "linear_attn.in_proj_b.weight", "linear_attn.A_log",
                            "linear_attn.dt_bias"):
        w = reorder_v_heads(w, 0, hk, r)
    elif tiled and leaf == "linear_attn.out_proj.weight":
        w = reorder_v_heads(w, 1, hk, r)
    if leaf == "linear_attn.A_log":
        w = -np.exp(w)
    return [(_LAYER[leaf], w)]


def hybrid_tensors(cfg, model_dir: str, mtp: bool = False, seed: int = 0
                   ) -> dict[str, np.ndarray]:
    """The checkpoint in llama.cpp's names and layout (float32, numpy order)."""
    arch = GGUF_HYBRID_ARCH[cfg.model_type]
    tiled = arch != "qwen3next" and cfg.linear_num_key_heads != cfg.linear_num_value_heads
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, w in _checkpoint(model_dir).items():
        name = name.replace("model.language_model.", "model.")
        if name.startswith(("mtp.", "model.visual.")):
            continue
        if name in _TOP:
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            out[_TOP[name]] = w + 1 if name == "model.norm.weight" else w
            continue
        m = re.match(r"^model\.layers\.(\d+)\.(.+)$", name)
        assert m is not None, name
        layer, leaf = int(m.group(1)), m.group(2)
        if (e := _PER_EXPERT.match(leaf)) is not None:
            experts.setdefault((layer, e.group(2)), {})[int(e.group(1))] = w
            continue
        if (f := _FUSED_EXPERTS.match(leaf)) is not None:  # [E, 2I, H] / [E, H, I]
            if f.group(1) == "down_proj":
                out[f"blk.{layer}.ffn_down_exps.weight"] = w
            else:
                i = w.shape[1] // 2
                out[f"blk.{layer}.ffn_gate_exps.weight"] = np.ascontiguousarray(w[:, :i])
                out[f"blk.{layer}.ffn_up_exps.weight"] = np.ascontiguousarray(w[:, i:])
            continue
        if leaf.startswith("linear_attn."):
            for g, t in _linear_attn(leaf, w, cfg, tiled):
                out[f"blk.{layer}.{g}"] = t
            continue
        if leaf.endswith("norm.weight"):
            w = w + 1
        out[f"blk.{layer}.{_LAYER[leaf]}"] = w
    for (layer, proj), by_e in experts.items():
        out[f"blk.{layer}.ffn_{proj}_exps.weight"] = np.stack([by_e[e] for e in sorted(by_e)])
    if mtp:
        out.update(_mtp_block(cfg, seed))
    return out


def _mtp_block(cfg, seed: int) -> dict[str, np.ndarray]:
    """A random MTP block as the converter names it (a full-attention layer plus nextn.*)."""
    rng = np.random.default_rng(seed)
    H, L = cfg.hidden_size, cfg.num_hidden_layers
    n, k, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    shapes = {"attn_norm.weight": (H,), "post_attention_norm.weight": (H,),
              "attn_q.weight": (2 * n * d, H), "attn_k.weight": (k * d, H),
              "attn_v.weight": (k * d, H), "attn_output.weight": (H, n * d),
              "attn_q_norm.weight": (d,), "attn_k_norm.weight": (d,),
              "nextn.eh_proj.weight": (H, 2 * H), "nextn.enorm.weight": (H,),
              "nextn.hnorm.weight": (H,), "nextn.shared_head_norm.weight": (H,)}
    return {f"blk.{L}.{leaf}": rng.normal(0, 0.1, s).astype(np.float32)
            for leaf, s in shapes.items()}


def add_hybrid_metadata(w: gguf.GGUFWriter, cfg, arch: str, mtp: bool = False) -> None:
    """The model keys the converter writes for these archs, and a 256-token byte-level
    vocabulary (`tokenizer.ggml.pre` qwen35 or qwen2, as the published files say)."""
    L = cfg.num_hidden_layers
    w.add_name("tiny-" + cfg.model_type)
    w.add_block_count(L + (1 if mtp else 0))
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    if arch != "qwen35moe":
        w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    if arch != "qwen35":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    # (the installed gguf package predates add_recurrent_layers: its key, written directly)
    w.add_array(f"{arch}.attention.recurrent_layers",
                [t == "linear_attention" for t in cfg.layer_types] + ([False] if mtp else []))
    w.add_full_attention_interval(getattr(cfg, "full_attention_interval", 4))
    w.add_rope_dimension_count(int(cfg.head_dim * rope.get("partial_rotary_factor", 0.25)))
    if arch != "qwen3next":
        w.add_rope_dimension_sections([11, 11, 10, 0])
    if mtp:
        w.add_nextn_predict_layers(1)
    byte_chars = gguf.vocab.bytes_to_unicode()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch == "qwen3next" else "qwen35")
    # Qwen's control tokens in place of three bytes (the tokenizer classes add <|endoftext|>
    # when the vocabulary lacks it)
    w.add_token_list(["<|endoftext|>", "<|im_start|>", "<|im_end|>"] +
                     [byte_chars[b] for b in range(3, 256)])
    w.add_token_types([3, 3, 3] + [1] * 253)
    w.add_token_scores([0.0] * 256)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                        "<|im_end|>\n{% endfor %}")


def write_hybrid_gguf(path: str, cfg, model_dir: str, qtype=lambda name, w: QT.F32,
                      mtp: bool = False, edit=None, seed: int = 0) -> str:
    """A GGUF of the tiny hybrid saved in `model_dir` (its text config `cfg`); `edit(tensors)`
    may change the {gguf name: array} dict before it is written."""
    arch = GGUF_HYBRID_ARCH[cfg.model_type]
    rng = np.random.default_rng(seed)
    tensors = hybrid_tensors(cfg, model_dir, mtp, seed)
    if edit is not None:
        edit(tensors)
    w = gguf.GGUFWriter(path, arch=arch)
    add_hybrid_metadata(w, cfg, arch, mtp)
    for name, t in tensors.items():
        q = QT.F32 if t.ndim < 2 or F32_ONLY.search(name) else qtype(name, t)
        if q == QT.F32:
            w.add_tensor(name, np.ascontiguousarray(t))
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
