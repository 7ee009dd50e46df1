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

import enum
import logging
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax
import numpy as np

from autoshard.compiler.ceiling import BatchProbe, batch_ceiling
from autoshard.compiler.driver import MeshLike, PlannedStep, candidate_meshes, plan_graph
from autoshard.compiler.explain import op_explanations
from autoshard.compiler.graph import OpGraph, Role, ValueId
from autoshard.compiler.plan import Plan
from autoshard.compiler.spec import MeshAxes, Spec
from autoshard.compiler.trace import trace
from autoshard.errors import InfeasibleMemoryError, PlanningError
from autoshard.meshes.cluster import ClusterSpec, get_cluster
from autoshard.meshes.logical import LogicalMesh
from autoshard.passes.intra_op import IntraOpOptions
from autoshard.passes.megatron import MegatronRoles, megatron_roles

log = logging.getLogger(__name__)

UNBOUNDED_BYTES = 1e30  # a budget no plan reaches: baselines that do not fit are priced without one
Progress = Callable[[str], None]


class Baseline(str, enum.Enum):
    DP = "dp"
    FSDP = "fsdp"
    ZERO2 = "zero2"
    HSDP = "hsdp"
    TP = "megatron-tp"
    DP_TP = "dp-tp"

    @property
    def label(self) -> str:
        return _LABELS[self]


_LABELS = {Baseline.DP: "DP", Baseline.FSDP: "FSDP/ZeRO-3", Baseline.ZERO2: "ZeRO-2", Baseline.HSDP: "HSDP",
           Baseline.TP: "Megatron TP", Baseline.DP_TP: "DP x TP"}
ALL_BASELINES: tuple[Baseline, ...] = tuple(Baseline)


# ----------------------------------------------------------------------------- layouts


def divisible_axes(size: int, axes: Sequence[str], sizes: Mapping[str, int]) -> MeshAxes:
    """The most devices from ``axes`` (kept in mesh order) whose product divides ``size``; () if none."""
    axes = [a for a in axes if sizes[a] > 1]
    best: MeshAxes = ()
    best_n = 1
    for mask in range(1, 1 << len(axes)):
        chosen = tuple(a for i, a in enumerate(axes) if mask >> i & 1)
        n = math.prod(sizes[a] for a in chosen)
        # ties: prefer the inner axes (later in the mesh), which are the faster links
        if size % n == 0 and (n > best_n or (n == best_n and chosen > best)):
            best, best_n = chosen, n
    return best


def largest_dim_spec(shape: Sequence[int], axes: Sequence[str], sizes: Mapping[str, int]) -> Spec:
    """Split the largest dimension that ``axes`` divide (FSDP's flat-shard analogue); replicated if none."""
    dims: list[MeshAxes] = [()] * len(shape)
    total = math.prod(sizes[a] for a in axes if sizes[a] > 1)
    order = sorted(range(len(shape)), key=lambda d: (-shape[d], d))
    for d in order:  # all the axes on one dimension, the largest that takes them
        if total > 1 and shape[d] % total == 0:
            dims[d] = tuple(a for a in axes if sizes[a] > 1)
            return Spec(tuple(dims))
    for d in order:  # else as many devices as divide the largest dimension that takes any
        chosen = divisible_axes(shape[d], axes, sizes)
        if chosen:
            dims[d] = chosen
            return Spec(tuple(dims))
    return Spec(tuple(dims))


def batch_spec(shape: Sequence[int], axes: Sequence[str], sizes: Mapping[str, int]) -> Spec:
    """Split dim 0 (the batch) over as many of ``axes`` as divide it."""
    if not shape:
        return Spec(())
    return Spec((divisible_axes(shape[0], axes, sizes),) + ((),) * (len(shape) - 1))


def _crosses_nodes(mesh: LogicalMesh, axis: int) -> bool:
    grid = np.asarray(mesh.device_indices).reshape(mesh.shape)
    moved = np.moveaxis(grid, axis, -1).reshape(-1, mesh.shape[axis]) // mesh.cluster.devices_per_node
    return bool((moved != moved[:, :1]).any())


def node_axes(mesh: LogicalMesh) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(intra-node axes, axes that cross nodes); on one node the last axis plays the node."""
    crossing = tuple(a.name for i, a in enumerate(mesh.axes) if a.size > 1 and _crosses_nodes(mesh, i))
    inside = tuple(a.name for a in mesh.axes if a.size > 1 and a.name not in crossing)
    if not crossing:
        return mesh.axis_names[-1:], mesh.axis_names[:-1]
    return inside, crossing


# ----------------------------------------------------------------------------- pins


def _mirror_params(graph: OpGraph, param_specs: Mapping[int, Spec]) -> dict[int, Spec]:
    """Optimizer-state leaves that mirror a parameter (same shape, path ending in its path) get its spec."""
    by_suffix: dict[tuple[str, tuple[int, ...]], Spec] = {}
    for i, spec in param_specs.items():
        value = graph.values[graph.inputs[i]]
        suffix = re.sub(r"^\[\d+\]", "", value.path or "")
        by_suffix[(suffix, value.shape)] = spec
    out: dict[int, Spec] = {}
    for i, vid in enumerate(graph.inputs):
        value = graph.values[vid]
        if value.role != Role.OPT_STATE:
            continue
        for (suffix, shape), spec in by_suffix.items():
            if suffix and value.shape == shape and (value.path or "").endswith(suffix):
                out[i] = spec
                break
    return out


def baseline_pins(graph: OpGraph, mesh: LogicalMesh, kind: Baseline,
                  roles: MegatronRoles | None = None) -> dict[int, Spec]:
    """The storage spec of every flat input under a classic strategy (see the module docstring)."""
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    all_axes = tuple(a for a in mesh.axis_names if sizes[a] > 1)
    inside, _crossing = node_axes(mesh)
    data_axes: tuple[str, ...] = all_axes
    if kind == Baseline.TP:
        data_axes = ()
    elif kind == Baseline.DP_TP:
        data_axes = all_axes[:1] if len(all_axes) > 1 else ()
    model_axes = all_axes if kind == Baseline.TP else all_axes[-1:]
    pins: dict[int, Spec] = {}
    state: dict[int, Spec] = {}
    for i, vid in enumerate(graph.inputs):
        value = graph.values[vid]
        replicated = Spec.replicated(value.rank)
        if value.role == Role.BATCH:
            pins[i] = batch_spec(value.shape, data_axes, sizes)
        elif value.role == Role.PARAM:
            if kind == Baseline.FSDP:
                pins[i] = largest_dim_spec(value.shape, all_axes, sizes)
            elif kind == Baseline.HSDP:
                pins[i] = largest_dim_spec(value.shape, inside, sizes)
            else:
                pins[i] = replicated
        elif value.role == Role.OPT_STATE:
            if kind in (Baseline.FSDP, Baseline.ZERO2):
                pins[i] = largest_dim_spec(value.shape, all_axes, sizes)
            elif kind == Baseline.HSDP:
                pins[i] = largest_dim_spec(value.shape, inside, sizes)
            else:
                pins[i] = replicated
        else:
            pins[i] = replicated
    if kind in (Baseline.TP, Baseline.DP_TP):
        roles = roles or megatron_roles(graph)
        for i, dim in {**roles.column, **roles.row, **roles.bias}.items():
            shape = graph.values[graph.inputs[i]].shape
            axes = divisible_axes(shape[dim], model_axes, sizes)
            dims = [()] * len(shape)
            dims[dim] = axes
            state[i] = Spec(tuple(dims))
        pins.update(state)
        pins.update(_mirror_params(graph, state))
    return pins


# ----------------------------------------------------------------------------- planning


def _logical_mesh(mesh: MeshLike, cluster: ClusterSpec | str | None) -> LogicalMesh:
    if mesh is None:
        raise PlanningError("baselines need a mesh: pass mesh=(2, 4) or a jax Mesh")
    num = mesh.devices.size if isinstance(mesh, jax.sharding.Mesh) else int(np.prod(mesh))
    spec = get_cluster(cluster, num_devices=num)
    return candidate_meshes(mesh, spec, num)[0]


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


def plan_baseline(graph: OpGraph, kind: Baseline, *, mesh: MeshLike, cluster: ClusterSpec | str | None = None,
                  memory_budget: float | None = None, options: IntraOpOptions | None = None,
                  roles: MegatronRoles | None = None, explain: bool = True,
                  batch_dims: Mapping[ValueId, tuple[int, ...]] | None = None) -> PlannedStep:
    """The ``kind`` baseline on ``mesh`` as a Plan named after it.

    ``batch_dims`` (per value, the dims that grow with the batch: ``BatchProbe.batch_dims``) keeps
    the batch split over the baseline's data axes in every op; without it only the storage is fixed.
    Planned under the memory budget; when its layouts cannot fit, it is planned
    without one and returned with ``plan.fits`` False.
    """
    logical = _logical_mesh(mesh, cluster)
    pins = baseline_pins(graph, logical, kind, roles)
    splits = batch_splits(graph, batch_dims, data_axes(graph, pins)) if batch_dims else {}
    opts = replace(options or IntraOpOptions(), pinned_inputs=pins, required_splits=splits)
    try:
        return plan_graph(graph, mesh=mesh, cluster=logical.cluster, memory_budget=memory_budget, options=opts,
                          name=kind.label, explain=explain)
    except InfeasibleMemoryError:
        budget = float(memory_budget if memory_budget is not None else logical.cluster.memory_per_device_bytes)
        planned = plan_graph(graph, mesh=mesh, cluster=logical.cluster, memory_budget=UNBOUNDED_BYTES,
                             options=opts, name=kind.label, explain=explain)
        return replace(planned, plan=replace(planned.plan, memory_budget_bytes=budget))


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
        """Per strategy: modeled step, peak, fits, ceiling, speedup (what ``Plan.baselines`` records)."""
        return {c.name: {"step_s": c.step_s, "peak_memory_bytes": c.peak_bytes, "fits": c.fits,
                         "batch_ceiling": c.batch_ceiling, "speedup": self.speedup(c)} for c in self.rows}


def _hint_options(options: IntraOpOptions, best: PlannedStep | None) -> IntraOpOptions:
    if best is None:
        return options
    return replace(options, hint=tuple(best.result.node_strategies))


def compare(fn: Callable[..., Any], args: Sequence[Any], mesh: MeshLike = None,
            cluster: ClusterSpec | str | None = None,
            *, memory_budget: float | None = None, options: IntraOpOptions | None = None,
            baselines: Sequence[Baseline] = ALL_BASELINES, progress: Progress | None = None) -> Comparison:
    """autoshard and every classic baseline on ``mesh``: modeled time, memory, fit, batch ceiling.

    With no mesh, autoshard's own mesh search picks it. The baselines are planned
    first; autoshard is then solved with the fastest one that fits as its ILP hint, and, should the solver still return a worse
    plan (a time-out), that baseline's plan is kept as autoshard's.
    """
    start = time.perf_counter()
    say = progress or (lambda _msg: None)
    options = options or IntraOpOptions()
    say("tracing")
    graph = trace(fn, *args)
    probe = BatchProbe(fn, args, graph)
    if mesh is None:
        say("choosing the mesh")
        mesh = plan_graph(graph, cluster=cluster, memory_budget=memory_budget, options=options,
                          explain=False).logical_mesh.shape
    logical = _logical_mesh(mesh, cluster)
    budget = float(memory_budget if memory_budget is not None else logical.cluster.memory_per_device_bytes)
    roles = megatron_roles(graph)
    batch_dims = probe.batch_dims()
    planned: dict[Baseline, PlannedStep] = {}
    for kind in baselines:
        say(f"planning {kind.label}")
        planned[kind] = plan_baseline(graph, kind, mesh=mesh, cluster=logical.cluster, memory_budget=budget,
                                      options=options, roles=roles, explain=False, batch_dims=batch_dims)
    fitting = [p for p in planned.values() if p.plan.fits]
    best = min(fitting, key=lambda p: p.plan.step_s, default=None)
    say("planning autoshard" + (f" (hinted with {best.plan.name})" if best else ""))
    try:
        auto = plan_graph(graph, mesh=mesh, cluster=logical.cluster, memory_budget=budget,
                          options=_hint_options(options, best), name="autoshard")
    except PlanningError as err:
        if best is None or isinstance(err, InfeasibleMemoryError):
            raise
        log.warning("autoshard's solve failed (%s); keeping %s, the best baseline that fits", err, best.plan.name)
        kept = replace(best.plan, name="autoshard",
                       solver=replace(best.plan.solver, status=f"solver time-out; kept {best.plan.name}"))
        auto = replace(best, plan=kept)
    if best is not None and auto.plan.step_s > best.plan.step_s * (1 + 1e-9):
        log.warning("autoshard's solver returned %.6g s, worse than %s (%.6g s) it was hinted with; keeping %s",
                    auto.plan.step_s, best.plan.name, best.plan.step_s, best.plan.name)
        kept = replace(best.plan, name="autoshard",
                       solver=replace(auto.plan.solver, status=f"{auto.plan.solver.status}; kept {best.plan.name}"))
        auto = replace(best, plan=kept)

    if not auto.plan.explanations:  # a kept baseline was planned without them
        auto = replace(auto, plan=replace(auto.plan, explanations=op_explanations(auto.result)))

    def candidate(name: str, step: PlannedStep) -> Candidate:
        return Candidate(name, step.plan, batch_ceiling(step.result, probe, budget), step)

    say("batch ceilings")
    result = Comparison(
        autoshard=candidate("autoshard", auto),
        baselines=tuple(candidate(kind.label, planned[kind]) for kind in baselines),
        batch_size=probe.batch, memory_budget_bytes=budget, megatron=roles,
        seconds=time.perf_counter() - start,
    )
    return result


def classic_layouts(graph: OpGraph, mesh: LogicalMesh) -> list[dict[int, Spec]]:
    """Every classic strategy's storage layouts: starting points for autoshard's own search
    (``IntraOpOptions.start_layouts``), so it begins in each strategy's basin."""
    layouts = []
    for kind in ALL_BASELINES:
        try:
            layouts.append(baseline_pins(graph, mesh, kind))
        except Exception as err:  # noqa: BLE001 — a start is optional; the search goes on without it
            log.debug("no %s start layout: %s", kind.label, err)
    return layouts
