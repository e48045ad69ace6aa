"""A disk cache of converted params (orbax): a second start skips GGUF parsing and dequantisation.

One entry per (source file, size, mtime, dtype) under `<cache>/params/<key>/`:
    params/        orbax StandardCheckpointer tree of the params pytree (absent for a GGUF
                   whose weights stay in their blocks: those load from the file itself)
    hf/            HF config.json + tokenizer files (save_pretrained), to skip the GGUF metadata
    COMPLETE       written last; an entry without it is never read
The entry is built in a hidden temporary directory and renamed into place in one step, so a
crashed or concurrent write leaves either nothing or a whole entry.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxbatch.model.arch import ModelArch

log = logging.getLogger(__name__)

# Bump when the params layout or the conversion changes, so old entries are not reused.
FORMAT_VERSION = 2  # 2: Qwen3.5 GGUF value heads kept in the file's order
_DONE = "COMPLETE"


def cache_key(source: str, dtype: Any, kind: str = "params") -> str:
    """Hash of the source file's absolute path, size and mtime, the dtype, what the entry holds
    (`params`, or `hf` only) and the format version."""
    st = os.stat(source)
    ident = "|".join(
        [os.path.abspath(source), str(st.st_size), str(st.st_mtime_ns), jnp.dtype(dtype).name,
         str(FORMAT_VERSION)] + ([] if kind == "params" else [kind])
    )
    return hashlib.sha256(ident.encode()).hexdigest()[:24]


def entry_dir(cache_dir: str, key: str) -> str:
    return os.path.join(cache_dir, "params", key)


def is_complete(entry: str) -> bool:
    return os.path.isfile(os.path.join(entry, _DONE))


def hf_dir(entry: str) -> str:
    return os.path.join(entry, "hf")


def remove_entry(entry: str) -> None:
    shutil.rmtree(entry, ignore_errors=True)


def restore_params(entry: str, arch: ModelArch, dtype: Any) -> dict | None:
    """The cached params as jnp arrays, or None (after removing the entry) if it cannot be read."""
    import orbax.checkpoint as ocp

    target = jax.tree.map(
        lambda shape: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)),
        arch.param_shapes(),
        is_leaf=lambda x: isinstance(x, tuple),
    )
    try:
        with ocp.StandardCheckpointer() as ckptr:
            return ckptr.restore(os.path.join(entry, "params"), target)
    except Exception as e:  # noqa: BLE001 - a damaged entry is a cache miss, not a failure
        log.warning("param cache entry %s is unreadable (%s); rebuilding it", entry, e)
        remove_entry(entry)
        return None


def save_entry(entry: str, params: dict | None,
               write_extra: Callable[[str], None] | None = None) -> None:
    """Write params (unless None) and whatever `write_extra(hf_dir)` adds atomically to `entry`.

    Failures are logged, not raised: the model is already loaded, the cache only saves time.
    """
    import orbax.checkpoint as ocp

    parent = os.path.dirname(entry)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".tmp-{os.path.basename(entry)}-")
    try:
        if params is not None:
            with ocp.StandardCheckpointer() as ckptr:
                ckptr.save(os.path.join(tmp, "params"), params)
                ckptr.wait_until_finished()
        if write_extra is not None:
            os.makedirs(os.path.join(tmp, "hf"))
            write_extra(os.path.join(tmp, "hf"))
        with open(os.path.join(tmp, _DONE), "w") as f:
            f.write(f"format {FORMAT_VERSION}\n")
        if os.path.isdir(entry):  # an incomplete leftover, or a concurrent writer won the race
            if is_complete(entry):
                return
            shutil.rmtree(entry, ignore_errors=True)
        os.rename(tmp, entry)
    except Exception as e:  # noqa: BLE001 - the model is loaded; the cache only saves time
        log.warning("could not write param cache entry %s: %s", entry, e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
