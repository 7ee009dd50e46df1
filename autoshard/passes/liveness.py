"""Which values own a buffer, when each is live, and the order XLA:CPU runs a step in (no plan needed).

The plan-independent half of the memory model. Each rule models one XLA:CPU
behaviour, read off the buffer-assignment and live-range dumps
(``--xla_dump_to``) of the mlp, gpt, moe and convnet examples:

1. *Fusion* (``fusion_analysis``; ``CpuInstructionFusion``): elementwise,
   broadcast, slicing, gather and transpose ops run inside the fusion of their
   consumers and take no memory. A value is materialised when a consumer cannot
   fuse it (dot, convolution, scatter, sort, control flow, a collective), when
   it is a step output, or when it would have to be recomputed in several
   fusions and may not be: it is expensive (transcendentals, float division,
   gather: ``InstructionFusion::IsExpensive``), or it reads more than one large
   operand and some consumer also reads a reduction of it (``x - mean(x)``;
   ``ComputeGloballyUnfusible``), or it would be recomputed in more than
   ``RECOMPUTE_LIMIT`` fusions (measured: ``a = x + y`` read by 20 reductions
   is materialised once by XLA:CPU, 9.6e7 bytes for 2^20 floats, the figure
   this rule gives, 1.7e8 without it; a 12-layer GPT's residual-stream
   gradient sums were each recomputed in up to 50 fusions, its bytes
   predicted 40% high, 22% with the rule). Still over-counted: a chain of
   such sums each read by its own reduction, which XLA materialises link by
   link (5x here). A cheap op materialised only for a dot is
   still recomputed by its fusible readers, so they do not keep its buffer
   alive. Reductions absorb their producers and materialise their result.
2. *Views*: reshapes and squeezes (bitcasts), and transposes read only by dots
   (``TransposeFolding``), share their operand's buffer and extend its life.
3. *Breadth-first schedule* (``breadth_first``; XLA:CPU's default
   ``xla_cpu_enable_concurrency_optimized_scheduler``): instructions run in
   order of their longest path from the arguments, not in program order. A
   parameter's all-gather needs nothing but the parameter, so it runs at the
   start and its gathered copy lives until its last reader: under FSDP every
   gathered parameter is live at once. Fused ops take no level; a
   materialised op, each collective step and each combined all-reduce do.

Here: ``op_kind`` (a primitive's ``OpKind`` and whether it is expensive are
facts of the primitive table, ``ir/primitives.py``), ``fusion_analysis`` and
``buffer_root`` (rules 1-2), ``breadth_first`` and the shared reader helpers ``_place_fused`` /
``_reader_positions`` (rule 3), and the ILP's memory points
(``liveness_intervals``, ``materialized_values``: rules 1-3 without a plan).

``passes/memory_model.py`` holds rules 4-9 (collectives, all-reduce combining,
donation, outputs and arguments, layout copies, reshard transients) and
``simulate``, the plan-aware per-device peak of the ledger;
``liveness_intervals`` reuses its reader pass. ``simulate``, ``Span``,
``MemorySimulation``, ``ReshardLike``, ``TUPLE_INDEX_BYTES`` and
``transposed_operands`` are re-exported here.
"""
from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.ir.graph import Op, OpGraph, Role, ValueId
from autoshard.ir.primitives import OpKind, Values, facts

OpIndex = int
NodeId = int  # ops are nodes 0..len(ops)-1; collectives and reshards get ids after them


RECOMPUTE_LIMIT = 15  # fusions one value may be recomputed in (rule 1)


def op_kind(op: Op) -> OpKind:
    """How fusion treats ``op`` (rules 1-2): its primitive's ``kind`` in the table (``ir/primitives.py``)."""
    return facts(op.primitive).kind


# --------------------------------------------------------------------------- rules 1-2: fusion


@dataclass(frozen=True)
class Fusion:
    materialized: frozenset[ValueId]  # op outputs that own a buffer (views of a buffer excluded)
    alias: Mapping[ValueId, ValueId]  # view output -> the value whose buffer it is
    roots: Mapping[OpIndex, frozenset[OpIndex]]  # op -> the materialised ops whose fusions compute it
    instruction: frozenset[OpIndex]  # ops that are instructions of their own (fusion roots, views, opaque)
    duplicated: frozenset[OpIndex] = frozenset()  # materialised for a dot, recomputed by fusible readers

    def recomputed_by(self, producer: OpIndex | None, reader: Op) -> bool:
        """True when ``reader`` recomputes the value ``producer`` made instead of reading its buffer."""
        return producer in self.duplicated and op_kind(reader) in (OpKind.ELEMENTWISE, OpKind.REDUCTION)


def fusion_analysis(graph: OpGraph, forced: Iterable[ValueId] = (), copied: Iterable[OpIndex] = ()) -> Fusion:
    """Rules 1 and 2. ``forced`` values must be materialised (a collective reads them); ops in ``copied``
    read a resharded copy of their operand, so a view there cannot share the original's buffer. Without
    either (no plan yet) the analysis is the graph's own, made once per graph (``OpGraph.derived``)."""
    forced_set, copied_set = set(forced), set(copied)
    if not forced_set and not copied_set:
        return graph.derived("fusion_analysis", lambda: _fusion_analysis(graph, forced_set, copied_set))
    return _fusion_analysis(graph, forced_set, copied_set)


def _fusion_analysis(graph: OpGraph, forced_set: set[ValueId], copied_set: set[OpIndex]) -> Fusion:
    forced_set = forced_set | set(graph.outputs)
    consumers = graph.consumers()
    kinds = [op_kind(op) for op in graph.ops]
    cheap_ops = _cheap_ops(graph)
    index = {id(op): t for t, op in enumerate(graph.ops)}
    materialized: set[ValueId] = set()
    alias: dict[ValueId, ValueId] = {}
    roots: dict[OpIndex, frozenset[OpIndex]] = {}
    instruction: set[OpIndex] = set()
    duplicated: set[OpIndex] = set()
    for t in range(len(graph.ops) - 1, -1, -1):
        op, kind = graph.ops[t], kinds[t]
        users = [index[id(c)] for v in op.outputs for c in consumers.get(v, ())]
        if kind in (OpKind.OPAQUE, OpKind.REDUCTION):
            materialized.update(op.outputs)
            roots[t] = frozenset({t})
            instruction.add(t)
            continue
        if kind == OpKind.ELEMENTWISE and op.primitive == "transpose" and users and all(
                graph.ops[u].primitive in ("dot_general", "transpose") for u in users):
            kind = OpKind.VIEW  # TransposeFolding: the dot reads the transpose's operand
        forced_here = any(v in forced_set for v in op.outputs)
        for_opaque = any(kinds[u] == OpKind.OPAQUE for u in users)
        reach: set[OpIndex] = set()
        for u in users:
            reach |= roots[u]
        cheap = t in cheap_ops
        if not (forced_here or for_opaque or (len(reach) > 1 and not cheap) or len(reach) > RECOMPUTE_LIMIT):
            roots[t] = frozenset(reach)
            continue
        roots[t] = frozenset({t})
        instruction.add(t)
        if kind == OpKind.ELEMENTWISE and for_opaque and cheap and not forced_here:
            # materialised for the dot; its fusible readers recompute it from its operands
            recompute = {r for u in users if kinds[u] in (OpKind.ELEMENTWISE, OpKind.REDUCTION) for r in roots[u]}
            if recompute:
                duplicated.add(t)
                roots[t] = frozenset({t} | recompute)
        if kind == OpKind.VIEW and op.inputs and t not in copied_set:
            alias.update((v, op.inputs[0]) for v in op.outputs)
        else:
            materialized.update(op.outputs)
    # a view of a value that no fusion materialises still needs a buffer of its own
    producer = {v: t for t, op in enumerate(graph.ops) for v in op.outputs}
    inputs = set(graph.inputs)
    for v, src in list(alias.items()):
        root = src
        while root in alias:
            root = alias[root]
        if root not in inputs and root not in materialized and root in producer:
            del alias[v]
            materialized.add(v)
    return Fusion(frozenset(materialized), alias, roots, frozenset(instruction), frozenset(duplicated))


# per graph (by id, while it lives): its cheap ops, the same for every fusion analysis of it
_CHEAP: dict[int, tuple[weakref.ReferenceType[OpGraph], frozenset[OpIndex]]] = {}


def _cheap_ops(graph: OpGraph) -> frozenset[OpIndex]:
    """The ops a fusion may recompute rather than materialise when several read them (not expensive, and
    ``_duplicable``); they depend on the graph only, so they are found once per graph (a budget search and the
    memory profile analyse one graph several times)."""
    key = id(graph)
    hit = _CHEAP.get(key)
    if hit is not None and hit[0]() is graph:
        return hit[1]
    producer = {v: op for op in graph.ops for v in op.outputs}
    consumers = graph.consumers()
    found = frozenset(t for t, op in enumerate(graph.ops)
                      if op_kind(op) not in (OpKind.OPAQUE, OpKind.REDUCTION) and not facts(op.primitive).expensive
                      and _duplicable(graph, op, producer, consumers))
    _CHEAP[key] = (weakref.ref(graph, lambda _ref, key=key: _CHEAP.pop(key, None)), found)
    return found


def _duplicable(graph: OpGraph, op: Op, producer: Mapping[ValueId, Op],
                consumers: Mapping[ValueId, Sequence[Op]]) -> bool:
    """``ComputeGloballyUnfusible``: an op is recomputed in several fusions when it reads at most one
    large operand (broadcasts, ops of no operand such as iota, and constants are not large), or no more
    elements than it writes, or when it can fuse into every consumer along every path: not when a
    consumer also reads a reduction of it (``x - mean(x)``: a reduction does not fuse into its elementwise consumer)."""
    def true_rank(shape: Sequence[int]) -> int:
        return sum(1 for d in shape if d != 1)

    outs = [graph.values[v] for v in op.outputs]
    out_rank = max((true_rank(v.shape) for v in outs), default=0)
    large = 0
    for vid in dict.fromkeys(op.inputs):
        value = graph.values[vid]
        src = producer.get(vid)
        if value.role == Role.CONSTANT or (src is not None and (not src.inputs
                                                                 or facts(src.primitive).values is Values.BROADCAST)):
            continue
        large += true_rank(value.shape) >= out_rank
    if large <= 1 or sum(graph.values[v].size for v in dict.fromkeys(op.inputs)) <= sum(v.size for v in outs):
        return True
    mine = set(op.outputs)

    def via_reduction(vid: ValueId, reduced: bool, depth: int) -> bool:
        if vid in mine:
            return reduced
        src = producer.get(vid)
        if src is None or depth == 0 or op_kind(src) == OpKind.OPAQUE:
            return False
        reduced |= op_kind(src) == OpKind.REDUCTION
        return any(via_reduction(v, reduced, depth - 1) for v in src.inputs)

    return not any(via_reduction(other, False, 8) for v in op.outputs for c in consumers.get(v, ())
                   for other in c.inputs if other not in mine)


def buffer_root(fusion: Fusion, vid: ValueId) -> ValueId:
    while vid in fusion.alias:
        vid = fusion.alias[vid]
    return vid


# --------------------------------------------------------------------------- rule 3: schedule


@dataclass(frozen=True)
class InstructionOrder:
    """Node levels and the breadth-first order XLA runs them in (positions 0..num_positions-1)."""

    level: np.ndarray  # per node
    position: np.ndarray  # per node; fused ops take their first fusion root's position
    num_positions: int
    preds: tuple[tuple[NodeId, ...], ...]  # per node
    topological: tuple[NodeId, ...]  # every node after its predecessors


def breadth_first(preds: Sequence[Sequence[NodeId]], weight: Sequence[int], seq: Sequence[float]) -> InstructionOrder:
    """Longest-path levels (a node of weight 0 runs inside its consumer) and the order sorted by level."""
    n = len(preds)
    succs: list[list[NodeId]] = [[] for _ in range(n)]
    indeg = np.zeros(n, dtype=np.int64)
    for v, ps in enumerate(preds):
        for p in set(ps):
            succs[p].append(v)
            indeg[v] += 1
    level = np.zeros(n, dtype=np.int64)
    ready = [v for v in range(n) if indeg[v] == 0]
    topological: list[NodeId] = []
    while ready:
        v = ready.pop()
        topological.append(v)
        base = max((level[p] for p in preds[v]), default=0)
        level[v] = base + weight[v]
        for s in succs[v]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    if len(topological) != n:
        raise ValueError("the instruction graph has a cycle")
    real = [v for v in range(n) if weight[v] > 0]
    real.sort(key=lambda v: (level[v], seq[v]))
    position = np.full(n, -1, dtype=np.int64)
    for k, v in enumerate(real):
        position[v] = k
    return InstructionOrder(level, position, len(real), tuple(tuple(p) for p in preds), tuple(topological))


def place_fused(sched: InstructionOrder, fusion: Fusion, ops: Iterable[OpIndex]) -> InstructionOrder:
    position = sched.position.copy()
    for t in ops:
        if position[t] < 0 and fusion.roots.get(t):
            position[t] = min(position[r] for r in fusion.roots[t])
    return dataclasses.replace(sched, position=position)


def reader_positions(sched: InstructionOrder, fusion: Fusion, t: OpIndex) -> list[int]:
    if t in fusion.instruction and t not in fusion.duplicated:
        return [int(sched.position[t])]
    return [int(sched.position[r]) for r in fusion.roots.get(t, ())]
