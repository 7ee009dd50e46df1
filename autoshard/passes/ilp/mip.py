"""The intra-op ILP as a mixed-integer program solved by HiGHS: the default backend (the LP relaxation through
HiGHS's own interface, ``highspy``, which keeps a basis between solves; the MIP through SciPy).

The same formulation as ``passes/ilp/cpsat.py`` (whose docstring has the legend), built as one sparse
matrix, with continuous y (integral whenever s is) and the costs in floating point instead of ticks:

    (a) one_hot   sum_a s[i,a] = 1                                      every free node i
    (b)           s[i,a] has upper bound 0 where c[i,a] = inf
    (c) rows      sum_B y[e,A,B] - sum_{a in A} s[u,a] = 0               every e, row group A
    (d) cols      sum_A y[e,A,B] - sum_{b in B} s[v,b] = 0               every e, column group B
    (e) memory    sum_{i,a} (m[p,i,a] / room[p]) s[i,a] <= 1             every point p that can bind
    (g) charge    sum_{a in members(k, i)} s[i,a] - z[k] <= 0            every member node i of charge k
    (h) joint     sum_l y[k,r,A,l] - sum_{a in A} s[P,a] = 0               every shared reshard k, reader r, group A
    (i)           sum_A y[k,r,A,l] - sum_{b : L[k,r,b] = l} s[r,b] = 0      every k, r, layout l (or "none priced")
    (j) made      y[k,r,A,l] - t[k,A,l] <= 0                               P the producer of k, A its price groups
    (k) exclude   sum_{i in F_c} sum_{a in X[c,i]} s[i,a] <= |F_c| - 1      every no-good cut c (``excluded``):
                  X[c,i] its marked strategies of node i, F_c the free nodes with marked and unmarked ones
                  (rows only when the LP without them has no optimum in time: ``disjunction.py`` branches
                  on the cuts instead, over that LP, as the LP spreads a cut row over every node it names)

    minimize  q (sum c[i,a] s[i,a] + sum R[e,A,B] y[e,A,B] + sum g[k] z[k] + sum G[k,a,l] t[k,a,l])

A shared reshard (``problem.SharedReshard``: a value read by several nodes, each distinct layout made
once) has t[k,A,l] in [0, 1], paid G[k,A,l], for each group A of the producer's strategies with equal
prices and each priced layout l, and per reader r the joint y[k,r,A,l] of the producer's group and the
layout r reads, marginalised on both sides as an edge is: t is at least every reader's y, so a layout
is paid once however many read it, and with one reader the rows are that edge's own. (A weaker model,
w[k,l] >= each reader's choice of l and t[k,a,l] <= s[P,a], left the LP relaxation fractional on 295
of 337 nodes of a 2-layer GPT, its bound useless; this one is integral there.) A fixed producer prices
w[k,l] >= each reader's choice of l directly; a fixed reader bounds t[k,A,l] by s[P,A].

with q = 1e6 / (the largest finite reduced cost), so the costs are well scaled for HiGHS's tolerances, and
each memory row divided by its room, so its coefficients lie in [0, 1]. (g) is aggregated per member
node: with (a), at most one of its strategies is taken, so the row is exact and tighter than one row per
choice. The min-peak model adds a continuous peak P, rows K[p] + sum m s <= P, and (f) of the CP-SAT
model for forbidden pairs (it has no y), and minimizes P.

Why a MIP solver: (c)-(d) is the local marginal polytope, whose LP relaxation is nearly always integral on
these problems (the LP optimum equalled the integer one on GPT-medium, GPT-large and MoE-large on
2x8-a100): the LP relaxation is solved first and, when integral, is the optimum with its proof; only a
fractional one goes to HiGHS's MIP (whose presolve and cuts cost more than the LP on these problems).
The memory rows (e) are part of that LP (GPT-large's on 2x8-a100 leave it integral; its HiGHS model adds each once a
solution breaks it, ``highs_model.py``), where HiGHS's MIP, given the problem first, stopped at 38-50% gaps after 10
s, CP-SAT at 37-59%. The LP is large (about 100k columns for a GPT block on a 2-D mesh) and takes 5-50 s from a cold
start. So the LP restricted to the pairs that pay no reshard (an edge's free pairs; a shared value read only in
layouts free to make) is solved first (``passes/ilp/lp.py``): a fifth of the columns, about a second, its optimum
nearly always integral and close to the whole LP's. The whole LP then continues from that basis (1.5 s instead of 23
s on GPT-small), raced by a cold dual simplex (``lp.solve_lp``); the restricted optimum is the plan when the time
limit ends first. HiGHS through SciPy takes no MIP start; the hint (the best classic start after local search) is
returned whenever HiGHS's plan is not better.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import highspy
import numpy as np
import scipy.optimize
import scipy.sparse

from autoshard.errors import CutOffError, PlanningError, SolverTimeoutError
from autoshard.passes.ilp.disjunction import KEPT_SEARCH, CutSearch
from autoshard.passes.ilp.kept_lp import Built, kept_lp, presolved
from autoshard.passes.ilp.highs_model import MIP_REL_GAP, MipBuilder, run_highs
from autoshard.passes.ilp.lp import integral, plan_objective, solve_lp
from autoshard.passes.ilp.presolve import Reduced, exclusion_cuts, identical_lines
from autoshard.passes.ilp.problem import IlpProblem, IlpSolution, evaluate, memory_error
from autoshard.passes.ilp.warm import WarmStart

__all__ = ["build_lp", "dive", "min_peak_plan_mip", "solve_mip"]

log = logging.getLogger(__name__)

_LARGEST_COST = 1e6  # the largest finite reduced cost after scaling
_MIP_SHARE = 0.3  # a fractional LP goes on to the MIP when this share of the time limit is left
_PRICE_S = 1.0  # at least this long to price a fractional LP's rounding (a warm start: well under it)
_DIVE_GAP = 0.01  # a dive this close to the LP's bound leaves the MIP only _POLISH_SHARE of the limit
_POLISH_SHARE = 0.2  # the MIP's share of the limit after such a dive: to prove it or find a better plan
_DIVE_S = 0.25  # at least this long to dive from a fractional LP to a plan (dive: warm starts, often 0.1 s)


def _new(problem: IlpProblem, red: Reduced, ticks: float) -> MipBuilder:
    """Columns s and rows (a), (b) for every free node."""
    b = MipBuilder(red, np.full(problem.num_nodes, -1, dtype=np.int64))
    free = [i for i, allowed in enumerate(red.allowed) if len(allowed) > 1]
    for i in free:
        cost = red.node_cost[i]
        finite = np.isfinite(cost)
        b.first[i] = b.add_cols(np.where(finite, cost, 0.0) * ticks, finite.astype(float), True)
    if free:  # (a): the free nodes' columns are consecutive, row k is the k-th free node's
        sizes = np.array([len(red.allowed[i]) for i in free])
        b.add_rows(len(free), np.repeat(np.arange(len(free)), sizes), b.first[free[0]] + np.arange(sizes.sum()),
                   np.ones(int(sizes.sum())), 1.0, 1.0)
    return b


def _add_edges(b: MipBuilder, ticks: float) -> list[tuple[int, int, np.ndarray, np.ndarray, np.ndarray]]:
    """Columns y and rows (c), (d); per edge (u, v, row group, column group, y columns [A, B] or -1)."""
    out = []
    for u, v, matrix in b.red.edges:
        (rows, first_row), (cols, first_col) = identical_lines(matrix), identical_lines(matrix.T)
        grouped = matrix[np.ix_(first_row, first_col)]
        allowed = np.isfinite(grouped)
        y = np.full(grouped.shape, -1, dtype=np.int64)
        y[allowed] = b.add_cols(grouped[allowed] * ticks, np.ones(int(allowed.sum())), False,
                                lazy=grouped[allowed] > 0) + np.arange(int(allowed.sum()))
        for group, lines, node in ((rows, y, u), (cols, y.T, v)):
            _add_marginals(b, lines, node, group)
        out.append((u, v, rows, cols, y))
    return out


def _add_marginals(b: MipBuilder, lines: np.ndarray, node: int, group: np.ndarray) -> None:
    """Row g per line g of ``lines`` (pair columns, -1 where there is none): its pairs sum to the strategies
    of ``node`` in ``group`` g (``sum_B y[A,B] - sum_{a in A} s[node,a] = 0``)."""
    at = np.nonzero(lines >= 0)
    row = np.concatenate([at[0], group])
    columns = np.concatenate([lines[at], b.s(node, np.arange(len(group)))])
    coeffs = np.concatenate([np.ones(len(at[0])), -np.ones(len(group))])
    b.add_rows(lines.shape[0], row, columns, coeffs, 0.0, 0.0)


def _add_charges(b: MipBuilder, ticks: float) -> None:
    for cost, members in b.red.charges:
        z = b.add_cols(np.array([cost * ticks]), np.ones(1), False)
        for node, mask in members:
            if b.first[node] >= 0:
                ss = b.s(node, np.flatnonzero(mask))
                b.add_row(np.append(ss, z), np.append(np.ones(len(ss)), -1.0), -np.inf, 0.0)


def _add_reshards(b: MipBuilder, ticks: float) -> None:
    """Rows (h)-(j) of the shared reshards (module docstring). With the producer free, each reader r has its
    joint y[r,A,l] with the producer (A a group of the producer's strategies with equal prices, l a priced
    layout or "none of them"), marginalised on both sides as an edge is, and t[A,l] >= y[r,A,l] for every
    reader: layout l made from A once, however many read it. With one reader this is the edge's own
    marginal polytope, so the LP bound is as tight as without the sharing."""
    for producer, costs, readers in b.red.reshards:
        paid = np.flatnonzero(costs.max(axis=0) > 0)
        if not len(paid):
            continue
        if b.first[producer] < 0:
            _add_reshard_fixed_producer(b, ticks, costs[0], paid, readers)
            continue
        group, first_rows = identical_lines(costs[:, paid])
        prices = costs[np.ix_(first_rows, paid)]  # [A, paid layouts]
        sources = [b.s(producer, np.flatnonzero(group == a)) for a in range(len(first_rows))]
        slot = np.full(int(costs.shape[1]), -1, dtype=np.int64)  # layout -> its position in paid
        slot[paid] = np.arange(len(paid))
        t = np.full(prices.shape, -1, dtype=np.int64)
        priced = prices > 0
        t[priced] = b.add_cols(prices[priced] * ticks, np.ones(int(priced.sum())), False,
                               lazy=np.ones(int(priced.sum()), dtype=bool)) + np.arange(int(priced.sum()))
        for node, layout in readers:
            read = np.where(layout >= 0, slot[np.maximum(layout, 0)], -1)  # per strategy: its paid layout or -1
            if not (read >= 0).any():
                continue
            if b.first[node] < 0:  # a fixed reader: t[A, its layout] >= s[P, A]
                j = int(read[0])
                for a in np.flatnonzero(t[:, j] >= 0):
                    b.add_row(np.append(sources[a], t[a, j]), np.append(np.ones(len(sources[a])), -1.0),
                              -np.inf, 0.0)
                continue
            targets = np.unique(read[read >= 0])  # the paid layouts it can read, each a group of strategies;
            in_group = np.searchsorted(targets, np.maximum(read, 0))  # the rest ("none of them") the last group
            in_group = np.where(read >= 0, in_group, len(targets))
            num_groups = len(targets) + int((read < 0).any())
            y = b.add_cols(np.zeros(len(sources) * num_groups), np.ones(len(sources) * num_groups), False) + \
                np.arange(len(sources) * num_groups).reshape(len(sources), num_groups)
            _add_marginals(b, y, producer, group)  # sum_l y[r,A,l] = s[P,A]
            _add_marginals(b, y.T, node, in_group)  # sum_A y[r,A,l] = s[r,l]
            g, a = np.nonzero((t[:, targets] >= 0).T)  # t[A,l] >= y[r,A,l], layout by layout
            if len(g):
                b.add_pair_rows(y[a, g], t[a, targets[g]], -np.inf, 0.0)
                b.leave_out(y[a, g])


def _add_reshard_fixed_producer(b: MipBuilder, ticks: float, prices: np.ndarray, paid: np.ndarray,
                                readers: list[tuple[int, np.ndarray]]) -> None:
    """A fixed producer: w[l] (priced at its one strategy's price) >= each reader's choice of layout l."""
    for l in paid:
        readers_l = [(node, np.flatnonzero(layout == l)) for node, layout in readers]
        readers_l = [(node, strategies) for node, strategies in readers_l if len(strategies)]
        if not readers_l:
            continue
        w = b.add_cols(np.array([prices[l] * ticks]), np.ones(1), False)
        for node, strategies in readers_l:
            if b.first[node] < 0:
                b.add_row(np.array([w]), np.ones(1), 1.0, np.inf)
            else:
                b.add_row(np.append(b.s(node, strategies), w), np.append(np.ones(len(strategies)), -1.0),
                          -np.inf, 0.0)


def _add_exclusions(b: MipBuilder, cuts: list[list[tuple[int, np.ndarray]]]) -> None:
    """Rows (k), the no-good cuts (``presolve.exclusion_cuts`` of ``IlpProblem.excluded``)."""
    for cut in cuts:
        columns = np.concatenate([b.s(i, positions) for i, positions in cut])
        b.add_row(columns, np.ones(len(columns)), -np.inf, float(len(cut) - 1))


def _add_memory(b: MipBuilder, budget_bytes: float) -> bool:
    """Rows (e), each scaled by its room; False if some point is over budget whatever the choices."""
    budget = math.floor(budget_bytes)
    for p, terms in enumerate(b.red.point_terms):
        room = budget - b.red.point_const[p]
        if room < 0:
            return False
        if sum(int(nbytes.max()) for _, nbytes in terms) <= room:
            continue  # it can never bind
        columns, coeffs = _memory_row(b, p)
        b.memory_points.append(p)
        b.memory_rows.append(len(b.lower_rhs))
        if room == 0:
            b.add_row(columns, np.ones(len(columns)), -np.inf, 0.0)
        else:
            b.add_row(columns, coeffs / room, -np.inf, 1.0)
    return True


def _memory_row(b: MipBuilder, p: int) -> tuple[np.ndarray, np.ndarray]:
    columns, coeffs = [], []
    for node, nbytes in b.red.point_terms[p]:
        nonzero = np.flatnonzero(nbytes)
        if len(nonzero) and b.first[node] >= 0:
            columns.append(b.s(node, nonzero))
            coeffs.append(nbytes[nonzero].astype(float))
    return (np.concatenate(columns), np.concatenate(coeffs)) if columns else (np.zeros(0, dtype=np.int64), np.zeros(0))


def _ticks(red: Reduced) -> float:
    largest = max([float(c[np.isfinite(c)].max(initial=0.0)) for c in red.node_cost]
                  + [float(m[np.isfinite(m)].max(initial=0.0)) for _, _, m in red.edges]
                  + [cost for cost, _ in red.charges] + [float(c.max()) for _, c, _ in red.reshards], default=0.0)
    return _LARGEST_COST / largest if largest > 0 else 1.0


def dive(b: MipBuilder, lp: scipy.optimize.OptimizeResult, seconds: float) -> scipy.optimize.OptimizeResult | None:
    """A plan from a fractional LP optimum (``lp``, holding its HiGHS model): the free node whose largest strategy
    variable is the largest among the fractional nodes is fixed to that strategy and the LP solved again from the
    basis it holds (a warm dual simplex: a few pivots), until the LP is integral; its optimum is then a plan,
    and the first LP's optimum bounds how far from the best plan it is. On ConvNet-large (1x8-a100) one fixing made the LP integral in
    0.1 s at the plan HiGHS's MIP proved optimal in 28 s (and at 10 s had not found: 7.27 ms against 5.29).
    None when a fixing leaves the LP infeasible (memory rows a tight budget sets) or ``seconds`` run out. The
    model is left with the fixings (``plan_objective`` sets every strategy column's bounds itself).

    First, when several fractional nodes are split alike (their largest variables equal: one mixture of two
    plans, as a binding memory row makes it), the whole block is fixed at once to each node's other share, the
    plan the row lets through (``_block_fixed``). The round after gpt-xl@8's first plan peaked over its budget
    on 2x8-a100: 33 nodes at 0.52, the LP 994.5 ms; fixing the block to its runner-up strategies gave an
    integral 995.7 ms in one 2 s re-solve, where one node at a time took 0.5-0.8 s a fixing and ran out."""
    highs, x, fun = lp.highs, lp.x, lp.fun
    deadline = time.perf_counter() + seconds
    fixed = _block_fixed(b, highs, x, fun, deadline)
    if fixed is not None:
        x, fun = fixed
    while True:
        decided = b.most_decided_fractional(x)
        if decided is None:
            return scipy.optimize.OptimizeResult(status=1, x=x, fun=fun, highs=highs,
                                                 message="the fractional LP's dive: an integral LP optimum")
        node, position = decided
        others = np.delete(b.s(node, np.arange(len(b.red.allowed[node]))), position).astype(np.int32)
        highs.changeColsBounds(len(others), others, np.zeros(len(others)), np.zeros(len(others)))
        left = deadline - time.perf_counter()
        if left <= 0:
            return None
        again = run_highs(highs, left)
        if again.status != 0:
            return None
        x, fun = again.x, again.fun


def split_alike(b: MipBuilder, x: np.ndarray, tol: float = 1e-6) -> list[tuple[int, int]]:
    """(node, position of its second-largest strategy variable) of the fractional free nodes whose largest
    variable in ``x`` equals (within ``tol``) the largest among the fractional nodes."""
    found = []
    for node, (f, allowed) in enumerate(zip(b.first, b.red.allowed)):
        v = x[f:f + len(allowed)] if f >= 0 else None
        if v is not None and len(v) > 1 and np.minimum(v, 1.0 - v).max() > 1e-6:
            order = np.argsort(-v, kind="stable")
            found.append((float(v[order[0]]), node, int(order[1])))
    if not found:
        return []
    top = max(v for v, _, _ in found)
    return [(node, second) for v, node, second in found if v >= top - tol]


def _block_fixed(b: MipBuilder, highs: highspy.Highs, x: np.ndarray, fun: float,
                 deadline: float) -> tuple[np.ndarray, float] | None:
    """``dive``'s first step: the fractional nodes whose largest variable equals the most decided one's, each
    fixed to its second-largest, and the LP solved again; its (x, objective) when that stays within
    ``_DIVE_GAP`` of ``fun``, else None with the bounds put back (the dive goes on a node at a time)."""
    block = split_alike(b, x)
    left = deadline - time.perf_counter()
    if len(block) < 2 or left <= 0:
        return None
    columns = np.concatenate([np.delete(b.s(node, np.arange(len(b.red.allowed[node]))), position)
                              for node, position in block]).astype(np.int32)
    upper = np.concatenate(b.upper)[columns]
    highs.changeColsBounds(len(columns), columns, np.zeros(len(columns)), np.zeros(len(columns)))
    again = run_highs(highs, left)
    if again.status == 0 and again.fun - fun <= _DIVE_GAP * abs(again.fun):
        return again.x, again.fun
    highs.changeColsBounds(len(columns), columns, np.zeros(len(columns)), upper)
    return None


def _solve_relaxation_first(b: MipBuilder, time_limit_s: float, cutoff: float = math.inf, hinted: bool = False,
                            const: float = 0.0, warm: WarmStart | None = None) -> scipy.optimize.OptimizeResult:
    """The LP relaxation, and the MIP only when that is fractional: the relaxation of these problems is
    nearly always integral (module docstring), and an integral LP optimum is the MIP's optimum with its
    proof, without HiGHS's MIP presolve and cuts, which cost more than the LP itself here. A fractional
    optimum still bounds every plan: when too little time is left for the MIP (or it finds no plan), its
    rounding (each node's largest strategy variable) is the plan, priced on the LP, and the LP optimum its
    bound (GPT-large at 24 layers, 1x8-a100: the LP takes 8 of the 10 s and is fractional). Before the MIP, the
    fractional LP is dived to a plan (``dive``: a node fixed at a time, the LP re-solved warm), which is the
    optimum when it reaches the LP's bound and otherwise a candidate beside the MIP's plan and the rounding; within
    ``_DIVE_GAP`` of the bound it leaves the MIP only ``_POLISH_SHARE`` of the limit (to prove it or find a better
    plan: small problems are proven in well under that), not the rest of the limit for the last percent
    (ConvNet-large on 1x8-a100: the dive 5.29 ms, 0.7% from the bound, in 0.1 s, where the MIP had 7.27 ms after
    10 s and proved 5.29 ms optimal after 28; ``const``: what every plan pays beyond the LP's objective, in its
    units, of which the gap is a share too). With a finite
    ``cutoff`` the LP stops once it proves no plan costs less (status 5, ``solve_lp``). An LP that ran out of
    time without a plan goes on to the MIP only when a share of the limit is left or there is no ``hinted``
    plan to fall back on: a MIP whose relaxation did not finish finds nothing in the few tenths of a second
    HiGHS's set-up overruns a small limit by (the layer solves of the stage search: 0.24 s each, for nothing)."""
    start = time.perf_counter()
    lp = warm.solve_lp(b, time_limit_s, cutoff, solve_lp) if warm is not None else solve_lp(b, time_limit_s, cutoff)
    if lp.status == 5:
        return lp
    if lp.status == 0 and lp.x is not None and integral(b, lp.x):
        lp.mip_dual_bound = lp.fun
        return lp
    if lp.status == 2:  # an infeasible relaxation: so is the MIP
        return lp
    if lp.status == 1 and lp.x is not None:  # out of time: a restricted LP's integral plan, bounded when it can be
        return lp
    left = time_limit_s - (time.perf_counter() - start)
    if lp.status != 0 or lp.x is None or getattr(lp, "highs", None) is None:
        if lp.status == 1 and hinted and left < _MIP_SHARE * time_limit_s:
            return lp  # out of time, no plan: the caller's hint (against the stopped LP's bound, if it has one)
        mip = b.solve(max(left, 0.1))
        stopped = getattr(lp, "mip_dual_bound", None)  # a stopped dual simplex's bound still bounds the MIP
        if stopped is not None and math.isfinite(stopped):
            mip.mip_dual_bound = max(stopped, float(getattr(mip, "mip_dual_bound", None) or -math.inf))
        return mip
    dived = dive(b, lp, max(left, _DIVE_S))
    mip_s = left = time_limit_s - (time.perf_counter() - start)
    if dived is not None:
        dived.mip_dual_bound = lp.fun
        if dived.fun - lp.fun <= MIP_REL_GAP * abs(dived.fun + const):
            return dived  # at the LP's bound: optimal
        if dived.fun - lp.fun <= _DIVE_GAP * abs(dived.fun + const):
            mip_s = min(left, _POLISH_SHARE * time_limit_s)  # close: the MIP may prove or better it, not for long
    found = b.solve(mip_s) if left >= _MIP_SHARE * time_limit_s else None
    if found is not None and found.status == 0 and found.x is not None:
        return found
    candidates = [r for r in (found, dived) if r is not None and r.x is not None]
    rounded = b.one_hot(b.positions(lp.x))
    price = plan_objective(b, lp.highs, rounded, max(left, _PRICE_S))
    if price is not None:
        candidates.append(scipy.optimize.OptimizeResult(
            status=1, x=rounded, fun=price,
            message="Time limit reached; the fractional LP's rounding, its optimum the bound"))
    if not candidates:  # the rounding takes a forbidden pair (or broke the memory rows) and the MIP found none
        return scipy.optimize.OptimizeResult(status=1, x=None, fun=None, message="Time limit reached")
    best = min(candidates, key=lambda r: r.fun)
    best.mip_dual_bound = max(lp.fun, float(getattr(found, "mip_dual_bound", None) or -math.inf))
    return best


def build_lp(problem: IlpProblem, red: Reduced) -> Built:
    """Columns and rows but the memory rows and cuts, named for its kept basis (``warm.py``)."""
    ticks = _ticks(red)
    b = _new(problem, red, ticks)
    _add_edges(b, ticks)
    _add_charges(b, ticks)
    _add_reshards(b, ticks)
    return Built(red, ticks, b, WarmStart.of(b))


def _decode(b: MipBuilder, x: np.ndarray) -> np.ndarray:
    return np.array([allowed[p] for allowed, p in zip(b.red.allowed, b.positions(x))], dtype=np.int64)


def solve_mip(problem: IlpProblem, hint: np.ndarray | Callable[[], np.ndarray] | None = None) -> IlpSolution:
    """Pick one strategy per node minimising node + edge seconds under the memory budget, with HiGHS.

    ``hint`` (a plan free of violations, e.g. the local search's) is returned when HiGHS's plan is not
    cheaper or it found none in time; a callable is called for it once the LP has neither cut the solve off
    nor proven its plan optimal.
    Raises ``InfeasibleMemoryError`` when no plan fits the budget, and ``CutOffError`` when
    ``problem.cutoff_s`` is given and the LP proves no plan costs less."""
    start = time.perf_counter()
    search = KEPT_SEARCH.take(problem) if problem.excluded and problem.cutoff_s is None else None
    warm = None
    if search is not None:  # a later plan of candidates.next_best: the search of the earlier ones goes on
        b, red, ticks = search.b, search.b.red, search.ticks
    else:  # the LP but for its memory rows, built once for every budget (kept_lp.py)
        kept = kept_lp(problem, build_lp)
        b, red, ticks, warm = kept.copy(), kept.red, kept.ticks, kept.warm
        if problem.memory_budget_bytes is not None and not _add_memory(b, problem.memory_budget_bytes):
            raise _infeasible(problem)
    cuts = exclusion_cuts(problem.excluded, b.red.allowed, b.first >= 0)
    if cuts is None:
        raise PlanningError(f"the {len(problem.excluded)} no-good cut(s) exclude every plan of the "
                            f"{problem.num_nodes} nodes")
    built = time.perf_counter()
    left = max(problem.time_limit_s - (built - start), 0.1)
    # the cutoff in the LP's units: presolve leaves out red.const_s, which every plan pays
    cutoff = (problem.cutoff_s - red.const_s) * ticks if problem.cutoff_s is not None else math.inf
    res = None
    if cuts and not math.isfinite(cutoff):  # branch on the cuts over the LP without them (disjunction.py)
        search = search or CutSearch(b, ticks, warm, const=red.const_s * ticks)
        res = search.run(cuts, left)
        if res is not None and res.status == 2:
            raise PlanningError(f"the {len(cuts)} no-good cut(s) exclude every plan of the {problem.num_nodes} "
                                "nodes that fits")
        if res is not None:
            KEPT_SEARCH.keep(problem, search)
    if res is None:
        _add_exclusions(b, cuts)
        res = _solve_relaxation_first(b, max(left - (time.perf_counter() - built), 0.1), cutoff,
                                      hinted=hint is not None, const=red.const_s * ticks, warm=warm)
    log.debug("mip: %d nodes (%d free), %d edges kept of %d; build %.2fs (%d columns, %d rows), HiGHS %.2fs: %s",
              problem.num_nodes, int((b.first >= 0).sum()), len(red.edges), len(problem.edges), built - start,
              b.num_cols, len(b.lower_rhs), time.perf_counter() - built, res.message)
    if res.status == 2:
        raise _infeasible(problem)
    if res.status == 5:
        bound_s = float(res.bound) / ticks + red.const_s
        raise CutOffError(f"no plan of the {problem.num_nodes} nodes costs less than the cutoff "
                          f"{problem.cutoff_s:.6g} s: the LP bounds every plan at {bound_s:.6g} s", bound_s)
    if callable(hint):  # made only when needed: no plan is cheaper than a proven optimum
        hint = None if res.status == 0 else hint()
    choices = _decode(b, res.x) if res.x is not None else None
    result = evaluate(problem, choices) if choices is not None else None
    if result is not None and result.violations:
        raise RuntimeError("internal error: the MIP plan violates its problem: " + "; ".join(result.violations))
    # presolve shifts every plan's objective by one constant: the full objective of HiGHS's bound (a stopped
    # LP that found no plan, whose caller's hint is the plan, may still have its dual simplex's bound)
    bound = getattr(res, "mip_dual_bound", None)
    if bound is None or not math.isfinite(bound):
        bound_s = -math.inf
    elif result is not None and res.fun is not None:
        bound_s = float(bound) / ticks + (result.objective_s - float(res.fun) / ticks)
    else:
        bound_s = float(bound) / ticks + red.const_s
    if hint is not None:
        hinted = evaluate(problem, hint)
        if not hinted.violations and (result is None or hinted.objective_s < result.objective_s):
            choices, result = np.asarray(hint, dtype=np.int64).copy(), hinted
    if choices is None or result is None:
        raise SolverTimeoutError(f"HiGHS found no plan for {problem.num_nodes} nodes within time_limit_s="
                                 f"{problem.time_limit_s:g}s ({res.message}); raise time_limit_s")
    gap = max(0.0, result.objective_s - bound_s) / result.objective_s if result.objective_s > 0 else 0.0
    optimal = res.status == 0 or gap <= MIP_REL_GAP
    return IlpSolution(choices, result.objective_s, "optimal" if optimal else "feasible", 0.0 if optimal else gap,
                       time.perf_counter() - start, b.num_cols, len(b.lower_rhs))


def _infeasible(problem: IlpProblem) -> Exception:
    if problem.memory_budget_bytes is None:
        return PlanningError(f"no combination of strategies for the {problem.num_nodes} nodes avoids every forbidden "
                             "choice and pair (infinite costs); the strategy rules are inconsistent")
    smallest, choices = min_peak_plan_mip(problem)
    return memory_error(problem, problem.memory_budget_bytes, smallest, choices)


def min_peak_plan_mip(problem: IlpProblem) -> tuple[float, np.ndarray]:
    """(smallest peak, a plan that reaches it): the least memory any plan free of forbidden choices needs."""
    red = presolved(problem)
    b = _new(problem, red, 0.0)
    for u, v, matrix in red.edges:  # (f): a forbidden pair cannot be taken together
        for col in np.flatnonzero(~np.isfinite(matrix).all(axis=0)):
            rows = np.flatnonzero(~np.isfinite(matrix[:, col]))
            b.add_row(np.append(b.s(u, rows), b.s(v, np.array([col]))), np.ones(len(rows) + 1), -np.inf, 1.0)
    scale = max([float(red.point_const[p]) + sum(float(n.max()) for _, n in terms)
                 for p, terms in enumerate(red.point_terms)] + [1.0])
    peak = b.add_cols(np.array([1.0]), np.array([np.inf]), False)
    for p in range(len(red.point_terms)):
        columns, coeffs = _memory_row(b, p)
        b.add_row(np.append(columns, peak), np.append(coeffs / scale, -1.0), -np.inf, -red.point_const[p] / scale)
    res = b.solve(problem.time_limit_s)
    if res.status == 2:
        raise PlanningError(f"no combination of strategies for the {problem.num_nodes} nodes avoids every forbidden "
                            "choice and pair (infinite costs); the strategy rules are inconsistent")
    if res.x is None:
        raise SolverTimeoutError(f"HiGHS found no plan free of forbidden choices for {problem.num_nodes} nodes "
                                 f"within time_limit_s={problem.time_limit_s:g}s; raise time_limit_s")
    choices = _decode(b, res.x)
    position = [int(np.searchsorted(allowed, c)) for allowed, c in zip(red.allowed, choices)]
    per_point = [red.point_const[p] + sum(int(nbytes[position[node]]) for node, nbytes in terms)
                 for p, terms in enumerate(red.point_terms)]
    return float(max(per_point, default=0)), choices
