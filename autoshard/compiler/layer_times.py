"""The modeled step of a solved SPMD plan, split per layer (``Plan.layer_times``, ``plans/breakdown.py``).

Each op's chosen strategy carries its compute and collective seconds, and each
reshard site its seconds; this module only groups them, so the layers add up
to the ledger's compute, collective and resharding times exactly.

**Which layer an op is in.** An op that reads a parameter (or optimizer
state) belongs to that leaf's layer (``layer_key``: ``blocks.3``, ``lm_head``);
any other op to the layer of its largest computed input (the most recent among
equals), which carries a layer forward through the activations and backward
through the cotangents, while a scalar every layer shares (Adam's bias
correction) carries none; an op with neither (a function of the batch alone)
to the layer of its first consumer. The rule is for display and has seams: an
op that reads no parameter but makes one's gradient (an embedding's scatter-add)
lands in the layer whose cotangent it reads. Input nodes count with their own leaf's layer, a reshard with the op
it feeds (state written back to storage: with the op that produced it).

**FLOP-bound or HBM-bound.** An op's compute is the roofline of its chosen
strategy, ``max(flops / peak, fused HBM bytes / bandwidth)`` per device
(``passes/hbm_traffic.py``); whichever term sets it names the side. Collective
seconds are as XLA issues them (a combined all-reduce's latency counts once,
on its first member: ``IntraOpResult.op_comm_s``).
"""
from __future__ import annotations

import collections
from collections.abc import Sequence

from autoshard.ir.graph import OpGraph, Role
from autoshard.meshes.cost import roofline_s
from autoshard.passes.hbm_traffic import compute_dtype
from autoshard.passes.intra_op import IntraOpResult
from autoshard.plans.breakdown import LayerTime, dotted, layer_key

OTHER = "(other)"


def op_layers(graph: OpGraph) -> list[str]:
    """The layer name of every op of ``graph`` (module docstring)."""
    state = {v: dotted(layer_key(graph.values[v].path or "")) for v in graph.inputs
             if graph.values[v].role in (Role.PARAM, Role.OPT_STATE)}
    state = {v: name for v, name in state.items() if name != OTHER}  # a step counter is no layer's
    params = {v for v in state if graph.values[v].role == Role.PARAM}
    producer = {v: i for i, op in enumerate(graph.ops) for v in op.outputs}
    labels: list[str | None] = []
    for op in graph.ops:
        read = [v for v in op.inputs if v in state]
        read.sort(key=lambda v: v not in params)  # a parameter names the layer before its optimizer state
        if read:
            labels.append(state[read[0]])
            continue
        # the largest computed input carries the layer (a shared scalar, such as Adam's bias correction,
        # does not); among equals the most recent one
        made = [(graph.values[v].size, producer[v]) for v in op.inputs
                if v in producer and labels[producer[v]] is not None]
        labels.append(labels[max(made)[1]] if made else None)
    index = {id(op): i for i, op in enumerate(graph.ops)}
    consumers = graph.consumers()
    for i in reversed(range(len(graph.ops))):  # functions of the batch alone: their first consumer's layer
        if labels[i] is None:
            users = sorted(index[id(c)] for v in graph.ops[i].outputs for c in consumers.get(v, ()))
            labels[i] = next((labels[j] for j in users if labels[j] is not None), OTHER)
    return [label or OTHER for label in labels]


def layer_times(result: IntraOpResult) -> tuple[LayerTime, ...]:
    """Per layer, in the order ops first reach it: FLOP-bound and HBM-bound compute, collectives, resharding."""
    graph, cluster = result.graph, result.mesh.cluster
    labels = op_layers(graph)
    # [flops_s, hbm_s, comm_s, reshard_s] per layer
    parts: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for i, op in enumerate(graph.ops):
        strategy = result.op_strategy(i)
        seconds = result.op_compute_s[i]
        flops_s = float(roofline_s(cluster, strategy.flops, 0.0, compute_dtype(op, graph)))
        part = parts[labels[i]]
        part[0 if flops_s >= seconds * (1 - 1e-12) else 1] += seconds
        part[2] += result.op_comm_s[i]
    for i, vid in enumerate(graph.inputs):  # (a batch leaf's arrival from the host is the ledger's input_s)
        strategy = result.node_strategies[i]
        parts[dotted(layer_key(graph.values[vid].path or ""))][2] += strategy.comm_s
    producer = {v: i for i, op in enumerate(graph.ops) for v in op.outputs}
    for site in {(r.value, r.src, r.dst, r.runs): r for r in result.reshards}.values():  # once, as the ledger
        op_index = site.op_index if site.op_index >= 0 else producer.get(site.value, -1)
        parts[labels[op_index] if op_index >= 0 else OTHER][3] += site.seconds
    return tuple(LayerTime(name, *values) for name, values in parts.items() if any(values))


def check_sums(times: Sequence[LayerTime], compute_s: float, comm_s: float, reshard_s: float,
               rel_tol: float = 1e-9) -> list[str]:
    """What does not add up between per-layer times and the ledger's totals (empty when all do)."""
    wrong = []
    for what, got, want in (("compute", sum(t.flops_s + t.hbm_s for t in times), compute_s),
                            ("collectives", sum(t.comm_s for t in times), comm_s),
                            ("resharding", sum(t.reshard_s for t in times), reshard_s)):
        if abs(got - want) > rel_tol * max(abs(want), 1e-30):
            wrong.append(f"{what}: layers sum to {got:.6g} s, the ledger has {want:.6g} s")
    return wrong
