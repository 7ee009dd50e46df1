"""A pipeline stage running the train graphs its layer plans were solved on, pinned op by op.

The intra-op pass prices a stage from each layer's *train graph* (one
microbatch's forward and backward with the gradient accumulated,
:func:`train_graph`) and plans every op of it: the backward's ops too, each with
its own strategy and the reshards between them. Running the stage as ``jax.vjp``
of its pinned forward equations would leave the backward to XLA: its collectives
would be XLA's, not the plan's, and could not be checked against it. So a stage
whose layers carry their train-graph plans (:class:`TrainPins`, from
``passes/stage_costs.py``) runs those graphs instead, with every op output
pinned to its planned spec and every planned reshard run as its pinned chain
(the SPMD runtime's ``pin_op_inputs`` / ``pin_op_outputs``).

A train graph is one program; a pipeline stage runs it in two executables, the
forward when the microbatch passes and the backward when its cotangents come
back. :func:`split_phases` cuts it: the *forward* is what the activations
leaving the layer need and reads neither the gradient accumulator nor a
cotangent; everything else is the *backward* (the derivative factors the JVP
rules compute from forward values included: made in the backward, they are not
kept between the two). The *residuals* are the forward's values the backward
reads; the forward returns them with its outputs and the runtime keeps them
per microbatch in flight (a stage that recomputes, and the last stage, which
fuses the two, runs both halves in one executable and keeps nothing).

Layers chain inside a stage (:class:`StageRunner`): each layer's forward reads
the activations the earlier layers (or the stage's input) made; the backward
runs the layers in reverse, each handing the cotangents of its entering
activations to the layer before. Every layer's entering activations are kept
(pinned to its plan's input specs) with its residuals when its backward reads
them.

The graphs are traced again from the runtime's forward (at the runtime's
microbatch, which may differ from the one the plan was solved at: then a spec
that does not divide a runtime shape is left to XLA, as in ``stage_pins.py``).
A layer whose graph does not have the planned number of ops, or a stage with a
layer without pins, runs the ``jax.vjp`` path (:func:`stage_runner` says why).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore
from jax.sharding import Mesh

from autoshard.ir.graph import Op, OpGraph, Role, ValueId
from autoshard.ir.spec import Spec
from autoshard.ir.split import Forward
from autoshard.ir.trace import trace
from autoshard.runtime.spmd import Annotations, pin, pin_op_inputs, pin_op_outputs
from autoshard.runtime.stage_programs import LayerEqns, StageProgram, stage_programs

Unit = tuple[int, int]  # ops [start, stop): one op, or a whole top-level loop region


@dataclass(frozen=True)
class TrainPins:
    """One layer class's train-graph plan on a stage's logical mesh: the SPMD annotations of every op."""

    key: str  # the layer structure hash (``Layer.structure``)
    num_ops: int  # ops of the graph it was planned on (a runtime graph with another count is not pinned)
    annotations: Annotations


# ---------------------------------------------------------------------------
# The train graph and its two halves


def struct_of(forward: Forward, var: Any) -> jax.ShapeDtypeStruct:
    """A forward variable as a ShapeDtypeStruct."""
    aval = forward.avals[var]
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype)


def train_graph(forward: Forward, program: StageProgram) -> tuple[OpGraph, tuple[int, int, int, int, int]]:
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


# ---------------------------------------------------------------------------
# Running one layer's graph, pinned


def _fits(spec: Spec | None, shape: Sequence[int], sizes: Mapping[str, int]) -> bool:
    return spec is not None and spec.rank == len(shape) and spec.divides(tuple(shape), dict(sizes))


class LayerRunner:
    """One layer's train graph on a stage's mesh, its halves pinned to the layer plan's annotations."""

    def __init__(self, graph: OpGraph, groups: Sequence[int], pins: TrainPins, mesh: Mesh) -> None:
        self.graph, self.groups, self.mesh = graph, tuple(groups), mesh
        self.phases = split_phases(graph, groups)
        sizes = dict(mesh.shape)
        ann = pins.annotations

        def shape(vid: ValueId) -> tuple[int, ...]:
            return tuple(graph.values[vid].shape)

        def kept(spec: Spec | None, vid: ValueId) -> Spec | None:
            return spec if _fits(spec, shape(vid), sizes) else None

        self.out_specs: dict[int, tuple[Spec | None, ...]] = {}
        for t, specs in ann.op_out_specs.items():
            if t < len(graph.ops):
                fitted = tuple(kept(s, v) for s, v in zip(specs, graph.ops[t].outputs))
                if any(s is not None for s in fitted):
                    self.out_specs[t] = fitted
        self.moves: dict[int, dict[int, tuple[Spec, ...]]] = {}
        for t, chains in ann.op_in_reshards.items():
            if t >= len(graph.ops):
                continue
            for pos, chain in chains.items():
                ins = graph.ops[t].inputs
                if pos < len(ins) and chain and all(_fits(s, shape(ins[pos]), sizes) for s in chain):
                    self.moves.setdefault(t, {})[pos] = tuple(chain)
        self.in_specs = [kept(s, v) for s, v in zip(ann.input_specs, graph.inputs)]
        self.final: list[tuple[Spec, ...]] = []  # per output: the layouts it is pinned through before leaving
        for k, vid in enumerate(graph.outputs):
            chain = tuple(ann.output_reshards.get(k, ())) + (
                (ann.output_specs[k],) if k < len(ann.output_specs) else ())
            self.final.append(tuple(s for s in chain if _fits(s, shape(vid), sizes)))

    # ---- hooks -------------------------------------------------------------
    def _before(self, op: Op, vals: list[Any]) -> list[Any]:
        return pin_op_inputs(vals, self.moves.get(op.id), self.mesh)

    def _after(self, op: Op, vals: list[Any]) -> list[Any]:
        return pin_op_outputs(vals, self.out_specs.get(op.id), self.mesh)

    def _enter(self, env: dict[ValueId, Any], positions: range, vals: Sequence[Any]) -> None:
        for k, x in zip(positions, vals):
            spec = self.in_specs[k]
            env[self.graph.inputs[k]] = pin(x, (spec,), self.mesh) if spec is not None else x

    def _leave(self, env: dict[ValueId, Any], positions: range) -> list[Any]:
        return [pin(env[self.graph.outputs[k]], self.final[k], self.mesh) for k in positions]

    def _run(self, env: dict[ValueId, Any], which: Sequence[Unit]) -> None:
        self.graph.run_ops(env, which, before_op=self._before, after_op=self._after)

    # ---- the two halves ----------------------------------------------------
    def forward(self, params: Sequence[Any], data: Sequence[Any], acts: Sequence[Any]
                ) -> tuple[list[Any], dict[ValueId, Any]]:
        """(the leaving activations, the residuals: forward values and entering activations the backward reads)."""
        na, npar, nd, nact, nct = self.groups
        env: dict[ValueId, Any] = dict(self.graph.constants)
        self._enter(env, range(na, na + npar), params)
        self._enter(env, range(na + npar, na + npar + nd), data)
        self._enter(env, range(na + npar + nd, na + npar + nd + nact), acts)
        self._run(env, self.phases.forward)
        first_act = na + npar + nd
        keep = [*self.phases.residuals, *(self.graph.inputs[first_act + i] for i in self.phases.input_residuals)]
        return self._leave(env, range(na, na + nct)), {v: env[v] for v in keep}

    def backward(self, params: Sequence[Any], data: Sequence[Any], residuals: Mapping[ValueId, Any],
                 cts: Sequence[Any], acc: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """(the accumulators with this microbatch's gradients added, the entering activations' cotangents)."""
        na, npar, nd, nact, nct = self.groups
        env: dict[ValueId, Any] = dict(self.graph.constants)
        self._enter(env, range(na), acc)
        self._enter(env, range(na, na + npar), params)
        self._enter(env, range(na + npar, na + npar + nd), data)
        env.update(residuals)
        first_ct = na + npar + nd + nact
        self._enter(env, range(first_ct, first_ct + nct), cts)
        self._run(env, self.phases.backward)
        return self._leave(env, range(na)), self._leave(env, range(na + nct, na + nct + nact))


# ---------------------------------------------------------------------------
# A stage: its layers chained


def _value(atom: Any, env: Mapping[Any, Any]) -> Any:
    return atom.val if isinstance(atom, jcore.Literal) else env[atom]


class StageRunner:
    """A stage's layers chained: ``forward(params, data, acts) -> (out_acts, stash)`` and
    ``backward(params, data, stash, cts, acc) -> (acc, dacts)``, in the stage program's leaves."""

    def __init__(self, program: StageProgram, layers: Sequence[tuple[StageProgram, LayerRunner]]) -> None:
        self.program, self.layers = program, tuple(layers)
        self._param_pos = {k: i for i, k in enumerate(program.param_leaves)}
        self._data_pos = {k: i for i, k in enumerate(program.data_leaves)}

    def _leaves(self, layer: StageProgram, params: Sequence[Any], data: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        return ([params[self._param_pos[k]] for k in layer.param_leaves],
                [data[self._data_pos[k]] for k in layer.data_leaves])

    def forward(self, params: Sequence[Any], data: Sequence[Any], acts: Sequence[Any]
                ) -> tuple[list[Any], list[dict[ValueId, Any]]]:
        env: dict[Any, Any] = dict(zip(self.program.in_acts, acts))
        stash = []
        for layer, runner in self.layers:
            pr, d = self._leaves(layer, params, data)
            outs, kept = runner.forward(pr, d, [env[v] for v in layer.in_acts])
            env.update((v, x) for v, x in zip(layer.out_acts, outs) if not isinstance(v, jcore.Literal))
            stash.append(kept)
        return [_value(v, env) for v in self.program.out_acts], stash

    def backward(self, params: Sequence[Any], data: Sequence[Any], stash: Sequence[Mapping[ValueId, Any]],
                 cts: Sequence[Any], acc: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        ct_env: dict[Any, Any] = {v: c for v, c in zip(self.program.out_acts, cts)
                                  if not isinstance(v, jcore.Literal)}
        acc = list(acc)
        for (layer, runner), kept in zip(reversed(self.layers), reversed(stash)):
            pr, d = self._leaves(layer, params, data)
            mine = [acc[self._param_pos[k]] for k in layer.param_leaves]
            layer_cts = [ct_env[v] if not isinstance(v, jcore.Literal) else jnp.zeros_like(v.val)
                         for v in layer.out_acts]
            mine, dacts = runner.backward(pr, d, kept, layer_cts, mine)
            for k, a in zip(layer.param_leaves, mine):
                acc[self._param_pos[k]] = a
            ct_env.update(zip(layer.in_acts, dacts))
        return acc, [ct_env[v] for v in self.program.in_acts]

    def loss_cotangents(self, outs: Sequence[Any], scale: float) -> list[Any]:
        """The last stage's cotangents: ``scale`` for the loss (a mean over B microbatches), zero for the aux."""
        loss, *aux = outs
        return [jnp.asarray(scale, loss.dtype), *(jnp.zeros_like(a) for a in aux)]


def _signature(forward: Forward, program: StageProgram) -> tuple[Any, ...]:
    """What a program's train graph takes: the shapes and dtypes of its inputs, group by group."""
    def avals(vs: Sequence[Any]) -> tuple[Any, ...]:
        return tuple((tuple(forward.avals[v].shape), str(forward.avals[v].dtype)) if not isinstance(v, jcore.Literal)
                     else ("literal",) for v in vs)

    return (avals([forward.invars[k] for k in program.param_leaves]),
            avals([forward.invars[k] for k in program.data_leaves]), avals(program.in_acts), avals(program.out_acts))


def stage_runner(forward: Forward, program: StageProgram, layer_programs: Sequence[StageProgram],
                 pins: Mapping[int, TrainPins], first: int, last: int, mesh: Mesh,
                 graphs: dict[Any, tuple[OpGraph, tuple[int, int, int, int, int]]] | None = None
                 ) -> tuple[StageRunner | None, str]:
    """The runner of the stage over layers ``first..last``, or (None, why not). ``graphs`` caches the traced
    train graph per layer class and input signature (tied and repeated layers trace once; a layer of the
    class that reads other inputs, the first block reading the batch, say, is traced on its own and then
    must have its plan's op count)."""
    graphs = {} if graphs is None else graphs
    layers = []
    for layer in range(first, last + 1):
        own = pins.get(layer)
        if own is None:
            return None, f"layer {layer} has no train-graph plan (a plan file from before they were stored?)"
        own_program = layer_programs[layer]
        signature = _signature(forward, own_program)
        try:  # layers of one class whose programs take the same inputs share one trace
            if (own.key, signature) not in graphs:
                graphs[own.key, signature] = train_graph(forward, own_program)
            graph, groups = graphs[own.key, signature]
        except Exception as err:  # noqa: BLE001 — the vjp path runs instead; the reason is logged
            return None, f"layer {layer}: its train graph could not be traced again ({type(err).__name__}: {err})"
        if len(graph.ops) != own.num_ops or len(graph.inputs) != len(own.annotations.input_specs):
            return None, (f"layer {layer}: its train graph has {len(graph.ops)} ops at the runtime microbatch, "
                          f"the plan {own.num_ops}")
        layers.append((own_program, LayerRunner(graph, groups, own, mesh)))
    return StageRunner(program, layers), ""
