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
``compiler/pipeline_plan.boundary_collectives`` predicts.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import Mesh

from autoshard.ir.spec import Spec
from autoshard.ir.split import EqnHook, Forward
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

    edges: dict[tuple[int, int], dict[int, tuple[Spec, Spec]]] = {}
    for (i, side, pos), (fwd_spec, bwd_spec) in layout.edge_pins.items():
        eqn = forward.eqns[i]
        atoms = eqn.ins if side == 0 else eqn.outs
        atom = atoms[pos] if pos < len(atoms) else None
        if atom is not None and not hasattr(atom, "val") and _fits(fwd_spec, forward.avals[atom], sizes) \
                and _fits(bwd_spec, forward.avals[atom], sizes):
            edges.setdefault((i, side), {})[pos] = (fwd_spec, bwd_spec)

    def crossing(vals: list[Any], pins: Mapping[int, tuple[Spec, Spec]] | None) -> list[Any]:
        if not pins:
            return vals
        return [two_way_pin(v, *pins[k], mesh) if k in pins else v for k, v in enumerate(vals)]

    shared = SharedPins(mesh)  # values of every trace of these hooks: keyed by the value object itself

    def before(i: int, vals: list[Any]) -> list[Any]:
        return pin_op_inputs(crossing(vals, edges.get((i, 0))), moves.get(i), mesh, shared)

    def after(i: int, vals: list[Any]) -> list[Any]:
        return crossing(pin_op_outputs(vals, outs.get(i), mesh), edges.get((i, 1)))

    return before, after


def two_way_pin(x: Any, forward_spec: Spec, backward_spec: Spec, mesh: Mesh) -> Any:
    """``x`` pinned to ``forward_spec``; under ``jax.vjp`` its cotangent pinned to ``backward_spec`` (a plain
    sharding constraint would pin the cotangent to the forward's spec). Where an activation passes from one
    layer plan to the next, the forward takes it in the reader's input spec and the backward hands its
    cotangent back in the reader's gradient-output spec, as the layer plans were priced."""

    @jax.custom_vjp
    def constrained(y: Any) -> Any:
        return pin(y, (forward_spec,), mesh)

    def forward(y: Any) -> tuple[Any, None]:
        return constrained(y), None

    def backward(_: None, ct: Any) -> tuple[Any]:
        return (pin(ct, (backward_spec,), mesh),)

    constrained.defvjp(forward, backward)
    return constrained(x)
