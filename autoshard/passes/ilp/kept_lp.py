"""A problem presolved, and its LP built, once for every budget it is solved at.

The budget search (``passes/budget_search.py``) solves one cost graph's ILP round after round at other
budgets (the ILP's budget lowered or bisected, ``smallest_budget``'s probes and the least-memory plan of an
``InfeasibleMemoryError``), and each solve presolved the problem and built the LP's columns and rows anew,
though the budget changes only the memory rows: in a test module that names and plans memory budgets of
the small GPT, under a profiler (which inflates Python code), presolve took 10.7 s and the LP's rows 12 s of
the 40 s in its 43 solves, HiGHS 6.8 s; unprofiled that module took 56 s before and 53 s with them kept, and
the budget sweeps of ``tests/unit/test_memory_budget.py`` 110 s and 95-103 s.
The problems of one cost graph share their terms (the same arrays: ``CostGraph.terms``, and the learned
memory points while no new copy is learned), so the last ``KEPT`` problems' presolved form (``Reduced``) and
LP but for its memory rows (with its ``WarmStart`` name) are kept per process, found again by those terms,
and each solve adds its memory rows to a copy of the kept LP. Nothing is kept for a problem whose presolve
or build fails (the error is raised again the next time).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from autoshard.passes.ilp.highs_model import MipBuilder
from autoshard.passes.ilp.presolve import Reduced, presolve
from autoshard.passes.ilp.problem import IlpProblem
from autoshard.passes.ilp.warm import WarmStart

__all__ = ["KEPT", "Built", "clear", "kept_lp", "presolved"]

KEPT = 4  # problems whose presolved form and LP the process keeps (the last used)


@dataclass(frozen=True)
class Built:
    """An LP without memory rows (``b``, not to be changed: ``copy`` it), its presolved problem and scale."""

    red: Reduced
    ticks: float
    b: MipBuilder
    warm: WarmStart

    def copy(self) -> MipBuilder:
        """The LP to add rows to: every list of columns and rows copied (their arrays are never changed)."""
        b = self.b
        return replace(b, cost=list(b.cost), upper=list(b.upper), integral=list(b.integral), rows=list(b.rows),
                       cols=list(b.cols), vals=list(b.vals), lower_rhs=list(b.lower_rhs),
                       upper_rhs=list(b.upper_rhs), lazy=list(b.lazy), left_out=list(b.left_out),
                       memory_points=list(b.memory_points), memory_rows=list(b.memory_rows))


def _terms(problem: IlpProblem) -> tuple[Any, ...]:
    """What presolve and the LP but for its memory rows are made of (not the budget, hint, limit or cutoff)."""
    return (problem.node_costs, problem.edges, problem.edge_costs, problem.memory_points,
            problem.memory_constant_bytes, problem.charges, problem.reshards, problem.excluded)


def _same(a: Any, b: Any) -> bool:
    """The same terms: the same objects, tuples element by element (a problem's tuples are made anew for each
    budget around the same arrays), plain numbers and names by value."""
    if a is b:
        return True
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float, str)) and isinstance(b, (int, float, str)):
        return a == b
    return False


class _Kept:
    """The last ``KEPT`` problems' terms, presolved form and LP (None until built), most recent last."""

    def __init__(self) -> None:
        self.entries: list[list[Any]] = []  # [terms, Reduced, Built | None]
        self.lock = threading.Lock()

    def find(self, problem: IlpProblem) -> list[Any]:
        terms = _terms(problem)
        with self.lock:
            for k, entry in enumerate(self.entries):
                if _same(entry[0], terms):
                    self.entries.append(self.entries.pop(k))
                    return entry
        entry = [terms, presolve(problem), None]
        with self.lock:
            self.entries.append(entry)
            del self.entries[:-KEPT]
        return entry


_KEPT = _Kept()


def presolved(problem: IlpProblem) -> Reduced:
    """``presolve(problem)``, kept for the next problem with the same terms."""
    return _KEPT.find(problem)[1]


def kept_lp(problem: IlpProblem, make: Callable[[IlpProblem, Reduced], Built]) -> Built:
    """The LP (without memory rows) ``make`` builds from the problem presolved, kept for the next problem with
    the same terms."""
    entry = _KEPT.find(problem)
    if entry[2] is None:
        entry[2] = make(problem, entry[1])
    return entry[2]


def clear() -> None:
    """Forget every kept problem."""
    with _KEPT.lock:
        _KEPT.entries.clear()
