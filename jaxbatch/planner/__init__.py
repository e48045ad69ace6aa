"""The padding planner, host only (numpy; never imports jax)."""

from __future__ import annotations

from typing import Any

from jaxbatch.planner.buckets import make_planner as _make


def make_planner(config: Any, arch: Any) -> Any:
    from jaxbatch.planner.cost import ModelDims, analytic_cost

    dims = ModelDims(arch.hidden_size, arch.intermediate_size, arch.num_layers, arch.num_heads,
                     arch.num_kv_heads, arch.head_dim, arch.vocab_size, arch.tie_word_embeddings)
    sc = config.scheduler
    kw = {}
    if config.planner.planner == "dp":
        kw = {"max_shapes": config.planner.max_compiled_shapes, "config": config,
              "cost": analytic_cost(dims, config.model.dtype)}
    return _make(config.planner.planner, sc.max_num_batched_tokens, sc.max_num_seqs, **kw)


StepPlanner = Any
