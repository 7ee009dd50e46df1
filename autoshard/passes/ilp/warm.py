"""The LP relaxation solved again from the basis of the last optimum of the same LP, memory rows aside.

The budget search (``passes/budget_search.py``) solves one cost graph's ILP round after round with only its
memory rows (e) changed: the ILP's budget lowered or bisected, a plan's resharded copies learned into its
points; ``smallest_budget`` probes budgets the same way, the search for the next-best plans
(``disjunction.CutSearch``) solves the best plan's LP without its cut rows, and planning a program again
solves its LP again. Every such LP has the same columns and the same other rows, so the simplex basis of
the last optimum is a near-optimal start: the round after gpt-xl@8's first plan peaked over its budget on
2x8-a100 (87k columns) took 1,300 simplex iterations from it against 24,000 for the dual simplex from a cold
start (3.1 against 8.8 s on a loaded machine), where the round, restricted LP first, had run out of the time
it was left.

``WarmStart.of(builder)`` names the LP by everything but its memory rows (a hash of its costs, bounds and
rows), taken before the memory rows are added; each memory row is matched to the last basis's by its memory
point (``MipBuilder.memory_points``), a new point's row starts basic, and a basis whose count no longer
matches the rows (a binding row dropped) is not used. The model holds every memory row from the start (``highs_model``
leaves them out of a cold one until a solution breaks one; a row out of the kept model's counts as basic).
The warm run has ``WARM_SHARE`` of the limit; when it proves neither an optimum nor that no plan fits,
``lp.solve_lp`` solves as from cold with the time left.
Bases are kept per process for the ``KEPT_BASES`` LPs last solved to optimality.
"""
from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import highspy
import numpy as np
import scipy.optimize

from autoshard.passes.ilp.highs_model import LpModel, MipBuilder, highs_lp, run_highs
from autoshard.passes.ilp.lp import cut_off, solve_lp

__all__ = ["KEPT_BASES", "WARM_SHARE", "WarmStart", "clear"]

log = logging.getLogger(__name__)

KEPT_BASES = 16  # LPs whose last optimal basis the process keeps (least recently used go)
WARM_SHARE = 0.5  # the share of the time limit the run from a kept basis may take before the cold path

_BASIC = int(highspy.HighsBasisStatus.kBasic)
_STATUS = {int(s): s for s in highspy.HighsBasisStatus.__members__.values()}


@dataclass(frozen=True)
class _Basis:
    cols: np.ndarray  # int8 HighsBasisStatus per column
    rows: np.ndarray  # the same per row other than a memory row, then per memory row
    points: tuple[int, ...]  # the memory point of each memory row


_KEPT: OrderedDict[str, _Basis] = OrderedDict()
_LOCK = threading.Lock()


def clear() -> None:
    """Forget every kept basis: the next solve of each LP starts cold."""
    with _LOCK:
        _KEPT.clear()


def _statuses(values: list) -> np.ndarray:
    return np.fromiter((int(s) for s in values), dtype=np.int8, count=len(values))


def _basis(highs: LpModel, cols: np.ndarray, rows: np.ndarray) -> highspy.HighsBasis:
    """A basis of ``highs`` from a status per column and per builder row (the model's rows picked)."""
    basis = highspy.HighsBasis()
    basis.col_status = [_STATUS[int(s)] for s in cols]
    basis.row_status = [_STATUS[int(rows[r])] for r in highs.rows]
    basis.valid = True
    return basis


@dataclass(frozen=True)
class WarmStart:
    """One LP's name apart from its memory rows (``key``) and how many rows come before them."""

    key: str
    fixed_rows: int

    @classmethod
    def of(cls, b: MipBuilder) -> WarmStart:
        """Taken once every row but the memory rows is in ``b`` (and before any of them)."""
        digest = hashlib.blake2b(digest_size=16)
        for part in (b.first, *b.cost, *b.upper, *b.rows, *b.cols, *b.vals):
            digest.update(np.ascontiguousarray(part).tobytes())
        digest.update(np.array(b.lower_rhs + b.upper_rhs, dtype=float).tobytes())
        return cls(f"{b.num_cols}:{len(b.lower_rhs)}:{digest.hexdigest()}", len(b.lower_rhs))

    def kept(self) -> bool:
        """Whether a basis of this LP is kept: its next solve starts from it."""
        with _LOCK:
            return self.key in _KEPT

    def solve_lp(self, b: MipBuilder, time_limit_s: float, cutoff: float,
                 cold: Callable[..., scipy.optimize.OptimizeResult] = solve_lp) -> scipy.optimize.OptimizeResult:
        """``cold`` (``lp.solve_lp``), first from the kept basis of this LP when there is one, with the time that
        leaves; the basis of an optimum either way is kept."""
        start = time.perf_counter()
        kept = self.statuses(b)
        if kept is not None:
            cols, rows = kept
            # every memory row in from the start: the basis was an optimum with them, and left out, the rows it
            # held at a bound would be broken at once (gpt-xl@8's round after its plan peaked over the budget)
            highs = highs_lp(b, np.concatenate(b.upper), enforce=b.memory_rows)
            if highs.setBasis(_basis(highs, cols, rows)) == highspy.HighsStatus.kOk:
                result = run_highs(highs, WARM_SHARE * time_limit_s)
                log.debug("mip: from the kept basis %.2fs, %d iterations: %s", time.perf_counter() - start,
                          highs.getInfo().simplex_iteration_count, result.message)
                if result.status == 0:
                    result.highs = highs
                    self.keep(b, highs)
                if result.status in (0, 2):  # an optimum, or no plan fits the memory rows from any start
                    return cut_off(result, cutoff)
        result = cold(b, max(time_limit_s - (time.perf_counter() - start), 0.1), cutoff)
        if result.status == 0 and getattr(result, "highs", None) is not None:
            self.keep(b, result.highs)
        return result

    def statuses(self, b: MipBuilder) -> tuple[np.ndarray, np.ndarray] | None:
        """The kept basis's status of each column and each of ``b``'s rows, or None (none kept, or its count no
        longer fits)."""
        with _LOCK:
            kept = _KEPT.get(self.key)
            if kept is not None:
                _KEPT.move_to_end(self.key)
        if kept is None:
            return None
        rows = np.full(len(b.lower_rhs), _BASIC, dtype=np.int8)  # a row not matched starts basic
        rows[:self.fixed_rows] = kept.rows[:self.fixed_rows]
        where = {p: self.fixed_rows + k for k, p in enumerate(kept.points)}
        for k, p in enumerate(b.memory_points):
            if p in where:
                rows[self.fixed_rows + k] = kept.rows[where[p]]
        if int((kept.cols == _BASIC).sum() + (rows == _BASIC).sum()) != len(rows):
            return None  # a row the kept basis held at a bound is gone: not a basis of this LP
        return kept.cols, rows

    def keep(self, b: MipBuilder, highs: LpModel) -> None:
        """Keep the basis ``highs`` holds (an optimum of ``b``'s LP) for this LP's next solve: a row the model
        leaves out is basic."""
        basis = highs.getBasis()
        if not basis.valid:
            return
        rows = np.full(len(b.lower_rhs), _BASIC, dtype=np.int8)
        rows[highs.rows] = _statuses(basis.row_status)
        rows = rows[:self.fixed_rows + len(b.memory_points)]
        with _LOCK:
            _KEPT[self.key] = _Basis(_statuses(basis.col_status), rows, tuple(b.memory_points))
            _KEPT.move_to_end(self.key)
            while len(_KEPT) > KEPT_BASES:
                _KEPT.popitem(last=False)
