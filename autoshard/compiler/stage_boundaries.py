"""Where a pipeline stage's layer plans meet: the reshards between them, priced and pinned alike.

Inside a stage each layer runs its own intra-op plan. An activation leaves its producing layer's plan in that
plan's output spec and enters each reading layer's plan in that plan's input spec; at the stage's boundaries it
is in the runtime's layout (``plans/stage_plan.batch_split_spec``: split over the batch axes). Cotangents go the
other way. :class:`StageBoundaries` names each such move (source and target spec) once, and both consumers read
it: :func:`boundary_collectives` prices each move as ``passes/resharding`` runs it, and :func:`edge_pins` gives
the runtime the layouts to pin, each move's intermediate layouts (``Reshard.path``) included. Without them
XLA runs a multi-step reshard its own way, often a full all-gather (``S(-,-,(x,y)) -> S(x,-,-)``: one
all-gather of the whole array where the plan priced an all-gather over y and an all-to-all over x).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from autoshard.ir.spec import Spec
from autoshard.ir.split import StepParts
from autoshard.ir.stage_programs import StageProgram
from autoshard.passes.resharding import Reshard, reshard
from autoshard.passes.stage_costs import PricedStages
from autoshard.plans.stage_plan import EdgePin, batch_split_spec

Chain = tuple[Spec, ...]


def act_specs(priced: PricedStages, layer: int, k: int
              ) -> tuple[Sequence[Spec], Sequence[Spec], Sequence[Spec], Sequence[Spec]]:
    """(activations in, cotangents in, activations out, cotangents out) of a layer's plan on variant k."""
    cost = priced.layer_cost(layer, k)
    na, npar, nd, nact, nct = priced.groups[layer]
    ins = cost.input_specs[na + npar + nd:]
    outs = cost.output_specs[na:]
    return ins[:nact], ins[nact:nact + nct], outs[:nct], outs[nct:]


def matches(priced: PricedStages, layer: int, k: int, program: StageProgram) -> bool:
    """Whether the layer plan's activation specs line up with this layer's own program (a layer sharing its
    class's graph may cross other values: then its boundaries are left to XLA)."""
    acts_in, cts_in, acts_out, dacts = act_specs(priced, layer, k)
    return len(acts_in) == len(dacts) == len(program.in_acts) and len(acts_out) == len(cts_in) == len(
        program.out_acts)


def programs_out(programs: Sequence[StageProgram], first: int, last: int) -> list[int]:
    """The activations layers ``first..last`` make that a later layer outside them reads."""
    made = {v for layer in range(first, last + 1) for v in programs[layer].out_acts if not hasattr(v, "val")}
    read_after = {v for layer in range(last + 1, len(programs)) for v in programs[layer].in_acts}
    return sorted(made & read_after)


class StageBoundaries:
    """The moves between the layer plans of the stage over layers ``first..last`` on variant ``k`` (module
    docstring), at the runtime's microbatch (a leading dim that ``num_microbatches`` divides is cut)."""

    def __init__(self, parts: StepParts, programs: Sequence[StageProgram], priced: PricedStages, first: int,
                 last: int, k: int, split_axes: Sequence[str], num_microbatches: int) -> None:
        self.fwd, self.programs, self.priced, self.k = parts.forward, programs, priced, k
        self.first, self.last = first, last
        self.mesh = priced.meshes[priced.mesh_of[k]]
        self.sizes = dict(zip(self.mesh.axis_names, self.mesh.shape))
        self.split_axes, self.num_microbatches = tuple(split_axes), num_microbatches
        self.layers = [layer for layer in range(first, last + 1) if matches(priced, layer, k, programs[layer])]
        # var -> the layers giving it out, in order, with its index among each one's out_acts; a layer that reads a
        # value and gives it out again (the residual stream through the pieces of a split block) is one of them
        self._givers: dict[int, list[tuple[int, int]]] = {}
        for layer in self.layers:
            for j, v in enumerate(programs[layer].out_acts):
                if not hasattr(v, "val"):
                    self._givers.setdefault(v, []).append((layer, j))

    def specs(self, layer: int) -> tuple[Sequence[Spec], Sequence[Spec], Sequence[Spec], Sequence[Spec]]:
        return act_specs(self.priced, layer, self.k)

    def giver(self, var: int, before: int) -> tuple[int, int] | None:
        """The last layer before ``before`` that gives ``var`` out (None: it enters the stage)."""
        found = [(a, j) for a, j in self._givers.get(var, ()) if a < before]
        return found[-1] if found else None

    def here(self, var: Any) -> Spec:
        """``var``'s layout at the stage's boundary (the runtime's)."""
        return batch_split_spec(tuple(self.fwd.avals[var].shape), self.split_axes, self.sizes)

    def read_from(self, var: int, layer: int) -> tuple[Spec, Spec]:
        """(the spec ``layer`` reads ``var`` from, the spec its cotangent goes back to): the giving layer's
        output and cotangent specs, or the stage's boundary layout."""
        given = self.giver(var, layer)
        if given is None:
            here = self.here(var)
            return here, here
        a, j = given
        _, cts_in, acts_out, _ = self.specs(a)
        return acts_out[j], cts_in[j]

    def read_later(self, var: int, layer: int) -> bool:
        """Whether a layer of the stage after ``layer`` reads ``var``."""
        return any(var in self.programs[b].in_acts for b in self.layers if b > layer)

    def move(self, var: Any, src: Spec, dst: Spec) -> Reshard | None:
        """The move of ``var`` from ``src`` to ``dst`` at the runtime's microbatch; None: nothing moves."""
        aval = self.fwd.avals[var]
        shape = tuple(int(d) for d in aval.shape)
        if shape and shape[0] % self.num_microbatches == 0:
            shape = (shape[0] // self.num_microbatches,) + shape[1:]
        if src == dst or src.rank != len(shape) or dst.rank != len(shape):
            return None
        return reshard(shape, np.dtype(aval.dtype).itemsize, src, dst, self.mesh)

    def via(self, var: Any, src: Spec, dst: Spec) -> Chain:
        """The layouts a move from ``src`` passes through before ``dst`` (its plan's path)."""
        moved = self.move(var, src, dst)
        return tuple(moved.path) if moved is not None else ()


def edge_pins(b: StageBoundaries) -> dict[tuple[int, int, int], EdgePin]:
    """The two-way pins (``runtime/stage_pins.two_way_pin``) of the activations a stage's layers read and
    make, each a forward chain and a cotangent chain. Each reading equation takes an activation through the
    path from where it is read from into its layer plan's input spec, and starts its cotangent in that
    plan's gradient spec, passing it through the path back to the giver's cotangent spec (or the
    boundary's); each making equation gives it out in its plan's output spec (its cotangent arrives in that
    plan's cotangent spec; for a value only later stages read, through the path from the boundary's layout,
    and a recomputing stage's forward takes it along the path to the boundary's layout). A batch leaf is
    taken through the path from the boundary's layout to the plan's spec for it. The last layer's outputs
    (the loss, the aux outputs) are not pinned."""
    fwd = b.fwd
    out: dict[tuple[int, int, int], EdgePin] = {}
    producer = {v: i for i, e in enumerate(fwd.eqns) for v in e.outs}
    leaving = set(programs_out(b.programs, b.first, b.last))
    recompute = b.priced.variants[b.k].recompute
    for layer in b.layers:
        program = b.programs[layer]
        acts_in, cts_in, acts_out, dacts = b.specs(layer)
        cost = b.priced.layer_cost(layer, b.k)
        na, npar, nd = b.priced.groups[layer][:3]
        data = {fwd.invars[leaf]: cost.input_specs[na + npar + d] for d, leaf in enumerate(program.data_leaves)
                if d < nd}
        position = {v: i for i, v in enumerate(program.in_acts)}
        for i in program.eqns:
            for pos, atom in enumerate(fwd.eqns[i].ins):
                if hasattr(atom, "val"):
                    continue
                if atom in position:
                    p = position[atom]
                    src, ct_dst = b.read_from(atom, layer)
                    back = b.via(atom, dacts[p], ct_dst)
                    out[(i, 0, pos)] = ((*b.via(atom, src, acts_in[p]), acts_in[p]),
                                        (dacts[p], *back, ct_dst) if back else (dacts[p],))
                elif atom in data and not fwd.free[i]:
                    spec = data[atom]
                    out[(i, 0, pos)] = ((*b.via(atom, b.here(atom), spec), spec), (spec,))
        if layer == len(b.programs) - 1:
            continue
        for j, v in enumerate(program.out_acts):
            if hasattr(v, "val") or v not in producer:
                continue
            i = producer[v]
            forward, backward = (acts_out[j],), (cts_in[j],)
            if v in leaving and b.giver(v, b.last + 1) == (layer, j) and not b.read_later(v, layer):
                here = b.here(v)
                backward = (*b.via(v, here, cts_in[j]), cts_in[j])
                ahead = b.via(v, acts_out[j], here) if recompute else ()
                forward = (acts_out[j], *ahead, here) if ahead else forward
            out[(i, 1, fwd.eqns[i].outs.index(v))] = (forward, backward)
    return out


def boundary_collectives(b: StageBoundaries, recompute: bool, last: bool
                         ) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """(forward, backward, forward without the outputs) per-device bytes per microbatch of the reshards
    between the layer plans of one stage (module docstring), each priced as ``passes/resharding`` runs it. A
    backward that re-runs the forward does not return the forward's outputs, so it runs the third figure, not
    the first; a forward that keeps its residuals for the backward returns its outputs in the layouts XLA
    leaves them in (their move happens in the send), so only a recomputing stage's forward reshards them to
    the runtime layout; cotangents arrive in it either way. A value several layers read in one layout is
    resharded once (XLA CSEs the copies, as the ILP's shared reshards say), and each reader takes a value from
    the last layer before it that gives it out."""
    fwd = b.fwd
    out: dict[str, dict[str, float]] = {"forward": {}, "backward": {}, "inside": {}}
    moved: set[tuple[int, Spec, Spec]] = set()  # forward reshards made once: XLA CSEs a value's equal copies

    def move(action: str, var: int, src: Spec, dst: Spec, leaving: bool = False) -> None:
        if action == "forward" and not leaving:
            if (var, src, dst) in moved:
                return
            moved.add((var, src, dst))
        moving = b.move(var, src, dst)
        for c in moving.collectives if moving is not None else ():
            for key in (action, "inside") if action == "forward" and not leaving else (action,):
                out[key][c.kind] = out[key].get(c.kind, 0.0) + c.nbytes

    for layer in b.layers:  # the batch leaves a layer reads arrive in the runtime's layout
        cost = b.priced.layer_cost(layer, b.k)
        na, npar = b.priced.groups[layer][:2]
        for d, leaf in enumerate(b.programs[layer].data_leaves):
            var = fwd.invars[leaf]
            if d < b.priced.groups[layer][2] and fwd.avals[var].shape:
                move("forward", var, b.here(var), cost.input_specs[na + npar + d])
    for layer in b.layers:
        acts_in, _, _, dacts = b.specs(layer)
        for i, v in enumerate(b.programs[layer].in_acts):
            src, ct_dst = b.read_from(v, layer)
            move("forward", v, src, acts_in[i])
            move("backward", v, dacts[i], ct_dst)
    if not last:
        for v in programs_out(b.programs, b.first, b.last):
            given = b.giver(v, b.last + 1)
            if given is None:
                continue
            a, j = given
            _, cts_in_a, acts_out_a, _ = b.specs(a)
            here = b.here(v)
            if recompute:  # a stage keeping its residuals returns its outputs as XLA leaves them
                move("forward", v, acts_out_a[j], here, leaving=True)
            move("backward", v, here, cts_in_a[j])
    return out["forward"], out["backward"], out["inside"]
