"""The pipeline driver: trace, take the step apart, cluster layers, price, solve the stage DP, build the Plan.

``plan_pipeline`` is what ``@autoshard`` and ``autoshard.plan`` call unless
``num_stages == 1``. It returns a :class:`PipelinePlanned` when a pipeline
is chosen, or the SPMD ``PlannedStep`` when

- the step has no ``autoshard.value_and_grad`` / ``grad`` marker (plain
  ``jax.grad``: one SPMD stage), or a mesh was forced with ``num_stages=None``;
- ``num_stages=None`` and the best SPMD-only plan (the intra-op planner over
  every logical mesh shape) is at least as fast, under the model, as the best
  plan of two or more stages.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from autoshard.compiler.driver import PlannedStep, Progress, plan_on
from autoshard.compiler.target import ClusterLike, MeshLike, resolve_target
from autoshard.errors import InfeasibleMemoryError, PlanningError
from autoshard.ir.graph import OpGraph, Role, same_structure
from autoshard.ir.spec import Spec
from autoshard.ir.split import StepParts, batch_inputs, microbatch_shapes, split_step
from autoshard.ir.trace import trace, trace_jaxpr
from autoshard.meshes.cluster import ClusterSpec
from autoshard.passes.hbm_traffic import compute_lower_bound_s, graph_costs
from autoshard.passes.inter_op import InterOpOptions, LayerWork, PricedProblem, place_stages, price_stages
from autoshard.passes.intra_op import IntraOpOptions
from autoshard.passes.layers import Layer, cluster_layers
from autoshard.passes.stages import StageInfeasibleError, StagePlan, solve_stages
from autoshard.plans.ledger import Ledger, SolverInfo
from autoshard.plans.plan import Plan
from autoshard.plans.stage_plan import PipelineStage, PipelineSummary, StageMemory
from autoshard.runtime.pipeline import PipelineError, PipelineStep, StageLayout, StageProgram, stage_programs

log = logging.getLogger(__name__)

COST_MODEL = ("dp: per-op rooflines of each layer's traced forward + backward at the device's batch share "
              "(residuals kept), gradient all-reduce + optimizer once per step, activation transfers both ways")
INTRA_STAGE = "data parallel: parameters replicated, batch and activations split on their leading dim"


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
    priced: PricedProblem

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
    num_devices, spec, budget = target.num_devices, target.cluster, target.memory_budget_bytes

    t0 = time.perf_counter()
    layers = cluster_layers(parts.forward, num_layers)
    global_batch, split = batch_inputs(parts)
    timings["layers"] = time.perf_counter() - t0
    fwd = parts.forward
    leaf_bytes = [float(fwd.nbytes(v)) if d else 0.0 for v, d in zip(fwd.invars, fwd.diff)]
    by_role = graph.bytes_by_role()
    opt_ratio = by_role.get(Role.OPT_STATE, 0) / max(by_role.get(Role.PARAM, 0), 1)
    inter = InterOpOptions(schedule=schedule, num_stages=num_stages, num_microbatches=num_microbatches,
                           memory_budget_bytes=budget, min_stages=2 if num_stages is None else 1)
    say(f"pricing pipeline stages ({len(layers)} layers)")
    t0 = time.perf_counter()
    work = layer_work(fn, graph, parts, layers, split, global_batch, args, spec)
    apply_s = leaf_apply_s(parts, spec)
    priced = price_stages(layers, leaf_bytes, 0.0, spec, num_devices, global_batch, opt_ratio, inter, work,
                          apply_s)
    timings["pricing"] = time.perf_counter() - t0

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
            return spmd
        raise
    timings["stage-dp"] = time.perf_counter() - t0
    if spmd is not None and spmd.plan.step_s <= stage_plan.step_time_s:
        log.info("SPMD %.4gs beats the best pipeline %s", spmd.plan.step_s, stage_plan)
        if not keep_both:
            return spmd
    placed = place_stages(stage_plan, spec, num_devices)
    pool = target.device_indices
    if pool is not None:
        placed = [tuple(pool[i] for i in devs) for devs in placed]
    layouts = tuple(StageLayout(st.first_layer, st.last_layer, devs) for st, devs in zip(stage_plan.stages, placed))
    plan = _build_plan(graph, parts, layers, stage_plan, layouts, priced, spec, budget, timings, name, spmd,
                       split, len(jax.tree_util.tree_leaves(args)))
    in_leaves = jax.tree_util.tree_leaves(tuple(args))
    log.info("%s", plan)
    piped = PipelinePlanned(plan, fn, tuple(in_leaves), graph, parts, layers, stage_plan, layouts, split, graph.in_tree,
                            graph.out_tree, graph.output_paths, priced)
    return (piped, spmd) if keep_both else piped


def trace_at(fn: Callable[..., Any], in_tree: Any, leaves: Sequence[Any]) -> OpGraph:
    """The step traced at other shapes (its flat input leaves as ShapeDtypeStructs)."""
    return trace(fn, *jax.tree_util.tree_unflatten(in_tree, list(leaves)))


def layer_work(fn: Callable[..., Any], graph: OpGraph, parts: StepParts, layers: Sequence[Layer],
               split: Sequence[bool], global_batch: int, args: Sequence[Any],
               cluster: ClusterSpec) -> list[LayerWork] | None:
    """Each layer's forward + backward graph, traced at the full batch and at batch / r (r the smallest
    divisor > 1), per op split into a fixed part and a part proportional to the batch. Equal layers
    (structural hash) are traced once. None when the two traces differ (then the planner falls back to
    3x the forward)."""
    ratio = next((r for r in range(2, global_batch + 1) if global_batch % r == 0), None)
    if ratio is None:
        return None
    small_graph = trace_at(fn, graph.in_tree, microbatch_shapes(jax.tree_util.tree_leaves(tuple(args)), split, ratio))
    small = split_step(small_graph.jaxpr) if same_structure(graph, small_graph) else None
    if small is None:
        return None
    ranges = [(i, i) for i in range(len(layers))]
    try:
        eqns = [layer.eqns for layer in layers]
        big_programs = stage_programs(parts.forward, eqns, ranges)
        small_programs = stage_programs(small.forward, eqns, ranges)
    except PipelineError:
        return None
    cache: dict[str, LayerWork] = {}
    out = []
    for layer, big, little in zip(layers, big_programs, small_programs):
        if layer.structure not in cache:
            full, part = _train_costs(parts, big, cluster), _train_costs(small, little, cluster)
            if full.shape != part.shape:
                part = np.concatenate([full[:, :2] / ratio, full[:, 2:]], axis=1)  # other op lists: all scales
            scaled = np.clip((full[:, :2] - part[:, :2]) * ratio / (ratio - 1), 0.0, None)
            fixed = np.clip(full[:, :2] - scaled, 0.0, None)
            cache[layer.structure] = LayerWork(fixed[:, 0], scaled[:, 0], fixed[:, 1], scaled[:, 1], full[:, 2])
        out.append(cache[layer.structure])
    return out


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


def _train_costs(parts: StepParts, program: StageProgram, cluster: ClusterSpec) -> np.ndarray:
    """[ops, 3] (flops, fused HBM bytes, peak FLOP/s) of the program's forward + backward (vjp) graph."""
    fwd = parts.forward
    run = program.function(fwd)

    def aval(v: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(fwd.avals[v].shape, fwd.avals[v].dtype)

    params = [aval(fwd.invars[k]) for k in program.param_leaves]
    data = [aval(fwd.invars[k]) for k in program.data_leaves]
    acts = [aval(v) for v in program.in_acts]
    cts = [aval(v) for v in program.out_acts]

    def train(pr: list[Any], d: list[Any], ac: list[Any], ct: list[Any]) -> Any:
        out, pullback = jax.vjp(lambda p_, a_: run(p_, d, a_), pr, ac)
        return out, pullback(ct)

    costs = graph_costs(trace_jaxpr(jax.make_jaxpr(train)(params, data, acts, cts)), cluster)
    return np.stack([costs.flops, costs.hbm_bytes, costs.peak_flops], axis=1).reshape(-1, 3)


def _build_plan(graph: OpGraph, parts: StepParts, layers: Sequence[Layer], sp: StagePlan,
                layouts: Sequence[StageLayout], priced: PricedProblem, cluster: ClusterSpec, budget: float,
                timings: dict[str, float], name: str, spmd: PlannedStep | None, split: Sequence[bool],
                num_inputs: int) -> Plan:
    values = graph.values
    paths = [values[v].path or f"[{i}]" for i, v in enumerate(graph.inputs)]
    shapes = {p: (values[v].shape, values[v].dtype) for p, v in zip(paths, graph.inputs)}
    fwd = parts.forward
    problem = priced.problem
    b = problem.microbatch_options.index(sp.num_microbatches)
    stages = []
    for s, (choice, layout) in enumerate(zip(sp.stages, layouts)):
        i, j, k = choice.first_layer, choice.last_layer, choice.submesh_index
        leaves = sorted({leaf for layer in layers[i:j + 1] for leaf in layer.param_leaves})
        pspecs = {paths[parts.operand_inputs[leaf]]: Spec.replicated(len(fwd.avals[fwd.invars[leaf]].shape))
                  for leaf in leaves if parts.operand_inputs[leaf] is not None}
        n = len(layout.device_indices)
        bspecs = {}
        for idx, is_batch in enumerate(split):
            if is_batch:
                rank = len(shapes[paths[idx]][0])
                mb = shapes[paths[idx]][0][0] // sp.num_microbatches
                bspecs[paths[idx]] = (Spec.from_partition_spec(("dp",) + (None,) * (rank - 1), rank)
                                      if n > 1 and mb % n == 0 else Spec.replicated(rank))
        p = float(priced.param_bytes[i, j])
        act = float(problem.stage_act_bytes[i, j, k, b])
        memory = StageMemory(p, p, p * priced.opt_ratio, sp.in_flight[s] * act, sp.in_flight[s])
        stages.append(PipelineStage(
            index=s, first_layer=i, last_layer=j, submesh=choice.submesh, device_indices=layout.device_indices,
            mesh_shape=(n,), axis_names=("dp",), param_specs=pspecs, batch_specs=bspecs,
            time_s=sp.stage_times_s[s], compute_s=float(priced.compute_s[i, j, k, b]),
            sync_s=float(priced.sync_s[i, j, k]),
            transfer_out_s=sp.transfer_times_s[s] if s < len(sp.transfer_times_s) else 0.0,
            memory=memory, num_params=len(pspecs)))
    # ledger: B x bottleneck split into compute and communication as in the bottleneck; the rest is bubble
    times = list(sp.stage_times_s) + list(sp.transfer_times_s)
    worst = int(np.argmax(times))
    busy = sp.num_microbatches * sp.bottleneck_s
    if worst < len(stages):
        st = stages[worst]
        frac = st.compute_s / st.time_s if st.time_s > 0 else 1.0
    else:
        frac = 0.0
    peak_stage = max(stages, key=lambda st: st.memory.peak_bytes)
    mem = peak_stage.memory
    ledger = Ledger(
        compute_s=busy * frac, comm_s=busy * (1 - frac), reshard_s=0.0, bubble_s=sp.step_time_s - busy,
        peak_memory_bytes=mem.peak_bytes,
        memory_by_kind={"param": mem.params_bytes, "grad": mem.grads_bytes, "opt_state": mem.opt_state_bytes,
                        "activation": mem.activations_bytes},
        collective_bytes={}, compute_lower_bound_s=compute_lower_bound_s(graph, cluster, cluster.num_devices))
    summary = PipelineSummary(
        num_microbatches=sp.num_microbatches, schedule=sp.schedule, step_s=sp.step_time_s,
        first_microbatch_latency_s=sp.first_microbatch_latency_s, bottleneck_s=sp.bottleneck_s,
        bubble_fraction=sp.bubble_fraction, layers=len(layers), cost_model=COST_MODEL, intra_stage=INTRA_STAGE,
        spmd_step_s=spmd.plan.step_s if spmd is not None else None,
        spmd_mesh="x".join(map(str, spmd.plan.mesh_shape)) if spmd is not None else "",
        layer_eqns=tuple(tuple(layer.eqns) for layer in layers))
    num_devices = problem.num_devices
    plan = Plan(
        mesh_shape=(num_devices,), axis_names=("devices",), cluster=cluster,
        input_specs={p: Spec.replicated(len(shapes[p][0])) for p in paths},
        output_specs={}, input_roles={p: values[v].role.value for p, v in zip(paths, graph.inputs)},
        input_shapes=shapes, op_out_specs={}, op_in_reshards={}, ledger=ledger,
        solver=SolverInfo("stage-dp", 0.0, timings.get("stage-dp", 0.0), len(layers), len(problem.submeshes),
                          int(np.prod(problem.stage_time_s.shape)), 0, 0),
        planning_s=dict(timings), memory_budget_bytes=budget, num_ops=len(graph.ops), name=name,
        stages=tuple(stages), num_microbatches=sp.num_microbatches, schedule=sp.schedule,
        output_shapes={p: (values[v].shape, values[v].dtype)
                       for p, v in zip(graph.output_paths or [f"out[{k}]" for k in range(len(graph.outputs))],
                                       graph.outputs)},
        in_tree=str(graph.in_tree) if graph.in_tree is not None else "", pipeline=summary,
    )
    return plan
