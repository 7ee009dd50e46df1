"""Presolve of an IlpProblem (P1-P4 of the formulation in ``passes/ilp/cpsat.py``, and P5 below).

Exact: every plan left keeps its objective, and the optimum stays. P1 arc consistency, P2 constants
folded into their neighbours, P3 parallel edges summed and row/column minima moved into node costs,
P4 node costs shifted so each node's cheapest strategy costs 0: these drop only impossible choices; P5
drops strategies another strategy of the same node beats in every term (``dominated``), so a plan that
used one has a cheaper twin left. Shared reshards keep their nodes (fixed ones too) over the allowed
strategies. Liveness-point bytes are rounded up to
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
    # shared reshards over allowed strategies: (producer, costs [allowed of producer, layouts], readers
    # [(node, layout per allowed strategy)]); nodes fixed by presolve stay named (one allowed strategy)
    reshards: list[tuple[NodeIndex, np.ndarray, list[tuple[NodeIndex, np.ndarray]]]] = dataclasses.field(
        default_factory=list)
    # seconds every plan pays that the terms above leave out (each node's cheapest cost, charges a fixed node
    # incurs): a plan's objective is its cost over these terms plus ``const_s``
    const_s: float = 0.0


_ROW_WEIGHTS = np.random.default_rng(0).uniform(0.5, 1.5, size=4096)  # fingerprints of edge-matrix rows


def identical_lines(lines: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(group per row, first row of each group): equal rows of an edge matrix share a group (inf rows too)."""
    key = np.where(np.isfinite(lines), lines, -1.0) + 0.0  # R >= 0, so -1 marks inf; + 0.0 drops -0.0
    if key.shape[1] <= len(_ROW_WEIGHTS):  # fast path: group by a fingerprint, then check it exactly
        _, first, group = np.unique(key @ _ROW_WEIGHTS[:key.shape[1]], return_index=True, return_inverse=True)
        if np.array_equal(key[first][group.ravel()], key):
            return group.ravel(), first
    seen: dict[bytes, int] = {}
    group = np.array([seen.setdefault(line.tobytes(), len(seen)) for line in key], dtype=np.int64)
    return group, np.unique(group, return_index=True)[1]


def exclusion_cuts(excluded: tuple[tuple[np.ndarray, ...], ...], allowed: list[np.ndarray],
                   free: np.ndarray) -> list[list[tuple[int, np.ndarray]]] | None:
    """The no-good cuts (``IlpProblem.excluded``) over the reduced problem: per cut, the free nodes it names
    (those with marked and unmarked strategies left, ``free[i]``: node i is still a choice) with their marked
    positions among ``allowed``; a cut some node cannot take is left out (every plan satisfies it). None when
    a cut excludes every plan left (a cut whose marked strategies are the only ones left everywhere)."""
    cuts = []
    for masks in excluded:
        marked = [np.asarray(m, dtype=bool)[a] for m, a in zip(masks, allowed)]
        if not all(m.any() for m in marked):
            continue
        nodes = [i for i, m in enumerate(marked) if free[i] and not m.all()]
        if not nodes:
            return None
        cuts.append([(i, np.flatnonzero(marked[i])) for i in nodes])
    return cuts


def no_strategy_error(problem: IlpProblem, node: int) -> PlanningError:
    neighbours = sorted({problem.node_names[v if u == node else u] for u, v in problem.edges if node in (u, v)})
    return PlanningError(
        f"node {problem.node_names[node]!r} has no allowed strategy: each of its {len(problem.node_costs[node])} "
        f"strategies is forbidden by its own cost or by forbidden pairs on its edges (neighbours: "
        f"{', '.join(map(repr, neighbours[:8])) or 'none'}); check the strategy rules for these ops")


_WORSE_THAN_ANY = 1e300  # an infinite (forbidden) cost where dominance compares: worse than every finite one


def dominated(problem: IlpProblem, cost: list[np.ndarray], merged: dict[tuple[int, int], np.ndarray]
              ) -> list[np.ndarray]:
    """P5: per node, the allowed strategies another allowed strategy of the same node dominates, as a mask.

    Strategy a of node i is dominated by b when switching any plan from a to b costs nothing more whatever the
    other nodes choose: b's own cost is no higher, b's row of every edge is no higher against every allowed
    strategy of the neighbour, b needs no more bytes at any liveness point, b incurs no shared charge a does
    not, b makes every layout of a shared reshard it produces for no more, and as a reader b reads the layout a
    reads or none. Dropping a keeps the optimum (a plan using a is never cheaper than the one using b). Strict
    only: b must be cheaper somewhere; strategies equal in every term are all kept (either may be the plan)."""
    n = len(cost)
    columns: list[list[np.ndarray]] = [[np.asarray(c, dtype=np.float64)] for c in cost]  # larger = worse
    keys: list[list[np.ndarray]] = [[] for _ in range(n)]  # as reader: its layouts (-1: reads none priced)
    finite = [np.isfinite(c) for c in cost]
    for (u, v), matrix in merged.items():
        columns[u].append(matrix[:, finite[v]])
        columns[v].append(matrix[finite[u], :].T)
    for terms in problem.memory_points:
        for node, nbytes in terms:
            columns[node].append(np.asarray(nbytes, dtype=np.float64))
    for charge in problem.charges:
        for node, mask in charge.members:
            columns[node].append(np.asarray(mask, dtype=np.float64))
    for group in problem.reshards:
        columns[group.producer].append(np.asarray(group.costs, dtype=np.float64))
        for node, layout in group.readers:
            keys[node].append(np.asarray(layout, dtype=np.int64))
    out = []
    for i in range(n):
        alive = np.flatnonzero(finite[i])
        dead = np.zeros(len(cost[i]), dtype=bool)
        if len(alive) < 2:
            out.append(dead)
            continue
        terms = np.concatenate([c.reshape(len(cost[i]), -1) for c in columns[i]], axis=1)[alive]
        terms = np.where(np.isfinite(terms), terms, _WORSE_THAN_ANY)
        # no_worse[a, b]: b's terms <= a's everywhere; cheaper[a, b]: b's < a's somewhere
        no_worse = np.all(terms[:, None, :] >= terms[None, :, :], axis=2)
        cheaper = np.any(terms[:, None, :] > terms[None, :, :], axis=2)
        for layout in keys[i]:
            mine = layout[alive]
            no_worse &= (mine[None, :] == mine[:, None]) | (mine[None, :] < 0)
        dead[alive] = np.any(no_worse & cheaper, axis=1)
        out.append(dead)
    return out


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
        if not changed and not problem.excluded:  # P5, once P1 + P2 are done; no-good cuts name strategies
            for i, dead in enumerate(dominated(problem, cost, merged)):
                if dead.any():
                    cost[i][dead] = np.inf
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
    cheapest = [float(cost[i][allowed[i]].min()) for i in range(len(cost))]
    node_cost = [cost[i][allowed[i]] - cheapest[i] for i in range(len(cost))]  # P4
    const_s = math.fsum(cheapest)
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
        elif members:  # a fixed member incurs it (members are those some allowed choice of makes pay)
            const_s += float(charge.cost_s)
    reshards = []
    for group in problem.reshards:
        readers = [(node, np.asarray(layout, dtype=np.int64)[allowed[node]]) for node, layout in group.readers]
        readers = [(node, layout) for node, layout in readers if (layout >= 0).any()]
        costs = np.asarray(group.costs, dtype=np.float64)[allowed[group.producer]]
        if readers and costs.any():
            reshards.append((group.producer, costs, readers))
    return Reduced(allowed, node_cost, edges, point_terms, point_const, charges, reshards, const_s)
