"""The CP-SAT model (the ``solver="cpsat"`` backend; HiGHS in ``passes/ilp/mip.py`` is the default): one
builder per constraint family, the objective, the hint, and the min-peak model.

``passes/ilp/problem.py`` holds the plain-data boundary (``IlpProblem`` in, ``IlpSolution`` out,
``evaluate``, ``brute_force``), ``passes/ilp/presolve.py`` the reductions P1-P4; this module never
sees jax. The formulation, in the order the builders add it:

Legend (single-letter names are used in this module only)
---------------------------------------------------------
    i, u, v   nodes (an edge e = (u, v));       a, b   strategies of u, of v
    s[i,a]    boolean: node i uses strategy a
    c[i,a]    node cost in seconds (inf: forbidden choice)
    C[e,a,b]  edge cost in seconds (inf: forbidden pair);  R[e] its reduced form (P3)
    A, B      a row group of R[e] (strategies of u with identical rows), a column group
    y[e,A,B]  boolean: edge e pays R[e,A,B]; only for allowed (finite) group pairs
    p         liveness point;  m[p,i,a] bytes;  K[p] constant bytes;  M budget bytes
    z[k]      boolean: shared charge k is paid;  g[k] its cost
    P         peak bytes (min-peak model only)
    q         ticks per second (the objective scale)

Presolve (exact: every plan keeps its objective; only impossible choices go)
-----------------------------------------------------------------------------
    P1  arc consistency: a strategy with no allowed partner on some edge is forbidden.
    P2  a node with one allowed strategy is a constant: each of its edges is added
        to the neighbour's node costs and its bytes to the point constants.
    P3  parallel edges are summed; row minima of C[e] move into c[u], then column
        minima into c[v]; R[e] >= 0 is what is left, and an all-zero R[e] is dropped.
    P4  node costs are shifted so that each node's cheapest strategy costs 0.

Constraints (built in this order, one builder each, every constraint named)
----------------------------------------------------------------------------
    (a) one_hot     sum_a s[i,a] = 1                                   every free node i
    (b) forbidden   s[i,a] = 0 where c[i,a] = inf: no variable is created for it
    (c) edge_rows   sum_B y[e,A,B] = sum_{a in A} s[u,a]                every e, row group A
    (d) edge_cols   sum_A y[e,A,B] = sum_{b in B} s[v,b]                every e, column group B
    (e) memory      K[p] + sum_{i,a} m[p,i,a] s[i,a] <= M               every point p that can bind
    (e') peak       K[p] + sum_{i,a} m[p,i,a] s[i,a] <= P               min-peak model only
    (f) forbid      s[v,b] + sum_{a : C[e,a,b] = inf} s[u,a] <= 1        min-peak model only
    (g) charge      s[i,a] - z[k] <= 0           every member choice (i, a) of shared charge k
    (h)-(j)         a shared reshard's layouts w and prices t, as written in ``passes/ilp/mip.py``
    (k) exclude     sum_{i in F_k} sum_{a in X[k,i]} s[i,a] <= |F_k| - 1   every no-good cut k: X[k,i] the
                    marked strategies of node i, F_k the free nodes with marked and unmarked allowed ones

Objective: minimize sum_{i,a} c[i,a] s[i,a] + sum_{e,A,B} R[e,A,B] y[e,A,B] + sum_k g[k] z[k], in ticks
(g[k]: the cost of shared charge k, paid once when any member choice is taken: the latency of one
combined all-reduce, say).

(c)-(d) is Alpa's edge formulation (y is the product s[u,a] s[v,b]: with s integral,
exactly y[e, group(a*), group(b*)] = 1, and a forbidden pair has no y, so it cannot be
chosen) with strategies that see the same row or column merged: several strategies of
an op usually share its output layout or the layout they need of an input, and P3's
shifts make more rows equal. Its LP relaxation is the local marginal polytope, far
tighter than the compact form with one integer t[e] >= sum_a R[e,a,b] s[u,a] - M_b (1 -
s[v,b]) per column (even lifted): on benchmarks/ilp_scale.py (300 nodes x 20
strategies, 450 edges) CP-SAT proves this model optimal (6.47 ms) in ~10 s, while
with the compact form it was still at 24.7 ms after 15 s (optimum confirmed by HiGHS).

Scaling: q = 1e9 / (largest finite reduced cost), so the largest cost is 1e9 ticks; a
cost x becomes round(q x), and a positive x that would round to 0 becomes 1 tick (a
nonzero cost is never free). Each term is off by at most 1 tick, so a plan's model
objective is within (nodes + edges) / q seconds of its true one; the returned
``objective_s`` is always recomputed in float from the choices. Bytes are rounded up
to whole bytes and M down, so a plan the model accepts always fits.

Solving: CP-SAT with ``time_limit_s``, ``seed`` and ``num_workers``. One worker (the
default) is deterministic unless the time limit cuts the search; several run CP-SAT's
parallel portfolio, which is not (and its interleaved deterministic mode was 5x slower
on the tests' 80-node problem). The hint is given to CP-SAT (s and y, so it is complete);
``solve`` returns it when it evaluates better than the solver's plan, or the solver
found none in time: the result is never worse than the hint.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from autoshard.errors import PlanningError
from autoshard.passes.ilp.cpsat_model import (Model, VarIndex, add_bools, add_forbidden_pairs, add_linear,
                                              add_memory_budget, add_one_hot, add_peak_memory, decode_choices,
                                              forbidden_error, new_model, run, ticks_scale, timeout_error,
                                              to_ticks)
from autoshard.passes.ilp.presolve import exclusion_cuts, identical_lines, presolve
from autoshard.passes.ilp.problem import IlpProblem, IlpSolution, NodeIndex, evaluate, memory_error

log = logging.getLogger(__name__)

@dataclass
class _EdgeVars:
    """The y[e, A, B] of one edge, by row group A of u and column group B of v."""
    u: NodeIndex
    v: NodeIndex
    row_group: np.ndarray  # per allowed strategy of u: its row group A
    col_group: np.ndarray  # per allowed strategy of v: its column group B
    y: np.ndarray  # [A, B] proto index of y[e, A, B]; -1 for a forbidden pair
    ticks: np.ndarray  # [A, B] R[e, A, B] in ticks


def _members(group: np.ndarray, first_var: int) -> list[list[VarIndex]]:
    """Per group, the s variables of the strategies in it."""
    members: list[list[VarIndex]] = [[] for _ in range(int(group.max()) + 1)]
    for k, g in enumerate(group.tolist()):
        members[g].append(first_var + k)
    return members


def _add_edge_costs(model: Model, ticks_per_s: float) -> list[_EdgeVars]:  # (c), (d)
    edge_vars = []
    for u, v, matrix in model.red.edges:
        (rows, first_row), (cols, first_col) = identical_lines(matrix), identical_lines(matrix.T)
        grouped = matrix[np.ix_(first_row, first_col)]
        name = f"{model.names[u]}->{model.names[v]}"
        allowed_pair = np.isfinite(grouped)
        y = np.full(grouped.shape, -1, dtype=np.int64)
        pairs = np.argwhere(allowed_pair).tolist()
        y[allowed_pair] = add_bools(model, [f"y[{name},{r},{c}]" for r, c in pairs]) + np.arange(len(pairs))
        for kind, members, lines in (("rows", _members(rows, model.s(u, 0)), y),
                                     ("cols", _members(cols, model.s(v, 0)), y.T)):
            for g, (line, s_vars) in enumerate(zip(lines, members)):
                ys = line[line >= 0].tolist()
                add_linear(model, f"edge_{kind}[{name},{g}]", ys + s_vars, [1] * len(ys) + [-1] * len(s_vars), 0, 0)
        edge_vars.append(_EdgeVars(u, v, rows, cols, y, to_ticks(grouped, ticks_per_s)))
    return edge_vars


def _add_charges(model: Model) -> None:  # (g)
    for k, (_cost, members) in enumerate(model.red.charges):
        z = add_bools(model, [f"z[charge {k}]"])
        model.charge_vars.append(z)
        for node, mask in members:
            if model.first_var[node] < 0:
                continue
            for a in np.flatnonzero(mask):
                add_linear(model, f"charge[{k},{model.names[node]},{a}]", [model.s(node, int(a)), z], [1, -1],
                            cp_model.INT_MIN, 0)


@dataclass
class _LayoutVars:
    """One layout l of one shared reshard: w (made), t per paid producer strategy, their prices in ticks."""
    producer: NodeIndex
    readers: list[tuple[NodeIndex, np.ndarray]]  # (node, allowed strategies that read layout l)
    w: VarIndex
    paid: np.ndarray  # producer's allowed strategies with a price (all of them, one, when it is fixed)
    t: np.ndarray  # proto index per paid strategy; empty when the producer is fixed (w carries the price)
    ticks: np.ndarray  # per paid strategy


def _add_reshards(model: Model, ticks_per_s: float) -> list[_LayoutVars]:  # (h)-(j), passes/ilp/mip.py
    out = []
    for k, (producer, costs, readers) in enumerate(model.red.reshards):
        for l in np.flatnonzero(costs.max(axis=0) > 0):
            readers_l = [(node, np.flatnonzero(layout == l)) for node, layout in readers]
            readers_l = [(node, strategies) for node, strategies in readers_l if len(strategies)]
            if not readers_l:
                continue
            w = add_bools(model, [f"w[reshard {k},{l}]"])
            for node, strategies in readers_l:
                if model.first_var[node] < 0:
                    add_linear(model, f"layout[{k},{l},{model.names[node]}]", [w], [1], 1, 1)
                else:
                    add_linear(model, f"layout[{k},{l},{model.names[node]}]",
                                [model.s(node, int(b)) for b in strategies] + [w], [1] * len(strategies) + [-1],
                                cp_model.INT_MIN, 0)
            if model.first_var[producer] < 0:
                out.append(_LayoutVars(producer, readers_l, w, np.array([0]), np.zeros(0, dtype=np.int64),
                                       to_ticks(costs[[0], l], ticks_per_s)))
                continue
            paid, free = np.flatnonzero(costs[:, l] > 0), np.flatnonzero(costs[:, l] == 0)
            first = add_bools(model, [f"t[reshard {k},{a},{l}]" for a in paid])
            t = first + np.arange(len(paid))
            add_linear(model, f"made[{k},{l}]", t.tolist() + [model.s(producer, int(a)) for a in free] + [w],
                        [1] * (len(paid) + len(free)) + [-1], 0, cp_model.INT_MAX)
            for col, a in zip(t.tolist(), paid):
                add_linear(model, f"from[{k},{a},{l}]", [col, model.s(producer, int(a))], [1, -1], cp_model.INT_MIN, 0)
            out.append(_LayoutVars(producer, readers_l, w, paid, t, to_ticks(costs[paid, l], ticks_per_s)))
    return out


def add_exclusions(model: Model, excluded: tuple[tuple[np.ndarray, ...], ...]) -> bool:  # (k)
    """False when some cut excludes every plan left."""
    cuts = exclusion_cuts(excluded, model.red.allowed, np.asarray(model.first_var) >= 0)
    if cuts is None:
        return False
    for k, cut in enumerate(cuts):
        variables = [model.s(i, int(a)) for i, positions in cut for a in positions]
        add_linear(model, f"exclude[{k}]", variables, [1] * len(variables), 0, len(cut) - 1)
    return True


def _layout_values(layouts: list[_LayoutVars], position: list[int]) -> list[tuple[int, np.ndarray]]:
    """Per layout of a plan: w, and t per paid producer strategy."""
    out = []
    for lv in layouts:
        made = int(any(position[node] in strategies for node, strategies in lv.readers))
        out.append((made, (lv.paid == position[lv.producer]).astype(int) * made if len(lv.t) else np.zeros(0)))
    return out


def _charge_active(model: Model, position: list[int]) -> list[bool]:
    return [any(position[node] >= 0 and bool(mask[position[node]]) for node, mask in members)
            for _cost, members in model.red.charges]


def _set_objective(model: Model, ticks_per_s: float, edge_vars: list[_EdgeVars],
                   layouts: list[_LayoutVars]) -> None:
    objective = model.proto.objective
    for lv in layouts:
        priced = (lv.t, lv.ticks) if len(lv.t) else (np.array([lv.w]), lv.ticks)
        nonzero = priced[1] > 0
        objective.vars.extend(priced[0][nonzero].tolist())
        objective.coeffs.extend(priced[1][nonzero].tolist())
    for z, (cost, _members) in zip(model.charge_vars, model.red.charges):
        ticks = int(to_ticks(np.array([cost]), ticks_per_s)[0])
        if ticks:
            objective.vars.append(z)
            objective.coeffs.append(ticks)
    for i, first in enumerate(model.first_var):
        if first >= 0:
            ticks = to_ticks(model.red.node_cost[i], ticks_per_s)
            nonzero = np.flatnonzero(ticks)
            objective.vars.extend((first + nonzero).tolist())
            objective.coeffs.extend(ticks[nonzero].tolist())
    for e in edge_vars:
        paid = (e.y >= 0) & (e.ticks > 0)
        objective.vars.extend(e.y[paid].tolist())
        objective.coeffs.extend(e.ticks[paid].tolist())


def _model_ticks(model: Model, edge_vars: list[_EdgeVars], layouts: list[_LayoutVars], ticks_per_s: float,
                 choices: np.ndarray) -> float:
    """The model's objective (ticks, without presolve's constants) at a plan free of forbidden choices."""
    position = [int(np.searchsorted(allowed, c)) for allowed, c in zip(model.red.allowed, choices)]
    layout_ticks = sum(int((lv.ticks * t).sum()) if len(lv.t) else int(lv.ticks[0]) * made
                       for lv, (made, t) in zip(layouts, _layout_values(layouts, position)))
    ticks = sum(int(to_ticks(model.red.node_cost[i], ticks_per_s)[position[i]])
                for i in range(len(position)) if model.first_var[i] >= 0)
    ticks += sum(int(to_ticks(np.array([cost]), ticks_per_s)[0])
                 for (cost, _m), on in zip(model.red.charges, _charge_active(model, position)) if on)
    return float(ticks + layout_ticks
                 + sum(int(e.ticks[e.row_group[position[e.u]], e.col_group[position[e.v]]]) for e in edge_vars))


def _add_hint(model: Model, hint: np.ndarray, edge_vars: list[_EdgeVars], layouts: list[_LayoutVars]) -> None:
    """Hint every s and y that the hint decides (a complete hint is checked by CP-SAT at once)."""
    position = [int(np.searchsorted(allowed, h)) for allowed, h in zip(model.red.allowed, hint)]
    position = [k if k < len(allowed) and allowed[k] == h else -1
                for k, allowed, h in zip(position, model.red.allowed, hint)]
    variables: list[int] = []
    values: list[int] = []
    for i, first in enumerate(model.first_var):
        if first >= 0 and position[i] >= 0:
            variables += range(first, first + len(model.red.allowed[i]))
            values += [int(a == position[i]) for a in range(len(model.red.allowed[i]))]
    for e in edge_vars:
        if position[e.u] >= 0 and position[e.v] >= 0:
            chosen = e.y[e.row_group[position[e.u]], e.col_group[position[e.v]]]
            present = e.y[e.y >= 0]
            variables += present.tolist()
            values += (present == chosen).astype(int).tolist()
    if all(k >= 0 for k in position):
        variables += model.charge_vars
        values += [int(on) for on in _charge_active(model, position)]
        for lv, (made, t) in zip(layouts, _layout_values(layouts, position)):
            variables += [lv.w] + lv.t.tolist()
            values += [made] + [int(v) for v in t]
    model.proto.solution_hint.vars.extend(variables)
    model.proto.solution_hint.values.extend(values)


# ---------------------------------------------------------------------------------------------
# solving


def _min_peak(problem: IlpProblem) -> tuple[int, np.ndarray]:
    """Smallest peak over plans free of forbidden choices, in the solver's whole bytes, and that plan."""
    model = new_model(problem, red := presolve(problem))
    add_one_hot(model)
    add_forbidden_pairs(model)
    peak = add_peak_memory(model)
    model.proto.objective.vars.append(peak)
    model.proto.objective.coeffs.append(1)
    solver, status = run(model, problem)
    if status == cp_model.INFEASIBLE:
        raise forbidden_error(problem)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise timeout_error(problem, "plan free of forbidden choices")
    if status == cp_model.FEASIBLE:
        log.warning("min peak memory not proven minimal within time_limit_s=%gs", problem.time_limit_s)
    choices = decode_choices(model, solver)
    position = [int(np.searchsorted(allowed, c)) for allowed, c in zip(red.allowed, choices)]
    per_point = [red.point_const[p] + sum(int(b[position[node]]) for node, b in terms)
                 for p, terms in enumerate(red.point_terms)]
    return max(per_point, default=0), choices


# ---------------------------------------------------------------------------------------------
# entry points


def min_peak_plan_cpsat(problem: IlpProblem) -> tuple[float, np.ndarray]:
    """(smallest peak, a plan that reaches it): the least memory any plan free of forbidden choices needs."""
    peak, choices = _min_peak(problem)
    return float(peak), choices


def _infeasible(problem: IlpProblem) -> PlanningError:
    if problem.memory_budget_bytes is None:
        return forbidden_error(problem)
    smallest, choices = _min_peak(problem)
    return memory_error(problem, problem.memory_budget_bytes, float(smallest), choices)


def solve_cpsat(problem: IlpProblem) -> IlpSolution:
    """Pick one strategy per node minimising node + edge seconds under the memory budget, with CP-SAT; the
    hint (already improved by the local search, ``passes/ilp/solvers.py``) is given to it and returned
    when it is cheaper than the solver's plan."""
    start = time.perf_counter()
    red = presolve(problem)
    model = new_model(problem, red)
    add_one_hot(model)
    ticks_per_s = ticks_scale(red)
    edge_vars = _add_edge_costs(model, ticks_per_s)
    _add_charges(model)
    layouts = _add_reshards(model, ticks_per_s)
    if not add_exclusions(model, problem.excluded):
        raise PlanningError(f"the {len(problem.excluded)} no-good cut(s) exclude every plan of the "
                            f"{problem.num_nodes} nodes")
    budget = problem.memory_budget_bytes
    if budget is not None and not add_memory_budget(model, budget):
        raise _infeasible(problem)
    _set_objective(model, ticks_per_s, edge_vars, layouts)
    if problem.hint is not None:
        _add_hint(model, np.asarray(problem.hint), edge_vars, layouts)
    built = time.perf_counter()
    solver, status = run(model, problem)
    proto = model.proto
    log.debug("ilp: %d nodes (%d free), %d edges kept of %d; build %.2fs (%d variables, %d constraints), "
              "CP-SAT %.2fs: %s", problem.num_nodes, int((model.first_var >= 0).sum()), len(red.edges),
              len(problem.edges), built - start, len(proto.variables), len(proto.constraints),
              time.perf_counter() - built, solver.status_name(status))
    if status == cp_model.INFEASIBLE:
        raise _infeasible(problem)
    found = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    choices = decode_choices(model, solver) if found else None
    result = evaluate(problem, choices) if found else None
    if result is not None and result.violations:
        raise RuntimeError("internal error: the ILP plan violates its problem: " + "; ".join(result.violations))
    if problem.hint is not None:  # never worse than the hint, even after a time-out
        hinted = evaluate(problem, np.asarray(problem.hint))
        if not hinted.violations and (result is None or hinted.objective_s < result.objective_s):
            log.debug("ilp: returning the hint (%.6gs); the solver's plan: %s", hinted.objective_s,
                      "none" if result is None else f"{result.objective_s:.6g}s")
            choices, result = np.asarray(problem.hint, dtype=np.int64).copy(), hinted
    if choices is None or result is None:
        raise timeout_error(problem, "plan")
    gap = 0.0
    if status != cp_model.OPTIMAL:
        gap_s = (_model_ticks(model, edge_vars, layouts, ticks_per_s, choices) - solver.best_objective_bound) / ticks_per_s
        if result.objective_s > 0:
            gap = max(gap_s, 0.0) / result.objective_s
        elif gap_s > 0:
            gap = np.inf
    return IlpSolution(choices, result.objective_s, "optimal" if status == cp_model.OPTIMAL else "feasible",
                       gap, time.perf_counter() - start, len(proto.variables), len(proto.constraints))
