"""Run a saved Plan on a set of devices: ``plan.apply(fn, mesh)``.

The step is traced again on its first call; the trace must match the plan's
signature (argument paths, shapes, dtypes, operation count) and the mesh its
axes, else PlanMismatchError says what differs.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh

from autoshard.compiler.plan import Plan
from autoshard.compiler.planfile import check_mesh, check_signature
from autoshard.compiler.trace import trace
from autoshard.passes.emit import Annotations
from autoshard.runtime.spmd import SpmdStep


def annotations_from_plan(plan: Plan, graph) -> Annotations:
    in_specs = tuple(plan.input_specs[graph.values[v].path] for v in graph.inputs)
    out_paths = list(graph.output_paths)
    missing = [p for p in out_paths if p not in plan.output_specs]
    if missing:
        from autoshard.errors import PlanMismatchError

        raise PlanMismatchError(f"the step's outputs {missing[:3]} have no spec in the plan: its return value changed")
    out_specs = tuple(plan.output_specs[p] for p in out_paths)
    return Annotations(in_specs, out_specs, dict(plan.op_out_specs), dict(plan.op_in_reshards),
                       dict(plan.output_reshards))


class AppliedPlan:
    """A callable running ``fn`` with ``plan``'s shardings on ``mesh``."""

    def __init__(self, plan: Plan, fn: Callable[..., Any], mesh: Mesh) -> None:
        check_mesh(plan, tuple(mesh.devices.shape), tuple(mesh.axis_names))
        self.plan, self.fn, self.mesh = plan, fn, mesh
        self.step: SpmdStep | None = None

    def _build(self, args: tuple[Any, ...]) -> SpmdStep:
        if self.step is None:
            # Trace from shapes: tracing committed, sharded arrays makes jax add reshard ops of its own.
            shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
            graph = trace(self.fn, *shapes)
            check_signature(self.plan, graph)
            self.step = SpmdStep(graph, annotations_from_plan(self.plan, graph), self.mesh)
        return self.step

    def __call__(self, *args: Any) -> Any:
        step = self._build(args)
        flat = step.flatten_args(args)
        placed = [x if getattr(x, "sharding", None) == s else jax.device_put(x, s)
                  for x, s in zip(flat, step.in_shardings)]
        return jax.tree_util.tree_unflatten(step.graph.out_tree, step.jitted(*placed))

    def lower(self, *args: Any) -> Any:
        return self._build(args).lower(*args)
