"""One layer's train graph, the unit the intra-op pass prices a pipeline stage with.

For a layer (its forward equations, ``passes/layers.py``) the graph is one
microbatch's forward and backward with the gradient accumulated, as the
pipeline runtime runs it (``runtime/stage_train.py``, cut into a forward and a
backward half there)::

    layer_step(acc, params, data, acts_in, cts_out) -> (acc + dparams, acts_out, dacts_in)

``acc`` (the gradient accumulator) is carried: it leaves in the layout it is
stored in, so the ILP chooses the accumulator's storage (ZeRO) beside the
parameters' (FSDP), the batch split (DP) and every op's split (TP). Roles:
``acc`` optimizer state, ``params`` parameters, ``data`` batch, the
activations and cotangents activations. Layers with equal structure hashes
share one graph (:func:`layer_graphs`).
"""
from __future__ import annotations

from collections.abc import Sequence

import jax

from autoshard.ir.graph import OpGraph
from autoshard.ir.split import Forward, StepParts
from autoshard.ir.trace import trace_jaxpr
from autoshard.passes.layers import Layer
from autoshard.passes.stage_costs import LayerTrainGraph
from autoshard.runtime.pipeline import StageProgram
from autoshard.runtime.stage_train import one_layer_programs, split_phases, struct_of, train_graph


def layer_graph(parts: StepParts, program: StageProgram, key: str) -> LayerTrainGraph:
    """The train graph of one layer (``runtime/stage_train.train_graph``) and its forward / backward cut."""
    fwd = parts.forward
    graph, groups = train_graph(fwd, program)
    run = program.function(fwd)
    params = [struct_of(fwd, fwd.invars[k]) for k in program.param_leaves]
    data = [struct_of(fwd, fwd.invars[k]) for k in program.data_leaves]
    acts = [struct_of(fwd, v) for v in program.in_acts]
    forward_ops = len(trace_jaxpr(jax.make_jaxpr(lambda p_, d_, a_: run(p_, d_, a_))(params, data, acts)).ops)
    return LayerTrainGraph(graph, min(forward_ops, len(graph.ops)), groups, key, split_phases(graph, groups),
                           eqn_ops=align_equations(fwd, program.eqns, graph))


def align_equations(fwd: Forward, eqns: Sequence[int], graph: OpGraph) -> tuple[int | None, ...]:
    """Per forward equation (in ``eqns`` order), the op of the train ``graph`` that computes it, or None.

    ``jax.vjp`` keeps the primal equations in order and interleaves what the JVP rules add (the derivative
    factors the backward reads), so each equation is matched to the next op with its primitive and output
    shapes; one without a match is skipped (its output is then left to XLA by the runtime)."""
    ops = graph.ops
    out: list[int | None] = []
    t = 0
    for i in eqns:
        e = fwd.eqns[i]
        name = e.eqn.primitive.name
        shapes = [tuple(fwd.avals[v].shape) for v in e.outs]
        u = t
        while u < len(ops) and not (ops[u].primitive == name
                                    and [tuple(graph.values[v].shape) for v in ops[u].outputs] == shapes):
            u += 1
        if u < len(ops):
            out.append(u)
            t = u + 1
        else:
            out.append(None)
    return tuple(out)


def layer_graphs(parts: StepParts, layers: Sequence[Layer]) -> tuple[list[LayerTrainGraph], list[StageProgram]]:
    """Per layer, its class's train graph (traced once per distinct ``Layer.structure``) and its own
    one-layer program (the leaves its graph's parameter inputs stand for)."""
    programs = one_layer_programs(parts.forward, [layer.eqns for layer in layers])
    cache: dict[str, LayerTrainGraph] = {}
    out = []
    for layer, program in zip(layers, programs):
        if layer.structure not in cache:
            cache[layer.structure] = layer_graph(parts, program, layer.structure)
        out.append(cache[layer.structure])
    return out, programs
