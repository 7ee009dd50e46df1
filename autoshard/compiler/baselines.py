"""Classic parallelization strategies as Plans of the same type, priced by the same model.

Each baseline fixes what the classic strategy fixes and leaves the rest to
the intra-op ILP:

- the *storage layout* of every input (parameters, optimizer state, batch),
  as ``IntraOpOptions.pinned_inputs``;
- for the strategies that split the batch, that it *stays split* over their
  data axes in every op (``IntraOpOptions.required_splits`` on every value
  with a batch-sized dimension, found by tracing the step at twice the
  batch): without it the solver may gather the batch and compute replicated,
  which is not data parallelism.

Given those, the solver picks every op's strategy and every reshard, so a
baseline is the best plan of that strategy under the cost model (an
optimistic version of it) and a point of autoshard's own search space.
autoshard is then solved with the best baseline that fits as its ILP hint,
so its modeled time is never worse than that baseline's.

============  ======================================================  =========================
baseline      fixes (storage layouts; the batch stays split)          left to the solver
============  ======================================================  =========================
DP            batch split on dim 0 over all mesh axes; parameters      op strategies (the
              and optimizer state replicated                           gradient all-reduce
                                                                       follows from them)
FSDP/ZeRO-3   batch as DP; every parameter and optimizer-state leaf    when to gather, whether
              split over all devices on its largest dimension that     gradients reduce-scatter
              divides (fewer, inner axes when none does)
ZeRO-2        batch as DP; optimizer state split as FSDP; parameters   the gradients' layout
              replicated                                               (reduce-scatter or not)
HSDP          batch as DP; parameters and optimizer state split as     as FSDP
              FSDP but over the intra-node axes only, replicated
              over the axes that cross nodes (on one node: the last
              axis plays the node, the others replicate)
Megatron TP   batch replicated; attention and MLP kernels split        op strategies, reshards
              column (q/k/v/up: output features) or row (out/down:     of activations
              input features) over all axes, column biases with
              them; everything else (embeddings, norms, LM head)
              replicated; optimizer state as its parameter
DP x TP       batch split over the first (outer) axis; Megatron        as Megatron TP
              over the last (inner) axis
============  ======================================================  =========================

Megatron's column/row kernels are found from the graph, or from conventional
parameter names when the graph shows no pair (``passes/megatron.py``).

Batch-size ceilings come from ``compiler/ceiling.py`` (affine memory in the
batch, refined at the estimate).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal


from autoshard.compiler.arbiter import Arbitration, arbitrate_steps
from autoshard.compiler.ceiling import BatchProbe, batch_ceiling
from autoshard.compiler.driver import PlannedStep, Progress, explained, plan_graph, plan_on
from autoshard.compiler.target import ClusterLike, MeshLike, Target, resolve_target
from autoshard.errors import InfeasibleMemoryError, PlanningError
from autoshard.ir.graph import OpGraph, Role, ValueId
from autoshard.ir.spec import Spec
from autoshard.ir.trace import trace
from autoshard.passes.classic import (ALL_BASELINES, Baseline, baseline_pins, batch_spec, divisible_axes,
                                      largest_dim_spec, node_axes)
from autoshard.passes.intra_op import IntraOpOptions
from autoshard.passes.megatron import MegatronRoles, megatron_roles
from autoshard.plans.plan import Plan

__all__ = ["ALL_BASELINES", "Baseline", "Candidate", "Comparison", "baseline_pins", "batch_spec", "compare",
           "divisible_axes", "largest_dim_spec", "node_axes", "plan_baseline"]

log = logging.getLogger(__name__)

UNBOUNDED_BYTES = 1e30  # a budget no plan reaches: baselines that do not fit are priced without one


# ----------------------------------------------------------------------------- planning


def baseline_target(mesh: MeshLike, cluster: ClusterLike = None, memory_budget: float | None = None) -> Target:
    """The Target of a baseline: like any plan's, but the mesh must be given."""
    if mesh is None:
        raise PlanningError("baselines need a mesh: pass mesh=(2, 4) or a jax Mesh")
    return resolve_target(mesh, cluster, memory_budget)


def data_axes(graph: OpGraph, pins: Mapping[int, Spec]) -> tuple[str, ...]:
    """The mesh axes a baseline splits the batch over (dim 0 of its batch inputs)."""
    for i, vid in enumerate(graph.inputs):
        if graph.values[vid].role == Role.BATCH and pins[i].dims and pins[i].dims[0]:
            return pins[i].dims[0]
    return ()


def batch_splits(graph: OpGraph, batch_dims: Mapping[ValueId, tuple[int, ...]], axes: tuple[str, ...]
                 ) -> dict[ValueId, tuple[tuple[int, ...], tuple[str, ...]]]:
    """``IntraOpOptions.required_splits`` that keep every batch-sized value split over ``axes``."""
    if not axes:
        return {}
    inputs = set(graph.inputs)
    return {vid: (dims, axes) for vid, dims in batch_dims.items() if dims and vid not in inputs}


def plan_baseline(graph: OpGraph, kind: Baseline, *, mesh: MeshLike, cluster: ClusterLike = None,
                  memory_budget: float | None = None, options: IntraOpOptions | None = None,
                  roles: MegatronRoles | None = None, explain: bool = True,
                  batch_dims: Mapping[ValueId, tuple[int, ...]] | None = None) -> PlannedStep:
    """The ``kind`` baseline on ``mesh`` as a Plan named after it (see ``baseline_on``)."""
    return baseline_on(graph, kind, baseline_target(mesh, cluster, memory_budget), options, roles=roles,
                       explain=explain, batch_dims=batch_dims)


def baseline_on(graph: OpGraph, kind: Baseline, target: Target, options: IntraOpOptions | None = None, *,
                roles: MegatronRoles | None = None, explain: bool = True,
                batch_dims: Mapping[ValueId, tuple[int, ...]] | None = None,
                progress: Progress | None = None) -> PlannedStep:
    """The ``kind`` baseline on the target's mesh.

    ``batch_dims`` (per value, the dims that grow with the batch: ``BatchProbe.batch_dims``) keeps
    the batch split over the baseline's data axes in every op; without it only the storage is fixed.
    Planned under the memory budget; when its layouts cannot fit, it is planned
    without one and returned with ``plan.fits`` False.
    """
    pins = baseline_pins(graph, target.meshes[0], kind, roles)
    splits = batch_splits(graph, batch_dims, data_axes(graph, pins)) if batch_dims else {}
    opts = replace(options or IntraOpOptions(), pinned_inputs=pins, required_splits=splits)
    try:
        return plan_on(graph, target, opts, name=kind.label, explain=explain, progress=progress)
    except InfeasibleMemoryError:
        unbounded = replace(target, memory_budget_bytes=UNBOUNDED_BYTES)
        planned = plan_on(graph, unbounded, opts, name=kind.label, explain=explain, progress=progress)
        return replace(planned, plan=replace(planned.plan, memory_budget_bytes=target.memory_budget_bytes))


# ----------------------------------------------------------------------------- comparison


@dataclass(frozen=True)
class Candidate:
    """One row of a comparison: a plan and what the model says about it."""

    name: str
    plan: Plan
    batch_ceiling: int | None  # largest global batch that fits; None: memory does not grow with the batch
    planned: PlannedStep | None = None

    @property
    def step_s(self) -> float:
        return self.plan.step_s

    @property
    def peak_bytes(self) -> float:
        return self.plan.ledger.peak_memory_bytes

    @property
    def fits(self) -> bool:
        return self.plan.fits


@dataclass(frozen=True)
class Comparison:
    autoshard: Candidate
    baselines: tuple[Candidate, ...]
    batch_size: int | None
    memory_budget_bytes: float
    megatron: MegatronRoles
    seconds: float
    arbitration: Arbitration | None = None  # check="compiled": every plan compiled, the fastest returned

    def compiled_speedup(self, baseline: Candidate) -> float | None:
        """How many times faster autoshard's compiled program is than ``baseline``'s, both priced from their
        HLO (``Ledger.compiled_step_s``); None when either was not compiled."""
        mine, theirs = self.autoshard.plan.ledger.compiled_step_s, baseline.plan.ledger.compiled_step_s
        return theirs / mine if mine > 0 and theirs > 0 else None

    def speedup(self, baseline: Candidate) -> float:
        """How many times faster autoshard's modeled step is than ``baseline``'s."""
        return baseline.step_s / self.autoshard.step_s if self.autoshard.step_s > 0 else float("inf")

    @property
    def best_baseline(self) -> Candidate | None:
        """The fastest classic plan under the model (fits or not)."""
        return min(self.baselines, key=lambda c: c.step_s, default=None)

    @property
    def fallback(self) -> Candidate | None:
        """The fastest classic plan that fits the memory budget: what to run if autoshard is not trusted."""
        return min((c for c in self.baselines if c.fits), key=lambda c: c.step_s, default=None)

    @property
    def rows(self) -> tuple[Candidate, ...]:
        return (self.autoshard, *self.baselines)

    def summary_dict(self) -> dict[str, dict[str, Any]]:
        """Per strategy: modeled step, peak, fits, ceiling, speedup, and the compiled step where compiled (what
        ``Plan.baselines`` records)."""
        return {c.name: {"step_s": c.step_s, "peak_memory_bytes": c.peak_bytes, "fits": c.fits,
                         "batch_ceiling": c.batch_ceiling, "speedup": self.speedup(c),
                         **({"compiled_step_s": c.plan.ledger.compiled_step_s}
                            if c.plan.ledger.compiled_step_s > 0 else {})} for c in self.rows}


def _hint_options(options: IntraOpOptions, best: PlannedStep | None) -> IntraOpOptions:
    if best is None:
        return options
    return replace(options, hint=tuple(best.result.node_strategies))


def compare(fn: Callable[..., Any], args: Sequence[Any], mesh: MeshLike = None,
            cluster: ClusterLike = None,
            *, memory_budget: float | None = None, options: IntraOpOptions | None = None,
            baselines: Sequence[Baseline] = ALL_BASELINES, progress: Progress | None = None,
            num_devices: int | None = None, check: str | None = "compiled", batch_ceilings: bool = True,
            contest: Literal["all", "best"] = "all") -> Comparison:
    """autoshard and every classic baseline on ``mesh``: modeled time, memory, fit, batch ceiling.

    With no mesh, autoshard's own mesh search picks it, over ``num_devices`` (default: the devices
    present). The baselines are planned first; autoshard is then solved with the fastest one that fits as its ILP hint, and, should the solver still return a worse
    plan (a time-out), that baseline's plan is kept as autoshard's.
    """
    start = time.perf_counter()
    say = progress or (lambda _msg: None)
    options = options or IntraOpOptions()
    say("tracing")
    graph = trace(fn, *args)
    probe = BatchProbe(fn, args, graph)
    if mesh is None:
        mesh = plan_graph(graph, cluster=cluster, memory_budget=memory_budget, options=options,
                          num_devices=num_devices, explain=False,
                          progress=lambda line: say(f"choosing the mesh: {line}")).logical_mesh.shape
    target = baseline_target(mesh, cluster, memory_budget)
    budget = target.memory_budget_bytes
    roles = megatron_roles(graph)
    say("tracing at twice the batch (which values grow with it)")
    batch_dims = probe.batch_dims()
    planned: dict[Baseline, PlannedStep] = {}
    for kind in baselines:
        planned[kind] = baseline_on(graph, kind, target, options, roles=roles, explain=False, batch_dims=batch_dims,
                                    progress=lambda line, label=kind.label: say(f"{label}: {line}"))
    fitting = [p for p in planned.values() if p.plan.fits]
    best = min(fitting, key=lambda p: p.plan.step_s, default=None)
    hinted = f" (hinted with {best.plan.name})" if best else ""
    try:
        auto = plan_on(graph, target, _hint_options(options, best), name="autoshard",
                       progress=lambda line: say(f"autoshard{hinted}: {line}"))
    except PlanningError as err:
        if best is None:
            raise
        why = "no plan of its own fits" if isinstance(err, InfeasibleMemoryError) else "solver time-out"
        log.warning("autoshard's solve failed (%s); keeping %s, the best baseline that fits", err, best.plan.name)
        kept = replace(best.plan, name="autoshard",
                       solver=replace(best.plan.solver, status=f"{why}; kept {best.plan.name}"))
        auto = replace(best, plan=kept)
    if best is not None and not auto.plan.fits:  # never keep a plan over the budget when a classic one fits
        log.warning("autoshard's plan peaks over the budget; keeping %s, the best baseline that fits", best.plan.name)
        kept = replace(best.plan, name="autoshard",
                       solver=replace(auto.plan.solver, status=f"over budget; kept {best.plan.name}"))
        auto = replace(best, plan=kept)
    if best is not None and auto.plan.step_s > best.plan.step_s * (1 + 1e-9):
        log.warning("autoshard's solver returned %.6g s, worse than %s (%.6g s) it was hinted with; keeping %s",
                    auto.plan.step_s, best.plan.name, best.plan.step_s, best.plan.name)
        kept = replace(best.plan, name="autoshard",
                       solver=replace(auto.plan.solver, status=f"{auto.plan.solver.status}; kept {best.plan.name}"))
        auto = replace(best, plan=kept)

    arbitration = None
    if check == "compiled":
        say("compiled arbitration: next-best plans, then compiling every candidate")
        classics = ([(k.label, planned[k]) for k in baselines] if contest == "all"
                    else [(best.plan.name, best)] if best is not None else [])
        auto, priced, arbitration = arbitrate_steps(auto, classics, replace(options, memory_budget_bytes=budget))
        planned = {kind: priced.get(kind.label, planned[kind]) for kind in baselines}
    auto = explained(auto)  # a kept baseline or a next-best plan was planned without them

    def candidate(name: str, step: PlannedStep) -> Candidate:
        ceiling = batch_ceiling(step.result, probe, budget) if batch_ceilings else None
        return Candidate(name, step.plan, ceiling, step)

    say("batch ceilings")
    result = Comparison(
        autoshard=candidate("autoshard", auto),
        baselines=tuple(candidate(kind.label, planned[kind]) for kind in baselines),
        batch_size=probe.batch, memory_budget_bytes=budget, megatron=roles,
        seconds=time.perf_counter() - start, arbitration=arbitration,
    )
    return result


UNIFORM_GPIPE = "uniform GPipe"


def plan_uniform_gpipe(fn: Callable[..., Any], args: Sequence[Any], *, cluster: ClusterLike = None,
                       memory_budget: float | None = None, num_devices: int | None = None,
                       options: IntraOpOptions | None = None, num_layers: int | None = None,
                       progress: Progress | None = None) -> Plan:
    """The classic pipeline: S equal stages (one per node on several nodes, else 2), each data parallel on an
    equal share of the devices (parameters and accumulators replicated, the batch split), GPipe, B the best
    that fits (the least memory when none does). Priced by the same intra-op model as every other row
    (``passes/stage_costs.py`` in its ``"dp"`` mode); needs the loss marked with ``autoshard.value_and_grad``."""
    import numpy as np

    from autoshard.compiler.pipeline_context import PipelineRequest, pipeline_context
    from autoshard.compiler.pipeline_pricing import STAGE_TIME_LIMIT_S, finish_pipeline, price_pipeline
    from autoshard.ir.split import split_step
    from autoshard.passes.stage_costs import StageCostOptions
    from autoshard.passes.stages import evaluate_stages

    say = progress or (lambda _line: None)
    timings: dict[str, float] = {}
    start = time.perf_counter()
    graph = trace(fn, *args)
    parts = split_step(graph.jaxpr)
    if parts is None:
        raise PlanningError("uniform GPipe needs the loss marked with autoshard.value_and_grad (or autoshard.grad)")
    target = resolve_target(None, cluster, memory_budget, num_devices=num_devices)
    spec, n = target.cluster, target.num_devices
    per_node = min(spec.devices_per_node, n)
    nodes = max(1, n // per_node)
    num_stages = nodes if nodes > 1 else 2
    width = n // num_stages
    submesh = (1, width) if width <= per_node else (width // per_node, per_node)
    request = PipelineRequest(cluster=cluster, memory_budget=memory_budget, num_devices=num_devices,
                              num_stages=num_stages, schedule="gpipe", num_layers=num_layers, options=options,
                              progress=progress)
    timings["trace"] = time.perf_counter() - start
    ctx = pipeline_context(fn, args, request, graph, parts, target, timings)
    layers = ctx.layers
    if len(layers) < num_stages:
        raise PlanningError(f"uniform GPipe needs at least {num_stages} layers; the step has {len(layers)}")
    cost_options = StageCostOptions(
        schedule="gpipe", num_stages=num_stages, memory_budget_bytes=target.memory_budget_bytes,
        min_stages=num_stages, recompute=(False,), modes=("dp",), submeshes=(submesh,),
        time_limit_s=min(STAGE_TIME_LIMIT_S, (options or IntraOpOptions()).time_limit_s))
    say(f"pricing uniform GPipe: {num_stages} stages of {len(layers) // num_stages}+ layers on {submesh}")
    t0 = time.perf_counter()
    priced = price_pipeline(ctx, cost_options)
    timings["pricing"] = time.perf_counter() - t0
    bounds = np.linspace(0, len(layers), num_stages + 1).round().astype(int)
    problem = priced.stages.problem
    plans = [evaluate_stages(problem, [(int(bounds[s]), int(bounds[s + 1]) - 1, k) for s in range(num_stages)], b)
             for k in range(len(priced.stages.variants)) for b in problem.microbatch_options]
    fitting = [p for p in plans if p.peak_bytes <= problem.memory_budget_bytes]
    best = min(fitting, key=lambda p: p.step_time_s) if fitting else min(plans, key=lambda p: p.peak_bytes)
    return finish_pipeline(ctx, priced, best, None, UNIFORM_GPIPE).plan
