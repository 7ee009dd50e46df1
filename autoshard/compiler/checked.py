"""``check="compiled"`` for ``autoshard.plan`` and the decorator: plan, then arbitrate on compiled programs.

An SPMD plan goes through ``compare`` with ``contest="best"``: the classic plans are planned (the best
one that fits is the ILP's hint, as always), then autoshard's plan, its next-best distinct plans and that
best classic plan are compiled and priced from their HLO, and the fastest is returned
(``compiler/arbiter.py``). Batch ceilings are not searched. A pipeline plan is returned as planned, with a
``Plan.checks`` note: its stages compile as separate programs, which this check does not arbitrate.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from autoshard.compiler.arbiter import CHECK_NAME
from autoshard.compiler.baselines import compare
from autoshard.compiler.collector import without_collector
from autoshard.compiler.driver import PlannedStep, Progress
from autoshard.compiler.pipeline_context import PipelinePlanned
from autoshard.compiler.target import ClusterLike, MeshLike
from autoshard.passes.intra_op import IntraOpOptions

PIPELINE_NOTE = ("not run: a pipeline plan's stages compile as separate programs, which compiled arbitration does "
                 "not compare; pass num_stages=1 to arbitrate the SPMD plan")


@without_collector
def plan_checked(fn: Callable[..., Any], args: Sequence[Any], *, mesh: MeshLike = None, cluster: ClusterLike = None,
                 memory_budget: float | None = None, options: IntraOpOptions | None = None,
                 progress: Progress | None = None, name: str | None = None) -> PlannedStep:
    """The SPMD plan of ``fn(*args)`` chosen by compiled arbitration (module docstring), named ``name``
    (default: the function's), with the comparison in ``Plan.baselines``."""
    comparison = compare(fn, args, mesh, cluster, memory_budget=memory_budget, options=options, progress=progress,
                         check="compiled", batch_ceilings=False, contest="best")
    planned = comparison.autoshard.planned
    assert planned is not None  # compare keeps every candidate's PlannedStep
    plan = replace(planned.plan, name=name or getattr(fn, "__name__", "autoshard"),
                   baselines=comparison.summary_dict())
    return replace(planned, plan=plan)


def checked(fn: Callable[..., Any], args: Sequence[Any], planned: PlannedStep | PipelinePlanned, *,
            mesh: MeshLike = None, cluster: ClusterLike = None, memory_budget: float | None = None, options: IntraOpOptions | None = None,
            progress: Progress | None = None) -> PlannedStep | PipelinePlanned:
    """A plan of the pipeline driver arbitrated: an SPMD one again by ``plan_checked`` on its mesh (``mesh``
    when given: a jax Mesh keeps its devices), a pipeline one returned with a note in ``Plan.checks``."""
    if isinstance(planned, PipelinePlanned):
        return replace(planned, plan=replace(planned.plan, checks={**planned.plan.checks, CHECK_NAME: PIPELINE_NOTE}))
    return plan_checked(fn, args, mesh=mesh if mesh is not None else planned.logical_mesh.shape, cluster=cluster,
                        memory_budget=memory_budget, options=options, progress=progress, name=planned.plan.name)
