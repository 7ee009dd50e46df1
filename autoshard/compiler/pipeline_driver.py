"""The pipeline driver: trace, take the step apart, cluster layers, price, solve the stage DP, build the Plan.

``plan_pipeline`` is what ``@autoshard`` and ``autoshard.plan`` call unless ``num_stages == 1``. It
returns a :class:`PipelineSearch` (``compiler/pipeline_context.py``) whose ``chosen`` plan is the pipeline,
or the SPMD ``PlannedStep`` when

- the step has no ``autoshard.value_and_grad`` / ``grad`` marker (plain ``jax.grad``: one SPMD stage), or a
  mesh was forced with ``num_stages=None``;
- ``num_stages=None`` and the best SPMD-only plan (the intra-op planner over every logical mesh shape) is at
  least as fast, under the model, as the best plan of two or more stages.

The step is traced once at its full batch and once at a microbatch (``ir/step_trace.py``); every phase
reads the one ``PipelineContext`` built from those traces.

A loss that runs its layers under ``lax.scan`` / ``nnx.scan`` / ``nn.scan`` (a scanned stack,
``ir/scan_stack.py``) needs nothing else: the scan's iterations are the layers.

- **Pricing**: the step is rewritten with the stack cut into its N iterations (``split_stack`` at bounds
  ``0, 1, ..., N``, each a one-iteration ``scan`` over its own slices of the stacked parameters), and a cut
  marked after every iteration but the last, so the layers are: the ops before the scan with iteration 0,
  iterations 1 .. N-2, iteration N-1 with the ops after it. The middle iterations have one structure hash:
  the intra-op ILP solves the scan body once per (sub-mesh, logical mesh, microbatch) and every range
  reuses it (``passes/stage_costs.py``). The stage DP is unchanged.
- **The plan** is over that rewrite (its paths name each stacked leaf's iterations:
  ``[0]['blocks']['mlp']['kernel'][2]``) and says how many iterations the stack has
  (``PipelinePlan.scan_layers``).
- **Runtime** (``runtime/scan_stages.py``): the step at the microbatch is rewritten again with one chunk
  per stage (the iteration range of its layers): stage s runs a ``scan`` over its own ``[lo, hi)`` (a
  loop, not unrolled), holds only those rows of every stacked parameter, gradient accumulator and
  optimizer state, and updates them; the user passes and gets back the stacked arrays.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from autoshard.compiler.collector import without_collector
from autoshard.compiler.driver import explained, plan_on
from autoshard.compiler.pipeline_context import PipelineRequest, PipelineSearch, pipeline_context
from autoshard.compiler.pipeline_pricing import finish_pipeline, price_pipeline, spmd_or_stages, stage_cost_options
from autoshard.compiler.target import check_budget_floor, resolve_target
from autoshard.errors import MicrobatchTraceError, PlanningError
from autoshard.ir.split import split_step
from autoshard.ir.trace import trace

log = logging.getLogger(__name__)


@without_collector
def plan_pipeline(fn: Callable[..., Any], args: Sequence[Any],
                  request: PipelineRequest = PipelineRequest()) -> PipelineSearch:
    """Plan ``fn(*args)`` as a pipeline, or fall back to SPMD (module docstring)."""
    name = request.name or getattr(fn, "__name__", "autoshard")
    request.say("tracing")
    timings: dict[str, float] = {}
    start = time.perf_counter()
    graph = trace(fn, *args)
    parts = split_step(graph.jaxpr)
    timings["trace"] = time.perf_counter() - start
    target = resolve_target(request.mesh, request.cluster, request.memory_budget, num_devices=request.num_devices)
    check_budget_floor(graph, target)
    if parts is None or (request.num_stages is None and request.mesh is not None):
        if parts is None and request.num_stages not in (None, 1):
            raise PlanningError(f"num_stages={request.num_stages} needs the step to compute its gradients with "
                                "autoshard.value_and_grad or autoshard.grad (plain jax.grad plans as one SPMD stage)")
        return PipelineSearch(plan_on(graph, target, request.options, timings=timings, name=name,
                                      progress=request.progress), None)
    ctx = pipeline_context(fn, args, request, graph, parts, target, timings)
    scanned = f", {ctx.stack.length} of them scanned" if ctx.stack is not None else ""
    request.say(f"pricing pipeline stages ({len(ctx.layers)} layers{scanned})")
    t0 = time.perf_counter()
    try:
        priced = price_pipeline(ctx, stage_cost_options(ctx))
    except MicrobatchTraceError as err:
        if request.num_stages is not None:
            raise
        # stages were searched, not asked for: a step that cannot be cut into microbatches plans as SPMD
        log.info("no pipeline: %s", err)
        request.say("the step does not trace at a microbatch: one SPMD stage")
        return PipelineSearch(plan_on(graph, target, request.options, timings=timings, name=name,
                                      progress=request.progress), None)
    timings["pricing"] = time.perf_counter() - t0
    log.info("priced %d stage variants with %d layer solves", len(priced.stages.variants), priced.stages.num_solves)
    spmd, stage_plan, spmd_bound = spmd_or_stages(ctx, priced)  # the SPMD plan weighed without its explanations
    if stage_plan is None:
        return PipelineSearch(explained(spmd) if spmd is not None else None, None)
    found = PipelineSearch(spmd, finish_pipeline(ctx, priced, stage_plan, spmd, spmd_bound_s=spmd_bound))
    if spmd is not None and found.chosen is spmd:
        found = PipelineSearch(explained(spmd), found.pipeline)
    return found
