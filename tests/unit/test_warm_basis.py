"""The LP solved again from the last optimum's basis when only its memory rows changed (``passes/ilp/warm.py``).
Each test starts with no basis kept (``tests/conftest.py``)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import autoshard.passes.ilp.warm as warm
from autoshard.errors import InfeasibleMemoryError
from autoshard.passes.ilp import IlpProblem, evaluate, min_peak_memory, solve
from tests.unit.test_ilp import _medium_problem


def _cold_path_calls(monkeypatch) -> list[float]:
    """Record every solve that takes ``lp.solve_lp`` (the restricted LP, then the whole one) rather than the
    kept basis."""
    import autoshard.passes.ilp.disjunction as disjunction
    import autoshard.passes.ilp.mip as mip

    calls: list[float] = []
    for module in (mip, disjunction):  # a plan's LP, and the root LP of a search outside no-good cuts
        def recorded(b, time_limit_s, cutoff=float("inf"), cold=module.solve_lp):
            calls.append(time_limit_s)
            return cold(b, time_limit_s, cutoff)

        monkeypatch.setattr(module, "solve_lp", recorded)
    return calls


def _at(problem: IlpProblem, budget: float | None) -> IlpProblem:
    return dataclasses.replace(problem, memory_budget_bytes=budget)


def test_a_lowered_budget_is_solved_from_the_last_basis_to_the_cold_answer(monkeypatch) -> None:
    """The budget search's rounds: the same LP with its memory rows tightened (the first solve has none). Each
    later solve starts from the kept basis, needs no cold path, and finds what a cold solve finds."""
    problem = _medium_problem(seed=1)
    budgets = (None, 53.0, 52.0, 51.0)  # its plan peaks at 54 B without a budget
    cold = {}
    for budget in budgets:
        warm.clear()
        cold[budget] = solve(_at(problem, budget))
    warm.clear()
    calls = _cold_path_calls(monkeypatch)
    for k, budget in enumerate(budgets):
        found = solve(_at(problem, budget))
        assert len(calls) == 1, f"budget {budget}: solved from cold again"  # the first solve only
        assert found.objective_s == pytest.approx(cold[budget].objective_s, rel=1e-9)
        assert found.status == cold[budget].status == "optimal"
        if budget is not None:
            assert max(evaluate(_at(problem, budget), found.choices).memory_bytes) <= budget
    assert cold[51.0].objective_s > cold[None].objective_s  # the rows bind: the tighter LP is another LP


def test_a_basis_whose_binding_row_is_gone_is_not_used(monkeypatch) -> None:
    """At 51 B memory rows bind (held at their bounds in the optimal basis); without a budget they are gone,
    so the kept statuses no longer count one basic variable per row and the solve goes the cold way."""
    problem = _medium_problem(seed=1)
    tight = solve(_at(problem, 51.0))
    assert tight.status == "optimal"
    (kept,) = warm._KEPT.values()
    assert (kept.rows[-len(kept.points):] != warm._BASIC).any()  # a memory row held at its bound
    calls = _cold_path_calls(monkeypatch)
    free = solve(_at(problem, None))
    assert len(calls) == 1
    assert free.status == "optimal" and free.objective_s < tight.objective_s


def test_another_lp_is_not_started_from_the_basis(monkeypatch) -> None:
    """The basis is kept by the LP's name apart from its memory rows: other costs are another LP."""
    problem = _at(_medium_problem(seed=1), None)
    solve(problem)
    calls = _cold_path_calls(monkeypatch)
    other = dataclasses.replace(problem, node_costs=tuple(np.asarray(c) * 1.5 for c in problem.node_costs))
    solve(other)
    assert len(calls) == 1
    solve(problem)
    assert len(calls) == 1  # the first LP's basis is still kept beside the other's


def test_the_bases_kept_are_bounded(monkeypatch) -> None:
    monkeypatch.setattr(warm, "KEPT_BASES", 2)
    problem = _at(_medium_problem(seed=1), None)
    for scale in (1.0, 2.0, 3.0):
        solve(dataclasses.replace(problem, node_costs=tuple(np.asarray(c) * scale for c in problem.node_costs)))
    assert len(warm._KEPT) == 2


def test_a_budget_no_plan_fits_is_proven_from_the_kept_basis(monkeypatch) -> None:
    """An LP the memory rows make infeasible is infeasible from any start: the warm run's proof stands and the
    budget's error follows without the cold path (``smallest_budget`` probes such budgets)."""
    problem = _medium_problem(seed=1)
    solve(_at(problem, 53.0))
    calls = _cold_path_calls(monkeypatch)
    # below every point's least bytes even the LP relaxation has no solution (the MIP would search in vain)
    lp_floor = max(sum(float(np.min(nbytes)) for _, nbytes in point) for point in problem.memory_points)
    assert lp_floor - 1.0 < min_peak_memory(problem)
    with pytest.raises(InfeasibleMemoryError):
        solve(_at(problem, lp_floor - 1.0))
    assert calls == []


def test_the_next_best_plans_start_from_the_basis_of_the_best(monkeypatch) -> None:
    """``candidates.next_best`` branches on no-good cuts over the LP without their rows: the same LP as the
    best plan's, so its root is that LP's kept optimum, and the plans are those found from cold."""
    from autoshard.passes.ilp.candidates import exact_cut, next_best

    problem = _at(_medium_problem(seed=1), None)

    def ranked() -> list[float]:
        best = solve(problem)
        return [s.objective_s for s in next_best(problem, exact_cut(problem, best.choices), 2,
                                                 lambda choices: exact_cut(problem, choices))]

    calls = _cold_path_calls(monkeypatch)
    monkeypatch.setattr(warm, "KEPT_BASES", 0)  # nothing kept: every LP from cold
    from_cold = ranked()
    assert len(calls) == 2  # the best plan's LP, then the root of the search
    monkeypatch.setattr(warm, "KEPT_BASES", 16)
    calls.clear()
    assert ranked() == pytest.approx(from_cold, rel=1e-9)
    assert len(calls) == 1 and len(from_cold) == 2  # the best plan's LP only
