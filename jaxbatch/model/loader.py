"""The one entry point that turns a model name into a LoadedModel (arch, params, tokenizer, EOS ids).

`model` may be
  * a built-in name (`smollm2-135m-instruct`): fetched once into the cache, then a GGUF;
  * a `.gguf` file: converted once, then restored from the orbax param cache;
  * a local HF directory: config.json + safetensors (single or sharded), tokenizer if present;
  * a Hugging Face Hub name, `OWNER/NAME` (safetensors) or `OWNER/NAME:QUANT` (a GGUF file picked
    by its quant tag): downloaded into huggingface_hub's cache, then one of the above
    (model/hub.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Any

import jax
import jax.numpy as jnp

from jaxbatch.config import DTYPES, canonical_dtype
from jaxbatch.config import cache_dir as default_cache_dir
from jaxbatch.model import hub, param_cache, registry
from jaxbatch.model.arch import ModelArch
from jaxbatch.model.hf import load_hf_config, load_hf_dir
from jaxbatch.model.quantize import QuantWeight, bf16_rows_params, quantize_params
from jaxbatch.model.stack_files import StackFiles

log = logging.getLogger(__name__)

_JNP_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    arch: ModelArch
    params: dict  # the stacked params pytree (see ModelArch.param_shapes), jnp arrays
    tokenizer: Any  # a transformers tokenizer; None for an HF directory without tokenizer files
    source: str  # the file or directory the weights came from
    load_seconds: float
    from_cache: bool  # params restored from the orbax cache rather than converted
    # every id that ends generation: the tokenizer's EOS and generation_config.json's eos_token_id
    # (an int or a list: Llama 3 instruct models stop on <|eot_id|> as well as <|end_of_text|>)
    eos_token_ids: tuple[int, ...] = ()

    def with_dtype(self, dtype: str | Any) -> LoadedModel:
        """The same model with its params converted to `dtype` (a no-op when they already are);
        quantised weights stay in their blocks."""
        dt = resolve_dtype(dtype)
        if self.params["final_norm"].dtype == dt:
            return self
        params = jax.tree.map(lambda p: p if isinstance(p, QuantWeight) else p.astype(dt),
                              self.params, is_leaf=lambda p: isinstance(p, QuantWeight))
        return dataclasses.replace(self, params=params)

    def as_bf16_rows(self) -> LoadedModel:
        """The same bf16 model with its float linear weights, embedding and head as BF16 rows
        (model/quantize.py `bf16_rows_params`); a no-op in other dtypes."""
        if self.params["final_norm"].dtype != jnp.bfloat16:
            return self
        return dataclasses.replace(self, params=bf16_rows_params(self.params))

    def quantized(self, quantization: str | None) -> LoadedModel:
        """The same model with its linear weights quantised (`quantization: int8`, see
        model/quantize.py); a no-op for None. Call it after `with_dtype`: the rest of the params
        stay in the compute dtype."""
        if quantization is None:
            return self
        return dataclasses.replace(self, params=quantize_params(self.params, quantization))


def resolve_dtype(dtype: str | Any) -> Any:
    """A dtype name ('float32', 'bf16', ...) or a numpy/jnp dtype -> the jnp scalar type."""
    if isinstance(dtype, str):
        return _JNP_DTYPES[canonical_dtype(dtype)]
    name = jnp.dtype(dtype).name
    if name not in DTYPES:
        raise ValueError(f"dtype {name} is not supported (use one of {DTYPES})")
    return _JNP_DTYPES[name]


def load_model(model: str, dtype: str | Any, cache_dir: str | None = None,
               tokenizer: str | None = None, bf16_rows: bool = False,
               revision: str | None = None, download_dir: str | None = None) -> LoadedModel:
    """`tokenizer`: a directory whose tokenizer replaces the model's own (or supplies one to a
    model directory that has none). `bf16_rows` (bfloat16 only): an HF directory's linear
    weights, embedding and head held as BF16 rows, one copy that the quantised matmul kernel
    reads (model/hf.py `bf16_blocks`), as a bf16 GGUF's are. `revision`, `download_dir`: a Hub
    name's branch, tag or commit and huggingface_hub cache folder (model/hub.py)."""
    t0 = time.perf_counter()
    dt = resolve_dtype(dtype)
    cache_dir = default_cache_dir(cache_dir)
    model = _local_path(model, cache_dir, revision, download_dir)
    gen_config_dir: str | None = None
    if os.path.isdir(model):
        rows = bf16_rows and dt == jnp.bfloat16
        arch, params = load_hf_dir(model, dt, bf16_rows=rows,
                                   stacks=_stack_files(cache_dir, model) if rows else None)
        tok, hit, gen_config_dir = _dir_tokenizer(model), False, model
    elif model.endswith(".gguf") and os.path.isfile(model):
        arch, params, tok, hit = _load_gguf_cached(model, dt, cache_dir)
    else:
        raise FileNotFoundError(_not_a_model(model))
    if tokenizer is not None:
        tok = _dir_tokenizer(tokenizer)
        if tok is None:
            raise FileNotFoundError(f"--tokenizer {tokenizer!r} holds no tokenizer files "
                                    f"({', '.join(_TOKENIZER_FILES)})")
    eos = _eos_token_ids(tok, gen_config_dir)
    return LoadedModel(arch, params, tok, model, time.perf_counter() - t0, from_cache=hit,
                       eos_token_ids=eos)


def load_arch(model: str, cache_dir: str | None = None, revision: str | None = None,
              download_dir: str | None = None) -> ModelArch:
    """The model's architecture without its weights (config.json, or the GGUF's metadata,
    cached), so that the compute dtype can be chosen before the weights are read."""
    cache_dir = default_cache_dir(cache_dir)
    model = _local_path(model, cache_dir, revision, download_dir)
    if os.path.isdir(model):
        return ModelArch.from_hf_config(load_hf_config(model))
    if model.endswith(".gguf") and os.path.isfile(model):
        from jaxbatch.model.gguf.reader import TensorIndex, open_gguf

        entry = param_cache.entry_dir(cache_dir, param_cache.cache_key(model, "float32",
                                                                       kind="hf"))
        cfg, _, _ = _cached_hf(entry)
        if cfg is None:
            reader = open_gguf(model)
            cfg, tok = _gguf_config_and_tokenizer(model, reader)
            param_cache.save_entry(entry, None, _hf_writer(cfg, tok, TensorIndex.table(model,
                                                                                    reader)))
        return ModelArch.from_hf_config(cfg)
    raise FileNotFoundError(_not_a_model(model))


def _local_path(model: str, cache_dir: str, revision: str | None,
                download_dir: str | None) -> str:
    """A built-in name or a Hub name -> its local file or folder (fetched on first use); a
    split GGUF's part refused (the reader reads one file); anything else unchanged."""
    if registry.is_builtin(model):
        return registry.builtin_model_path(model, cache_dir)
    model = hub.resolve(model, revision, download_dir)
    split = hub.SPLIT_GGUF.search(model)
    if split is not None and int(split.group(2)) > 1 and os.path.isfile(model):
        raise ValueError(f"{model} is part {int(split.group(1))} of a GGUF split into "
                         f"{int(split.group(2))} files; jaxbatch reads one GGUF file: merge the "
                         f"parts with llama.cpp's `llama-gguf-split --merge {model} OUT.gguf`")
    return model


def _not_a_model(model: str) -> str:
    return (f"model {model!r} is neither a built-in name "
            f"({', '.join(sorted(registry.BUILTIN_MODELS))}), an existing .gguf file, a local "
            f"HF directory with config.json nor a Hugging Face Hub name (OWNER/NAME[:QUANT])")


def _dir_tokenizer(path: str) -> Any:
    if not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _eos_token_ids(tokenizer: Any, model_dir: str | None) -> tuple[int, ...]:
    """The tokenizer's EOS id plus generation_config.json's eos_token_id (int or list)."""
    ids: set[int] = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    path = os.path.join(model_dir, "generation_config.json") if model_dir else ""
    if path and os.path.isfile(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        ids.update(int(i) for i in ([eos] if isinstance(eos, int) else eos or []))
    return tuple(sorted(ids))


def _load_gguf_cached(path: str, dtype: Any, cache_dir: str) -> tuple[ModelArch, dict, Any, bool]:
    """-> (arch, params, tokenizer, from_cache). On CPU a file with weights in kept formats
    loads them from the file every time (mmap'd, no conversion; the C++ kernels read the
    blocks) and caches only its HF config and tokenizer; other files, and every file on an
    accelerator, are dequantised once into the orbax param cache in the compute dtype."""
    from jaxbatch.model.gguf.reader import TensorIndex, has_kept_blocks, load_gguf, open_gguf

    # the file's HF config, tokenizer and tensor table (whatever the dtype): parsing its
    # metadata takes seconds, which a restart skips
    entry = param_cache.entry_dir(cache_dir, param_cache.cache_key(path, "float32", kind="hf"))
    cfg, tok, hit = _cached_hf(entry)
    reader: Any = _saved_index(path, entry) if hit else None
    if reader is None:
        reader = open_gguf(path)
        if not hit:
            cfg, tok = _gguf_config_and_tokenizer(path, reader)
            param_cache.save_entry(entry, None, _hf_writer(cfg, tok, TensorIndex.table(path,
                                                                                    reader)))
    if _keeps_blocks_here() and has_kept_blocks(reader, ModelArch.from_hf_config(cfg)):
        arch, params, _ = load_gguf(path, dtype, cfg=cfg, reader=reader,
                                    stacks=_stack_files(cache_dir, path))
        return arch, params, tok, hit
    entry = param_cache.entry_dir(cache_dir, param_cache.cache_key(path, dtype))
    cfg_p, tok_p, hit = _cached_hf(entry)
    if hit:
        arch = ModelArch.from_hf_config(cfg_p)
        restored = param_cache.restore_params(entry, arch, dtype)
        if restored is not None:
            return arch, restored, tok_p, True
    arch, params, cfg = load_gguf(path, dtype, keep_blocks=False, cfg=cfg, reader=reader)
    param_cache.save_entry(entry, params, _hf_writer(cfg, tok))
    return arch, params, tok, False


def _keeps_blocks_here() -> bool:
    """Quantised GGUF weights stay in their blocks on CPU only, where the C++ kernels multiply
    them in place. On a GPU XLA's dot would dequantise every weight in full at every step (a
    Q4_K model re-expanded each decode step); there the file is dequantised once at load into
    the compute dtype (bf16 by default: 2 bytes a weight) and cached, so a step reads only
    plain arrays."""
    keep = jax.default_backend() == "cpu"
    if not keep:
        log.info("GGUF on %s: quantised weights dequantised once at load to the compute dtype "
                 "(and cached), not per step", jax.default_backend())
    return keep


def _stack_files(cache_dir: str, source: str) -> StackFiles | None:
    """On CPU, the folder where the kept weights' stacks are built as files and mapped by the
    next start (model/stack_files.py); elsewhere the stacks are copied to the device anyway."""
    if jax.default_backend() != "cpu":
        return None
    return StackFiles.for_source(cache_dir, source)


def _gguf_config_and_tokenizer(path: str, reader: Any) -> tuple[Any, Any]:
    from jaxbatch.model.gguf.reader import load_gguf_config, load_gguf_tokenizer, reuse_reader

    with reuse_reader(path, reader):  # one parse of the metadata, not three
        return load_gguf_config(path, reader), load_gguf_tokenizer(path, reader)


def _cached_hf(entry: str) -> tuple[Any, Any, bool]:
    """(config, tokenizer, True) from a complete cache entry's hf/ folder, else (None, None,
    False); a damaged entry is removed."""
    from transformers import AutoConfig, AutoTokenizer

    if not param_cache.is_complete(entry):
        return None, None, False
    hf = param_cache.hf_dir(entry)
    try:
        return AutoConfig.from_pretrained(hf), AutoTokenizer.from_pretrained(hf), True
    except (OSError, ValueError) as e:  # damaged config/tokenizer files: rebuild the entry
        log.warning("param cache entry %s is unreadable (%s); rebuilding it", entry, e)
        param_cache.remove_entry(entry)
        return None, None, False


_INDEX = "gguf_tensors.json"


def _hf_writer(cfg: Any, tok: Any, index: dict | None = None) -> Any:
    def write_hf(d: str) -> None:
        cfg.save_pretrained(d)
        tok.save_pretrained(d)
        if index is not None:
            with open(os.path.join(d, _INDEX), "w") as f:
                json.dump(index, f)

    return write_hf


def _saved_index(path: str, entry: str) -> Any:
    """The GGUF's tensor table saved in its cache entry, over the mapped file; None if absent
    or unusable (then the file is parsed)."""
    from jaxbatch.model.gguf.reader import TensorIndex

    try:
        with open(os.path.join(param_cache.hf_dir(entry), _INDEX)) as f:
            return TensorIndex(path, json.load(f))
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.info("GGUF tensor index unusable (%s); parsing %s", e, path)
        return None
