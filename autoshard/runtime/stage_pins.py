"""A stage's intra-op plan inside its executables: the per-op sharding constraints of ``runtime/pipeline.py``.

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
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jax.sharding import Mesh

from autoshard.ir.spec import Spec
from autoshard.ir.split import EqnHook, Forward
from autoshard.runtime.spmd import pin_op_inputs, pin_op_outputs
from autoshard.runtime.stage_layout import StageLayout


def _fits(spec: Spec | None, aval: Any, sizes: Mapping[str, int]) -> bool:
    shape = tuple(getattr(aval, "shape", ()))
    return spec is not None and spec.rank == len(shape) and spec.divides(shape, dict(sizes))


def stage_hooks(forward: Forward, layout: StageLayout, mesh: Mesh) -> tuple[EqnHook | None, EqnHook | None]:
    """``(before, after)`` for ``StageProgram.function``: the stage's planned layouts pinned on its equations."""
    if not layout.op_out_specs and not layout.op_in_reshards:
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

    def before(i: int, vals: list[Any]) -> list[Any]:
        return pin_op_inputs(vals, moves.get(i), mesh)

    def after(i: int, vals: list[Any]) -> list[Any]:
        return pin_op_outputs(vals, outs.get(i), mesh)

    return before, after


def pinned_equations(layout: StageLayout, eqns: Sequence[int]) -> int:
    """How many of ``eqns`` the stage's plan pins (for reports and tests)."""
    return sum(1 for i in eqns if i in layout.op_out_specs)
