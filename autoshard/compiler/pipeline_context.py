"""The pipeline driver's data: what was asked, the one context it plans in, and what it returns.

- :class:`PipelineRequest`: what a caller asks (the target, the stage and microbatch counts, the schedule);
- :class:`PipelineContext`: built once per plan by :func:`pipeline_context`: the request resolved (the
  Target), the step traced once at its full batch and once at a microbatch (``ir/step_trace.TracedStep``),
  its scanned stack if it has one, the split step the layers index (a scanned stack cut into its
  iterations), the layers and the layer solves made so far; every pricing and finishing function reads
  it rather than a dozen arguments;
- :class:`PipelinePlanned`: a chosen pipeline (its Plan, the stage layouts, the pricing) and its runtime,
  built from the Plan as ``autoshard.apply`` builds it, on the context's traces;
- :class:`PipelineSearch`: what ``plan_pipeline`` returns: the SPMD plan and the best pipeline, each when
  planned, and the chosen one.

A new model family needs nothing here: its layers come from ``passes/layers.py`` (or a scanned stack's
iterations); a new schedule is a name in ``plans/schedules.py``.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax

from autoshard.compiler.driver import PlannedStep, Progress
from autoshard.compiler.target import ClusterLike, MeshLike, Target
from autoshard.errors import PlanningError
from autoshard.ir.graph import OpGraph
from autoshard.ir.scan_stack import ScanStack, StackSplit, find_stack
from autoshard.ir.split import StepParts
from autoshard.ir.step_trace import TracedStep
from autoshard.passes.intra_op import IntraOpOptions
from autoshard.passes.layers import Layer, cluster_layers
from autoshard.passes.layer_solves import LayerSolves
from autoshard.passes.layer_cost import LayerCost
from autoshard.passes.stage_costs import PricedStages, StageCostOptions
from autoshard.passes.stages import StagePlan
from autoshard.plans.plan import Plan
from autoshard.plans.schedules import SCHEDULES, PipelineSchedule
from autoshard.runtime.applied_pipeline import AppliedPipeline
from autoshard.runtime.applied_scan import AppliedScanPipeline
from autoshard.runtime.pipeline import PipelineStep
from autoshard.runtime.scan_stages import StackedView, per_layer, stacked_view, stage_bounds
from autoshard.runtime.stage_layout import StageLayout, StepOptions


@dataclass(frozen=True)
class PipelineRequest:
    """What a caller asks of the pipeline driver; None: autoshard decides."""

    mesh: MeshLike = None  # a mesh: its devices (with num_stages None, SPMD on it: a given mesh is not cut)
    cluster: ClusterLike = None  # a preset, a file, a ClusterSpec; None: the devices present
    memory_budget: float | None = None  # bytes per device; None: the device memory
    num_devices: int | None = None  # plan for that many devices instead of those present (planning only)
    num_stages: int | None = None  # None: searched against SPMD (two or more); 1: SPMD only
    num_microbatches: int | None = None
    schedule: PipelineSchedule = "1f1b"
    num_layers: int | None = None  # the layer count L of the clustering (None: passes/layers.py decides)
    options: IntraOpOptions | None = None  # the intra-op solver's knobs
    name: str | None = None  # the plan's name (None: the function's)
    keep_both: bool = False  # with num_stages None: finish the best pipeline even when SPMD is faster
    progress: Progress | None = None  # told a short line as each long phase starts

    def say(self, line: str) -> None:
        if self.progress is not None:
            self.progress(line)


@dataclass(frozen=True, eq=False)
class PipelineContext:
    """One pipeline plan's inputs, built once (module docstring)."""

    request: PipelineRequest
    name: str
    target: Target
    traced: TracedStep  # the user's step, at the full batch and (on demand, once each) at microbatches
    stack: ScanStack | None  # its scanned layer stack, whose iterations are the layers
    stack_split: StackSplit | None  # the step cut into the stack's iterations (the parts the layers index)
    layers: tuple[Layer, ...]
    timings: dict[str, float]  # seconds per phase, written as the phases run
    # the layer solves every pricing in this context reads and adds to (``passes/layer_solves.py``)
    solves: LayerSolves[LayerCost] = field(default_factory=LayerSolves)

    @property
    def fn(self) -> Callable[..., Any]:
        return self.traced.fn

    @property
    def parts(self) -> StepParts:
        """The split step the layers index: the user's, or with its stack cut per iteration."""
        return self.stack_split.parts if self.stack_split is not None else self.traced.parts

    def microbatch_parts(self, count: int) -> StepParts | None:
        """``parts`` at batch / ``count`` (None: the step traces to other equations there); traced once."""
        small = self.traced.at_microbatches(count)
        if small is None or self.stack_split is None:
            return small
        return per_layer(small).parts

    def view(self) -> StepView:
        """The step as the plan reports it: the user's, or (a scanned stack) traced per iteration."""
        if self.stack_split is None:
            return StepView(self.traced.graph, self.traced.parts, None)
        stacked = stacked_view(self.traced, self.stack_split)
        return StepView(stacked.graph, stacked.split.parts, stacked)


@dataclass(frozen=True, eq=False)
class StepView:
    """The step a pipeline Plan reports: its graph (input and output paths) and split (the leaves the stage
    layouts key); for a scanned stack, the per-iteration rewrite (``stacked``)."""

    graph: OpGraph
    parts: StepParts
    stacked: StackedView | None


def pipeline_context(fn: Callable[..., Any], args: Sequence[Any], request: PipelineRequest, graph: OpGraph,
                     parts: StepParts, target: Target, timings: dict[str, float]) -> PipelineContext:
    """The context of a marked step traced at ``args`` (``graph``, split into ``parts``): its scanned stack
    (unless one stage is asked), the per-iteration cut of that stack, and the layers."""
    if request.schedule not in SCHEDULES:
        raise PlanningError(f"schedule must be one of {list(SCHEDULES)}; got {request.schedule!r}")
    stack = find_stack(parts.forward) if request.num_stages != 1 else None
    if stack is not None and request.num_stages is not None and request.num_stages > stack.length + 1:
        raise PlanningError(f"num_stages={request.num_stages} but the layer scan has only {stack.length} iterations; "
                            f"a scanned stack is cut between iterations: ask for at most {stack.length} stages")
    t0 = time.perf_counter()
    split = per_layer(parts) if stack is not None else None
    layers = cluster_layers((split.parts if split is not None else parts).forward, request.num_layers)
    timings["layers"] = time.perf_counter() - t0
    return PipelineContext(request, request.name or getattr(fn, "__name__", "autoshard"), target,
                           TracedStep.of(fn, args, graph, parts), stack, split, tuple(layers), timings)


@dataclass(frozen=True, eq=False)
class PricedPipeline:
    """Every stage variant priced (``passes/stage_costs.py``) and each layer's own one-layer program."""

    stages: PricedStages
    programs: tuple[Any, ...]  # per layer: its ir.stage_programs.StageProgram
    options: StageCostOptions  # how it was priced (the chosen stages are solved again under the same)
    leaf_update_s: tuple[tuple[float, ...], ...]  # per layer: the optimizer's seconds per parameter input


@dataclass(frozen=True, eq=False)
class PipelinePlanned:
    """A chosen pipeline plan, how it was made, and its runtime."""

    plan: Plan
    context: PipelineContext
    view: StepView  # the step the plan reports (a scanned stack: rewritten per iteration)
    stage_plan: StagePlan
    layouts: tuple[StageLayout, ...]  # per stage, as the planner laid it out (the plan records them)
    pricing: PricedPipeline

    @property
    def layers(self) -> tuple[Layer, ...]:
        return self.context.layers

    @property
    def priced(self) -> PricedStages:
        return self.pricing.stages

    @property
    def stage_iterations(self) -> tuple[tuple[int, int] | None, ...]:
        """A scanned stack's plan: per stage, the scan iterations ``[lo, hi)`` it runs (empty for another)."""
        if self.view.stacked is None:
            return ()
        return tuple(stage_bounds(self.view.stacked.split, [layer.eqns for layer in self.layers],
                                  [(st.first_layer, st.last_layer) for st in self.stage_plan.stages]))

    def runtime(self, devices: Sequence[jax.Device] | None = None,
                options: StepOptions = StepOptions()) -> PipelineStep:
        """The stage executables, built from the Plan as ``autoshard.apply`` builds them, on the traces planning
        made: the step is not traced again (a microbatch count not priced is extrapolated, ``ir/rescale.py``)."""
        devices = list(devices) if devices is not None else jax.devices()
        ctx = self.context
        if self.view.stacked is not None:
            return AppliedScanPipeline(self.plan, ctx.fn, devices, options=options, traced=ctx.traced,
                                       view=self.view.stacked).prepare()
        return AppliedPipeline(self.plan, ctx.fn, devices, options=options, traced=ctx.traced).prepare()


@dataclass(frozen=True, eq=False)
class PipelineSearch:
    """What ``plan_pipeline`` found: the SPMD plan (when it was planned: the stage count searched, or no
    pipeline possible) and the best pipeline (when one was chosen or ``keep_both`` asked for it)."""

    spmd: PlannedStep | None
    pipeline: PipelinePlanned | None

    @property
    def chosen(self) -> PlannedStep | PipelinePlanned:
        """The pipeline unless the SPMD plan is at least as fast under the model."""
        if self.pipeline is None:
            if self.spmd is None:
                raise PlanningError("internal: a pipeline search with neither plan")
            return self.spmd
        if self.spmd is not None and self.spmd.plan.step_s <= self.pipeline.stage_plan.step_time_s:
            return self.spmd
        return self.pipeline

    @property
    def plan(self) -> Plan:
        return self.chosen.plan
