"""Tensor parallelism as a transformation of the unchanged model: a `Mesh` with one axis "tp", a
table from parameter path to `PartitionSpec`, and attention run per shard under `shard_map`.

Megatron's layout (XLA inserts the collectives from the shardings; the model code is the same
single-device forward):
  wq wk wv w_gate w_up [L, H, out]   columns split (heads / MLP columns)  P(None, None, "tp")
  bq bk bv [L, out]                   split like their columns              P(None, "tp")
  wo w_down [L, in, H]                rows split: each device a partial sum P(None, "tp", None)
                                      -> one all-reduce after o and one after down, per layer
  lm_head [H, V]                      vocab split; the logits are gathered for the sampler
  experts_* [L, E, ...] and an experts QuantWeight's blocks [L, E * n, row_bytes]
                                      split by expert (expert parallelism): each device holds
                                      and reads E/tp whole experts (quantised blocks stay
                                      blocks), computes the routed rows of its own experts and
                                      the partial sums are all-reduced (`shard_experts`): one
                                      all-reduce of [T, H] per MoE layer, like a dense MLP's
  everything else (embedding, norms, whatever a new architecture adds) replicated: correct
  under any sharding propagation, only not memory-saving.
  KV cache [L, pages, P, K, D]        split by KV head                     P(..., "tp", None)

GQA when KV heads K < tp: each KV head is duplicated tp/K times (vLLM does the same), so every
device holds exactly the one KV head its q heads read. With q head n -> KV head n // (N/K), the
device s holding q heads [s*N/tp, (s+1)*N/tp) needs KV head s*K/tp, which is copy s of the
duplicated heads; the duplicated model is the same function (its GQA group N/tp maps q head n
to duplicate n // (N/tp) = s). Requirements: N % tp == 0, K % tp == 0 or tp % K == 0, I % tp == 0,
E % tp == 0.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxbatch.model.arch import ModelArch
from jaxbatch.model.archs import moe
from jaxbatch.model.quantize import QuantWeight

TP = "tp"
# params leaves under these names: split by output columns (last axis) / by input rows (axis 1)
COLUMN_PARALLEL = ("wq", "wk", "wv", "w_gate", "w_up", "bq", "bk", "bv")
ROW_PARALLEL = ("wo", "w_down")
# routed experts' leaves: split by expert (axis 1 of the stack)
EXPERT_PARALLEL = ("experts_gate", "experts_up", "experts_down", "experts_gate_bias",
                   "experts_up_bias", "experts_down_bias")


def check_tp(arch: ModelArch, tp: int) -> None:
    """ValueError when the model's heads or MLP cannot be split over `tp` devices."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    N, K, I = arch.num_heads, arch.num_kv_heads, arch.intermediate_size
    if N % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide the {N} attention heads")
    if K % tp and tp % K:
        raise ValueError(f"tensor_parallel_size {tp} and the {K} KV heads: one must divide "
                         f"the other (KV heads are split, or each duplicated tp/K times)")
    if I % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide the MLP width {I}")
    if arch.num_experts % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide the {arch.num_experts} "
                         "experts (each device holds E/tp of them)")


def make_mesh(devices: Sequence[Any]) -> Mesh:
    """A one-axis "tp" mesh over `devices`, sharding by annotation (Auto axes; jax 0.10's
    make_mesh defaults to Explicit)."""
    return Mesh(np.asarray(devices), (TP,), axis_types=(jax.sharding.AxisType.Auto,))


def tp_arch(arch: ModelArch, tp: int) -> ModelArch:
    """The architecture as the sharded runner holds it: KV heads duplicated up to tp."""
    check_tp(arch, tp)
    return dataclasses.replace(arch, num_kv_heads=max(arch.num_kv_heads, tp))


def duplicate_kv_heads(params: dict, arch: ModelArch, tp: int) -> dict:
    """wk, wv (and bk, bv) with each KV head's columns repeated tp/K times (see the module
    docstring); the params unchanged when K >= tp."""
    K, D = arch.num_kv_heads, arch.head_dim
    if tp <= K:
        return params
    r = tp // K

    def rep(w: jax.Array) -> jax.Array:  # [..., K*D] -> [..., K*r*D], copies of a head adjacent
        lead = w.shape[:-1]
        return jnp.repeat(w.reshape(*lead, K, D), r, axis=-2).reshape(*lead, K * r * D)

    layers = dict(params["layers"])
    for name in ("wk", "wv", "bk", "bv"):
        if name in layers:
            layers[name] = rep(layers[name])
    return {**params, "layers": layers}


def _leaf_spec(path: tuple[Any, ...], leaf: Any, tp: int) -> P:
    names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    ndim = len(leaf.shape)
    if any(n in EXPERT_PARALLEL for n in names):
        # an array [L, E, ...] (names end at the leaf's name) or an experts QuantWeight's
        # blocks [L_f, E * n, row_bytes] (under "parts"; its layer indices stay whole)
        whole = names[-1] in EXPERT_PARALLEL or "parts" in names
        if whole and ndim >= 2 and leaf.shape[1] % tp == 0:
            return P(None, TP, *([None] * (ndim - 2)))
        return P()
    if any(n in COLUMN_PARALLEL for n in names) and leaf.shape[-1] % tp == 0:
        return P(*([None] * (ndim - 1)), TP)
    if any(n in ROW_PARALLEL for n in names) and ndim == 3 and leaf.shape[1] % tp == 0:
        return P(None, TP, None)
    if names == ["lm_head"] and leaf.shape[-1] % tp == 0:
        return P(None, TP)  # vocab-split head; replicated when the vocabulary does not divide
    return P()


def param_specs(params: dict, tp: int) -> Any:
    """The PartitionSpec of every params leaf (a pytree like params)."""
    return jax.tree_util.tree_map_with_path(lambda p, x: _leaf_spec(p, x, tp), params)


def cache_spec() -> P:
    return P(None, None, None, TP, None)  # [L, pages, P, K, D]: split by KV head


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a sharded runner's arrays live: the mesh and the NamedShardings of its jit."""

    mesh: Mesh
    params: Any  # pytree of NamedSharding, like params
    cache: NamedSharding
    replicated: NamedSharding

    @property
    def tp(self) -> int:
        return self.mesh.shape[TP]


def prepare(params: dict, arch: ModelArch, mesh: Mesh) -> tuple[dict, ModelArch, Placement]:
    """The params (KV heads duplicated when tp > K, a tied model's head as its own [H, V] copy
    so that it can be vocab-split), the runner's arch and the placement, for `mesh`."""
    tp = mesh.shape[TP]
    held = tp_arch(arch, tp)
    params = duplicate_kv_heads(params, arch, tp)
    if tp > 1 and "lm_head" not in params:
        params = {**params, "lm_head": jnp.array(params["embed"].T)}
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(params, tp))
    placement = Placement(mesh, shardings, NamedSharding(mesh, cache_spec()),
                          NamedSharding(mesh, P()))
    return params, held, placement


def with_params(placement: Placement, params: dict) -> Placement:
    """`placement` with the shardings of `params` (the same leaves, in the forms the runner
    runs them: an experts QuantWeight's kernel settings are part of its tree)."""
    shardings = jax.tree.map(lambda s: NamedSharding(placement.mesh, s),
                             param_specs(params, placement.tp))
    return dataclasses.replace(placement, params=shardings)


def place(tree: Any, shardings: Any) -> Any:
    """Host or device arrays onto the mesh. Built with make_array_from_callback so that it also
    works when the mesh spans several processes (each process passes the same values)."""

    def put(x: Any, s: NamedSharding) -> jax.Array:
        if jax.process_count() == 1:
            return jax.device_put(x, s)
        a = np.asarray(x)
        return jax.make_array_from_callback(a.shape, s, lambda idx: a[idx])

    return jax.tree.map(put, tree, shardings)


def replicated_like(tree: Any, sharding: NamedSharding) -> Any:
    return jax.tree.map(lambda _: sharding, tree)


def shard_attention(fn: Callable[..., jax.Array], mesh: Mesh) -> Callable[..., jax.Array]:
    """The attention function (reference or Pallas kernel, one signature) run on each device
    over its own heads: q [T, N/tp, D] against its cache [pages, P, K/tp, D], the metadata
    replicated. No collective: every head's attention is independent."""
    heads = P(None, TP, None)  # q and the output [T, N, D]
    cache = P(None, None, TP, None)  # [pages, P, K, D]

    def sharded(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sinks=None,
                **static):
        inner = functools.partial(fn, **static)
        args = [q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs]
        specs = [heads, cache, cache, P(), P(), P(), P()]
        if sinks is not None:  # gpt-oss's [N] sink logits: each device its own heads'
            inner = functools.partial(_with_sinks, inner)
            args.append(sinks)
            specs.append(P(TP))
        return jax.shard_map(inner, mesh=mesh, in_specs=tuple(specs), out_specs=heads,
                             check_vma=False)(*args)

    return sharded


def shard_experts(mesh: Mesh) -> Callable[..., jax.Array]:
    """model/moe.experts_mlp (its signature) run on each device over its own E/tp experts:
    the router whole (every device routes every token), a device's assignments to other
    devices' experts dropped, the float32 partial sums all-reduced, then rounded once."""
    tp = mesh.shape[TP]

    def experts(h: jax.Array, lp: dict, arch: ModelArch, act: Callable[..., jax.Array],
                num_valid: jax.Array | None = None) -> jax.Array:
        local = arch.num_experts // tp
        moe_leaves = {n: w for n, w in lp.items() if n in EXPERT_PARALLEL or
                      n in ("router", "router_bias")}
        # inside the layer scan: arrays [E, ...] (their layer's slice), QuantWeights the
        # whole stacks [L_f, E * n, row_bytes] with the layer index
        specs = {n: jax.tree_util.tree_map_with_path(
            lambda path, x, n=n: _in_scan_spec(n, path, x), w) for n, w in moe_leaves.items()}

        def per_device(h: jax.Array, leaves: dict, *valid: jax.Array) -> jax.Array:
            mine = {n: dataclasses.replace(w, experts=local)
                    if isinstance(w, QuantWeight) and n in EXPERT_PARALLEL else w
                    for n, w in leaves.items()}
            first = jax.lax.axis_index(TP) * local
            part = moe.experts_partial(h, mine, arch, act, valid[0] if valid else None,
                                       first, local)
            return jax.lax.psum(part, TP)

        args: tuple[Any, ...] = (h, moe_leaves) + (() if num_valid is None else (num_valid,))
        in_specs = (P(), specs) + (() if num_valid is None else (P(),))
        out = jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=P(),
                            check_vma=False)(*args)
        return out.astype(h.dtype)

    return experts


def _in_scan_spec(name: str, path: tuple[Any, ...], leaf: Any) -> P:
    if name not in EXPERT_PARALLEL:
        return P()
    names = [getattr(k, "name", None) for k in path]
    if not names:  # an array leaf [E, ...]
        return P(TP, *([None] * (len(leaf.shape) - 1)))
    if "parts" in names:  # a QuantWeight's blocks [L_f, E * n, row_bytes]
        return P(None, TP, None)
    return P()


def _with_sinks(fn: Callable[..., jax.Array], *args: jax.Array) -> jax.Array:
    return fn(*args[:-1], sinks=args[-1])


def engine_mesh(tp: int, devices: Sequence[Any] | None = None) -> Mesh | None:
    """The mesh one engine runs on: `devices` (a data-parallel replica's slice, or every device
    of a multi-host job), else the first `tp` devices; None for one default device."""
    if devices is None:
        if tp == 1:
            return None
        if len(jax.devices()) < tp:
            raise ValueError(f"tensor_parallel_size {tp} needs {tp} devices; "
                             f"{len(jax.devices())} are visible ({jax.default_backend()})")
        devices = jax.devices()[:tp]
    if len(devices) != tp:
        raise ValueError(f"tensor_parallel_size {tp} with {len(devices)} devices")
    return make_mesh(devices)


def measure_all_reduce_gbps(mesh: Mesh, hidden: int, tokens: int = 512, repeats: int = 5
                            ) -> float:
    """The mesh's all-reduce rate in GB/s of bus traffic per device (ring: 2 (tp-1)/tp of the
    array), on an f32 [tokens, hidden] array like the step's: what the planner's analytic cost
    prices the collectives with. Every process of a multi-host mesh must call it (it runs a
    collective)."""
    import time

    tp = mesh.shape[TP]
    x = jax.jit(lambda: jnp.ones((tp * tokens, hidden), jnp.float32),
                out_shardings=NamedSharding(mesh, P(TP, None)))()
    reduce = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, TP), mesh=mesh,
                                   in_specs=P(TP, None), out_specs=P()))
    reduce(x).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        reduce(x).block_until_ready()
        times.append(time.perf_counter() - t)
    moved = 2.0 * (tp - 1) / tp * tokens * hidden * 4
    return moved / float(np.median(times)) / 1e9


def collective_gbps(configured: float | None, placement: Placement | None, hidden: int
                    ) -> float | None:
    """The collective rate the planner prices with: the configured one, else measured on the
    engine's mesh when it is tensor parallel, else None (no collectives)."""
    if configured is not None or placement is None or placement.tp == 1:
        return configured
    gbps = measure_all_reduce_gbps(placement.mesh, hidden)
    import logging

    logging.getLogger("jaxbatch").info("all-reduce over tp=%d: %.2f GB/s per device (measured)",
                                       placement.tp, gbps)
    return gbps
