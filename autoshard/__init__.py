"""autoshard: an automatic parallelization compiler for JAX train steps.

Public API (everything else is internal and may change)::

    autoshard.autoshard        decorator: trace, plan, compile, cache
    autoshard.plan             plan a step from arrays or shapes -> Plan
    autoshard.load_plan        read a plan file
    autoshard.apply            run a Plan: apply(plan, fn, mesh) -> a callable like fn
    autoshard.Plan, autoshard.ClusterSpec
    autoshard.grad, autoshard.value_and_grad, autoshard.layer_boundary

Names are imported on first use, so ``import autoshard.meshes`` stays light.
"""
from __future__ import annotations

import importlib
from typing import Any

from autoshard.version import __version__  # noqa: F401

_EXPORTS = {
    "autoshard": "autoshard.api",
    "plan": "autoshard.api",
    "load_plan": "autoshard.api",
    "apply": "autoshard.api",
    "Plan": "autoshard.plans.plan",
    "ClusterSpec": "autoshard.meshes.cluster",
    "PRESETS": "autoshard.meshes.cluster",
    "grad": "autoshard.ir.markers",
    "value_and_grad": "autoshard.ir.markers",
    "layer_boundary": "autoshard.ir.markers",
    "PlanningError": "autoshard.errors",
    "InfeasibleMemoryError": "autoshard.errors",
    "PlanMismatchError": "autoshard.errors",
}
__all__ = [*_EXPORTS, "Cluster"]


def __getattr__(name: str) -> Any:
    if name == "Cluster":
        name = "ClusterSpec"
    if name not in _EXPORTS:
        raise AttributeError(f"module 'autoshard' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
