"""XLA:CPU's per-device memory for a step under a plan: buffers, donation reuse, the peak.

``compiled.memory_analysis()`` of an XLA:CPU executable reports argument +
output − alias + temp. Temp is one heap holding every buffer that is neither
an argument nor an output and did not fit into a dead donated argument; its
size is the most such bytes live at once in XLA's instruction order (the
heap simulator's fragmentation was under 4% on every example). ``simulate``
reproduces that figure from an OpGraph and a plan. Rules 1-3 (fusion, views,
the breadth-first schedule) and the reader helpers are plan-independent and
live in ``passes/liveness.py``, shared with the ILP's memory points; rules
4-9, read off the same XLA dumps, are here:

4. *Collectives*: a partial-sum strategy keeps the partial result and the
   reduced result as two buffers (all-reduce is not in place). A
   reduce-scatter is an all-reduce of the full partial result and a
   dynamic-slice; the slice fuses into fusible readers, which then keep the
   full all-reduce buffer alive until the last of them. A reshard with
   collectives makes one buffer per (value, target layout), shared by its
   readers (CSE); a reshard without collectives is a slice fused into its reader.
5. *All-reduce combining* (``CpuAllReduceCombiner``, no byte limit, 256
   operands): in program order, all-reduces over the same axes with the same
   reduction and dtype join one group until one depends on a member. The
   group runs after its last operand is ready, so every partial result (the
   gradients of a data-parallel step) lives until then.
6. *Donation* (``CopyInsertion``, ``BufferAssigner``): updated state is
   written into its donated argument. An argument read by an op that is not an
   ancestor of its update (a backward dot reading a weight) is copied at the
   start. Temporaries, largest first, reuse a donated argument buffer that is
   free for their whole life (after the argument's last read or copy, before
   its update); the rest go to the temp heap.
7. *Outputs and arguments*: outputs that are not donated state are in the
   output allocation (plus an 8-byte pointer per leaf for the output tuple);
   arguments count in full for the whole step, as ``memory_analysis`` reports.
8. *Layout copies* (``DotDecomposer``, ``ConvCanonicalization``): a dot
   operand not laid out as [batch, free, contracting] or [batch, contracting,
   free], and a convolution input, kernel or output not in NHWC / HWIO / NHWC
   order, is transposed into a copy. The copy is made as soon as the operand
   exists (rule 3) and kept until its last such reader: a weight-gradient
   convolution keeps a transposed copy of its forward activation.
9. *Reshard transients*: an all-gather along a dimension that is not
   major-most lands in a permuted layout and is copied into the default one;
   an all-to-all is decomposed into sliced pieces and received pieces. Both
   cost extra result-sized buffers for one step.
10. *Narrow floats computed in float32* (``ClusterSpec.f32_compute_dtypes``:
   XLA:CPU and bfloat16 / float16): a dot or convolution of such operands
   runs on float32 operands into a float32 result. Its result buffer, the
   buffers materialised as its operands and its layout copies are float32;
   an argument it reads (a bfloat16 weight) gets a float32 copy from the
   start until its last dot. Measured on GPT tiny in bfloat16 on one device:
   XLA:CPU's temp was 2.38 MB against 0.83 MB of bfloat16 activations
   modeled without this rule. Between elementwise ops too (excess precision,
   ``buffer_rules.excess_precision``): math XLA runs in float32 and only
   float32 math reads stays float32 (a residual stream's adds): the peak of
   GPT tiny in bfloat16 on one device went from 17% to 7% under XLA:CPU's.

Here: ``simulate`` and its pass (``_Simulation``), its result (``Span``,
``MemorySimulation``), and the rule 5, 6 and 8 helpers.
"""
from __future__ import annotations

import dataclasses
import types
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from autoshard.ir.graph import OpGraph, Role, ValueId, dtype_itemsize
from autoshard.ir.primitives import CONTRACTIONS
from autoshard.ir.spec import Collective, Spec, partial_sums
from autoshard.passes.buffer_rules import (Span, assign_to_donated, combine_all_reduces, donation,
                                           excess_precision, f32_dot_buffers, transposed_operands)
from autoshard.passes.liveness import (InstructionOrder, NodeId, OpIndex, OpKind, place_fused, reader_positions,
                                       breadth_first, buffer_root, fusion_analysis, op_kind)


class ReshardLike(Protocol):
    """What ``simulate`` reads of a reshard site (``intra_op.ReshardSite``)."""

    op_index: int  # -1: a carried output written back to its storage layout
    input_pos: int
    value: ValueId
    src: Spec
    dst: Spec
    collectives: tuple[Collective, ...]


@dataclass(frozen=True)
class MemorySimulation:
    arguments: Mapping[str, float]  # per-device argument bytes by role (live for the whole step)
    outputs: float  # non-donated outputs (output allocation), with the tuple index table
    spans: tuple[Span, ...]  # temporaries
    num_positions: int
    views: Mapping[ValueId, ValueId] = dataclasses.field(default_factory=dict)  # view -> the value owning its buffer

    def buffer_of(self, vid: ValueId) -> ValueId:
        """The value whose buffer holds ``vid`` (itself unless it is a view)."""
        while vid in self.views:
            vid = self.views[vid]
        return vid

    @property
    def fixed_bytes(self) -> float:
        return float(sum(self.arguments.values())) + self.outputs

    def temp_profile(self) -> np.ndarray:
        n = max(self.num_positions, 1)
        change = np.zeros(n + 1)  # bytes that start (+) and stop (-) living at each position: O(spans)
        for s in self.spans:
            if s.start < n and s.start <= s.stop:
                change[s.start] += s.nbytes
                change[min(s.stop + 1, n)] -= s.nbytes
        return np.cumsum(change[:n])

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
             op_reductions: Mapping[OpIndex, str | None] | None = None,
             f32_compute_dtypes: Iterable[str] = (), held: Sequence[Span] = ()) -> MemorySimulation:
    """Per-device buffers of ``graph`` run with these specs, as XLA:CPU lays them out (rules 1-10).

    ``op_collectives`` are each op's strategy collectives (partial-sum
    all-reduces and reduce-scatters); ``op_reductions`` their reduction kind;
    ``f32_compute_dtypes`` the cluster's (rule 10); ``held``: more buffers, from op index ``start`` to
    ``stop`` (the partial sums a deferred reduction keeps over its loop, ``passes/deferral.py``).
    """
    return _Simulation(graph, value_specs, sizes, reshards, op_collectives or {}, op_reductions or {},
                       frozenset(f32_compute_dtypes), held).run()


@dataclass
class _LayoutGroup:
    """Operand reads that share one transposed copy (rule 8)."""

    source: NodeId | None  # node that provides the operand (None: an argument)
    root: ValueId | None  # the buffer copied (None: a resharded copy)
    nbytes: float
    reads: list[tuple[OpIndex, int]] = dataclasses.field(default_factory=list)


@dataclass
class _Reads:
    last_read: dict[ValueId, int]  # buffer -> last position that reads it
    readers_of: dict[ValueId, list[NodeId]]  # buffer -> reading nodes (for donation, rule 6)
    opaque_read: set[ValueId]  # buffers read by a dot, convolution or other unfusible op
    copy_last_read: dict[NodeId, int]  # reshard node -> last position that reads its copy


class _Simulation:
    """One pass over the graph and plan: instruction nodes, their breadth-first order, buffer spans."""

    def __init__(self, graph: OpGraph, value_specs: Mapping[ValueId, Spec], sizes: Mapping[str, int],
                 reshards: Sequence[ReshardLike], op_collectives: Mapping[OpIndex, Sequence[Collective]],
                 op_reductions: Mapping[OpIndex, str | None], f32_dtypes: frozenset[str] = frozenset(),
                 held: Sequence[Span] = ()) -> None:
        self.graph, self.value_specs, self.sizes = graph, value_specs, sizes
        self.f32_dtypes, self.widened = f32_dtypes, frozenset[ValueId]()  # rule 10, set by run()
        self.held = tuple(held)  # extra buffers, by op index (``simulate``)
        self.op_collectives = {t: tuple(cs) for t, cs in op_collectives.items() if cs}
        self.n_ops = n_ops = len(graph.ops)
        self.producer = {v: t for t, op in enumerate(graph.ops) for v in op.outputs}
        # reshard nodes: one per (value, target layout, written back). A reshard without collectives is a
        # local slice: it fuses into a fusible reader, and is a buffer of its own before a dot
        self.rs_key: list[tuple[ValueId, Spec, bool]] = []
        self.rs_steps: list[int] = []
        self.rs_transient: list[float] = []  # rule 9: bytes of the reshard's short-lived extra buffers
        self.reads_through: dict[tuple[OpIndex, int], NodeId] = {}
        node_of: dict[tuple[ValueId, Spec, bool], NodeId] = {}
        self.read_spec: dict[tuple[OpIndex, int], Spec] = {}  # the layout an op reads an input in
        for r in reshards:
            if r.op_index >= 0:
                self.read_spec[(r.op_index, r.input_pos)] = r.dst
            sliced_for_dot = r.op_index >= 0 and op_kind(graph.ops[r.op_index]) == OpKind.OPAQUE
            if not r.collectives and not sliced_for_dot:
                continue
            key = (r.value, r.dst, r.op_index < 0)
            if key not in node_of:
                node_of[key] = n_ops + len(self.rs_key)
                self.rs_key.append(key)
                self.rs_steps.append(max(len(r.collectives), 1))
                self.rs_transient.append(self._transient_bytes(r))
            if r.op_index >= 0:
                self.reads_through[(r.op_index, r.input_pos)] = node_of[key]
        self.written_back = {v: node for (v, _, back), node in node_of.items() if back}
        forced = {key[0] for key in self.rs_key}
        forced |= {v for t in self.op_collectives for v in graph.ops[t].outputs}
        self.fusion = fusion_analysis(graph, forced, {t for t, _ in self.reads_through})
        # rule 5: strategy all-reduces (and the all-reduce of a reduce-scatter) combined into groups
        self.groups = combine_all_reduces(graph, sorted(self.op_collectives), self.op_collectives, op_reductions)
        first_group = n_ops + len(self.rs_key)
        self.ar_node = {t: first_group + g for g, members in enumerate(self.groups) for t in members}
        self.sched = self._schedule()
        self.pos = self.sched.position
        self.end = max(self.sched.num_positions - 1, 0)
        # a scan's stacked output is allocated before its first iteration (each one writes a slice into it)
        self.stacked_from = {graph.ops[t].outputs[0]: min(self.at(u) for u in range(r.body_start, r.body_stop))
                             for r in graph.loops if r.kind == "scan" and r.body_stop > r.body_start
                             for t in r.stack_ops}

    # ---- helpers
    def nbytes(self, vid: ValueId, spec: Spec | None = None) -> float:
        value = self.graph.values[vid]
        spec = spec if spec is not None else self.value_specs.get(vid)
        widen = max(dtype_itemsize(value.dtype), 4) / dtype_itemsize(value.dtype) if vid in self.widened else 1.0
        if spec is None:
            return float(value.nbytes) * widen
        shard = spec.shard_shape(value.shape, self.sizes)
        return float(np.prod(shard, dtype=np.float64) * dtype_itemsize(value.dtype)) * widen

    def _transient_bytes(self, r: ReshardLike) -> float:
        """Rule 9: XLA:CPU gathers along the major-most dimension, so a gather along an inner dimension
        lands in a permuted layout and is copied into the default one; an all-to-all is decomposed into
        slices of its operand and separate received pieces before they are concatenated."""
        value = self.graph.values[r.value]
        src_shard, dst_shard = (spec.shard_shape(value.shape, self.sizes) for spec in (r.src, r.dst))
        gathered = [d for d, (a, b) in enumerate(zip(r.src.dims, r.dst.dims)) if set(a) - set(b)]
        split = [d for d, (a, b) in enumerate(zip(r.src.dims, r.dst.dims)) if set(b) - set(a)]

        def inner(dims: Sequence[int], shard: Sequence[int]) -> bool:
            return any(any(n > 1 for n in shard[:d]) for d in dims)

        extra = 0.0
        for c in r.collectives:
            if c.kind == "all-to-all":  # received pieces, and sliced pieces unless the split is major-most
                extra += c.nbytes * (2 if inner(split, src_shard) else 1)
        if any(c.kind == "all-gather" for c in r.collectives) and inner(gathered, dst_shard):
            extra += self.nbytes(r.value, r.dst)
        return extra

    def provider(self, vid: ValueId) -> NodeId | None:
        """The node after which ``vid`` is available (its op, or the all-reduce that completes it)."""
        t = self.producer.get(vid)
        return None if t is None else self.ar_node.get(t, t)

    def at(self, node: NodeId | None) -> int:
        return 0 if node is None else int(self.pos[node])

    def _schedule(self) -> InstructionOrder:
        graph, n_ops = self.graph, self.n_ops
        n_nodes = n_ops + len(self.rs_key) + len(self.groups)
        preds: list[list[NodeId]] = [[] for _ in range(n_nodes)]
        for t, op in enumerate(graph.ops):
            for p, vid in enumerate(op.inputs):
                node = self.reads_through.get((t, p), self.provider(vid))
                if node is not None:
                    preds[t].append(node)
        for k, (vid, _, _) in enumerate(self.rs_key):
            if (node := self.provider(vid)) is not None:
                preds[n_ops + k].append(node)
        for g, members in enumerate(self.groups):
            preds[n_ops + len(self.rs_key) + g].extend(members)
        weight = [1 if t in self.fusion.instruction else 0 for t in range(n_ops)] + list(self.rs_steps)
        weight += [2 if any(c.kind == "reduce-scatter" for t in m for c in self.op_collectives[t]) else 1
                   for m in self.groups]
        seq = [float(t) for t in range(n_ops)] + [self.producer.get(v, -1) + 0.5 for v, _, _ in self.rs_key]
        seq += [max(m) + 0.5 for m in self.groups]
        return place_fused(breadth_first(preds, weight, seq), self.fusion, range(n_ops))

    def layout_groups(self) -> list[_LayoutGroup]:
        """Rule 8: transposed operand copies, shared per (source, layout). A fusion that only feeds such
        reads writes the transposed layout itself, so its value needs no second copy."""
        graph, fusion = self.graph, self.fusion
        groups: dict[tuple, _LayoutGroup] = {}
        for t, op in enumerate(graph.ops):
            if op.primitive not in CONTRACTIONS:
                continue
            operands, _ = transposed_operands(op, [graph.values[v].rank for v in op.inputs])
            for p in operands:
                vid, layout = op.inputs[p], (op.primitive, p, repr(op.params.get("dimension_numbers")))
                node = self.reads_through.get((t, p))
                if node is not None:
                    size = self.nbytes(vid, self.rs_key[node - self.n_ops][1])
                    group = groups.setdefault(("copy", node, layout), _LayoutGroup(node, None, size))
                else:
                    root = buffer_root(fusion, vid)
                    key = ("value", root, layout)
                    group = groups.setdefault(key, _LayoutGroup(self.provider(root), root,
                                                                self.nbytes(vid, self.read_spec.get((t, p)))))
                group.reads.append((t, p))
        readers: dict[ValueId, set[tuple[OpIndex, int]]] = defaultdict(set)
        for t, op in enumerate(graph.ops):
            for p, vid in enumerate(op.inputs):
                if (t, p) not in self.reads_through:
                    readers[buffer_root(fusion, vid)].add((t, p))
        copy_readers: dict[NodeId, set[tuple[OpIndex, int]]] = defaultdict(set)
        for read, node in self.reads_through.items():
            copy_readers[node].add(read)
        resharded = {v for v, _, _ in self.rs_key}
        kept = []
        for group in groups.values():
            if group.root is None:  # the reshard writes the transposed layout when nothing else reads it
                if copy_readers[group.source] <= set(group.reads):
                    continue
            else:
                t = self.producer.get(group.root)
                if (t is not None and op_kind(graph.ops[t]) == OpKind.ELEMENTWISE and group.root not in resharded
                        and readers[group.root] <= set(group.reads)):
                    continue
            kept.append(group)
        return kept

    # ---- the pass
    def reads(self, layout: Sequence[_LayoutGroup]) -> _Reads:
        """When each buffer is last read, by which nodes, and which buffers an unfusible op reads."""
        graph, fusion = self.graph, self.fusion
        via_copy = {read for g in layout for read in g.reads}
        out = _Reads(defaultdict(lambda: -1), defaultdict(list), set(), defaultdict(lambda: -1))

        def read(root: ValueId, position: int, nodes: Iterable[NodeId]) -> None:
            out.last_read[root] = max(out.last_read[root], position)
            out.readers_of[root].extend(nodes)

        for t, op in enumerate(graph.ops):
            positions = reader_positions(self.sched, fusion, t)
            nodes = [t] if t in fusion.instruction and t not in fusion.duplicated else list(fusion.roots.get(t, ()))
            for p, vid in enumerate(op.inputs):
                node = self.reads_through.get((t, p))
                if node is not None:
                    if (t, p) not in via_copy:
                        out.copy_last_read[node] = max([out.copy_last_read[node], *positions])
                    continue
                if (t, p) in via_copy or fusion.recomputed_by(self.producer.get(vid), op):
                    continue  # reads the transposed copy, or recomputes the value
                root = buffer_root(fusion, vid)
                read(root, max(positions, default=-1), nodes)
                if op_kind(op) == OpKind.OPAQUE:
                    out.opaque_read.add(root)
        for g in layout:  # each transposed copy reads its source once, right away
            if g.root is not None:
                read(g.root, self.at(g.source), [] if g.source is None else [g.source])
            else:
                out.copy_last_read[g.source] = max(out.copy_last_read[g.source], self.at(g.source))
        for k, (vid, _, _) in enumerate(self.rs_key):
            root = buffer_root(fusion, vid)
            read(root, self.at(self.n_ops + k), [self.n_ops + k])
            out.opaque_read.add(root)
        return out

    def run(self) -> MemorySimulation:
        graph = self.graph
        layout = self.layout_groups()
        spans = self._f32_copies(layout) if self.f32_dtypes else []
        reads = self.reads(layout)
        spans += self._value_spans(reads.last_read, reads.opaque_read)
        for k, (vid, dst, back) in enumerate(self.rs_key):
            node = self.n_ops + k
            if not back:
                stop = max(self.at(node), reads.copy_last_read[node])
                spans.append(Span(self.at(node), stop, self.nbytes(vid, dst), "resharded", vid))
            if self.rs_transient[k]:
                spans.append(Span(self.at(node), self.at(node), self.rs_transient[k], "reshard transient", vid))
        spans += [dataclasses.replace(h, start=self.at(h.start), stop=self.at(h.stop)) for h in self.held]
        for g in layout:
            stop = max(self.at(t) for t, _ in g.reads)
            spans.append(Span(self.at(g.source), max(stop, self.at(g.source)), g.nbytes, "layout copy", g.root))
        for t, op in enumerate(graph.ops):
            if op.primitive in CONTRACTIONS:
                if transposed_operands(op, [graph.values[v].rank for v in op.inputs])[1]:
                    spans += [Span(self.at(t), self.at(t), self.nbytes(v), "layout copy", v) for v in op.outputs]

        carried = {graph.outputs[k]: i for k, i in enumerate(graph.carried or ()) if i is not None}
        copies, pools = donation(graph, self.sched, reads.readers_of, self.provider, self.written_back, carried,
                                  lambda i: self.nbytes(graph.inputs[i]), self.end)
        spans = assign_to_donated(spans + copies, pools)
        spans = [s if s.stop <= self.end else dataclasses.replace(s, stop=self.end) for s in spans]

        arguments: dict[str, float] = defaultdict(float)
        for vid in dict.fromkeys(graph.inputs):
            arguments[graph.values[vid].role.value] += self.nbytes(vid)
        outs = [v for k, v in enumerate(graph.outputs) if not (graph.carried and graph.carried[k] is not None)]
        out_bytes = sum(self.nbytes(v) for v in outs if graph.values[v].role != Role.CONSTANT)
        if len(graph.outputs) > 1:
            out_bytes += TUPLE_INDEX_BYTES * len(graph.outputs)
        return MemorySimulation(dict(arguments), float(out_bytes), tuple(spans), self.sched.num_positions,
                                self.fusion.alias)

    def _f32_copies(self, layout: list[_LayoutGroup]) -> list[Span]:
        """Rule 10: float32 results and operands of narrow-float dots (``self.widened``, which ``nbytes``
        reads), their layout copies in float32, and the float32 copies of the arguments they read."""
        graph, fusion = self.graph, self.fusion
        skip = {read for g in layout for read in g.reads} | set(self.reads_through)
        direct = {(t, p) for t, op in enumerate(graph.ops) if op.primitive in CONTRACTIONS
                  for p in range(len(op.inputs))}
        shared = {buffer_root(fusion, v) for t, op in enumerate(graph.ops) for p, v in enumerate(op.inputs)
                  if ((t, p) not in direct or (t, p) in skip) and not fusion.recomputed_by(self.producer.get(v), op)}
        found = f32_dot_buffers(graph, self.f32_dtypes, lambda v: buffer_root(fusion, v), skip, shared)
        self.widened = found.widened | excess_precision(graph, self.f32_dtypes, fusion.materialized)
        for g in layout:
            t, p = g.reads[0]
            if graph.ops[t].primitive in CONTRACTIONS and graph.values[graph.ops[t].inputs[p]].dtype in self.f32_dtypes:
                g.nbytes *= 4 / dtype_itemsize(graph.values[graph.ops[t].inputs[p]].dtype)
        spans = []
        for root, dots in found.copies.items():
            start = self.at(self.provider(root))
            nbytes = 4 / dtype_itemsize(graph.values[root].dtype) * self.nbytes(root)
            spans.append(Span(start, max(start, *(self.at(t) for t in dots)), nbytes, "float32 copy", root))
        return spans

    def _value_spans(self, last_read: Mapping[ValueId, int], opaque_read: set[ValueId]) -> list[Span]:
        """Op results (rules 1-2), partial sums and all-reduce results (rule 4)."""
        graph = self.graph
        # a reduce-scatter's dynamic-slice fuses into fusible readers: they read the full all-reduce buffer
        outputs = set(graph.outputs)
        sliced_late = {v for t in self.ar_node if any(c.kind == "reduce-scatter" for c in self.op_collectives[t])
                       for v in graph.ops[t].outputs if v not in opaque_read and v not in outputs}
        spans: list[Span] = []
        inputs = set(graph.inputs)
        for vid in self.fusion.materialized:
            if vid in inputs or vid in sliced_late:
                continue
            if vid in outputs and vid not in self.written_back:
                continue  # lives in the output allocation (or the donated argument)
            start = self.at(self.provider(vid))
            if vid in self.stacked_from:  # a loop's stacked output is allocated before its first iteration
                start = min(start, self.stacked_from[vid])
            kind = "written back" if vid in self.written_back else "activation"
            spans.append(Span(start, max(start, last_read[vid]), self.nbytes(vid), kind, vid))
        for t, node in self.ar_node.items():
            out = graph.ops[t].outputs[0]
            for c in partial_sums(self.op_collectives[t]):
                spans.append(Span(self.at(t), self.at(node), float(c.nbytes), "partial sum", out))
                if c.kind == "reduce-scatter":
                    late = max((last_read[v] for v in graph.ops[t].outputs if v in sliced_late), default=-1)
                    spans.append(Span(self.at(node), max(self.at(node), late), float(c.nbytes), "partial sum", out))
        return spans


# --------------------------------------------------------------------------- plan-independent liveness


def liveness_intervals(graph: OpGraph) -> Mapping[ValueId, tuple[int, int]]:
    """Buffer -> (first position, last position) inclusive, in XLA:CPU's breadth-first order, before any
    plan is chosen (rules 1-3 and the reader rules of ``simulate``); made once per graph (``OpGraph.derived``,
    read-only).

    Arguments live throughout; donated state written back (carried outputs)
    lives in its argument's buffer and is left out; other outputs live from
    their definition to the end; a view's readers extend its buffer's life.
    Keys are the inputs and the values of ``materialized_values`` that own a buffer.
    """
    return graph.derived("liveness_intervals", lambda: types.MappingProxyType(_liveness_intervals(graph)))


def op_positions(graph: OpGraph) -> np.ndarray:
    """Each op's position in XLA:CPU's breadth-first order before any plan is chosen: the positions of
    ``liveness_intervals`` and of the ILP's memory points (made once per graph)."""
    def make() -> np.ndarray:
        sim = _Simulation(graph, {}, {}, (), {}, {})
        positions = np.array([sim.at(t) for t in range(len(graph.ops))], dtype=int)
        positions.setflags(write=False)
        return positions
    return graph.derived("op_positions", make)


def _liveness_intervals(graph: OpGraph) -> dict[ValueId, tuple[int, int]]:
    sim = _Simulation(graph, {}, {}, (), {}, {})
    reads = sim.reads(sim.layout_groups())
    live: dict[ValueId, tuple[int, int]] = {v: (0, sim.end) for v in graph.inputs}
    for vid in sim.fusion.materialized:
        start = sim.at(sim.provider(vid))
        live[vid] = (min(start, sim.stacked_from.get(vid, start)), max(start, reads.last_read[vid]))
    carried = {graph.outputs[k] for k, i in enumerate(graph.carried or ()) if i is not None}
    inputs = set(graph.inputs)
    for vid in graph.outputs:
        if vid in live and vid not in inputs:
            if vid in carried:
                live.pop(vid)
            else:
                live[vid] = (live[vid][0], sim.end)
    return live


def materialized_values(graph: OpGraph) -> frozenset[ValueId]:
    """Values that occupy memory: inputs, outputs, and op results that no fusion absorbs."""
    return graph.derived("materialized_values", lambda: frozenset(graph.inputs) | frozenset(graph.outputs)
                         | fusion_analysis(graph).materialized)
