"""The pipeline driver: trace, take the step apart, cluster layers, price, solve the stage DP, build the Plan.

``plan_pipeline`` is what ``@autoshard`` and ``autoshard.plan`` call unless
``num_stages == 1``. It returns a :class:`PipelinePlanned` when a pipeline
is chosen, or the SPMD ``PlannedStep`` when

- the step has no ``autoshard.value_and_grad`` / ``grad`` marker (plain
  ``jax.grad``: one SPMD stage), or a mesh was forced with ``num_stages=None``;
- ``num_stages=None`` and the best SPMD-only plan (the intra-op planner over
  every logical mesh shape) is at least as fast, under the model, as the best
  plan of two or more stages.

A loss that runs its layers under ``lax.scan`` / ``nnx.scan`` (a scanned stack, ``ir/scan_stack.py``) is
planned by ``compiler/scan_pipeline.py``: the scan's iterations are the layers.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from autoshard.compiler.driver import PlannedStep, Progress, plan_on
from autoshard.compiler.target import ClusterLike, MeshLike, resolve_target
from autoshard.errors import PlanningError
from autoshard.ir.scan_stack import find_stack
from autoshard.ir.split import split_step
from autoshard.ir.trace import trace
from autoshard.passes.intra_op import IntraOpOptions
from autoshard.passes.layers import cluster_layers

from autoshard.compiler.pipeline_pricing import (  # noqa: F401  (re-exported: callers import them from here)
    STAGE_TIME_LIMIT_S, PipelinePlanned, finish_pipeline, leaf_apply_s, microbatch_ratios, price_pipeline, spmd_or_stages,
    stage_cost_options, trace_at)
from autoshard.compiler.scan_pipeline import plan_scanned

log = logging.getLogger(__name__)


def plan_pipeline(fn: Callable[..., Any], args: Sequence[Any], *, mesh: MeshLike = None,
                  cluster: ClusterLike = None, memory_budget: float | None = None,
                  num_stages: int | None = None, num_microbatches: int | None = None, schedule: str = "1f1b",
                  options: IntraOpOptions | None = None, num_layers: int | None = None,
                  num_devices: int | None = None, name: str | None = None,
                  keep_both: bool = False, progress: Progress | None = None) -> PipelinePlanned | PlannedStep | Any:
    """Plan ``fn(*args)`` as a pipeline, or fall back to SPMD (module docstring).

    ``keep_both`` (with ``num_stages=None``): return ``(best pipeline of >= 2 stages, best SPMD plan)``
    whichever wins, for comparisons (``benchmarks/pipeline_vs_spmd.py``).

    ``num_devices`` plans for that many devices instead of those present (planning only: the
    result's runtime needs them); ``num_layers`` overrides the layer count L of the clustering.
    ``progress`` is told a short line as each long phase starts (tracing, pricing, each solve).
    """
    name = name or getattr(fn, "__name__", "autoshard")
    say = progress or (lambda _line: None)
    say("tracing")
    timings: dict[str, float] = {}
    start = time.perf_counter()
    graph = trace(fn, *args)
    parts = split_step(graph.jaxpr)
    timings["trace"] = time.perf_counter() - start
    target = resolve_target(mesh, cluster, memory_budget, num_devices=num_devices)
    if parts is None:
        if num_stages not in (None, 1):
            raise PlanningError(f"num_stages={num_stages} needs the step to compute its gradients with "
                                "autoshard.value_and_grad or autoshard.grad (plain jax.grad plans as one SPMD stage)")
        return plan_on(graph, target, options, timings=timings, name=name, progress=progress)
    if num_stages is None and mesh is not None:
        return plan_on(graph, target, options, timings=timings, name=name, progress=progress)
    if schedule not in ("1f1b", "gpipe"):
        raise PlanningError(f"schedule must be '1f1b' or 'gpipe'; got {schedule!r}")
    num_devices, spec = target.num_devices, target.cluster

    stack = find_stack(parts.forward) if num_stages != 1 else None
    if stack is not None:  # a scanned layer stack: its iterations are the layers (compiler/scan_pipeline.py)
        return plan_scanned(fn, args, graph, parts, stack, target, timings, name=name, num_stages=num_stages,
                            num_microbatches=num_microbatches, schedule=schedule, options=options,
                            num_layers=num_layers, keep_both=keep_both, progress=progress)
    t0 = time.perf_counter()
    layers = cluster_layers(parts.forward, num_layers)
    timings["layers"] = time.perf_counter() - t0
    say(f"pricing pipeline stages ({len(layers)} layers)")
    t0 = time.perf_counter()
    cost_options = stage_cost_options(schedule, num_stages, num_microbatches, target, options)
    priced, programs = price_pipeline(fn, args, graph, parts, layers, cost_options, spec, num_devices, progress=say)
    timings["pricing"] = time.perf_counter() - t0
    log.info("priced %d stage variants with %d layer solves", len(priced.variants), priced.num_solves)
    spmd, stage_plan = spmd_or_stages(graph, priced, target, options, timings, name=name, num_stages=num_stages,
                                      keep_both=keep_both, progress=progress)
    if stage_plan is None:
        return spmd
    piped = finish_pipeline(fn, args, graph, parts, layers, stage_plan, priced, programs, target, timings, name, spmd)
    return (piped, spmd) if keep_both else piped


