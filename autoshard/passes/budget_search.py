"""Keeping a plan within its memory budget: the ILP's budget is searched until the plan XLA would lay out fits.

The ILP bounds memory at a few liveness points with per-choice terms; resharded and layout copies depend
on pairs of choices and only the simulation of the decoded plan (``decode.memory_profile``) sees them. So
``BudgetSearch.plan_within`` solves, decodes, and when the simulated peak exceeds the budget, the plan's
resharded copies join the ILP's memory points (``passes/learned_memory.py``) and it solves again with the
ILP's budget lowered by the largest gap seen between a plan's simulated peak and the ILP's estimate of it,
copies included; once a plan fits, the ILP's budget is bisected between the highest at which the
plan fit and the lowest at which it did not, and the fastest plan that fit is kept (``MAX_MEMORY_ROUNDS``
solves in all). The rounds share the solver's time limit: each later one gets what the earlier ones left of
it, and at least ``ROUND_SHARE`` of it (``WARM_ROUND_SHARE`` for a round that starts from the basis of an
earlier round's optimum), so a budget that binds costs a few limits, not one per round (a toy
step under a tight budget took 7 solves of a 10 s limit each, every one of them out of time). If none fits,
the least-memory plans and the search's start are tried.
``BudgetSearch.smallest_budget`` finds, when nothing fits, a budget at which planning succeeds within
``BUDGET_PRECISION`` of the least one: the figure an ``InfeasibleMemoryError`` names.

One ``BudgetSearch`` serves one cost graph: it owns the search starts (computed once, budget-free) and
the budgets already probed. The plan that proved a named budget is remembered for the process, keyed by its
cost graph's terms (``remembered``): planning again at that budget, as the error says to, tries it when
no solve finds a plan that fits, so the promise does not rest on time-limited solves repeating themselves.
"""
from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from autoshard.errors import InfeasibleMemoryError, PlanningError, SolverTimeoutError
from autoshard.passes.cost_graph import CostGraph
from autoshard.passes.decode import decode
from autoshard.passes.ilp import IlpProblem, IlpSolution, evaluate, min_peak_plan, solve
from autoshard.passes.ilp.highs_model import MIP_REL_GAP
from autoshard.passes.ilp.solvers import starts_warm
from autoshard.passes.learned_memory import CopiesLearned
from autoshard.passes.lowering import build_problem, search_starts_of
from autoshard.passes.plan_result import IlpStats, IntraOpResult, PassClock
from autoshard.passes.search_starts import best_start
from autoshard.plans.ledger import fmt_bytes

__all__ = ["BUDGET_PRECISION", "BudgetSearch", "MAX_MEMORY_ROUNDS", "bounded", "followed"]

log = logging.getLogger(__name__)

MAX_MEMORY_ROUNDS = 8  # ILP solves per plan before the least-memory plans decide
MAX_BUDGET_CHECKS = 3  # replans at the budget an InfeasibleMemoryError is about to name
MAX_BUDGET_PROBES = 5  # bisection steps towards the least budget it names
BUDGET_PRECISION = 1.08  # stop when the bracket [fails, succeeds] is this tight
ROUND_SHARE = 0.2  # the least share of the time limit a round of plan_within gets once the limit is spent
# ... and a round whose LP starts from the basis of an earlier round's optimum (ilp/warm.py): such a start
# takes a few thousand simplex iterations where a cold one takes tens of thousands (gpt-xl@8 on 2x8-a100:
# 1,300 against 24,000; 2.1 s, where the fifth of the limit left it 1 s of the kept basis and 1 s of cold
# path, and the round stopped at a 41% gap)
WARM_ROUND_SHARE = 0.5
REMEMBERED_GRAPHS = 32  # cost graphs whose budget-proving plans the process keeps (least recently used go)

# cost graph fingerprint -> class choices of the plans that proved the budgets InfeasibleMemoryErrors named
_PROVEN: OrderedDict[str, list[np.ndarray]] = OrderedDict()


@dataclass
class BudgetSearch:
    cg: CostGraph
    start_s: float = field(default_factory=time.perf_counter)  # when planning began (the ILP build time)
    starts: tuple[np.ndarray, ...] | None = None  # the search starts, once
    probes: dict[tuple[float, float], float] = field(default_factory=dict)  # smallest budgets already found
    clock: PassClock = field(default_factory=PassClock)  # seconds per pass (build, solve, decode, memory)
    learned: CopiesLearned | None = None  # resharded copies of plans over budget, in later rounds' memory points

    def __post_init__(self) -> None:
        if self.learned is None:
            self.learned = CopiesLearned(self.cg)

    def search_starts(self) -> tuple[np.ndarray, ...]:
        """The search starts of this cost graph, computed on the first call."""
        if self.starts is None:
            self.starts = search_starts_of(self.cg)
        return self.starts

    def problem(self, budget: float, hinted: bool = True) -> IlpProblem:
        """The ILP at ``budget``, hinted with the best search start that fits it; without a hint, and no start
        computed, when ``hinted`` is false."""
        with self.clock.timing("build"):
            return build_problem(self.cg, budget, self.search_starts() if hinted else None, hinted=hinted,
                                 points=self.learned.points())

    def hint_at(self, budget: float) -> np.ndarray:
        """The best search start that fits ``budget``."""
        return best_start(self.cg, self.cg.terms, self.search_starts(), budget, self.learned.points())

    def solve(self, problem: IlpProblem, later_hint: Callable[[], np.ndarray] | None = None) -> IlpSolution:
        with self.clock.timing("solve"):
            return solve(problem, later_hint)

    def plan_within(self, budget: float,
                    cutoff_s: float | None = None) -> tuple[IntraOpResult | None, list[float], float]:
        """The plan within ``budget`` (module docstring), or None; the simulated peaks of every plan
        decoded on the way; the ILP's floor (its least memory of any plan; 0 when not computed). With
        ``cutoff_s`` the solve at the budget raises ``CutOffError`` when it proves no plan costs less: no plan
        that fits does either (those the search finds below the budget are among them). With HiGHS the first
        solve's hint, the search starts, is made only once the LP has neither cut it off nor proven its plan
        optimal (HiGHS reads the hint after the LP): most solves are proven, and on small programs the starts'
        greedy descents were a third of the pass (MLP tiny 0.29 -> 0.19 s)."""
        lazy = self.starts is None and self.cg.options.solver == "mip"
        problem = self.problem(budget, hinted=not lazy)
        later_hint = (lambda: self.hint_at(budget)) if lazy else None  # (its seconds count as the solve's)
        if cutoff_s is not None:
            problem = replace(problem, cutoff_s=cutoff_s)
        build_s = time.perf_counter() - self.start_s
        margin = 0.0
        seen: list[float] = []
        fitting: list[IntraOpResult] = []
        fits_at, fails_at = None, budget  # ILP budgets: the highest whose plan fit, the lowest whose did not
        ilp_budget = budget
        # no plan that fits is faster: the ILP's bound at the budget itself, in ILP seconds, while it has learned no
        # copies (a learned copy may be counted for a plan that does not make it, so that ILP's bound is no proof)
        bound = -np.inf
        limit, solving = problem.time_limit_s, time.perf_counter()
        for _ in range(MAX_MEMORY_ROUNDS):
            try:
                solution = self.solve(problem, later_hint)
            except (InfeasibleMemoryError, SolverTimeoutError):
                solution = None  # the (tightened) ILP has no plan, or none was found within the time limit
            later_hint = None  # (the problems of later rounds are built with their hints)
            if solution is not None and ilp_budget >= budget and not self.learned.bytes_at:
                bound = solution.objective_s * (1.0 - solution.gap) if np.isfinite(solution.gap) else -np.inf
            if solution is not None:
                result = self.decoded(problem, solution, build_s)
                if fits(result.peak_bytes, budget):
                    if ilp_budget >= budget:
                        return result, seen, 0.0
                    fitting.append(result)
                    fits_at = ilp_budget
                else:
                    seen.append(result.peak_bytes)
                    fails_at = ilp_budget
                    # its resharded copies join the memory points (passes/learned_memory.py), so the budget is
                    # lowered only by what the ILP still does not count of this plan
                    if self.learned.learn(result):
                        problem = replace(problem, memory_points=self.learned.points())
                    estimate = max(evaluate(problem, solution.choices).memory_bytes, default=0.0)
                    margin = max(margin, result.peak_bytes - estimate)
                    log.info("intra-op on %s: the plan peaks at %s, over the budget %s (the ILP saw %s)",
                             self.cg.mesh, fmt_bytes(result.peak_bytes), fmt_bytes(budget), fmt_bytes(estimate))
            elif fits_at is None:
                break  # nothing below here: the least-memory plans decide
            if fits_at is None:
                ilp_budget = fails_at - margin
            elif fails_at <= fits_at * BUDGET_PRECISION ** 0.5:
                break
            else:
                ilp_budget = (fits_at * fails_at) ** 0.5
            if ilp_budget <= 0:
                break
            problem = self.problem(ilp_budget)  # no cutoff: the bound at the budget decided that
            left = limit - (time.perf_counter() - solving)
            with self.clock.timing("build", new_run=False):  # the LP it builds is the solve's (ilp/kept_lp.py)
                share = WARM_ROUND_SHARE if starts_warm(problem) else ROUND_SHARE
            problem = replace(problem, time_limit_s=max(left, share * limit))
        if fitting:
            return bounded(min(fitting, key=lambda r: r.step_s), bound), seen, 0.0
        problem = replace(problem, time_limit_s=limit)  # (the least memory needs its solves: the whole limit)
        floor, results = self.least_memory(problem, build_s, self.hint_at(budget), remembered(self.cg))
        fitting = [r for r in results if fits(r.peak_bytes, budget)]
        if fitting:
            return bounded(min(fitting, key=lambda r: r.step_s), bound), seen, floor
        return None, seen + [r.peak_bytes for r in results], floor

    def smallest_budget(self, candidate: float, floor: float) -> float:
        """A budget at which planning succeeds, within ~``BUDGET_PRECISION`` of the least one: geometric
        bisection between the ILP's own floor (no plan needs less by its count) and ``candidate`` (a plan
        that peaks there was seen), each probe a full plan; the lowest budget a probe succeeded at."""
        key = (candidate, floor)
        if key in self.probes:
            return self.probes[key]
        hi: float | None = None
        found: IntraOpResult | None = None
        for _ in range(MAX_BUDGET_CHECKS):  # first make sure planning at the candidate succeeds
            found, seen, _floor = self.plan_within(candidate)
            if found is not None:
                hi = candidate
                break
            candidate = min(seen)
        if hi is None or found is None:
            self.probes[key] = candidate
            return candidate
        lo, peak, proof = min(floor, hi), found.peak_bytes, found
        for _ in range(MAX_BUDGET_PROBES):
            if hi <= lo * BUDGET_PRECISION:
                break
            mid = (lo * hi) ** 0.5
            found, _seen, _floor = self.plan_within(mid)
            if found is not None:
                hi, peak, proof = mid, found.peak_bytes, found
            else:
                lo = mid
        while peak < hi / BUDGET_PRECISION ** 0.5:  # the plan found needs less than its budget: try its own peak
            found, _seen, _floor = self.plan_within(peak)
            if found is None:
                break
            hi, peak, proof = peak, found.peak_bytes, found
        remember(self.cg, proof)
        self.probes[key] = hi
        return hi

    def decoded(self, problem: IlpProblem, solution: IlpSolution, build_s: float) -> IntraOpResult:
        cg = self.cg
        solution = followed(cg, problem, solution)
        check = evaluate(problem, solution.choices)
        if check.violations:
            raise PlanningError("the ILP solution violates its own constraints: " + "; ".join(check.violations))
        stats = IlpStats(
            num_nodes=len(cg.strategies), num_classes=cg.classes.num_classes, num_followers=cg.classes.num_followers,
            num_tied=cg.classes.num_tied, num_variables=solution.num_variables,
            num_constraints=solution.num_constraints, num_edges=len(problem.edges), status=solution.status,
            gap=solution.gap, solve_s=solution.solve_s, build_s=build_s, objective_s=check.objective_s,
        )
        log.info("intra-op on %s: %d nodes -> %d classes, %d edges; %s in %.2fs (build %.2fs)", cg.mesh,
                 stats.num_nodes, stats.num_classes, stats.num_edges, stats.status, stats.solve_s, build_s)
        return decode(cg, solution.choices, stats, self.clock)

    def least_memory(self, problem: IlpProblem, build_s: float, start_plan: np.ndarray | None,
                     proven: Sequence[np.ndarray] = ()) -> tuple[float, list[IntraOpResult]]:
        """The ILP's floor (least memory of any plan by its count) and, decoded, the fastest plan among
        those of least ILP memory, the least-memory plan itself, the search's start (``start_plan``: a
        fitting baseline when ``compare`` hints with one) and the plans that proved named budgets
        (``proven``, status "start": starts the search was given by its earlier runs)."""
        start = time.perf_counter()
        with self.clock.timing("solve"):
            floor, choices = min_peak_plan(problem)
        fill = replace(problem, memory_budget_bytes=floor, hint=None)
        candidates = [IlpSolution(choices, evaluate(problem, choices).objective_s, "least-memory", 0.0,
                                  time.perf_counter() - start, 0, 0)]
        unbounded = replace(problem, memory_budget_bytes=None)
        for plan in ([] if start_plan is None else [start_plan]) + list(proven):
            if len(plan) == problem.num_nodes and not evaluate(unbounded, plan).violations:
                candidates.append(IlpSolution(np.asarray(plan), evaluate(problem, plan).objective_s,
                                              "start", 0.0, 0.0, 0, 0))
        try:
            candidates.insert(0, self.solve(fill))
        except PlanningError:
            pass
        return floor, [self.decoded(unbounded, s, build_s) for s in candidates]


def fingerprint(cg: CostGraph) -> str:
    """A digest of the cost graph's mesh and ILP terms: two traces of one step on one mesh share it."""
    digest = hashlib.sha1(repr(cg.mesh).encode())
    terms = cg.terms
    arrays = [*terms.class_cost, *(m for _, _, m in terms.edges), *(g.costs for g in terms.reshards),
              *(a for point in terms.points for _, a in point)]
    digest.update(repr([(u, v) for u, v, _ in terms.edges]).encode())
    for array in arrays:
        array = np.asarray(array)
        digest.update(repr((array.shape, array.dtype.str)).encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def remember(cg: CostGraph, proof: IntraOpResult) -> None:
    """Keep the class choices of ``proof``, the plan behind a budget an error is about to name."""
    if proof.class_choices is None:
        return
    key = fingerprint(cg)
    plans = _PROVEN.setdefault(key, [])
    if not any(np.array_equal(p, proof.class_choices) for p in plans):
        plans.append(np.array(proof.class_choices))
    _PROVEN.move_to_end(key)
    while len(_PROVEN) > REMEMBERED_GRAPHS:
        _PROVEN.popitem(last=False)


def remembered(cg: CostGraph) -> list[np.ndarray]:
    """The plans that proved the budgets named for this cost graph in this process (``remember``)."""
    if not _PROVEN:
        return []
    return list(_PROVEN.get(fingerprint(cg), ()))


def followed(cg: CostGraph, problem: IlpProblem, solution: IlpSolution) -> IlpSolution:
    """``solution`` with the classes that never run on the layouts their neighbours read and write
    (``CostGraph.follow_unpriced``), where that keeps the problem's constraints; else ``solution``."""
    choices = cg.follow_unpriced(solution.choices)
    if np.array_equal(choices, solution.choices):
        return solution
    check = evaluate(problem, choices)
    before = evaluate(problem, solution.choices).objective_s
    if check.violations or check.objective_s > before * (1 + 1e-12) + 1e-15:
        return solution
    return replace(solution, choices=choices)


def bounded(result: IntraOpResult, bound_s: float) -> IntraOpResult:
    """A plan the search found below the budget itself (the ILP's budget lowered, or a least-memory plan),
    with its gap against ``bound_s``, the bound of the solve at the budget itself: the ILP counts no
    resharded copies, so every plan whose simulated peak fits also fits its rows there, and that bound holds
    for all of them; a lowered budget's own bound does not (it leaves such plans out). Proven (gap 0) only
    when the plan reaches that bound."""
    stats = result.ilp
    objective = stats.objective_s
    if np.isfinite(bound_s) and np.isfinite(objective) and objective > 0:
        gap = max(0.0, objective - bound_s) / objective
    else:
        gap = float("inf")
    proven = gap <= MIP_REL_GAP
    status = "optimal" if proven else (stats.status if stats.status in ("least-memory", "start")
                                       else "feasible (memory budget lowered)")
    return replace(result, ilp=replace(stats, status=status, gap=0.0 if proven else gap))


def fits(peak_bytes: float, budget_bytes: float) -> bool:
    return peak_bytes <= budget_bytes * (1 + 1e-9)
