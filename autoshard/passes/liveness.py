"""Which values XLA:CPU keeps in memory, in what order it runs the step, and the per-device peak.

``memory_analysis()`` of an XLA:CPU executable reports argument + output −
alias + temp, where temp is the heap the buffer assigner packs every
non-argument, non-output buffer into (its peak is the most bytes live at once
in XLA's instruction order). This module reproduces that figure from an
OpGraph and a plan. Each rule below models one XLA:CPU behaviour, checked
against the buffer-assignment dumps (``--xla_dump_to``) of the example
workloads:

1. *Fusion* (``fusion_analysis``; XLA's ``CpuInstructionFusion``): elementwise,
   broadcast, slicing, gather and layout ops are computed inside the fusion
   of their consumers and never reach memory. A value is materialised when a
   consumer cannot fuse it (dot, convolution, scatter, sort, control flow, a
   collective), when it is a step output, or when it is expensive to recompute
   (transcendentals, float division, gather: ``InstructionFusion::IsExpensive``)
   and would otherwise be duplicated into more than one fusion. Reductions
   absorb their elementwise producers but materialise their own result.
2. *Views*: reshapes, squeezes and transposes read only by dots (XLA folds
   them into the dot or turns them into bitcasts) share their input's buffer
   and extend its lifetime instead of taking new bytes.
3. *Breadth-first schedule* (``schedule``; XLA:CPU's default
   ``xla_cpu_enable_concurrency_optimized_scheduler``): instructions run in
   order of their longest path from the arguments, not in program order. So a
   parameter's all-gather, which needs nothing but the parameter, runs at the
   start and its gathered copy stays live until its last reader: with FSDP
   every gathered parameter is live at once. Fused ops take no level; every
   materialised op, collective and reshard step takes one.
4. *Collectives*: a strategy that reduces partial sums keeps the partial
   result and the reduced result as two buffers (XLA:CPU's all-reduce is not
   in place); a reduce-scatter is an all-reduce of the full partial result
   followed by a dynamic-slice, so the full-size all-reduce output is a
   temporary too. A reshard with collectives makes one new buffer per
   (value, target layout), shared by all its readers (CSE).
5. *All-reduce combining* (``CpuAllReduceCombiner``, no byte limit, 256
   operands): walking the program in order, all-reduces with the same mesh
   axes, reduction and dtype join one combined all-reduce until one depends on
   an earlier member. The combined op waits for its last operand, so every
   partial result (typically every gradient of a data-parallel step) stays
   live until then, and all results appear together.
6. *Donation*: carried state is written into its donated argument buffer, so
   updated parameters and optimizer state cost nothing beyond the arguments.
   ``CopyInsertion`` copies a donated argument when one of its readers is not
   an ancestor of the value written over it (a backward dot reading a weight
   that the update overwrites). The copy lives until its last reader; the
   argument buffer it frees can hold another argument's copy of no larger
   size until the update is written, so equal-sized copies cost one buffer.
7. *Outputs*: step outputs that are not donated state are counted in the
   output allocation (plus XLA's 8-byte-per-leaf tuple index table), never as
   temporaries. Arguments count in full for the whole step, as
   ``memory_analysis`` reports them even after XLA reuses a dead argument's
   buffer.

The plan-independent parts (rules 1–3 without collectives) give
``liveness_intervals`` and ``materialized_values``, which the intra-op ILP
uses for its memory points; ``simulate`` adds the plan (specs, reshards and
strategy collectives, rules 4–7) for the ledger's peak.
"""
from __future__ import annotations

import dataclasses
import enum
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from autoshard.compiler.graph import Op, OpGraph, Role, ValueId, dtype_itemsize
from autoshard.compiler.spec import Collective, Spec

OpIndex = int
NodeId = int  # ops are nodes 0..len(ops)-1; collectives and reshards get ids after them


class OpKind(enum.Enum):
    ELEMENTWISE = "elementwise"  # fused into its consumers
    VIEW = "view"  # a bitcast of its input when it must exist on its own
    REDUCTION = "reduction"  # absorbs elementwise producers, materialises its result
    OPAQUE = "opaque"  # reads materialised operands, materialises its result


ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan", "atan2", "atanh", "cbrt", "ceil",
    "clamp", "convert_element_type", "cos", "cosh", "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2",
    "expm1", "floor", "ge", "gt", "imag", "integer_pow", "is_finite", "le", "lgamma", "digamma", "log", "log1p",
    "logistic", "lt", "max", "min", "mul", "ne", "neg", "nextafter", "not", "or", "pow", "real", "rem", "round",
    "rsqrt", "select_n", "sign", "sin", "sinh", "sqrt", "square", "stop_gradient", "sub", "tan", "tanh", "xor",
    "broadcast_in_dim", "reduce_precision", "shift_left", "shift_right_logical", "shift_right_arithmetic",
    "population_count", "iota", "slice", "dynamic_slice", "dynamic_update_slice", "pad", "concatenate", "rev",
    "gather", "transpose", "bitcast_convert_type", "clz",
})
VIEWS = frozenset({"reshape", "squeeze", "expand_dims", "copy", "copy_p", "optimization_barrier"})
REDUCTIONS = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor", "argmax",
    "argmin", "reduce",
})
# InstructionFusion::IsExpensive: not duplicated into several fusions.
EXPENSIVE = frozenset({
    "acos", "acosh", "asin", "asinh", "atan2", "atanh", "cosh", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1",
    "log", "log1p", "logistic", "pow", "rsqrt", "sqrt", "cbrt", "tanh", "lgamma", "digamma", "gather", "div", "rem",
})
FUSIBLE = ELEMENTWISE | VIEWS  # kept for callers that only ask "can this op fuse?"


def op_kind(op: Op) -> OpKind:
    if op.primitive in VIEWS:
        return OpKind.VIEW
    if op.primitive in ELEMENTWISE:
        return OpKind.ELEMENTWISE
    if op.primitive in REDUCTIONS:
        return OpKind.REDUCTION
    return OpKind.OPAQUE


class ReshardLike(Protocol):
    """What ``simulate`` reads of a reshard site (``intra_op.ReshardSite``)."""

    op_index: int  # -1: a carried output written back to its storage layout
    input_pos: int
    value: ValueId
    dst: Spec
    collectives: tuple[Collective, ...]


# --------------------------------------------------------------------------- rules 1-2: fusion


@dataclass(frozen=True)
class Fusion:
    materialized: frozenset[ValueId]  # op outputs that own a buffer (views of a buffer excluded)
    alias: Mapping[ValueId, ValueId]  # view output -> the value whose buffer it is
    roots: Mapping[OpIndex, frozenset[OpIndex]]  # op -> the materialised ops whose fusions compute it
    instruction: frozenset[OpIndex]  # ops that are instructions of their own (fusion roots, views, opaque)


def fusion_analysis(graph: OpGraph, forced: Iterable[ValueId] = ()) -> Fusion:
    """Rules 1 and 2. ``forced`` values must be materialised (a collective reads them)."""
    forced_set = set(forced) | set(graph.outputs)
    consumers = graph.consumers()
    kinds = [op_kind(op) for op in graph.ops]
    index = {id(op): t for t, op in enumerate(graph.ops)}
    producer_prim = {v: op.primitive for op in graph.ops for v in op.outputs}
    materialized: set[ValueId] = set()
    alias: dict[ValueId, ValueId] = {}
    roots: dict[OpIndex, frozenset[OpIndex]] = {}
    instruction: set[OpIndex] = set()
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
        need = any(v in forced_set for v in op.outputs)
        need |= any(kinds[u] == OpKind.OPAQUE for u in users)
        reach: set[OpIndex] = set()
        for u in users:
            reach |= roots[u]
        need |= len(reach) > 1 and (op.primitive in EXPENSIVE or not _duplicable(graph, op, producer_prim))
        if not need:
            roots[t] = frozenset(reach)
            continue
        roots[t] = frozenset({t})
        instruction.add(t)
        if kind == OpKind.VIEW and op.inputs:
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
    return Fusion(frozenset(materialized), alias, roots, frozenset(instruction))


def _duplicable(graph: OpGraph, op: Op, producer_prim: Mapping[ValueId, str]) -> bool:
    """``ComputeGloballyUnfusible``: an op may be recomputed in several fusions when it reads at most one
    large operand (broadcasts, iotas and constants are not large) or no more elements than it writes."""
    def true_rank(shape: Sequence[int]) -> int:
        return sum(1 for d in shape if d != 1)

    outs = [graph.values[v] for v in op.outputs]
    out_rank = max((true_rank(v.shape) for v in outs), default=0)
    large = 0
    for vid in dict.fromkeys(op.inputs):
        value = graph.values[vid]
        if value.role == Role.CONSTANT or producer_prim.get(vid) in ("broadcast_in_dim", "iota"):
            continue
        large += true_rank(value.shape) >= out_rank
    if large <= 1:
        return True
    return sum(graph.values[v].size for v in dict.fromkeys(op.inputs)) <= sum(v.size for v in outs)


def buffer_root(fusion: Fusion, vid: ValueId) -> ValueId:
    while vid in fusion.alias:
        vid = fusion.alias[vid]
    return vid


# --------------------------------------------------------------------------- rule 3: schedule


@dataclass(frozen=True)
class Schedule:
    """Node levels and the breadth-first order XLA runs them in (positions 0..num_positions-1)."""

    level: np.ndarray  # per node
    position: np.ndarray  # per node; fused ops take their first fusion root's position
    num_positions: int
    preds: tuple[tuple[NodeId, ...], ...]  # per node


def breadth_first(preds: Sequence[Sequence[NodeId]], weight: Sequence[int], seq: Sequence[float]) -> Schedule:
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
    seen = 0
    while ready:
        v = ready.pop()
        seen += 1
        base = max((level[p] for p in preds[v]), default=0)
        level[v] = base + weight[v]
        for s in succs[v]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    if seen != n:
        raise ValueError("the instruction graph has a cycle")
    real = [v for v in range(n) if weight[v] > 0]
    real.sort(key=lambda v: (level[v], seq[v]))
    position = np.full(n, -1, dtype=np.int64)
    for k, v in enumerate(real):
        position[v] = k
    return Schedule(level, position, len(real), tuple(tuple(p) for p in preds))


def schedule(graph: OpGraph, fusion: Fusion | None = None) -> Schedule:
    """Rule 3 without a plan: one node per op."""
    fusion = fusion or fusion_analysis(graph)
    producer = {v: t for t, op in enumerate(graph.ops) for v in op.outputs}
    preds = [tuple(producer[v] for v in op.inputs if v in producer) for op in graph.ops]
    weight = [1 if t in fusion.instruction else 0 for t in range(len(graph.ops))]
    sched = breadth_first(preds, weight, list(range(len(graph.ops))))
    return _place_fused(sched, fusion, range(len(graph.ops)))


def _place_fused(sched: Schedule, fusion: Fusion, ops: Iterable[OpIndex]) -> Schedule:
    position = sched.position.copy()
    for t in ops:
        if position[t] < 0 and fusion.roots.get(t):
            position[t] = min(position[r] for r in fusion.roots[t])
    return Schedule(sched.level, position, sched.num_positions, sched.preds)


def _reader_positions(sched: Schedule, fusion: Fusion, t: OpIndex) -> list[int]:
    if t in fusion.instruction:
        return [int(sched.position[t])]
    return [int(sched.position[r]) for r in fusion.roots.get(t, ())]


# --------------------------------------------------------------------------- plan-independent liveness


def liveness_intervals(graph: OpGraph) -> dict[ValueId, tuple[int, int]]:
    """Buffer -> (first position, last position) inclusive, in XLA:CPU's breadth-first order.

    Arguments live throughout; donated state written back (carried outputs)
    lives in its argument's buffer and is left out; other outputs live from
    their definition to the end; a view's readers extend its buffer's life.
    Keys are the values of ``materialized_values`` plus the inputs.
    """
    fusion = fusion_analysis(graph)
    sched = schedule(graph, fusion)
    end = max(sched.num_positions - 1, 0)
    live: dict[ValueId, tuple[int, int]] = {v: (0, end) for v in graph.inputs}
    producer = {v: t for t, op in enumerate(graph.ops) for v in op.outputs}
    for vid in fusion.materialized:
        t = producer[vid]
        start = int(sched.position[t])
        live[vid] = (start, start)
    for t, op in enumerate(graph.ops):
        for vid in op.inputs:
            root = buffer_root(fusion, vid)
            if root in live and root not in graph.inputs:
                start, stop = live[root]
                live[root] = (start, max([stop, *_reader_positions(sched, fusion, t)]))
    carried = {graph.outputs[k] for k, i in enumerate(graph.carried or ()) if i is not None}
    for vid in graph.outputs:
        if vid in live and vid not in graph.inputs:
            if vid in carried:
                live.pop(vid)
            else:
                live[vid] = (live[vid][0], end)
    return live


def materialized_values(graph: OpGraph) -> set[ValueId]:
    """Values that occupy memory: inputs, outputs, and op results that no fusion absorbs."""
    fusion = fusion_analysis(graph)
    return set(graph.inputs) | set(graph.outputs) | set(fusion.materialized)


# --------------------------------------------------------------------------- plan-aware simulation


@dataclass(frozen=True)
class Span:
    start: int
    stop: int  # inclusive
    nbytes: float
    kind: str  # "activation", "partial sum", "resharded", "layout copy", "donation copy", "written back"
    value: ValueId | None = None  # the value this buffer holds (a copy of), for reports


@dataclass(frozen=True)
class MemorySimulation:
    arguments: Mapping[str, float]  # per-device argument bytes by role (live for the whole step)
    outputs: float  # non-donated outputs (output allocation), with the tuple index table
    spans: tuple[Span, ...]  # temporaries
    num_positions: int

    @property
    def fixed_bytes(self) -> float:
        return float(sum(self.arguments.values())) + self.outputs

    def temp_profile(self) -> np.ndarray:
        profile = np.zeros(max(self.num_positions, 1))
        for s in self.spans:
            profile[s.start:s.stop + 1] += s.nbytes
        return profile

    def profile(self) -> np.ndarray:
        return self.temp_profile() + self.fixed_bytes

    def by_kind_at(self, t: int) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        out.update(self.arguments)
        if self.outputs:
            out["output"] += self.outputs
        for s in self.spans:
            if s.start <= t <= s.stop:
                out[s.kind] += s.nbytes
        return dict(out)


TUPLE_INDEX_BYTES = 8  # XLA's output tuple holds one pointer per leaf


def simulate(graph: OpGraph, value_specs: Mapping[ValueId, Spec], sizes: Mapping[str, int],
             reshards: Sequence[ReshardLike] = (),
             op_collectives: Mapping[OpIndex, Sequence[Collective]] | None = None,
             op_reductions: Mapping[OpIndex, str | None] | None = None) -> MemorySimulation:
    """Per-device buffers of ``graph`` run with these specs, as XLA:CPU lays them out (rules 1-7).

    ``op_collectives`` are each op's strategy collectives (partial-sum
    all-reduces and reduce-scatters); ``op_reductions`` their reduction kind.
    """
    op_collectives = op_collectives or {}
    op_reductions = op_reductions or {}
    n_ops = len(graph.ops)
    values = graph.values
    producer = {v: t for t, op in enumerate(graph.ops) for v in op.outputs}
    inputs = set(graph.inputs)

    def nbytes(vid: ValueId, spec: Spec | None) -> float:
        value = values[vid]
        if spec is None:
            return float(value.nbytes)
        shard = spec.shard_shape(value.shape, sizes)
        return float(np.prod(shard, dtype=np.float64) * dtype_itemsize(value.dtype))

    # reshards that move data (collective-free ones are local slices that fuse into the reader)
    moving = [r for r in reshards if r.collectives]
    reads_through: dict[tuple[OpIndex, int], int] = {}  # (op, input pos) -> reshard node
    rs_nodes: dict[tuple[ValueId, Spec, bool], int] = {}  # (value, dst, written back) -> node
    rs_steps: list[int] = []
    rs_value: list[ValueId] = []
    rs_dst: list[Spec] = []
    rs_out: list[bool] = []
    for r in moving:
        key = (r.value, r.dst, r.op_index < 0)
        if key not in rs_nodes:
            rs_nodes[key] = n_ops + len(rs_steps)
            rs_steps.append(len(r.collectives))
            rs_value.append(r.value)
            rs_dst.append(r.dst)
            rs_out.append(r.op_index < 0)
        if r.op_index >= 0:
            reads_through[(r.op_index, r.input_pos)] = rs_nodes[key]
    forced = {r.value for r in moving}
    forced |= {v for t, cs in op_collectives.items() if cs for v in graph.ops[t].outputs}
    fusion = fusion_analysis(graph, forced)

    # rule 5: combine strategy all-reduces (and the all-reduce inside a reduce-scatter)
    reducing = [t for t in range(n_ops) if op_collectives.get(t)]
    groups = _combine_all_reduces(graph, reducing, op_collectives, op_reductions)
    n_rs = len(rs_steps)
    ar_node = {t: n_ops + n_rs + g for g, members in enumerate(groups) for t in members}
    n_nodes = n_ops + n_rs + len(groups)

    def provider(vid: ValueId) -> NodeId | None:
        t = producer.get(vid)
        if t is None:
            return None
        return ar_node.get(t, t)

    preds: list[list[NodeId]] = [[] for _ in range(n_nodes)]
    for t, op in enumerate(graph.ops):
        for pos, vid in enumerate(op.inputs):
            node = reads_through.get((t, pos))
            if node is None:
                node = provider(vid)
            if node is not None:
                preds[t].append(node)
    for k in range(n_rs):
        p = provider(rs_value[k])
        if p is not None:
            preds[n_ops + k].append(p)
    for g, members in enumerate(groups):
        preds[n_ops + n_rs + g].extend(members)
    weight = [1 if t in fusion.instruction else 0 for t in range(n_ops)]
    weight += rs_steps + [2 if any(c.kind == "reduce-scatter" for t in m for c in op_collectives[t]) else 1
                          for m in groups]
    seq = list(range(n_ops)) + [float(producer.get(v, -1)) + 0.5 for v in rs_value]
    seq += [float(max(m)) + 0.5 for m in groups]
    sched = _place_fused(breadth_first(preds, weight, seq), fusion, range(n_ops))
    pos = sched.position
    end = max(sched.num_positions - 1, 0)

    # readers of every buffer, as positions
    last_read: dict[ValueId, int] = defaultdict(lambda: -1)
    readers_of: dict[ValueId, list[NodeId]] = defaultdict(list)  # for donation (rule 6)
    opaque_read: set[ValueId] = set()  # buffers a dot, convolution or other unfusible op reads
    for t, op in enumerate(graph.ops):
        for p_, vid in enumerate(op.inputs):
            node = reads_through.get((t, p_))
            if node is not None:
                continue  # the reshard node reads vid; t reads the copy
            root = buffer_root(fusion, vid)
            for q in _reader_positions(sched, fusion, t):
                last_read[root] = max(last_read[root], q)
            readers_of[root].extend([t] if t in fusion.instruction else fusion.roots.get(t, ()))
            if op_kind(op) == OpKind.OPAQUE:
                opaque_read.add(root)
    copy_last_read: dict[int, int] = defaultdict(lambda: -1)
    for (t, p_), node in reads_through.items():
        for q in _reader_positions(sched, fusion, t):
            copy_last_read[node] = max(copy_last_read[node], q)
    for k in range(n_rs):
        root = buffer_root(fusion, rs_value[k])
        last_read[root] = max(last_read[root], int(pos[n_ops + k]))
        readers_of[root].append(n_ops + k)
        opaque_read.add(root)
    # rule 4: a reduce-scatter's dynamic-slice fuses into fusible readers, keeping the full all-reduce alive
    sliced_late = {v: t for t in ar_node if any(c.kind == "reduce-scatter" for c in op_collectives[t])
                   for v in graph.ops[t].outputs if v not in opaque_read and v not in graph.outputs}

    carried_out = {graph.outputs[k]: i for k, i in enumerate(graph.carried or ()) if i is not None}
    written_back = {rs_value[k] for k in range(n_rs) if rs_out[k]}
    spans: list[Span] = []
    for vid in fusion.materialized:
        if vid in inputs:
            continue
        if vid in graph.outputs and vid not in written_back:
            continue  # lives in the output allocation (or the donated argument)
        if vid in sliced_late:
            continue  # read straight from the all-reduce buffer
        t = producer[vid]
        start = int(pos[ar_node.get(t, t)])
        stop = max(start, last_read[vid])
        kind = "written back" if vid in written_back else "activation"
        spans.append(Span(start, stop, nbytes(vid, value_specs.get(vid)), kind, vid))
    for t, g_node in ar_node.items():  # rule 4: partial results (and a reduce-scatter's full all-reduce)
        for c in op_collectives[t]:
            spans.append(Span(int(pos[t]), int(pos[g_node]), float(c.nbytes), "partial sum", graph.ops[t].outputs[0]))
            if c.kind == "reduce-scatter":
                late = max((last_read[v] for v in graph.ops[t].outputs if v in sliced_late), default=-1)
                spans.append(Span(int(pos[g_node]), max(int(pos[g_node]), late), float(c.nbytes), "partial sum",
                                  graph.ops[t].outputs[0]))
    for k in range(n_rs):
        if rs_out[k]:
            continue
        node = n_ops + k
        spans.append(Span(int(pos[node]), max(int(pos[node]), copy_last_read[node]),
                          nbytes(rs_value[k], rs_dst[k]), "resharded", rs_value[k]))

    spans += _layout_copies(graph, fusion, pos, reads_through, provider, value_specs, nbytes,
                            {n_ops + k: rs_dst[k] for k in range(n_rs)})

    copies, pools = _donation(graph, sched, readers_of, provider, rs_nodes, carried_out,
                              lambda i: nbytes(graph.inputs[i], value_specs.get(graph.inputs[i])), end)
    spans = _assign_to_donated(spans + copies, pools)

    arguments: dict[str, float] = defaultdict(float)
    for vid in dict.fromkeys(graph.inputs):
        arguments[values[vid].role.value] += nbytes(vid, value_specs.get(vid))
    outs = [v for k, v in enumerate(graph.outputs) if not (graph.carried and graph.carried[k] is not None)]
    out_bytes = sum(nbytes(v, value_specs.get(v)) for v in outs if values[v].role != Role.CONSTANT)
    if len(graph.outputs) > 1:
        out_bytes += TUPLE_INDEX_BYTES * len(graph.outputs)
    spans = [s if s.stop <= end else dataclasses.replace(s, stop=end) for s in spans]
    return MemorySimulation(dict(arguments), float(out_bytes), tuple(spans), sched.num_positions)


def transposed_operands(op: Op, ranks: Sequence[int]) -> tuple[tuple[int, ...], bool]:
    """Rule 8: the operands XLA:CPU copies into a canonical layout before a dot or a convolution
    (``DotDecomposer``, ``ConvCanonicalization``), and whether the result is transposed afterwards.

    A dot operand is canonical as [batch..., free..., contracting...] or [batch..., contracting...,
    free...] (the dot emitter takes either); a convolution wants NHWC input, HWIO kernel, NHWC output.
    """
    dims = op.params.get("dimension_numbers")
    if op.primitive == "dot_general" and isinstance(dims, tuple) and len(dims) == 2:
        (lc, rc), (lb, rb) = dims
        out = []
        for pos, (contract, batch) in enumerate(((tuple(lc), tuple(lb)), (tuple(rc), tuple(rb)))):
            rank = ranks[pos]
            free = tuple(d for d in range(rank) if d not in contract and d not in batch)
            if tuple(range(rank)) not in (batch + free + contract, batch + contract + free):
                out.append(pos)
        return tuple(out), False
    if op.primitive == "conv_general_dilated" and hasattr(dims, "lhs_spec"):
        n = len(dims.lhs_spec)
        spatial = tuple(range(1, n - 1))
        lhs_ok = tuple(dims.lhs_spec) == (0, n - 1) + spatial
        rhs_ok = tuple(dims.rhs_spec) == (n - 1, n - 2) + tuple(range(n - 2))
        out_ok = tuple(dims.out_spec) == (0, n - 1) + spatial
        return tuple(p for p, ok in ((0, lhs_ok), (1, rhs_ok)) if not ok), not out_ok
    return (), False


def _layout_copies(graph: OpGraph, fusion: Fusion, pos: np.ndarray, reads_through: Mapping[tuple[int, int], int],
                   provider: Callable[[ValueId], NodeId | None], value_specs: Mapping[ValueId, Spec],
                   nbytes: Callable[[ValueId, Spec | None], float], dst_of: Mapping[int, Spec]) -> list[Span]:
    """Rule 8: one transposed copy per (operand buffer, layout), made as soon as the operand is ready
    (breadth-first) and kept until its last dot or convolution; a transposed result is transient."""
    groups: dict[tuple, list[OpIndex]] = defaultdict(list)
    sizes: dict[tuple, float] = {}
    starts: dict[tuple, int] = {}
    spans: list[Span] = []
    for t, op in enumerate(graph.ops):
        if op.primitive not in ("dot_general", "conv_general_dilated"):
            continue
        ranks = [graph.values[v].rank for v in op.inputs]
        operands, transposed_out = transposed_operands(op, ranks)
        for p in operands:
            vid = op.inputs[p]
            node = reads_through.get((t, p))
            if node is not None:
                key = ("copy", node, op.primitive, p, repr(op.params.get("dimension_numbers")))
                sizes[key], starts[key] = nbytes(vid, dst_of[node]), int(pos[node])
            else:
                root = buffer_root(fusion, vid)
                src = provider(root)
                key = ("value", root, op.primitive, p, repr(op.params.get("dimension_numbers")))
                sizes[key] = nbytes(vid, value_specs.get(vid))
                starts[key] = int(pos[src]) if src is not None else 0
            groups[key].append(t)
        if transposed_out:
            for v in op.outputs:
                spans.append(Span(int(pos[t]), int(pos[t]), nbytes(v, value_specs.get(v)), "layout copy", v))
    for key, readers in groups.items():
        stop = max(int(pos[t]) for t in readers)
        spans.append(Span(starts[key], max(stop, starts[key]), sizes[key], "layout copy", key[1] if key[0] == "value" else None))
    return spans


def _combine_all_reduces(graph: OpGraph, reducing: Sequence[OpIndex],
                         op_collectives: Mapping[OpIndex, Sequence[Collective]],
                         op_reductions: Mapping[OpIndex, str | None]) -> list[list[OpIndex]]:
    """Rule 5: greedy groups in program order; a group closes at the first member that depends on it."""
    if not reducing:
        return []
    producer = {v: t for t, op in enumerate(graph.ops) for v in op.outputs}
    bit = {t: 1 << k for k, t in enumerate(reducing)}
    upstream = [0] * len(graph.ops)  # reducing ops each op depends on (bitmask)
    for t, op in enumerate(graph.ops):
        mask = 0
        for v in op.inputs:
            p = producer.get(v)
            if p is not None:
                mask |= upstream[p] | bit.get(p, 0)
        upstream[t] = mask

    def key(t: OpIndex) -> tuple:
        cs = op_collectives[t]
        axes = tuple(sorted({a for c in cs for a in c.axes}))
        dtype = graph.values[graph.ops[t].outputs[0]].dtype
        return axes, op_reductions.get(t), dtype

    remaining = list(reducing)
    groups: list[list[OpIndex]] = []
    while remaining:
        k0 = key(remaining[0])
        group: list[OpIndex] = []
        mask = 0
        for t in remaining:
            if key(t) != k0:
                continue
            if upstream[t] & mask or len(group) >= 256:
                break
            group.append(t)
            mask |= bit[t]
        groups.append(group)
        taken = set(group)
        remaining = [t for t in remaining if t not in taken]
    return groups


def _donation(graph: OpGraph, sched: Schedule, readers_of: Mapping[ValueId, list[NodeId]],
              provider: Callable[[ValueId], NodeId | None], rs_nodes: Mapping[tuple, int],
              carried_out: Mapping[ValueId, int], arg_bytes: Callable[[int], float],
              end: int) -> tuple[list[Span], list[tuple[float, list[tuple[int, int]]]]]:
    """Rule 6: the copies CopyInsertion adds for donated arguments, and each donated buffer's busy intervals."""
    n = len(sched.preds)
    order = np.argsort(sched.level, kind="stable")
    ancestors: list[int] = [0] * n
    for v in order:
        mask = 0
        for p in sched.preds[v]:
            mask |= ancestors[p] | (1 << p)
        ancestors[v] = mask
    copies: list[Span] = []
    pools: list[tuple[float, list[tuple[int, int]]]] = []
    for out_vid, i in carried_out.items():
        arg = graph.inputs[i]
        if out_vid == arg:
            continue
        writer = next((node for (v, _, back), node in rs_nodes.items() if back and v == out_vid), None)
        if writer is None:
            writer = provider(out_vid)
        if writer is None:
            continue
        size = arg_bytes(i)
        readers = [r for r in readers_of.get(arg, ()) if r != writer]
        last = max((int(sched.position[r]) for r in readers_of.get(arg, ())), default=0)
        write = int(sched.position[writer])
        if readers and not all(ancestors[writer] >> r & 1 for r in readers):
            # the copies run one after another at the start: each frees its argument for later copies
            k = len(copies)
            copies.append(Span(k + 1, max(last, k + 1), size, "donation copy", arg))
            pools.append((size, [(0, k + 1), (write, end)]))
        else:
            pools.append((size, [(0, last), (write, end)]))
    return copies, pools


def _assign_to_donated(spans: list[Span], pools: list[tuple[float, list[tuple[int, int]]]]) -> list[Span]:
    """XLA's BufferAssigner: largest buffers first, each into the smallest donated argument buffer that is
    free for its whole life; what finds none goes to the temp heap (returned)."""
    pools = sorted(pools, key=lambda p: p[0])
    heap: list[Span] = []
    for s in sorted(spans, key=lambda s: (-s.nbytes, s.start)):
        for size, busy in pools:
            if size >= s.nbytes and all(s.stop < a or b < s.start for a, b in busy):
                busy.append((s.start, s.stop))
                break
        else:
            heap.append(s)
    return heap
