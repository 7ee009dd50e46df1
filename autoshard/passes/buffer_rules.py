"""Rules 5, 6 and 8 of the memory model (``passes/memory_model.py``), as plain functions.

5. *All-reduce combining* (``combine_all_reduces``): groups in program order.
6. *Donation* (``donation``, ``assign_to_donated``): the copies CopyInsertion
   adds for donated arguments, and BufferAssigner's reuse of a donated
   argument's buffer by temporaries.
8. *Layout copies* (``transposed_operands``): the dot and convolution operands
   XLA:CPU copies into a canonical layout.

``Span`` is one buffer's life, the unit every rule speaks in.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from autoshard.ir.graph import Op, OpGraph, ValueId
from autoshard.ir.spec import Collective
from autoshard.passes.liveness import InstructionOrder, NodeId, OpIndex


@dataclass(frozen=True)
class Span:
    start: int
    stop: int  # inclusive
    nbytes: float
    kind: str  # "activation", "partial sum", "resharded", "layout copy", "donation copy", "written back"
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
    """Rule 5: greedy groups in program order; a group closes at the first member that depends on it.
    XLA combines inside one computation: the body of a loop is its own, so groups never cross one."""
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


def donation(graph: OpGraph, sched: InstructionOrder, readers_of: Mapping[ValueId, list[NodeId]],
              provider: Callable[[ValueId], NodeId | None], written_back: Mapping[ValueId, NodeId],
              carried_out: Mapping[ValueId, int], arg_bytes: Callable[[int], float],
              end: int) -> tuple[list[Span], list[tuple[float, list[tuple[int, int]]]]]:
    """Rule 6: the copies CopyInsertion adds for donated arguments, and each donated buffer's busy intervals."""
    ancestors: list[int] = [0] * len(sched.preds)
    for v in sched.topological:
        mask = 0
        for p in sched.preds[v]:
            mask |= ancestors[p] | (1 << p)
        ancestors[v] = mask
    copies: list[Span] = []
    pools: list[tuple[float, list[tuple[int, int]]]] = []
    for out_vid, i in carried_out.items():
        arg = graph.inputs[i]
        writer = written_back.get(out_vid, provider(out_vid))
        if out_vid == arg or writer is None:
            continue
        size = arg_bytes(i)
        others = [r for r in readers_of.get(arg, ()) if r != writer]
        last = max((int(sched.position[r]) for r in readers_of.get(arg, ())), default=0)
        write = int(sched.position[writer])
        if others and not all(ancestors[writer] >> r & 1 for r in others):
            # the copies run one after another at the start: each frees its argument for later copies
            k = len(copies)
            copies.append(Span(k + 1, max(last, k + 1), size, "donation copy", arg))
            pools.append((size, [(0, k + 1), (write, end)]))
        else:
            pools.append((size, [(0, last), (write, end)]))
    return copies, pools


def assign_to_donated(spans: list[Span], pools: list[tuple[float, list[tuple[int, int]]]]) -> list[Span]:
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
