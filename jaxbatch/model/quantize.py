"""Quantised linear weights: GGUF blocks held as the file stores them, dequantised inside the dot.

A `QuantWeight` is a linear weight [..., in, out] held as GGUF blocks (pallas_kernels/matmul/
quant_formats.py: Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, MXFP4, BF16, F16): uint8 [..., out,
row_bytes], one row of blocks along `in` per output feature, the bits per weight of the format (4.5 for Q4_K, 8.5 for Q8_0).
A GGUF file's tensors of those types load this way (model/gguf/reader.py), and `quantization: int8`
quantises a float checkpoint's linear weights to Q8_0 blocks (one f16 scale per 32 inputs).

Layers of one leaf may come in different formats (a Q4_K_M file keeps about half the layers'
attn_v and ffn_down in Q6_K): the stack is then one array per format, and `part_of_layer` /
`index_in_part` say where each layer's weight is; the step switches on the layer (lax.switch).

A GGUF file's stacked weights may instead be read where the file holds them (model/
stack_files.py `file_offset`): every part is then the one mapped file, uint8 [G, 32], and
`offsets` says where each layer's rows start (in 32-byte units, each as two i32 words: a file may
pass 64 GiB); nothing is copied at load.

Inside the step (`quant_matmul`) the CPU kernel (pallas_kernels/matmul/quant.py) dequantises in
registers and dots, reading the whole stack with the layer index (slicing the stack in the layer
scan made XLA copy each layer's weights per step); elsewhere (GPU, or without the kernel) the
layer's blocks are dequantised with jnp (quant_formats.dequantize) and dotted in x's dtype with
f32 sums. Everything else (norms, biases, the KV cache) stays in the compute dtype.

A GGUF file's MoE experts (3-D tensors of ggml shape [K, N, E]) are QuantWeights with `experts`
= E: each layer's rows uint8 [E * N, RB], expert e's N rows at row e * N, as the file holds them.
`grouped_quant_matmul` multiplies rows sorted by expert by their experts' weights, reading only
the routed experts on the CPU kernel (pallas_kernels/matmul/moe.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.config import QUANTIZATIONS
from jaxbatch.model.stack_files import StackFiles
from pallas_kernels.matmul import quant_formats

# the dense linear weights of a layer, each [L, in, out]; all are used through llama._mm
LINEAR_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@dataclasses.dataclass(frozen=True)
class RawBlocks:
    """One 2-D tensor's GGUF blocks as read from a file (host memory or a memory map):
    rows uint8 [n, row_bytes(fmt, k)]; the weight is [n, k] (HF's [out, in]). With `experts` =
    E, a 3-D expert tensor: rows [E * n, row_bytes], expert e's at row e * n. `parent`: the
    3-D tensor this one expert's rows (`expert`) were cut from (the loader puts them back)."""

    fmt: str
    rows: np.ndarray
    k: int
    experts: int = 0
    parent: RawBlocks | None = None
    expert: int = -1

    @property
    def n(self) -> int:
        return int(self.rows.shape[0]) // max(1, self.experts)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantWeight:
    """A linear weight [..., in, out] (or an embedding [V, H]: `k` = H) in GGUF blocks."""

    parts: tuple[jax.Array, ...]  # per format: uint8 [L_f, n, row_bytes] (no L axis unstacked)
    part_of_layer: jax.Array | None  # i32 [L]: which part holds layer l (None: one part)
    index_in_part: jax.Array | None  # i32 [L]: its index there
    fmts: tuple[str, ...] = dataclasses.field(metadata={"static": True})
    k: int = dataclasses.field(metadata={"static": True})  # inputs (dot axis)
    n: int = dataclasses.field(metadata={"static": True})  # outputs
    stacked: bool = dataclasses.field(metadata={"static": True})
    # > 0: a layer's weight is this many experts' [in, out] weights, rows uint8 [E * n, RB]
    experts: int = dataclasses.field(default=0, metadata={"static": True})
    # run through the CPU kernel (set by cpu_layout.as_run_on_cpu where it is built), else jnp
    kernel: bool = dataclasses.field(default=False, metadata={"static": True})
    # per part, the kernel's activations: "float" (weights dequantised into the dot), "int8"
    # (x quantised per row to int8 blocks, integer dots: llama.cpp's scheme) or, for BF16 rows,
    # "amx" (Intel AMX tiles) or "panel" (outer-product tiles, AVX512-BF16 or AVX2); chosen per
    # format and shape by measurement (tuning/precision.py), never per step size; () = all "float"
    acts: tuple[str, ...] = dataclasses.field(default=(), metadata={"static": True})
    # BF16 parts on the kernel: steps of at least this many rows run XLA's dot on the rows
    # bitcast to bf16 instead (where measured faster: AMX's bf16 dots at prefill sizes, engine/
    # precision.py choose_bf16_route); 0: the kernel at every size (batch invariant)
    xla_from_rows: int = dataclasses.field(default=0, metadata={"static": True})
    # inside the layer scan: the parts are the whole stacks and this i32 scalar picks the layer
    layer: jax.Array | None = None
    # the weight read in place from a mapped GGUF file (every part is that file, uint8 [G, 32]):
    # i32 [L, 2], layer l's [n, row_bytes] rows at byte 32 * u, u = offsets[l] as words [low,
    # high] (quant_formats.offset_words: jax runs with 32-bit integers, and one i32 of 32-byte
    # units ends at 64 GiB); None: parts are stacks
    offsets: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        lead = (self.num_layers,) if self.stacked else ()
        ex = (self.experts,) if self.experts else ()
        return (*lead, *ex, self.k, self.n)

    @property
    def num_layers(self) -> int:
        if self.offsets is not None:
            return int(self.offsets.shape[0])
        if self.part_of_layer is not None:
            return int(self.part_of_layer.shape[0])
        return int(self.parts[0].shape[0])

    @property
    def nbytes(self) -> int:
        """The bytes of the weight as held (in place: its layers' rows, not the whole file)."""
        if self.offsets is None:
            return int(sum(p.size for p in self.parts))
        return sum(self.rows_per_layer * quant_formats.row_bytes(
            self.fmts[self._where(li)[0]], self.k) for li in range(self.num_layers))

    @property
    def rows_per_layer(self) -> int:
        """Rows of blocks a layer holds: n, or E * n for experts."""
        return self.n * max(1, self.experts)

    def layer_rows(self, part: int, index: Any, li: Any) -> jax.Array:
        """Layer `li`'s rows uint8 [n (E * n for experts), row_bytes] (`index`: its index in
        `part`)."""
        blocks = self.parts[part]
        if self.offsets is None:
            return blocks[index]
        rb = quant_formats.row_bytes(self.fmts[part], self.k)
        rows = self.rows_per_layer
        if blocks.shape[0] > 2**31:  # jnp's i32 start index reaches 2^31 units (64 GiB) only
            raise ValueError("a file past 64 GiB is read in place by the CPU kernel only")
        units = jax.lax.dynamic_slice(blocks, (self.offsets[li, 0], 0), (rows * rb // 32, 32))
        return units.reshape(rows, rb)

    def dequantized(self) -> jax.Array:
        """f32 [..., in, out] ([..., E, in, out] for experts): the weight the quantised forward
        computes with (tests)."""
        def one(rows: jax.Array, fmt: str) -> jax.Array:
            w = quant_formats.dequantize(rows, fmt, self.k)  # [rows, k]
            if self.experts:
                return jnp.swapaxes(w.reshape(self.experts, self.n, self.k), 1, 2)
            return w.T

        if not self.stacked:
            return one(self.parts[0], self.fmts[0])
        layers = []
        for li in range(self.num_layers):
            p, i = self._where(li)
            layers.append(one(self.layer_rows(p, i, li), self.fmts[p]))
        return jnp.stack(layers)

    def _where(self, li: int) -> tuple[int, int]:
        if self.part_of_layer is None:
            return 0, li
        return int(self.part_of_layer[li]), int(self.index_in_part[li])  # type: ignore[index]

    def rows(self, ids: jax.Array) -> jax.Array:
        """An unstacked weight's rows `ids` dequantised, f32 [len(ids), k] (embedding lookup)."""
        return quant_formats.dequantize(self.parts[0][ids], self.fmts[0], self.k)


def _aligned_empty(shape: tuple[int, ...]) -> np.ndarray:
    """uint8 `shape`, 64-byte aligned: XLA:CPU can then take it as a buffer without a copy."""
    size = int(np.prod(shape))
    raw = np.empty(size + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start:start + size].reshape(shape)


def _to_device(buf: np.ndarray) -> jax.Array:
    """The host buffer as a jax array: aliased on CPU (no second copy of a weight stack at
    load), copied elsewhere."""
    if jax.default_backend() == "cpu":
        return jax.device_put(buf, may_alias=True)
    return jnp.asarray(buf)


def _drop_file_pages(rows: np.ndarray) -> None:
    """Unmap the pages of a memory-mapped file under `rows` (already copied): a mapped page
    counts in the process's RSS until unmapped, so reading a 2 GB file this way held up to
    2 GB of it beside the weights. Only whole pages inside `rows`; anything else: no-op."""
    import mmap

    base: Any = rows
    while base is not None and getattr(base, "_mmap", None) is None:
        base = getattr(base, "base", None)  # a memoryview (a buffer's export) ends the chain
    if base is None or not rows.flags.c_contiguous:
        return
    mapped = getattr(base, "_mmap")  # noqa: B009 - np.memmap's mmap.mmap (slices share it)
    try:
        start = np.frombuffer(mapped, np.uint8).ctypes.data  # the mapping's first byte
    except (TypeError, ValueError):
        return
    lo = rows.ctypes.data - start
    hi = lo + rows.nbytes
    lo = -(-lo // mmap.PAGESIZE) * mmap.PAGESIZE
    hi = min(hi, len(mapped)) // mmap.PAGESIZE * mmap.PAGESIZE
    if 0 <= lo < hi:
        try:
            mapped.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        except (AttributeError, OSError, ValueError):
            pass


def _host_buffer(shape: tuple[int, ...], stacks: StackFiles | None, leaf: str, fmt: str,
                 fill: Callable[[np.ndarray], None]) -> np.ndarray:
    """The uint8 `shape` host buffer of one leaf's part, filled by `fill`: in anonymous memory,
    or (with `stacks`) a file of the stack folder, mapped as it is if an earlier start built
    it (`fill` not called)."""
    buf, complete = stacks.buffer(leaf, fmt, shape) if stacks is not None else (None, False)
    if buf is None:
        buf = _aligned_empty(shape)
        fill(buf)
        return buf
    assert stacks is not None
    if not complete:
        fill(buf)
        buf = stacks.finish(leaf, fmt, buf)
    return buf


def _in_place(raw: Sequence[RawBlocks], stacks: StackFiles | None) -> list[int] | None:
    """Each layer's byte offset in the mapped source file, if all of them can be read there."""
    if stacks is None or stacks.source is None or jax.default_backend() != "cpu" \
            or len(jax.devices()) != 1:
        return None
    offsets = []
    for r in raw:
        off = stacks.file_offset(r.rows)
        if off is None or r.rows.nbytes % 32:
            return None
        offsets.append(off)
    return offsets


def from_raw(raw: RawBlocks | Sequence[RawBlocks], stacks: StackFiles | None = None,
             leaf: str = "") -> QuantWeight:
    """One tensor's blocks, or one per layer (a stack, grouped by format), as a QuantWeight
    (read in place from the mapped source file where it can be (`stacks.file_offset`), else
    copied once into device memory, or into / from a file of `stacks` named by `leaf`; the
    source file's pages are dropped as they are copied)."""
    if isinstance(raw, RawBlocks):
        def fill_one(buf: np.ndarray) -> None:
            buf[...] = raw.rows
            _drop_file_pages(raw.rows)

        host = _host_buffer(raw.rows.shape, stacks, leaf, raw.fmt, fill_one)
        return QuantWeight((_to_device(host),), None, None, (raw.fmt,), raw.k, raw.n,
                           stacked=False)
    fmts = tuple(dict.fromkeys(r.fmt for r in raw))
    k, n, experts = raw[0].k, raw[0].n, raw[0].experts
    if any(r.k != k or r.n != n or r.experts != experts for r in raw):
        raise ValueError("the layers of one weight have different shapes")
    rows = n * max(1, experts)
    parts: list[jax.Array] = []
    part_of, index_of = [], []
    offsets = _in_place(raw, stacks)
    if offsets is not None:
        assert stacks is not None
        if stacks.device_array is None:
            stacks.device_array = _to_device(stacks.mapped_source())
        parts = [cast(jax.Array, stacks.device_array)] * len(fmts)
    for fmt in ([] if offsets is not None else fmts):
        members = [r for r in raw if r.fmt == fmt]

        def fill(buf: np.ndarray, members: list[RawBlocks] = members) -> None:
            for i, r in enumerate(members):
                buf[i] = r.rows
                _drop_file_pages(r.rows)

        parts.append(_to_device(_host_buffer(
            (len(members), rows, quant_formats.row_bytes(fmt, k)), stacks, leaf, fmt, fill)))
    counters = dict.fromkeys(fmts, 0)
    for r in raw:
        part_of.append(fmts.index(r.fmt))
        index_of.append(counters[r.fmt])
        counters[r.fmt] += 1
    one = len(fmts) == 1
    return QuantWeight(tuple(parts), None if one else jnp.asarray(part_of, jnp.int32),
                       None if one else jnp.asarray(index_of, jnp.int32), fmts, k, n,
                       stacked=True, experts=experts, offsets=None if offsets is None else jnp.asarray(
                           quant_formats.offset_words(np.asarray(offsets, np.int64) // 32)))


def check_quantization(name: str | None) -> str | None:
    if name is not None and name not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} (or none), got {name!r}")
    return name


def quantize_q8_0(w_out_in: np.ndarray) -> np.ndarray:
    """w [..., n, k] (k % 32 == 0) -> Q8_0 rows uint8 [..., n, k / 32 * 34], as ggml's
    quantize_row_q8_0: per 32 inputs d = max|w| / 127 (as f16), q = round(w / d)."""
    w = np.asarray(w_out_in, np.float32)
    *lead, n, k = w.shape
    b = w.reshape(*lead, n, k // 32, 32)
    d = np.abs(b).max(axis=-1) / 127.0
    inv = np.where(d > 0, 1.0 / np.where(d > 0, d, 1.0), 0.0)
    q = np.clip(np.rint(b * inv[..., None]), -127, 127).astype(np.int8)
    out = np.empty((*lead, n, k // 32, 34), np.uint8)
    out[..., 0:2] = d.astype(np.float16)[..., None].view(np.uint8)
    out[..., 2:] = q.view(np.uint8)
    return out.reshape(*lead, n, k // 32 * 34)


def quantize_params(params: dict, quantization: str | None) -> dict:
    """The params with each layer's dense linear weights as Q8_0 `QuantWeight`s (`int8`; no-op
    for None, for weights already quantised, and for weights whose inputs are not whole blocks
    of 32). One layer at a time, so that memory holds one float layer beside the blocks."""
    if check_quantization(quantization) is None:
        return params
    layers = dict(params["layers"])
    for name in LINEAR_WEIGHTS:
        w = layers.get(name)
        if w is None or not isinstance(w, jax.Array) or w.shape[-2] % 32:
            continue
        k, n = w.shape[-2:]
        raws = [RawBlocks("Q8_0", quantize_q8_0(np.asarray(jax.device_get(w[i]), np.float32).T),
                          k) for i in range(w.shape[0])]
        layers[name] = from_raw(raws)
    return {**params, "layers": layers}


def _bf16_rows(w_out_in: np.ndarray) -> RawBlocks:
    """w [n, k] -> its rows as BF16 blocks (the bf16 bits, [n, 2 * k] uint8), rounded to bf16
    (nearest even) if held wider."""
    bits = np.ascontiguousarray(np.asarray(w_out_in).astype(jnp.bfloat16)).view(np.uint16)
    return RawBlocks("BF16", bits.view(np.uint8), int(w_out_in.shape[1]))


def bf16_rows_params(params: dict) -> dict:
    """The params with the dense linear weights, the routed experts, the embedding and an
    untied head held as BF16 rows (`QuantWeight`s the quantised matmul reads, one resident copy each), as an HF
    directory's bf16 weights load (model/hf.py `bf16_blocks`): what a file whose format is not
    kept (a Q4_1 or Q5_0 GGUF, dequantised) runs in bfloat16 on one CPU device. The kernel gives
    a row the same bits at every step size (a batch-invariant mode for every M), and a weight
    whose input is not whole 32-blocks stays as it is. One layer at a time."""
    qk = quant_formats.FORMATS["BF16"][0]
    layers = dict(params["layers"])
    for name in LINEAR_WEIGHTS:
        w = layers.get(name)
        if w is None or not isinstance(w, jax.Array) or w.ndim != 3 or w.shape[1] % qk:
            continue
        layers[name] = from_raw([_bf16_rows(np.asarray(jax.device_get(w[i])).T)
                                 for i in range(w.shape[0])])
    # routed experts [L, E, in, out] (e.g. a Q5_0 file's, dequantised): BF16 rows [E * out, in]
    # per layer, so that the routed-expert kernel reads only the chosen experts (float arrays
    # go through ragged_dot, on XLA:CPU a dense dot against every expert)
    for name in ("experts_gate", "experts_up", "experts_down"):
        w = layers.get(name)
        if w is None or not isinstance(w, jax.Array) or w.ndim != 4 or w.shape[2] % qk:
            continue
        E = int(w.shape[1])
        raws = []
        for i in range(w.shape[0]):
            rows = _bf16_rows(np.swapaxes(np.asarray(jax.device_get(w[i])), 1, 2).reshape(
                E * int(w.shape[3]), int(w.shape[2])))
            raws.append(RawBlocks("BF16", rows.rows, rows.k, experts=E))
        layers[name] = from_raw(raws)
    out = {**params, "layers": layers}
    embed = params["embed"]
    if isinstance(embed, jax.Array) and embed.ndim == 2 and embed.shape[1] % qk == 0:
        out["embed"] = from_raw(_bf16_rows(np.asarray(jax.device_get(embed))))
    head = params.get("lm_head")
    if isinstance(head, jax.Array) and head.ndim == 2 and head.shape[0] % qk == 0:
        out["lm_head"] = from_raw(_bf16_rows(np.asarray(jax.device_get(head)).T))
    return out


def quant_matmul(x: jax.Array, w: QuantWeight, out_dtype: Any = None) -> jax.Array:
    """x [T, in] @ w -> [T, out] in x's dtype (or `out_dtype`: float32 for the head's logits),
    f32 sums."""
    if w.experts:
        raise ValueError("an experts weight is multiplied by grouped_quant_matmul")
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    li = w.layer if w.stacked else None
    if w.stacked and li is None:
        raise ValueError("a stacked QuantWeight needs its layer index (set in the layer scan)")

    def one(part: int, index: Any) -> jax.Array:
        blocks, fmt = w.parts[part], w.fmts[part]
        to_xla = fmt == "BF16" and 0 < w.xla_from_rows <= x.shape[0]
        if w.kernel and not to_xla:
            from pallas_kernels.matmul import quant

            act = w.acts[part] if w.acts else "float"
            if w.offsets is not None:  # read in place from the mapped file
                return quant.quant_matmul(x, blocks, w.offsets[li], fmt=fmt, k=w.k, act=act,
                                          out_dtype=out_dtype, n=w.n)
            stack = blocks if w.stacked else blocks[None]
            return quant.quant_matmul(x, stack, 0 if index is None else index, fmt=fmt, k=w.k,
                                      act=act, out_dtype=out_dtype)
        rows = blocks if index is None else w.layer_rows(part, index, li)
        if fmt == "BF16" and x.dtype == jnp.bfloat16:  # the rows are bf16 values: bitcast
            wf = jax.lax.bitcast_convert_type(rows.reshape(w.n, w.k, 2), jnp.bfloat16)
        else:
            wf = quant_formats.dequantize(rows, fmt, w.k).astype(x.dtype)  # [n, k]
        return jax.lax.dot_general(x, wf, (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32).astype(out_dtype)

    if not w.stacked:
        return one(0, None)
    if w.part_of_layer is None:
        return one(0, li)
    assert w.index_in_part is not None
    idx = w.index_in_part[li]
    return jax.lax.switch(w.part_of_layer[li], [lambda p=p: one(p, idx)
                                                for p in range(len(w.parts))])


def grouped_quant_matmul(x: jax.Array, w: QuantWeight, group_sizes: jax.Array) -> jax.Array:
    """x [M, in] with rows sorted by expert (group_sizes i32 [E] rows each; rows past their sum
    are padding and come out zero) @ each row's expert weight -> [M, out] in x's dtype, f32 sums.
    On the CPU kernel only the routed experts' blocks are read; elsewhere the layer's experts
    are dequantised and `ragged_dot` runs (XLA's, dense on CPU)."""
    from pallas_kernels.matmul import moe as moe_kernel

    li = w.layer
    if not w.experts or not w.stacked or li is None:
        raise ValueError("grouped_quant_matmul takes a stacked experts weight inside the scan")

    def one(part: int, index: Any) -> jax.Array:
        fmt = w.fmts[part]
        if w.kernel:
            act = w.acts[part] if w.acts else "float"
            if w.offsets is not None:
                return moe_kernel.moe_matmul(x, w.parts[part], w.offsets[li], group_sizes,
                                             fmt=fmt, k=w.k, n=w.n, experts=w.experts, act=act,
                                             in_file=True)
            return moe_kernel.moe_matmul(x, w.parts[part], index, group_sizes, fmt=fmt, k=w.k,
                                         n=w.n, experts=w.experts, act=act)
        return moe_kernel.moe_matmul_reference(x, w.layer_rows(part, index, li), group_sizes,
                                               fmt=fmt, k=w.k, n=w.n, experts=w.experts)

    if w.part_of_layer is None:
        return one(0, li)
    assert w.index_in_part is not None
    idx = w.index_in_part[li]
    return jax.lax.switch(w.part_of_layer[li], [lambda p=p: one(p, idx)
                                                for p in range(len(w.parts))])


def _nbytes(tree: Any) -> int:
    leaves = jax.tree.leaves(tree, is_leaf=lambda a: isinstance(a, QuantWeight))
    return int(sum(a.nbytes if isinstance(a, QuantWeight) else a.size * a.dtype.itemsize
                   for a in leaves))


def weight_bytes(params: dict) -> dict[str, int]:
    """Bytes as stored: `layers` (the stacked layer weights), `decode_step` (what every step
    reads whatever its size: the layers, the head — `lm_head`, else the tied embedding — and
    the final norm; the embedding rows of the step's tokens are left out) and `total`."""
    head = params["lm_head"] if "lm_head" in params else params["embed"]
    layers = _nbytes(params["layers"])
    return {"layers": layers, "decode_step": layers + _nbytes(head) + _nbytes(
        params["final_norm"]), "total": _nbytes(params)}
