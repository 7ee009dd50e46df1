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
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from autoshard.errors import InfeasibleMemoryError, PlanningError
from autoshard.ir.graph import OpGraph, ValueId, dtype_itemsize
from autoshard.ir.spec import Collective, Spec
from autoshard.meshes.logical import LogicalMesh
from autoshard.meshes import cost
from autoshard.passes.buffer_rules import combine_all_reduces
from autoshard.passes.cost_graph import (CostGraph, IntraOpOptions, MemoryPoints, class_costs_and_edges,
                                         class_name, combined_latency_charges, memory_points, node_strategies)
from autoshard.passes.hbm_traffic import collective_hbm_bytes, compute_dtype, local_slice_hbm_bytes
from autoshard.passes.ilp import IlpProblem, IlpSolution, evaluate, min_peak_plan, solve
from autoshard.plans.ledger import fmt_bytes
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
    runs: int = 1  # times it runs per step (inside a loop: the trip count); ``seconds`` counts them all

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
    # per op: its collectives' seconds as XLA issues them (a combined all-reduce's latency on its first member)
    op_comm_s: tuple[float, ...] = ()

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

    def flops_by_dtype(self) -> dict[str, float]:
        """``flops_per_device`` split by the peak each op runs at (``hbm_traffic.compute_dtype``)."""
        found: dict[str, float] = {}
        for j, op in enumerate(self.graph.ops):
            flops = float(self.op_strategy(j).flops)
            if flops:
                dtype = compute_dtype(op, self.graph)
                found[dtype] = found.get(dtype, 0.0) + flops
        return found

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
        computes a copy of one value in one layout once, however many ops read it). An all-reduce whose
        result is only read split over its axes (through views) is what XLA shows as a reduce-scatter
        (an all-reduce and a slice: ``compiler/hlo.py``), so it is reported as one, bytes unchanged."""
        return [c for _, c in self.collectives_by_op()]

    def collectives_by_op(self, part_of: Callable[[int], int] | None = None) -> list[tuple[int, Collective]]:
        """``collectives()`` with the op each belongs to: the op whose strategy runs it or whose input it
        reshards; -1 for the inputs' own and for carried state written back to its storage layout.

        A value resharded alike for several readers is priced once (one reshard feeds them all); with
        ``part_of`` (op index -> the program part running it: a pipeline stage's forward and backward are
        two executables) once per part that reads it, as each part must run it itself."""
        sliced = _sliced_after_all_reduce(self)
        ops = self.graph.ops
        found = [(t, _runs(dataclasses.replace(c, kind="reduce-scatter") if (t, k) in sliced else c,
                           ops[t].trip_count))
                 for t, s in enumerate(self.node_strategies[len(self.graph.inputs):])
                 for k, c in enumerate(s.collectives)]
        found += [(-1, c) for s in self.node_strategies[:len(self.graph.inputs)] for c in s.collectives]
        seen: set[tuple] = set()
        for site in self.reshards:
            key = (site.value, site.src, site.chain, part_of(site.op_index) if part_of is not None else 0)
            if key not in seen:
                seen.add(key)
                found += [(site.op_index, _runs(c, site.runs)) for c in site.collectives]
        return found

    def collective_bytes_by_kind(self) -> dict[str, float]:
        out: dict[str, float] = collections.defaultdict(float)
        for c in self.collectives():
            out[c.kind] += c.nbytes
        return dict(out)


def _runs(collective: Collective, runs: int) -> Collective:
    """A collective run ``runs`` times (inside a loop), as one of all their bytes."""
    return collective if runs == 1 else dataclasses.replace(collective, nbytes=collective.nbytes * runs)


_VIEW_CHAIN = frozenset({"reshape", "transpose", "squeeze", "expand_dims", "copy", "copy_p"})


def _sliced_after_all_reduce(result: IntraOpResult) -> set[tuple[int, int]]:
    """(op, collective index) of all-reduces every reader of whose result (through views) takes a layout
    split over all the all-reduce's axes: XLA slices them right after, which it reports as reduce-scatter."""
    graph = result.graph
    consumers = graph.consumers()
    index = {id(op): j for j, op in enumerate(graph.ops)}
    carried_spec = {graph.outputs[k]: result.input_specs[i] for k, i in enumerate(graph.carried or ())
                    if i is not None}
    read_specs: dict[ValueId, list[Spec]] = collections.defaultdict(list)
    for site in result.reshards:
        read_specs[site.value].append(site.dst)
    found: set[tuple[int, int]] = set()
    for j, op in enumerate(graph.ops):
        strategy = result.op_strategy(j)
        for k, c in enumerate(strategy.collectives):
            if c.kind != "all-reduce" or len(op.outputs) != 1:
                continue
            wanted, frontier, ok, reads = set(c.axes), [op.outputs[0]], True, 0
            while frontier and ok:
                v = frontier.pop()
                if v in graph.outputs and carried_spec.get(v) is None:
                    ok = False
                    break
                specs = list(read_specs.get(v, ())) + ([carried_spec[v]] if v in carried_spec else [])
                for user in consumers.get(v, ()):
                    u = index[id(user)]
                    if user.primitive in _VIEW_CHAIN and v not in read_specs:
                        frontier.extend(user.outputs)
                    elif not any(site.op_index == u and site.value == v for site in result.reshards):
                        specs.append(result.value_specs[v])
                reads += len(specs)
                ok = all(wanted <= set(s.used_axes) for s in specs)
            if ok and reads:
                found.add((j, k))
    return found


def build_problem(cg: CostGraph, budget_bytes: float | None = None) -> IlpProblem:
    """The ILP of a cost graph under ``budget_bytes`` (default: the options', else the device memory),
    hinted with the best search start (``passes/search_starts.py``) that fits it."""
    class_cost, edges, charges, points = _budget_free_terms(cg)
    budget = budget_bytes if budget_bytes is not None else cg.options.memory_budget_bytes
    if budget is None:
        budget = cg.mesh.cluster.memory_per_device_bytes
    hint = best_start(cg, class_cost, edges, points, hint_from(cg, cg.options.hint), float(budget), charges)
    return IlpProblem(
        node_names=tuple(class_name(cg, c) for c in range(cg.classes.num_classes)),
        node_costs=tuple(class_cost),
        edges=tuple((u, v) for u, v, _ in edges),
        edge_costs=tuple(m for _, _, m in edges),
        memory_points=points,
        memory_budget_bytes=float(budget),
        hint=hint,
        charges=charges,
        time_limit_s=cg.options.time_limit_s,
        seed=cg.options.seed,
    )


def _budget_free_terms(cg: CostGraph) -> tuple[list[np.ndarray], list, tuple, MemoryPoints]:
    """Class costs, edges, shared charges and memory points of ``cg``: they do not depend on the budget, so
    the re-solves of one plan (cuts, least-budget probes) share them; computed once per cost graph and
    read-only (the arrays refuse writes)."""
    if cg.problem_terms is None:
        class_cost, edges = class_costs_and_edges(cg)
        points = memory_points(cg)
        for array in (*class_cost, *(m for _, _, m in edges), *(a for point in points for _, a in point)):
            if isinstance(array, np.ndarray):
                array.setflags(write=False)
        cg.problem_terms = (class_cost, edges, tuple(combined_latency_charges(cg)), points)
    class_cost, edges, charges, points = cg.problem_terms
    return list(class_cost), list(edges), charges, points


def plan_intra_op(graph: OpGraph, mesh: LogicalMesh, options: IntraOpOptions | None = None, *,
                  exact_smallest_budget: bool = True) -> IntraOpResult:
    """Solve the intra-op ILP for ``graph`` on ``mesh`` and decode the chosen specs, within the budget.

    The ILP bounds memory at a few liveness points with per-choice terms; resharded and layout copies
    depend on pairs of choices and only the simulation of the decoded plan (``memory_profile``) sees
    them. So the promise is kept with cuts: when the decoded plan's simulated peak exceeds the budget,
    the ILP is solved again with its budget lowered by the largest gap seen between a plan's simulated
    peak and the ILP's own estimate of it, until a plan fits (``MAX_MEMORY_ROUNDS``). If none does, the
    least-memory plans and the search's start are tried. When nothing fits, ``InfeasibleMemoryError``
    names the lowest simulated peak of the plans seen, checked by planning again at it (a budget at
    which planning succeeds). With ``exact_smallest_budget=False`` that check is skipped and the error
    names the lowest peak seen (a driver comparing meshes checks only the best one).
    """
    options = options or IntraOpOptions()
    start = time.perf_counter()
    cg = CostGraph(graph, mesh, options)
    budget = float(options.memory_budget_bytes if options.memory_budget_bytes is not None
                   else mesh.cluster.memory_per_device_bytes)
    result, seen, floor = _plan_within(cg, budget, start)
    if result is not None:
        return result
    smallest = _smallest_budget(cg, min(seen), floor, start) if exact_smallest_budget else min(seen)
    raise InfeasibleMemoryError(
        f"no plan fits in {fmt_bytes(budget)} per device on mesh {mesh}; the smallest budget that fits is "
        f"{fmt_bytes(smallest)} (simulated as XLA lays the plan out); raise memory_budget to at least that, use "
        "more devices, or a smaller batch", smallest, budget_bytes=budget)


def _smallest_budget(cg: CostGraph, candidate: float, floor: float, start: float) -> float:
    """A budget at which planning succeeds, within ~10% of the least one: geometric bisection between the
    ILP's own floor (no plan needs less by its count) and ``candidate`` (a plan that peaks there was
    seen), each probe a full plan; the result is the lowest budget a probe succeeded at (cached)."""
    key = (candidate, floor)
    if key in cg.budget_probes:
        return cg.budget_probes[key]
    hi: float | None = None
    for _ in range(MAX_BUDGET_CHECKS):  # first make sure planning at the candidate succeeds
        found, seen, _floor = _plan_within(cg, candidate, start)
        if found is not None:
            hi = candidate
            break
        candidate = min(seen)
    if hi is None:
        cg.budget_probes[key] = candidate
        return candidate
    lo, peak = min(floor, hi), found.peak_bytes
    for _ in range(MAX_BUDGET_PROBES):
        if hi <= lo * BUDGET_PRECISION:
            break
        mid = (lo * hi) ** 0.5
        found, _seen, _floor = _plan_within(cg, mid, start)
        if found is not None:
            hi, peak = mid, found.peak_bytes
        else:
            lo = mid
    while peak < hi / BUDGET_PRECISION ** 0.5:  # the plan found needs less than its budget: try its own peak
        found, _seen, _floor = _plan_within(cg, peak, start)
        if found is None:
            break
        hi, peak = peak, found.peak_bytes
    cg.budget_probes[key] = hi
    return hi


MAX_MEMORY_ROUNDS = 6  # ILP solves per plan before the least-memory plans decide
MAX_BUDGET_CHECKS = 3  # replans at the budget an InfeasibleMemoryError is about to name
MAX_BUDGET_PROBES = 5  # bisection steps towards the least budget it names
BUDGET_PRECISION = 1.08  # stop when the bracket [fails, succeeds] is this tight


def _plan_within(cg: CostGraph, budget: float, start: float) -> tuple[IntraOpResult | None, list[float], float]:
    """The plan within ``budget`` (docstring of ``plan_intra_op``), or None; the simulated peaks of every
    plan decoded on the way; the ILP's floor (its least memory of any plan; 0 when not computed)."""
    problem = build_problem(cg, budget)
    first_hint = problem.hint
    build_s = time.perf_counter() - start
    margin = 0.0
    seen: list[float] = []
    for _ in range(MAX_MEMORY_ROUNDS):
        try:
            solution = solve(problem)
        except InfeasibleMemoryError:
            break  # the (tightened) ILP has no plan: the least-memory plans decide
        result = _decoded(cg, problem, solution, build_s)
        if _fits(result.peak_bytes, budget):
            return result, seen, 0.0
        seen.append(result.peak_bytes)
        estimate = max(evaluate(problem, solution.choices).memory_bytes, default=0.0)
        margin = max(margin, result.peak_bytes - estimate)
        log.info("intra-op on %s: the plan peaks at %s, over the budget %s (the ILP saw %s): solving again "
                 "%s tighter", cg.mesh, fmt_bytes(result.peak_bytes), fmt_bytes(budget), fmt_bytes(estimate),
                 fmt_bytes(margin))
        if budget - margin <= 0:
            break
        problem = build_problem(cg, budget - margin)
    floor, results = _least_memory(cg, problem, build_s, first_hint)
    fitting = [r for r in results if _fits(r.peak_bytes, budget)]
    if fitting:
        return min(fitting, key=lambda r: r.step_s), seen, floor
    return None, seen + [r.peak_bytes for r in results], floor


def _fits(peak_bytes: float, budget_bytes: float) -> bool:
    return peak_bytes <= budget_bytes * (1 + 1e-9)


def _decoded(cg: CostGraph, problem: IlpProblem, solution: IlpSolution, build_s: float) -> IntraOpResult:
    check = evaluate(problem, solution.choices)
    if check.violations:
        raise PlanningError("the ILP solution violates its own constraints: " + "; ".join(check.violations))
    stats = IlpStats(
        num_nodes=len(cg.strategies), num_classes=cg.classes.num_classes, num_followers=cg.classes.num_followers,
        num_tied=cg.classes.num_tied, num_variables=solution.num_variables,
        num_constraints=solution.num_constraints, num_edges=len(problem.edges), status=solution.status,
        gap=solution.gap, solve_s=solution.solve_s, build_s=build_s,
    )
    log.info("intra-op on %s: %d nodes -> %d classes, %d edges; %s in %.2fs (build %.2fs)", cg.mesh,
             stats.num_nodes, stats.num_classes, stats.num_edges, stats.status, stats.solve_s, build_s)
    return decode(cg, solution.choices, stats)


def _least_memory(cg: CostGraph, problem: IlpProblem, build_s: float,
                  start_plan: np.ndarray | None) -> tuple[float, list[IntraOpResult]]:
    """The ILP's floor (least memory of any plan by its count) and, decoded, the fastest plan among
    those of least ILP memory, the least-memory plan itself, and the search's start (``start_plan``: a
    fitting baseline when ``compare`` hints with one)."""
    start = time.perf_counter()
    floor, choices = min_peak_plan(problem)
    fill = replace(problem, memory_budget_bytes=floor, hint=None)
    candidates = [IlpSolution(choices, evaluate(problem, choices).objective_s, "least-memory", 0.0,
                              time.perf_counter() - start, 0, 0)]
    unbounded = replace(problem, memory_budget_bytes=None)
    if start_plan is not None and not evaluate(unbounded, start_plan).violations:
        candidates.append(IlpSolution(np.asarray(start_plan), evaluate(problem, start_plan).objective_s, "start",
                                      0.0, 0.0, 0, 0))
    try:
        candidates.insert(0, solve(fill))
    except PlanningError:
        pass
    return floor, [_decoded(cg, unbounded, s, build_s) for s in candidates]


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
            runs = cg.edge_weight(c, pos)
            reshards.append(ReshardSite(op_index, pos, vid, src, dst, r.seconds * runs, tuple(r.collectives),
                                        tuple(r.path), runs))
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
    op_comm = _combined_comm_s(cg, chosen[cg.num_inputs:])
    return IntraOpResult(
        graph=graph, mesh=cg.mesh, node_strategies=chosen, value_specs=value_specs, input_specs=input_specs,
        output_specs=tuple(output_specs), reshards=tuple(reshards),
        compute_s=float(sum(op_compute)), comm_s=float(sum(op_comm)), op_comm_s=op_comm,
        reshard_s=float(sum(r.seconds for r in {(r.value, r.src, r.chain): r for r in reshards}.values())),
        memory_profile=profile, memory_by_role=by_role, ilp=stats, op_compute_s=op_compute, op_hbm_bytes=op_bytes,
    )


def _combined_comm_s(cg: CostGraph, op_strategies: Sequence[Strategy]) -> tuple[float, ...]:
    """Per op, its strategy's collectives as XLA issues them: all-reduces (and reduce-scatters, on XLA:CPU
    an all-reduce and a slice) combined into groups (rule 5 of the memory model) pay their latency once
    per group, on the group's first member; everything else is priced alone."""
    graph, mesh = cg.graph, cg.mesh
    reducing = {t: s.collectives for t, s in enumerate(op_strategies)
                if s.collectives and all(c.kind in ("all-reduce", "reduce-scatter") for c in s.collectives)}
    seconds = []
    for t, s in enumerate(op_strategies):
        latency = sum(cost.latency_s(mesh, c) for c in s.collectives) if t in reducing else 0.0
        seconds.append(max(0.0, s.comm_s - latency))
    groups = combine_all_reduces(graph, sorted(reducing), reducing,
                                 {t: op_strategies[t].reduction for t in reducing})
    for group in groups:
        seconds[min(group)] += max(cost.latency_s(mesh, c) for t in group for c in reducing[t])
    return tuple(float(s) * op.trip_count for s, op in zip(seconds, graph.ops))


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
