"""One layer plan read as stage costs: what the stage DP and the pipeline plan take from an intra-op solve.

``passes/stage_costs.py`` solves each layer class's train graph (``ir/train_graph.py``) with the intra-op
ILP; :func:`layer_cost` reads the plan it returns as a :class:`LayerCost`: the time per microbatch (and its
forward's part), the state, gradient and optimizer bytes per device, the residuals held between forward
and backward, the collectives of each executable, the specs the runtime pins (op by op, ``TrainPins``) and
a one-line summary in the classic names.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autoshard.ir.graph import OpGraph, ValueId
from autoshard.ir.spec import Spec, partial_sums
from autoshard.ir.train_graph import LayerTrainGraph
from autoshard.meshes.logical import LogicalMesh
from autoshard.passes.decode import memory_simulation
from autoshard.passes.emit import annotations_from
from autoshard.passes.intra_op import IntraOpResult
from autoshard.passes.memory_model import MemorySimulation
from autoshard.passes.resharding import reshard
from autoshard.passes.strategies import Strategy
from autoshard.plans.annotations import TrainPins


@dataclass(frozen=True)
class LayerCost:
    """The intra-op plan of one layer class on one mesh at one microbatch size (module docstring)."""

    time_s: float
    forward_s: float
    state_bytes: float
    grad_bytes: float  # the gradient accumulators' part of state_bytes
    opt_bytes: float
    update_s: float
    act_bytes: float
    in_bytes: float
    in_replicated: bool  # the layer takes its input activations replicated
    input_specs: tuple[Spec, ...]  # storage spec per graph input
    output_specs: tuple[Spec, ...]  # spec per graph output (accumulators, activations out, their cotangents in)
    summary: str  # DP / FSDP / ZeRO / TP, as the specs say
    # per forward equation of the layer's program (LayerTrainGraph.eqn_ops): the planned spec of each output
    # (None: not matched) and the reshard chains of its inputs, as ``passes/emit.annotations_from`` emits them
    eqn_out_specs: tuple[tuple[Spec, ...] | None, ...] = ()
    eqn_in_reshards: tuple[Mapping[int, tuple[Spec, ...]], ...] = ()
    # per-device bytes by collective kind: per microbatch in its forward and in its backward (with the
    # accumulation), and once per step in the update (the accumulator resharded to each parameter's layout)
    forward_collectives: Mapping[str, float] = field(default_factory=dict)
    backward_collectives: Mapping[str, float] = field(default_factory=dict)
    # both halves as one program (the last stage, a recomputing stage's backward): a value resharded alike
    # for readers in either half is moved once
    fused_collectives: Mapping[str, float] = field(default_factory=dict)
    apply_collectives: Mapping[str, float] = field(default_factory=dict)
    # the whole plan, op by op, for a stage that runs the train graph itself (``runtime/stage_train.py``)
    train_pins: TrainPins | None = None
    # residuals and temporaries when the forward and the backward run as one program (the last stage, a
    # recomputing stage): the forward's values the backward reads, by program order
    fused_act_bytes: float = 0.0
    fused_extra_bytes: float = 0.0
    # the backward as its own executable (``backward_apart``): its temporaries above state and residuals, the
    # residuals being its arguments (held to its end), and the partial sums still pending at its end (XLA
    # combines a stage's gradient reductions into one, after every layer's backward)
    held_extra_bytes: float = 0.0
    pending_bytes: float = 0.0


def _local_bytes(graph: OpGraph, vid: int, spec: Spec, sizes: dict[str, int]) -> float:
    value = graph.values[vid]
    return float(value.nbytes) / max(1, spec.num_shards(sizes))


def _describe(groups: Sequence[int], specs: Sequence[Spec], mesh: LogicalMesh) -> str:
    """What the plan does with state and batch, in the classic names where they fit."""
    na, npar, nd, nact = groups[0], groups[1], groups[2], groups[3]
    params = specs[na:na + npar]
    accs = specs[:na]
    inputs = specs[na + npar:na + npar + nd + nact]
    batch_axes = sorted({a for s in inputs if s.rank for a in s.dims[0]})
    param_axes = sorted({a for s in params for a in s.used_axes})
    if not param_axes and not any(not s.is_replicated for s in accs):
        kind = "DP" if batch_axes else "replicated"
    elif not param_axes:
        kind = "ZeRO-2" if batch_axes else "replicated, grads sharded"
    elif set(param_axes) <= set(batch_axes):
        kind = "FSDP"
    elif batch_axes:
        kind = "DP x TP"
    else:
        kind = "TP"
    return f"{kind} on {'x'.join(map(str, mesh.shape))} (batch over {{{','.join(batch_axes)}}})"


def backward_apart(sim: MemorySimulation, residuals: set[ValueId], graph: OpGraph,
                   op_strategies: Sequence[Strategy]) -> tuple[float, float]:
    """(peak, pending) of a layer's train graph run as a stage runs it, its backward an executable apart: the
    residuals are that executable's arguments, so they live to its end rather than to their last reads (the
    peak); the partial sums of the ops that feed only the program's outputs (the gradients accumulated) are
    what XLA leaves pending to the stage's end, where it combines them into one reduction (pending)."""
    end = sim.num_positions - 1
    residuals = {sim.buffer_of(v) for v in residuals}
    spans = tuple(dataclasses.replace(s, stop=end) if s.kind == "activation" and s.value in residuals else s
                  for s in sim.spans)
    peak = float(dataclasses.replace(sim, spans=spans).profile().max()) if sim.num_positions else 0.0
    outputs = set(graph.outputs)
    consumers = graph.consumers()
    tail: set[int] = set()  # ops whose results reach only the outputs
    for t in range(len(graph.ops) - 1, -1, -1):
        if all(v in outputs or all(id(c) in tail for c in consumers.get(v, ())) for v in graph.ops[t].outputs):
            tail.add(id(graph.ops[t]))
    pending = sum(float(c.nbytes) for op, s in zip(graph.ops, op_strategies) if id(op) in tail
                  for c in partial_sums(s.collectives))
    return peak, pending


def fused_residuals(graph: OpGraph, in_forward: frozenset[int]) -> set[ValueId]:
    """The values of the forward ops ``in_forward`` that a later op reads: what the forward leaves the backward
    when both run as one program."""
    made = {v for t in in_forward for v in graph.ops[t].outputs}
    return {v for t, op in enumerate(graph.ops) if t not in in_forward for v in op.inputs if v in made}


def held_buffers(graph: OpGraph, sim: MemorySimulation, values: set[ValueId]) -> set[ValueId]:
    """The buffers (activation spans of ``sim``) that hold ``values`` for a later read: a value's own buffer
    (a view's: its source's); for a value no buffer holds (a fusion recomputes it where it is read), the
    buffers it is recomputed from, found through its producers up to the graph's inputs (which are counted as
    arguments, not here)."""
    buffers = {sp.value for sp in sim.spans if sp.kind == "activation"}
    producer = {v: op for op in graph.ops for v in op.outputs}
    inputs = set(graph.inputs)
    out: set[ValueId] = set()
    seen: set[ValueId] = set()
    stack = list(values)
    while stack:
        v = sim.buffer_of(stack.pop())
        if v in seen or v in inputs:
            continue
        seen.add(v)
        if v in buffers:
            out.add(v)
        elif v in producer:
            stack.extend(producer[v].inputs)
    return out


def layer_cost(train: LayerTrainGraph, result: IntraOpResult, leaf_update_s: Sequence[float],
               opt_ratio: float) -> LayerCost:
    """Read a LayerCost off the ILP's plan of one layer (module docstring)."""
    graph, mesh = train.graph, result.mesh
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    specs = result.input_specs
    na, npar, nd, nact, _ = train.groups
    local = [_local_bytes(graph, vid, s, sizes) for vid, s in zip(graph.inputs, specs)]
    acc_b, param_b = sum(local[:na]), sum(local[na:na + npar])
    in_b = sum(local[na + npar + nd:na + npar + nd + nact])
    # the forward as the runtime runs it (``Phases``): jax.vjp interleaves the JVP rules' derivative factors with
    # the primal ops, so the forward is not a prefix of the graph's ops
    in_forward = train.phases.forward_ops()

    def held(vids: Any) -> float:
        return sum(_local_bytes(graph, v, result.value_specs[v], sizes) for v in vids if v in result.value_specs)

    sim = memory_simulation(graph, result.value_specs, sizes, result.reshards,
                            result.node_strategies[len(graph.inputs):], mesh.cluster.f32_compute_dtypes)
    fused_residual = held(held_buffers(graph, sim, fused_residuals(graph, in_forward)))
    residual = held(train.phases.residuals)
    forward_s = float(sum(result.op_compute_s[t] + result.op_comm_s[t] for t in sorted(in_forward)))
    update_s = 0.0
    apply_c: dict[str, float] = {}
    for p in range(npar):
        vid = graph.inputs[na + p]
        value = graph.values[vid]
        acc_spec, param_spec = specs[p], specs[na + p]
        update_s += float(leaf_update_s[p]) / max(1, acc_spec.num_shards(sizes))
        if acc_spec != param_spec:
            moved = reshard(value.shape, int(value.nbytes // max(1, int(np.prod(value.shape)))), acc_spec,
                            param_spec, mesh)
            update_s += moved.seconds
            for c in moved.collectives:
                apply_c[c.kind] = apply_c.get(c.kind, 0.0) + c.nbytes
    ann = annotations_from(result)

    def part_of(t: int) -> int:
        return 0 if t in in_forward else 1
    fwd_c: dict[str, float] = {}
    bwd_c: dict[str, float] = {}
    for t, c in result.collectives_by_op(part_of):
        side = fwd_c if t >= 0 and part_of(t) == 0 else bwd_c
        side[c.kind] = side.get(c.kind, 0.0) + c.nbytes
    fused_c: dict[str, float] = {}
    for _, c in result.collectives_by_op():
        fused_c[c.kind] = fused_c.get(c.kind, 0.0) + c.nbytes
    act = residual + in_b
    held_peak, pending = backward_apart(sim, set(train.phases.residuals), graph,
                                        result.node_strategies[len(graph.inputs):])
    acts_in = specs[na + npar + nd:na + npar + nd + nact]
    return LayerCost(
        time_s=float(result.step_s), forward_s=forward_s, state_bytes=acc_b + param_b, grad_bytes=acc_b,
        opt_bytes=opt_ratio * acc_b,
        update_s=update_s, act_bytes=act, in_bytes=in_b,
        in_replicated=all(s.is_replicated for s in acts_in), input_specs=tuple(specs),
        output_specs=tuple(result.output_specs),
        summary=_describe(train.groups, specs, mesh),
        eqn_out_specs=tuple(None if t is None else tuple(ann.op_out_specs[t]) for t in train.eqn_ops),
        eqn_in_reshards=tuple({} if t is None else dict(ann.op_in_reshards.get(t, {})) for t in train.eqn_ops),
        forward_collectives=fwd_c, backward_collectives=bwd_c, fused_collectives=fused_c, apply_collectives=apply_c,
        train_pins=TrainPins(train.key, len(graph.ops), ann),
        fused_act_bytes=fused_residual + in_b,
        fused_extra_bytes=max(0.0, float(result.peak_bytes) - acc_b - param_b - fused_residual - in_b),
        held_extra_bytes=max(0.0, held_peak - acc_b - param_b - act), pending_bytes=pending)

