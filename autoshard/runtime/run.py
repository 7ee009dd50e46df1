"""Run a Plan: ``autoshard.apply(plan, fn, mesh)``, the one place a plan (plain data) becomes a runner.

The runner is chosen by what the plan is: an SPMD plan (``Plan.pipeline`` is None) runs as one ``jax.jit``
on ``mesh`` (``runtime/applied.py``); a pipeline plan runs its stages on the devices of ``mesh``
(``runtime/applied_pipeline.py``), a scanned stack's stages each scanning their own iterations
(``runtime/applied_scan.py``). Each traces ``fn`` on its first call and checks the trace against the plan.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from autoshard.plans.plan import Plan
from autoshard.runtime.applied import AppliedPlan
from autoshard.runtime.applied_pipeline import AppliedPipeline
from autoshard.runtime.applied_scan import AppliedScanPipeline
from autoshard.runtime.stage_layout import StepOptions


def run(plan: Plan, fn: Callable[..., Any], mesh: Mesh | Sequence[jax.Device], *,
        compiler_options: Mapping[str, Any] | None = None) -> AppliedPlan | AppliedPipeline:
    """A callable that runs ``fn`` with ``plan`` on ``mesh`` (a jax Mesh of the plan's shape; for a pipeline
    plan any mesh or device list: its stages' device indices name ``mesh.devices.flat``);
    ``compiler_options``: XLA's, for its executables, as ``jax.jit``'s."""
    if plan.pipeline is None:
        if not isinstance(mesh, Mesh):
            raise TypeError(f"an SPMD plan runs on a jax Mesh of shape {tuple(plan.mesh_shape)}; got "
                            f"{type(mesh).__name__}")
        return AppliedPlan(plan, fn, mesh, compiler_options=compiler_options)
    options = StepOptions(compiler_options=dict(compiler_options) if compiler_options else None)
    if plan.pipeline.scanned:
        return AppliedScanPipeline(plan, fn, mesh, options=options)
    return AppliedPipeline(plan, fn, mesh, options=options)
