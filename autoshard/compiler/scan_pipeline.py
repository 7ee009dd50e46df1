"""Pipelines over a scanned layer stack: the scan's iterations are the layers, each stage scans its own range.

``plan_pipeline`` hands a step here when its loss runs a layer stack under ``lax.scan`` / ``nnx.scan`` /
``nn.scan`` (``ir/scan_stack.find_stack``). Nothing to mark: the usual ``autoshard.value_and_grad`` and
``num_stages`` / ``autoshard plan --stages N`` are enough.

- **Pricing**: the step is rewritten with the stack cut into its N iterations (``split_stack`` at bounds
  ``0, 1, ..., N``, each a one-iteration ``scan`` over its own slices of the stacked parameters), and a
  cut marked after every iteration but the last, so the layers are: the ops before the scan with
  iteration 0, iterations 1 .. N-2, iteration N-1 with the ops after it. The middle iterations have one
  structure hash: the intra-op ILP solves the scan body once per (sub-mesh, logical mesh, microbatch)
  and every range reuses it (``passes/stage_costs.py``). The stage DP is unchanged.
- **Runtime**: the step traced at the microbatch is rewritten again with one chunk per stage (the
  iteration range of its layers): stage s runs a ``scan`` over its own ``[lo, hi)`` (a loop, not
  unrolled), holds only those rows of every stacked parameter, gradient accumulator and optimizer
  state (Adam's moments are split with them when the update reads them row-wise), and updates them.
  :class:`ScanPipelineStep` slices the user's stacked arrays before each step and concatenates the
  stacked outputs (parameters, optimizer state) after it on the first stage's devices, so the step
  returns what the user's step returns.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from autoshard.compiler.driver import Progress
from autoshard.compiler.pipeline_pricing import (PipelinePlanned, finish_pipeline, price_pipeline, spmd_or_stages,
                                                 stage_cost_options)
from autoshard.compiler.target import Target
from autoshard.errors import PlanningError
from autoshard.ir.graph import OpGraph
from autoshard.ir.scan_stack import ScanStack
from autoshard.ir.split import StepParts, batch_inputs
from autoshard.ir.trace import trace
from autoshard.passes.intra_op import IntraOpOptions
from autoshard.passes.layers import cluster_layers
from autoshard.runtime.pipeline import PipelineStep
from autoshard.runtime.scan_stages import per_layer, scanned_step, stacked_args, stacked_function, stage_bounds


def plan_scanned(fn: Callable[..., Any], args: Sequence[Any], graph: OpGraph, parts: StepParts, stack: ScanStack,
                 target: Target, timings: dict[str, float], *, name: str, num_stages: int | None,
                 num_microbatches: int | None, schedule: str, options: IntraOpOptions | None,
                 num_layers: int | None, keep_both: bool, progress: Progress | None) -> Any:
    """``plan_pipeline`` for a step with a scanned layer stack (module docstring)."""
    say = progress or (lambda _line: None)
    if schedule not in ("1f1b", "gpipe"):
        raise PlanningError(f"schedule must be '1f1b' or 'gpipe'; got {schedule!r}")
    if num_stages is not None and num_stages > stack.length + 1:
        raise PlanningError(f"num_stages={num_stages} but the layer scan has only {stack.length} iterations; a "
                            "scanned stack is cut between iterations: ask for at most "
                            f"{stack.length} stages")
    t0 = time.perf_counter()
    pricing = per_layer(parts)
    layers = cluster_layers(pricing.parts.forward, num_layers)
    timings["layers"] = time.perf_counter() - t0
    say(f"pricing pipeline stages ({len(layers)} layers, {stack.length} of them scanned)")
    t0 = time.perf_counter()
    cost_options = stage_cost_options(schedule, num_stages, num_microbatches, target, options)
    priced, programs = price_pipeline(fn, args, graph, pricing.parts, layers, cost_options, target.cluster,
                                      target.num_devices, progress=say, prepare=lambda p: per_layer(p).parts)
    timings["pricing"] = time.perf_counter() - t0
    spmd, stage_plan = spmd_or_stages(graph, priced, target, options, timings, name=name, num_stages=num_stages,
                                      keep_both=keep_both, progress=progress)
    if stage_plan is None:
        return spmd
    in_leaves = jax.tree_util.tree_leaves(tuple(args))
    vfn = stacked_function(fn, graph.in_tree, graph.out_tree, pricing)
    vargs = stacked_args(in_leaves, graph.in_tree, pricing)
    vgraph = trace(vfn, *vargs)
    piped = finish_pipeline(vfn, vargs, vgraph, pricing.parts, layers, stage_plan, priced, programs, target,
                            timings, name, spmd)
    _, user_split = batch_inputs(parts)
    plan = piped.plan
    piped = dataclasses.replace(piped, plan=dataclasses.replace(
        plan, pipeline=dataclasses.replace(plan.pipeline, scan_layers=stack.length)))
    scanned = ScanPipelinePlanned(**{f.name: getattr(piped, f.name) for f in dataclasses.fields(piped)},
                                  user_fn=fn, user_arg_leaves=tuple(in_leaves), user_in_tree=graph.in_tree,
                                  user_out_tree=graph.out_tree, user_split=user_split, stack_length=stack.length,
                                  stage_iterations=tuple(stage_bounds(pricing, [layer.eqns for layer in layers], [
                                      (st.first_layer, st.last_layer) for st in stage_plan.stages])))
    return (scanned, spmd) if keep_both else scanned


@dataclass(frozen=True, eq=False)
class ScanPipelinePlanned(PipelinePlanned):
    """A pipeline plan over a scanned stack: the plan and layouts are over the per-iteration rewrite; the runtime
    runs one scan per stage (module docstring)."""

    user_fn: Callable[..., Any] = None  # type: ignore[assignment]
    user_arg_leaves: tuple[Any, ...] = ()
    user_in_tree: Any = None
    user_out_tree: Any = None
    user_split: tuple[bool, ...] = ()
    stack_length: int = 0
    stage_iterations: tuple[tuple[int, int] | None, ...] = ()  # per stage: the scan iterations [lo, hi) it runs

    def runtime(self, devices: Sequence[jax.Device] | None = None, **step_options: Any) -> PipelineStep:
        return scanned_step(self.user_fn, self.user_in_tree, self.user_arg_leaves, self.user_split,
                            self.stack_length, [layer.eqns for layer in self.layers], self.layouts,
                            self.stage_plan.num_microbatches, self.stage_plan.schedule, devices, **step_options)
