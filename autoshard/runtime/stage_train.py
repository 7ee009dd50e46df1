"""A pipeline stage running the train graphs its layer plans were solved on, pinned op by op.

The intra-op pass prices a stage from each layer's *train graph* (one
microbatch's forward and backward with the gradient accumulated,
``ir/train_graph.py``) and plans every op of it: the backward's ops too, each with
its own strategy and the reshards between them. Running the stage as ``jax.vjp``
of its pinned forward equations would leave the backward to XLA: its collectives
would be XLA's, not the plan's, and could not be checked against it. So a stage
whose layers carry their train-graph plans (``plans.annotations.TrainPins``, from
``passes/stage_costs.py``) runs those graphs instead, with every op output
pinned to its planned spec and every planned reshard run as its pinned chain
(the SPMD runtime's ``pin_op_inputs`` / ``pin_op_outputs``).

A train graph is one program; a pipeline stage runs it in two executables, the
forward when the microbatch passes and the backward when its cotangents come
back, cut by ``ir/train_graph.split_phases``; the forward returns the residuals
its backward reads and the runtime keeps them per microbatch in flight (a stage
that recomputes, and the last stage, which fuses the two, runs both halves in
one executable and keeps nothing).

Layers chain inside a stage (:class:`StageRunner`): each layer's forward reads
the activations the earlier layers (or the stage's input) made; the backward
runs the layers in reverse, each handing the cotangents of its entering
activations to the layer before. Every layer's entering activations are kept
(pinned to its plan's input specs) with its residuals when its backward reads
them. Between two layer plans (and at the stage's edges) a value moves along
the planned reshard's intermediate layouts (``StageLayout.edge_pins``, the
chains ``compiler/stage_boundaries.py`` prices), both ways (:class:`LayerEdges`).

The graphs are traced again from the runtime's forward (at the runtime's
microbatch, which may differ from the one the plan was solved at: then a spec
that does not divide a runtime shape is left to XLA, as in ``stage_pins.py``).
A layer whose graph does not have the planned number of ops, or a stage with a
layer without pins, runs the ``jax.vjp`` path (:func:`stage_runner` says why).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax.numpy as jnp
from jax.extend import core as jcore
from jax.sharding import Mesh

from autoshard.ir.graph import Op, OpGraph, ValueId
from autoshard.ir.spec import Spec
from autoshard.ir.split import Forward
from autoshard.ir.stage_programs import StageProgram
from autoshard.ir.train_graph import (Groups, Unit, input_signature, program_constants, split_phases,
                                      train_graph)
from autoshard.plans.annotations import TrainPins
from autoshard.plans.stage_plan import EdgePin
from autoshard.runtime import microbatch_bits
from autoshard.runtime.spmd import SharedPins, pin, pin_op_inputs, pin_op_outputs
from autoshard.runtime.stage_pins import fitted_edge_pin

# ---------------------------------------------------------------------------
# Running one layer's graph, pinned


def _fits(spec: Spec | None, shape: Sequence[int], sizes: Mapping[str, int]) -> bool:
    return spec is not None and spec.rank == len(shape) and spec.divides(tuple(shape), dict(sizes))


class LayerRunner:
    """One layer's train graph on a stage's mesh, its halves pinned to the layer plan's annotations."""

    def __init__(self, graph: OpGraph, groups: Sequence[int], pins: TrainPins, mesh: Mesh) -> None:
        self.graph, self.groups, self.mesh = graph, tuple(groups), mesh
        self.phases = split_phases(graph, groups)
        # the planned reshards made once per value and chain: where both halves run in one program (the last
        # stage, a recomputing backward) the backward reads the forward's moved values (the same tracers)
        self.shared, self.loop = SharedPins(mesh), graph.loop_of()
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

    def _after(self, op: Op, vals: list[Any]) -> list[Any]:
        return pin_op_outputs(vals, self.out_specs.get(op.id), self.mesh)

    def _enter(self, env: dict[ValueId, Any], positions: range, vals: Sequence[Any]) -> None:
        for k, x in zip(positions, vals):
            spec = self.in_specs[k]
            env[self.graph.inputs[k]] = self.shared(x, (spec,)) if spec is not None else x

    def _leave(self, env: dict[ValueId, Any], positions: range) -> list[Any]:
        return [pin(env[self.graph.outputs[k]], self.final[k], self.mesh) for k in positions]

    def _run(self, env: dict[ValueId, Any], which: Sequence[Unit]) -> None:
        def before(op: Op, vals: list[Any]) -> list[Any]:  # a loop body is a trace of its own (runtime/spmd.py)
            shared = self.shared if self.loop[op.id] < 0 else None
            return pin_op_inputs(vals, self.moves.get(op.id), self.mesh, shared)

        self.graph.run_ops(env, which, before_op=before, after_op=self._after, bind_op=microbatch_bits.bind_op)

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


@dataclass(frozen=True)
class LayerEdges:
    """The layouts a layer's boundary values pass through outside its own pins (its plan pins its inputs to
    their input specs and its outputs to their output specs): per entering activation (by position) those
    before its input pin going forward and after its gradient leaves coming back; per batch leaf those before
    its input pin; per leaving activation those after its output pin and before its cotangent's pin."""

    into: Mapping[int, tuple[Spec, ...]] = field(default_factory=dict)
    back_from: Mapping[int, tuple[Spec, ...]] = field(default_factory=dict)
    data_into: Mapping[int, tuple[Spec, ...]] = field(default_factory=dict)
    out_of: Mapping[int, tuple[Spec, ...]] = field(default_factory=dict)
    back_into: Mapping[int, tuple[Spec, ...]] = field(default_factory=dict)

    @staticmethod
    def of(forward: Forward, program: StageProgram, edges: Mapping[tuple[int, int, int], EdgePin],
           sizes: Mapping[str, int]) -> "LayerEdges":
        """Read off the stage's edge pins on the layer's equations (``runtime/stage_pins.py`` keys them)."""
        acts = {v: p for p, v in enumerate(program.in_acts)}
        data = {forward.invars[leaf]: d for d, leaf in enumerate(program.data_leaves)}
        made = {v: j for j, v in enumerate(program.out_acts) if not isinstance(v, jcore.Literal)}
        into: dict[int, tuple[Spec, ...]] = {}
        back_from: dict[int, tuple[Spec, ...]] = {}
        data_into: dict[int, tuple[Spec, ...]] = {}
        out_of: dict[int, tuple[Spec, ...]] = {}
        back_into: dict[int, tuple[Spec, ...]] = {}
        for i in program.eqns:
            eqn = forward.eqns[i]
            for side, atoms in ((0, eqn.ins), (1, eqn.outs)):
                for pos, atom in enumerate(atoms):
                    chains = edges.get((i, side, pos))
                    if chains is None or isinstance(atom, jcore.Literal):
                        continue
                    fitted = fitted_edge_pin(chains, side, forward.avals[atom].shape, sizes)
                    if fitted is None:
                        continue
                    ahead, back = fitted
                    if side == 0 and atom in acts:
                        into.setdefault(acts[atom], ahead[:-1])
                        back_from.setdefault(acts[atom], back[1:])
                    elif side == 0 and atom in data:
                        data_into.setdefault(data[atom], ahead[:-1])
                    elif side == 1 and atom in made:
                        out_of.setdefault(made[atom], ahead[1:])
                        back_into.setdefault(made[atom], back[:-1])
        return LayerEdges(into, back_from, data_into, out_of, back_into)


class StageRunner:
    """A stage's layers chained: ``forward(params, data, acts) -> (out_acts, stash)`` and
    ``backward(params, data, stash, cts, acc) -> (acc, dacts)``, in the stage program's leaves."""

    def __init__(self, program: StageProgram, layers: Sequence[tuple[StageProgram, LayerRunner]],
                 edges: Sequence[LayerEdges] | None = None) -> None:
        self.program, self.layers = program, tuple(layers)
        self.edges = tuple(edges) if edges is not None else (LayerEdges(),) * len(self.layers)
        self._param_pos = {k: i for i, k in enumerate(program.param_leaves)}
        self._data_pos = {k: i for i, k in enumerate(program.data_leaves)}

    def _leaves(self, layer: StageProgram, params: Sequence[Any], data: Sequence[Any], runner: LayerRunner,
                edges: LayerEdges) -> tuple[list[Any], list[Any]]:
        return ([params[self._param_pos[k]] for k in layer.param_leaves],
                [pin(data[self._data_pos[k]], edges.data_into.get(d, ()), runner.mesh)
                 for d, k in enumerate(layer.data_leaves)])

    def forward(self, params: Sequence[Any], data: Sequence[Any], acts: Sequence[Any]
                ) -> tuple[list[Any], list[dict[ValueId, Any]]]:
        env: dict[Any, Any] = dict(zip(self.program.in_acts, acts))
        stash = []
        for (layer, runner), edges in zip(self.layers, self.edges):
            pr, d = self._leaves(layer, params, data, runner, edges)
            outs, kept = runner.forward(pr, d, [pin(env[v], edges.into.get(p, ()), runner.mesh)
                                                for p, v in enumerate(layer.in_acts)])
            outs = [pin(x, edges.out_of.get(j, ()), runner.mesh) for j, x in enumerate(outs)]
            env.update((v, x) for v, x in zip(layer.out_acts, outs) if not isinstance(v, jcore.Literal))
            stash.append(kept)
        return [_value(v, env) for v in self.program.out_acts], stash

    def backward(self, params: Sequence[Any], data: Sequence[Any], stash: Sequence[Mapping[ValueId, Any]],
                 cts: Sequence[Any], acc: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        ct_env: dict[Any, Any] = {v: c for v, c in zip(self.program.out_acts, cts)
                                  if not isinstance(v, jcore.Literal)}
        acc = list(acc)
        for (layer, runner), edges, kept in zip(reversed(self.layers), reversed(self.edges), reversed(stash)):
            pr, d = self._leaves(layer, params, data, runner, edges)
            mine = [acc[self._param_pos[k]] for k in layer.param_leaves]
            layer_cts = [pin(ct_env[v], edges.back_into.get(j, ()), runner.mesh) if not isinstance(v, jcore.Literal)
                         else jnp.zeros_like(v.val) for j, v in enumerate(layer.out_acts)]
            mine, dacts = runner.backward(pr, d, kept, layer_cts, mine)
            dacts = [pin(x, edges.back_from.get(p, ()), runner.mesh) for p, x in enumerate(dacts)]
            for k, a in zip(layer.param_leaves, mine):
                acc[self._param_pos[k]] = a
            ct_env.update(zip(layer.in_acts, dacts))
        return acc, [ct_env[v] for v in self.program.in_acts]

    def loss_cotangents(self, outs: Sequence[Any], scale: float) -> list[Any]:
        """The last stage's cotangents: ``scale`` for the loss (a mean over B microbatches), zero for the aux."""
        loss, *aux = outs
        return [jnp.asarray(scale, loss.dtype), *(jnp.zeros_like(a) for a in aux)]


def stage_runner(forward: Forward, program: StageProgram, layer_programs: Sequence[StageProgram],
                 pins: Mapping[int, TrainPins], first: int, last: int, mesh: Mesh,
                 graphs: dict[Any, tuple[OpGraph, Groups]] | None = None,
                 edges: Mapping[tuple[int, int, int], EdgePin] | None = None
                 ) -> tuple[StageRunner | None, str]:
    """The runner of the stage over layers ``first..last``, or (None, why not). ``graphs`` caches the traced
    train graph per layer class, input signature and constants (tied and repeated layers trace once; a layer
    of the class that reads other inputs, the first block reading the batch, say, or other constants, such as
    its own dropout key's ``fold_in`` literal, is traced on its own and then must have its plan's op count)."""
    graphs = {} if graphs is None else graphs
    layers = []
    for layer in range(first, last + 1):
        own = pins.get(layer)
        if own is None:
            return None, f"layer {layer} has no train-graph plan (a plan file from before they were stored?)"
        own_program = layer_programs[layer]
        # layers of one class whose programs take the same inputs and constants share one trace
        shared = (own.key, input_signature(forward, own_program), program_constants(forward, own_program))
        try:
            if shared not in graphs:
                graphs[shared] = train_graph(forward, own_program)
            graph, groups = graphs[shared]
        except Exception as err:  # noqa: BLE001 — the vjp path runs instead; the reason is logged
            return None, f"layer {layer}: its train graph could not be traced again ({type(err).__name__}: {err})"
        if len(graph.ops) != own.num_ops or len(graph.inputs) != len(own.annotations.input_specs):
            return None, (f"layer {layer}: its train graph has {len(graph.ops)} ops at the runtime microbatch, "
                          f"the plan {own.num_ops}")
        layers.append((own_program, LayerRunner(graph, groups, own, mesh)))
    sizes = dict(mesh.shape)
    return StageRunner(program, layers, [LayerEdges.of(forward, p, edges or {}, sizes) for p, _ in layers]), ""
