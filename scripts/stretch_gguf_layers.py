#!/usr/bin/env python
"""A hybrid GGUF (qwen35 / qwen35moe / qwen3next) stretched to more layers, for measuring speed
and memory at a real model's depth where its bf16 source would not fit the disk (Qwen3.6-35B-A3B:
1.6 GB of bf16 a layer, 64 GB in all).

    python scripts/stretch_gguf_layers.py TEMPLATE.gguf OUT.gguf --layers N

TEMPLATE is a file llama.cpp's converter and `llama-quantize` made from a few layers of the
shape (scripts/make_scale_model.py --layers 8, then the converter); OUT has N layers (a multiple
of the template's layer pattern, `full_attention_interval`), each a copy of a template layer of
the same kind. Its metadata is the template's with the block count and the recurrent-layer
pattern for N layers. In a Q4_K_M template the tensors whose type llama-quantize chooses by layer
(attn_qkv, attn_v, ffn_down_exps, ffn_down_shexp: Q6_K on the first and last eighths of the
layers and every third between, else Q4_K) follow that rule for N layers: each such tensor is
copied from a template layer of its kind that has the type, else filled with random blocks of
it (scripts/make_moe_gguf.py's). A layer's values do not change the work; greedy with ignore_eos
fixes the lengths.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
from make_moe_gguf import copy_fields, more_bits, random_blocks  # scripts/ is on sys.path

BY_LAYER = ("attn_qkv.weight", "attn_v.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight")
Q4_K_M = 15  # general.file_type


def _field(r, key: str):
    f = r.fields.get(key)
    return None if f is None else f.contents()


def _copy_metadata(w, r, arch: str, recurrent: list[bool]) -> None:
    """Every key of the template but the writer's own and the two that depend on depth."""
    import gguf

    skip = {"general.architecture", f"{arch}.block_count",
            f"{arch}.attention.recurrent_layers"}
    copy_fields(w, r, lambda key: not key.startswith("GGUF.") and key not in skip)
    w.add_block_count(len(recurrent))
    w.add_key_value(f"{arch}.attention.recurrent_layers", recurrent, gguf.GGUFValueType.ARRAY,
                    sub_type=gguf.GGUFValueType.BOOL)


def _plan(r, layers: int, period: int, by_layer_rule: bool):
    """(name, template tensor or None, type, numpy shape) of every output tensor, in order:
    the template's non-layer tensors first and last as it has them, its layers repeated."""
    import gguf

    tensors = {t.name: t for t in r.tensors}
    n_tpl = int(_field(r, f"{_field(r, 'general.architecture')}.block_count"))
    head = [t for t in r.tensors if not t.name.startswith("blk.")]
    out = [(t.name, t, t.tensor_type, None) for t in head if t.name == "token_embd.weight"]
    for i in range(layers):
        kinds = [j for j in range(n_tpl) if j % period == i % period]
        for t in (t for t in r.tensors if t.name.startswith(f"blk.{kinds[0]}.")):
            suffix = t.name.split(".", 2)[2]
            want = t.tensor_type
            if by_layer_rule and suffix in BY_LAYER:
                want = gguf.GGMLQuantizationType.Q6_K if more_bits(i, layers) \
                    else gguf.GGMLQuantizationType.Q4_K
            src = next((tensors[f"blk.{j}.{suffix}"] for j in kinds
                        if tensors[f"blk.{j}.{suffix}"].tensor_type == want), None)
            shape = tuple(int(d) for d in reversed(t.shape))  # numpy order [..., out, in]
            out.append((f"blk.{i}.{suffix}", src, want, shape))
    out += [(t.name, t, t.tensor_type, None) for t in head if t.name != "token_embd.weight"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("template")
    p.add_argument("out")
    p.add_argument("--layers", type=int, required=True)
    a = p.parse_args()
    import gguf

    r = gguf.GGUFReader(a.template)
    arch = str(_field(r, "general.architecture"))
    pattern = list(_field(r, f"{arch}.attention.recurrent_layers"))
    period = int(_field(r, f"{arch}.full_attention_interval") or 4)
    if a.layers % period or len(pattern) < period:
        raise SystemExit(f"--layers must be a multiple of {period}, and the template hold a "
                         f"whole pattern ({len(pattern)} layers)")
    by_layer_rule = int(_field(r, "general.file_type") or 0) == Q4_K_M
    plan = _plan(r, a.layers, period, by_layer_rule)
    w = gguf.GGUFWriter(a.out, arch=arch)
    _copy_metadata(w, r, arch, [pattern[i % period] for i in range(a.layers)])
    for name, src, qt, shape in plan:
        if src is not None:
            f32 = src.tensor_type == gguf.GGMLQuantizationType.F32
            w.add_tensor_info(name, src.data.shape, src.data.dtype, int(src.n_bytes),
                              raw_dtype=None if f32 else src.tensor_type)
        else:
            block, size = gguf.GGML_QUANT_SIZES[qt]
            rows = int(np.prod(shape[:-1]))
            w.add_tensor_info(name, (*shape[:-1], shape[-1] // block * size), np.dtype(np.uint8),
                              rows * (shape[-1] // block) * size, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for _name, src, qt, shape in plan:
        data = src.data if src is not None else random_blocks(qt, qt.name, shape, rng)
        w.write_tensor_data(np.ascontiguousarray(data))
    w.close()
    print(f"wrote {a.out}: {a.layers} layers, {os.path.getsize(a.out) / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
