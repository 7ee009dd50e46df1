"""What the pipeline driver (``compiler/pipeline_driver.py``) and its other users (uniform GPipe) share:
pricing every stage variant with the intra-op pass, choosing between SPMD and stages, and turning a chosen
stage plan into a ``PipelinePlanned`` (its layouts, its Plan, its runtime). Each reads one
``PipelineContext`` (``compiler/pipeline_context.py``)."""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace

import jax

from autoshard.compiler.driver import PlannedStep, plan_on
from autoshard.compiler.pipeline_context import PipelineContext, PipelinePlanned, PricedPipeline
from autoshard.compiler.pipeline_plan import build_pipeline_plan, stage_layout
from autoshard.errors import CutOffError, InfeasibleMemoryError
from autoshard.ir.batch_coupling import batch_statistics, warn_coupled
from autoshard.ir.graph import Role
from autoshard.ir.split import StepParts
from autoshard.ir.train_graph import layer_graphs
from autoshard.ir.trace import trace_jaxpr
from autoshard.meshes.cluster import ClusterSpec
from autoshard.passes.hbm_traffic import graph_costs
from autoshard.passes.inter_op import place_stages
from autoshard.passes.intra_op import IntraOpOptions
from autoshard.passes.stage_costs import StageCostOptions, at_chosen_microbatch, price_stage_variants
from autoshard.passes.interleave import solve_interleaved
from autoshard.passes.stages import StageInfeasibleError, StagePlan, StageProblem, solve_stages
from autoshard.plans.schedules import PipelineSchedule

log = logging.getLogger(__name__)

STAGE_TIME_LIMIT_S = 0.05  # CP-SAT seconds per layer solve when pricing stages (the greedy starts and local search run first)


def microbatch_ratios(global_batch: int, most: int = 8) -> list[int]:
    """Candidates for r, the second microbatch count each layer is solved at (beside B = 1), best first:
    divisors of the batch up to ``most`` that leave at least 2 samples per microbatch (a batch of 1 often
    traces to other equations). The first at which the step traces to the same equations is used."""
    return [r for r in range(min(most, global_batch // 2), 1, -1) if global_batch % r == 0]


def finish_pipeline(ctx: PipelineContext, priced: PricedPipeline, stage_plan: StagePlan,
                    spmd: PlannedStep | None, name: str | None = None,
                    spmd_bound_s: float | None = None) -> PipelinePlanned:
    """Place the chosen stages on devices, lay each out as its intra-op plan says, and write the Plan
    (named ``name``, by default the context's; ``spmd_bound_s``: the bound that showed no SPMD plan beats it)."""
    target = ctx.target
    placed = place_stages(stage_plan, target.cluster, target.num_devices)
    pool = target.device_indices
    if pool is not None:
        placed = [tuple(pool[i] for i in devs) for devs in placed]
    priced = at_runtime_microbatch(ctx, priced, stage_plan)
    view = ctx.view()
    layouts = tuple(stage_layout(view.graph, view.parts, priced.programs, priced.stages, st, devs,
                                 stage_plan.num_microbatches)
                    for st, devs in zip(stage_plan.stages, placed))
    plan = build_pipeline_plan(ctx, view, stage_plan, layouts, priced, spmd, name, spmd_bound_s)
    log.info("%s", plan)
    return PipelinePlanned(plan, ctx, view, stage_plan, layouts, priced)


def price_pipeline(ctx: PipelineContext, cost_options: StageCostOptions) -> PricedPipeline:
    """Every stage variant priced by the intra-op pass (``passes/stage_costs.py``): each distinct layer's train
    graph at B = 1 and at B = r (only at B when ``cost_options.num_microbatches`` forces it), solved per
    logical mesh; also each layer's one-layer program (the leaves its graph's inputs stand for). The step at
    B = r is the context's one microbatch trace."""
    parts, traced = ctx.parts, ctx.traced
    by_role = traced.graph.bytes_by_role()
    opt_ratio = by_role.get(Role.OPT_STATE, 0) / max(by_role.get(Role.PARAM, 0), 1)
    num_microbatches = cost_options.num_microbatches
    global_batch = traced.global_batch
    forced = num_microbatches is not None and num_microbatches > 1 and global_batch % num_microbatches == 0
    classes = [(layer.eqns, layer.structure) for layer in ctx.layers]
    big, programs = layer_graphs(parts.forward, classes)
    ratio, small = 1, big
    found = first_microbatch(ctx, [num_microbatches] if forced else microbatch_ratios(global_batch))
    if found is not None:
        ratio, small = found[0], layer_graphs(found[1].forward, classes)[0]
    if forced and ratio == num_microbatches:
        big = small  # B is fixed: each layer is solved at that microbatch only
    apply_s = leaf_apply_s(parts, ctx.target.cluster)
    update_s = tuple(tuple(apply_s[k] for k in prog.param_leaves) for prog in programs)
    priced = price_stage_variants(
        list(zip(big, small)), update_s,
        [layer.out_bytes for layer in ctx.layers], ratio, ctx.target.cluster, ctx.target.num_devices, global_batch,
        opt_ratio, cost_options, progress=ctx.request.progress, solves=ctx.solves)
    return PricedPipeline(priced, tuple(programs), cost_options, update_s)


def at_runtime_microbatch(ctx: PipelineContext, priced: PricedPipeline, stage_plan: StagePlan) -> PricedPipeline:
    """``priced`` with the chosen stages' layers planned at the chosen microbatch count, the one the runtime
    runs (``passes/stage_costs.at_chosen_microbatch``); the step at batch / B is the context's TracedStep's
    (extrapolated from its two traces, ``ir/rescale.py``), which the runtime reads too."""
    stages, b = priced.stages, stage_plan.num_microbatches
    if b == stages.ratio:
        return priced
    graphs = None
    if b > 1:
        small_parts = ctx.microbatch_parts(b)
        if small_parts is not None:
            graphs = layer_graphs(small_parts.forward, [(layer.eqns, layer.structure) for layer in ctx.layers])[0]
        else:
            log.info("the step traces differently at batch / %d; its stages keep the interpolated plans", b)
    chosen = at_chosen_microbatch(stages, stage_plan, graphs, priced.leaf_update_s, ctx.traced.global_batch,
                                  priced.options, ctx.solves)
    return replace(priced, stages=chosen)


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


def first_microbatch(ctx: PipelineContext, ratios: Sequence[int]) -> tuple[int, StepParts] | None:
    """The first of ``ratios`` at which the step traces to the same equations, and the step there (None: none)."""
    for r in ratios:
        small = ctx.microbatch_parts(r)
        if small is not None:
            return r, small
        log.info("the step traces differently at batch / %d; trying a larger microbatch", r)
    return None


def batch_coupling(ctx: PipelineContext) -> list[str]:
    """Where the loss uses a statistic over the batch per example (``ir/batch_coupling.py``), from the step at
    the microbatch ``price_pipeline`` reads."""
    found = first_microbatch(ctx, microbatch_ratios(ctx.traced.global_batch))
    return batch_statistics(ctx.parts.forward, found[1].forward) if found is not None else []


def stage_cost_options(ctx: PipelineContext) -> StageCostOptions:
    """How stage variants are priced: the user's schedule, stage and microbatch counts and budget; at least two
    stages when the count is searched (one stage is the SPMD plan, planned beside). A searched microbatch count
    is one when the loss couples its batch's examples (a batch statistic, such as BatchNorm's in training):
    more would give each microbatch its own statistic, another step than the user's; a count given above one
    warns (``MicrobatchCouplingWarning``) and is kept."""
    request = ctx.request
    num_microbatches = request.num_microbatches
    if num_microbatches is None or num_microbatches > 1:
        coupled = batch_coupling(ctx)
        if coupled and num_microbatches is None:
            log.info("the loss uses a statistic over its batch per example (at %s): one microbatch, so the step "
                     "keeps the whole batch's statistics", coupled[0])
            num_microbatches = 1
        elif coupled:
            warn_coupled(coupled, num_microbatches, stacklevel=2)
    return StageCostOptions(  # interleaving is searched beside the 1F1B DP, on its arrays (choose_stages)
        schedule="1f1b" if request.schedule == "interleaved" else request.schedule, num_stages=request.num_stages, num_microbatches=num_microbatches,
        memory_budget_bytes=ctx.target.memory_budget_bytes, min_stages=2 if request.num_stages is None else 1,
        time_limit_s=min(STAGE_TIME_LIMIT_S, (request.options or IntraOpOptions()).time_limit_s))


def spmd_or_stages(ctx: PipelineContext, priced: PricedPipeline
                   ) -> tuple[PlannedStep | None, StagePlan | None, float | None]:
    """The SPMD plan (planned beside when the stage count is searched; None when none fits or none can win), the
    stage DP's choice, and the bound that showed no SPMD plan beats it (None: not cut off). The stage plan is
    None when the SPMD plan is the answer: no stages fit, or SPMD is at least as fast and ``keep_both`` is not
    asked. The stages are chosen first: without ``keep_both`` the SPMD plan is wanted only if it beats them,
    so each mesh's solve is cut off once its ILP bound proves it cannot (``plan_on``'s ``cutoff_s``)."""
    request, timings = ctx.request, ctx.timings
    request.say("choosing pipeline stages")
    t0 = time.perf_counter()
    stage_plan: StagePlan | None = None
    no_stages: StageInfeasibleError | None = None
    try:
        stage_plan = choose_stages(priced.stages.problem, request.schedule)
    except StageInfeasibleError as err:
        if request.num_stages is not None:
            raise
        no_stages = err
    timings["stage-dp"] = time.perf_counter() - t0
    spmd: PlannedStep | None = None
    spmd_bound: float | None = None
    if request.num_stages is None:
        cutoff = stage_plan.step_time_s if stage_plan is not None and not request.keep_both else None
        t0 = time.perf_counter()
        try:
            spmd = plan_on(ctx.traced.graph, ctx.target, request.options, timings=dict(timings), name=ctx.name,
                           progress=request.progress, explain=False,  # explained if it is the answer (driver)
                           cutoff_s=cutoff)
        except InfeasibleMemoryError as err:
            log.info("no SPMD plan fits (%s); pipelines only", err)
        except CutOffError as err:
            log.info("no SPMD plan beats the best pipeline (%s)", err)
            spmd_bound = err.bound_s
        timings["spmd"] = time.perf_counter() - t0
    if stage_plan is None:
        if spmd is not None:
            return spmd, None, None
        assert no_stages is not None
        raise no_stages
    if spmd is not None and spmd.plan.step_s <= stage_plan.step_time_s:
        log.info("SPMD %.4gs beats the best pipeline %s", spmd.plan.step_s, stage_plan)
        if not request.keep_both:
            return spmd, None, None
    return spmd, stage_plan, spmd_bound


def choose_stages(problem: StageProblem, schedule: PipelineSchedule) -> StagePlan:
    """The stage plan for the user's schedule: GPipe and 1F1B from the stage DP, 1F1B searched with interleaving
    too (v = 1 is plain 1F1B; ``passes/interleave.py``), ``"interleaved"`` from interleaved plans only."""
    found: list[StagePlan] = []
    error: StageInfeasibleError | None = None
    if schedule != "interleaved":
        try:
            found.append(solve_stages(problem))
        except StageInfeasibleError as err:
            error = err
    if schedule in ("1f1b", "interleaved"):
        interleaved = solve_interleaved(problem)
        if interleaved is not None:
            found.append(interleaved)
        elif schedule == "interleaved":
            raise StageInfeasibleError(
                "no interleaved 1F1B plan fits: it needs sub-meshes that split the devices into two or more equal "
                "groups, at least 2 stage chunks per group (layers >= 2 x groups), a microbatch count that is a "
                "multiple of the groups, and the memory of its extra microbatches in flight; try schedule='1f1b'")
    if not found:
        assert error is not None
        raise error
    best = min(found, key=lambda p: p.step_time_s)
    if best.chunks > 1:
        log.info("interleaved 1F1B (%d chunks per group) %.4gs beats 1F1B", best.chunks, best.step_time_s)
    return best
