"""Partial sums reduced once after a scan: a stacked gradient's reduction moved out of the loop body.

A weight gradient in a scan body is a contraction over the batch; with the batch split, each device holds a
partial sum that the strategy reduces (all-reduce or reduce-scatter). When that result only travels through
views (reshape, squeeze, transpose) into a stacked output of the loop (``loop_stack``: the gradient of a stacked
weight), the reduction can wait: each iteration writes the device's own partial sum, on an explicit leading
axis of the mesh's size split like the contracting dims, and one reduction of the whole stack follows the
loop. XLA cannot do this by itself: a loop-carried buffer holds no pending partial sum, so it reduces in the
body, once per iteration (tests/sim/test_scan_partial_sums.py measures both forms).

The planner prices both. For each such op, every strategy whose collectives reduce exactly the split
contracting dims gets a *deferred* twin (``Strategy.deferred_over`` = the loop length): the same layouts and
bytes, its reductions' latency paid once per loop instead of once per iteration (and joining the combined
all-reduce of the late reductions after the loop), and the partial stack's extra bytes held over the loop
(``extra_bytes``: unreduced, unscattered). The ILP picks one; emission (``passes/emit.py``) records a chosen
twin as a ``Deferral`` that the runtime turns into the partial form (``runtime/spmd.partial_result``,
``runtime/deferred.py``).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from autoshard.ir.graph import Op, OpGraph
from autoshard.ir.spec import REDUCING, Spec
from autoshard.passes.buffer_rules import Span
from autoshard.passes.strategies import Strategy
from autoshard.plans.annotations import PARTIAL_OPS, PARTIAL_VIEWS, Deferral, partial_spec



@dataclass(frozen=True)
class StackSite:
    """An op whose result reaches a loop's stacked output through views only, read by nothing else."""

    op: int
    chain: tuple[int, ...]  # the views between it and the stack, in order
    stack: int  # the ``loop_stack`` op
    length: int  # the loop's trip count
    loop: int  # the loop's index in ``OpGraph.loops``


def stack_sites(graph: OpGraph) -> dict[int, StackSite]:
    """Op index -> its ``StackSite``, for every reducible op in a scan body whose result only becomes a
    stacked output (through single-reader views)."""
    consumers = graph.consumers()
    index = {id(op): t for t, op in enumerate(graph.ops)}
    found: dict[int, StackSite] = {}
    for k, region in enumerate(graph.loops):
        if region.kind != "scan":
            continue
        stacks = set(region.stack_ops)
        for j in range(region.body_start, region.body_stop):
            op = graph.ops[j]
            if op.primitive not in PARTIAL_OPS or len(op.outputs) != 1:
                continue
            chain, value = [], op.outputs[0]
            while True:
                users = consumers.get(value, ())
                if len(users) != 1 or value in graph.outputs:
                    break
                t = index[id(users[0])]
                if t in stacks:
                    found[j] = StackSite(j, tuple(chain), t, region.length, k)
                    break
                user = graph.ops[t]
                if (user.primitive not in PARTIAL_VIEWS or not region.body_start <= t < region.body_stop
                        or (user.primitive == "reshape" and user.params.get("dimensions") is not None)):
                    break
                chain.append(t)
                value = user.outputs[0]
    return found


def reduced_dims(op: Op, strategy: Strategy) -> tuple[tuple[int, int, tuple[str, ...]], ...] | None:
    """The split contracting dims a strategy of ``op`` leaves partial sums over, as (operand dim, other
    operand's dim or -1, mesh axes), when its collectives reduce (sum) exactly over those axes; else None."""
    if not strategy.collectives or strategy.reduction != "sum":
        return None
    if any(c.kind not in REDUCING for c in strategy.collectives):
        return None
    if op.primitive == "dot_general":
        (lc, rc), _ = op.params["dimension_numbers"]
        lhs, rhs = strategy.in_specs[0], strategy.in_specs[1]
        if any(lhs.dims[a] != rhs.dims[b] for a, b in zip(lc, rc)):
            return None
        found = tuple((int(a), int(b), lhs.dims[a]) for a, b in zip(lc, rc) if lhs.dims[a])
    else:
        x = strategy.in_specs[0]
        found = tuple((int(d), -1, x.dims[d]) for d in op.params["axes"] if x.dims[d])
    split = {a for *_, axes in found for a in axes}
    reduced = {a for c in strategy.collectives for a in c.axes}
    return found if found and split == reduced else None


def twins(graph: OpGraph, site: StackSite, strategies: Sequence[Strategy], sizes: Mapping[str, int]) -> list[Strategy]:
    """The deferred twin of every strategy of the site's op that can leave its partial sums to the loop's end.

    A twin writes each iteration's whole partial sum into the stack (read and written by the update, as XLA
    counts a dynamic-update-slice) and the stack is zero-filled before the loop: three times the bytes by which
    the partial sum exceeds the reduced result, per run, in instructions of their own (``apart_hbm_bytes``)."""
    op, value = graph.ops[site.op], graph.values[graph.ops[site.op].outputs[0]]
    found = []
    for s in strategies:
        reduced = None if s.deferred_over else reduced_dims(op, s)
        if reduced is not None:
            found.append(replace(s, deferred_over=site.length,
                                 apart_hbm_bytes=3 * _excess(value.nbytes, s.out_specs[0], reduced, sizes)))
    return found


def _excess(nbytes: float, spec: Spec, reduced: Sequence[tuple[int, int, tuple[str, ...]]],
            sizes: Mapping[str, int]) -> float:
    """Per device, how many more bytes a partial sum holds than its reduced (maybe scattered) result."""
    return nbytes / _whole(spec, reduced).num_shards(sizes) - nbytes / spec.num_shards(sizes)


def _whole(spec: Spec, reduced: Sequence[tuple[int, int, tuple[str, ...]]]) -> Spec:
    """The layout of each device's whole partial sum: ``spec`` without the reduced axes."""
    return Spec(partial_spec(spec, reduced).dims[len(reduced):])


def extra_bytes(graph: OpGraph, site: StackSite, strategies: Sequence[Strategy], sizes: Mapping[str, int]) -> np.ndarray:
    """Per strategy of the site's op: the bytes a deferred twin holds beyond its reduced layout while the loop
    runs (the stack of partial sums, length + 1 iterations' worth with the body's own); 0 for the others."""
    value = graph.values[graph.ops[site.op].outputs[0]]
    return np.array([(site.length + 1) * _excess(value.nbytes, s.out_specs[0], reduced_dims(graph.ops[site.op], s), sizes)
                     if s.deferred_over else 0.0 for s in strategies])


def partial_sum_spans(graph: OpGraph, op_strategies: Sequence[Strategy], sizes: Mapping[str, int]) -> list[Span]:
    """The partial sums of each chosen deferred strategy (one per op), held over its loop: buffers for the
    memory simulation, by op index (``memory_model.simulate(held=...)``)."""
    deferred = [j for j, s in enumerate(op_strategies) if s.deferred_over]
    if not deferred:
        return []
    sites = stack_sites(graph)
    spans = []
    for j in deferred:
        site, strategy, out = sites[j], op_strategies[j], graph.ops[j].outputs[0]
        nbytes = float(extra_bytes(graph, site, [strategy], sizes)[0])
        spans.append(Span(graph.loops[site.loop].start, site.stack, nbytes, "stacked partial sums", out))
        # the reduction after the loop writes a whole stack beside the partial one (XLA:CPU reduce-scatters as
        # an all-reduce of the whole buffer and a slice)
        whole = _whole(strategy.out_specs[0], reduced_dims(graph.ops[j], strategy))
        spans.append(Span(site.stack, site.stack, site.length * graph.values[out].nbytes / whole.num_shards(sizes),
                          "stacked partial sums", out))
    return spans


def deferral(graph: OpGraph, j: int, strategy: Strategy, site: StackSite) -> Deferral:
    """What the runtime needs to emit op ``j``'s chosen deferred ``strategy`` (``plans.annotations.Deferral``)."""
    reduced = reduced_dims(graph.ops[j], strategy)
    assert reduced is not None, "a deferred twin reduces its split contracting dims"
    return Deferral(reduced=reduced, chain=site.chain, stack=site.stack, operands=strategy.in_specs)
