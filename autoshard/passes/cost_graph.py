"""The cost graph of the intra-op pass: every node's strategies, node and edge costs, memory terms.

Built once per (graph, logical mesh, options) and read, never mutated, by the search starts
(``passes/search_starts.py``), the ILP lowering and the decoding (``passes/intra_op.py``):

- nodes: every input leaf (its strategies are storage specs: replicated, or
  split over any mesh axes — FSDP/ZeRO layouts are points of this space) and
  every op (strategies from the rule table);
- classes (``passes/simplify.py``): followers and repeated layers share one
  ILP variable, so a 24-layer model costs about what a 2-layer one does;
- node cost: compute plus the collectives the strategy itself needs;
- edges: resharding from the producer's output spec to the consumer's
  required input spec, and, for state the step returns updated, from the new
  value's spec back to the input's storage spec (the next step reads it);
- memory: per-device bytes of the values live at a few liveness peaks.

Loops (a flattened scan, ``ir/graph.LoopRegion``): an op inside runs
``trip_count`` times, so its compute and collectives, and the resharding into
it, count that many times (``edge_weight``); a carry's layout is one choice
(its ``loop_carry`` node), and the body's carry out reshards to it every
iteration, priced as an edge from the carry out's producer to that node. A while loop is the same
at its trip count. A cond (``kind == "cond"``): its operands' and results' layouts are one choice each
(``loop_carry``, ``cond_merge``), its costliest branch is priced and the others' ops weigh 0
(``ir/trace.py``), so is a reshard into the merge from a branch that is not priced. Such a branch
takes, after the solve, the layouts that reshard least from and to its neighbours (``follow_unpriced``):
XLA allocates it as it does the priced one.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass, field

import numpy as np

from autoshard.ir.graph import OpGraph, Role, Value, ValueId, dtype_itemsize
from autoshard.ir.spec import Spec
from autoshard.meshes import cost
from autoshard.meshes.logical import LogicalMesh
from autoshard.passes.hbm_traffic import compute_dtype, op_traffic, strategies_work
from autoshard.passes.ilp.problem import SharedCharge, SharedReshard, SolverName
from autoshard.passes.memory_model import liveness_intervals, materialized_values
from autoshard.passes.deferral import StackSite, extra_bytes, stack_sites, twins
from autoshard.passes.objective import (EdgeSite, edge_runs, edge_sites, late_reductions,
                                        latency_charges, own_comm_s)
from autoshard.passes.resharding import reshard_cost_matrix, spec_options
from autoshard.passes.simplify import NodeClasses, build_classes, op_token
from autoshard.passes.strategies import Strategy, strategies_for

ClassEdge = tuple[int, int, np.ndarray]  # (class u, class v, cost matrix)
MemoryPoints = tuple[tuple[tuple[int, np.ndarray], ...], ...]


@dataclass(frozen=True)
class IntraOpOptions:
    memory_budget_bytes: float | None = None  # per device; None: the cluster's device memory
    # solver wall-clock limit per solve (the rounds of a budget search share it). A solve returns as soon as it is
    # proven: on two cores every benchmark cell's is within 13 s (benchmarks/SOLVER_GAPS.md; the MoE cells on
    # 2x8-a100 take 11-13 s, and stopped at 10 s they return a plan 7% slower than the optimum, 17-19% from the
    # bound), most within 8 s. A limit below the proof returns the best plan found and its gap to the bound
    time_limit_s: float = 20.0
    solver: SolverName = "mip"  # the ILP backend: "mip" (HiGHS) or "cpsat" (OR-Tools CP-SAT)
    seed: int = 0  # CP-SAT's and the local search's seed: same input, same plan
    shard_state: bool = True  # allow sharded storage of parameters and optimizer state (FSDP/ZeRO)
    tie_layers: bool = True  # solve repeated layers once
    merge_followers: bool = True  # elementwise chains follow their producer
    # a scanned stack's gradient may leave its partial sums to the loop's end (passes/deferral.py)
    defer_stack_reductions: bool = True
    num_memory_points: int = 8  # liveness points constrained in the ILP
    pinned_inputs: Mapping[int, Spec] = field(default_factory=dict)  # flat input index -> forced storage spec
    # a previous plan's chosen strategy per node (IntraOpResult.node_strategies, e.g. the best baseline's):
    # the ILP hint starts from it instead of the greedy data-parallel plan where the specs match
    hint: Sequence[Strategy] | None = None
    # also start the search from every classic strategy's storage layouts (passes/classic.py); skipped when
    # every input is pinned (a baseline), since no layout start could move them
    classic_starts: bool = True
    # extra starting points for the search: storage layouts (flat input index -> Spec) as functions of the
    # graph and mesh
    start_layouts: Callable[[OpGraph, LogicalMesh], Sequence[Mapping[int, Spec]]] | None = None
    # value id -> (dims, mesh axes): an op output listed must be split over all those axes, on those dims; a
    # strategy that does not is forbidden (the data-parallel baselines keep the batch split through the step)
    required_splits: Mapping[ValueId, tuple[tuple[int, ...], tuple[str, ...]]] = field(default_factory=dict)



def input_strategies(graph: OpGraph, mesh: LogicalMesh, options: IntraOpOptions) -> list[list[Strategy]]:
    """Storage choices of every input leaf; leaves with the same choices share one list object. A batch
    leaf's choice costs its shard's arrival from the host (``meshes.cost.host_load_s``) every step."""
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
        loaded = value.role == Role.BATCH  # arrives from the host every step (``cost.host_load_s``)
        key = (*key, value.nbytes if loaded else 0)
        if key not in shared:
            specs = specs if specs is not None else spec_options(value.shape, mesh)
            sizes = dict(zip(mesh.axis_names, mesh.shape))
            shared[key] = [Strategy(in_specs=(), out_specs=(s,), note="storage",
                                    compute_s=cost.host_load_s(mesh.cluster, value.nbytes / s.num_shards(sizes))
                                    if loaded else 0.0) for s in specs]
        out.append(shared[key])
    return out


def node_strategies(graph: OpGraph, mesh: LogicalMesh, options: IntraOpOptions,
                    sites: Mapping[int, StackSite]) -> list[list[Strategy]]:
    """Strategies of every node: input storage specs, then op strategies (cached by op signature), with
    the deferred twins of the ops in ``sites`` (``passes/deferral.py``)."""
    found = input_strategies(graph, mesh, options)
    cache: dict[tuple, list[Strategy]] = {}
    for j, op in enumerate(graph.ops):
        key = (op_token(graph, op), op.trip_count)  # a strategy's FLOPs count every run of its op
        if key not in cache:
            ins = [graph.values[v] for v in op.inputs]
            outs = [graph.values[v] for v in op.outputs]
            cache[key] = strategies_for(op, ins, outs, mesh)
        own = cache[key]
        if j in sites:
            own = own + twins(graph, sites[j], own, dict(zip(mesh.axis_names, mesh.shape)))
        found.append(own)
    return found


class CostGraph:
    """Strategies, classes, costs, edges and memory terms of one graph on one mesh (module docstring)."""

    def __init__(self, graph: OpGraph, mesh: LogicalMesh, options: IntraOpOptions) -> None:
        self.graph, self.mesh, self.options = graph, mesh, options
        self.num_inputs = len(graph.inputs)
        self.sites = stack_sites(graph) if options.defer_stack_reductions else {}
        self.strategies = node_strategies(graph, mesh, options, self.sites)
        self.classes: NodeClasses = build_classes(graph, self.strategies, tie_layers=options.tie_layers,
                                                  merge_followers=options.merge_followers)
        self.producer: dict[ValueId, tuple[int, int]] = {}
        for i, vid in enumerate(graph.inputs):
            self.producer.setdefault(vid, (i, 0))
        for j, op in enumerate(graph.ops):
            for k, vid in enumerate(op.outputs):
                self.producer[vid] = (self.num_inputs + j, k)
        self.sizes = dict(zip(mesh.axis_names, mesh.shape))
        self.traffic = op_traffic(graph)
        self.late = late_reductions(graph)
        self._edge_cache: dict[tuple, np.ndarray] = {}
        self._compute_cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._dst_cache: dict[tuple, tuple[Spec, ...]] = {}

    @functools.cached_property
    def terms(self) -> ProblemTerms:
        """The ILP's terms no budget changes (``ProblemTerms``), once; their arrays refuse writes."""
        class_cost, edges, reshards = class_costs_and_edges(self)
        points = memory_points(self)
        for array in (*class_cost, *(m for _, _, m in edges), *(g.costs for g in reshards),
                      *(a for point in points for _, a in point)):
            if isinstance(array, np.ndarray):
                array.setflags(write=False)
        return ProblemTerms(tuple(class_cost), tuple(edges), tuple(reshards), tuple(combined_latency_charges(self)),
                            points)

    def op_work(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        """Per strategy of op ``j`` (its own list, not its class's): fused compute seconds and HBM bytes,
        of all its runs (``Op.trip_count``)."""
        op, strategies = self.graph.ops[j], self.strategies[self.num_inputs + j]
        key = (id(strategies), self.traffic[j], compute_dtype(op, self.graph), op.trip_count)
        if key not in self._compute_cache:
            self._compute_cache[key] = strategies_work(self.graph, op, self.traffic[j], strategies, self.sizes,
                                                       self.mesh.cluster)
        return self._compute_cache[key]

    def comm_s(self, j: int, strategy: Strategy) -> float:
        """The strategy's own collectives, all runs of the op; for a late reduction (``late_reductions``)
        without their latency, which the combined all-reduce pays once for all of them."""
        return own_comm_s(self.graph, self.mesh, j, strategy, self.late)

    def edge_weight(self, c: int, pos: int) -> int:
        """How many times a reshard into node ``c`` (input ``pos``; -1: written back) runs per step
        (``objective.edge_runs``)."""
        return edge_runs(self.graph, self.num_inputs, c, pos)

    # per-node views indexed by class strategy
    def node_cost(self, node: int) -> np.ndarray:
        """Fused compute plus the strategy's own collectives, per strategy of the node's class."""
        strategies = self.strategies[node]
        if node < self.num_inputs:
            own = np.array([s.cost_s for s in strategies])  # a batch's load from the host
        else:
            j = node - self.num_inputs
            own = np.array([self.comm_s(j, s) for s in strategies]) + self.op_work(j)[0]
        return own[self.classes.strategy_map[node]]

    def out_specs(self, node: int, pos: int) -> list[Spec]:
        strats = self.strategies[node]
        return [strats[i].out_specs[pos] for i in self.classes.strategy_map[node]]

    def in_specs(self, node: int, pos: int) -> list[Spec]:
        strats = self.strategies[node]
        return [strats[i].in_specs[pos] for i in self.classes.strategy_map[node]]

    def dst_specs(self, c: int, pos: int) -> tuple[Spec, ...]:
        """Per strategy of node ``c``'s class, the spec it reads input ``pos`` in (-1: its storage spec)."""
        key = (id(self.strategies[c]), self.classes.strategy_map[c].tobytes(), pos)
        found = self._dst_cache.get(key)
        if found is None:
            found = self._dst_cache[key] = tuple(self.out_specs(c, 0) if pos < 0 else self.in_specs(c, pos))
        return found

    def edge_sites(self) -> Iterator[EdgeSite]:
        """(producer node, out pos, consumer node, consumer in pos or -1 for carried, value id)."""
        return edge_sites(self.graph, self.producer)

    def edge_matrix(self, p: int, k: int, c: int, pos: int, vid: ValueId, runs: int | None = None) -> np.ndarray:
        """Resharding seconds from each strategy of ``p``'s class to each of ``c``'s, over all the reshard's runs
        per step (``edge_weight``), or over ``runs``."""
        value = self.graph.values[vid]
        maps = self.classes.strategy_map
        # Tied layers repeat the same (strategy lists, maps, shape) edge many times: compute it once.
        key = (id(self.strategies[p]), maps[p].tobytes(), k, id(self.strategies[c]), maps[c].tobytes(), pos,
               value.shape, value.dtype)
        cached = self._edge_cache.get(key)
        if cached is None:
            cached = self._edge_cache[key] = self._edge_matrix(p, k, c, pos, value)
        weight = self.edge_weight(c, pos) if runs is None else runs
        return cached if weight == 1 else cached * weight

    def _edge_matrix(self, p: int, k: int, c: int, pos: int, value: Value) -> np.ndarray:
        srcs = self.out_specs(p, k)
        dsts = self.out_specs(c, 0) if pos < 0 else self.in_specs(c, pos)
        usrc, src_idx = _unique(srcs)
        udst, dst_idx = _unique(dsts)
        itemsize = dtype_itemsize(value.dtype)
        mat = reshard_cost_matrix(value.shape, itemsize, tuple(usrc), tuple(udst), self.mesh)
        return mat[np.ix_(src_idx, dst_idx)]

    def follow_unpriced(self, choices: np.ndarray) -> np.ndarray:
        """``choices`` (one strategy per class) with every class that never runs (a cond's branches other than
        the priced one, module docstring) moved to the strategy that reshards least from and to its
        neighbours as chosen, in program order, twice (a read's and a write's side settle). Such a class
        weighs nothing in the objective, so the solver leaves it on any strategy, a whole-weight all-gather
        as well as none; XLA still lays out and allocates its buffers. Each reshard counts at one run;
        a strategy the class forbids (infinite cost) is never taken. The objective does not change."""
        sites = self._unpriced_sites
        if not sites:
            return choices
        cls = self.classes
        allowed = [np.isfinite(cost) for cost in self.terms.class_cost]
        out = np.array(choices, dtype=np.int64, copy=True)
        for _ in range(2):
            for c, touching in sites.items():
                seconds = np.zeros(cls.class_size[c])
                for p, k, n, pos, vid in touching:
                    matrix = self.edge_matrix(p, k, n, pos, vid, runs=1)
                    cp, cn = int(cls.node_class[p]), int(cls.node_class[n])
                    if cp == c and cn == c:
                        seconds += np.diagonal(matrix)
                    elif cp == c:
                        seconds += matrix[:, out[cn]]
                    else:
                        seconds += matrix[out[cp], :]
                seconds = np.where(allowed[c] & np.isfinite(seconds), seconds, np.inf)
                if np.isfinite(seconds).any() and seconds.min() < seconds[out[c]]:
                    out[c] = int(np.argmin(seconds))
        return out

    @functools.cached_property
    def _unpriced_sites(self) -> dict[int, list[EdgeSite]]:
        """Per class none of whose nodes ever runs (``follow_unpriced``), in class order, the edge sites
        touching it."""
        cls, num_inputs = self.classes, self.num_inputs
        runs = np.zeros(cls.num_classes, dtype=bool)
        for node in range(len(self.strategies)):
            if node < num_inputs or self.graph.ops[node - num_inputs].trip_count:
                runs[cls.node_class[node]] = True
        sites: dict[int, list[EdgeSite]] = {}
        if runs.all():
            return sites
        for site in self.edge_sites():
            for node in {site[0], site[2]}:
                c = int(cls.node_class[node])
                if not runs[c]:
                    sites.setdefault(c, []).append(site)
        return dict(sorted(sites.items()))

    def value_bytes(self, vid: ValueId) -> np.ndarray:
        """Per-device bytes of a value for each strategy of its producer's class."""
        node, k = self.producer[vid]
        value = self.graph.values[vid]
        return np.array([value.nbytes / s.num_shards(self.sizes) for s in self.out_specs(node, k)])


def _unique(specs: Sequence[Spec]) -> tuple[list[Spec], np.ndarray]:
    index: dict[Spec, int] = {}
    idx = np.array([index.setdefault(s, len(index)) for s in specs], dtype=np.int64)
    return list(index), idx




@dataclass(frozen=True, eq=False)
class ProblemTerms:
    """The ILP's terms over class strategies that no memory budget changes: computed once per cost graph
    (``CostGraph.terms``) and shared by every solve of it (cuts, least-budget probes, search starts)."""

    class_cost: tuple[np.ndarray, ...]  # per class: its nodes' costs and the edges inside it
    edges: tuple[ClassEdge, ...]  # between classes, summed per pair
    reshards: tuple[SharedReshard, ...]  # values read in several layouts: each distinct one made once
    charges: tuple[SharedCharge, ...]  # combined reductions' latencies
    points: MemoryPoints


def class_costs_and_edges(cg: CostGraph) -> tuple[list[np.ndarray], list[ClassEdge], list[SharedReshard]]:
    """Per class its summed node costs (plus edges inside it); edges between classes, summed per pair; and
    the shared reshards.

    The reshards of one value follow XLA's common-subexpression elimination: a value read in one layout
    by several consumers is resharded once. Readers that always read alike (one class, the same layout
    for each of its strategies, as often) are one reader; a value whose remaining readers can ask for the
    same non-free layout becomes a ``SharedReshard`` (a layout made once, whoever reads it); the others are
    plain edges, one per reader."""
    cls = cg.classes
    class_cost = [np.zeros(size) for size in cls.class_size]
    for node in range(len(cg.strategies)):
        class_cost[cls.node_class[node]] += cg.node_cost(node)
    forbid_unsplit(cg, class_cost)
    by_value: dict[tuple[int, int], dict[tuple, tuple[int, int, ValueId]]] = {}
    for p, k, c, pos, vid in cg.edge_sites():
        runs = cg.edge_weight(c, pos)
        if runs:
            key = (int(cls.node_class[c]), cg.dst_specs(c, pos), runs)
            by_value.setdefault((p, k), {}).setdefault(key, (c, pos, vid))
    pair_cost: dict[tuple[int, int], np.ndarray] = {}
    shared: dict[tuple, list] = {}
    for (p, k), readers in by_value.items():
        vid = next(iter(readers.values()))[2]
        if len(readers) > 1 and _readers_may_share(cg, p, k, vid, list(readers)):
            key = (int(cls.node_class[p]), id(cg.strategies[p]), cls.strategy_map[p].tobytes(), k,
                   frozenset(readers), cg.graph.values[vid].shape, cg.graph.values[vid].dtype)
            if key in shared:
                shared[key][1] += 1
            else:
                shared[key] = [(p, k, vid, list(readers)), 1]
            continue
        for c, pos, _vid in readers.values():
            cu, cv = int(cls.node_class[p]), int(cls.node_class[c])
            mat = cg.edge_matrix(p, k, c, pos, vid)
            if cu == cv:
                class_cost[cu] += np.diagonal(mat)
                continue
            pair, m = ((cu, cv), mat) if cu < cv else ((cv, cu), mat.T)
            pair_cost[pair] = pair_cost[pair] + m if pair in pair_cost else m.copy()
    reshards = [_shared_reshard(cg, *found, copies) for found, copies in shared.values()]
    return class_cost, [(u, v, m) for (u, v), m in pair_cost.items() if np.any(m != 0)], reshards


def _readers_may_share(cg: CostGraph, p: int, k: int, vid: ValueId, readers: list[tuple]) -> bool:
    """Whether two readers (``(class, dst specs, runs)``) of one value can ask for the same layout at a
    price: only then does making it once differ from pricing each reader's edge."""
    value = cg.graph.values[vid]
    srcs = tuple(dict.fromkeys(cg.out_specs(p, k)))
    for i, (_c1, dsts1, runs1) in enumerate(readers):
        for _c2, dsts2, runs2 in readers[i + 1:]:
            common = tuple(set(dsts1) & set(dsts2)) if runs1 == runs2 else ()
            if common and reshard_cost_matrix(value.shape, dtype_itemsize(value.dtype), srcs, common,
                                              cg.mesh).max() > 0:
                return True
    return False


def _shared_reshard(cg: CostGraph, p: int, k: int, vid: ValueId, readers: list[tuple], copies: int) -> SharedReshard:
    """The ``SharedReshard`` of one value (times ``copies`` alike: tied layers) over class strategies."""
    cls = cg.classes
    value = cg.graph.values[vid]
    layouts: dict[tuple[Spec, int], int] = {}
    index = [np.array([layouts.setdefault((d, runs), len(layouts)) for d in dsts], dtype=np.int64)
             for _c, dsts, runs in readers]
    srcs, src_idx = _unique(cg.out_specs(p, k))
    dst_specs = tuple(dict.fromkeys(d for d, _runs in layouts))
    matrix = reshard_cost_matrix(value.shape, dtype_itemsize(value.dtype), tuple(srcs), dst_specs, cg.mesh)
    column = {d: j for j, d in enumerate(dst_specs)}
    costs = np.stack([matrix[src_idx, column[d]] * runs * copies for d, runs in layouts], axis=1)
    return SharedReshard(f"value {vid} ({len(readers)} readers)" + (f" x{copies}" if copies > 1 else ""),
                         int(cls.node_class[p]), costs,
                         tuple((int(c), layout) for (c, _dsts, _runs), layout in zip(readers, index)))


def combined_latency_charges(cg: CostGraph) -> list[SharedCharge]:
    """The shared charges of the combined reductions (``objective.latency_charges``: the latency the late
    reductions, priced without it in ``node_cost``, pay once together), over class strategies: charged
    when any class chooses a strategy that incurs it."""
    cls = cg.classes
    ops = cg.strategies[cg.num_inputs:]
    out = []
    for charge in latency_charges(cg.graph, cg.mesh, ops, cg.late):
        members: dict[int, np.ndarray] = {}
        for j, mask in charge.members.items():
            node = cg.num_inputs + j
            c = int(cls.node_class[node])
            own = mask[cls.strategy_map[node]]
            members[c] = members[c] | own if c in members else own
        out.append(SharedCharge(charge.name, charge.cost_s, tuple(members.items())))
    return out


def forbid_unsplit(cg: CostGraph, class_cost: list[np.ndarray]) -> None:
    """Infinite cost for op strategies that leave a value of ``options.required_splits`` unsplit.

    An op none of whose class's strategies complies (a rule without that split, a follower of an
    unsplit producer) is left free.
    """
    required = cg.options.required_splits
    if not required:
        return
    cls = cg.classes
    for j, op in enumerate(cg.graph.ops):
        wanted = [(k, required[v]) for k, v in enumerate(op.outputs) if v in required]
        if not wanted:
            continue
        node = cg.num_inputs + j
        ok = np.array([all(set(axes) <= {a for d in dims for a in s.out_specs[k].dims[d]}
                               for k, (dims, axes) in wanted) for s in cg.strategies[node]])
        ok = ok[cls.strategy_map[node]]  # per strategy of the node's class (a follower may not reach them all)
        cost = class_cost[cls.node_class[node]]
        if (ok & np.isfinite(cost)).any():
            cost[~ok] = np.inf


def class_name(cg: CostGraph, c: int) -> str:
    node = cg.classes.class_root[c]
    if node < cg.num_inputs:
        value = cg.graph.values[cg.graph.inputs[node]]
        return f"input {value.path}"
    op = cg.graph.ops[node - cg.num_inputs]
    return f"{op.primitive}#{op.id}" + (f" ({op.source})" if op.source else "")


def point_positions(cg: CostGraph, live: Mapping[ValueId, tuple[int, int]] | None = None,
                    keep: Set[ValueId] | None = None) -> list[int]:
    """The positions of the ILP's memory points, in order, in XLA:CPU's breadth-first order (that of
    ``liveness_intervals``; ``memory_model.op_positions`` places the ops in it): the most replicated bytes
    live, spread over the step (``live``, ``keep``: the graph's liveness intervals and materialised values,
    when already computed)."""
    graph = cg.graph
    live = liveness_intervals(graph) if live is None else live
    keep = materialized_values(graph) if keep is None else keep
    num_points = len(graph.ops) + 1
    change = np.zeros(num_points + 1)  # bytes that start (+) and stop (-) living at each point
    for vid, (start, stop) in live.items():
        if vid in keep and vid in cg.producer:
            change[start] += graph.values[vid].nbytes
            change[min(stop + 1, num_points)] -= graph.values[vid].nbytes
    replicated = np.cumsum(change[:num_points])
    order = np.argsort(-replicated, kind="stable")
    chosen: list[int] = []
    spacing = max(1, num_points // (4 * cg.options.num_memory_points))
    for t in order:
        if all(abs(int(t) - c) >= spacing for c in chosen):
            chosen.append(int(t))
        if len(chosen) >= cg.options.num_memory_points:
            break
    return sorted(chosen)


def memory_points(cg: CostGraph) -> MemoryPoints:
    graph = cg.graph
    live = liveness_intervals(graph)
    keep = materialized_values(graph)
    held = []  # a deferred twin's stack of partial sums, over its loop: (first point, end, class, bytes)
    for j, site in cg.sites.items():
        node, region = cg.num_inputs + j, graph.loops[site.loop]
        extra = extra_bytes(graph, site, cg.strategies[node], cg.sizes)[cg.classes.strategy_map[node]]
        if extra.any():
            held.append((region.start, region.stop, int(cg.classes.node_class[node]), extra))
    points = []
    for t in point_positions(cg, live, keep):
        terms: dict[int, np.ndarray] = {}
        for vid, (start, stop) in live.items():
            if start <= t <= stop and vid in keep and vid in cg.producer:
                node = cg.producer[vid][0]
                c = int(cg.classes.node_class[node])
                terms[c] = terms.get(c, 0) + cg.value_bytes(vid)
        for start, stop, c, extra in held:
            if start <= t < stop:
                terms[c] = terms.get(c, 0) + extra
        points.append(tuple(sorted(terms.items())))
    return tuple(points)
