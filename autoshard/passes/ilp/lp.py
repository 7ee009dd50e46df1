"""The intra-op MIP's LP relaxation (its columns and rows: ``highs_model.MipBuilder``), solved by HiGHS through its
own interface.

``highspy`` keeps the model and its basis between solves, which SciPy's ``linprog`` does not: the LP
restricted to the pairs that pay no reshard is solved first, and the whole LP continues from its basis
(``solve_lp``). ``integral`` says whether a solution picks one strategy per node.
"""
from __future__ import annotations

import logging
import os
import threading
import time

import highspy
import numpy as np
import scipy.optimize
import scipy.sparse

from autoshard.passes.ilp.highs_model import TIGHT, LpModel, MipBuilder, highs_lp, row_duals, run_highs, run_once

log = logging.getLogger(__name__)

# the whole LP continues from the restricted basis alone for this share of the time limit (at least
# HEAD_START_S) before a cold start races it
HEAD_START_SHARE, HEAD_START_S = 0.1, 1.0
REDUCED_COST_TOL = 1e-3  # a left-out column prices out below this reduced cost (costs scaled as the MIP's)
# an LP with this many columns starts its cold dual simplex beside the restricted LP, not after the head start:
# such LPs take seconds (GPT blocks on a 2-D mesh: 60-150k), and the cold start is the faster on many of them
EARLY_COLD_COLUMNS = 50_000
# the cold start runs only when this much of a core is left free beside this thread (``spare_core``)
SPARE_CORE = 0.5


def _cpu_now() -> tuple[float, float, float] | None:
    """(wall seconds, CPU seconds the machine has been busy, this process's CPU seconds); None without
    ``/proc/stat`` (not Linux)."""
    try:
        with open("/proc/stat") as stat:
            ticks = [int(x) for x in stat.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    return time.perf_counter(), (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK"), time.process_time()


class _CoreMeter:
    """``spare_core``'s state: the last look at the machine and what it found."""

    WINDOW_S = 0.2  # a shorter span since the last look is not judged: the last answer stands

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.last = _cpu_now()
        self.free = True

    def spare(self) -> bool:
        try:
            usable = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            usable = os.cpu_count() or 1
        if usable < 2:
            return False
        with self.lock:
            now = _cpu_now()
            if now is None or self.last is None:  # unreadable, or the first readable look: judged from the next
                self.last = now
                return True
            wall = now[0] - self.last[0]
            if wall >= self.WINDOW_S:
                others = max(0.0, (now[1] - self.last[1]) - (now[2] - self.last[2])) / wall  # other processes
                free = (os.cpu_count() or usable) - others - 1.0  # this thread takes one core
                log.debug("mip: %.2f cores busy elsewhere over %.1fs, %.2f free for a second thread", others,
                          wall, free)
                self.free, self.last = free >= SPARE_CORE, now
            return self.free


_METER = _CoreMeter()


def spare_core() -> bool:
    """Whether a second HiGHS thread (``ColdStart``) would have a core to itself: the machine's busy CPU
    seconds since the last look (``/proc/stat``), less this process's own, leave ``SPARE_CORE`` of a core
    free beside this thread. Without one, the race costs what it saves: the two threads share a core, and
    the CPU the losing one spent is taken from whatever else runs (measured: five test modules that plan
    GPTs and MoEs, two at a time on two cores, 160 s with the race, 118 s without). Where the machine
    cannot be read: whenever this process may run on two cores or more."""
    return _METER.spare()


def plan_objective(b: MipBuilder, highs: highspy.Highs, plan: np.ndarray, seconds: float) -> float | None:
    """The LP's (scaled) objective with every free node's strategy fixed as in ``plan`` (``MipBuilder.one_hot``):
    the plan's own cost in the LP's units, the pairs, charges and shared reshards following from the
    strategies; None when that plan takes a forbidden pair or runs out of time. Continues from the basis
    ``highs`` holds (the LP's optimum), so it takes a fraction of the LP."""
    columns = b.strategy_columns()
    if not len(columns):
        return 0.0
    fixed = plan[columns]
    highs.changeColsBounds(len(columns), columns.astype(np.int32), fixed, fixed)
    priced = run_highs(highs, seconds)
    return float(priced.fun) if priced.status == 0 else None


def lagrangian_bound(b: MipBuilder, row_dual: np.ndarray, upper: np.ndarray) -> float:
    """A lower bound on the LP (so on every plan), in its scaled units, from any row multipliers ``row_dual``
    (HiGHS's sign: reduced costs are ``c - A^T y``): for x in [0, upper] with the rows in [lo, hi],
    ``c x = (c - A^T y) x + y A x >= sum_j min(0, d_j) upper_j + sum_i min over [lo_i, hi_i] of y_i r``.
    Multipliers of the wrong sign for a row's one-sided range are dropped first (their term would be
    -inf). Exact at an optimal basis's duals; on a dual simplex stopped by the time limit (its basis dual
    feasible) it is the dual objective reached so far, recomputed here with the true costs (HiGHS
    perturbs them while it iterates)."""
    lo, hi = np.array(b.lower_rhs, dtype=float), np.array(b.upper_rhs, dtype=float)
    y = np.where(((row_dual > 0) & ~np.isfinite(lo)) | ((row_dual < 0) & ~np.isfinite(hi)), 0.0, row_dual)
    reduced = np.concatenate(b.cost) - b.matrix().T @ y
    rows = np.where(y > 0, y * np.where(np.isfinite(lo), lo, 0.0), y * np.where(np.isfinite(hi), hi, 0.0))
    return float(np.minimum(reduced, 0.0) @ upper + rows.sum())


def stopped_bound(b: MipBuilder, highs: LpModel, upper: np.ndarray) -> float:
    """``lagrangian_bound`` at the row duals of a run ``highs`` stopped; -inf when it has none."""
    duals = row_duals(b, highs)
    return -np.inf if duals is None else lagrangian_bound(b, duals, upper)


def integral(b: MipBuilder, x: np.ndarray) -> bool:
    """Whether every free node's strategy variables in ``x`` are 0 or 1."""
    columns = b.strategy_columns()
    return bool(np.all(np.minimum(x[columns], 1.0 - x[columns]) <= 1e-6))


def _uncancelled(highs: highspy.Highs) -> highspy.Highs:
    """``highs`` with user interrupts off: a ``cancelSolve`` the race sent it as it finished (its rival's, or
    ``ColdStart.stop``'s) would otherwise stop every later run of it (a dive, a plan's pricing, a box of
    ``disjunction.py``) at once, status 4, for as long as the interrupts are handled."""
    highs.HandleUserInterrupt = False
    return highs


class ColdStart:
    """The whole LP by the serial dual simplex from a cold start (``highs_lp(b, upper, dual=True)``), built
    and solved in a thread of its own until ``deadline`` (``time.perf_counter()`` seconds): ``solve_lp``'s
    second start, raced against the continuation (``ColdStart.race``). HiGHS releases the GIL, so the two
    take the wall time of one; the first to finish cancels the other (``cancelSolve``, which HiGHS keeps until the
    model's next run, so a model is cancelled only while it runs or is about to). Given a finite ``cutoff``,
    it also finishes once its dual objective, recomputed with the true costs (``stopped_bound``), passes the
    cutoff: status 5, ``bound`` that objective (``solve_lp``: no plan beats the cutoff)."""

    def __init__(self, b: MipBuilder, upper: np.ndarray, deadline: float, cutoff: float = np.inf) -> None:
        self.model: highspy.Highs | None = None
        self.result: scipy.optimize.OptimizeResult | None = None
        self.finished = threading.Event()  # solved: optimal or infeasible
        self._lock = threading.Lock()
        self._rival: highspy.Highs | None = None  # the continuation while it races this
        self._stopped = False
        self._thread = threading.Thread(target=self._run, args=(b, upper, deadline, cutoff), daemon=True)
        self._thread.start()

    def _run(self, b: MipBuilder, upper: np.ndarray, deadline: float, cutoff: float) -> None:
        model = highs_lp(b, upper, dual=True, cutoff=cutoff)
        model.HandleUserInterrupt = True  # ``cancelSolve`` stops a run only with this set
        with self._lock:
            if self._stopped:
                return
            self.model = model
        result = run_highs(model, deadline - time.perf_counter())
        while result.status == 5:  # HiGHS's dual objective (perturbed costs) passed the cutoff: check it
            bound = stopped_bound(b, model, upper)
            if bound > cutoff:
                result.bound = bound
                break
            model.setOptionValue("objective_bound", np.inf)  # not with the true costs: solve on
            with self._lock:
                if self._stopped:
                    return
            result = run_highs(model, deadline - time.perf_counter())
        with self._lock:
            self.result = result
            if result.status in (0, 2, 5):
                self.finished.set()
                if self._rival is not None:
                    self._rival.cancelSolve()

    def race(self, highs: highspy.Highs, deadline: float) -> tuple[scipy.optimize.OptimizeResult, highspy.Highs]:
        """Continue ``highs`` in this thread until ``deadline`` or until the cold start finishes: the result
        and model of whichever finished first (the continuation's on a tie), else the continuation's
        time-out."""
        with self._lock:
            racing = not self.finished.is_set()
            if racing:
                highs.HandleUserInterrupt = True
                self._rival = highs
        result = None
        if racing:
            result = run_highs(highs, deadline - time.perf_counter())
            with self._lock:
                self._rival = None
            if result.status in (0, 2):
                self.stop()
                return result, _uncancelled(highs)
        self.stop()
        if self.finished.is_set() and self.result is not None and self.model is not None:
            log.debug("mip: the whole LP's cold start finished first")
            return self.result, _uncancelled(self.model)
        assert result is not None  # not racing only when the cold start had finished
        return result, _uncancelled(highs)

    def stop(self) -> None:
        """Cancel the solve if it still runs, and wait for its thread."""
        with self._lock:
            self._stopped = True
            if self.model is not None and self.result is None:
                self.model.cancelSolve()
        self._thread.join()


def solve_lp(b: MipBuilder, time_limit_s: float, cutoff: float = np.inf) -> scipy.optimize.OptimizeResult:
    """The LP relaxation, restricted first: without the priced pairs (``MipBuilder.restricted``: an edge's pairs
    that pay a reshard, a shared reshard's t and the y that need it), held at 0, the LP is a fifth of the
    size and its optimum, a plan in which every value is read as it was made where that pays, is often
    integral and sometimes optimal. When no left-out column has a negative reduced cost there, it is the
    whole LP's optimum; otherwise the left-out columns are opened and the simplex continues from the
    restricted optimum's basis, which is primal feasible for the whole LP (the opened columns sit at 0): on
    GPT-small's 95k columns the whole LP then takes 1.5 s where a cold start by HiGHS's default took 23 s,
    and GPT-medium's on 2x8-a100 1.6 s. On some LPs that continuation stalls (GPT-large at 12 and 24 layers
    on 1x8-a100: 19.8 and 15.3 s) where the serial dual simplex from a cold start, without HiGHS's presolve,
    takes 5.1 and 5.4 s, and on others the cold start is the slower (MoE-large on 2x8-a100: 16.3 against
    10.6 s): so after a head start alone (``HEAD_START_SHARE`` of the limit) the continuation is raced by a
    cold start in a second thread (``ColdStart.race``) when a core is free for it (``spare_core``; else the
    continuation runs on alone), and the first to finish is the LP's optimum; a small
    LP is done before the race starts (presolve cost more than it saved on every one of these LPs: 12-40 s).
    An LP of ``EARLY_COLD_COLUMNS`` or more starts its cold one beside the restricted LP, the continuation
    keeping its head start (the 24-layer GPT's LP, which the cold start wins, is solved 2 s sooner); where there
    are memory rows, the restricted LP is first solved without them (``_memory_probe``: whether every model may
    leave them out, ``highs_model``), and the cold start begins after it. Adding
    only the columns that price out (column generation) does not pay either: the duals of these degenerate
    LPs price thousands of columns in every round while the objective stays. Out of time, the restricted
    optimum is returned (status 1) when it is integral, with the bound the stopped dual simplex reached
    (``stopped_bound``) as its ``mip_dual_bound`` when the race ran; the stopped whole LP carries that bound
    too when the restricted optimum is not integral (the plan is then a caller's). An optimum carries its HiGHS
    model (``highs``), on which ``plan_objective`` prices a plan.

    Given a finite ``cutoff`` (the LP's units: a plan must cost less to matter), the solve stops as soon as a
    bound proves none does: the whole LP's optimum, the cold start's dual objective (``ColdStart``) or the
    bound a stopped dual simplex reached, above it (status 5, ``bound`` that bound; see ``cut_off``)."""
    if b.num_cols == 0:
        return cut_off(b.solve(time_limit_s, relaxed=True), cutoff)
    start = time.perf_counter()
    upper = np.concatenate(b.upper)
    left_out = b.restricted()
    probe = _memory_probe(b, np.where(left_out, 0.0, upper), time_limit_s)
    # a large LP takes seconds whichever way: its cold start runs from now on, beside the restricted LP
    cold = (ColdStart(b, upper, start + time_limit_s, cutoff)
            if left_out.any() and b.num_cols >= EARLY_COLD_COLUMNS and spare_core() else None)
    try:
        return cut_off(_restricted_then_whole(b, time_limit_s, start, upper, left_out, cold, cutoff, probe), cutoff)
    finally:
        if cold is not None:
            cold.stop()


def cut_off(result: scipy.optimize.OptimizeResult, cutoff: float) -> scipy.optimize.OptimizeResult:
    """``result``, or status 5 when it proves that no plan costs less than ``cutoff`` (ties are not cut: a plan
    that matches the cutoff may still be the one a caller prefers): an optimum above it (``solve_lp`` returns
    status 0 only for the whole LP's), or a stopped dual simplex's bound (``mip_dual_bound``) above it."""
    if result.status == 5 or not np.isfinite(cutoff):
        return result
    bound = result.fun if result.status == 0 and result.fun is not None else getattr(result, "mip_dual_bound", None)
    if bound is None or not bound > cutoff:
        return result
    return scipy.optimize.OptimizeResult(status=5, x=None, fun=None, bound=float(bound),
                                         message="Cut off: no plan costs less than the cutoff")


def _memory_probe(b: MipBuilder, upper: np.ndarray, time_limit_s: float) -> LpModel | None:
    """The restricted LP (column bounds ``upper``) without the memory rows, when ``b`` has some left out: its model,
    solved, when its optimum leaves every row far from binding (``TIGHT``: the solve's models go on leaving them out
    until broken, ``highs_model``); else None, with ``b.memory`` tight (every model holds every row, in this solve
    and in the later ones of the same LP)."""
    if not b.memory_rows or b.memory.tight:
        return None
    probe = highs_lp(b, upper)
    result = run_once(probe, time_limit_s)
    if result.status == 0 and probe.broken(result.x, TIGHT):
        log.debug("mip: the memory rows nearly bind at the restricted LP's optimum: every model holds them")
        b.memory.tight = True
        return None
    return probe


def _restricted_then_whole(b: MipBuilder, time_limit_s: float, start: float, upper: np.ndarray,
                           left_out: np.ndarray, cold: ColdStart | None, cutoff: float = np.inf,
                           probe: LpModel | None = None) -> scipy.optimize.OptimizeResult:
    """``solve_lp`` after its set-up: the restricted LP (``probe``'s, when it solved it), the continuation's head
    start, the race."""
    highs = probe if probe is not None else highs_lp(b, np.where(left_out, 0.0, upper))
    restricted = run_highs(highs, time_limit_s - (time.perf_counter() - start))  # (the probe took its share)
    if restricted.status == 0 and not left_out.any():
        restricted.highs = highs
    if not left_out.any() or restricted.status not in (0, 2):  # the whole LP already, or out of time
        if cold is not None and cold.finished.is_set() and cold.result is not None:
            cold.result.highs = cold.model  # the cold start solved the whole LP before the restricted one
            return cold.result
        return restricted
    incumbent = None
    opened = np.flatnonzero(left_out).astype(np.int32)
    highs.changeColsBounds(len(opened), opened, np.zeros(len(opened)), upper[opened])
    if restricted.status == 0:  # (infeasible restricted: a forbidden pair everywhere else; the whole LP decides)
        entering = int((left_out & (restricted.reduced < -REDUCED_COST_TOL)).sum())
        log.debug("mip: restricted LP %.2fs, %d of %d columns, %d price out", time.perf_counter() - start,
                  int((~left_out).sum()), b.num_cols, entering)
        if not entering:  # the whole LP's optimum already (its basis stays optimal with the columns opened)
            restricted.highs = highs
            return restricted
        incumbent = restricted if integral(b, restricted.x) else None
    left = time_limit_s - (time.perf_counter() - start)
    full = run_highs(highs, min(max(HEAD_START_S, HEAD_START_SHARE * time_limit_s), left))
    bound = -np.inf
    if full.status == 1 and time_limit_s - (time.perf_counter() - start) > 0:
        if cold is not None or spare_core():
            # not done from that basis: the dual simplex from a cold start races it for the time left
            cold = cold or ColdStart(b, upper, start + time_limit_s, cutoff)
            full, highs = cold.race(highs, start + time_limit_s)
            if full.status == 1 and cold.model is not None:  # neither finished: the dual simplex's basis, dual
                bound = stopped_bound(b, cold.model, upper)  # feasible, still bounds the LP (and cuts it off
                if np.isfinite(bound):  # when above the cutoff, ``cut_off``); a plan's gap is taken against it
                    full.mip_dual_bound = bound
        else:  # no core for a second thread: the continuation alone
            full = run_highs(highs, time_limit_s - (time.perf_counter() - start))
    if full.status == 0:
        full.highs = highs  # a fractional optimum prices its rounded plan on it (``plan_objective``)
    if full.status in (0, 2, 5) or incumbent is None:
        return full
    proof = ", its bound the stopped dual simplex's" if np.isfinite(bound) else ", without a proof"
    out = scipy.optimize.OptimizeResult(status=1, x=incumbent.x, fun=incumbent.fun,
                                        message="Time limit reached; the plan of the LP restricted to the pairs read "
                                                "as made" + proof)
    if np.isfinite(bound):
        out.mip_dual_bound = bound
    return out
