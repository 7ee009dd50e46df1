"""One layer's train graph, the unit the intra-op pass prices a pipeline stage with.

For a layer (its forward equations, ``passes/layers.py``) the graph is one
microbatch's forward and backward with the gradient accumulated, as the
pipeline runtime runs it (``runtime/pipeline.py``)::

    layer_step(acc, params, data, acts_in, cts_out) -> (acc + dparams, acts_out, dacts_in)

``acc`` (the gradient accumulator) is carried: it leaves in the layout it is
stored in, so the ILP chooses the accumulator's storage (ZeRO) beside the
parameters' (FSDP), the batch split (DP) and every op's split (TP). Roles:
``acc`` optimizer state, ``params`` parameters, ``data`` batch, the
activations and cotangents activations. Layers with equal structure hashes
share one graph (:func:`layer_graphs`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax

from autoshard.ir.graph import OpGraph, Role
from autoshard.ir.split import Forward, StepParts
from autoshard.ir.trace import trace, trace_jaxpr
from autoshard.passes.layers import Layer
from autoshard.passes.stage_costs import LayerTrainGraph
from autoshard.runtime.pipeline import StageProgram, stage_programs


def _aval(parts: StepParts, var: Any) -> jax.ShapeDtypeStruct:
    aval = parts.forward.avals[var]
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype)


def layer_graph(parts: StepParts, program: StageProgram, key: str) -> LayerTrainGraph:
    """The train graph of one layer (module docstring)."""
    fwd = parts.forward
    run = program.function(fwd)
    params = [_aval(parts, fwd.invars[k]) for k in program.param_leaves]
    data = [_aval(parts, fwd.invars[k]) for k in program.data_leaves]
    acts = [_aval(parts, v) for v in program.in_acts]
    cts = [_aval(parts, v) for v in program.out_acts]

    def layer_step(acc: list[Any], pr: list[Any], d: list[Any], ac: list[Any], ct: list[Any]) -> Any:
        out, pullback = jax.vjp(lambda p_, a_: run(p_, d, a_), pr, ac)
        dparams, dacts = pullback(ct)
        return [a + g for a, g in zip(acc, dparams)], out, dacts

    graph = trace(layer_step, params, params, data, acts, cts)
    groups = (len(params), len(params), len(data), len(acts), len(cts))
    roles = ([Role.OPT_STATE] * groups[0] + [Role.PARAM] * groups[1] + [Role.BATCH] * groups[2]
             + [Role.ACTIVATION] * (groups[3] + groups[4]))
    values = dict(graph.values)
    for vid, role in zip(graph.inputs, roles):
        values[vid] = dataclasses.replace(values[vid], role=role)
    carried = tuple(k if k < groups[0] else None for k in range(len(graph.outputs)))
    graph = dataclasses.replace(graph, values=values, carried=carried)
    forward_ops = len(trace_jaxpr(jax.make_jaxpr(lambda p_, d_, a_: run(p_, d_, a_))(params, data, acts)).ops)
    return LayerTrainGraph(graph, min(forward_ops, len(graph.ops)), groups, key,
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
    programs = stage_programs(parts.forward, [layer.eqns for layer in layers], [(i, i) for i in range(len(layers))])
    cache: dict[str, LayerTrainGraph] = {}
    out = []
    for layer, program in zip(layers, programs):
        if layer.structure not in cache:
            cache[layer.structure] = layer_graph(parts, program, layer.structure)
        out.append(cache[layer.structure])
    return out, programs
