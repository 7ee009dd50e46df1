"""The entry points: ``solve``, ``min_peak_plan`` and ``min_peak_memory`` on either backend.

``IlpProblem.solver`` picks it: ``"mip"`` (HiGHS, ``passes/ilp/mip.py``; the default: its LP bound proves
these problems optimal in seconds) or ``"cpsat"`` (OR-Tools CP-SAT, ``passes/ilp/cpsat.py``, which starts from
the hint improved by the local search, ``passes/ilp/search.py``). Both return the hint when their own plan
is not cheaper, so a result is never worse than its hint.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from autoshard.passes.ilp.kept_lp import kept_lp
from autoshard.passes.ilp.mip import build_lp, min_peak_plan_mip, solve_mip
from autoshard.passes.ilp.problem import IlpProblem, IlpSolution, evaluate
from autoshard.passes.ilp.search import local_search

__all__ = ["min_peak_memory", "min_peak_plan", "solve", "starts_warm"]


def solve(problem: IlpProblem, later_hint: Callable[[], np.ndarray] | None = None) -> IlpSolution:
    """Pick one strategy per node minimising node + edge seconds under the memory budget.

    CP-SAT searches from its hint, so the hint is first improved by the local search; HiGHS proves these
    problems from its LP bound and only falls back on the hint: when it stops at its time limit without a
    proof, the local search improves the better of its plan and the hint, and the gap is taken against
    HiGHS's bound. ``later_hint`` makes the hint of a problem without one: with HiGHS it is called after the
    LP, so not at all when the LP proves that no plan beats the problem's cutoff, or proves its own plan optimal."""
    if problem.solver == "cpsat":
        from autoshard.passes.ilp.cpsat import solve_cpsat  # on use: OR-Tools (and the pandas it loads) take 0.3 s

        if problem.hint is None and later_hint is not None:
            problem = dataclasses.replace(problem, hint=later_hint())
        if problem.hint is not None:
            problem = dataclasses.replace(problem, hint=local_search(problem, np.asarray(problem.hint),
                                                                     seed=problem.seed))
        return solve_cpsat(problem)
    found = solve_mip(problem, problem.hint if problem.hint is not None else later_hint)
    if found.status == "optimal":
        return found
    # the rescue gets what is left of the limit (at least a fifth of it): the limit bounds the whole solve
    left = max(problem.time_limit_s - found.solve_s, 0.2 * problem.time_limit_s)
    improved = local_search(problem, found.choices, seed=problem.seed, time_limit_s=left)
    objective = evaluate(problem, improved).objective_s
    if objective >= found.objective_s:
        return found
    bound = found.objective_s * (1.0 - found.gap)
    gap = max(0.0, objective - bound) / objective if objective > 0 else 0.0
    return dataclasses.replace(found, choices=improved, objective_s=objective, gap=gap)


def starts_warm(problem: IlpProblem) -> bool:
    """Whether solving ``problem`` starts from a kept simplex basis (``warm.py``: the same LP, memory rows
    aside, solved to optimality before in this process); HiGHS only. Builds the LP, which the solve reuses."""
    if problem.solver != "mip":
        return False
    return kept_lp(problem, build_lp).warm.kept()


def min_peak_plan(problem: IlpProblem) -> tuple[float, np.ndarray]:
    """(smallest peak, a plan that reaches it): the least memory any plan free of forbidden choices needs."""
    if problem.solver == "cpsat":
        from autoshard.passes.ilp.cpsat import min_peak_plan_cpsat  # on use, as in ``solve``

        return min_peak_plan_cpsat(problem)
    return min_peak_plan_mip(problem)


def min_peak_memory(problem: IlpProblem) -> float:
    """The smallest ``memory_budget_bytes`` under which :func:`solve` finds a plan (bytes rounded up)."""
    return min_peak_plan(problem)[0]
