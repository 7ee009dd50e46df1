"""The cutoff a mesh search is given (``plan_on``'s ``cutoff_s``: a step found elsewhere, a pipeline's): a mesh
whose ILP bound proves it slower is left unfinished, and a cutoff above the best plan changes nothing."""
from __future__ import annotations

import pytest

from autoshard.compiler.driver import plan_on
from autoshard.compiler.target import resolve_target
from autoshard.errors import CutOffError
from autoshard.passes import budget_search
from autoshard.passes.lowering import search_starts_of
from autoshard.ir.trace import trace
from examples import gpt


@pytest.fixture(scope="module")
def searched():
    work = gpt.workload("tiny", abstract=True)
    graph = trace(work.step, *work.args)
    target = resolve_target(None, "1x8-a100", None, num_devices=8)
    assert len(target.meshes) > 1
    return graph, target, plan_on(graph, target, explain=False)


def test_a_cutoff_below_every_plan_leaves_every_mesh_unfinished(searched, monkeypatch):
    graph, target, full = searched
    best = full.plan.step_s
    starts = []  # the search starts are the hint HiGHS reads after its LP: a mesh cut off never makes them
    monkeypatch.setattr(budget_search, "search_starts_of", lambda cg: starts.append(cg) or search_starts_of(cg))
    with pytest.raises(CutOffError) as cut:
        plan_on(graph, target, explain=False, cutoff_s=0.5 * best)
    # the least bound over the meshes: above the cutoff, and no plan of any mesh is below it
    assert 0.5 * best < cut.value.bound_s <= best * (1 + 1e-9)
    assert f"{len(target.meshes)} of the {len(target.meshes)} meshes" in str(cut.value)
    assert starts == []


def test_a_cutoff_above_the_best_plan_finds_it(searched):
    graph, target, full = searched
    again = plan_on(graph, target, explain=False, cutoff_s=1.5 * full.plan.step_s)
    assert again.plan.step_s == pytest.approx(full.plan.step_s, rel=1e-9)
    assert again.plan.mesh_shape == full.plan.mesh_shape
