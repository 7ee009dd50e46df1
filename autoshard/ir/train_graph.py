"""One layer's train graph, the unit the intra-op pass prices a pipeline stage with, and its two halves.

For a layer (its forward equations, ``passes/layers.py``) the train graph is one microbatch's forward and
backward with the gradient accumulated, as the pipeline runtime runs it::

    layer_step(acc, params, data, acts_in, cts_out) -> (acc + dparams, acts_out, dacts_in)

``acc`` (the gradient accumulator) is carried: it leaves in the layout it is stored in, so the ILP chooses
the accumulator's storage (ZeRO) beside the parameters' (FSDP), the batch split (DP) and every op's split
(TP). Roles: ``acc`` optimizer state, ``params`` parameters, ``data`` batch, the activations and cotangents
activations. Layers with equal structure hashes and equal input signatures share one graph
(:func:`layer_graphs`).

A train graph is one program; a pipeline stage runs it in two executables, the forward when the microbatch
passes and the backward when its cotangents come back. :func:`split_phases` cuts it: the *forward* is what
the activations leaving the layer need and reads neither the gradient accumulator nor a cotangent;
everything else is the *backward* (the derivative factors the JVP rules compute from forward values
included: made in the backward, they are not kept between the two). The *residuals* are the forward's
values the backward reads; the forward returns them with its outputs and the runtime keeps them per
microbatch in flight.

The planner prices these graphs (``passes/stage_costs.py``) and the runtime runs them pinned op by op
(``runtime/stage_train.py``): both read them from here.
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import jax
import numpy as np

from jax.extend import core as jcore

from autoshard.ir.graph import OpGraph, Role, ValueId
from autoshard.ir.split import Forward
from autoshard.ir.stage_programs import LayerEqns, StageProgram, stage_programs
from autoshard.ir.trace import trace

Unit: TypeAlias = tuple[int, int]  # ops [start, stop): one op, or a whole top-level loop region
Groups: TypeAlias = tuple[int, int, int, int, int]  # input counts: accumulators, params, data, activations, cotangents


def struct_of(forward: Forward, var: Any) -> jax.ShapeDtypeStruct:
    """A forward variable as a ShapeDtypeStruct."""
    aval = forward.avals[var]
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype)


def train_graph(forward: Forward, program: StageProgram) -> tuple[OpGraph, Groups]:
    """The train graph of a (one-layer) program and its input groups::

        layer_step(acc, params, data, acts_in, cts_out) -> (acc + dparams, acts_out, dacts_in)

    Roles: ``acc`` optimizer state (carried: it leaves in its storage layout), ``params`` parameters, ``data``
    batch, activations and cotangents activations."""
    run = program.function(forward)
    params = [struct_of(forward, forward.invars[k]) for k in program.param_leaves]
    data = [struct_of(forward, forward.invars[k]) for k in program.data_leaves]
    acts = [struct_of(forward, v) for v in program.in_acts]
    cts = [struct_of(forward, v) for v in program.out_acts]

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
    return dataclasses.replace(graph, values=values, carried=carried), groups


def one_layer_programs(forward: Forward, layers: Sequence[LayerEqns]) -> list[StageProgram]:
    """Each layer as a program of its own (the leaves and activations its train graph's inputs stand for)."""
    return stage_programs(forward, layers, [(i, i) for i in range(len(layers))])


@dataclass(frozen=True)
class Phases:
    """A train graph cut into the forward and the backward executables (module docstring)."""

    forward: tuple[Unit, ...]
    backward: tuple[Unit, ...]
    residuals: tuple[ValueId, ...]  # forward values the backward reads (or returns)
    input_residuals: tuple[int, ...]  # positions among the entering activations the backward reads

    def forward_ops(self) -> frozenset[int]:
        return frozenset(t for a, b in self.forward for t in range(a, b))


def units(graph: OpGraph) -> list[Unit]:
    """The graph's ops in order, a top-level loop region (scan, while, cond) as one unit."""
    regions = sorted((r.start, r.stop) for r in graph.loops)
    top = [r for r in regions if not any(o != r and o[0] <= r[0] and r[1] <= o[1] for o in regions)]
    starts = dict(top)
    out, t = [], 0
    while t < len(graph.ops):
        stop = starts.get(t, t + 1)
        out.append((t, stop))
        t = stop
    return out


def _unit_io(graph: OpGraph, unit: Unit) -> tuple[set[ValueId], set[ValueId]]:
    made = {v for t in range(*unit) for v in graph.ops[t].outputs}
    reads = {v for t in range(*unit) for v in graph.ops[t].inputs if v not in made}
    return reads, made


def split_phases(graph: OpGraph, groups: Sequence[int]) -> Phases:
    """The forward: the units the leaving activations need that read no accumulator and no cotangent
    (transitively); the backward: the rest (module docstring)."""
    na, npar, nd, nact, nct = groups
    inputs = graph.inputs
    acts_in = inputs[na + npar + nd:na + npar + nd + nact]
    tainted = set(inputs[:na]) | set(inputs[na + npar + nd + nact:])
    all_units = units(graph)
    io = [_unit_io(graph, u) for u in all_units]
    clean = []
    for reads, made in io:
        dirty = bool(reads & tainted)
        if dirty:
            tainted |= made
        clean.append(not dirty)
    needed = set(graph.outputs[na:na + nct])
    forward = [False] * len(all_units)
    for u in reversed(range(len(all_units))):
        reads, made = io[u]
        if clean[u] and made & needed:
            forward[u] = True
            needed |= reads
    fwd_made = {v for u, (_, made) in enumerate(io) if forward[u] for v in made}
    back_reads = {v for u, (reads, _) in enumerate(io) if not forward[u] for v in reads}
    back_reads |= set(graph.outputs[:na]) | set(graph.outputs[na + nct:])
    return Phases(
        forward=tuple(u for u, f in zip(all_units, forward) if f),
        backward=tuple(u for u, f in zip(all_units, forward) if not f),
        residuals=tuple(sorted(fwd_made & back_reads)),
        input_residuals=tuple(i for i, v in enumerate(acts_in) if v in back_reads))


@dataclass(frozen=True, eq=False)
class LayerTrainGraph:
    """One layer class's train graph, as the intra-op pass prices it."""

    graph: OpGraph
    groups: Groups  # input counts: accumulators, params, data, activations, cotangents
    key: str  # the layer structure hash: equal keys, one solve
    phases: Phases  # its forward / backward cut, as the runtime runs it (:func:`split_phases`)
    # per forward equation of the layer's program (in its order): the graph op computing it (None: unmatched)
    eqn_ops: tuple[int | None, ...] = ()


def layer_graph(fwd: Forward, program: StageProgram, key: str) -> LayerTrainGraph:
    """The train graph of one layer (:func:`train_graph`) and its forward / backward cut."""
    graph, groups = train_graph(fwd, program)
    return LayerTrainGraph(graph, groups, key, split_phases(graph, groups),
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


def input_signature(forward: Forward, program: StageProgram) -> tuple[Any, ...]:
    """What a program's train graph takes: the shapes and dtypes of its inputs, group by group. Two layers of
    one structure hash can differ here (the first block reads the batch leaf, the others an activation: no
    input cotangent to make), and then their train graphs differ too."""
    def avals(vs: Sequence[Any]) -> tuple[Any, ...]:
        return tuple((tuple(forward.avals[v].shape), str(forward.avals[v].dtype)) if not isinstance(v, jcore.Literal)
                     else ("literal",) for v in vs)

    return (avals([forward.invars[k] for k in program.param_leaves]),
            avals([forward.invars[k] for k in program.data_leaves]), avals(program.in_acts), avals(program.out_acts))


def program_constants(forward: Forward, program: StageProgram) -> str:
    """A digest of the literals and constants a program's equations read, in order. Layers of one class can
    differ here (``jax.random.fold_in(key, i)`` per layer, with ``i`` a literal of the key's equations the
    program recomputes, which the structure hash does not see; a constant array per layer): a train graph
    traced for one of them bakes its values in, so it is reused only for programs with the same digest."""
    digest = hashlib.sha1()
    for i in program.eqns:
        for a in forward.eqns[i].ins:
            if isinstance(a, jcore.Literal):
                value = a.val
            elif a in forward.consts:
                value = forward.consts[a]
            else:
                continue
            try:
                if jax.dtypes.issubdtype(getattr(value, "dtype", None), jax.dtypes.prng_key):
                    value = jax.random.key_data(value)
                array = np.asarray(value)
                digest.update(f"{i}:{array.dtype}{array.shape}".encode() + array.tobytes())
            except (TypeError, ValueError):  # not an array: told apart by identity (its own trace)
                digest.update(f"{i}:{type(value).__name__}@{id(value)}".encode())
    return digest.hexdigest()[:16]


def class_keys(forward: Forward, hashes: Sequence[str], programs: Sequence[StageProgram]) -> list[str]:
    """Per layer, its class key: its structure hash, with ``/n`` added for the n-th further input signature
    (:func:`input_signature`) of that hash, so a class's layers all have one train graph."""
    seen: dict[str, list[tuple[Any, ...]]] = {}
    keys = []
    for key, program in zip(hashes, programs):
        signatures = seen.setdefault(key, [])
        signature = input_signature(forward, program)
        if signature not in signatures:
            signatures.append(signature)
        n = signatures.index(signature)
        keys.append(key if n == 0 else f"{key}/{n}")
    return keys


def layer_graphs(fwd: Forward, layers: Sequence[tuple[LayerEqns, str]]
                 ) -> tuple[list[LayerTrainGraph], list[StageProgram]]:
    """Per layer (its equations and structure hash), its class's train graph (traced once per class:
    :func:`class_keys`) and its own one-layer program (the leaves its graph's parameter inputs stand for)."""
    programs = one_layer_programs(fwd, [eqns for eqns, _ in layers])
    cache: dict[str, LayerTrainGraph] = {}
    out = []
    for key, program in zip(class_keys(fwd, [key for _, key in layers], programs), programs):
        if key not in cache:
            cache[key] = layer_graph(fwd, program, key)
        out.append(cache[key])
    return out, programs
