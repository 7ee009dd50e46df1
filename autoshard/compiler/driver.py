"""The SPMD driver: trace, resolve the target, run the intra-op pass on each candidate mesh, build the Plan.

With no mesh given, every factorization of the device count into two axes is
planned (Alpa's logical-mesh search, ``compiler/target.py``) and the one with
the lowest modeled step time wins; the others are kept in ``Plan.alternatives``.
"""
from __future__ import annotations

import logging
import warnings
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeAlias

from autoshard.compiler.collector import without_collector
from autoshard.compiler.explain import op_explanations
from autoshard.compiler.layer_times import layer_times
from autoshard.compiler.target import ClusterLike, MeshLike, Target, check_budget_floor, resolve_target
from autoshard.errors import CutOffError, InfeasibleMemoryError, OverBudgetWarning, PlanningError
from autoshard.ir.graph import OpGraph
from autoshard.ir.trace import trace
from autoshard.meshes.logical import LogicalMesh
from autoshard.passes.emit import annotations_from
from autoshard.passes.hbm_traffic import compute_lower_bound_s
from autoshard.passes.intra_op import IntraOpOptions, IntraOpResult, plan_intra_op
from autoshard.plans.ledger import Explanations, Ledger, SolverInfo, fmt_bytes, fmt_s
from autoshard.plans.plan import Plan

log = logging.getLogger(__name__)

Progress: TypeAlias = Callable[[str], None]  # told a short line as each long phase starts (tracing, each solve)


@dataclass(frozen=True)
class PlannedStep:
    plan: Plan
    graph: OpGraph
    logical_mesh: LogicalMesh
    result: IntraOpResult


def explained(step: PlannedStep) -> PlannedStep:
    """``step`` with each op's strategy explained against its alternatives (``Plan.explanations``), for a plan
    built without them (``explain=False``: a plan weighed against others, explained once it is the answer)."""
    if isinstance(step.plan.explanations, Explanations) or step.plan.explanations:
        return step
    return replace(step, plan=replace(step.plan, explanations=explanations_of(step.result)))


def explanations_of(result: IntraOpResult) -> Explanations:
    """The plan's explanations, made when first read (``plans/ledger.Explanations``), with the collector paused
    as while planning."""
    return Explanations(without_collector(lambda: op_explanations(result)))


def build_plan(graph: OpGraph, result: IntraOpResult, budget: float, timings: dict[str, float],
               name: str = "autoshard", explain: bool = True) -> Plan:
    mesh = result.mesh
    values = graph.values
    in_paths = [values[v].path or f"[{i}]" for i, v in enumerate(graph.inputs)]
    out_paths = list(graph.output_paths) or [f"out[{i}]" for i in range(len(graph.outputs))]
    cluster = mesh.cluster
    bound = compute_lower_bound_s(graph, cluster, mesh.num_devices)
    ann = annotations_from(result)
    compute_bound, memory_bound = result.bound_split_s()
    ledger = Ledger(
        compute_s=result.compute_s, comm_s=result.comm_s, reshard_s=result.reshard_s, bubble_s=0.0,
        peak_memory_bytes=result.peak_bytes, memory_by_kind=dict(result.memory_by_role),
        collective_bytes=result.collective_bytes_by_kind(), compute_lower_bound_s=bound,
        flops_per_device=result.flops_per_device, hbm_bytes_per_device=result.hbm_bytes_per_device,
        compute_bound_s=compute_bound, memory_bound_s=memory_bound, flops_by_dtype=result.flops_by_dtype(),
        input_s=result.input_s,
    )
    s = result.ilp
    return Plan(
        mesh_shape=mesh.shape, axis_names=mesh.axis_names, cluster=cluster,
        input_specs=dict(zip(in_paths, result.input_specs)), output_specs=dict(zip(out_paths, result.output_specs)),
        input_roles={p: values[v].role.value for p, v in zip(in_paths, graph.inputs)},
        input_shapes={p: (values[v].shape, values[v].dtype) for p, v in zip(in_paths, graph.inputs)},
        op_out_specs=dict(ann.op_out_specs), op_in_reshards={k: dict(v) for k, v in ann.op_in_reshards.items()},
        output_reshards=dict(ann.output_reshards), op_deferred=dict(ann.deferred),
        ledger=ledger,
        solver=SolverInfo(s.status, s.gap, s.solve_s, s.num_nodes, s.num_classes, s.num_variables,
                          s.num_constraints, s.num_edges),
        planning_s=dict(timings), memory_budget_bytes=budget, num_ops=len(graph.ops), name=name,
        output_shapes={p: (values[v].shape, values[v].dtype) for p, v in zip(out_paths, graph.outputs)},
        in_tree=str(graph.in_tree) if graph.in_tree is not None else "",
        explanations=explanations_of(result) if explain else {},
        layer_times=layer_times(result),
    )


def plan_graph(graph: OpGraph, *, mesh: MeshLike = None, cluster: ClusterLike = None,
               memory_budget: float | None = None, options: IntraOpOptions | None = None,
               num_devices: int | None = None, timings: dict[str, float] | None = None,
               name: str = "autoshard", explain: bool = True, progress: Progress | None = None) -> PlannedStep:
    """Plan an already traced graph on the given (or searched) logical mesh.

    ``explain`` records each op's strategy against its alternatives in the plan (``Plan.explanations``).
    """
    target = resolve_target(mesh, cluster, memory_budget, num_devices=num_devices)
    return plan_on(graph, target, options, timings=timings, name=name, explain=explain, progress=progress)


@without_collector
def plan_on(graph: OpGraph, target: Target, options: IntraOpOptions | None = None, *,
            timings: dict[str, float] | None = None, name: str = "autoshard", explain: bool = True,
            progress: Progress | None = None, cutoff_s: float | None = None) -> PlannedStep:
    """``plan_graph`` for a resolved Target: the intra-op pass on each candidate mesh, the fastest kept.

    ``cutoff_s``: a step found elsewhere (a pipeline's) that the plan must beat to matter; a mesh whose ILP
    bound proves it cannot is left out (``CutOffError``), and when every mesh is, ``CutOffError`` is raised
    with the least of their bounds."""
    check_budget_floor(graph, target)
    budget = target.memory_budget_bytes
    options = replace(options or IntraOpOptions(), memory_budget_bytes=budget)
    timings = dict(timings or {})
    best: tuple[float, IntraOpResult] | None = None
    alternatives: dict[str, float] = {}
    errors: list[tuple[InfeasibleMemoryError, LogicalMesh]] = []
    cut: list[tuple[CutOffError, LogicalMesh]] = []
    start = time.perf_counter()
    several = len(target.meshes) > 1
    for i, logical in enumerate(target.meshes):
        if progress is not None:
            count = f" ({i + 1} of {len(target.meshes)})" if several else ""
            progress(f"solving {len(graph.ops)} ops on mesh {'x'.join(map(str, logical.shape))}{count}")
        try:
            result = plan_intra_op(graph, logical, options, exact_smallest_budget=not several, cutoff_s=cutoff_s)
        except InfeasibleMemoryError as err:
            errors.append((err, logical))
            continue
        except CutOffError as err:
            log.info("mesh %s cannot beat %.6g s: its ILP bound is %.6g s", logical, cutoff_s, err.bound_s)
            cut.append((err, logical))
            continue
        alternatives["x".join(map(str, logical.shape))] = result.step_s
        if best is None or result.step_s < best[0] - 1e-12:
            best = (result.step_s, result)
    timings["intra-op"] = time.perf_counter() - start
    if best is None and cut:
        err, mesh = min(cut, key=lambda e: e[0].bound_s)
        raise CutOffError(f"no plan on {len(cut)} of the {len(target.meshes)} meshes beats {fmt_s(cutoff_s or 0.0)}: "
                          f"the least bound is {fmt_s(err.bound_s)} (mesh {'x'.join(map(str, mesh.shape))})"
                          + (f"; {len(errors)} others fit no plan" if errors else ""), err.bound_s)
    if best is None:
        err, closest = min(errors, key=lambda e: e[0].smallest_budget_bytes or float("inf"))
        if several:  # name a budget checked on the mesh that came closest
            try:
                plan_intra_op(graph, closest, options)
            except InfeasibleMemoryError as checked:
                err = checked
        raise InfeasibleMemoryError(
            f"no mesh shape of {target.num_devices} devices fits {fmt_bytes(budget)} per device; the smallest "
            f"budget that fits is {fmt_bytes(err.smallest_budget_bytes or 0.0)} (mesh "
            f"{'x'.join(map(str, closest.shape))}): raise memory_budget or use more devices",
            err.smallest_budget_bytes, budget_bytes=budget) if several else err
    result = best[1]
    if result.peak_bytes > budget:
        # The ILP's memory terms are per choice; resharded and layout copies depend on pairs of choices and
        # only the ledger counts them, so a plan the ILP accepted can still exceed the budget here.
        warnings.warn(
            f"the chosen plan's modeled peak memory {fmt_bytes(result.peak_bytes)} per device exceeds the budget "
            f"{fmt_bytes(budget)} by {fmt_bytes(result.peak_bytes - budget)} (resharded copies the ILP does not "
            f"bound): plan with a memory_budget below the real one to leave room, or run `autoshard compare` "
            f"(autoshard.compiler.baselines.compare) and use its fallback, the fastest classic plan that fits",
            OverBudgetWarning, stacklevel=2)
    plan = build_plan(graph, result, budget, timings, name=name, explain=explain)
    if len(target.meshes) > 1:
        plan = replace(plan, alternatives=alternatives)
    return PlannedStep(plan, graph, result.mesh, result)


@without_collector
def plan_step(fn: Callable[..., Any], args: Sequence[Any], **kwargs: Any) -> PlannedStep:
    """Trace ``fn(*args)`` and plan it (see ``plan_graph`` for the options)."""
    progress = kwargs.get("progress")
    if progress is not None:
        progress("tracing")
    start = time.perf_counter()
    graph = trace(fn, *args)
    timings = {"trace": time.perf_counter() - start}
    name = kwargs.pop("name", getattr(fn, "__name__", "autoshard"))
    if not graph.ops:
        raise PlanningError(f"{name} has no operations to plan")
    return plan_graph(graph, timings=timings, name=name, **kwargs)
