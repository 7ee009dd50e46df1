"""The intra-op sharding ILP as plain data in, plain data out (numpy + OR-Tools, no jax).

An :class:`IlpProblem` holds, per node, a cost per strategy; per edge, a cost
matrix over the two nodes' strategies; per liveness point, the bytes each
node's choice keeps alive. :func:`solve` picks one strategy per node with
HiGHS or CP-SAT; :func:`evaluate` recomputes any choice's cost and lists its
violations from the problem alone (tests call it on every solve);
:func:`brute_force` enumerates small problems; :func:`min_peak_memory` is the
smallest budget under which a plan exists.

This module is the solver boundary: the problem and solution types, their
validation, ``evaluate``, ``brute_force`` and the memory error. The two backends
(HiGHS in ``passes/ilp/mip.py``, the default; CP-SAT in ``passes/ilp/cpsat.py``,
whose docstring writes out the formulation and its legend) sit behind the entry
points ``solve`` and ``min_peak_memory`` of ``passes/ilp/solvers.py``; the presolve
P1-P4 in ``passes/ilp/presolve.py``.

``solve`` first improves the hint by local search (``passes/ilp/search.py``) and
gives it to the backend; if it evaluates better than the solver's plan, or the solver
found none in time, the hint is returned: the result is never worse than the hint.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Literal, TypeAlias

import numpy as np

from autoshard.errors import InfeasibleMemoryError, PlanningError

__all__ = ["Evaluation", "IlpProblem", "IlpSolution", "SharedCharge", "SharedReshard", "brute_force", "evaluate",
           "exhaustive",
           "format_bytes", "memory_error"]

log = logging.getLogger(__name__)

NodeIndex: TypeAlias = int
MemoryTerm: TypeAlias = tuple[NodeIndex, np.ndarray]  # (node, bytes per strategy)
ChargeMember: TypeAlias = tuple[NodeIndex, np.ndarray]  # (node, bool per strategy: this choice incurs the charge)


@dataclass(frozen=True, eq=False)
class SharedCharge:
    """A cost paid once if any member takes a marked strategy (one combined collective's latency)."""

    name: str
    cost_s: float
    members: tuple[ChargeMember, ...]

    def active(self, choices: np.ndarray) -> bool:
        return any(bool(mask[choices[node]]) for node, mask in self.members)


ReshardReader: TypeAlias = tuple[NodeIndex, np.ndarray]  # (node, layout index per strategy; -1: reads no copy)


@dataclass(frozen=True, eq=False)
class SharedReshard:
    """A value read by several nodes, each in the layout its strategy needs: every distinct layout they read
    it in is made once from the producer's (XLA's common-subexpression elimination), however many read it.

    Cost = sum over the distinct layouts l the readers' choices name of ``costs[producer's choice, l]``."""

    name: str
    producer: NodeIndex
    costs: np.ndarray  # [len(node_costs[producer]), num_layouts] seconds to make layout l from strategy a
    readers: tuple[ReshardReader, ...]

    def layouts(self, choices: np.ndarray) -> set[int]:
        return {int(layout[choices[node]]) for node, layout in self.readers if layout[choices[node]] >= 0}

    def cost_s(self, choices: np.ndarray) -> float:
        return float(sum(self.costs[choices[self.producer], l] for l in self.layouts(choices)))


SolveStatus: TypeAlias = Literal["optimal", "feasible", "least-memory", "start"]
SolverName: TypeAlias = Literal["mip", "cpsat"]

_BRUTE_FORCE_LIMIT = 1_000_000
_BYTES_REL_TOL = 1e-12  # float summation slack when comparing bytes with the budget


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
    charges: tuple[SharedCharge, ...] = ()  # costs paid once when any member choice is taken
    reshards: tuple[SharedReshard, ...] = ()  # values read by several nodes: each distinct layout made once
    time_limit_s: float = 30.0  # CP-SAT wall-clock limit
    seed: int = 0  # CP-SAT random seed
    num_workers: int = 1  # CP-SAT workers; 1 is deterministic, >1 runs CP-SAT's portfolio (not)
    solver: SolverName = "mip"  # "mip": HiGHS (passes/ilp/mip.py); "cpsat": OR-Tools CP-SAT (passes/ilp/cpsat.py)
    # no-good cuts: each a bool mask per node over its strategies; a plan choosing a marked strategy at every
    # node is excluded (passes/ilp/candidates.py: the next-best plans)
    excluded: tuple[tuple[np.ndarray, ...], ...] = ()
    # the objective a plan must beat to matter (the best found elsewhere); HiGHS stops with CutOffError once its
    # bound proves no plan does (passes/ilp/mip.py); None: solved as usual
    cutoff_s: float | None = None

    def excluded_by(self, choices: np.ndarray) -> int | None:
        """The index of the first cut that excludes ``choices`` (None: none does)."""
        return next((k for k, masks in enumerate(self.excluded)
                     if all(bool(m[int(c)]) for m, c in zip(masks, choices))), None)

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def num_nodes(self) -> int:
        return len(self.node_costs)

    def point_constant(self, p: int) -> float:
        """Bytes at liveness point ``p`` that no choice changes."""
        return float(self.memory_constant_bytes[p]) if self.memory_constant_bytes else 0.0


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
    objective_s: float  # node_s + edge_s + charge_s + reshard_s; inf if a choice is forbidden or out of range
    node_s: float
    edge_s: float
    memory_bytes: tuple[float, ...]  # per liveness point, constant included
    violations: tuple[str, ...]  # human-readable; empty when the choice is a valid plan
    charge_s: float = 0.0  # shared charges incurred
    reshard_s: float = 0.0  # shared reshards: each distinct layout a value is read in, made once


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
    for charge in problem.charges:
        if not (math.isfinite(charge.cost_s) and charge.cost_s >= 0):
            raise ValueError(f"charge {charge.name!r}: cost must be finite and >= 0, got {charge.cost_s}")
        for node, mask in charge.members:
            if not 0 <= node < n or np.shape(mask) != (len(problem.node_costs[node]),):
                raise ValueError(f"charge {charge.name!r}: member {node} must be a node with one flag per strategy")
    for group in problem.reshards:
        costs = np.asarray(group.costs)
        if not 0 <= group.producer < n or costs.ndim != 2 or costs.shape[0] != len(problem.node_costs[group.producer]) \
                or not np.isfinite(costs).all() or (costs < 0).any():
            raise ValueError(f"shared reshard {group.name!r}: costs must be finite, >= 0, one row per strategy of "
                             f"its producer, got shape {costs.shape}")
        for node, layout in group.readers:
            if not 0 <= node < n or np.shape(layout) != (len(problem.node_costs[node]),) \
                    or (np.asarray(layout) >= costs.shape[1]).any():
                raise ValueError(f"shared reshard {group.name!r}: reader {node} needs one layout index per strategy "
                                 f"below {costs.shape[1]}")
    if any(len(masks) != n or any(np.shape(m) != np.shape(c) for m, c in zip(masks, problem.node_costs))
           for masks in problem.excluded):
        raise ValueError("each excluded set needs one mask per node, with one flag per strategy")
    if problem.time_limit_s <= 0 or problem.num_workers < 1:
        raise ValueError("time_limit_s must be > 0 and num_workers >= 1")
    if problem.solver not in ("mip", "cpsat"):
        raise ValueError(f"solver must be 'mip' or 'cpsat', got {problem.solver!r}")


# ---------------------------------------------------------------------------------------------
# evaluate / brute force


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
        total = problem.point_constant(p)
        for node, nbytes in terms:
            if in_range[node]:
                total += float(nbytes[choices[node]])
        memory.append(total)
        budget = problem.memory_budget_bytes
        if budget is not None and _over_budget(total, budget):
            violations.append(f"over budget at liveness point {p} by {total - budget:.0f} bytes "
                              f"({format_bytes(total)} > {format_bytes(budget)})")
    charge_s = reshard_s = 0.0
    if all(in_range) and (cut := problem.excluded_by(choices)) is not None:
        violations.append(f"the plan is excluded by no-good cut {cut}")
    if all(in_range):
        charge_s = float(sum(c.cost_s for c in problem.charges if c.active(choices)))
        reshard_s = float(sum(group.cost_s(choices) for group in problem.reshards))
    return Evaluation(node_s + edge_s + charge_s + reshard_s, node_s, edge_s, tuple(memory), tuple(violations),
                      charge_s, reshard_s)


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
        for charge in problem.charges:
            active = np.zeros(len(idx), dtype=bool)
            for node, mask in charge.members:
                active |= np.asarray(mask, dtype=bool)[choices[:, node]]
            objective = objective + charge.cost_s * active
        objective = objective + _reshard_costs(problem, choices)
        for masks in problem.excluded:
            hit = np.ones(len(idx), dtype=bool)
            for i, mask in enumerate(masks):
                hit &= np.asarray(mask, dtype=bool)[choices[:, i]]
            objective = np.where(hit, np.inf, objective)
        peak = np.full(len(idx), -np.inf if problem.memory_points else 0.0)
        for p, terms in enumerate(problem.memory_points):
            point = np.full(len(idx), problem.point_constant(p))
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
        raise memory_error(problem, budget, lowest[0], lowest[1])
    choices = best[1].astype(np.int64)
    return IlpSolution(choices, evaluate(problem, choices).objective_s, "optimal", 0.0,
                       time.perf_counter() - start, 0, 0)


def _reshard_costs(problem: IlpProblem, choices: np.ndarray) -> np.ndarray:
    """Per row of ``choices`` (combinations x nodes), the shared reshards' seconds."""
    total = np.zeros(len(choices))
    for group in problem.reshards:
        used = np.zeros((len(choices), group.costs.shape[1]), dtype=bool)
        for node, layout in group.readers:
            picked = np.asarray(layout)[choices[:, node]]
            rows = np.flatnonzero(picked >= 0)
            used[rows, picked[rows]] = True
        total += (np.asarray(group.costs)[choices[:, group.producer]] * used).sum(axis=1)
    return total


def exhaustive(problem: IlpProblem, max_combinations: int = _BRUTE_FORCE_LIMIT) -> IlpSolution:
    """The exact optimum without a memory budget, by enumeration; for tests of problems ``brute_force``
    cannot enumerate whole. An independent set of nodes free of charges ("leaves": no edge between two
    of them, no shared reshard they produce, at most one of them reading any shared reshard) is not
    enumerated: given every other node's strategy, each leaf's best strategy depends on its own cost,
    its edges and what its reads add to the shared reshards alone, so taking it per combination is
    exact. Ties go to the first."""
    start = time.perf_counter()
    if problem.memory_budget_bytes is not None:
        raise ValueError("exhaustive() is for problems without a memory budget; use brute_force()")
    blocked = {node for c in problem.charges for node, _mask in c.members}
    blocked |= {group.producer for group in problem.reshards}
    neighbours: list[set[int]] = [set() for _ in problem.node_costs]
    for u, v in problem.edges:
        neighbours[u].add(v)
        neighbours[v].add(u)
    for group in problem.reshards:  # two readers of one group are not both leaves
        members = {r for r, _ in group.readers}
        for r in members:
            neighbours[r] |= members - {r}
    leaves: list[int] = []
    for node in sorted(range(problem.num_nodes), key=lambda i: -len(problem.node_costs[i])):
        if node not in blocked and not neighbours[node] & set(leaves):
            leaves.append(node)
    leaf_set = set(leaves)
    enumerated = [i for i in range(problem.num_nodes) if i not in leaf_set]
    sizes = tuple(len(problem.node_costs[i]) for i in enumerated)
    total = math.prod(sizes)
    if total > max_combinations:
        raise ValueError(f"exhaustive search over {total:.3g} combinations refused (limit {max_combinations})")
    position = {node: k for k, node in enumerate(enumerated)}
    best: tuple[float, np.ndarray | None] = (np.inf, None)
    for lo in range(0, total, 1 << 14):
        idx = np.arange(lo, min(lo + (1 << 14), total))
        picked = (np.stack(np.unravel_index(idx, sizes), axis=1) if sizes
                  else np.zeros((len(idx), 0), dtype=np.int64))
        choices = np.zeros((len(idx), problem.num_nodes), dtype=np.int64)
        choices[:, enumerated] = picked
        objective = np.zeros(len(idx))
        for node in enumerated:
            objective = objective + np.asarray(problem.node_costs[node], dtype=np.float64)[choices[:, node]]
        leaf_cost = {leaf: np.broadcast_to(np.asarray(problem.node_costs[leaf], dtype=np.float64),
                                           (len(idx), len(problem.node_costs[leaf]))).copy() for leaf in leaves}
        for (u, v), matrix in zip(problem.edges, problem.edge_costs):
            matrix = np.asarray(matrix, dtype=np.float64)
            if u in position and v in position:
                objective = objective + matrix[choices[:, u], choices[:, v]]
            elif u in position:
                leaf_cost[v] += matrix[choices[:, u], :]
            else:
                leaf_cost[u] += matrix[:, choices[:, v]].T
        for group in problem.reshards:
            costs = np.asarray(group.costs, dtype=np.float64)[choices[:, group.producer]]  # [combinations, layouts]
            used = np.zeros(costs.shape, dtype=bool)
            for node, layout in group.readers:
                if node in position:
                    picked_layout = np.asarray(layout)[choices[:, node]]
                    rows = np.flatnonzero(picked_layout >= 0)
                    used[rows, picked_layout[rows]] = True
            objective = objective + (costs * used).sum(axis=1)
            for node, layout in group.readers:  # a leaf reader adds its layout when no one else reads it
                if node in leaf_set:
                    layout = np.asarray(layout)
                    extra = np.where(layout >= 0, costs[:, np.maximum(layout, 0)], 0.0)
                    fresh = ~used[:, np.maximum(layout, 0)] & (layout >= 0)
                    leaf_cost[node] += extra * fresh
        for leaf, table in leaf_cost.items():
            choices[:, leaf] = np.argmin(table, axis=1)
            objective = objective + table[np.arange(len(idx)), choices[:, leaf]]
        for charge in problem.charges:
            active = np.zeros(len(idx), dtype=bool)
            for node, mask in charge.members:
                active |= np.asarray(mask, dtype=bool)[choices[:, node]]
            objective = objective + charge.cost_s * active
        j = int(np.argmin(objective))
        if objective[j] < best[0]:
            best = (float(objective[j]), choices[j].copy())
    if best[1] is None:
        raise PlanningError(f"no combination of strategies for the {problem.num_nodes} nodes avoids every "
                            "forbidden choice and pair; the strategy rules are inconsistent")
    return IlpSolution(best[1], evaluate(problem, best[1]).objective_s, "optimal", 0.0,
                       time.perf_counter() - start, 0, 0)


def format_bytes(nbytes: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= 0.1 * size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes:.0f} B"


def memory_error(problem: IlpProblem, budget: float, smallest: float,
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
            where += f", where the largest term is {problem.node_names[top]!r} with {format_bytes(top_bytes)}"
    return InfeasibleMemoryError(
        f"no plan fits in {format_bytes(budget)} per device; the smallest budget that fits is "
        f"{format_bytes(smallest)} ({where}); raise memory_budget or use more devices",
        smallest, budget_bytes=budget, liveness_point=point)
