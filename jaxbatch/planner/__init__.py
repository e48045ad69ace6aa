"""The padding planner, host only (numpy; never imports jax, directly or transitively).

Which step shapes (buckets) to compile, and how each scheduled batch runs in them:
  buckets.py   Bucket, SubStep and the geometric / fixed bucket sets (pow2, linear:STEP, fixed)
  cost.py      step cost models c(T, S): analytic from the model's dimensions, fitted, measured
  select.py    the bucket set for a histogram of step shapes (DP) or a workload (dp), and
               build_planner, the factory for every spec
  step.py      StepPlanner: fit / plan (pad, trim, split) / calibrate / predict
  simulate.py  a workload through the real scheduler with fake model outputs
  trace.py     StepRecord (one executed sub-step) and the engine's StepTrace
  compare.py   `jaxbatch plan`: planners side by side on a workload or a trace

The engine calls `make_planner(config, arch)` once, compiles `planner.buckets`, then
`planner.calibrate(runner.time_bucket)`, and per step `planner.plan(batch)` and
`planner.predict(bucket)`.
"""

from __future__ import annotations

import logging

from jaxbatch.config import EngineConfig
from jaxbatch.planner.buckets import Bucket, SubStep
from jaxbatch.planner.cost import ArchDims, ModelDims, analytic_cost, hardware
from jaxbatch.planner.select import build_planner, workload_source
from jaxbatch.planner.simulate import Lengths, default_workload
from jaxbatch.planner.step import StepPlanner
from jaxbatch.planner.trace import StepRecord, StepTrace

__all__ = ["Bucket", "StepPlanner", "StepRecord", "StepTrace", "SubStep", "make_planner"]

log = logging.getLogger("jaxbatch")


def make_planner(config: EngineConfig, arch: ArchDims, collective_gbps: float | None = None
                 ) -> StepPlanner:
    """The engine's planner for `config` (planner, max_compiled_shapes, planner_workload, the
    scheduler's limits, page size), pricing steps with the loaded model's dimensions (`arch`:
    model.arch.ModelArch, whatever format the weights came from) split over
    tensor_parallel_size devices, the collectives at `collective_gbps` (measured on the mesh;
    config.planner.collective_gbps when given). `config.model.max_model_len`
    must be resolved (Engine.from_config does it). ValueError for a bucket set that cannot hold
    the scheduler's largest step."""
    max_model_len = config.model.max_model_len
    if max_model_len is None:
        raise ValueError("make_planner needs a resolved max_model_len (Engine.from_config)")
    cost = analytic_cost(ModelDims.from_arch(arch), config.model.dtype,
                         hardware(config.planner.collective_gbps or collective_gbps),
                         tp=config.runner.tensor_parallel_size)
    lengths: Lengths = []
    hist = None
    if config.planner.planner == "dp":
        source = config.planner.planner_workload
        lengths, hist = workload_source(source) if source else (default_workload(), None)
    planner, sel = build_planner(
        config.planner.planner, config.scheduler, cost, config.planner.max_compiled_shapes,
        max_model_len=max_model_len, page_size=config.cache.page_size,
        num_pages=config.cache.num_pages, lengths=lengths, hist=hist)
    gap = f" (expected cost within {100 * (sel.gap - 1):.2f}% of optimal)" if sel else ""
    log.info("%s planner: %d buckets %s%s; %s", planner.name, len(planner.buckets),
             " ".join(f"{t}x{s}" for t, s in planner.buckets), gap, cost.describe())
    return planner
