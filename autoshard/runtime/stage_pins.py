"""A stage's intra-op plan on its forward equations: the ``jax.vjp`` path of ``runtime/pipeline.py``.

A stage whose layers carry their train-graph plans runs those graphs pinned op by op instead
(``runtime/stage_train.py``); this path serves stages without them (a plan file from before they were
stored, a scanned stack's chunks) and pins what the forward equations' plans say.

The SPMD runtime pins every op output to the spec its plan chose and every
resharded input through its planned chain (``runtime/spmd.py``: ``pin_op_inputs``,
``pin_op_outputs``). A pipeline stage does the same on the forward equations it
runs, from the layer plans chosen for its logical mesh (``StageLayout.op_out_specs``,
``op_in_reshards``, keyed by forward equation). Its backward is ``jax.vjp`` of that
forward: the transpose of a sharding constraint constrains the cotangent alike, so
the gradients flow in the layouts the forward values were planned in.

The layer plans are solved at one microbatch size and the stage may run at
another: a spec that does not divide the runtime shape (or has another rank) is
left to XLA, as is every equation without one.

Where an activation passes from one layer plan to another (and at the stage's edges) it is pinned both
ways (``two_way_pin``): forward to the reading layer plan's input spec, and its cotangent to the spec that
plan's backward hands it back in; at the producing end, forward to the producer's output spec and the
cotangent to the producer's cotangent-input spec. The reshards in between are what
``compiler/stage_boundaries.boundary_collectives`` predicts, and each is pinned through its planned
intermediate layouts (``StageLayout.edge_pins`` holds chains), so XLA runs them as priced.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from autoshard.ir.spec import Spec
from autoshard.ir.split import EqnHook, Forward
from autoshard.plans.stage_plan import EdgePin
from autoshard.runtime.spmd import SharedPins, pin, pin_op_inputs, pin_op_outputs
from autoshard.runtime.stage_layout import StageLayout


def _fits(spec: Spec | None, aval: Any, sizes: Mapping[str, int]) -> bool:
    shape = tuple(getattr(aval, "shape", ()))
    return spec is not None and spec.rank == len(shape) and spec.divides(shape, dict(sizes))


def stage_hooks(forward: Forward, layout: StageLayout, mesh: Mesh) -> tuple[EqnHook | None, EqnHook | None]:
    """``(before, after)`` for ``StageProgram.function``: the stage's planned layouts pinned on its equations."""
    if not layout.op_out_specs and not layout.op_in_reshards and not layout.edge_pins:
        return None, None
    sizes = dict(mesh.shape)
    outs: dict[int, tuple[Spec | None, ...]] = {}
    for i, specs in layout.op_out_specs.items():
        eqn = forward.eqns[i]
        kept = tuple(s if _fits(s, forward.avals[v], sizes) else None for s, v in zip(specs, eqn.outs))
        if any(s is not None for s in kept):
            outs[i] = kept
    moves: dict[int, dict[int, tuple[Spec, ...]]] = {}
    for i, chains in layout.op_in_reshards.items():
        eqn = forward.eqns[i]
        for pos, chain in chains.items():
            atom = eqn.ins[pos] if pos < len(eqn.ins) else None
            if atom is None or hasattr(atom, "val"):  # a literal: nothing to move
                continue
            if chain and all(_fits(s, forward.avals[atom], sizes) for s in chain):
                moves.setdefault(i, {})[pos] = tuple(chain)

    edges: dict[tuple[int, int], dict[int, EdgePin]] = {}
    for (i, side, pos), chains in layout.edge_pins.items():
        eqn = forward.eqns[i]
        atoms = eqn.ins if side == 0 else eqn.outs
        atom = atoms[pos] if pos < len(atoms) else None
        if atom is not None and not hasattr(atom, "val"):
            fitted = fitted_edge_pin(chains, side, forward.avals[atom].shape, sizes)
            if fitted is not None:
                edges.setdefault((i, side), {})[pos] = fitted

    def crossing(vals: list[Any], pins: Mapping[int, EdgePin] | None) -> list[Any]:
        if not pins:
            return vals
        return [two_way_pin(v, *pins[k], mesh) if k in pins else v for k, v in enumerate(vals)]

    shared = SharedPins(mesh)  # values of every trace of these hooks: keyed by the value object itself

    def before(i: int, vals: list[Any]) -> list[Any]:
        return pin_op_inputs(crossing(vals, edges.get((i, 0))), moves.get(i), mesh, shared)

    def after(i: int, vals: list[Any]) -> list[Any]:
        return crossing(pin_op_outputs(vals, outs.get(i), mesh), edges.get((i, 1)))

    return before, after


def fitted_edge_pin(chains: EdgePin, side: int, shape: Sequence[int], sizes: Mapping[str, int]
                    ) -> EdgePin | None:
    """An edge pin (on an equation's input: ``side`` 0, output: 1) at the runtime's ``shape``: None when the
    layer plan's own layouts in it (a reader's input and gradient spec: the forward chain's last and the
    cotangent chain's first; a maker's: the forward's first and the cotangent's last) do not divide it (left
    to XLA); else its chains without the layouts that do not."""
    forward, backward = chains
    shape = tuple(shape)

    def fits(spec: Spec) -> bool:
        return spec.rank == len(shape) and spec.divides(shape, dict(sizes))

    if not forward or not backward:
        return None
    own = (forward[-1], backward[0]) if side == 0 else (forward[0], backward[-1])
    if not all(map(fits, own)):
        return None
    return tuple(filter(fits, forward)), tuple(filter(fits, backward))


def two_way_pin(x: Any, forward: Sequence[Spec], backward: Sequence[Spec], mesh: Mesh) -> Any:
    """``x`` pinned through the layouts ``forward`` in order; under ``jax.vjp`` its cotangent pinned through
    ``backward`` (a plain sharding constraint would pin the cotangent to the forward's layouts, reversed).
    Where an activation passes from one layer plan to the next, the forward takes it along the planned
    reshard into the reader's input spec and the backward hands its cotangent back from the reader's
    gradient-output spec, as the layer plans and the reshards between them were priced."""
    forward_chain, backward_chain = tuple(forward), tuple(backward)

    @jax.custom_vjp
    def constrained(y: Any) -> Any:
        return pin(y, forward_chain, mesh)

    def forward_rule(y: Any) -> tuple[Any, None]:
        return constrained(y), None

    def backward_rule(_: None, ct: Any) -> tuple[Any]:
        return (pin(ct, backward_chain, mesh),)

    constrained.defvjp(forward_rule, backward_rule)
    return constrained(x)
