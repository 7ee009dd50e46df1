"""What the pipeline driver (``compiler/pipeline_driver.py``) and the scanned-stack pipeline
(``compiler/scan_pipeline.py``) share: pricing every stage variant with the intra-op pass, and turning a
chosen stage plan into a ``PipelinePlanned`` (its layouts, its Plan, its runtime)."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from autoshard.compiler.driver import PlannedStep, Progress, plan_on
from autoshard.compiler.target import Target
from autoshard.errors import InfeasibleMemoryError
from autoshard.ir.graph import OpGraph, Role, same_structure
from autoshard.ir.split import StepParts, batch_inputs, microbatch_shapes, split_step
from autoshard.ir.trace import trace, trace_jaxpr
from autoshard.meshes.cluster import ClusterSpec
from autoshard.passes.hbm_traffic import graph_costs
from autoshard.passes.inter_op import place_stages
from autoshard.passes.stage_costs import PricedStages, StageCostOptions, price_stage_variants
from autoshard.passes.layers import Layer
from autoshard.passes.intra_op import IntraOpOptions
from autoshard.passes.stages import StageInfeasibleError, StagePlan, solve_stages
from autoshard.plans.plan import Plan
from autoshard.compiler.pipeline_plan import build_pipeline_plan, stage_layout
from autoshard.compiler.stage_graphs import layer_graphs
from autoshard.runtime.pipeline import PipelineError, PipelineStep, StageLayout, StageProgram

log = logging.getLogger(__name__)

STAGE_TIME_LIMIT_S = 0.05  # CP-SAT seconds per layer solve when pricing stages (the greedy starts and local search run first)


def microbatch_ratios(global_batch: int, most: int = 8) -> list[int]:
    """Candidates for r, the second microbatch count each layer is solved at (beside B = 1), best first:
    divisors of the batch up to ``most`` that leave at least 2 samples per microbatch (a batch of 1 often
    traces to other equations). The first at which the step traces to the same equations is used."""
    return [r for r in range(min(most, global_batch // 2), 1, -1) if global_batch % r == 0]


@dataclass(frozen=True, eq=False)
class PipelinePlanned:
    """A chosen pipeline plan and what the runtime needs to build it."""

    plan: Plan
    fn: Callable[..., Any]
    arg_leaves: tuple[Any, ...]  # flat step inputs (ShapeDtypeStructs or arrays)
    graph: OpGraph  # the step traced at the full batch
    parts: StepParts  # split from it
    layers: tuple[Layer, ...]
    stage_plan: StagePlan
    layouts: tuple[StageLayout, ...]
    split_inputs: tuple[bool, ...]
    in_tree: Any
    out_tree: Any
    out_paths: tuple[str, ...]
    priced: PricedStages

    def runtime(self, devices: Sequence[jax.Device] | None = None, **step_options: Any) -> PipelineStep:
        """Trace the step at one microbatch and build the stage executables (``step_options``: PipelineStep's
        ``recompute``, ``compiler_options``)."""
        big_b = self.stage_plan.num_microbatches
        small = trace_at(self.fn, self.in_tree, microbatch_shapes(self.arg_leaves, self.split_inputs, big_b))
        parts = split_step(small.jaxpr) if same_structure(self.graph, small) else None
        if parts is None:
            raise PipelineError(f"the loss traces to different equations at the microbatch size "
                                f"(batch / {big_b}); a pipeline needs shape-independent loss code")
        return PipelineStep(parts, [layer.eqns for layer in self.layers], self.layouts, big_b, self.stage_plan.schedule,
                            split_inputs=self.split_inputs, in_tree=self.in_tree, out_tree=self.out_tree,
                            out_paths=self.out_paths, devices=devices, **step_options)



def finish_pipeline(fn: Callable[..., Any], args: Sequence[Any], graph: OpGraph, parts: StepParts,
                    layers: Sequence[Layer], stage_plan: StagePlan, priced: PricedStages,
                    programs: Sequence[StageProgram], target: Target, timings: dict[str, float], name: str,
                    spmd: PlannedStep | None) -> PipelinePlanned:
    """Place the chosen stages on devices, lay each out as its intra-op plan says, and write the Plan."""
    placed = place_stages(stage_plan, target.cluster, target.num_devices)
    pool = target.device_indices
    if pool is not None:
        placed = [tuple(pool[i] for i in devs) for devs in placed]
    _, split = batch_inputs(parts)
    layouts = tuple(stage_layout(graph, parts, programs, priced, st, devs)
                    for st, devs in zip(stage_plan.stages, placed))
    plan = build_pipeline_plan(graph, parts, layers, stage_plan, layouts, priced, target.cluster,
                               target.memory_budget_bytes, timings, name, spmd, split, programs)
    log.info("%s", plan)
    return PipelinePlanned(plan, fn, tuple(jax.tree_util.tree_leaves(tuple(args))), graph, parts, tuple(layers),
                           stage_plan, layouts, split, graph.in_tree, graph.out_tree, graph.output_paths, priced)


def price_pipeline(fn: Callable[..., Any], args: Sequence[Any], graph: OpGraph, parts: StepParts,
                   layers: Sequence[Layer], cost_options: StageCostOptions, cluster: ClusterSpec, num_devices: int,
                   progress: Progress | None = None,
                   prepare: Callable[[StepParts], StepParts] | None = None) -> tuple[PricedStages, list[StageProgram]]:
    """Every stage variant priced by the intra-op pass (``passes/stage_costs.py``): each distinct layer's train
    graph at B = 1 and at B = r (only at B when ``cost_options.num_microbatches`` forces it), solved per
    logical mesh; also each layer's one-layer program (the leaves its graph's inputs stand for). ``prepare``
    rewrites the step traced at the microbatch as ``parts`` was (a scanned stack cut into its layers)."""
    global_batch, split = batch_inputs(parts)
    by_role = graph.bytes_by_role()
    opt_ratio = by_role.get(Role.OPT_STATE, 0) / max(by_role.get(Role.PARAM, 0), 1)
    in_leaves = jax.tree_util.tree_leaves(tuple(args))
    num_microbatches = cost_options.num_microbatches
    forced = num_microbatches is not None and num_microbatches > 1 and global_batch % num_microbatches == 0
    big, programs = layer_graphs(parts, layers)
    ratio, small = 1, big
    for r in [num_microbatches] if forced else microbatch_ratios(global_batch):
        small_graph = trace_at(fn, graph.in_tree, microbatch_shapes(in_leaves, split, r))
        small_parts = split_step(small_graph.jaxpr) if same_structure(graph, small_graph) else None
        if small_parts is not None and prepare is not None:
            small_parts = prepare(small_parts)
        if small_parts is not None:
            ratio, small = r, layer_graphs(small_parts, layers)[0]
            break
        log.info("the step traces differently at batch / %d; trying a larger microbatch", r)
    if forced and ratio == num_microbatches:
        big = small  # B is fixed: each layer is solved at that microbatch only
    apply_s = leaf_apply_s(parts, cluster)
    priced = price_stage_variants(
        list(zip(big, small)), [[apply_s[k] for k in prog.param_leaves] for prog in programs],
        [layer.out_bytes for layer in layers], ratio, cluster, num_devices, global_batch, opt_ratio, cost_options,
        progress=progress)
    return priced, programs


def trace_at(fn: Callable[..., Any], in_tree: Any, leaves: Sequence[Any]) -> OpGraph:
    """The step traced at other shapes (its flat input leaves as ShapeDtypeStructs)."""
    return trace(fn, *jax.tree_util.tree_unflatten(in_tree, list(leaves)))


def leaf_apply_s(parts: StepParts, cluster: ClusterSpec) -> list[float]:
    """Per loss-argument leaf: seconds of the optimizer ops that read its gradient (per-op rooflines of the
    fused traffic, the intra-op pass's compute model, replicated as in data parallelism); ops reading none
    are not counted."""
    graph = trace_jaxpr(jax.extend.core.ClosedJaxpr(parts.update, []))
    first = parts.num_consts + parts.num_inputs + 1
    deps: dict[int, int] = {v: 1 << (k - first) for k, v in enumerate(graph.inputs) if k >= first}
    cost = [0.0] * len(parts.forward.invars)
    seconds = graph_costs(graph, cluster).seconds(cluster)
    for t, op in enumerate(graph.ops):
        mask = 0
        for v in op.inputs:
            mask |= deps.get(v, 0)
        for v in op.outputs:
            deps[v] = mask
        owners = [g for g in range(parts.num_grads) if mask >> g & 1]
        if owners:
            for g in owners:
                cost[parts.grad_for_leaf[g]] += float(seconds[t]) / len(owners)
    return cost


def stage_cost_options(schedule: str, num_stages: int | None, num_microbatches: int | None, target: Target,
                       options: IntraOpOptions | None) -> StageCostOptions:
    """How stage variants are priced: the user's schedule, stage and microbatch counts and budget; at least two
    stages when the count is searched (one stage is the SPMD plan, planned beside)."""
    return StageCostOptions(
        schedule=schedule, num_stages=num_stages, num_microbatches=num_microbatches,
        memory_budget_bytes=target.memory_budget_bytes, min_stages=2 if num_stages is None else 1,
        time_limit_s=min(STAGE_TIME_LIMIT_S, (options or IntraOpOptions()).time_limit_s))


def spmd_or_stages(graph: OpGraph, priced: PricedStages, target: Target, options: IntraOpOptions | None,
                   timings: dict[str, float], *, name: str, num_stages: int | None, keep_both: bool,
                   progress: Progress | None) -> tuple[PlannedStep | None, StagePlan | None]:
    """The SPMD plan (planned beside when the stage count is searched; None when none fits) and the stage DP's
    choice. The stage plan is None when the SPMD plan is the answer: no stages fit, or SPMD is at least as fast
    and ``keep_both`` is not asked."""
    say = progress or (lambda _line: None)
    spmd: PlannedStep | None = None
    if num_stages is None:
        t0 = time.perf_counter()
        try:
            spmd = plan_on(graph, target, options, timings=dict(timings), name=name, progress=progress)
        except InfeasibleMemoryError as err:
            log.info("no SPMD plan fits (%s); pipelines only", err)
        timings["spmd"] = time.perf_counter() - t0
    say("choosing pipeline stages")
    t0 = time.perf_counter()
    try:
        stage_plan = solve_stages(priced.problem)
    except StageInfeasibleError:
        if spmd is not None:
            return spmd, None
        raise
    timings["stage-dp"] = time.perf_counter() - t0
    if spmd is not None and spmd.plan.step_s <= stage_plan.step_time_s:
        log.info("SPMD %.4gs beats the best pipeline %s", spmd.plan.step_s, stage_plan)
        if not keep_both:
            return spmd, None
    return spmd, stage_plan
