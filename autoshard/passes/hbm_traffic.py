"""HBM traffic as XLA fuses: which buffers each op reads and writes, and what a strategy costs in time.

XLA runs a step as a sequence of instructions: fusions (chains of elementwise
ops, broadcasts, slices, transposes, and the reduction or dot output they feed),
dots, convolutions, collectives and copies. ``compiled.cost_analysis()``'s
"bytes accessed" is, per instruction, its operands' bytes plus its result's
bytes; what stays inside a fusion never touches memory. So an op's traffic is:

- *reads*: each operand buffer produced outside its fusion (a step argument, a
  non-scalar constant, or the result of an op that is an instruction of its own:
  ``passes/liveness.fusion_analysis``), counted once per fusion that reads it
  (the first op of the fusion that reads it carries it);
- *writes*: each result the op materialises (a fusion root, a dot, a reduction,
  a value read by an unfusible op or returned);
- *layout copies* (rule 8 of the memory model): an operand a dot or convolution
  reads transposed is copied first (one more read and write of it);
- *stacked slices*: a scan's loop copies each slice of a stacked input out of
  the stack (the stack read, each slice written) and writes each stacked output
  a slice per iteration; a scan unrolled whole (``fully_unrolled``) is
  straight-line code whose static slices fuse into their readers.

Views (reshapes, bitcasts) move nothing. Bytes are per device: each buffer at
the shard size of the spec the strategy reads or writes it in. A strategy's
compute time is the roofline of its per-device FLOPs (``Strategy.flops``) at
the peak of its compute dtype (``compute_dtype``: a dot or convolution runs at
its operands' dtype, so bf16 dots use the bf16 peak even with an f32 result)
and these bytes at HBM bandwidth: one cost model for the intra-op pass, the
baselines, the ledger and the reports (``meshes/cost.roofline_s``).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.ir.graph import LoopRegion, Op, OpGraph, Role, ValueId
from autoshard.ir.primitives import CONTRACTIONS
from autoshard.ir.spec import Collective, Spec
from autoshard.meshes.cluster import ClusterSpec
from autoshard.meshes.cost import roofline_s
from autoshard.meshes.logical import LogicalMesh
from autoshard.passes.buffer_rules import transposed_operands
from autoshard.passes.liveness import Fusion, OpKind, fusion_analysis, op_kind
from autoshard.passes.strategies.base import Strategy, op_dtype


@dataclass(frozen=True)
class OpTraffic:
    """The buffers one op moves through HBM, by position (see the module docstring)."""

    reads: tuple[tuple[int, int], ...] = ()  # (input position, how many fusions read it there)
    writes: tuple[int, ...] = ()  # output positions written
    copies: tuple[int, ...] = ()  # input positions copied into another layout first
    output_copied: bool = False  # a convolution whose result is transposed afterwards

    @property
    def moves_nothing(self) -> bool:
        return not (self.reads or self.writes or self.copies or self.output_copied)


def compute_dtype(op: Op, graph: OpGraph) -> str:
    """The peak an op runs at (``strategies.base.op_dtype``)."""
    return op_dtype(op, [graph.values[v] for v in op.inputs], [graph.values[v] for v in op.outputs])


def op_traffic(graph: OpGraph, fusion: Fusion | None = None) -> Sequence[OpTraffic]:
    """Per op of ``graph``, what it reads and writes (module docstring); one pass over the graph, made once
    per graph for its own fusions (``OpGraph.derived``)."""
    if fusion is None:
        return graph.derived("op_traffic", lambda: tuple(_op_traffic(graph, fusion_analysis(graph))))
    return _op_traffic(graph, fusion)


def _op_traffic(graph: OpGraph, fusion: Fusion) -> list[OpTraffic]:
    producer = {v: t for t, op in enumerate(graph.ops) for v in op.outputs}
    views = {t for t, op in enumerate(graph.ops) if op.outputs and all(v in fusion.alias for v in op.outputs)}

    def buffer(v: ValueId) -> ValueId | None:
        """The buffer a read of ``v`` touches, or None when ``v`` is computed inside the reader's fusion."""
        while v in fusion.alias:
            v = fusion.alias[v]
        t = producer.get(v)
        if t is None:
            value = graph.values[v]
            return None if value.role == Role.CONSTANT and value.size <= 1 else v
        return v if v in fusion.materialized else None

    # the first reader of each (fusion, buffer) carries the read
    first_reader: dict[tuple[int, ValueId], tuple[int, int]] = {}
    for t, op in enumerate(graph.ops):
        if t in views:
            continue
        for p, v in enumerate(op.inputs):
            b = buffer(v)
            if b is None or fusion.recomputed_by(producer.get(v), op):
                continue
            for root in fusion.roots.get(t, (t,)):
                first_reader.setdefault((root, b), (t, p))
    counts: dict[tuple[int, int], int] = defaultdict(int)
    for t_p in first_reader.values():
        counts[t_p] += 1
    unrolled = {t for region in graph.loops if region.kind == "scan" and fully_unrolled(region)
                for t in region.slice_ops}
    out: list[OpTraffic] = []
    for t, op in enumerate(graph.ops):
        if op.primitive == "loop_slice" and t in unrolled:  # a static slice, fused into the ops that read it:
            # through a view its readers read their slices of the stack; else the stack is read once here
            out.append(OpTraffic() if t in views else OpTraffic(((0, 1),)))
            continue
        if op.primitive == "loop_slice":  # each iteration copies its slice out of the stack (a dynamic-slice):
            out.append(OpTraffic(((0, 1),), (0,)))  # the whole stack read over the loop, and each slice written
            continue
        if op.primitive == "loop_stack":  # each iteration reads its slice and writes it into the stack
            out.append(OpTraffic(((0, 1),), (0,)))  # (a dynamic-update-slice; the write is one layer's: see below)
            continue
        if t in views:
            out.append(OpTraffic())
            continue
        reads = tuple((p, counts[(t, p)]) for p in range(len(op.inputs)) if counts.get((t, p)))
        writes = tuple(k for k, v in enumerate(op.outputs) if v in fusion.materialized)
        copies: tuple[int, ...] = ()
        output_copied = False
        if op.primitive in CONTRACTIONS:
            copies, output_copied = transposed_operands(op, [graph.values[v].rank for v in op.inputs])
        out.append(OpTraffic(reads, writes, tuple(copies), output_copied))
    return out


def fully_unrolled(region: LoopRegion) -> bool:
    """Whether a scan is unrolled whole (``lax.scan(..., unroll=True)`` or ``unroll >= length``, as penzai's
    ``LayerStack`` scans): XLA then runs straight-line code, each slice of a stacked input a static slice that
    fuses into its readers, where a loop copies each slice out of the stack."""
    return region.unroll is True or (isinstance(region.unroll, int) and region.unroll >= region.length)


def _per_run(op: Op) -> float:
    """How many runs of ``op`` write its output: a scan stack is written a layer per iteration; a slice is
    written once per iteration and the op runs outside the loop, so its write counts the slice once per layer."""
    if op.primitive == "loop_stack":
        return int(op.params["length"])
    if op.primitive == "loop_slice":
        return 1 / int(op.params["length"])
    return 1


def _shard_bytes(nbytes: float, spec: Spec, sizes: Mapping[str, int]) -> float:
    return nbytes / spec.num_shards(sizes)


def strategy_hbm_bytes(graph: OpGraph, op: Op, traffic: OpTraffic, in_specs: Sequence[Spec],
                       out_specs: Sequence[Spec], sizes: Mapping[str, int]) -> float:
    """Per-device HBM bytes of ``op`` run with these specs."""
    values = graph.values
    total = 0.0
    for p, times in traffic.reads:
        total += times * _shard_bytes(values[op.inputs[p]].nbytes, in_specs[p], sizes)
    for p in traffic.copies:  # read once more and written in the canonical layout
        total += 2 * _shard_bytes(values[op.inputs[p]].nbytes, in_specs[p], sizes)
    for k in traffic.writes:
        total += _shard_bytes(values[op.outputs[k]].nbytes, out_specs[k], sizes) / _per_run(op)
    if traffic.output_copied:
        total += 2 * sum(_shard_bytes(values[v].nbytes, s, sizes) for v, s in zip(op.outputs, out_specs))
    return total


def collective_hbm_bytes(collective: Collective, mesh: LogicalMesh) -> float:
    """Per-device bytes a collective instruction reads and writes (what cost_analysis counts for it).

    ``Collective.nbytes`` is the buffer XLA's HLO shows: an all-gather's result (it reads its shard),
    a reduce-scatter's operand (XLA:CPU runs it as an all-reduce of the whole buffer, then a slice the
    reader fuses), else the buffer itself, read once and written once.
    """
    n = collective.nbytes
    if collective.kind == "all-gather":
        return n + n / max(1, mesh.size_of(collective.axes))
    return 2.0 * n


def local_slice_hbm_bytes(graph: OpGraph, op_index: int, value: ValueId, dst: Spec, sizes: Mapping[str, int],
                          has_collectives: bool) -> float:
    """A reshard that only slices locally fuses into a fusible reader (it then reads the shard, which its
    own traffic counts); before a dot or any unfusible op it is a dynamic-slice of its own: the shard is
    read once and written once more."""
    if has_collectives or op_index < 0 or op_kind(graph.ops[op_index]) != OpKind.OPAQUE:
        return 0.0
    return 2.0 * _shard_bytes(graph.values[value].nbytes, dst, sizes)


@dataclass(frozen=True)
class GraphCosts:
    """Per op of a graph run on one device (every array whole): what the roofline needs."""

    flops: np.ndarray
    hbm_bytes: np.ndarray  # fused traffic (module docstring)
    peak_flops: np.ndarray  # FLOP/s of each op's compute dtype on the cluster

    def seconds(self, cluster: ClusterSpec) -> np.ndarray:
        return np.maximum(self.flops / self.peak_flops, self.hbm_bytes / cluster.memory_bandwidth_bytes_per_s)


def graph_costs(graph: OpGraph, cluster: ClusterSpec) -> GraphCosts:
    """FLOPs, fused HBM bytes and peak of every op of ``graph`` on one device, nothing split."""
    traffic = op_traffic(graph)
    flops, nbytes, peaks = [], [], []
    for op, tr in zip(graph.ops, traffic):
        ins = [Spec.replicated(graph.values[v].rank) for v in op.inputs]
        outs = [Spec.replicated(graph.values[v].rank) for v in op.outputs]
        flops.append(op.flops)
        nbytes.append(op.trip_count * strategy_hbm_bytes(graph, op, tr, ins, outs, {}))
        peaks.append(cluster.peak_flops(compute_dtype(op, graph)))
    return GraphCosts(np.asarray(flops, dtype=float), np.asarray(nbytes, dtype=float), np.asarray(peaks, dtype=float))


def graph_flops_by_dtype(graph: OpGraph) -> dict[str, float]:
    """The graph's FLOPs (nothing split) by the peak each op runs at (``compute_dtype``)."""
    found: dict[str, float] = {}
    for op in graph.ops:
        if op.flops:
            dtype = compute_dtype(op, graph)
            found[dtype] = found.get(dtype, 0.0) + float(op.flops)
    return found


def compute_lower_bound_s(graph: OpGraph, cluster: ClusterSpec, num_devices: int) -> float:
    """The step's FLOPs spread perfectly over ``num_devices``, each op at its compute dtype's peak."""
    seconds = sum(op.flops / cluster.peak_flops(compute_dtype(op, graph)) for op in graph.ops)
    return float(seconds) / max(1, num_devices)


def strategies_work(graph: OpGraph, op: Op, traffic: OpTraffic, strategies: Sequence[Strategy],
                    sizes: Mapping[str, int], cluster: ClusterSpec) -> tuple[np.ndarray, np.ndarray]:
    """Per strategy of ``op``, every run: compute seconds (the fused roofline) and HBM bytes. A strategy's
    ``apart_hbm_bytes`` are moved by instructions of their own, after the fused op (a deferred twin's stack
    writes): counted in its bytes, and their time added rather than hidden under the op's FLOPs."""
    apart = op.trip_count * np.array([s.apart_hbm_bytes for s in strategies])
    fused = op.trip_count * np.array([strategy_hbm_bytes(graph, op, traffic, s.in_specs, s.out_specs, sizes)
                                      for s in strategies])
    flops = np.array([s.flops for s in strategies])
    seconds = np.asarray(roofline_s(cluster, flops, fused, compute_dtype(op, graph)), dtype=float).reshape(len(flops))
    return seconds + apart / cluster.memory_bandwidth_bytes_per_s, fused + apart
