"""LoRA adapters read from disk into the engine's layout (numpy only; no device work here).

An adapter changes a linear layer's output by `scale * B (A x)`: A [r, in], B [out, r], r the
rank, scale alpha / r (alpha / sqrt(r) with rsLoRA), as PEFT's `lora.Linear` computes it. Two
file kinds load:
  * a PEFT directory: adapter_config.json + adapter_model.safetensors, tensors named
    `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` [r, in] and `lora_B`
    [out, r];
  * a llama.cpp GGUF LoRA file (convert_lora_to_gguf.py: general.type "adapter", adapter.type
    "lora", adapter.lora.alpha): `blk.{i}.attn_q.weight.lora_a` (numpy [r, in]) and `lora_b`
    ([out, r]), q/k's B rows interleaved for llama.cpp's rope as its base weights are (undone
    here as model/gguf/reader.py undoes them); scale alpha / r, or 1 with no alpha (llama.cpp's rule).
The modules are the dense linears of `quantize.LINEAR_WEIGHTS` (q/k/v/o, gate/up/down; an MoE
model's shared expert), and a hybrid's DeltaNet projections (lora/hybrid.py), found through the
model's own HF names (model/hf_names.py: Phi-3's fused qkv_proj / gate_up_proj split by rows:
B's rows split, A shared). Anything else an adapter trains (embeddings, the head, MoE experts,
routers, biases, DoRA, per-module alpha) is refused by name, never dropped. A multimodal
wrapper's adapter (`base_model.model.model.language_model.layers.*`) applies to its text model.

`LoRAAdapter.weights[leaf] = (A [L, r, in], B [L, out, r])` in float32 (L: the leaf's stack, a
hybrid's kind's layers), zeros for layers the adapter leaves alone; lora/runtime.py pads them to the slots' rank and puts them on the device.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import numpy as np

from jaxbatch.lora import hybrid
from jaxbatch.model.arch import ModelArch
from jaxbatch.model.hf_names import layer_sources
from jaxbatch.model.quantize import LINEAR_WEIGHTS


class LoRALoadError(ValueError):
    """An adapter that cannot be served on this model (the message says why)."""


@dataclasses.dataclass(frozen=True)
class LoRAAdapter:
    name: str
    path: str
    rank: int
    scale: float  # alpha / rank (PEFT's `scaling`)
    # leaf -> (A f32 [L, r, in], B f32 [L, out, r]); only the leaves the adapter trains
    weights: dict[str, tuple[np.ndarray, np.ndarray]] = dataclasses.field(repr=False)

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(sorted(self.weights))


def _linear_sources(arch: ModelArch) -> dict[str, Any]:
    """Our linear leaf -> its HF Source (dense linears only: MoE experts have none)."""
    srcs = layer_sources(arch)
    return {leaf: srcs[leaf] for leaf in LINEAR_WEIGHTS + hybrid.DN_LEAVES
            if leaf in srcs and "{e}" not in srcs[leaf].name}


def adapted_leaves(arch: ModelArch) -> tuple[str, ...]:
    """The layer leaves an adapter may change on this model: its dense linear projections."""
    return tuple(_linear_sources(arch))


def _module_of(source: Any) -> str:
    """An HF Source's module path within a layer: 'self_attn.q_proj'."""
    return source.name.removesuffix(".weight")


def _leaves_by_module(sources: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    """HF module -> our leaves it feeds: one leaf each, or several for a fused module (Phi-3's
    qkv_proj -> wq, wk, wv; gate_up_proj -> w_gate, w_up), each leaf reading its own row range
    of the module's B (`Source.rows`) and the whole shared A."""
    out: dict[str, tuple[str, ...]] = {}
    for leaf, src in sources.items():
        out[_module_of(src)] = out.get(_module_of(src), ()) + (leaf,)
    return out


def _module_by_leaf(by_module: dict[str, tuple[str, ...]]) -> dict[str, str]:
    return {leaf: module for module, leaves in by_module.items() for leaf in leaves}


def _by_leaf(found: dict[str, dict[int, dict[str, np.ndarray]]],
             by_module: dict[str, tuple[str, ...]]) -> dict[str, dict[int, dict[str, np.ndarray]]]:
    """An adapter's tensors keyed by HF module -> keyed by our leaf: a fused module's (A, B)
    go to each of its leaves (the rows are cut in _assemble)."""
    return {leaf: layers for module, layers in found.items() for leaf in by_module[module]}


def load_adapter(name: str, path: str, arch: ModelArch, max_rank: int) -> LoRAAdapter:
    """A PEFT directory or a GGUF LoRA file at `path`, checked against the model's shapes and
    `max_rank`; LoRALoadError saying what does not fit."""
    if os.path.isdir(path):
        adapter = _load_peft(name, path, arch)
    elif os.path.isfile(path) and path.endswith(".gguf"):
        adapter = _load_gguf(name, path, arch)
    elif os.path.exists(path):
        raise LoRALoadError(f"LoRA {name!r}: {path} is neither a PEFT adapter directory nor a "
                            f".gguf file")
    else:
        raise LoRALoadError(f"LoRA {name!r}: {path} does not exist")
    if adapter.rank > max_rank:
        raise LoRALoadError(f"LoRA {name!r} has rank {adapter.rank}; this engine's slots hold at "
                            f"most max_lora_rank={max_rank}")
    return adapter


# ---- PEFT ------------------------------------------------------------------------------------
# a causal LM's layers; a multimodal wrapper's text model's (Qwen3.5 as Qwen publishes it)
_PEFT_PREFIXES = ("base_model.model.model.layers.",
                  "base_model.model.model.language_model.layers.")
_UNSUPPORTED_PEFT = {"use_dora": "DoRA", "modules_to_save": "modules_to_save",
                     "alpha_pattern": "alpha_pattern", "rank_pattern": "rank_pattern",
                     "layers_pattern": "layers_pattern", "fan_in_fan_out": "fan_in_fan_out"}


def _load_peft(name: str, path: str, arch: ModelArch) -> LoRAAdapter:
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise LoRALoadError(f"LoRA {name!r}: {path} has no adapter_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRALoadError(f"LoRA {name!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key, what in _UNSUPPORTED_PEFT.items():
        if cfg.get(key):
            raise LoRALoadError(f"LoRA {name!r}: {what} adapters are not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRALoadError(f"LoRA {name!r}: bias={cfg['bias']!r} (trained biases) is not "
                            f"supported")
    weights_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights_path):
        raise LoRALoadError(f"LoRA {name!r}: {path} has no adapter_model.safetensors (a .bin "
                            f"adapter can be saved again with safe_serialization=True)")
    from safetensors.numpy import load_file

    try:
        tensors = {k: v for k, v in load_file(weights_path).items()}
    except Exception as e:  # noqa: BLE001 - a damaged file: say which
        raise LoRALoadError(f"LoRA {name!r}: cannot read {weights_path}: {e}") from None
    r = int(cfg.get("r", 0))
    alpha = float(cfg.get("lora_alpha", r))
    if r <= 0:
        raise LoRALoadError(f"LoRA {name!r}: adapter_config.json has no rank r")
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    found: dict[str, dict[int, dict[str, np.ndarray]]] = {}
    by_module = hybrid.leaves_by_module(arch, _leaves_by_module(_linear_sources(arch)))
    for key, value in tensors.items():
        prefix = next((p for p in _PEFT_PREFIXES if key.startswith(p)), None)
        if prefix is None or not (key.endswith(".lora_A.weight")
                                  or key.endswith(".lora_B.weight")):
            raise LoRALoadError(f"LoRA {name!r}: tensor {key!r} is not one this engine applies "
                                f"(only the text model's layers' linear projections)")
        rest = key[len(prefix):]
        layer_s, _, rest = rest.partition(".")
        module, _, part = rest.rpartition(".lora_")
        if module not in by_module:
            raise LoRALoadError(f"LoRA {name!r}: module {module!r} is not among this model's "
                                f"adapted linears {sorted(by_module)}")
        found.setdefault(module, {}).setdefault(int(layer_s), {})[part[0]] = \
            np.asarray(value, np.float32)
    return _assemble(name, path, arch, r, scale, _by_leaf(found, by_module),
                     _module_by_leaf(by_module), permuted=None)


# ---- GGUF ------------------------------------------------------------------------------------
def _load_gguf(name: str, path: str, arch: ModelArch) -> LoRAAdapter:
    from jaxbatch.model.gguf import reader as gguf_model

    try:
        reader = gguf_model.open_gguf(path)
    except Exception as e:  # noqa: BLE001 - WeightLoadError names the damage
        raise LoRALoadError(f"LoRA {name!r}: {e}") from None

    def field(key: str) -> Any:
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    if field("general.type") != "adapter" or field("adapter.type") != "lora":
        raise LoRALoadError(f"LoRA {name!r}: {path} is not a GGUF LoRA adapter (general.type "
                            f"{field('general.type')!r}, adapter.type {field('adapter.type')!r})")
    gguf_arch = field("general.architecture")
    refused = hybrid.refuse_gguf(arch, gguf_arch)
    if refused is not None:
        raise LoRALoadError(f"LoRA {name!r}: {refused}")
    sources = _linear_sources(arch)
    hf_names = {f"model.layers.{i}.{src.name}" for i in range(arch.num_layers)
                for src in sources.values()}
    to_hf = gguf_model.gguf_to_hf_names(gguf_arch, arch.num_layers, hf_names)
    by_module = _leaves_by_module(sources)
    found: dict[str, dict[int, dict[str, np.ndarray]]] = {}
    rank = 0
    for t in reader.tensors:
        base, _, part = t.name.rpartition(".lora_")
        hf = to_hf.get(base)
        if part not in ("a", "b") or hf is None:
            raise LoRALoadError(f"LoRA {name!r}: tensor {t.name!r} is not one this engine applies "
                                f"(only the layers' linear projections)")
        rest = hf.removeprefix("model.layers.")
        layer_s, _, module = rest.partition(".")
        w = gguf_model._tensor(reader, t).astype(np.float32)
        if part == "a":
            rank = max(rank, w.shape[0])
        found.setdefault(module.removesuffix(".weight"), {}).setdefault(
            int(layer_s), {})[part.upper()] = w
    alpha = field("adapter.lora.alpha")
    scale = float(alpha) / rank if alpha and rank else 1.0
    permuted = {"self_attn.q_proj": arch.num_heads, "self_attn.k_proj": arch.num_kv_heads} \
        if gguf_arch in gguf_model._PERMUTED_ARCHS else None
    return _assemble(name, path, arch, rank, scale, _by_leaf(found, by_module),
                     _module_by_leaf(by_module), permuted=permuted)


# ---- both ------------------------------------------------------------------------------------
def _assemble(name: str, path: str, arch: ModelArch, rank: int, scale: float,
              found: dict[str, dict[int, dict[str, np.ndarray]]], modules: dict[str, str],
              permuted: dict[str, int] | None) -> LoRAAdapter:
    """Per leaf: the layers' (A, B) stacked [L, r, in] / [L, out, r] (L: the leaf's stack, HF
    layer i at its index there), zeros where the adapter leaves a layer alone; shapes checked
    against the model's linears. `modules`: each leaf's HF module (the one its A, B came from)."""
    shapes = arch.param_shapes()["layers"]
    sources = _linear_sources(arch)
    weights: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    if not found:
        raise LoRALoadError(f"LoRA {name!r}: the adapter has no LoRA weights")
    for leaf, layers in found.items():
        L, d_in, d_out = shapes[leaf]  # ours: [L, in, out]
        src, module = sources[leaf], modules[leaf]
        index = hybrid.stack_index(arch, leaf)
        a = np.zeros((L, rank, d_in), np.float32)
        b = np.zeros((L, d_out, rank), np.float32)
        for i, parts in layers.items():
            if i not in index:
                raise LoRALoadError(f"LoRA {name!r}: layer {i} of the model has no {module} "
                                    f"(the model has {arch.num_layers} layers"
                                    + (f"; {module} in layers {sorted(index)})"
                                       if arch.is_hybrid else ")"))
            if set(parts) != {"A", "B"}:
                raise LoRALoadError(f"LoRA {name!r}: layer {i} of {leaf!r} needs both lora_A and "
                                    f"lora_B")
            la, lb = parts["A"], parts["B"]
            if src.rows is not None:  # a fused HF tensor: this leaf's rows of B
                start, stop, total = src.rows
                if lb.shape[0] != total:
                    raise LoRALoadError(f"LoRA {name!r}: {src.name} lora_B has {lb.shape[0]} rows, "
                                        f"the model {total}")
                lb = lb[start:stop]
            if permuted is not None and module in permuted:
                from jaxbatch.model.gguf.reader import unpermute_rows
                lb = unpermute_rows(lb, permuted[module])
            try:  # a hybrid's DeltaNet rows and columns in the model's order (lora/hybrid.py)
                lb, la = hybrid.b_rows(arch, module, leaf, lb), hybrid.a_cols(arch, leaf, la)
            except ValueError as e:
                raise LoRALoadError(f"LoRA {name!r}: layer {i} {module}: {e}") from None
            r = la.shape[0]
            if la.shape != (r, d_in) or lb.shape != (d_out, r) or r > rank:
                raise LoRALoadError(
                    f"LoRA {name!r}: layer {i} {leaf}: lora_A {la.shape} / lora_B {lb.shape} do "
                    f"not fit the model's [{d_out}, {d_in}] linear at rank {rank}")
            a[index[i], :r], b[index[i], :, :r] = la, lb
        weights[leaf] = (a, b)
    return LoRAAdapter(name, path, rank, scale, weights)
