"""Presolve of an IlpProblem (P1-P4 of the formulation in ``passes/ilp/cpsat.py``).

Exact: every plan keeps its objective; only impossible choices go. P1 arc consistency, P2 constants
folded into their neighbours, P3 parallel edges summed and row/column minima moved into node costs,
P4 node costs shifted so each node's cheapest strategy costs 0. Liveness-point bytes are rounded up to
whole bytes with their fixed part moved into the point constants; shared charges keep the members that
can still incur them (one a fixed node incurs is a constant and leaves the model).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from autoshard.errors import PlanningError
from autoshard.passes.ilp.problem import IlpProblem, NodeIndex


@dataclass
class Reduced:
    """The problem after presolve, over the strategies still allowed."""
    allowed: list[np.ndarray]  # per node: original strategy indices still allowed (sorted)
    node_cost: list[np.ndarray]  # per node: seconds over `allowed`, cheapest = 0
    edges: list[tuple[NodeIndex, NodeIndex, np.ndarray]]  # (u, v, R) over allowed x allowed; inf = forbidden
    point_terms: list[list[tuple[NodeIndex, np.ndarray]]]  # per point: int64 bytes over allowed, min = 0
    point_const: list[int]  # per point: whole bytes fixed by presolve (K rounded up + shifted minima)
    # shared charges still open: (seconds, [(node, bool over allowed)]) with some free member choice incurring
    # it and none fixed on it (a charge a fixed node incurs is a constant; one no allowed choice incurs is gone)
    charges: list[tuple[float, list[tuple[NodeIndex, np.ndarray]]]] = dataclasses.field(default_factory=list)


def no_strategy_error(problem: IlpProblem, node: int) -> PlanningError:
    neighbours = sorted({problem.node_names[v if u == node else u] for u, v in problem.edges if node in (u, v)})
    return PlanningError(
        f"node {problem.node_names[node]!r} has no allowed strategy: each of its {len(problem.node_costs[node])} "
        f"strategies is forbidden by its own cost or by forbidden pairs on its edges (neighbours: "
        f"{', '.join(map(repr, neighbours[:8])) or 'none'}); check the strategy rules for these ops")


def presolve(problem: IlpProblem) -> Reduced:
    cost = [np.array(c, dtype=np.float64) for c in problem.node_costs]
    merged: dict[tuple[int, int], np.ndarray] = {}
    for (u, v), matrix in zip(problem.edges, problem.edge_costs):
        matrix = np.asarray(matrix, dtype=np.float64)
        if u > v:
            u, v, matrix = v, u, matrix.T
        merged[(u, v)] = merged[(u, v)] + matrix if (u, v) in merged else matrix.copy()
    for i, c in enumerate(cost):
        if not np.isfinite(c).any():
            raise no_strategy_error(problem, i)
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
                    raise no_strategy_error(problem, node)
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
        const = math.ceil(problem.point_constant(p))
        kept = []
        for node, nbytes in terms:
            whole = np.ceil(np.asarray(nbytes, dtype=np.float64)[allowed[node]]).astype(np.int64)
            low = int(whole.min())
            const += low
            if (whole > low).any():
                kept.append((node, whole - low))
        point_terms.append(kept)
        point_const.append(const)
    charges = []
    for charge in problem.charges:
        members = [(node, np.asarray(mask, dtype=bool)[allowed[node]]) for node, mask in charge.members]
        members = [(node, mask) for node, mask in members if mask.any()]
        if members and not any(len(allowed[node]) == 1 for node, _ in members):
            charges.append((float(charge.cost_s), members))
    return Reduced(allowed, node_cost, edges, point_terms, point_const, charges)
