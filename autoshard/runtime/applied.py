"""Run a Plan on a set of devices: ``autoshard.apply(plan, fn, mesh)``; and the one conversion of a plan to annotations.

``annotations_for(plan, graph)`` turns a plan's per-path specs and per-op
reshards into the flat ``runtime.spmd.Annotations`` the SPMD runtime reads;
``@autoshard`` and ``autoshard.apply`` both run through it. ``AppliedPlan`` traces
the step again on its first call; the trace must match the plan's signature
(argument paths, shapes, dtypes, operation count, per-op layouts) and the mesh
its axes, and every call's arguments the planned shapes, else
PlanMismatchError says what differs.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.sharding import Mesh

from autoshard.errors import PlanMismatchError, TripCountGuessWarning
from autoshard.ir.graph import OpGraph
from autoshard.ir.trace import signature, trace
from autoshard.plans.annotations import Annotations
from autoshard.plans.plan import Plan
from autoshard.plans.planfile import check_args, check_mesh, check_signature
from autoshard.runtime.spmd import SpmdStep


def annotations_for(plan: Plan, graph: OpGraph) -> Annotations:
    """The plan's layouts in the runtime's shape, in ``graph``'s flat input and output order."""
    in_specs = tuple(plan.input_specs[graph.values[v].path] for v in graph.inputs)
    missing = [p for p in graph.output_paths if p not in plan.output_specs]
    if missing:
        raise PlanMismatchError(f"the step's outputs {missing[:3]} have no spec in the plan: its return value changed")
    out_specs = tuple(plan.output_specs[p] for p in graph.output_paths)
    return Annotations(in_specs, out_specs, dict(plan.op_out_specs), dict(plan.op_in_reshards),
                       dict(plan.output_reshards), dict(plan.op_deferred))


class AppliedPlan:
    """A callable running ``fn`` with ``plan``'s shardings on ``mesh``."""

    def __init__(self, plan: Plan, fn: Callable[..., Any], mesh: Mesh, *,
                 compiler_options: Mapping[str, Any] | None = None) -> None:
        """``compiler_options``: XLA's, for the step's executable, as ``jax.jit``'s (None: its defaults)."""
        check_mesh(plan, tuple(mesh.devices.shape), tuple(mesh.axis_names))
        self.plan, self.fn, self.mesh = plan, fn, mesh
        self.compiler_options = compiler_options
        self.step: SpmdStep | None = None
        self.called_with: Any = None  # the first call's signature (tree, shapes, dtypes)

    def prepare(self, args: tuple[Any, ...]) -> SpmdStep:
        """Trace ``fn`` at the shapes of ``args`` and build the SPMD step once; a later call with other
        shapes raises PlanMismatchError naming them (the step is compiled for the planned ones)."""
        if self.step is None:
            # Trace from shapes: tracing committed, sharded arrays makes jax add reshard ops of its own.
            shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.numpy.result_type(x)), args)
            with warnings.catch_warnings():  # the plan is priced already: a while loop's guessed trip count
                warnings.simplefilter("ignore", TripCountGuessWarning)  # is no news when it is only run
                graph = trace(self.fn, *shapes)
            check_signature(self.plan, graph)
            self.step = SpmdStep(graph, annotations_for(self.plan, graph), self.mesh,
                                 compiler_options=self.compiler_options)
            self.called_with = signature(args)
        elif signature(args) != self.called_with:
            check_args(self.plan, args)
        return self.step

    def __call__(self, *args: Any) -> Any:
        return self.prepare(args).call_placed(args)

    def lower(self, *args: Any) -> Any:
        return self.prepare(args).lower(*args)
