"""The next-best plans of an ILP: solve again with a no-good cut excluding each plan found.

A cut (``IlpProblem.excluded``, constraint (k) of ``passes/ilp/mip.py`` and ``passes/ilp/cpsat.py``) is a mask per node over its
strategies; a plan that takes a marked strategy at every node is excluded. ``exact_cut`` marks one plan's
choices only; a caller that sees several strategies as the same plan (the same decoded layouts) marks
them all, so each re-solve returns a plan that differs where it matters. ``next_best`` returns up to
``k`` such plans, best first under the model; each is optimal among the plans the cuts leave, or the best
found within the time limit (its ``status`` and ``gap`` say which).
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import TypeAlias

import numpy as np

from autoshard.errors import PlanningError
from autoshard.passes.ilp import solve
from autoshard.passes.ilp.disjunction import KEPT_SEARCH
from autoshard.passes.ilp.problem import IlpProblem, IlpSolution, evaluate

__all__ = ["Cut", "exact_cut", "next_best", "solve_excluding"]

log = logging.getLogger(__name__)

Cut: TypeAlias = tuple[np.ndarray, ...]  # per node: bool per strategy, True = in the excluded set


def exact_cut(problem: IlpProblem, choices: np.ndarray) -> Cut:
    """The cut that excludes exactly ``choices``."""
    return tuple(np.arange(len(c)) == int(choices[i]) for i, c in enumerate(problem.node_costs))


def solve_excluding(problem: IlpProblem, cuts: Sequence[Cut], starts: Sequence[np.ndarray] = ()) -> IlpSolution | None:
    """The best plan no cut excludes, or None when the cuts leave none (or none was found in time).

    The hint is the cheapest of the problem's own hint and ``starts`` (complete plans, e.g. the classic ones)
    that no cut excludes and that fits: the solver's fallback (and CP-SAT's first plan).
    """
    cut = dataclasses.replace(problem, excluded=tuple(problem.excluded) + tuple(cuts), hint=None)
    usable = [(e.objective_s, i) for i, start in enumerate(x for x in (problem.hint, *starts) if x is not None)
              if len(start) == problem.num_nodes and (np.asarray(start) >= 0).all()
              and not (e := evaluate(cut, np.asarray(start, dtype=np.int64))).violations]
    if usable:
        candidates = [x for x in (problem.hint, *starts) if x is not None]
        cut = dataclasses.replace(cut, hint=np.asarray(candidates[min(usable)[1]], dtype=np.int64))
    try:
        found = solve(cut)
    except PlanningError as err:
        log.info("no further plan: %s", err)
        return None
    if evaluate(cut, found.choices).violations:  # never hand back a plan a cut excludes
        log.warning("the solver returned a plan its cuts exclude: no further plan")
        return None
    return found


def next_best(problem: IlpProblem, first: Cut, k: int, cut_of: Callable[[np.ndarray], Cut],
              keep: Callable[[IlpSolution], bool] = lambda _s: True, max_solves: int | None = None,
              starts: Sequence[np.ndarray] = ()) -> list[IlpSolution]:
    """Up to ``k`` plans after the one ``first`` excludes, best first: each re-solve excludes every plan seen
    (``cut_of(choices)`` of each); a plan ``keep`` refuses (it does not fit, say) is excluded and not
    returned. At most ``max_solves`` solves (default 2k + 1); ``starts``: hints (``solve_excluding``)."""
    cuts, found = [first], []
    try:
        for _ in range(2 * k + 1 if max_solves is None else max_solves):
            if len(found) >= k:
                break
            solution = solve_excluding(problem, cuts, starts)
            if solution is None:
                break
            cuts.append(cut_of(solution.choices))
            if keep(solution):
                found.append(solution)
    finally:
        KEPT_SEARCH.forget()  # the re-solves were one search (passes/ilp/disjunction.py), kept between them
    return found
