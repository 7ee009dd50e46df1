"""``check="compiled"`` for ``autoshard.plan`` and the decorator: plan, then arbitrate on compiled programs.

An SPMD plan goes through ``compare`` with ``contest="best"``: the classic plans are planned (the best
one that fits is the ILP's hint, as always), then autoshard's plan, its next-best distinct plans and that
best classic plan are compiled and priced from their HLO, and the fastest is returned
(``compiler/arbiter.py``). Batch ceilings are not searched.

A pipeline plan compiles as one program per stage and action (``compile_plans.compile_pipeline``) and is
priced from them (``verify_pipeline.compiled_pipeline_price``: each executable as an SPMD program is, composed
by its schedule), its ledger getting that price. With the stage count searched, the pipeline driver keeps
the best pipeline beside the SPMD plan whichever the model prefers; the SPMD plan is arbitrated as above and
the faster compiled step of the two is returned (ties: the model's choice); with the stage count given, the
pipeline is the answer and only gets its price. A pipeline whose stages do not compile here is not a
contender, and ``Plan.checks`` says why.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from autoshard.compiler.arbiter import CHECK_NAME
from autoshard.compiler.baselines import compare
from autoshard.compiler.collector import without_collector
from autoshard.compiler.compile_plans import compile_pipeline
from autoshard.compiler.driver import PlannedStep, Progress
from autoshard.compiler.pipeline_context import PipelinePlanned, PipelineSearch
from autoshard.compiler.target import ClusterLike, MeshLike
from autoshard.compiler.verify_pipeline import compiled_pipeline_price
from autoshard.passes.intra_op import IntraOpOptions
from autoshard.plans.ledger import fmt_s


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


def checked(fn: Callable[..., Any], args: Sequence[Any], search: PipelineSearch, *, mesh: MeshLike = None,
            cluster: ClusterLike = None, memory_budget: float | None = None, options: IntraOpOptions | None = None,
            progress: Progress | None = None) -> PlannedStep | PipelinePlanned:
    """What the pipeline driver found (``keep_both``: the best pipeline beside the SPMD plan when the stage
    count was searched), arbitrated on compiled programs: the SPMD plan again by ``plan_checked`` on its mesh
    (``mesh`` when given: a jax Mesh keeps its devices), the pipeline stage by stage; the faster compiled step
    is returned (module docstring)."""
    piped = _priced_pipeline(fn, args, search.pipeline, progress) if search.pipeline is not None else None
    if search.spmd is None:  # the user's stage count: nothing else to weigh
        if piped is None:
            raise ValueError("internal: a pipeline search with neither plan")
        return piped
    spmd = plan_checked(fn, args, mesh=mesh if mesh is not None else search.spmd.logical_mesh.shape,
                        cluster=cluster, memory_budget=memory_budget, options=options, progress=progress,
                        name=search.spmd.plan.name)
    if piped is None:
        return spmd
    mine, other = piped.plan.ledger.compiled_step_s, spmd.plan.ledger.compiled_step_s
    spmd_line = spmd.plan.checks.get(CHECK_NAME, "")
    if mine <= 0:  # the pipeline did not compile: the SPMD plan, arbitrated, is what runs
        return _noted(spmd, f"{spmd_line}; {piped.plan.checks[CHECK_NAME]}")
    pipe_line = piped.plan.checks[CHECK_NAME]
    if spmd.plan.fits and 0 < other and (other < mine or (other == mine and search.chosen is search.spmd)):
        return _noted(spmd, f"{spmd_line}; faster than the best pipeline: {pipe_line}")
    return _noted(piped, f"{pipe_line}; the best SPMD plan compiled {fmt_s(other) if other > 0 else 'not at all'}"
                         + (f" ({spmd_line})" if spmd_line else ""))


def _priced_pipeline(fn: Callable[..., Any], args: Sequence[Any], planned: PipelinePlanned,
                     progress: Progress | None) -> PipelinePlanned:
    """``planned`` with its compiled price in its ledger and a line in ``Plan.checks`` (the ledger unpriced and
    the reason when its stages do not compile here)."""
    plan = planned.plan
    if progress is not None:
        progress("compiling the pipeline's stage executables")
    try:
        price = compiled_pipeline_price(plan, compile_pipeline(plan, fn, args))
    except Exception as err:  # noqa: BLE001 — the model's choice stays, with the reason
        why = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}"
        return _noted(planned, f"the pipeline's stage executables did not compile here ({why})")
    plan = replace(plan, ledger=replace(plan.ledger, compiled_step_s=price.step_s,
                                        compiled_compute_s=price.busy_compute_s,
                                        compiled_collectives_s=price.busy_collectives_s))
    return _noted(replace(planned, plan=plan), f"the pipeline compiles to {fmt_s(price.step_s)} a step (modeled "
                                               f"{fmt_s(price.modeled_step_s)})")


def _noted(planned: Any, line: str) -> Any:
    """``planned`` with ``line`` as its compiled-arbitration entry of ``Plan.checks``."""
    return replace(planned, plan=replace(planned.plan, checks={**planned.plan.checks, CHECK_NAME: line}))
