"""Rules 5, 6 and 8 of the memory model (``passes/memory_model.py``), as plain functions.

5. *All-reduce combining* (``combine_all_reduces``): groups in program order.
6. *Donation* (``donation``, ``assign_to_donated``): the copies CopyInsertion
   adds for donated arguments, and BufferAssigner's reuse of a donated
   argument's buffer by temporaries.
8. *Layout copies* (``transposed_operands``): the dot and convolution operands
   XLA:CPU copies into a canonical layout.
10. *Narrow floats computed in float32* (``f32_dot_buffers``): the buffers of
   a bfloat16 / float16 dot that XLA:CPU holds in float32; and
   (``excess_precision``) narrow-float math between float32 math.

``Span`` is one buffer's life, the unit every rule speaks in.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.ir.graph import Op, OpGraph, ValueId, dtype_itemsize
from autoshard.ir.primitives import CONTRACTIONS, Family, FlopRule, OpKind, Values, facts
from autoshard.ir.spec import Collective
from autoshard.passes.liveness import InstructionOrder, NodeId, OpIndex


@dataclass(frozen=True)
class Span:
    start: int
    stop: int  # inclusive
    nbytes: float
    kind: str  # "activation", "partial sum", "stacked partial sums", "resharded", "layout copy", "donation copy", "written back"
    value: ValueId | None = None  # the value this buffer holds (a copy of), for reports


def transposed_operands(op: Op, ranks: Sequence[int]) -> tuple[tuple[int, ...], bool]:
    """Rule 8: the operands XLA:CPU copies into a canonical layout before a dot or a convolution
    (``DotDecomposer``, ``ConvCanonicalization``), and whether the result is transposed afterwards.

    A dot wants [batch, free, contracting] x [batch, contracting, free]; without batch dimensions the
    emitter also takes either operand transposed (``TransposeFolding``). A convolution wants NHWC input,
    HWIO kernel and NHWC output.
    """
    dims = op.params.get("dimension_numbers")
    if op.primitive == "dot_general" and isinstance(dims, tuple) and len(dims) == 2:
        (lc, rc), (lb, rb) = dims
        out = []
        for pos, (contract, batch) in enumerate(((tuple(lc), tuple(lb)), (tuple(rc), tuple(rb)))):
            free = tuple(d for d in range(ranks[pos]) if d not in contract and d not in batch)
            canonical = batch + free + contract if pos == 0 else batch + contract + free
            folded = () if batch else (batch + contract + free if pos == 0 else batch + free + contract,)
            if tuple(range(ranks[pos])) not in (canonical, *folded):
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


def combine_all_reduces(graph: OpGraph, reducing: Sequence[OpIndex],
                         op_collectives: Mapping[OpIndex, Sequence[Collective]],
                         op_reductions: Mapping[OpIndex, str | None]) -> list[list[OpIndex]]:
    """Rule 5: greedy groups in program order (``reducing`` is sorted); a group closes at the first op that
    depends on it. XLA combines inside one computation: the body of a loop is its own, so groups never cross one."""
    if not reducing:
        return []
    loop = graph.loop_of()
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
        axes = tuple(sorted({a for c in op_collectives[t] for a in c.axes}))
        return axes, op_reductions.get(t), graph.values[graph.ops[t].outputs[0]].dtype, loop[t]

    # one pass in program order, a group open per key: an op closes every open group it depends on, of any
    # key (its own: it cannot join what it reads; another: were that group to grow after this op joined one,
    # each combined node could wait for the other, a cycle). So a group only depends on groups that closed
    # before it did, and the combined nodes stay acyclic
    open_group: dict[tuple, int] = {}
    groups: list[list[OpIndex]] = []
    masks: list[int] = []
    for t in reducing:
        for k, g in list(open_group.items()):
            if upstream[t] & masks[g]:
                del open_group[k]
        k = key(t)
        g = open_group.get(k)
        if g is None or len(groups[g]) >= 256:
            g = open_group[k] = len(groups)
            groups.append([])
            masks.append(0)
        groups[g].append(t)
        masks[g] |= bit[t]
    return groups


@dataclass(frozen=True)
class F32DotBuffers:
    """Rule 10 (``f32_dot_buffers``)."""

    widened: frozenset[ValueId]  # op results held in float32 whatever their dtype
    copies: Mapping[ValueId, tuple[OpIndex, ...]]  # buffer -> the dots that read its float32 copy


def f32_dot_buffers(graph: OpGraph, f32_dtypes: frozenset[str], root_of: Callable[[ValueId], ValueId],
                    skip: set[tuple[OpIndex, int]], shared: set[ValueId]) -> F32DotBuffers:
    """Rule 10: a backend without arithmetic for a dtype of ``f32_dtypes`` (XLA:CPU and bfloat16) runs a
    dot or convolution of such operands in float32. Its result buffer is float32 (the cast back is fused
    into its readers). An operand buffer that only such dots read is materialised in float32 (the cast is
    fused into its producer); one that an argument holds or other ops read too (``shared``) keeps its
    dtype and gets a float32 copy, made when it is ready and kept until the last dot that reads it. Reads
    in ``skip`` (through a layout copy or a reshard, which hold the float32 copy themselves) are left
    out; ``root_of`` maps a value to the buffer it is a view of."""
    widened: set[ValueId] = set()
    copies: dict[ValueId, list[OpIndex]] = {}
    inputs, outputs = set(graph.inputs), set(graph.outputs)
    for t, op in enumerate(graph.ops):
        if op.primitive not in CONTRACTIONS or not any(graph.values[v].dtype in f32_dtypes for v in op.inputs):
            continue
        widened.update(op.outputs)
        for p, vid in enumerate(op.inputs):
            if graph.values[vid].dtype not in f32_dtypes or (t, p) in skip:
                continue
            root = root_of(vid)
            if root in inputs or root in shared:
                copies.setdefault(root, []).append(t)
            elif root not in outputs:
                widened.add(root)
    return F32DotBuffers(frozenset(widened), {v: tuple(ts) for v, ts in copies.items()})


def _computes_in_f32(graph: OpGraph, op: Op) -> bool:
    """An op a backend without narrow-float arithmetic runs in float32: a reduction, a contraction, or elementwise
    math that XLA counts FLOPs for (not data movement, a select or a convert) and that yields numbers (not a
    comparison's booleans)."""
    f = facts(op.primitive)
    if f.family in (Family.REDUCTION, Family.CONTRACTION):
        return True
    return (f.family is Family.ELEMENTWISE and f.values is Values.NEW and f.flops is not FlopRule.ZERO
            and all(graph.values[v].dtype != "bool" for v in op.outputs))


def excess_precision(graph: OpGraph, f32_dtypes: frozenset[str], buffers: Iterable[ValueId]) -> set[ValueId]:
    """Rule 10, between elementwise ops: XLA:CPU computes narrow-float math in float32, with a convert to the
    narrow type after each op and back before the next; with excess precision allowed (its default)
    ``simplify-fp-conversions`` removes each such pair, so a value made by math in float32 and read only by
    math in float32 (or converted up to float32) stays float32. Of ``buffers`` (materialised values), those:
    produced by such an op, in a dtype of ``f32_dtypes``, not a step output, every reader (through views)
    computing in float32 or converting to a wider float."""
    consumers = graph.consumers()
    producer = {v: op for op in graph.ops for v in op.outputs}
    outputs = set(graph.outputs)

    def reads_in_f32(vid: ValueId, depth: int = 4) -> bool:
        readers = consumers.get(vid, ())
        if not readers or vid in outputs:
            return False
        for r in readers:
            kind = facts(r.primitive)
            if kind.kind is OpKind.VIEW:
                if depth == 0 or not all(reads_in_f32(o, depth - 1) for o in r.outputs):
                    return False
            elif kind.values is Values.CAST:
                if any(dtype_itemsize(graph.values[o].dtype) < 4 for o in r.outputs):
                    return False
            elif not _computes_in_f32(graph, r):
                return False
        return True

    found = set()
    for vid in buffers:
        op = producer.get(vid)
        if op is None or graph.values[vid].dtype not in f32_dtypes or not _computes_in_f32(graph, op):
            continue
        if reads_in_f32(vid):  # a contraction's result is float32 already (``f32_dot_buffers``)
            found.add(vid)
    return found


def donation(graph: OpGraph, sched: InstructionOrder, readers_of: Mapping[ValueId, list[NodeId]],
              provider: Callable[[ValueId], NodeId | None], written_back: Mapping[ValueId, NodeId],
              carried_out: Mapping[ValueId, int], arg_bytes: Callable[[int], float],
              end: int) -> tuple[list[Span], list[tuple[float, list[tuple[int, int]]]]]:
    """Rule 6: the copies CopyInsertion adds for donated arguments, and each donated buffer's busy intervals."""
    writers = {out_vid: written_back.get(out_vid, provider(out_vid)) for out_vid in carried_out}
    bit, reaches = _writers_reached(sched, {w for w in writers.values() if w is not None},
                                    {r for i in carried_out.values() for r in readers_of.get(graph.inputs[i], ())})
    copies: list[Span] = []
    pools: list[tuple[float, list[tuple[int, int]]]] = []
    for out_vid, i in carried_out.items():
        arg = graph.inputs[i]
        writer = writers[out_vid]
        if out_vid == arg or writer is None:
            continue
        size = arg_bytes(i)
        others = [r for r in readers_of.get(arg, ()) if r != writer]
        last = max((int(sched.position[r]) for r in readers_of.get(arg, ())), default=0)
        write = int(sched.position[writer])
        if others and not all(reaches[r] & bit[writer] for r in others):
            # the copies run one after another at the start: each frees its argument for later copies
            k = len(copies)
            copies.append(Span(k + 1, max(last, k + 1), size, "donation copy", arg))
            pools.append((size, [(0, k + 1), (write, end)]))
        else:
            pools.append((size, [(0, last), (write, end)]))
    return copies, pools


def _writers_reached(sched: InstructionOrder, writers: set[NodeId],
                     readers: set[NodeId]) -> tuple[dict[NodeId, int], dict[NodeId, int]]:
    """A bit per node of ``writers``, and for each node of ``readers`` the bits of the writers that depend
    on it (run after it, through a path of the schedule's edges).

    One sweep in reverse topological order carrying, per node, a bitmask over the writers only (one bit
    per donated argument's update): O(nodes x writers / 64) word operations, and a node's mask is dropped
    once every predecessor has read it, rather than every node's ancestors held over all nodes.
    """
    bit = {w: 1 << k for k, w in enumerate(sorted(writers))}
    pending = [len(ps) for ps in sched.preds]  # predecessors that have not read the node's mask yet
    below: dict[NodeId, int] = {}  # node -> writers reachable from it, strictly after it
    succs: list[list[NodeId]] = [[] for _ in sched.preds]
    for v, ps in enumerate(sched.preds):
        for p in ps:
            succs[p].append(v)
    kept: dict[NodeId, int] = {}
    for v in reversed(sched.topological):
        mask = 0
        for s in succs[v]:
            mask |= below[s] | bit.get(s, 0)
            pending[s] -= 1
            if pending[s] == 0:
                del below[s]
        below[v] = mask
        if v in readers:
            kept[v] = mask
        if not sched.preds[v]:
            del below[v]
    return bit, kept


def assign_to_donated(spans: list[Span], pools: list[tuple[float, list[tuple[int, int]]]]) -> list[Span]:
    """XLA's BufferAssigner: largest buffers first, each into the smallest donated argument buffer that is
    free for its whole life; what finds none goes to the temp heap (returned).

    Pools of one size are one ``_SizeClass``: a span asks the classes from the smallest that holds it up,
    each answering with its first pool (in the pools' order) free for the span's life, so the choice is
    the first such pool of the pools sorted by size. A class rejects a span that no pool's free window
    covers by bisection, so the buffers alive before any donated argument dies (the forward pass's)
    cost O(log pools) each rather than a scan of every pool.
    """
    by_size: dict[float, list[Sequence[tuple[int, int]]]] = {}
    for size, busy in sorted(pools, key=lambda p: p[0]):
        by_size.setdefault(size, []).append(busy)
    classes = {size: _SizeClass(busy) for size, busy in by_size.items()}
    sizes = sorted(classes)
    heap: list[Span] = []
    for s in sorted(spans, key=lambda s: (-s.nbytes, s.start)):
        for size in sizes[bisect.bisect_left(sizes, s.nbytes):]:
            k = classes[size].take(s.start, s.stop)
            if k is not None:
                break
        else:
            heap.append(s)
    return heap


class _SizeClass:
    """Donated buffers of one size (``assign_to_donated``), in order. Each pool's base intervals (an
    argument's reads, its update; inclusive, first <= last) leave free windows; a window entry is
    (first, last, pool). The spans placed in one pool are disjoint; all placed spans are kept sorted by
    (pool, start) in numpy arrays (``placed_key``, ``placed_stop``) plus a short list of recent ones, so one
    vectorised search tells every candidate pool's conflict at once."""

    def __init__(self, pools: Sequence[Sequence[tuple[int, int]]]) -> None:
        entries: list[tuple[int, int, int]] = []  # (window first, window last, pool), pools in order
        for k, busy in enumerate(pools):
            free_from = 0
            for a, b in sorted(busy):
                if a > free_from:
                    entries.append((free_from, a - 1, k))
                free_from = max(free_from, b + 1)
            entries.append((free_from, _NEVER, k))
        self.first = np.array([e[0] for e in entries], dtype=np.int64)
        self.last = np.array([e[1] for e in entries], dtype=np.int64)
        self.pool = np.array([e[2] for e in entries], dtype=np.int64)
        order = np.argsort(self.first, kind="stable")
        self.sorted_first = self.first[order].tolist()
        self.reach = np.maximum.accumulate(self.last[order]).tolist()  # latest window end among those so far
        self.placed_key = np.zeros(0, dtype=np.int64)  # pool * _STRIDE + start, sorted
        self.placed_stop = np.zeros(0, dtype=np.int64)
        self.recent = np.zeros((3, 16), dtype=np.int64)  # rows pool, start, stop of spans not merged yet
        self.num_recent = 0

    def take(self, start: int, stop: int) -> int | None:
        """The first pool free over [start, stop], which then holds it; None when no pool is."""
        opened = bisect.bisect_right(self.sorted_first, start)
        if opened == 0 or self.reach[opened - 1] < stop:
            return None  # no window that opened by ``start`` lasts until ``stop``
        pools = self.pool[(self.first <= start) & (self.last >= stop)]
        if not pools.size:
            return None
        free = np.ones(len(pools), dtype=bool)
        if self.placed_key.size:  # per pool, the placed span starting last by ``stop`` is the one that can overlap
            at = np.searchsorted(self.placed_key, pools * _STRIDE + min(stop, _STRIDE - 1), side="right") - 1
            ok = at >= 0
            hit = at[ok]
            free[ok] = ~((self.placed_key[hit] // _STRIDE == pools[ok]) & (self.placed_stop[hit] >= start))
        if self.num_recent:
            pool, first, last = self.recent[:, :self.num_recent]
            blocked = pool[(first <= stop) & (last >= start)]
            if blocked.size:
                free &= ~np.isin(pools, blocked)
        if not free.any():
            return None
        k = int(pools[int(np.argmax(free))])
        if self.num_recent == self.recent.shape[1]:
            self.recent = np.concatenate((self.recent, np.zeros_like(self.recent)), axis=1)
        self.recent[:, self.num_recent] = (k, start, stop)
        self.num_recent += 1
        if self.num_recent * self.num_recent > max(self.placed_key.size, 256):
            self._merge()
        return k

    def _merge(self) -> None:
        """Fold the recent spans into the sorted arrays (every ~sqrt(placed) spans: O(n^1.5) moves in all)."""
        pool, first, last = self.recent[:, :self.num_recent]
        keys = np.concatenate((self.placed_key, pool * _STRIDE + first))
        stops = np.concatenate((self.placed_stop, last))
        order = np.argsort(keys, kind="stable")
        self.placed_key, self.placed_stop = keys[order], stops[order]
        self.num_recent = 0


_STRIDE = 1 << 31  # positions stay below it: (pool, start) packed as pool * _STRIDE + start
_NEVER = np.iinfo(np.int64).max  # a window open to the end
