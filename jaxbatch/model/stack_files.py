"""Weight stacks kept as files in their final layout, memory-mapped by later starts.

A GGUF's kept blocks and an HF directory's BF16 rows are copied at load into layer stacks
(uint8 [L, N, row bytes], model/quantize.py `from_raw`): the layers of one leaf sit in different
places of the file, the kernel reads one contiguous stack. Built in anonymous memory, every start
paid that copy again, and on a VM the first touch of fresh memory is the slow part: a 1B bf16
model's 2.15 GB of stacks took 16-22 s to fill on a 2-vCPU EPYC VM (memory that a VM has not
touched recently is backed by the host at ~3-4 s per GB; the same copy into recently freed
memory took 0.2 s).

So on CPU the stacks are built in files under the cache directory (through a shared mapping: the
page cache is the copy, no second one in anonymous memory) and mapped again by the next start:
those pages are already in the page cache (as llama.cpp's mmap of a GGUF is), so a warm restart
maps them instead of copying. XLA:CPU aliases the mapping (64-byte aligned, read-only use: no
weight buffer is ever donated). Each file is written under a temporary name and renamed when
complete, so a crashed start leaves nothing half-written behind a valid name.

A GGUF file's layers need no stack at all where the kernel can read them in place
(`file_offset`): the whole file is mapped once (`mapped_source`, uint8 [G, 32]) and each layer's
rows are found by their offset in it (a 1B bf16 GGUF: 2.15 GB not copied at its first start,
nothing written to the cache folder). Rows the loader had to rearrange (a Llama GGUF's q and k
rows, stored permuted) are not a view of the file and are stacked as above.

The folder is keyed by the source's identity (path, size and mtime of its files) and the layout
version; `remove_stale` keeps one folder per source. Disk use: one copy of what is stacked
(2.15 GB for a 1B bf16 HF directory; for a GGUF only its q / k rows, embedding and head).
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import shutil
from collections.abc import Sequence

import numpy as np

log = logging.getLogger(__name__)

_VERSION = "stacks v2"  # v2: Qwen3.5 GGUF value heads in the file's order


class StackFiles:
    """The folder of one source's stack files (`for_source`), or None where not used."""

    def __init__(self, folder: str, source: str | None = None) -> None:
        self.folder = folder
        self.source = source  # a GGUF file whose layers may be read in place
        self.mapped: np.ndarray | None = None  # `mapped_source`'s map, made on first use
        self.device_array: object = None  # its device array (model/quantize.py sets it)

    @classmethod
    def for_source(cls, cache_dir: str, source: str) -> StackFiles | None:
        """The stack folder for a GGUF file or an HF directory (None if it cannot be made)."""
        files = [source] if os.path.isfile(source) else sorted(
            os.path.join(source, f) for f in os.listdir(source) if f.endswith(".safetensors"))
        ident = [_VERSION, os.path.abspath(source)]
        for f in files:
            st = os.stat(f)
            ident.append(f"{os.path.basename(f)}:{st.st_size}:{st.st_mtime_ns}")
        root = os.path.join(cache_dir, "stacks")
        name = hashlib.sha256(os.path.abspath(source).encode()).hexdigest()[:12]
        key = hashlib.sha256("|".join(ident).encode()).hexdigest()[:12]
        folder = os.path.join(root, f"{name}-{key}")
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            log.warning("weight stacks are built in memory: cannot create %s (%s)", folder, e)
            return None
        remove_stale(root, name, keep=folder)
        return cls(folder, source if os.path.isfile(source) else None)

    def file_offset(self, rows: np.ndarray) -> int | None:
        """The byte offset in the source file where `rows` (a view of a memory map of that
        file) start, if the kernel can read them there: C-contiguous, 32-byte aligned and
        inside the file's whole 32-byte units; else None (the rows are then stacked)."""
        base: object = rows
        while base is not None and getattr(base, "_mmap", None) is None:
            base = getattr(base, "base", None)
        if self.source is None or base is None or not rows.flags.c_contiguous:
            return None
        name = getattr(base, "filename", None)
        try:
            if name is None or not os.path.samefile(name, self.source):
                return None
            start = np.frombuffer(getattr(base, "_mmap"), np.uint8).ctypes.data  # noqa: B009
        except (OSError, TypeError, ValueError):
            return None
        # the map starts at the file offset np.memmap asked for, rounded down to a granule
        map_start = int(getattr(base, "offset", 0)) // mmap.ALLOCATIONGRANULARITY \
            * mmap.ALLOCATIONGRANULARITY
        offset = map_start + rows.ctypes.data - start
        whole_units = os.path.getsize(self.source) // 32 * 32
        if offset < 0 or offset % 32 or offset + rows.nbytes > whole_units:
            return None
        return offset

    def mapped_source(self) -> np.ndarray:
        """The source file's whole 32-byte units, read-only, uint8 [G, 32]: one mapping that
        every in-place weight reads."""
        assert self.source is not None
        if self.mapped is None:
            units = os.path.getsize(self.source) // 32
            self.mapped = np.memmap(self.source, np.uint8, mode="r", shape=(units, 32))
        return self.mapped

    def buffer(self, leaf: str, fmt: str, shape: Sequence[int]
               ) -> tuple[np.ndarray | None, bool]:
        """(uint8 `shape` buffer, complete): the file from an earlier start mapped (complete:
        True), else a new file's shared mapping to fill and then pass to `finish`; (None, False)
        where no file can be made (a full disk: the stack is then built in memory)."""
        path = self._path(leaf, fmt, shape)
        size = int(np.prod(shape))
        if os.path.isfile(path) and os.path.getsize(path) == size:
            log.info("weight stack %s mapped from %s", os.path.basename(path), self.folder)
            return np.memmap(path, np.uint8, mode="c", shape=tuple(shape)), True
        tmp = f"{path}.{os.getpid()}.tmp"
        try:  # the blocks reserved first: writing a mapped page the disk has no room for
            with open(tmp, "wb") as f:  # would kill the process (SIGBUS), not raise
                os.posix_fallocate(f.fileno(), 0, size)
        except OSError as e:
            log.warning("weight stack %s is built in memory: cannot reserve %.2f GB in %s (%s)",
                        leaf, size / 1e9, self.folder, e)
            try:
                os.remove(tmp)
            except OSError:
                pass
            return None, False
        return np.memmap(tmp, np.uint8, mode="r+", shape=tuple(shape)), False

    def finish(self, leaf: str, fmt: str, buf: np.ndarray) -> np.ndarray:
        """The filled buffer renamed to its final name (a crash before leaves only a .tmp)."""
        path = self._path(leaf, fmt, buf.shape)
        tmp = f"{path}.{os.getpid()}.tmp"
        os.replace(tmp, path)
        log.info("weight stack %s built in %s", os.path.basename(path), self.folder)
        return buf

    def _path(self, leaf: str, fmt: str, shape: Sequence[int]) -> str:
        dims = "x".join(str(int(d)) for d in shape)
        return os.path.join(self.folder, f"{leaf}-{fmt}-{dims}.bin")


def remove_stale(root: str, name: str, keep: str) -> None:
    """Other folders of the same source (its files changed since), and leftover .tmp files."""
    for entry in os.listdir(root):
        path = os.path.join(root, entry)
        if entry.startswith(f"{name}-") and path != keep:
            shutil.rmtree(path, ignore_errors=True)
    for entry in os.listdir(keep):
        if entry.endswith(".tmp") and not _alive(entry.rsplit(".", 2)[-2]):
            try:
                os.remove(os.path.join(keep, entry))
            except OSError:
                pass


def _alive(pid: str) -> bool:
    """Whether the process that is writing a .tmp file still runs (then it is left alone)."""
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True
