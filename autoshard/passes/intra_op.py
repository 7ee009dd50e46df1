"""Intra-op parallelism: choose a strategy for every node of an OpGraph on one logical mesh.

The graph becomes an ``IlpProblem`` (see ``passes/ilp_cpsat.py`` for the formulation):

- nodes: every input leaf (its strategies are storage specs: replicated, or
  split over any mesh axes — FSDP/ZeRO layouts are points of this space) and
  every op (strategies from the rule table);
- classes (``passes/simplify.py``): followers and repeated layers share one
  ILP variable, so a 24-layer model costs about what a 2-layer one does;
- node cost: compute plus the collectives the strategy itself needs;
- edges: resharding from the producer's output spec to the consumer's
  required input spec, and, for state the step returns updated, from the new
  value's spec back to the input's storage spec (the next step reads it);
- memory: per-device bytes of the values live at a few liveness peaks ≤ budget.

The solver is hinted with the best of several greedy starts after ICM
(data-parallel, sharded state, replicated, the classic layouts, a previous
plan; ``passes/starts.py``), so the result is never worse than any of them
under the model. This module keeps the options and result types, the lowering
(``_Problem``, ``_build``), ``plan_intra_op``, ``decode`` and ``memory_profile``.
"""
from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from autoshard.compiler.graph import OpGraph, Role, ValueId, dtype_itemsize
from autoshard.compiler.spec import Collective, Spec
from autoshard.meshes.logical import LogicalMesh
from autoshard.passes import ilp
from autoshard.passes.liveness import liveness_intervals, materialized_values, simulate
from autoshard.passes.resharding import reshard, reshard_cost_matrix, spec_options
from autoshard.passes.simplify import NodeClasses, build_classes, op_token
from autoshard.passes.starts import best_start, hint_from
from autoshard.passes.strategies import Strategy, strategies_for

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IntraOpOptions:
    memory_budget_bytes: float | None = None  # per device; None: the cluster's device memory
    time_limit_s: float = 10.0  # CP-SAT wall-clock limit (after a deterministic local search)
    seed: int = 0  # CP-SAT seed: same input, same plan
    shard_state: bool = True  # allow sharded storage of parameters and optimizer state (FSDP/ZeRO)
    tie_layers: bool = True  # solve repeated layers once
    merge_followers: bool = True  # elementwise chains follow their producer
    num_memory_points: int = 8  # liveness points constrained in the ILP
    pinned_inputs: Mapping[int, Spec] = field(default_factory=dict)  # flat input index -> forced storage spec
    # a previous plan's chosen strategy per node (IntraOpResult.node_strategies, e.g. the best baseline's):
    # the ILP hint starts from it instead of the greedy data-parallel plan where the specs match
    hint: Sequence[Strategy] | None = None
    # extra starting points for the search: storage layouts (flat input index -> Spec) as functions of the
    # graph and mesh, e.g. the classic strategies' (the API passes autoshard.baselines.baseline_pins)
    start_layouts: Callable[[OpGraph, LogicalMesh], Sequence[Mapping[int, Spec]]] | None = None
    # value id -> (dims, mesh axes): an op output listed must be split over all those axes, on those dims; a
    # strategy that does not is forbidden (the data-parallel baselines keep the batch split through the step)
    required_splits: Mapping[ValueId, tuple[tuple[int, ...], tuple[str, ...]]] = field(default_factory=dict)


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


def _input_strategies(graph: OpGraph, mesh: LogicalMesh, options: IntraOpOptions) -> list[list[Strategy]]:
    """Storage choices of every input leaf; leaves with the same choices share one list object."""
    out: list[list[Strategy]] = []
    shared: dict[tuple, list[Strategy]] = {}
    for i, vid in enumerate(graph.inputs):
        value = graph.values[vid]
        if i in options.pinned_inputs:
            key: tuple = ("pinned", options.pinned_inputs[i])
            specs = [options.pinned_inputs[i]]
        elif value.role in (Role.PARAM, Role.OPT_STATE) and not options.shard_state:
            key, specs = ("replicated", value.rank), [Spec.replicated(value.rank)]
        else:
            key, specs = ("options", value.shape), None
        if key not in shared:
            specs = specs if specs is not None else spec_options(value.shape, mesh)
            shared[key] = [Strategy(in_specs=(), out_specs=(s,), compute_s=0.0, note="storage") for s in specs]
        out.append(shared[key])
    return out


def node_strategies(graph: OpGraph, mesh: LogicalMesh, options: IntraOpOptions) -> list[list[Strategy]]:
    """Strategies of every node: input storage specs, then op strategies (cached by op signature)."""
    found = _input_strategies(graph, mesh, options)
    cache: dict[tuple, list[Strategy]] = {}
    for op in graph.ops:
        key = op_token(graph, op)
        if key not in cache:
            ins = [graph.values[v] for v in op.inputs]
            outs = [graph.values[v] for v in op.outputs]
            cache[key] = strategies_for(op, ins, outs, mesh)
        found.append(cache[key])
    return found


class _Problem:
    """The graph-to-ILP lowering: classes, costs, edges and memory terms."""

    def __init__(self, graph: OpGraph, mesh: LogicalMesh, options: IntraOpOptions) -> None:
        self.graph, self.mesh, self.options = graph, mesh, options
        self.num_inputs = len(graph.inputs)
        self.strategies = node_strategies(graph, mesh, options)
        self.classes: NodeClasses = build_classes(graph, self.strategies, tie_layers=options.tie_layers,
                                                  merge_followers=options.merge_followers)
        self.producer: dict[ValueId, tuple[int, int]] = {}
        for i, vid in enumerate(graph.inputs):
            self.producer.setdefault(vid, (i, 0))
        for j, op in enumerate(graph.ops):
            for k, vid in enumerate(op.outputs):
                self.producer[vid] = (self.num_inputs + j, k)
        self.sizes = dict(zip(mesh.axis_names, mesh.shape))
        self._edge_cache: dict[tuple, np.ndarray] = {}

    # per-node views indexed by class strategy
    def node_cost(self, node: int) -> np.ndarray:
        own = np.array([s.cost_s for s in self.strategies[node]])
        return own[self.classes.strategy_map[node]]

    def out_specs(self, node: int, pos: int) -> list[Spec]:
        strats = self.strategies[node]
        return [strats[i].out_specs[pos] for i in self.classes.strategy_map[node]]

    def in_specs(self, node: int, pos: int) -> list[Spec]:
        strats = self.strategies[node]
        return [strats[i].in_specs[pos] for i in self.classes.strategy_map[node]]

    def edge_sites(self):
        """(producer node, out pos, consumer node, consumer in pos or -1 for carried, value id)."""
        graph = self.graph
        for j, op in enumerate(graph.ops):
            for pos, vid in enumerate(op.inputs):
                if vid in self.producer:
                    p, k = self.producer[vid]
                    yield p, k, self.num_inputs + j, pos, vid
        for out_index, in_index in enumerate(graph.carried):
            vid = graph.outputs[out_index]
            if in_index is not None and vid in self.producer and self.producer[vid][0] != in_index:
                p, k = self.producer[vid]
                yield p, k, in_index, -1, vid

    def edge_matrix(self, p: int, k: int, c: int, pos: int, vid: ValueId) -> np.ndarray:
        value = self.graph.values[vid]
        maps = self.classes.strategy_map
        # Tied layers repeat the same (strategy lists, maps, shape) edge many times: compute it once.
        key = (id(self.strategies[p]), maps[p].tobytes(), k, id(self.strategies[c]), maps[c].tobytes(), pos,
               value.shape, value.dtype)
        cached = self._edge_cache.get(key)
        if cached is None:
            cached = self._edge_cache[key] = self._edge_matrix(p, k, c, pos, value)
        return cached

    def _edge_matrix(self, p: int, k: int, c: int, pos: int, value) -> np.ndarray:
        srcs = self.out_specs(p, k)
        dsts = self.out_specs(c, 0) if pos < 0 else self.in_specs(c, pos)
        usrc, src_idx = _unique(srcs)
        udst, dst_idx = _unique(dsts)
        itemsize = dtype_itemsize(value.dtype)
        mat = reshard_cost_matrix(value.shape, itemsize, tuple(usrc), tuple(udst), self.mesh)
        return mat[np.ix_(src_idx, dst_idx)]

    def value_bytes(self, vid: ValueId) -> np.ndarray:
        """Per-device bytes of a value for each strategy of its producer's class."""
        node, k = self.producer[vid]
        value = self.graph.values[vid]
        return np.array([value.nbytes / s.num_shards(self.sizes) for s in self.out_specs(node, k)])


def _unique(specs: Sequence[Spec]) -> tuple[list[Spec], np.ndarray]:
    index: dict[Spec, int] = {}
    idx = np.array([index.setdefault(s, len(index)) for s in specs], dtype=np.int64)
    return list(index), idx


def _build(pb: _Problem) -> tuple[ilp.IlpProblem, np.ndarray]:
    cls = pb.classes
    n = cls.num_classes
    class_cost = [np.zeros(size) for size in cls.class_size]
    num_nodes = len(pb.strategies)
    for node in range(num_nodes):
        class_cost[cls.node_class[node]] += pb.node_cost(node)
    _forbid_unsplit(pb, class_cost)
    pair_cost: dict[tuple[int, int], np.ndarray] = {}
    for p, k, c, pos, vid in pb.edge_sites():
        cu, cv = int(cls.node_class[p]), int(cls.node_class[c])
        mat = pb.edge_matrix(p, k, c, pos, vid)
        if cu == cv:
            class_cost[cu] += np.diagonal(mat)
            continue
        key, m = ((cu, cv), mat) if cu < cv else ((cv, cu), mat.T)
        if key in pair_cost:
            pair_cost[key] = pair_cost[key] + m
        else:
            pair_cost[key] = m.copy()
    edges = [(u, v, m) for (u, v), m in pair_cost.items() if np.any(m != 0)]
    points = _memory_points(pb)
    budget = pb.options.memory_budget_bytes
    if budget is None:
        budget = pb.mesh.cluster.memory_per_device_bytes
    hint = best_start(pb, class_cost, edges, points, hint_from(pb, pb.options.hint))
    problem = ilp.IlpProblem(
        node_names=tuple(_class_name(pb, c) for c in range(n)),
        node_costs=tuple(class_cost),
        edges=tuple((u, v) for u, v, _ in edges),
        edge_costs=tuple(m for _, _, m in edges),
        memory_points=points,
        memory_budget_bytes=float(budget),
        hint=hint,
        time_limit_s=pb.options.time_limit_s,
        seed=pb.options.seed,
    )
    return problem, hint


def _forbid_unsplit(pb: _Problem, class_cost: list[np.ndarray]) -> None:
    """Infinite cost for op strategies that leave a value of ``options.required_splits`` unsplit.

    An op none of whose class's strategies complies (a rule without that split, a follower of an
    unsplit producer) is left free.
    """
    required = pb.options.required_splits
    if not required:
        return
    cls = pb.classes
    for j, op in enumerate(pb.graph.ops):
        wanted = [(k, required[v]) for k, v in enumerate(op.outputs) if v in required]
        if not wanted:
            continue
        node = pb.num_inputs + j
        ok = np.array([all(set(axes) <= {a for d in dims for a in s.out_specs[k].dims[d]}
                               for k, (dims, axes) in wanted) for s in pb.strategies[node]])
        ok = ok[cls.strategy_map[node]]  # per strategy of the node's class (a follower may not reach them all)
        cost = class_cost[cls.node_class[node]]
        if (ok & np.isfinite(cost)).any():
            cost[~ok] = np.inf


def _class_name(pb: _Problem, c: int) -> str:
    node = pb.classes.class_root[c]
    if node < pb.num_inputs:
        value = pb.graph.values[pb.graph.inputs[node]]
        return f"input {value.path}"
    op = pb.graph.ops[node - pb.num_inputs]
    return f"{op.primitive}#{op.id}" + (f" ({op.source})" if op.source else "")


def _memory_points(pb: _Problem) -> tuple[tuple[tuple[int, np.ndarray], ...], ...]:
    graph = pb.graph
    live = liveness_intervals(graph)
    keep = materialized_values(graph)
    num_points = len(graph.ops) + 1
    replicated = np.zeros(num_points)
    for vid, (start, stop) in live.items():
        if vid in keep and vid in pb.producer:
            replicated[start:stop + 1] += graph.values[vid].nbytes
    order = np.argsort(-replicated, kind="stable")
    chosen: list[int] = []
    spacing = max(1, num_points // (4 * pb.options.num_memory_points))
    for t in order:
        if all(abs(int(t) - c) >= spacing for c in chosen):
            chosen.append(int(t))
        if len(chosen) >= pb.options.num_memory_points:
            break
    points = []
    for t in sorted(chosen):
        terms: dict[int, np.ndarray] = {}
        for vid, (start, stop) in live.items():
            if start <= t <= stop and vid in keep and vid in pb.producer:
                node = pb.producer[vid][0]
                c = int(pb.classes.node_class[node])
                terms[c] = terms.get(c, 0) + pb.value_bytes(vid)
        points.append(tuple(sorted(terms.items())))
    return tuple(points)


def plan_intra_op(graph: OpGraph, mesh: LogicalMesh, options: IntraOpOptions | None = None) -> IntraOpResult:
    """Solve the intra-op ILP for ``graph`` on ``mesh`` and decode the chosen specs."""
    options = options or IntraOpOptions()
    start = time.perf_counter()
    pb = _Problem(graph, mesh, options)
    problem, _hint = _build(pb)
    build_s = time.perf_counter() - start
    solution = ilp.solve(problem)
    check = ilp.evaluate(problem, solution.choices)
    if check.violations:
        raise ilp.PlanningError("the ILP solution violates its own constraints: " + "; ".join(check.violations))
    stats = IlpStats(
        num_nodes=len(pb.strategies), num_classes=pb.classes.num_classes, num_followers=pb.classes.num_followers,
        num_tied=pb.classes.num_tied, num_variables=solution.num_variables,
        num_constraints=solution.num_constraints, num_edges=len(problem.edges), status=solution.status,
        gap=solution.gap, solve_s=solution.solve_s, build_s=build_s,
    )
    log.info("intra-op on %s: %d nodes -> %d classes, %d edges; %s in %.2fs (build %.2fs)", mesh,
             stats.num_nodes, stats.num_classes, stats.num_edges, stats.status, stats.solve_s, build_s)
    return decode(pb, solution.choices, stats)


def decode(pb: _Problem, choices: np.ndarray, stats: IlpStats) -> IntraOpResult:
    graph, cls = pb.graph, pb.classes
    chosen = tuple(pb.strategies[node][cls.strategy_map[node][choices[cls.node_class[node]]]]
                   for node in range(len(pb.strategies)))
    value_specs: dict[ValueId, Spec] = {}
    for vid, (node, k) in pb.producer.items():
        value_specs[vid] = chosen[node].out_specs[k]
    input_specs = tuple(chosen[i].out_specs[0] for i in range(pb.num_inputs))
    reshards: list[ReshardSite] = []
    for p, k, c, pos, vid in pb.edge_sites():
        src = chosen[p].out_specs[k]
        dst = chosen[c].out_specs[0] if pos < 0 else chosen[c].in_specs[pos]
        if src != dst:
            value = graph.values[vid]
            r = reshard(value.shape, dtype_itemsize(value.dtype), src, dst, pb.mesh)
            op_index = -1 if pos < 0 else c - pb.num_inputs
            reshards.append(ReshardSite(op_index, pos, vid, src, dst, r.seconds, tuple(r.collectives), tuple(r.path)))
    output_specs = []
    for out_index, vid in enumerate(graph.outputs):
        carried = graph.carried[out_index] if graph.carried else None
        if carried is not None:
            output_specs.append(input_specs[carried])
        else:
            output_specs.append(value_specs.get(vid, Spec.replicated(graph.values[vid].rank)))
    profile, by_role = memory_profile(graph, value_specs, pb.sizes, reshards, chosen[pb.num_inputs:])
    return IntraOpResult(
        graph=graph, mesh=pb.mesh, node_strategies=chosen, value_specs=value_specs, input_specs=input_specs,
        output_specs=tuple(output_specs), reshards=tuple(reshards),
        compute_s=float(sum(s.compute_s for s in chosen)), comm_s=float(sum(s.comm_s for s in chosen)),
        reshard_s=float(sum(r.seconds for r in {(r.value, r.src, r.chain): r for r in reshards}.values())),
        memory_profile=profile, memory_by_role=by_role, ilp=stats,
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
