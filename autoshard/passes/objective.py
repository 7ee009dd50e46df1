"""The objective, recomputed: what a decoded plan costs on the unsimplified graph.

The ILP is an optimization of this one number, never a different problem: followers, tied layers,
presolve and pins only shrink how it is searched. ``plan_cost`` recomputes it from the graph, the mesh
and the strategy chosen for every node (input leaves first, then ops), walking every op and every edge
itself; it shares the cost *definitions* with the cost graph (the fused roofline of ``hbm_traffic``,
the alpha-beta collectives of ``meshes/cost.py``, ``resharding.reshard``) and nothing of its
simplification. ``check`` sets it beside the ILP's own objective and the ledger's step time: the three
are equal up to float rounding, or the planner has a bug.

The terms, per step on one device:

- compute: per op, the fused roofline of its strategy (FLOPs at the peak of its compute dtype, HBM
  bytes at memory bandwidth), for every run of the op (``Op.trip_count``);
- collectives: per op, its strategy's collectives for every run; a *late* reduction
  (``late_reductions``: its result reaches no contraction, reduction or unfusible op, as a data-parallel
  step's gradients) without its latency, which one combined all-reduce pays per group
  (``latency_charges``: same collective axes, reduction and loop; the largest latency among the chosen
  members, once);
- input: each batch leaf's shard, as the storage spec chosen for it splits it, arriving from the host
  every step (``meshes.cost.host_load_s``);
- resharding: per edge, from the producer's output spec to the spec its consumer reads (or, for state
  the step returns updated, to the input's storage spec), at the reshard's price times the runs of the
  consumer (``edge_runs``); a value resharded to one layout is computed once per consumer *class* that
  reads it there (``dedupe_key``): readers that must choose alike share one copy, as XLA's CSE makes them.

``PlanObjective`` charges each term to one place, most to an op (its *contribution*: its compute and own
collectives, and the reshards its input edges are the first to need), and prices any other strategy of an
op with the rest of the plan fixed. ``plan_cost`` sums the contributions and the rest; the explanations of
a plan (``compiler/explain.py``) read the same contributions, so what a user reads is the objective.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.errors import ObjectiveMismatchWarning
from autoshard.ir.graph import OpGraph, ValueId, dtype_itemsize
from autoshard.ir.spec import REDUCING
from autoshard.meshes import cost
from autoshard.meshes.logical import LogicalMesh
from autoshard.passes.hbm_traffic import OpTraffic, op_traffic, strategies_work
from autoshard.passes.liveness import OpKind, op_kind
from autoshard.passes.resharding import reshard
from autoshard.passes.strategies import Strategy

__all__ = ["Contribution", "EdgeSite", "LatencyCharge", "LatencyKey", "ObjectiveCheck", "PlanCost", "PlanObjective",
           "check", "edge_runs", "edge_sites", "group_latencies", "late_reductions", "latency_charges", "op_comm_s",
           "own_comm_s", "plan_cost"]

EdgeSite = tuple[int, int, int, int, ValueId]  # (producer node, out pos, consumer node, in pos or -1, value)
LatencyKey = tuple[str, tuple[str, ...], str | None, int]  # ("all-reduce", axes, reduction, loop index)

LOOP_EXITS = frozenset({"loop_stack", "loop_final"})


def late_reductions(graph: OpGraph) -> frozenset[int]:
    """Ops whose results reach no contraction, reduction or other unfusible op: the partial sums they
    reduce (the gradients of a data-parallel step) are independent of each other, and XLA's all-reduce
    combiner issues them as one collective (``passes/buffer_rules.combine_all_reduces``)."""
    consumers = graph.consumers()
    feeds: list[bool] = [False] * len(graph.ops)
    index = {id(op): t for t, op in enumerate(graph.ops)}

    def anchor(op) -> bool:
        """An op the reduced value must wait for before more work: a contraction or other unfusible op, or
        a reduction that really reduces (one over size-1 dims only is a reshape). A loop's stacked outputs
        and final carries are written where they lie: their readers decide."""
        if op.primitive in LOOP_EXITS:
            return False
        kind = op_kind(op)
        if kind == OpKind.REDUCTION:
            return graph.values[op.inputs[0]].size != graph.values[op.outputs[0]].size
        return kind == OpKind.OPAQUE

    for t in range(len(graph.ops) - 1, -1, -1):
        users = [c for v in graph.ops[t].outputs for c in consumers.get(v, ())]
        feeds[t] = any(anchor(c) or feeds[index[id(c)]] for c in users)
    return frozenset(t for t in range(len(graph.ops)) if not feeds[t])


def latency_key(strategy: Strategy, collective_axes: tuple[str, ...], loop: int) -> LatencyKey:
    """The combined all-reduce a late reduction joins: same axes, reduction and loop body (XLA combines
    inside one computation). A reduce-scatter joins the all-reduces' group: XLA:CPU runs it as an
    all-reduce and a slice, and its combiner takes both into one collective."""
    return ("all-reduce", tuple(collective_axes), strategy.reduction, loop)


@dataclass(frozen=True)
class LatencyCharge:
    """Part of one combined group's latency, paid once when any member choice is taken.

    A group pays the largest latency among the members chosen (an all-reduce's exceeds a
    reduce-scatter's): its distinct member latencies l1 < l2 < ... become charges l1, l2 - l1, ...,
    charge k taken by every choice of latency >= lk, so the charges paid sum to exactly that maximum."""

    name: str
    cost_s: float
    members: Mapping[int, np.ndarray]  # op index -> bool per strategy of its list: the choice incurs it


def group_latencies(graph: OpGraph, mesh: LogicalMesh, j: int, strategy: Strategy, late: frozenset[int],
                    loop: Sequence[int]) -> dict[LatencyKey, float]:
    """The combined groups op ``j`` joins with ``strategy`` and the latency it brings to each, all its runs:
    none unless it is a late reduction (``loop``: ``graph.loop_of()``)."""
    runs = graph.ops[j].trip_count
    found: dict[LatencyKey, float] = {}
    if j not in late or runs == 0:
        return found
    where = loop[j]
    if strategy.deferred_over:  # reduced once after its loop: with the late reductions around the loop
        runs //= strategy.deferred_over
        where = loop[graph.loops[where].stack_ops[0]]
    for col in strategy.collectives:
        if col.kind in REDUCING:
            key = latency_key(strategy, col.axes, where)
            found[key] = max(found.get(key, 0.0), runs * cost.latency_s(mesh, col))
    return found


def latency_charges(graph: OpGraph, mesh: LogicalMesh, op_strategies: Sequence[Sequence[Strategy]],
                    late: frozenset[int]) -> list[LatencyCharge]:
    """The charges (``LatencyCharge``) of the combined all-reduces the late reductions can join, given
    every op's strategy list (one strategy per op: the chosen plan's)."""
    loop = graph.loop_of()
    found: dict[LatencyKey, dict[int, dict[int, float]]] = {}  # key -> op -> strategy -> latency
    for j in sorted(late):
        for a, strategy in enumerate(op_strategies[j]):
            for key, latency in group_latencies(graph, mesh, j, strategy, late, loop).items():
                found.setdefault(key, {}).setdefault(j, {})[a] = latency
    charges: list[LatencyCharge] = []
    for key, members in found.items():
        levels = sorted({lat for choices in members.values() for lat in choices.values() if lat > 0})
        for below, level in zip([0.0] + levels, levels):
            masks = {j: np.array([choices.get(a, 0.0) >= level for a in range(len(op_strategies[j]))])
                     for j, choices in members.items()}
            charges.append(LatencyCharge(f"combined {key[0]}[{','.join(key[1])}]", level - below,
                                         {j: m for j, m in masks.items() if m.any()}))
    return charges


def own_comm_s(graph: OpGraph, mesh: LogicalMesh, j: int, strategy: Strategy, late: frozenset[int]) -> float:
    """Op ``j``'s own collectives with ``strategy``, every run; a late reduction's without their latency; a
    deferred one's (``Strategy.deferred_over``) with one latency per loop."""
    trips = graph.ops[j].trip_count
    if not strategy.collectives or (j not in late and not strategy.deferred_over):
        return strategy.comm_s * trips
    latency = sum(cost.latency_s(mesh, c) for c in strategy.collectives)
    bandwidth = trips * max(0.0, strategy.comm_s - latency)
    if j in late:
        return bandwidth
    # a deferred reduction (passes/deferral.py) moves the same bytes once per loop: one latency, not one a run
    return bandwidth + latency * (trips // strategy.deferred_over)


def edge_runs(graph: OpGraph, num_inputs: int, consumer: int, pos: int) -> int:
    """How many times a reshard into node ``consumer`` (input ``pos``; -1: written back) runs per step: the
    consumer op's trip count; a loop's carry out written back to its carry, every iteration; a cond's
    merge from a branch that is not priced, never (the cond costs its costliest branch)."""
    if consumer < num_inputs:
        return 1
    op = graph.ops[consumer - num_inputs]
    if pos < 0 and op.primitive == "loop_carry":
        return op.trip_count * int(op.params["length"])
    if op.primitive == "cond_merge" and pos != op.params["priced"]:
        return 0
    return op.trip_count


def producers(graph: OpGraph) -> dict[ValueId, tuple[int, int]]:
    """value id -> (node, output position) (``OpGraph.producer_nodes``)."""
    return graph.producer_nodes()


def edge_sites(graph: OpGraph, producer: Mapping[ValueId, tuple[int, int]] | None = None) -> Iterator[EdgeSite]:
    """Every edge of the graph: op inputs; updated state written back to its input's storage; a loop's carry
    out written back to its carry's layout."""
    producer = producer if producer is not None else producers(graph)
    num_inputs = len(graph.inputs)
    for j, op in enumerate(graph.ops):
        for pos, vid in enumerate(op.inputs):
            if vid in producer:
                p, k = producer[vid]
                yield p, k, num_inputs + j, pos, vid
    for out_index, in_index in enumerate(graph.carried):
        vid = graph.outputs[out_index]
        if in_index is not None and vid in producer and producer[vid][0] != in_index:
            p, k = producer[vid]
            yield p, k, in_index, -1, vid
    for region in graph.loops:
        if region.kind == "cond":
            continue
        for carry, final in zip(region.carry_ops, region.final_ops):
            vid = graph.ops[final].inputs[0]
            c = num_inputs + carry
            if vid in producer and producer[vid][0] != c:
                p, k = producer[vid]
                yield p, k, c, -1, vid


def op_comm_s(graph: OpGraph, mesh: LogicalMesh, op_strategies: Sequence[Strategy],
              late: frozenset[int] | None = None) -> tuple[float, ...]:
    """Per op, the seconds of its strategy's collectives as XLA issues them, every run: a late reduction's
    without their latency; each combined group's latency on the first op that pays into it."""
    late = late_reductions(graph) if late is None else late
    seconds = [own_comm_s(graph, mesh, j, s, late) for j, s in enumerate(op_strategies)]
    for charge in latency_charges(graph, mesh, [[s] for s in op_strategies], late):
        seconds[min(charge.members)] += charge.cost_s
    return tuple(seconds)


@dataclass(frozen=True)
class PlanCost:
    """A plan's step time on one device, by term (module docstring)."""

    compute_s: float
    comm_s: float  # the strategies' own collectives, combined latencies included
    reshard_s: float
    input_s: float = 0.0  # the batch's arrival from the host

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s + self.reshard_s + self.input_s


@dataclass(frozen=True)
class Contribution:
    """One op's share of the objective with one strategy (``PlanObjective.contribution``)."""

    compute_s: float
    comm_s: float  # its own collectives; for another strategy, plus the change of the combined latencies
    reshard_s: float  # the reshards charged to it; for another strategy, plus the change of all it touches

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s + self.reshard_s


class PlanObjective:
    """The objective of one plan (one strategy per node), split into the ops' contributions.

    Each term is charged to one place: an op's compute and own collectives to the op; each distinct reshard
    (one per value, source, target layout, runs and ``dedupe_key``) to the consumer of its first edge in
    ``edge_sites`` order, an op or the write-back of updated state (``write_back_s``); each combined
    group's latency to ``charges_s``; the inputs' arrival and storage collectives to ``input_s`` and
    ``input_comm_s``. The contributions and those four sum to the objective (``cost``, ``plan_cost``).

    ``contribution(j, s)`` prices another strategy ``s`` of op ``j`` with the rest of the plan fixed: the
    objective with ``s``, less what every other place pays with the chosen strategy. Two strategies'
    contributions differ exactly as the objectives of the two plans do; the reshard term then holds the
    change of every reshard ``s`` touches (its inputs', its consumers', its write-backs: negative when ``s``
    would spare its consumers one), the collectives the change of the combined groups' latencies.
    """

    def __init__(self, graph: OpGraph, mesh: LogicalMesh, node_strategies: Sequence[Strategy],
                 dedupe_key: Mapping[EdgeSite, object] | None = None, traffic: Sequence[OpTraffic] | None = None,
                 late: frozenset[int] | None = None) -> None:
        self.graph, self.mesh = graph, mesh
        self.strategies = tuple(node_strategies)
        self.num_inputs = len(graph.inputs)
        self._dedupe = dedupe_key
        self._traffic = op_traffic(graph) if traffic is None else traffic
        self._late = late_reductions(graph) if late is None else late
        self._loop = graph.loop_of()
        self._sizes = dict(zip(mesh.axis_names, mesh.shape))
        self._sites = list(edge_sites(graph))
        self._runs = [edge_runs(graph, self.num_inputs, c, pos) for _p, _k, c, pos, _v in self._sites]
        self._by_value: dict[ValueId, list[int]] = {}
        self._touching: dict[int, set[ValueId]] = {}  # node -> values on its edges, in or out
        for i, (p, _k, c, _pos, vid) in enumerate(self._sites):
            self._by_value.setdefault(vid, []).append(i)
            self._touching.setdefault(p, set()).add(vid)
            self._touching.setdefault(c, set()).add(vid)
        self._share = np.zeros(len(self.strategies))
        self._value_s: dict[ValueId, float] = {}
        for vid in self._by_value:
            for i, seconds in self._reshards(vid):
                self._share[self._sites[i][2]] += seconds
                self._value_s[vid] = self._value_s.get(vid, 0.0) + seconds
        self._groups: dict[LatencyKey, list[tuple[float, int]]] = {}  # key -> (latency, op), largest first
        for j in sorted(self._late):
            for key, latency in self._latencies(j, self.op_strategy(j)).items():
                self._groups.setdefault(key, []).append((latency, j))
        for members in self._groups.values():
            members.sort(reverse=True)
        self.charges_s = float(sum(members[0][0] for members in self._groups.values()))
        self.write_back_s = float(self._share[:self.num_inputs].sum())
        self.input_s = float(sum(s.compute_s for s in self.strategies[:self.num_inputs]))
        self.input_comm_s = float(sum(s.comm_s for s in self.strategies[:self.num_inputs]))

    def op_strategy(self, j: int) -> Strategy:
        return self.strategies[self.num_inputs + j]

    def contribution(self, j: int, strategy: Strategy | None = None) -> Contribution:
        """Op ``j``'s share of the objective with ``strategy`` (the chosen one when None), the rest fixed."""
        node, chosen = self.num_inputs + j, self.op_strategy(j)
        s = chosen if strategy is None else strategy
        compute = self._compute_s(j, s)
        comm = own_comm_s(self.graph, self.mesh, j, s, self._late)
        resharded = float(self._share[node])
        if s == chosen:
            return Contribution(compute, comm, resharded)
        for vid in self._touching.get(node, ()):
            resharded += sum(seconds for _i, seconds in self._reshards(vid, node, s)) - self._value_s.get(vid, 0.0)
        return Contribution(compute, comm + self._charges_change(j, s), resharded)

    def cost(self) -> PlanCost:
        """The plan's objective by term: the contributions, write-backs, combined latencies and inputs."""
        parts = [self.contribution(j) for j in range(len(self.graph.ops))]
        return PlanCost(float(sum(c.compute_s for c in parts)),
                        float(sum(c.comm_s for c in parts)) + self.charges_s + self.input_comm_s,
                        float(sum(c.reshard_s for c in parts)) + self.write_back_s, self.input_s)

    def _compute_s(self, j: int, s: Strategy) -> float:
        """The fused roofline of op ``j`` run with ``s``, every run (``hbm_traffic.strategies_work``)."""
        seconds, _ = strategies_work(self.graph, self.graph.ops[j], self._traffic[j], [s], self._sizes,
                                     self.mesh.cluster)
        return float(seconds[0])

    def _reshards(self, vid: ValueId, node: int = -1, strategy: Strategy | None = None) -> Iterator[tuple[int, float]]:
        """Each distinct reshard of value ``vid`` (node ``node`` taking ``strategy`` instead of its own), once,
        with the edge site it is charged to."""
        seen: set[tuple] = set()
        value = self.graph.values[vid]
        for i in self._by_value[vid]:
            site = self._sites[i]
            p, k, c, pos, _vid = site
            runs = self._runs[i]
            src = (strategy if p == node else self.strategies[p]).out_specs[k]
            reader = strategy if c == node else self.strategies[c]
            dst = reader.out_specs[0] if pos < 0 else reader.in_specs[pos]
            if src == dst or runs == 0:
                continue
            key = (src, dst, runs, self._dedupe.get(site) if self._dedupe is not None else None)
            if key in seen:
                continue
            seen.add(key)
            yield i, runs * reshard(value.shape, dtype_itemsize(value.dtype), src, dst, self.mesh).seconds

    def _latencies(self, j: int, s: Strategy) -> dict[LatencyKey, float]:
        return group_latencies(self.graph, self.mesh, j, s, self._late, self._loop)

    def _charges_change(self, j: int, s: Strategy) -> float:
        """How the combined groups' latencies change when op ``j`` takes ``s``: each group pays the largest
        latency among its chosen members."""
        if j not in self._late:
            return 0.0
        mine, theirs = self._latencies(j, self.op_strategy(j)), self._latencies(j, s)
        change = 0.0
        for key in mine.keys() | theirs.keys():
            others = next((latency for latency, i in self._groups.get(key, ()) if i != j), 0.0)
            change += max(others, theirs.get(key, 0.0)) - max(others, mine.get(key, 0.0))
        return change


def plan_cost(graph: OpGraph, mesh: LogicalMesh, node_strategies: Sequence[Strategy],
              dedupe_key: Mapping[EdgeSite, object] | None = None,
              traffic: Sequence[OpTraffic] | None = None) -> PlanCost:
    """Recompute the objective of a plan (one strategy per node) on the unsimplified graph: the sum of
    its ops' contributions and the rest (``PlanObjective``).

    ``dedupe_key``: per edge site, a key naming the copy it reads; edges of one value resharded alike
    under the same key share one reshard (readers that must choose alike). Without it every edge of a
    value to the same layout shares one. ``traffic``: ``hbm_traffic.op_traffic(graph)``, when known.
    """
    return PlanObjective(graph, mesh, node_strategies, dedupe_key, traffic).cost()


@dataclass(frozen=True)
class ObjectiveCheck:
    """The ILP's objective, the objective recomputed on the unsimplified graph, and the ledger's step."""

    ilp_s: float
    recomputed: PlanCost
    ledger_s: float

    @property
    def recomputed_s(self) -> float:
        return self.recomputed.total_s

    def agrees(self, rel: float = 1e-6) -> bool:
        values = (self.ilp_s, self.recomputed_s, self.ledger_s)
        return all(math.isclose(a, b, rel_tol=rel, abs_tol=1e-15) for a in values for b in values)

    def __str__(self) -> str:
        state = "agree" if self.agrees() else "DISAGREE"
        return (f"objective {state}: ILP {self.ilp_s * 1e3:.6g} ms, recomputed on the whole graph "
                f"{self.recomputed_s * 1e3:.6g} ms (compute {self.recomputed.compute_s * 1e3:.6g}, collectives "
                f"{self.recomputed.comm_s * 1e3:.6g}, resharding {self.recomputed.reshard_s * 1e3:.6g}), "
                f"ledger {self.ledger_s * 1e3:.6g} ms")


def check(graph: OpGraph, mesh: LogicalMesh, node_strategies: Sequence[Strategy], ilp_s: float, ledger_s: float,
          dedupe_key: Mapping[EdgeSite, object] | None = None,
          traffic: Sequence[OpTraffic] | None = None) -> ObjectiveCheck:
    """The three figures of a plan; a disagreement is reported with an ``ObjectiveMismatchWarning``."""
    found = ObjectiveCheck(ilp_s, plan_cost(graph, mesh, node_strategies, dedupe_key, traffic), ledger_s)
    if not found.agrees():
        warnings.warn(f"planner bug on mesh {mesh}: {found}", ObjectiveMismatchWarning, stacklevel=3)
    return found
