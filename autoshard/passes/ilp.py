"""The intra-op sharding ILP as plain data in, plain data out (numpy + OR-Tools, no jax).

An :class:`IlpProblem` holds, per node, a cost per strategy; per edge, a cost
matrix over the two nodes' strategies; per liveness point, the bytes each
node's choice keeps alive. :func:`solve` picks one strategy per node with
CP-SAT; :func:`evaluate` recomputes any choice's cost and lists its
violations from the problem alone (tests call it on every solve);
:func:`brute_force` enumerates small problems; :func:`min_peak_memory` is the
smallest budget under which a plan exists.

Legend (single-letter names are used in this module only)
---------------------------------------------------------
    i, u, v   nodes (an edge e = (u, v));       a, b   strategies of u, of v
    s[i,a]    boolean: node i uses strategy a
    c[i,a]    node cost in seconds (inf: forbidden choice)
    C[e,a,b]  edge cost in seconds (inf: forbidden pair);  R[e] its reduced form (P3)
    A, B      a row group of R[e] (strategies of u with identical rows), a column group
    y[e,A,B]  boolean: edge e pays R[e,A,B]; only for allowed (finite) group pairs
    p         liveness point;  m[p,i,a] bytes;  K[p] constant bytes;  M budget bytes
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

Objective: minimize sum_{i,a} c[i,a] s[i,a] + sum_{e,A,B} R[e,A,B] y[e,A,B], in ticks.

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
on the tests' 80-node problem). The hint is given to CP-SAT (s and y, so it is complete); if it evaluates
better than the solver's plan, or the solver found none in time, the hint is returned:
the result is never worse than the hint.
"""
from __future__ import annotations

import dataclasses

import logging
import math
import time
from dataclasses import dataclass
from typing import Literal, TypeAlias

import numpy as np
from ortools.sat.python import cp_model

from autoshard.errors import InfeasibleMemoryError, PlanningError

__all__ = [
    "Evaluation", "IlpProblem", "IlpSolution", "InfeasibleMemoryError", "PlanningError",
    "brute_force", "evaluate", "min_peak_memory", "solve",
]

log = logging.getLogger(__name__)

NodeIndex: TypeAlias = int
VarIndex: TypeAlias = int  # index of a variable in the CP-SAT model proto
MemoryTerm: TypeAlias = tuple[NodeIndex, np.ndarray]  # (node, bytes per strategy)
SolveStatus: TypeAlias = Literal["optimal", "feasible"]

_TICKS_FOR_LARGEST_COST = 1e9
_BRUTE_FORCE_LIMIT = 1_000_000
_BYTES_REL_TOL = 1e-12  # float summation slack when comparing bytes with the budget
_ROW_WEIGHTS = np.random.default_rng(0).uniform(0.5, 1.5, size=4096)  # fingerprints of edge-matrix rows


@dataclass(frozen=True, eq=False)
class IlpProblem:
    node_names: tuple[str, ...]  # one per node, for errors and logs
    node_costs: tuple[np.ndarray, ...]  # node i: float64 seconds per strategy; np.inf = forbidden
    edges: tuple[tuple[NodeIndex, NodeIndex], ...]  # (u, v) with u != v; repeats are summed
    edge_costs: tuple[np.ndarray, ...]  # edge k: [len(node_costs[u]), len(node_costs[v])]; inf = forbidden pair
    memory_points: tuple[tuple[MemoryTerm, ...], ...]  # per liveness point; a node at most once per point
    memory_budget_bytes: float | None = None  # per device; None: unconstrained
    memory_constant_bytes: tuple[float, ...] = ()  # per point, bytes no choice changes; () = zeros
    hint: np.ndarray | None = None  # one strategy per node, e.g. the data-parallel plan
    time_limit_s: float = 30.0  # CP-SAT wall-clock limit
    seed: int = 0  # CP-SAT random seed
    num_workers: int = 1  # CP-SAT workers; 1 is deterministic, >1 runs CP-SAT's portfolio (not)

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def num_nodes(self) -> int:
        return len(self.node_costs)


@dataclass(frozen=True, eq=False)
class IlpSolution:
    choices: np.ndarray  # int64 strategy index per node
    objective_s: float  # recomputed in float from the choices, not the scaled integer objective
    status: SolveStatus
    gap: float  # relative optimality gap; 0 when optimal
    solve_s: float  # wall time of the whole call (presolve, build, CP-SAT)
    num_variables: int
    num_constraints: int


@dataclass(frozen=True)
class Evaluation:
    objective_s: float  # node_s + edge_s; inf if a choice is forbidden or out of range
    node_s: float
    edge_s: float
    memory_bytes: tuple[float, ...]  # per liveness point, constant included
    violations: tuple[str, ...]  # human-readable; empty when the choice is a valid plan


def _validate(problem: IlpProblem) -> None:
    n = len(problem.node_costs)
    if len(problem.node_names) != n:
        raise ValueError(f"{len(problem.node_names)} node names for {n} nodes")
    for i, costs in enumerate(problem.node_costs):
        costs = np.asarray(costs)
        if costs.ndim != 1 or costs.size == 0 or np.isnan(costs).any() or (costs == -np.inf).any():
            raise ValueError(f"node {problem.node_names[i]!r}: costs must be a non-empty 1-D array "
                             f"without nan or -inf, got {costs!r}")
    if len(problem.edge_costs) != len(problem.edges):
        raise ValueError(f"{len(problem.edge_costs)} edge cost matrices for {len(problem.edges)} edges")
    for k, ((u, v), matrix) in enumerate(zip(problem.edges, problem.edge_costs)):
        if not (0 <= u < n and 0 <= v < n) or u == v:
            raise ValueError(f"edge {k} = ({u}, {v}): endpoints must be two different nodes in [0, {n})")
        matrix = np.asarray(matrix)
        want = (len(problem.node_costs[u]), len(problem.node_costs[v]))
        if matrix.shape != want or np.isnan(matrix).any() or (matrix == -np.inf).any():
            raise ValueError(f"edge {k} ({problem.node_names[u]!r} -> {problem.node_names[v]!r}): cost matrix "
                             f"must have shape {want} without nan or -inf, got shape {matrix.shape}")
    for p, terms in enumerate(problem.memory_points):
        seen: set[int] = set()
        for node, nbytes in terms:
            if not 0 <= node < n or node in seen:
                raise ValueError(f"liveness point {p}: node {node} is out of range or appears twice")
            seen.add(node)
            nbytes = np.asarray(nbytes)
            if nbytes.shape != (len(problem.node_costs[node]),) or not np.isfinite(nbytes).all():
                raise ValueError(f"liveness point {p}, node {problem.node_names[node]!r}: bytes must be finite "
                                 f"with shape {(len(problem.node_costs[node]),)}, got {nbytes!r}")
    if problem.memory_constant_bytes and len(problem.memory_constant_bytes) != len(problem.memory_points):
        raise ValueError(f"{len(problem.memory_constant_bytes)} constants for {len(problem.memory_points)} points")
    if problem.hint is not None and np.shape(problem.hint) != (n,):
        raise ValueError(f"hint must have one strategy per node ({n}), got shape {np.shape(problem.hint)}")
    if problem.memory_budget_bytes is not None and not math.isfinite(problem.memory_budget_bytes):
        raise ValueError(f"memory_budget_bytes must be finite or None, got {problem.memory_budget_bytes}")
    if problem.time_limit_s <= 0 or problem.num_workers < 1:
        raise ValueError("time_limit_s must be > 0 and num_workers >= 1")


# ---------------------------------------------------------------------------------------------
# evaluate / brute force


def _point_constant(problem: IlpProblem, p: int) -> float:
    return float(problem.memory_constant_bytes[p]) if problem.memory_constant_bytes else 0.0


def _over_budget(total: float | np.ndarray, budget: float) -> bool | np.ndarray:
    return total > budget + _BYTES_REL_TOL * max(abs(budget), 1.0)


def evaluate(problem: IlpProblem, choices: np.ndarray) -> Evaluation:
    """Recompute the cost, per-point bytes and violations of ``choices`` from ``problem`` alone."""
    choices = np.asarray(choices)
    names = problem.node_names
    n = problem.num_nodes
    if choices.shape != (n,) or (n and not np.issubdtype(choices.dtype, np.integer)):
        return Evaluation(np.inf, np.inf, np.inf, (), (f"expected {n} integer choices, got {choices!r}",))
    violations: list[str] = []
    in_range = [0 <= int(choices[i]) < len(problem.node_costs[i]) for i in range(n)]
    node_s = 0.0
    for i, costs in enumerate(problem.node_costs):
        if not in_range[i]:
            violations.append(f"node {names[i]!r}: strategy {int(choices[i])} is out of range [0, {len(costs)})")
            node_s = np.inf
            continue
        cost = float(costs[choices[i]])
        if cost == np.inf:
            violations.append(f"node {names[i]!r}: strategy {int(choices[i])} is forbidden (infinite cost)")
        node_s += cost
    edge_s = 0.0
    for (u, v), matrix in zip(problem.edges, problem.edge_costs):
        if not (in_range[u] and in_range[v]):
            edge_s = np.inf
            continue
        cost = float(matrix[choices[u], choices[v]])
        if cost == np.inf:
            violations.append(f"edge {names[u]!r} -> {names[v]!r}: strategy pair "
                              f"({int(choices[u])}, {int(choices[v])}) is forbidden")
        edge_s += cost
    memory: list[float] = []
    for p, terms in enumerate(problem.memory_points):
        total = _point_constant(problem, p)
        for node, nbytes in terms:
            if in_range[node]:
                total += float(nbytes[choices[node]])
        memory.append(total)
        budget = problem.memory_budget_bytes
        if budget is not None and _over_budget(total, budget):
            violations.append(f"over budget at liveness point {p} by {total - budget:.0f} bytes "
                              f"({_format_bytes(total)} > {_format_bytes(budget)})")
    return Evaluation(node_s + edge_s, node_s, edge_s, tuple(memory), tuple(violations))


def brute_force(problem: IlpProblem, max_combinations: int = _BRUTE_FORCE_LIMIT) -> IlpSolution:
    """Enumerate every combination (vectorised); for tests. Ties go to the first combination."""
    start = time.perf_counter()
    sizes = tuple(len(c) for c in problem.node_costs)
    total = math.prod(sizes)
    if total > max_combinations:
        raise ValueError(f"brute force over {total:.3g} combinations refused (limit {max_combinations})")
    budget = problem.memory_budget_bytes
    best: tuple[float, np.ndarray | None] = (np.inf, None)
    lowest: tuple[float, np.ndarray | None] = (np.inf, None)  # min peak over plans free of forbidden choices
    for lo in range(0, total, 1 << 16):
        idx = np.arange(lo, min(lo + (1 << 16), total))
        choices = (np.stack(np.unravel_index(idx, sizes), axis=1) if sizes
                   else np.zeros((len(idx), 0), dtype=np.int64))
        objective = np.zeros(len(idx))
        for i, costs in enumerate(problem.node_costs):
            objective = objective + np.asarray(costs, dtype=np.float64)[choices[:, i]]
        for (u, v), matrix in zip(problem.edges, problem.edge_costs):
            objective = objective + np.asarray(matrix, dtype=np.float64)[choices[:, u], choices[:, v]]
        peak = np.full(len(idx), -np.inf if problem.memory_points else 0.0)
        for p, terms in enumerate(problem.memory_points):
            point = np.full(len(idx), _point_constant(problem, p))
            for node, nbytes in terms:
                point = point + np.asarray(nbytes, dtype=np.float64)[choices[:, node]]
            peak = np.maximum(peak, point)
        allowed = np.isfinite(objective)
        if allowed.any():
            j = int(np.argmin(np.where(allowed, peak, np.inf)))
            if peak[j] < lowest[0]:
                lowest = (float(peak[j]), choices[j])
        fits = allowed & ~_over_budget(peak, budget) if budget is not None and problem.memory_points else allowed
        if fits.any():
            j = int(np.argmin(np.where(fits, objective, np.inf)))
            if objective[j] < best[0]:
                best = (float(objective[j]), choices[j])
    if lowest[1] is None:
        raise PlanningError(f"no combination of strategies for the {problem.num_nodes} nodes avoids every "
                            "forbidden choice and pair; the strategy rules are inconsistent")
    if best[1] is None:
        assert budget is not None
        raise _memory_error(problem, budget, lowest[0], lowest[1])
    choices = best[1].astype(np.int64)
    return IlpSolution(choices, evaluate(problem, choices).objective_s, "optimal", 0.0,
                       time.perf_counter() - start, 0, 0)


def _format_bytes(nbytes: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= 0.1 * size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes:.0f} B"


def _memory_error(problem: IlpProblem, budget: float, smallest: float,
                  choices: np.ndarray) -> InfeasibleMemoryError:
    """The error for "nothing fits in ``budget``", given the plan that peaks lowest."""
    memory = evaluate(problem, choices).memory_bytes
    point = int(np.argmax(memory)) if memory else None
    where = "there are no liveness points"
    if point is not None:
        where = f"at liveness point {point}"
        terms = [(float(nbytes[choices[node]]), node) for node, nbytes in problem.memory_points[point]]
        if terms:
            top_bytes, top = max(terms)
            where += f", where the largest term is {problem.node_names[top]!r} with {_format_bytes(top_bytes)}"
    return InfeasibleMemoryError(
        f"no plan fits in {_format_bytes(budget)} per device; the smallest budget that fits is "
        f"{_format_bytes(smallest)} ({where}); raise memory_budget or use more devices",
        smallest, budget_bytes=budget, liveness_point=point)


# ---------------------------------------------------------------------------------------------
# presolve (P1-P4)


@dataclass
class _Reduced:
    """The problem after presolve, over the strategies still allowed."""
    allowed: list[np.ndarray]  # per node: original strategy indices still allowed (sorted)
    node_cost: list[np.ndarray]  # per node: seconds over `allowed`, cheapest = 0
    edges: list[tuple[NodeIndex, NodeIndex, np.ndarray]]  # (u, v, R) over allowed x allowed; inf = forbidden
    point_terms: list[list[tuple[NodeIndex, np.ndarray]]]  # per point: int64 bytes over allowed, min = 0
    point_const: list[int]  # per point: whole bytes fixed by presolve (K rounded up + shifted minima)


def _no_strategy_error(problem: IlpProblem, node: int) -> PlanningError:
    neighbours = sorted({problem.node_names[v if u == node else u] for u, v in problem.edges if node in (u, v)})
    return PlanningError(
        f"node {problem.node_names[node]!r} has no allowed strategy: each of its {len(problem.node_costs[node])} "
        f"strategies is forbidden by its own cost or by forbidden pairs on its edges (neighbours: "
        f"{', '.join(map(repr, neighbours[:8])) or 'none'}); check the strategy rules for these ops")


def _presolve(problem: IlpProblem) -> _Reduced:
    cost = [np.array(c, dtype=np.float64) for c in problem.node_costs]
    merged: dict[tuple[int, int], np.ndarray] = {}
    for (u, v), matrix in zip(problem.edges, problem.edge_costs):
        matrix = np.asarray(matrix, dtype=np.float64)
        if u > v:
            u, v, matrix = v, u, matrix.T
        merged[(u, v)] = merged[(u, v)] + matrix if (u, v) in merged else matrix.copy()
    for i, c in enumerate(cost):
        if not np.isfinite(c).any():
            raise _no_strategy_error(problem, i)
    changed = True
    while changed:  # P1 + P2 until nothing moves
        changed = False
        for (u, v) in list(merged):
            matrix = merged[(u, v)]
            ok = np.isfinite(matrix) & np.isfinite(cost[u])[:, None] & np.isfinite(cost[v])[None, :]
            for node, dead in ((u, ~ok.any(axis=1)), (v, ~ok.any(axis=0))):
                dead &= np.isfinite(cost[node])
                if dead.any():
                    cost[node][dead] = np.inf
                    changed = True
                if not np.isfinite(cost[node]).any():
                    raise _no_strategy_error(problem, node)
            left_u, left_v = np.flatnonzero(np.isfinite(cost[u])), np.flatnonzero(np.isfinite(cost[v]))
            if len(left_u) == 1:
                cost[v] = cost[v] + matrix[left_u[0], :]
            elif len(left_v) == 1:
                cost[u] = cost[u] + matrix[:, left_v[0]]
            else:
                continue
            del merged[(u, v)]
            changed = True
    allowed = [np.flatnonzero(np.isfinite(c)) for c in cost]
    edges = []
    for (u, v), matrix in merged.items():  # P3
        sub = matrix[np.ix_(allowed[u], allowed[v])]
        finite = np.isfinite(sub)
        row_min = np.where(finite, sub, np.inf).min(axis=1)
        sub = sub - row_min[:, None]
        col_min = np.where(finite, sub, np.inf).min(axis=0)
        sub = sub - col_min[None, :]
        cost[u][allowed[u]] += row_min
        cost[v][allowed[v]] += col_min
        if not finite.all() or sub.any():
            edges.append((u, v, sub))
    node_cost = [cost[i][allowed[i]] - cost[i][allowed[i]].min() for i in range(len(cost))]  # P4
    point_terms, point_const = [], []
    for p, terms in enumerate(problem.memory_points):
        const = math.ceil(_point_constant(problem, p))
        kept = []
        for node, nbytes in terms:
            whole = np.ceil(np.asarray(nbytes, dtype=np.float64)[allowed[node]]).astype(np.int64)
            low = int(whole.min())
            const += low
            if (whole > low).any():
                kept.append((node, whole - low))
        point_terms.append(kept)
        point_const.append(const)
    return _Reduced(allowed, node_cost, edges, point_terms, point_const)


def _to_ticks(seconds: np.ndarray, ticks_per_s: float) -> np.ndarray:
    """Integer ticks; inf becomes 0 (a forbidden entry gets no variable); a positive cost stays >= 1."""
    finite = np.isfinite(seconds)
    ticks = np.round(np.where(finite, seconds, 0.0) * ticks_per_s).astype(np.int64)
    ticks[(ticks == 0) & finite & (seconds > 0)] = 1
    return ticks


# ---------------------------------------------------------------------------------------------
# model builders, one per constraint family


@dataclass
class _Model:
    """A CP-SAT model under construction and where each node's booleans s[i, .] live in it."""
    cp: cp_model.CpModel
    red: _Reduced
    names: tuple[str, ...]
    first_var: np.ndarray  # per node: proto index of s[i, 0]; -1 for a node fixed by presolve
    num_vars: int = 0

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


def _new_model(problem: IlpProblem, red: _Reduced) -> _Model:
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


def _set_objective(model: _Model, ticks_per_s: float, edge_vars: list[_EdgeVars]) -> None:
    objective = model.proto.objective
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
    model = _new_model(problem, red := _presolve(problem))
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


def min_peak_memory(problem: IlpProblem) -> float:
    """The smallest ``memory_budget_bytes`` under which :func:`solve` finds a plan (bytes rounded up)."""
    return float(_min_peak(problem)[0])


def _infeasible(problem: IlpProblem) -> PlanningError:
    if problem.memory_budget_bytes is None:
        return _forbidden_error(problem)
    smallest, choices = _min_peak(problem)
    return _memory_error(problem, problem.memory_budget_bytes, float(smallest), choices)


def solve(problem: IlpProblem) -> IlpSolution:
    """Pick one strategy per node minimising node + edge seconds under the memory budget."""
    start = time.perf_counter()
    red = _presolve(problem)
    model = _new_model(problem, red)
    _add_one_hot(model)
    largest = max([float(c.max()) for c in red.node_cost]
                  + [float(m[np.isfinite(m)].max(initial=0.0)) for _, _, m in red.edges], default=0.0)
    ticks_per_s = _TICKS_FOR_LARGEST_COST / largest if largest > 0 else 1.0
    edge_vars = _add_edge_costs(model, ticks_per_s)
    budget = problem.memory_budget_bytes
    if budget is not None and not _add_memory_budget(model, budget):
        raise _infeasible(problem)
    _set_objective(model, ticks_per_s, edge_vars)
    if problem.hint is not None:
        from autoshard.passes.ilp_search import local_search  # imports this module: keep it lazy

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
