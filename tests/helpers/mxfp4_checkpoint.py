"""gpt-oss checkpoints with their experts in MXFP4, as openai publishes them: each expert's
[out, in] rows in 32-value blocks, `{gate_up,down}_proj_blocks` uint8 [E, out, in / 32, 16]
(values 2i and 2i + 1 in byte i's low and high nibble) and `_scales` uint8 [E, out, in / 32]
(E8M0: 2^(s - 127)); config.json's quantization_config says mxfp4."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
from safetensors.numpy import load_file, save_file

# E2M1: codes 0..7 and their negatives (8..15)
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def quantize_mxfp4(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Float rows [..., out, in] (in % 32 == 0) -> (blocks uint8 [..., out, in/32, 16], scales
    uint8 [..., out, in/32]): per block the smallest power of two that brings its largest value
    within 6, each value to its nearest E2M1 code."""
    w = np.asarray(rows, np.float32)
    *lead, n, k = w.shape
    b = w.reshape(*lead, n, k // 32, 32)
    amax = np.abs(b).max(axis=-1)
    e = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), -127)
    e = np.clip(e, -127, 127)
    scaled = b / np.exp2(e)[..., None]
    codes = np.abs(scaled[..., None] - FP4_VALUES).argmin(axis=-1).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (e + 127).astype(np.uint8)


def write_mxfp4_checkpoint(src: str, dst: str) -> str:
    """A copy of the float gpt-oss HF directory `src` with every layer's experts in MXFP4."""
    shutil.copytree(src, dst)
    f = os.path.join(dst, "model.safetensors")
    tensors = load_file(f)
    for name in [n for n in tensors if n.endswith((".experts.gate_up_proj",
                                                   ".experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(np.swapaxes(tensors.pop(name), 1, 2))  # [E, out, in]
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, f, metadata={"format": "pt"})
    cfg_path = os.path.join(dst, "config.json")
    with open(cfg_path) as fh:
        cfg = json.load(fh)
    cfg["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn",
                                                             "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}
    with open(cfg_path, "w") as fh:
        json.dump(cfg, fh)
    return dst


def dequantised_reference(mxfp4_dir: str, dst: str) -> str:
    """The MXFP4 directory with its experts dequantised by transformers' own
    `convert_moe_packed_tensors` (float32 [E, in, out], as the float checkpoint holds them)
    and no quantization_config: the HF reference for the MXFP4 file."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    shutil.copytree(mxfp4_dir, dst)
    f = os.path.join(dst, "model.safetensors")
    tensors = load_file(f)
    for name in [n for n in tensors if n.endswith("_blocks")]:
        stem = name[: -len("_blocks")]
        w = convert_moe_packed_tensors(torch.from_numpy(tensors.pop(name)),
                                       torch.from_numpy(tensors.pop(stem + "_scales")),
                                       dtype=torch.float32)
        tensors[stem] = w.numpy()
    save_file(tensors, f, metadata={"format": "pt"})
    cfg_path = os.path.join(dst, "config.json")
    with open(cfg_path) as fh:
        cfg = json.load(fh)
    cfg.pop("quantization_config")
    with open(cfg_path, "w") as fh:
        json.dump(cfg, fh)
    return dst
