"""One problem presolved and its LP built once for every budget it is solved at (``passes/ilp/kept_lp.py``)."""
from __future__ import annotations

import dataclasses

import numpy as np

import autoshard.passes.ilp.kept_lp as kept_lp
import autoshard.passes.ilp.mip as mip
from autoshard.errors import InfeasibleMemoryError
from autoshard.passes.ilp import solve
from autoshard.passes.ilp.presolve import presolve
from tests.unit.test_ilp import _medium_problem


def _counted(monkeypatch) -> dict[str, int]:
    counts = {"presolve": 0, "build": 0}

    def counted_presolve(problem):
        counts["presolve"] += 1
        return presolve(problem)

    def counted_build(problem, red, build=mip.build_lp):
        counts["build"] += 1
        return build(problem, red)

    monkeypatch.setattr(kept_lp, "presolve", counted_presolve)
    monkeypatch.setattr(mip, "build_lp", counted_build)
    return counts


def test_the_budgets_of_one_problem_share_its_presolve_and_lp(monkeypatch) -> None:
    """Budgets of one problem (its tuples made anew around the same arrays, as the budget search makes them)
    are presolved and built once, and each plans as a fresh build does; the least-memory plan an infeasible
    budget names reuses the presolve; other terms (a learned memory point) are presolved and built anew."""
    kept_lp.clear()
    counts = _counted(monkeypatch)
    problem = _medium_problem(seed=1)
    plans = []
    for budget in (None, 53.0, 52.0, 51.0):
        again = dataclasses.replace(problem, memory_budget_bytes=budget, edges=tuple(problem.edges),
                                    edge_costs=tuple(problem.edge_costs))
        plans.append(solve(again))
    assert counts == {"presolve": 1, "build": 1}
    try:
        solve(dataclasses.replace(problem, memory_budget_bytes=1.0))
    except InfeasibleMemoryError as err:
        assert err.smallest_budget_bytes is not None
    assert counts == {"presolve": 1, "build": 1}
    kept_lp.clear()  # each budget built from scratch plans the same
    for budget, plan in zip((None, 53.0, 52.0, 51.0), plans):
        fresh = solve(dataclasses.replace(problem, memory_budget_bytes=budget))
        kept_lp.clear()
        assert np.array_equal(fresh.choices, plan.choices) and fresh.objective_s == plan.objective_s
    counts.update(presolve=0, build=0)
    unbounded = dataclasses.replace(problem, memory_budget_bytes=None)
    solve(unbounded)
    point = problem.memory_points[0]
    grown = ((point[0][0], np.asarray(point[0][1]) + 1), *point[1:])  # a copy's bytes learned at point 0
    solve(dataclasses.replace(unbounded, memory_points=(grown, *problem.memory_points[1:])))
    assert counts == {"presolve": 2, "build": 2}


def test_only_the_last_problems_are_kept() -> None:
    kept_lp.clear()
    for seed in range(kept_lp.KEPT + 2):
        kept_lp.presolved(_medium_problem(seed=seed))
    assert len(kept_lp._KEPT.entries) == kept_lp.KEPT


def test_a_problem_starts_warm_once_its_lp_was_solved_to_optimality() -> None:
    """``starts_warm``: the budget search gives a round more time when its LP starts from a kept basis."""
    import autoshard.passes.ilp.warm as warm
    from autoshard.passes.ilp.solvers import starts_warm

    kept_lp.clear()
    problem = dataclasses.replace(_medium_problem(seed=1), memory_budget_bytes=None)
    assert not starts_warm(problem)
    assert solve(problem).status == "optimal"
    assert starts_warm(dataclasses.replace(problem, memory_budget_bytes=52.0))
    assert not starts_warm(dataclasses.replace(problem, node_costs=tuple(c * 2 for c in problem.node_costs)))
    warm.clear()
    assert not starts_warm(problem)
