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
(``ir/trace.py``), so is a reshard into the merge from a branch that is not priced.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from autoshard.ir.graph import OpGraph, Role, Value, ValueId, dtype_itemsize
from autoshard.ir.spec import Spec
from autoshard.meshes import cost
from autoshard.meshes.logical import LogicalMesh
from autoshard.passes.hbm_traffic import compute_dtype, op_traffic, strategy_compute_s, strategy_hbm_bytes
from autoshard.passes.ilp.problem import SharedCharge
from autoshard.passes.liveness import OpKind, op_kind
from autoshard.passes.memory_model import liveness_intervals, materialized_values
from autoshard.passes.resharding import reshard_cost_matrix, spec_options
from autoshard.passes.simplify import NodeClasses, build_classes, op_token
from autoshard.passes.strategies import Strategy, strategies_for

EdgeSite = tuple[int, int, int, int, ValueId]  # (producer node, out pos, consumer node, in pos or -1, value)
ClassEdge = tuple[int, int, np.ndarray]  # (class u, class v, cost matrix)
MemoryPoints = tuple[tuple[tuple[int, np.ndarray], ...], ...]


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
    # also start the search from every classic strategy's storage layouts (passes/classic.py); skipped when
    # every input is pinned (a baseline), since no layout start could move them
    classic_starts: bool = True
    # extra starting points for the search: storage layouts (flat input index -> Spec) as functions of the
    # graph and mesh
    start_layouts: Callable[[OpGraph, LogicalMesh], Sequence[Mapping[int, Spec]]] | None = None
    # value id -> (dims, mesh axes): an op output listed must be split over all those axes, on those dims; a
    # strategy that does not is forbidden (the data-parallel baselines keep the batch split through the step)
    required_splits: Mapping[ValueId, tuple[tuple[int, ...], tuple[str, ...]]] = field(default_factory=dict)



LOOP_EXITS = frozenset({"loop_stack", "loop_final"})


def late_reductions(graph: OpGraph) -> frozenset[int]:
    """Ops whose results reach no contraction, reduction or other unfusible op: the partial sums they
    reduce (the gradients of a data-parallel step) are independent of each other, and XLA's all-reduce
    combiner issues them as one collective (``passes/buffer_rules.combine_all_reduces``)."""
    consumers = graph.consumers()
    feeds: list[bool] = [False] * len(graph.ops)
    index = {id(op): t for t, op in enumerate(graph.ops)}
    for t in range(len(graph.ops) - 1, -1, -1):
        users = [c for v in graph.ops[t].outputs for c in consumers.get(v, ())]
        # a loop's stacked outputs and final carries are written where they lie: their readers decide
        feeds[t] = any((op_kind(c) in (OpKind.OPAQUE, OpKind.REDUCTION) and c.primitive not in LOOP_EXITS)
                       or feeds[index[id(c)]] for c in users)
    return frozenset(t for t in range(len(graph.ops)) if not feeds[t])


def input_strategies(graph: OpGraph, mesh: LogicalMesh, options: IntraOpOptions) -> list[list[Strategy]]:
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
    found = input_strategies(graph, mesh, options)
    cache: dict[tuple, list[Strategy]] = {}
    for op in graph.ops:
        key = (op_token(graph, op), op.trip_count)  # a strategy's FLOPs count every run of its op
        if key not in cache:
            ins = [graph.values[v] for v in op.inputs]
            outs = [graph.values[v] for v in op.outputs]
            cache[key] = strategies_for(op, ins, outs, mesh)
        found.append(cache[key])
    return found


class CostGraph:
    """Strategies, classes, costs, edges and memory terms of one graph on one mesh (module docstring)."""

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
        self.traffic = op_traffic(graph)
        self.late = late_reductions(graph)
        self._edge_cache: dict[tuple, np.ndarray] = {}
        self._compute_cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self.budget_probes: dict[tuple[float, float], float] = {}  # intra_op: smallest budgets already found
        self.problem_terms: tuple | None = None  # intra_op: the ILP terms no budget changes, once

    def op_work(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        """Per strategy of op ``j`` (its own list, not its class's): fused compute seconds and HBM bytes,
        of all its runs (``Op.trip_count``)."""
        op, strategies = self.graph.ops[j], self.strategies[self.num_inputs + j]
        key = (id(strategies), self.traffic[j], compute_dtype(op, self.graph), op.trip_count)
        if key not in self._compute_cache:
            hbm = op.trip_count * np.array([
                strategy_hbm_bytes(self.graph, op, self.traffic[j], s.in_specs, s.out_specs, self.sizes)
                for s in strategies])
            flops = np.array([s.flops for s in strategies])
            self._compute_cache[key] = (strategy_compute_s(self.mesh.cluster, flops, hbm, key[2]), hbm)
        return self._compute_cache[key]

    def comm_s(self, j: int, strategy: Strategy) -> float:
        """The strategy's own collectives, all runs of the op; for a late reduction (``late_reductions``)
        without their latency, which the combined all-reduce pays once for all of them."""
        trips = self.graph.ops[j].trip_count
        if j not in self.late or not strategy.collectives:
            return strategy.comm_s * trips
        return trips * max(0.0, strategy.comm_s - sum(cost.latency_s(self.mesh, c) for c in strategy.collectives))

    def edge_weight(self, c: int, pos: int) -> int:
        """How many times a reshard into node ``c`` (input ``pos``; -1: written back) runs per step: the
        consumer op's trip count; a loop's carry out written back to its carry, every iteration."""
        if c < self.num_inputs:
            return 1
        op = self.graph.ops[c - self.num_inputs]
        if pos < 0 and op.primitive == "loop_carry":
            return op.trip_count * int(op.params["length"])
        if op.primitive == "cond_merge" and pos != op.params["priced"]:
            return 0  # that branch runs instead of the priced one: the cond costs its costliest branch
        return op.trip_count

    # per-node views indexed by class strategy
    def node_cost(self, node: int) -> np.ndarray:
        """Fused compute plus the strategy's own collectives, per strategy of the node's class."""
        strategies = self.strategies[node]
        if node < self.num_inputs:
            own = np.array([s.comm_s for s in strategies])
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

    def edge_sites(self) -> Iterator[EdgeSite]:
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
        for region in graph.loops:  # a loop's carry out, written back to its carry's layout
            if region.kind == "cond":
                continue
            for carry, final in zip(region.carry_ops, region.final_ops):
                vid = graph.ops[final].inputs[0]
                c = self.num_inputs + carry
                if vid in self.producer and self.producer[vid][0] != c:
                    p, k = self.producer[vid]
                    yield p, k, c, -1, vid

    def edge_matrix(self, p: int, k: int, c: int, pos: int, vid: ValueId) -> np.ndarray:
        value = self.graph.values[vid]
        maps = self.classes.strategy_map
        # Tied layers repeat the same (strategy lists, maps, shape) edge many times: compute it once.
        key = (id(self.strategies[p]), maps[p].tobytes(), k, id(self.strategies[c]), maps[c].tobytes(), pos,
               value.shape, value.dtype)
        cached = self._edge_cache.get(key)
        if cached is None:
            cached = self._edge_cache[key] = self._edge_matrix(p, k, c, pos, value)
        weight = self.edge_weight(c, pos)
        return cached if weight == 1 else cached * weight

    def _edge_matrix(self, p: int, k: int, c: int, pos: int, value: Value) -> np.ndarray:
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




def class_costs_and_edges(cg: CostGraph) -> tuple[list[np.ndarray], list[ClassEdge]]:
    """Per class its summed node costs (plus edges inside it); edges between classes, summed per pair."""
    cls = cg.classes
    class_cost = [np.zeros(size) for size in cls.class_size]
    for node in range(len(cg.strategies)):
        class_cost[cls.node_class[node]] += cg.node_cost(node)
    forbid_unsplit(cg, class_cost)
    pair_cost: dict[tuple[int, int], np.ndarray] = {}
    for p, k, c, pos, vid in cg.edge_sites():
        cu, cv = int(cls.node_class[p]), int(cls.node_class[c])
        mat = cg.edge_matrix(p, k, c, pos, vid)
        if cu == cv:
            class_cost[cu] += np.diagonal(mat)
            continue
        key, m = ((cu, cv), mat) if cu < cv else ((cv, cu), mat.T)
        if key in pair_cost:
            pair_cost[key] = pair_cost[key] + m
        else:
            pair_cost[key] = m.copy()
    return class_cost, [(u, v, m) for (u, v), m in pair_cost.items() if np.any(m != 0)]


def combined_latency_charges(cg: CostGraph) -> list[SharedCharge]:
    """One shared charge per combined reduction: the latency that the late reductions (``late_reductions``:
    priced without it in ``node_cost``) over the same axes, with the same reduction, pay once together,
    charged when any class chooses a strategy that runs one. Reduce-scatters join the all-reduces' group
    (XLA:CPU runs them as an all-reduce and a slice; the combined all-reduce carries them)."""
    members: dict[tuple, dict[int, np.ndarray]] = {}
    latency: dict[tuple, float] = {}
    cls = cg.classes
    loop = cg.graph.loop_of()  # a loop body combines its own reductions, once per iteration
    for j in sorted(cg.late):
        node = cg.num_inputs + j
        strategies, own = cg.strategies[node], cls.strategy_map[node]
        c = int(cls.node_class[node])
        for a, i in enumerate(own):
            s = strategies[i]
            for col in s.collectives:
                if col.kind not in ("all-reduce", "reduce-scatter"):
                    continue
                key = ("all-reduce", col.axes, s.reduction, loop[j])  # XLA combines reduce-scatters with them
                mask = members.setdefault(key, {}).setdefault(c, np.zeros(len(own), dtype=bool))
                mask[a] = True
                runs = cg.graph.ops[j].trip_count
                latency[key] = max(latency.get(key, 0.0), runs * cost.latency_s(cg.mesh, col))
    return [SharedCharge(f"combined {key[0]}[{','.join(key[1])}]", latency[key], tuple(members[key].items()))
            for key in members if latency[key] > 0]


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


def memory_points(cg: CostGraph) -> MemoryPoints:
    graph = cg.graph
    live = liveness_intervals(graph)
    keep = materialized_values(graph)
    num_points = len(graph.ops) + 1
    replicated = np.zeros(num_points)
    for vid, (start, stop) in live.items():
        if vid in keep and vid in cg.producer:
            replicated[start:stop + 1] += graph.values[vid].nbytes
    order = np.argsort(-replicated, kind="stable")
    chosen: list[int] = []
    spacing = max(1, num_points // (4 * cg.options.num_memory_points))
    for t in order:
        if all(abs(int(t) - c) >= spacing for c in chosen):
            chosen.append(int(t))
        if len(chosen) >= cg.options.num_memory_points:
            break
    points = []
    for t in sorted(chosen):
        terms: dict[int, np.ndarray] = {}
        for vid, (start, stop) in live.items():
            if start <= t <= stop and vid in keep and vid in cg.producer:
                node = cg.producer[vid][0]
                c = int(cg.classes.node_class[node])
                terms[c] = terms.get(c, 0) + cg.value_bytes(vid)
        points.append(tuple(sorted(terms.items())))
    return tuple(points)
