"""Intra-op parallelism: choose a strategy for every node of an OpGraph on one logical mesh.

The cost graph (``passes/cost_graph.py``: nodes, classes, node and edge costs,
memory terms) becomes an ``IlpProblem`` (the formulation is written out in
``passes/ilp/cpsat.py``) with every per-device liveness point ≤ the budget.

The solver is hinted with the best of several greedy starts after ICM
(data-parallel, sharded state, replicated, the classic layouts, a previous
plan; ``passes/search_starts.py``), so the result is never worse than any of them
under the model. This module keeps the result types, the lowering
(``build_problem``), ``plan_intra_op``, ``decode`` and ``memory_profile``.
"""
from __future__ import annotations

import collections
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.errors import PlanningError
from autoshard.ir.graph import OpGraph, ValueId, dtype_itemsize
from autoshard.ir.spec import Collective, Spec
from autoshard.meshes.logical import LogicalMesh
from autoshard.passes.cost_graph import (CostGraph, IntraOpOptions, class_costs_and_edges, class_name,
                                         memory_points, node_strategies)
from autoshard.passes.hbm_traffic import collective_hbm_bytes, compute_dtype, local_slice_hbm_bytes
from autoshard.passes.ilp import IlpProblem, evaluate, solve
from autoshard.passes.memory_model import simulate
from autoshard.passes.resharding import reshard
from autoshard.passes.search_starts import best_start, hint_from
from autoshard.passes.strategies import Strategy

__all__ = ["IlpStats", "IntraOpOptions", "IntraOpResult", "ReshardSite", "build_problem", "decode",
           "memory_profile", "node_strategies", "plan_intra_op"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReshardSite:
    op_index: int  # -1: carried state written back to its input's storage spec
    input_pos: int
    value: ValueId
    src: Spec
    dst: Spec
    seconds: float
    collectives: tuple[Collective, ...]
    path: tuple[Spec, ...] = ()  # intermediate layouts the priced plan passes through (pinned by emission)

    @property
    def chain(self) -> tuple[Spec, ...]:
        """Layouts to pin in order: the intermediates, then the target."""
        return tuple(self.path) + (self.dst,)


@dataclass(frozen=True)
class IlpStats:
    num_nodes: int
    num_classes: int
    num_followers: int
    num_tied: int
    num_variables: int
    num_constraints: int
    num_edges: int
    status: str
    gap: float
    solve_s: float
    build_s: float


@dataclass(frozen=True)
class IntraOpResult:
    graph: OpGraph
    mesh: LogicalMesh
    node_strategies: tuple[Strategy, ...]  # chosen, per node (inputs first, then ops)
    value_specs: Mapping[ValueId, Spec]  # spec each value is produced in
    input_specs: tuple[Spec, ...]  # storage spec per flat input
    output_specs: tuple[Spec, ...]  # per flat output (carried state: its input's storage spec)
    reshards: tuple[ReshardSite, ...]
    compute_s: float
    comm_s: float  # collectives inside chosen strategies
    reshard_s: float
    memory_profile: np.ndarray  # per-device live bytes at each program point
    memory_by_role: Mapping[str, float]  # at the peak
    ilp: IlpStats
    op_compute_s: tuple[float, ...] = ()  # per op: fused roofline seconds of its chosen strategy
    op_hbm_bytes: tuple[float, ...] = ()  # per op: per-device HBM bytes it reads and writes

    @property
    def flops_per_device(self) -> float:
        """FLOPs one device runs per step (XLA's count: transcendentals and data movement are not FLOPs)."""
        return float(sum(s.flops for s in self.node_strategies[len(self.graph.inputs):]))

    @property
    def hbm_bytes_per_device(self) -> float:
        """Bytes one device moves through HBM per step: the ops' fused traffic and the collectives'."""
        sizes = dict(zip(self.mesh.axis_names, self.mesh.shape))
        slices = {(r.op_index, r.value, r.dst): local_slice_hbm_bytes(self.graph, r.op_index, r.value, r.dst, sizes,
                                                                      bool(r.collectives)) for r in self.reshards}
        return (float(sum(self.op_hbm_bytes)) + sum(collective_hbm_bytes(c, self.mesh) for c in self.collectives())
                + float(sum(slices.values())))

    def bound_split_s(self) -> tuple[float, float]:
        """(compute-bound, memory-bound) seconds: the ops whose roofline is set by FLOPs, by bytes."""
        cluster = self.mesh.cluster
        compute = memory = 0.0
        for j, op in enumerate(self.graph.ops):
            seconds = self.op_compute_s[j] if self.op_compute_s else 0.0
            flops_s = self.op_strategy(j).flops / cluster.peak_flops(compute_dtype(op, self.graph))
            if flops_s >= seconds * (1 - 1e-12):
                compute += seconds
            else:
                memory += seconds
        return compute, memory

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s + self.reshard_s

    @property
    def peak_bytes(self) -> float:
        return float(self.memory_profile.max()) if len(self.memory_profile) else 0.0

    def op_strategy(self, op_index: int) -> Strategy:
        return self.node_strategies[len(self.graph.inputs) + op_index]

    def collectives(self) -> list[Collective]:
        """Collectives the plan runs: each op's own, and each distinct resharded copy once (XLA
        computes a copy of one value in one layout once, however many ops read it)."""
        found = [c for s in self.node_strategies for c in s.collectives]
        seen: set[tuple] = set()
        for site in self.reshards:
            key = (site.value, site.src, site.chain)
            if key not in seen:
                seen.add(key)
                found += list(site.collectives)
        return found

    def collective_bytes_by_kind(self) -> dict[str, float]:
        out: dict[str, float] = collections.defaultdict(float)
        for c in self.collectives():
            out[c.kind] += c.nbytes
        return dict(out)


def build_problem(cg: CostGraph) -> IlpProblem:
    """The ILP of a cost graph, hinted with the best search start (``passes/search_starts.py``)."""
    class_cost, edges = class_costs_and_edges(cg)
    points = memory_points(cg)
    budget = cg.options.memory_budget_bytes
    if budget is None:
        budget = cg.mesh.cluster.memory_per_device_bytes
    hint = best_start(cg, class_cost, edges, points, hint_from(cg, cg.options.hint))
    return IlpProblem(
        node_names=tuple(class_name(cg, c) for c in range(cg.classes.num_classes)),
        node_costs=tuple(class_cost),
        edges=tuple((u, v) for u, v, _ in edges),
        edge_costs=tuple(m for _, _, m in edges),
        memory_points=points,
        memory_budget_bytes=float(budget),
        hint=hint,
        time_limit_s=cg.options.time_limit_s,
        seed=cg.options.seed,
    )


def plan_intra_op(graph: OpGraph, mesh: LogicalMesh, options: IntraOpOptions | None = None) -> IntraOpResult:
    """Solve the intra-op ILP for ``graph`` on ``mesh`` and decode the chosen specs."""
    options = options or IntraOpOptions()
    start = time.perf_counter()
    cg = CostGraph(graph, mesh, options)
    problem = build_problem(cg)
    build_s = time.perf_counter() - start
    solution = solve(problem)
    check = evaluate(problem, solution.choices)
    if check.violations:
        raise PlanningError("the ILP solution violates its own constraints: " + "; ".join(check.violations))
    stats = IlpStats(
        num_nodes=len(cg.strategies), num_classes=cg.classes.num_classes, num_followers=cg.classes.num_followers,
        num_tied=cg.classes.num_tied, num_variables=solution.num_variables,
        num_constraints=solution.num_constraints, num_edges=len(problem.edges), status=solution.status,
        gap=solution.gap, solve_s=solution.solve_s, build_s=build_s,
    )
    log.info("intra-op on %s: %d nodes -> %d classes, %d edges; %s in %.2fs (build %.2fs)", mesh,
             stats.num_nodes, stats.num_classes, stats.num_edges, stats.status, stats.solve_s, build_s)
    return decode(cg, solution.choices, stats)


def decode(cg: CostGraph, choices: np.ndarray, stats: IlpStats) -> IntraOpResult:
    graph, cls = cg.graph, cg.classes
    chosen = tuple(cg.strategies[node][cls.strategy_map[node][choices[cls.node_class[node]]]]
                   for node in range(len(cg.strategies)))
    value_specs: dict[ValueId, Spec] = {}
    for vid, (node, k) in cg.producer.items():
        value_specs[vid] = chosen[node].out_specs[k]
    input_specs = tuple(chosen[i].out_specs[0] for i in range(cg.num_inputs))
    reshards: list[ReshardSite] = []
    for p, k, c, pos, vid in cg.edge_sites():
        src = chosen[p].out_specs[k]
        dst = chosen[c].out_specs[0] if pos < 0 else chosen[c].in_specs[pos]
        if src != dst:
            value = graph.values[vid]
            r = reshard(value.shape, dtype_itemsize(value.dtype), src, dst, cg.mesh)
            op_index = -1 if pos < 0 else c - cg.num_inputs
            reshards.append(ReshardSite(op_index, pos, vid, src, dst, r.seconds, tuple(r.collectives), tuple(r.path)))
    output_specs = []
    for out_index, vid in enumerate(graph.outputs):
        carried = graph.carried[out_index] if graph.carried else None
        if carried is not None:
            output_specs.append(input_specs[carried])
        else:
            output_specs.append(value_specs.get(vid, Spec.replicated(graph.values[vid].rank)))
    profile, by_role = memory_profile(graph, value_specs, cg.sizes, reshards, chosen[cg.num_inputs:])
    own = [int(cls.strategy_map[cg.num_inputs + j][choices[cls.node_class[cg.num_inputs + j]]])
           for j in range(len(graph.ops))]
    work = [cg.op_work(j) for j in range(len(graph.ops))]
    op_compute = tuple(float(w[0][a]) for w, a in zip(work, own))
    op_bytes = tuple(float(w[1][a]) for w, a in zip(work, own))
    return IntraOpResult(
        graph=graph, mesh=cg.mesh, node_strategies=chosen, value_specs=value_specs, input_specs=input_specs,
        output_specs=tuple(output_specs), reshards=tuple(reshards),
        compute_s=float(sum(op_compute)), comm_s=float(sum(s.comm_s for s in chosen)),
        reshard_s=float(sum(r.seconds for r in {(r.value, r.src, r.chain): r for r in reshards}.values())),
        memory_profile=profile, memory_by_role=by_role, ilp=stats, op_compute_s=op_compute, op_hbm_bytes=op_bytes,
    )


def memory_profile(graph: OpGraph, value_specs: Mapping[ValueId, Spec], sizes: Mapping[str, int],
                   reshards: Sequence[ReshardSite] = (), op_strategies: Sequence[Strategy] | None = None,
                   ) -> tuple[np.ndarray, dict[str, float]]:
    """Per-device bytes at each point of XLA:CPU's schedule, and the split by kind at the peak.

    ``passes/liveness.py`` says which XLA behaviour each rule models: fusion,
    the breadth-first schedule, collectives and their combining, donation.
    The profile is arguments + non-donated outputs + live temporaries, the
    figure ``compiled.memory_analysis()`` reports. ``op_strategies`` (one per
    op) supply the partial-sum all-reduces and reduce-scatters of the chosen
    strategies.
    """
    collectives: dict[int, tuple] = {}
    reductions: dict[int, str | None] = {}
    for t, strategy in enumerate(op_strategies or ()):
        if strategy.collectives:
            collectives[t] = strategy.collectives
            reductions[t] = strategy.reduction
    sim = simulate(graph, value_specs, sizes, reshards, collectives, reductions)
    profile = sim.profile()
    return profile, sim.by_kind_at(int(np.argmax(profile)))
