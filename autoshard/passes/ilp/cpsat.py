"""The CP-SAT model and the entry points :func:`solve` and :func:`min_peak_memory`: one builder per
constraint family, the objective, the hint, and the min-peak model.

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

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np
from ortools.sat.python import cp_model

from autoshard.errors import PlanningError
from autoshard.passes.ilp.presolve import Reduced, presolve
from autoshard.passes.ilp.problem import IlpProblem, IlpSolution, NodeIndex, evaluate, memory_error
from autoshard.passes.ilp.search import local_search

log = logging.getLogger(__name__)

VarIndex: TypeAlias = int  # index of a variable in the CP-SAT model proto

_TICKS_FOR_LARGEST_COST = 1e9
_ROW_WEIGHTS = np.random.default_rng(0).uniform(0.5, 1.5, size=4096)  # fingerprints of edge-matrix rows


def _to_ticks(seconds: np.ndarray, ticks_per_s: float) -> np.ndarray:
    """Integer ticks; inf becomes 0 (a forbidden entry gets no variable); a positive cost stays >= 1."""
    finite = np.isfinite(seconds)
    ticks = np.round(np.where(finite, seconds, 0.0) * ticks_per_s).astype(np.int64)
    ticks[(ticks == 0) & finite & (seconds > 0)] = 1
    return ticks


def _ticks_per_s(red: Reduced) -> float:
    """q: the largest finite reduced cost becomes _TICKS_FOR_LARGEST_COST ticks."""
    largest = max([float(c.max()) for c in red.node_cost]
                  + [float(m[np.isfinite(m)].max(initial=0.0)) for _, _, m in red.edges]
                  + [cost for cost, _ in red.charges], default=0.0)
    return _TICKS_FOR_LARGEST_COST / largest if largest > 0 else 1.0


# ---------------------------------------------------------------------------------------------
# model builders, one per constraint family


@dataclass
class _Model:
    """A CP-SAT model under construction and where each node's booleans s[i, .] live in it."""
    cp: cp_model.CpModel
    red: Reduced
    names: tuple[str, ...]
    first_var: np.ndarray  # per node: proto index of s[i, 0]; -1 for a node fixed by presolve
    num_vars: int = 0
    charge_vars: list[VarIndex] = dataclasses.field(default_factory=list)  # z[k] per open shared charge

    @property
    def proto(self) -> cp_model.cp_model_helper.CpModelProto:
        return self.cp.proto

    def s(self, node: NodeIndex, a: int) -> VarIndex:
        return int(self.first_var[node]) + a


@dataclass
class _EdgeVars:
    """The y[e, A, B] of one edge, by row group A of u and column group B of v."""
    u: NodeIndex
    v: NodeIndex
    row_group: np.ndarray  # per allowed strategy of u: its row group A
    col_group: np.ndarray  # per allowed strategy of v: its column group B
    y: np.ndarray  # [A, B] proto index of y[e, A, B]; -1 for a forbidden pair
    ticks: np.ndarray  # [A, B] R[e, A, B] in ticks


def _add_var(model: _Model, lower: int, upper: int, name: str) -> VarIndex:
    var = model.proto.variables.add()
    var.domain.extend((lower, upper))
    var.name = name
    model.num_vars += 1
    return model.num_vars - 1


def _add_bools(model: _Model, names: list[str]) -> VarIndex:
    """Add one boolean per name; returns the index of the first."""
    add = model.proto.variables.add
    for name in names:
        var = add()
        var.domain.extend((0, 1))
        var.name = name
    model.num_vars += len(names)
    return model.num_vars - len(names)


def _add_linear(model: _Model, name: str, variables: list[int], coeffs: list[int], lower: int, upper: int) -> None:
    # Written into the proto directly (named like .with_name would): 4x faster to build than LinearExpr.
    constraint = model.proto.constraints.add()
    constraint.name = name
    constraint.linear.vars.extend(variables)
    constraint.linear.coeffs.extend(coeffs)
    constraint.linear.domain.extend([lower, upper])


def _new_model(problem: IlpProblem, red: Reduced) -> _Model:
    model = _Model(cp_model.CpModel(), red, problem.node_names, np.full(problem.num_nodes, -1, dtype=np.int64))
    for i, allowed in enumerate(red.allowed):
        if len(allowed) > 1:
            model.first_var[i] = _add_bools(model, [f"s[{problem.node_names[i]},{a}]" for a in allowed])
    return model


def _add_one_hot(model: _Model) -> None:  # (a)
    for i, first in enumerate(model.first_var):
        if first >= 0:
            constraint = model.proto.constraints.add()
            constraint.name = f"one_hot[{model.names[i]}]"
            constraint.exactly_one.literals.extend(range(first, first + len(model.red.allowed[i])))


def _add_forbidden_pairs(model: _Model) -> None:  # (f), min-peak model only
    for u, v, matrix in model.red.edges:
        for b in np.flatnonzero(~np.isfinite(matrix).all(axis=0)):
            constraint = model.proto.constraints.add()
            constraint.name = f"forbid[{model.names[u]}->{model.names[v]},{model.red.allowed[v][b]}]"
            constraint.at_most_one.literals.extend(
                [model.s(v, b)] + [model.s(u, a) for a in np.flatnonzero(~np.isfinite(matrix[:, b]))])


def _identical(lines: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(group per row, first row of each group): equal rows share a group."""
    key = np.where(np.isfinite(lines), lines, -1.0) + 0.0  # R >= 0, so -1 marks inf; + 0.0 drops -0.0
    if key.shape[1] <= len(_ROW_WEIGHTS):  # fast path: group by a fingerprint, then check it exactly
        _, first, group = np.unique(key @ _ROW_WEIGHTS[:key.shape[1]], return_index=True, return_inverse=True)
        if np.array_equal(key[first][group.ravel()], key):
            return group.ravel(), first
    seen: dict[bytes, int] = {}
    group = np.array([seen.setdefault(line.tobytes(), len(seen)) for line in key], dtype=np.int64)
    return group, np.unique(group, return_index=True)[1]


def _members(group: np.ndarray, first_var: int) -> list[list[VarIndex]]:
    """Per group, the s variables of the strategies in it."""
    members: list[list[VarIndex]] = [[] for _ in range(int(group.max()) + 1)]
    for k, g in enumerate(group.tolist()):
        members[g].append(first_var + k)
    return members


def _add_edge_costs(model: _Model, ticks_per_s: float) -> list[_EdgeVars]:  # (c), (d)
    edge_vars = []
    for u, v, matrix in model.red.edges:
        (rows, first_row), (cols, first_col) = _identical(matrix), _identical(matrix.T)
        grouped = matrix[np.ix_(first_row, first_col)]
        name = f"{model.names[u]}->{model.names[v]}"
        allowed_pair = np.isfinite(grouped)
        y = np.full(grouped.shape, -1, dtype=np.int64)
        pairs = np.argwhere(allowed_pair).tolist()
        y[allowed_pair] = _add_bools(model, [f"y[{name},{r},{c}]" for r, c in pairs]) + np.arange(len(pairs))
        for kind, members, lines in (("rows", _members(rows, model.s(u, 0)), y),
                                     ("cols", _members(cols, model.s(v, 0)), y.T)):
            for g, (line, s_vars) in enumerate(zip(lines, members)):
                ys = line[line >= 0].tolist()
                _add_linear(model, f"edge_{kind}[{name},{g}]", ys + s_vars, [1] * len(ys) + [-1] * len(s_vars), 0, 0)
        edge_vars.append(_EdgeVars(u, v, rows, cols, y, _to_ticks(grouped, ticks_per_s)))
    return edge_vars


def _memory_row(model: _Model, p: int) -> tuple[list[int], list[int]]:
    variables: list[int] = []
    coeffs: list[int] = []
    for node, nbytes in model.red.point_terms[p]:
        nonzero = np.flatnonzero(nbytes)
        variables += [model.s(node, a) for a in nonzero]
        coeffs += nbytes[nonzero].tolist()
    return variables, coeffs


def _add_memory_budget(model: _Model, budget_bytes: float) -> bool:  # (e)
    """Add (e); False if some point is over budget whatever the choices."""
    budget = math.floor(budget_bytes)
    for p, terms in enumerate(model.red.point_terms):
        room = budget - model.red.point_const[p]
        if room < 0:
            return False
        if sum(int(nbytes.max()) for _, nbytes in terms) > room:  # else it can never bind
            _add_linear(model, f"memory[{p}]", *_memory_row(model, p), 0, room)
    return True


def _add_peak_memory(model: _Model) -> VarIndex:  # (e')
    red = model.red
    lower = max(red.point_const, default=0)
    upper = max((red.point_const[p] + sum(int(b.max()) for _, b in terms) for p, terms in enumerate(red.point_terms)),
                default=0)
    peak = _add_var(model, lower, upper, "peak")
    for p in range(len(red.point_terms)):
        variables, coeffs = _memory_row(model, p)
        if variables:
            _add_linear(model, f"peak[{p}]", variables + [peak], coeffs + [-1], cp_model.INT_MIN, -red.point_const[p])
    return peak


def _add_charges(model: _Model) -> None:  # (g)
    for k, (_cost, members) in enumerate(model.red.charges):
        z = _add_bools(model, [f"z[charge {k}]"])
        model.charge_vars.append(z)
        for node, mask in members:
            if model.first_var[node] < 0:
                continue
            for a in np.flatnonzero(mask):
                _add_linear(model, f"charge[{k},{model.names[node]},{a}]", [model.s(node, int(a)), z], [1, -1],
                            cp_model.INT_MIN, 0)


def _charge_active(model: _Model, position: list[int]) -> list[bool]:
    return [any(position[node] >= 0 and bool(mask[position[node]]) for node, mask in members)
            for _cost, members in model.red.charges]


def _set_objective(model: _Model, ticks_per_s: float, edge_vars: list[_EdgeVars]) -> None:
    objective = model.proto.objective
    for z, (cost, _members) in zip(model.charge_vars, model.red.charges):
        ticks = int(_to_ticks(np.array([cost]), ticks_per_s)[0])
        if ticks:
            objective.vars.append(z)
            objective.coeffs.append(ticks)
    for i, first in enumerate(model.first_var):
        if first >= 0:
            ticks = _to_ticks(model.red.node_cost[i], ticks_per_s)
            nonzero = np.flatnonzero(ticks)
            objective.vars.extend((first + nonzero).tolist())
            objective.coeffs.extend(ticks[nonzero].tolist())
    for e in edge_vars:
        paid = (e.y >= 0) & (e.ticks > 0)
        objective.vars.extend(e.y[paid].tolist())
        objective.coeffs.extend(e.ticks[paid].tolist())


def _model_ticks(model: _Model, edge_vars: list[_EdgeVars], ticks_per_s: float, choices: np.ndarray) -> float:
    """The model's objective (ticks, without presolve's constants) at a plan free of forbidden choices."""
    position = [int(np.searchsorted(allowed, c)) for allowed, c in zip(model.red.allowed, choices)]
    ticks = sum(int(_to_ticks(model.red.node_cost[i], ticks_per_s)[position[i]])
                for i in range(len(position)) if model.first_var[i] >= 0)
    ticks += sum(int(_to_ticks(np.array([cost]), ticks_per_s)[0])
                 for (cost, _m), on in zip(model.red.charges, _charge_active(model, position)) if on)
    return float(ticks + sum(int(e.ticks[e.row_group[position[e.u]], e.col_group[position[e.v]]]) for e in edge_vars))


def _add_hint(model: _Model, hint: np.ndarray, edge_vars: list[_EdgeVars]) -> None:
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
    model.proto.solution_hint.vars.extend(variables)
    model.proto.solution_hint.values.extend(values)


# ---------------------------------------------------------------------------------------------
# solving


def _run(model: _Model, problem: IlpProblem) -> tuple[cp_model.CpSolver, int]:
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = problem.time_limit_s
    solver.parameters.random_seed = problem.seed
    solver.parameters.num_workers = problem.num_workers
    solver.parameters.linearization_level = 2  # LP cuts pay off on (c)-(d); measured 2x on ilp_scale
    solver.parameters.cp_model_probing_level = 0  # probing 100k+ y booleans costs more than it finds
    solver.parameters.hint_conflict_limit = 0  # a complete hint is taken as is; searching near it cost 2x
    status = solver.solve(model.cp)
    if status == cp_model.MODEL_INVALID:
        raise RuntimeError(f"internal error: invalid CP-SAT model: {model.cp.validate()}")
    return solver, status


def _decode(model: _Model, solver: cp_model.CpSolver) -> np.ndarray:
    values = np.asarray(solver.response_proto.solution, dtype=np.int64)
    choices = np.empty(len(model.first_var), dtype=np.int64)
    for i, (first, allowed) in enumerate(zip(model.first_var, model.red.allowed)):
        choices[i] = allowed[0] if first < 0 else allowed[int(np.argmax(values[first:first + len(allowed)]))]
    return choices


def _timeout_error(problem: IlpProblem, what: str) -> PlanningError:
    return PlanningError(f"CP-SAT found no {what} for {problem.num_nodes} nodes within time_limit_s="
                         f"{problem.time_limit_s:g}s, and could not prove there is none; raise time_limit_s")


def _forbidden_error(problem: IlpProblem) -> PlanningError:
    return PlanningError(f"no combination of strategies for the {problem.num_nodes} nodes avoids every forbidden "
                         "choice and pair (infinite costs); the strategy rules are inconsistent")


def _min_peak(problem: IlpProblem) -> tuple[int, np.ndarray]:
    """Smallest peak over plans free of forbidden choices, in the solver's whole bytes, and that plan."""
    model = _new_model(problem, red := presolve(problem))
    _add_one_hot(model)
    _add_forbidden_pairs(model)
    peak = _add_peak_memory(model)
    model.proto.objective.vars.append(peak)
    model.proto.objective.coeffs.append(1)
    solver, status = _run(model, problem)
    if status == cp_model.INFEASIBLE:
        raise _forbidden_error(problem)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise _timeout_error(problem, "plan free of forbidden choices")
    if status == cp_model.FEASIBLE:
        log.warning("min peak memory not proven minimal within time_limit_s=%gs", problem.time_limit_s)
    choices = _decode(model, solver)
    position = [int(np.searchsorted(allowed, c)) for allowed, c in zip(red.allowed, choices)]
    per_point = [red.point_const[p] + sum(int(b[position[node]]) for node, b in terms)
                 for p, terms in enumerate(red.point_terms)]
    return max(per_point, default=0), choices


# ---------------------------------------------------------------------------------------------
# entry points


def min_peak_memory(problem: IlpProblem) -> float:
    """The smallest ``memory_budget_bytes`` under which :func:`solve` finds a plan (bytes rounded up)."""
    return float(_min_peak(problem)[0])


def min_peak_plan(problem: IlpProblem) -> tuple[float, np.ndarray]:
    """(smallest peak, a plan that reaches it): the least memory any plan free of forbidden choices needs."""
    peak, choices = _min_peak(problem)
    return float(peak), choices


def _infeasible(problem: IlpProblem) -> PlanningError:
    if problem.memory_budget_bytes is None:
        return _forbidden_error(problem)
    smallest, choices = _min_peak(problem)
    return memory_error(problem, problem.memory_budget_bytes, float(smallest), choices)


def solve(problem: IlpProblem) -> IlpSolution:
    """Pick one strategy per node minimising node + edge seconds under the memory budget."""
    start = time.perf_counter()
    red = presolve(problem)
    model = _new_model(problem, red)
    _add_one_hot(model)
    ticks_per_s = _ticks_per_s(red)
    edge_vars = _add_edge_costs(model, ticks_per_s)
    _add_charges(model)
    budget = problem.memory_budget_bytes
    if budget is not None and not _add_memory_budget(model, budget):
        raise _infeasible(problem)
    _set_objective(model, ticks_per_s, edge_vars)
    if problem.hint is not None:
        improved = local_search(problem, np.asarray(problem.hint), seed=problem.seed)
        problem = dataclasses.replace(problem, hint=improved)
        _add_hint(model, np.asarray(problem.hint), edge_vars)
    built = time.perf_counter()
    solver, status = _run(model, problem)
    proto = model.proto
    log.debug("ilp: %d nodes (%d free), %d edges kept of %d; build %.2fs (%d variables, %d constraints), "
              "CP-SAT %.2fs: %s", problem.num_nodes, int((model.first_var >= 0).sum()), len(red.edges),
              len(problem.edges), built - start, len(proto.variables), len(proto.constraints),
              time.perf_counter() - built, solver.status_name(status))
    if status == cp_model.INFEASIBLE:
        raise _infeasible(problem)
    found = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    choices = _decode(model, solver) if found else None
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
        raise _timeout_error(problem, "plan")
    gap = 0.0
    if status != cp_model.OPTIMAL:
        gap_s = (_model_ticks(model, edge_vars, ticks_per_s, choices) - solver.best_objective_bound) / ticks_per_s
        if result.objective_s > 0:
            gap = max(gap_s, 0.0) / result.objective_s
        elif gap_s > 0:
            gap = np.inf
    return IlpSolution(choices, result.objective_s, "optimal" if status == cp_model.OPTIMAL else "feasible",
                       gap, time.perf_counter() - start, len(proto.variables), len(proto.constraints))
