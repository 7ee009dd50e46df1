"""The intra-op MIP's columns and rows (``MipBuilder``, filled by ``passes/ilp/mip.py``), and HiGHS holding its LP
relaxation with the memory rows left out until a solution breaks one (``LpModel``, built by ``highs_lp``), and the
run that adds them as they break (``run_highs``).

A memory row (e) is dense: a coefficient on every strategy of every node live at its point. Few of them bind at an
LP optimum, and the ones that do not still cost the simplex dearly: MoE-large on 2x8-a100 has seven, none binding at
the optimum (0.09-0.43 of their room), and the whole LP from the restricted LP's basis took 42 s with them against
9.5 s without (45 s with them present but free: it is the dense rows in the factored basis, not their bounds). So
where the memory rows are far from binding, a model leaves each out until an optimum breaks it. Whether they are is
asked of the restricted LP (``lp.solve_lp``) without them: when its optimum uses more than ``TIGHT`` of some row's
room, every model of the solve holds every memory row from the start, as without this module: where the budget
binds, the dense rows make each pivot from a basis found without them dear (gpt-xl@8 on 2x8-a100 under a lowered
budget, the restricted LP: every one of its eight rows broken, then 6.7 s from that basis against 2.4 s cold, 2.5 s
with the rows in from the start), and the optimum the solve ends at among equal ones decides which plans the budget
search goes on to (from the basis, that cell's search ended 66% slower than with the rows in). Else a row an optimum
breaks is added; where it breaks the model's first optimum, the LP is solved again from a cold start, and a later
run (the whole LP after the restricted one, a dive's fixings, a plan's pricing) goes on from its basis, a few pivots
from an optimum. A model started from a kept basis (``warm.py``) holds every memory row: the basis was an optimum
with them. Once tight, an LP stays so for its other budgets (the verdict is shared by its kept copies): its budget
search probes once (a tiny GPT's budget tests spent as long on the probes as on the rest of their solves). An
optimum that breaks none is the whole LP's optimum: the LP without them is a relaxation, and that optimum is
feasible for the whole LP. What a run proves on the way holds for the whole LP as it is: an infeasible relaxation
makes it infeasible, and a bound on the relaxation (a stopped dual simplex's, or its objective passing
``objective_bound``) bounds it.
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import highspy
import numpy as np
import scipy.optimize
import scipy.sparse

from autoshard.passes.ilp.presolve import Reduced

__all__ = ["MIP_REL_GAP", "TIGHT", "LpModel", "MemoryVerdict", "MipBuilder", "highs_lp", "row_duals", "run_highs",
           "run_once"]

MIP_REL_GAP = 1e-6  # HiGHS's MIP stops when its incumbent is this close to its bound

ROW_TOL = 1e-7  # a memory row is broken when its activity passes its bound by more (HiGHS's feasibility tolerance)
TIGHT = 0.9  # the restricted LP's optimum using more of some memory row's room than this puts every row in


@dataclass
class MemoryVerdict:
    """Whether an LP's memory rows nearly bind (``TIGHT``), as its restricted LP without them found."""

    tight: bool = False


@dataclass
class MipBuilder:
    """Columns and rows of the MIP under construction (COO triplets)."""

    red: Reduced
    first: np.ndarray  # per node: column of s[i, 0]; -1 for a node fixed by presolve
    num_cols: int = 0
    cost: list[np.ndarray] = field(default_factory=list)
    upper: list[np.ndarray] = field(default_factory=list)
    integral: list[np.ndarray] = field(default_factory=list)
    rows: list[np.ndarray] = field(default_factory=list)
    cols: list[np.ndarray] = field(default_factory=list)
    vals: list[np.ndarray] = field(default_factory=list)
    lower_rhs: list[float] = field(default_factory=list)
    upper_rhs: list[float] = field(default_factory=list)
    # per column: whether the restricted LP of ``lp.solve_lp`` leaves it out (a pair that pays a reshard)
    lazy: list[np.ndarray] = field(default_factory=list)
    left_out: list[np.ndarray] = field(default_factory=list)  # columns added earlier and left out too
    memory_points: list[int] = field(default_factory=list)  # the point of each memory row (e), in order
    memory_rows: list[int] = field(default_factory=list)  # the row of each memory row (e)
    # whether the memory rows nearly bind (``lp.solve_lp``): every model then holds them; shared by the copies of
    # one kept LP (``kept_lp.Built.copy``), so the solves of its other budgets hold them from the start too
    memory: MemoryVerdict = field(default_factory=MemoryVerdict)

    def add_cols(self, cost: np.ndarray, upper: np.ndarray, integral: bool,
                 lazy: np.ndarray | None = None) -> int:
        start = self.num_cols
        self.num_cols += len(cost)
        self.cost.append(np.asarray(cost, dtype=float))
        self.upper.append(np.asarray(upper, dtype=float))
        self.integral.append(np.full(len(cost), int(integral)))
        self.lazy.append(np.zeros(len(cost), dtype=bool) if lazy is None else np.asarray(lazy, dtype=bool))
        return start

    def leave_out(self, columns: np.ndarray) -> None:
        """Leave ``columns`` out of the restricted LP too (a reshard's y, worth nothing without its t)."""
        self.left_out.append(np.asarray(columns, dtype=np.int64))

    def restricted(self) -> np.ndarray:
        """Per column: whether the restricted LP leaves it out."""
        out = np.concatenate(self.lazy) if self.lazy else np.zeros(0, dtype=bool)
        for columns in self.left_out:
            out[columns] = True
        return out

    def matrix(self) -> scipy.sparse.csr_array:
        return scipy.sparse.csr_array(
            (np.concatenate(self.vals) if self.vals else np.zeros(0),
             (np.concatenate(self.rows) if self.rows else np.zeros(0, dtype=np.int64),
              np.concatenate(self.cols) if self.cols else np.zeros(0, dtype=np.int64))),
            shape=(len(self.lower_rhs), self.num_cols))

    def add_row(self, columns: np.ndarray, coeffs: np.ndarray, lower: float, upper: float) -> None:
        self.rows.append(np.full(len(columns), len(self.lower_rhs)))
        self.cols.append(np.asarray(columns, dtype=np.int64))
        self.vals.append(np.asarray(coeffs, dtype=float))
        self.lower_rhs.append(lower)
        self.upper_rhs.append(upper)

    def add_rows(self, num_rows: int, row: np.ndarray, columns: np.ndarray, coeffs: np.ndarray, lower: float,
                 upper: float) -> None:
        """``num_rows`` rows at once, each in [lower, upper]: entry k is ``coeffs[k]`` at ``columns[k]`` in row
        ``row[k]`` (0 .. num_rows - 1), each row's entries in the order given (``add_row`` one row at a time
        builds the same matrix: the LP, and so HiGHS's path through it, does not depend on which was used)."""
        order = np.argsort(row, kind="stable")
        self.rows.append(len(self.lower_rhs) + np.asarray(row, dtype=np.int64)[order])
        self.cols.append(np.asarray(columns, dtype=np.int64)[order])
        self.vals.append(np.asarray(coeffs, dtype=float)[order])
        self.lower_rhs.extend([lower] * num_rows)
        self.upper_rhs.extend([upper] * num_rows)

    def add_pair_rows(self, first: np.ndarray, second: np.ndarray, lower: float, upper: float) -> None:
        """One row ``first[i] - second[i]`` in [lower, upper] per i, added at once."""
        count = len(first)
        rows = len(self.lower_rhs) + np.arange(count)
        self.rows.append(np.repeat(rows, 2))
        self.cols.append(np.stack([np.asarray(first, dtype=np.int64), np.asarray(second, dtype=np.int64)],
                                  axis=1).ravel())
        self.vals.append(np.tile([1.0, -1.0], count))
        self.lower_rhs.extend([lower] * count)
        self.upper_rhs.extend([upper] * count)

    def s(self, node: int, positions: np.ndarray) -> np.ndarray:
        return self.first[node] + np.asarray(positions, dtype=np.int64)

    def strategy_columns(self) -> np.ndarray:
        """Every free node's strategy columns s[i, *]."""
        return np.concatenate([self.s(i, np.arange(len(a))) for i, a in enumerate(self.red.allowed)
                               if self.first[i] >= 0] or [np.zeros(0, dtype=np.int64)])

    def positions(self, x: np.ndarray) -> list[int]:
        """Per node, the position (among its allowed strategies) of its largest strategy variable in ``x``; 0 for
        a node presolve fixed."""
        return [int(np.argmax(x[f:f + len(a)])) if f >= 0 else 0 for f, a in zip(self.first, self.red.allowed)]

    def most_decided_fractional(self, x: np.ndarray) -> tuple[int, int] | None:
        """(node, position) of the free node whose largest strategy variable in ``x`` is the largest among the
        nodes with a fractional one, and that variable's position; None when ``x`` is integral."""
        best = None
        for node, (f, allowed) in enumerate(zip(self.first, self.red.allowed)):
            v = x[f:f + len(allowed)] if f >= 0 else None
            if v is not None and np.minimum(v, 1.0 - v).max() > 1e-6 and (best is None or v.max() > best[0]):
                best = (float(v.max()), node, int(np.argmax(v)))
        return None if best is None else best[1:]

    def one_hot(self, positions: list[int]) -> np.ndarray:
        """The columns with each free node's strategy at ``positions`` taken and nothing else set."""
        x = np.zeros(self.num_cols)
        for f, position in zip(self.first, positions):
            if f >= 0:
                x[f + position] = 1.0
        return x

    def solve(self, time_limit_s: float, relaxed: bool = False) -> scipy.optimize.OptimizeResult:
        if self.num_cols == 0:  # presolve fixed every node
            return scipy.optimize.OptimizeResult(status=0, x=np.zeros(0), fun=0.0, mip_dual_bound=0.0,
                                                 message="fixed by presolve")
        num_rows = len(self.lower_rhs)
        matrix = self.matrix()
        constraints = (scipy.optimize.LinearConstraint(matrix, np.array(self.lower_rhs), np.array(self.upper_rhs)),
                       ) if num_rows else ()
        return scipy.optimize.milp(
            np.concatenate(self.cost), integrality=None if relaxed else np.concatenate(self.integral),
            bounds=scipy.optimize.Bounds(0.0, np.concatenate(self.upper)), constraints=constraints,
            options={"time_limit": float(time_limit_s), "mip_rel_gap": MIP_REL_GAP, "disp": False})


class LpModel(highspy.Highs):
    """HiGHS holding ``b``'s LP but for the memory rows no solution has broken yet."""

    def __init__(self, rows: np.ndarray, pending: dict[int, tuple[np.ndarray, np.ndarray, float, float]]) -> None:
        super().__init__()
        self.rows = [int(r) for r in rows]  # the builder's row of each model row, in the model's order
        self.pending = pending  # builder row -> (columns, coefficients, lower, upper) of a row left out
        self.optimal = False  # whether a run reached an optimum of the rows it had (``run_highs``)

    def broken(self, x: np.ndarray, share: float = 1.0) -> list[int]:
        """The builder rows left out that ``x`` breaks, or (``share`` < 1) whose activity passes that share of its
        upper bound (a memory row's room: 1)."""
        out = []
        for row, (columns, coeffs, lower, upper) in self.pending.items():
            activity = float(coeffs @ x[columns])
            if activity > upper - (1.0 - share) * abs(upper) + ROW_TOL or activity < lower - ROW_TOL:
                out.append(row)
        return out

    def enforce(self, rows: Iterable[int]) -> None:
        """Add the builder's ``rows`` (left out so far) to the model (each basic in the basis it holds)."""
        rows = [r for r in rows if r in self.pending]
        if not rows:
            return
        parts = [self.pending.pop(r) for r in rows]
        starts = np.cumsum([0] + [len(c) for c, _, _, _ in parts[:-1]]).astype(np.int32)
        columns = np.concatenate([c for c, _, _, _ in parts]).astype(np.int32)
        coeffs = np.concatenate([v for _, v, _, _ in parts]).astype(float)
        lower = np.array([lo for _, _, lo, _ in parts], dtype=float)
        upper = np.array([hi for _, _, _, hi in parts], dtype=float)
        self.addRows(len(rows), np.where(np.isfinite(lower), lower, -highspy.kHighsInf),
                     np.where(np.isfinite(upper), upper, highspy.kHighsInf), len(columns), starts, columns, coeffs)
        self.rows.extend(rows)


def highs_lp(b: MipBuilder, upper: np.ndarray, dual: bool = False, cutoff: float = np.inf,
             enforce: Iterable[int] = ()) -> LpModel:
    """HiGHS (its own Python interface, ``highspy``) holding the LP relaxation with column bounds [0, upper], its
    memory rows (``MipBuilder.memory_rows``) left out, unless they nearly bind (``MipBuilder.memory``), but for
    ``enforce`` (module docstring); ``dual``: solved by the serial dual simplex without presolve (``lp.solve_lp``),
    else as HiGHS chooses; a finite ``cutoff`` (the LP's units) stops the dual simplex once its objective passes it
    (``objective_bound``: status 5, which ``lp.ColdStart`` checks against the true costs)."""
    matrix = b.matrix().tocsr()
    lo, hi = np.array(b.lower_rhs, dtype=float), np.array(b.upper_rhs, dtype=float)
    lazy = np.zeros(len(lo), dtype=bool)
    lazy[list(b.memory_rows)] = not b.memory.tight
    lazy[list(enforce)] = False
    kept = np.flatnonzero(~lazy)
    pending = {int(r): (matrix.indices[matrix.indptr[r]:matrix.indptr[r + 1]],
                        matrix.data[matrix.indptr[r]:matrix.indptr[r + 1]], lo[r], hi[r]) for r in np.flatnonzero(lazy)}
    columnwise = matrix[kept].tocsc()
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = b.num_cols, len(kept)
    lp.col_cost_ = np.concatenate(b.cost)
    lp.col_lower_ = np.zeros(b.num_cols)
    lp.col_upper_ = upper
    lp.row_lower_ = np.where(np.isfinite(lo[kept]), lo[kept], -highspy.kHighsInf)
    lp.row_upper_ = np.where(np.isfinite(hi[kept]), hi[kept], highspy.kHighsInf)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = columnwise.indptr
    lp.a_matrix_.index_ = columnwise.indices
    lp.a_matrix_.value_ = columnwise.data
    highs = LpModel(kept, pending)
    highs.setOptionValue("output_flag", False)
    highs.setOptionValue("solver", "simplex")
    if dual:  # the serial dual simplex (deterministic), without presolve, which takes longer than it here
        highs.setOptionValue("simplex_strategy", 1)
        highs.setOptionValue("presolve", "off")
        if np.isfinite(cutoff):
            highs.setOptionValue("objective_bound", float(cutoff))
    highs.passModel(lp)
    return highs


def run_highs(highs: LpModel, seconds: float) -> scipy.optimize.OptimizeResult:
    """Run (or continue, from the basis it holds) for at most ``seconds`` more, adding the memory rows an optimum
    breaks until one breaks none, solved again from a cold start when they break the model's first optimum (module
    docstring); the result as SciPy's ``linprog`` shapes it (status 0 optimal, 1 out of time, 2 infeasible, 4
    other; 5: the dual simplex passed its ``objective_bound``) with the reduced costs."""
    deadline = time.perf_counter() + max(seconds, 0.05)
    while True:
        first = not highs.optimal
        result = run_once(highs, deadline - time.perf_counter())
        if result.status != 0:
            return result
        highs.optimal = True
        broken = highs.broken(result.x)
        if not broken:
            return result
        highs.enforce(broken)
        if first:
            highs.clearSolver()
            highs.optimal = False
        if time.perf_counter() >= deadline:
            return scipy.optimize.OptimizeResult(status=1, x=None, fun=None, message="Time limit reached")


def run_once(highs: highspy.Highs, seconds: float) -> scipy.optimize.OptimizeResult:
    """One run of ``highs`` as it is, for at most ``seconds`` more (``run_highs`` without adding rows)."""
    highs.setOptionValue("time_limit", highs.getRunTime() + max(seconds, 0.05))  # HiGHS's limit is cumulative
    highs.run()
    status = highs.getModelStatus()
    if status == highspy.HighsModelStatus.kOptimal:
        solution = highs.getSolution()
        return scipy.optimize.OptimizeResult(status=0, x=np.asarray(solution.col_value),
                                             fun=highs.getInfo().objective_function_value,
                                             reduced=np.asarray(solution.col_dual), message="Optimal")
    code = {highspy.HighsModelStatus.kTimeLimit: 1, highspy.HighsModelStatus.kInfeasible: 2,
            highspy.HighsModelStatus.kObjectiveBound: 5}.get(status, 4)
    return scipy.optimize.OptimizeResult(status=code, x=None, fun=None, message=highs.modelStatusToString(status))


def row_duals(b: MipBuilder, highs: LpModel) -> np.ndarray | None:
    """The row duals ``highs`` holds, one per builder row (0 for a row left out: a valid multiplier for any row);
    None when it holds none."""
    solution = highs.getSolution()
    duals = np.asarray(solution.row_dual, dtype=float)
    if not solution.dual_valid or len(duals) != len(highs.rows):
        return None
    full = np.zeros(len(b.lower_rhs))
    full[highs.rows] = duals
    return full
