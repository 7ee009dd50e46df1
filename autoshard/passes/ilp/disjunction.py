"""The best plan outside no-good cuts (``IlpProblem.excluded``), by branching on the cuts over one warm LP.

A cut excludes the plans that take a marked strategy at every node it names. As a row of the MIP
(``mip.py``'s (k)) it is weak: the LP spreads the one unit of difference over every node it names, the
relaxation is fractional, and HiGHS's MIP took 6-8 s to prove the next-best plan of an 83-node MLP (10k
columns) and stopped at a 22% gap when given 1 s. Here the cuts are not rows. The LP of the problem without
them is solved, and a box (a set of columns held at 0) whose optimum is a plan some cut excludes is split
as Lawler and Murty split a solution space for the k best plans: for the cut's nodes i_1..i_n, child j keeps
i_1..i_{j-1} within the cut's marked strategies and takes i_j outside them. The children partition the box
less the plans the cut excludes; each is the same LP with more columns held at 0, solved again from the basis
HiGHS holds (a warm dual simplex), and bounded before it is solved by its parent's optimum plus the least
reduced cost among the strategies it opens at i_j (every column's reduced cost at an optimum prices what
moving it costs, so a plan taking one of them costs at least that much more). The search is best first; a
box whose optimum is fractional branches on its most decided fractional node (that strategy, or not it). Of
boxes with equal bounds the newest is taken first, so the search goes deep and finds a plan soon. It
ends when no open box's bound is below the best plan found (optimal) or at the time limit (the least open
bound is then the plan's bound).
"""
from __future__ import annotations

import heapq
import itertools
import threading
import time

import numpy as np
import scipy.optimize

from autoshard.passes.ilp.highs_model import MIP_REL_GAP, MipBuilder, run_highs
from autoshard.passes.ilp.lp import integral, solve_lp
from autoshard.passes.ilp.problem import IlpProblem
from autoshard.passes.ilp.warm import WarmStart

__all__ = ["KEPT_SEARCH", "CutSearch", "KeptSearch"]

Cuts = list[list[tuple[int, np.ndarray]]]  # presolve.exclusion_cuts: per cut, (free node, its marked positions)
_EMPTY = np.zeros(0, dtype=np.int64)


class _Boxes:
    """The HiGHS model of the LP, moved from box to box: ``show(held)`` holds exactly ``held`` at 0."""

    def __init__(self, b: MipBuilder, highs) -> None:
        self.highs, self.upper, self.held = highs, np.concatenate(b.upper), _EMPTY

    def show(self, held: np.ndarray) -> None:
        freed, newly = np.setdiff1d(self.held, held), np.setdiff1d(held, self.held)
        for columns, upper in ((freed, self.upper[freed]), (newly, np.zeros(len(newly)))):
            if len(columns):
                self.highs.changeColsBounds(len(columns), columns.astype(np.int32), np.zeros(len(columns)), upper)
        self.held = held


def _children(b: MipBuilder, cut: list[tuple[int, np.ndarray]], held: np.ndarray, fun: float,
              reduced: np.ndarray) -> list[tuple[float, np.ndarray]]:
    """The boxes that split ``held`` less the plans ``cut`` excludes, each with its bound (module docstring)."""
    sides = []  # per node of the cut: (its columns outside the marks, inside them), each without the held ones
    for node, marked in cut:
        columns = b.s(node, np.arange(len(b.red.allowed[node])))
        inside = np.zeros(len(columns), dtype=bool)
        inside[marked] = True
        keep = ~np.isin(columns, held)
        sides.append((columns[~inside & keep], columns[inside & keep], columns[~inside], columns[inside]))
    bounds = [fun + max(0.0, float(reduced[outside].min())) if len(outside) else np.inf
              for outside, _, _, _ in sides]
    out, within = [], []  # within: the columns that keep the nodes before the next one inside the marks
    for j in np.argsort(bounds, kind="stable"):
        outside, inside, all_outside, all_inside = sides[j]
        if len(outside):
            out.append((bounds[j], np.union1d(held, np.concatenate([all_inside, *within]))))
        if not len(inside):
            break  # no later child can keep this node inside its marks
        within.append(all_outside)
    return out


def _violated(cuts: Cuts, positions: list[int]) -> list[tuple[int, np.ndarray]] | None:
    return next((cut for cut in cuts if all(positions[node] in marked for node, marked in cut)), None)


def _split_fractional(b: MipBuilder, x: np.ndarray, held: np.ndarray) -> list[np.ndarray]:
    """Two boxes: the most decided fractional node (as ``mip.dive`` fixes it) takes its largest strategy, or not."""
    decided = b.most_decided_fractional(x)
    assert decided is not None, "a fractional LP optimum with no fractional node"
    node, position = decided
    columns = b.s(node, np.arange(len(b.red.allowed[node])))
    return [np.union1d(held, np.delete(columns, position)), np.union1d(held, columns[position:position + 1])]


class CutSearch:
    """The search of one problem (``b``, built without the cut rows), kept between solves with more cuts: the
    k best plans of ``candidates.next_best`` are one search (Lawler's), each later plan taken from the boxes the
    earlier ones left open, the LP solved once. ``ticks``: the LP's cost scale (``mip._ticks``); ``const``: what every plan pays beyond the LP's objective (the
    gap is a share of the whole)."""

    def __init__(self, b: MipBuilder, ticks: float, warm: WarmStart, const: float = 0.0) -> None:
        self.b, self.ticks, self.const = b, ticks, const
        self.warm = warm  # the LP's name for its kept basis (``warm.py``): the plan before the cuts solved this LP
        self.boxes: _Boxes | None = None
        self.heap: list = []  # (bound, tie, held columns, the box's LP optimum or None)
        self.order = itertools.count()
        self.found: tuple | None = None  # the heap entry of the plan the last run returned

    def _push(self, bound: float, held: np.ndarray, solved: scipy.optimize.OptimizeResult | None) -> None:
        heapq.heappush(self.heap, (bound, -next(self.order), held, solved))

    def run(self, cuts: Cuts, time_limit_s: float) -> scipy.optimize.OptimizeResult | None:
        """The best plan no cut of ``cuts`` excludes, as ``mip._solve_relaxation_first`` returns one: status 0
        (optimal, ``mip_dual_bound`` its value), 1 (out of time: the best plan found, if any, and the least
        open bound), 2 (every plan is excluded or infeasible). None when the LP without the cuts has no
        optimum in time (the caller solves with the rows). ``cuts`` must extend those of the last run."""
        deadline = time.perf_counter() + time_limit_s
        if self.boxes is None:
            root = self.warm.solve_lp(self.b, time_limit_s, float("inf"), solve_lp)
            if root.status == 2:
                return root
            if root.status != 0 or root.x is None or getattr(root, "highs", None) is None:
                return None
            self.boxes = _Boxes(self.b, root.highs)
            self._push(root.fun, _EMPTY, root)
        if self.found is not None:  # the last plan, which the new cuts exclude: its box is split like any other
            heapq.heappush(self.heap, self.found)
            self.found = None
        best = None
        while self.heap:
            bound, _, held, solved = self.heap[0]
            if best is not None and bound >= best.fun - MIP_REL_GAP * abs(best.fun + self.const):
                break
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            entry = heapq.heappop(self.heap)
            if solved is None:
                self.boxes.show(held)
                solved = run_highs(self.boxes.highs, left)
                if solved.status in (1, 4):  # out of time (or stopped): the box stays open at its bound
                    heapq.heappush(self.heap, entry)
                    break
                if solved.status != 0:
                    continue  # infeasible: no plan in the box
                solved.fun = max(solved.fun, bound)
                if best is not None and solved.fun >= best.fun:
                    self._push(solved.fun, held, None)  # no better than the plan found: open for a later run
                    continue
            if not integral(self.b, solved.x):
                for child in _split_fractional(self.b, solved.x, held):
                    self._push(solved.fun, child, None)
                continue
            cut = _violated(cuts, self.b.positions(solved.x))
            if cut is None:  # the box's optimum, outside every cut: its other plans cost no less
                if best is not None:
                    self._push(best.fun, self.found[2], None)
                best, self.found = solved, (solved.fun, entry[1], held, solved)
                continue
            reduced = getattr(solved, "reduced", None)
            for child_bound, child in _children(self.b, cut, held, solved.fun,
                                                reduced if reduced is not None else np.zeros(self.b.num_cols)):
                self._push(child_bound, child, None)
        if best is None:
            if self.heap:
                return scipy.optimize.OptimizeResult(status=1, x=None, fun=None, mip_dual_bound=self.heap[0][0],
                                                     message="Time limit reached: no plan outside the cuts found")
            return scipy.optimize.OptimizeResult(status=2, x=None, fun=None,
                                                 message="every plan is excluded by a cut or infeasible")
        bound = min(best.fun, self.heap[0][0]) if self.heap else best.fun
        proven = best.fun - bound <= MIP_REL_GAP * abs(best.fun + self.const)
        return scipy.optimize.OptimizeResult(
            status=0 if proven else 1, x=best.x, fun=best.fun, mip_dual_bound=bound,
            message="Optimal outside the cuts" if proven else "Time limit reached; the best plan outside the cuts")


class KeptSearch:
    """The ``CutSearch`` of the last problem solved outside cuts, for the next solve of the same problem (the
    same objects in every field but the cuts, the hint and the limit, as ``dataclasses.replace`` leaves them)
    with more cuts: ``candidates.next_best``'s re-solves, which ``forget`` it when done. One at a time: a
    search is taken out while it runs."""

    _SAME = ("node_costs", "edges", "edge_costs", "memory_points", "memory_constant_bytes", "charges", "reshards")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: tuple[IlpProblem, CutSearch] | None = None

    def take(self, problem: IlpProblem) -> CutSearch | None:
        with self._lock:
            kept, self._kept = self._kept, None
        if kept is None:
            return None
        old, search = kept
        same = all(getattr(old, f) is getattr(problem, f) for f in self._SAME) and (
            old.memory_budget_bytes, old.solver) == (problem.memory_budget_bytes, problem.solver)
        extends = len(old.excluded) <= len(problem.excluded) and all(
            a is c for a, c in zip(old.excluded, problem.excluded))
        return search if same and extends else None

    def keep(self, problem: IlpProblem, search: CutSearch) -> None:
        with self._lock:
            self._kept = (problem, search)

    def forget(self) -> None:
        with self._lock:
            self._kept = None


KEPT_SEARCH = KeptSearch()

