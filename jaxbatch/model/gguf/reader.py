"""Load a llama.cpp GGUF file: keep or dequantise, rename to HF names, undo llama.cpp's layout
changes.

Linear weights and the embedding/head in the formats the engine computes from directly (Q8_0,
Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, MXFP4, BF16, F16: pallas_kernels/matmul/quant_formats.py) stay
in their blocks (`RawBlocks` -> `QuantWeight`): read from the memory-mapped file tensor by
tensor, never dequantised. Everything else is dequantised tensor by tensor into the compute dtype.
Dequantisation is the `gguf` package's own (`gguf.quants.dequantize`, the reference llama.cpp
ships with its converter), so every type it reads loads: F32/F16/BF16, Q4_0..Q8_0, the K-quants
(Q2_K..Q6_K, what Q4_K_M/Q5_K_M files mix), the IQ- and TQ-quants, MXFP4. Names go through the
package's tensor-name map for the file's architecture, the same map transformers uses, so
Qwen3's q/k norms, Gemma's four norms and Phi-3's fused qkv / gate_up land on their HF names.

Layout changes undone (each as transformers' GGUF loader does it):
  * llama/mistral q/k rows are interleaved for llama.cpp's rope kernel (`unpermute_rows`);
  * Gemma 2/3 RMSNorm weights are stored as 1 + w (llama.cpp's norm multiplies by w, HF's
    Gemma norm by 1 + w), so 1 is subtracted;
  * a `rope_freqs` tensor (Llama 3.1's rope scaling, written by convert_hf_to_gguf instead of
    metadata) becomes the equivalent `llama3` rope parameters (`llama3_rope_from_freq_factors`);
  * gpt-oss's experts are split as the HF names of its table are (model/archs/gpt_oss.py), so they
    load like any MoE's; its config's head dim, expert width and YaRN rope come from the
    metadata (`gpt_oss.gguf_config`: transformers misreads the YaRN keys and raises, so they
    are hidden from it, `reuse_reader`).

MoE experts (`blk.N.ffn_{gate,up,down}_exps`, 3-D, ggml shape [K, N, E]) are cut into the
per-expert HF tensors the strict check expects, each remembering its 3-D parent, which the
assembly puts back together: the experts stay one tensor in their blocks (one copy, read in place
where the file allows), or are dequantised once per tensor where the format is not kept.

The tensors go through the same strict `assemble_params` as a safetensors checkpoint. The HF
config, tokenizer and chat template come from the file's metadata via transformers' own GGUF
support, so they match what `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` sees.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from jaxbatch.model.arch import ModelArch
from jaxbatch.model.archs import gpt_oss
from jaxbatch.model.gguf import hybrid
from jaxbatch.model.gguf.moe_config import moe_config
from jaxbatch.model.quantize import RawBlocks
from jaxbatch.model.stack_files import StackFiles
from jaxbatch.model.weights import (
    KEEPABLE,
    LazyTensors,
    WeightLoadError,
    assemble_params,
    expected_hf_names,
)
from pallas_kernels.matmul.quant_formats import FORMATS, row_bytes

# llama.cpp stores q/k of these architectures with rows interleaved for its rope kernel
_PERMUTED_ARCHS = ("llama", "mistral")
# llama.cpp's Gemma converters store each RMSNorm weight as 1 + w
_NORM_PLUS_ONE_ARCHS = ("gemma", "gemma2", "gemma3")
ROPE_FREQS = "rope_freqs.weight"


def _quant_type(type_name: str) -> Any:
    import gguf

    return gguf.GGMLQuantizationType[type_name]


def supported_types() -> tuple[str, ...]:
    """Every ggml type the gguf package dequantises (F32, F16 and one class per block type)."""
    import gguf

    return tuple(t.name for t in gguf.GGMLQuantizationType
                 if t.name in ("F32", "F16") or hasattr(gguf.quants, t.name))


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Raw tensor data (as GGUFReader exposes it) -> float32 array of `shape` (numpy order)."""
    import gguf

    try:
        out = gguf.quants.dequantize(np.asarray(raw), _quant_type(type_name))
    except (NotImplementedError, KeyError):
        raise WeightLoadError(
            f"quantisation type {type_name} is not supported (the gguf package dequantises "
            f"{', '.join(supported_types())})") from None
    except ValueError as e:  # the package checks that the data is whole blocks
        raise WeightLoadError(f"{type_name} data of {shape} is not whole blocks: {e}") from None
    n = math.prod(shape)
    if out.size != n:
        raise WeightLoadError(f"tensor data holds {out.size} values, {n} expected for {shape}")
    return np.asarray(out, np.float32).reshape(shape)


# ---------------------------------------------------------------------------------------------
# Names and layout
# ---------------------------------------------------------------------------------------------
def gguf_to_hf_names(gguf_arch: str, num_layers: int, hf_names: set[str]) -> dict[str, str]:
    """{gguf tensor name: HF name} for the HF names a model expects, through the gguf package's
    tensor-name map of `gguf_arch` (what transformers' GGUF loader does)."""
    import gguf

    arch_ids = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    if gguf_arch not in arch_ids:
        raise WeightLoadError(f"GGUF architecture {gguf_arch!r} is unknown to the gguf package")
    name_map = gguf.get_tensor_name_map(arch_ids[gguf_arch], num_layers)
    out: dict[str, str] = {}
    for hf in sorted(hf_names):
        stem, _, suffix = hf.rpartition(".")
        g = name_map.get_name(stem)
        if g is not None:
            out[f"{g}.{suffix}"] = hf
        elif (g := name_map.get_name(hf)) is not None:  # a parameter with no .weight in HF
            out[f"{g}.weight"] = hf  # (gpt-oss's self_attn.sinks: blk.N.attn_sinks.weight)
    return out


_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(.*)$")


def gguf_expert_names(gguf_arch: str, num_layers: int, hf_names: set[str]
                      ) -> dict[str, list[str]]:
    """{gguf 3-D expert tensor name: its per-expert HF names, in expert order}: HF's
    `...experts.{e}.gate_proj.weight` are one merged tensor `...experts.gate_proj` in llama.cpp's
    map (`blk.N.ffn_gate_exps`)."""
    import gguf

    arch_ids = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    if gguf_arch not in arch_ids:
        raise WeightLoadError(f"GGUF architecture {gguf_arch!r} is unknown to the gguf package")
    name_map = gguf.get_tensor_name_map(arch_ids[gguf_arch], num_layers)
    groups: dict[str, dict[int, str]] = {}
    for hf in hf_names:
        m = _EXPERT.match(hf)
        if m is None:
            continue
        stem, _, suffix = f"{m.group(1)}.{m.group(3)}".rpartition(".")
        g = name_map.get_name(stem)
        if g is not None:
            groups.setdefault(f"{g}.{suffix}", {})[int(m.group(2))] = hf
    return {g: [by_e[e] for e in sorted(by_e)] for g, by_e in groups.items()}


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf's `permute`: w [n_head * D, ...] (or bias [n_head * D]).

    llama.cpp maps HF row (head, half, j) to (head, j, half), pairing each rotary dimension j with
    j + D/2 as adjacent rows; this puts them back into HF's rotate_half layout.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_from_freq_factors(factors: np.ndarray, theta: float, dim: int) -> dict[str, Any]:
    """HF `llama3` rope parameters whose inverse frequencies equal llama.cpp's for `rope_freqs`.

    llama.cpp divides each inverse frequency theta^(-2i/dim) by factors[i]; convert_hf_to_gguf
    writes factors[i] = 1 (short wavelengths), `factor` (long ones) and 1 / ((1-s)/factor + s)
    between, with s linear in 1/wavelength. The parameters are found from that line (any
    (original_ctx, low, high) scaled together give the same frequencies) and checked to
    reproduce every factor: anything else is refused rather than approximated.
    """
    r = np.asarray(factors, np.float64)
    inv = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if r.shape != inv.shape:
        raise WeightLoadError(f"rope_freqs has {r.size} values, {inv.size} expected (head dim "
                              f"{dim})")
    x = inv / (2 * math.pi)  # 1 / wavelength, decreasing with i
    factor = float(r.max())
    unscaled = np.abs(r - 1) <= 1e-6
    full = np.abs(r - factor) <= 1e-6 * factor
    mid = ~(unscaled | full)
    s = (1 / r - 1 / factor) / (1 - 1 / factor) if factor > 1 else np.zeros_like(r)
    x_a = x[unscaled].min() if unscaled.any() else 2 * x[0]  # the lowest unscaled frequency
    x_b = x[full].max() if full.any() else x[-1] / 2  # the highest fully scaled one
    if mid.sum() >= 2:  # s = (x - x_lo) / (x_hi - x_lo): fit the line
        slope, icpt = np.polyfit(x[mid], s[mid], 1)
        x_hi, x_lo = (1 - icpt) / slope, -icpt / slope
    elif mid.sum() == 1:  # one point on the line: twice the least slope that keeps its
        xm, sm = float(x[mid][0]), float(s[mid][0])  # ends (s = 0, 1) inside the gaps around it
        slope = 2 * max((1 - sm) / (x_a - xm), sm / (xm - x_b))
        x_hi, x_lo = xm + (1 - sm) / slope, xm - sm / slope
    else:  # a step: both ends of the ramp inside the gap
        x_hi, x_lo = x_a - (x_a - x_b) / 3, x_b + (x_a - x_b) / 3
    # scale (original_ctx, low, high) so that original_ctx is the integer HF expects, low ~ 1
    ctx = max(1, round(1 / x_lo))
    params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(ctx * x_lo),
              "high_freq_factor": float(ctx * x_hi), "original_max_position_embeddings": ctx}
    got = _llama3_inv_freq(inv, params)
    if factor < 1 or not np.allclose(got, inv / r, rtol=1e-5, atol=0):
        raise WeightLoadError(
            "the rope_freqs tensor is not llama3 rope scaling (its factors are not 1, a ramp, "
            "then a constant), which is the only kind supported")
    return params


def _llama3_inv_freq(inv: np.ndarray, p: dict[str, Any]) -> np.ndarray:
    """transformers' _compute_llama3_parameters, in float64 (to check a fit)."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    with np.errstate(divide="ignore", invalid="ignore"):
        smooth = (old / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    return np.where((wavelen >= old / high) & (wavelen <= old / low), mid, scaled)


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------
def open_gguf(path: str) -> Any:
    """A GGUFReader over `path`, with every tensor checked to lie wholly inside the file."""
    import gguf

    if not os.path.isfile(path):
        raise WeightLoadError(f"GGUF file {path} does not exist")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/KeyError/IndexError on bad bytes
        raise WeightLoadError(
            f"cannot read GGUF file {path} (corrupt or truncated?): {type(e).__name__}: {e}"
        ) from e
    size = os.path.getsize(path)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise WeightLoadError(
                f"GGUF file {path} is truncated: tensor {t.name!r} needs bytes "
                f"{t.data_offset}..{t.data_offset + t.n_bytes} but the file has {size}"
            )
    return reader


def _field(reader: Any, key: str) -> Any:
    if isinstance(reader, TensorIndex):
        return reader.fields.get(key)
    f = reader.fields.get(key)
    return None if f is None else f.contents()


@dataclasses.dataclass(frozen=True)
class IndexedTensor:
    """What the loader reads of a GGUFReader tensor, from a saved index: `data` is its bytes in
    the memory-mapped file, uint8 [rows, row bytes]."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # ggml dims, innermost first
    data: np.ndarray


class TensorIndex:
    """The file's tensor table (name, type, dims, data offset) and architecture, saved beside the
    cached HF config: a restart maps the file and skips GGUFReader's parse of every metadata
    field (SmolLM2's 49k-token vocabulary: seconds)."""

    def __init__(self, path: str, table: dict[str, Any]) -> None:
        import gguf

        if os.path.getsize(path) != table["size"]:
            raise WeightLoadError(f"{path} changed since its index was saved")
        mm = np.memmap(path, np.uint8, mode="r")
        self.fields = {"general.architecture": table["arch"]}
        self.tensors = []
        for name, type_name, dims, offset, nbytes in table["tensors"]:
            qtype = gguf.GGMLQuantizationType[type_name]
            rows = math.prod(dims[1:])
            self.tensors.append(IndexedTensor(name, qtype, np.asarray(dims, np.int64),
                                              mm[offset:offset + nbytes].reshape(rows, -1)))

    @staticmethod
    def table(path: str, reader: Any) -> dict[str, Any]:
        """The index of an open GGUFReader, as JSON-able data."""
        return {"size": os.path.getsize(path), "arch": _field(reader, "general.architecture"),
                "tensors": [(t.name, t.tensor_type.name, [int(d) for d in t.shape.tolist()],
                             int(t.data_offset), int(t.n_bytes)) for t in reader.tensors]}


def _tensor(reader: Any, t: Any) -> np.ndarray:
    # ggml lists dims innermost first; numpy's order is the reverse ([out, in] for a linear)
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    try:
        return dequantize(t.data, t.tensor_type.name, shape)
    except WeightLoadError as e:
        raise WeightLoadError(f"GGUF tensor {t.name!r}: {e}") from None


def keeps_blocks(t: Any, hf_name: str) -> bool:
    """Whether GGUF tensor `t` (named `hf_name`) is held in its blocks rather than dequantised:
    a 2-D tensor of a kept format that a linear weight, the embedding or the head reads."""
    return (t.tensor_type.name in FORMATS and len(t.shape) == 2
            and int(t.shape[0]) % FORMATS[t.tensor_type.name][0] == 0  # whole blocks (F16 rows)
            and KEEPABLE.search(hf_name) is not None)


def read_gguf_tensors(reader: Any, arch: ModelArch, hf_names: set[str] | None = None,
                      keep_blocks: bool = True) -> LazyTensors:
    """Every tensor in HF names and HF layout ([out, in] for linears), read when taken:
    `RawBlocks` where `keeps_blocks` (with `keep_blocks`), else float32 numpy arrays.

    `hf_names`: the names the model expects (default: `expected_hf_names(arch)` and lm_head);
    a tensor with no HF name keeps its GGUF name, for `assemble_params` to report."""
    gguf_arch = _field(reader, "general.architecture")
    if gguf_arch in hybrid.HYBRID_GGUF_ARCHS:
        return hybrid.read_hybrid_tensors(reader, arch, keep_blocks, gguf_arch,
                                          lambda t: _tensor(reader, t), _experts_tensor)
    if hf_names is None:
        hf_names = expected_hf_names(arch) | {"lm_head.weight"}
    names = gguf_to_hf_names(gguf_arch, arch.num_layers, hf_names)
    expert_names = gguf_expert_names(gguf_arch, arch.num_layers, hf_names)
    wholes: dict[str, RawBlocks | np.ndarray] = {}  # the 3-D tensor being read (one at a time)

    def read_expert(t: Any, e: int) -> np.ndarray | RawBlocks:
        if t.name not in wholes:
            wholes.clear()
            wholes[t.name] = _experts_tensor(t, keep_blocks)
        whole = wholes[t.name]
        if isinstance(whole, RawBlocks):
            n = whole.n
            return RawBlocks(whole.fmt, whole.rows[e * n:(e + 1) * n], whole.k, parent=whole,
                             expert=e)
        return whole[e]

    def read(item: tuple[Any, ...]) -> np.ndarray | RawBlocks:
        if len(item) == 3:  # one expert of a 3-D tensor
            return read_expert(item[0], item[2])
        t, name = item
        w: np.ndarray | RawBlocks
        if keep_blocks and keeps_blocks(t, name):
            k, n = (int(d) for d in t.shape.tolist())  # ggml: inputs innermost
            rows = np.asarray(t.data).view(np.uint8).reshape(n, -1)  # F16: typed by the reader
            if rows.shape[1] != row_bytes(t.tensor_type.name, k):
                raise WeightLoadError(f"GGUF tensor {t.name!r}: {rows.shape[1]} bytes per row, "
                                      f"{row_bytes(t.tensor_type.name, k)} expected")
            w = RawBlocks(t.tensor_type.name, rows, k)
        else:
            w = _tensor(reader, t)
        if gguf_arch in _PERMUTED_ARCHS and ".self_attn.q_proj." in name:
            w = _unpermute(w, arch.num_heads)
        elif gguf_arch in _PERMUTED_ARCHS and ".self_attn.k_proj." in name:
            w = _unpermute(w, arch.num_kv_heads)
        elif gguf_arch in _NORM_PLUS_ONE_ARCHS and name.endswith("norm.weight"):
            assert isinstance(w, np.ndarray)
            w = w - 1.0
        elif name.endswith(".shared_expert_gate.weight") and isinstance(w, np.ndarray) \
                and w.ndim == 1:  # llama.cpp may write Qwen2-MoE's [1, H] gate as a vector
            w = w[None, :]
        return w

    items: dict[str, tuple[Any, ...]] = {}
    for t in reader.tensors:
        if t.name == ROPE_FREQS:  # consumed by the config (load_gguf_config)
            continue
        per_expert = expert_names.get(t.name)
        if per_expert is not None and len(t.shape) == 3 and int(t.shape[2]) == len(per_expert):
            for e, hf in enumerate(per_expert):
                items[hf] = (t, hf, e)
            continue
        items[names.get(t.name, t.name)] = (t, names.get(t.name, t.name))
    return LazyTensors(items, read)


def _experts_tensor(t: Any, keep_blocks: bool) -> RawBlocks | np.ndarray:
    """A 3-D expert tensor (ggml [K, N, E]): its blocks uint8 [E * N, RB] (a kept format), else
    float32 [E, N, K] (HF's per-expert [out, in])."""
    k, n, e = (int(d) for d in t.shape.tolist())
    fmt = t.tensor_type.name
    if keep_blocks and fmt in FORMATS and k % FORMATS[fmt][0] == 0:
        rows = np.asarray(t.data).view(np.uint8).reshape(e * n, -1)
        if rows.shape[1] != row_bytes(fmt, k):
            raise WeightLoadError(f"GGUF tensor {t.name!r}: {rows.shape[1]} bytes per row, "
                                  f"{row_bytes(fmt, k)} expected")
        return RawBlocks(fmt, rows, k, experts=e)
    return _tensor(None, t)


def _unpermute(w: np.ndarray | RawBlocks, n_head: int) -> np.ndarray | RawBlocks:
    """`unpermute_rows` of a float tensor, or of a quantised one's rows (rows are output
    features, each its own blocks: the permutation moves whole rows)."""
    if isinstance(w, RawBlocks):
        return RawBlocks(w.fmt, unpermute_rows(w.rows, n_head), w.k)
    return unpermute_rows(w, n_head)


def has_kept_blocks(reader: Any, arch: ModelArch) -> bool:
    """The file holds a tensor the engine keeps in its blocks (see `keeps_blocks`)."""
    gguf_arch = _field(reader, "general.architecture")
    if gguf_arch in hybrid.HYBRID_GGUF_ARCHS:
        return hybrid.has_kept_blocks(reader, arch)
    hf_names = expected_hf_names(arch) | {"lm_head.weight"}
    names = gguf_to_hf_names(gguf_arch, arch.num_layers, hf_names)
    experts = gguf_expert_names(gguf_arch, arch.num_layers, hf_names)
    return any(keeps_blocks(t, names.get(t.name, t.name)) or (
        t.name in experts and t.tensor_type.name in FORMATS) for t in reader.tensors)


@contextlib.contextmanager
def reuse_reader(path: str, reader: Any) -> Iterator[None]:
    """Within: `gguf.GGUFReader(path)` answers `reader`, the file already parsed. transformers'
    GGUF config and tokenizer builders each construct a GGUFReader (`from gguf import GGUFReader`
    at call time), and a parse of a 1B file's metadata (49k tokens and merges, each a few numpy
    views) is 4-6 s: three of them were 17 s of a first start. Other paths parse as usual; were
    transformers to bind the class elsewhere, it would parse again (slower, same result). What
    transformers misreads is hidden from it (gpt-oss's YaRN keys: `gpt_oss.for_transformers`)."""
    import gguf

    real = gguf.GGUFReader
    target = os.path.realpath(path)
    shown = gpt_oss.for_transformers(reader, _field(reader, "general.architecture"))

    def reader_for(p: Any, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and os.path.realpath(os.fspath(p)) == target:
            return shown
        return real(p, *args, **kwargs)

    setattr(gguf, "GGUFReader", reader_for)  # noqa: B010 - the module attribute, on purpose
    try:
        yield
    finally:
        setattr(gguf, "GGUFReader", real)  # noqa: B010


def load_gguf_config(path: str, reader: Any | None = None) -> Any:
    """The HF config transformers derives from the file, plus the rope scaling it does not read
    (linear scaling metadata, Llama 3.1's rope_freqs tensor)."""
    from transformers import AutoConfig

    reader = reader if reader is not None else open_gguf(path)
    arch_name = _field(reader, "general.architecture")
    if arch_name in hybrid.HYBRID_GGUF_ARCHS:  # transformers has no qwen3next, and reads qwen35's
        shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist()))  # layer kinds
                  for t in reader.tensors}  # from the interval alone
        return hybrid.hybrid_config(lambda key: _field(reader, key), shapes, arch_name)
    try:
        with reuse_reader(path, reader):
            cfg = AutoConfig.from_pretrained(
                os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path)
            )
    except Exception as e:
        raise WeightLoadError(f"cannot derive an HF config from {path}: {e}") from e
    if arch_name == "gpt-oss":
        return gpt_oss.gguf_config(cfg, lambda key: _field(reader, key))
    cfg = moe_config(cfg, lambda key: _field(reader, key), arch_name)
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    kind = _field(reader, f"{arch_name}.rope.scaling.type")
    if kind not in (None, "none"):
        if kind != "linear":
            raise WeightLoadError(f"{path}: rope scaling type {kind!r} is not supported")
        factor = float(_field(reader, f"{arch_name}.rope.scaling.factor"))
        cfg.rope_parameters = {**rope, "rope_type": "linear", "factor": factor}
    freqs = [t for t in reader.tensors if t.name == ROPE_FREQS]
    if freqs:
        if kind not in (None, "none"):
            raise WeightLoadError(f"{path} has both rope scaling metadata and rope_freqs")
        theta = float(rope.get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0)
        dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        try:
            llama3 = llama3_rope_from_freq_factors(_tensor(reader, freqs[0]), theta, dim)
        except WeightLoadError as e:
            raise WeightLoadError(f"{path}: {e}") from None
        cfg.rope_parameters = {**rope, **llama3}
    return cfg


def load_gguf_tokenizer(path: str, reader: Any | None = None) -> Any:
    """The tokenizer (with chat template) stored in the file's `tokenizer.*` metadata."""
    from transformers import AutoTokenizer

    reader = reader if reader is not None else open_gguf(path)
    arch_name = _field(reader, "general.architecture")
    # the hybrids' class named (transformers would derive it from a config it has no
    # qwen3next one for)
    kind = {"tokenizer_type": hybrid.tokenizer_type(arch_name)} \
        if arch_name in hybrid.HYBRID_GGUF_ARCHS else {}
    try:
        with reuse_reader(path, reader):
            return AutoTokenizer.from_pretrained(
                os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path), **kind
            )
    except Exception as e:
        raise WeightLoadError(f"cannot build a tokenizer from {path}: {e}") from e


def load_gguf(path: str, dtype: Any, keep_blocks: bool = True, cfg: Any = None,
              reader: Any = None, stacks: StackFiles | None = None
              ) -> tuple[ModelArch, dict, Any]:
    """-> (arch, params in `dtype` with kept formats as QuantWeights, HF config); `cfg`: the
    file's HF config when already known (cached), else derived from its metadata; `stacks`:
    where the kept blocks' stacks are kept as files (model/stack_files.py)."""
    reader = reader if reader is not None else open_gguf(path)
    cfg = cfg if cfg is not None else load_gguf_config(path, reader)
    arch = ModelArch.from_hf_config(cfg)
    tensors = read_gguf_tensors(reader, arch, keep_blocks=keep_blocks)
    return arch, assemble_params(arch, tensors, dtype, stacks), cfg
