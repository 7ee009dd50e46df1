"""Local search on an IlpProblem: a better starting plan for CP-SAT, and HiGHS's rescue when it stops at
its time limit without a proof; found in a second or two.

Iterated conditional modes (ICM): visit the nodes and give each the strategy
that minimises its node cost plus its edges to the neighbours' current
strategies, until no node changes; then iterated local search: re-draw a random
subset of nodes, run ICM again, keep the result when it is cheaper and within
the memory budget. The iteration count, not a clock, bounds the work and the
RNG is seeded, so the same problem always gives the same plan.

On the GPT example the greedy data-parallel start costs 8.3 ms under the
model, ICM alone brings it to 6.4 ms and 300 rounds of ILS to 5.7 ms (the
optimum is about 5.2 ms); CP-SAT alone, hinted with the greedy start, did not
improve on it in 30 s. CP-SAT then starts from the ILS plan.
"""
from __future__ import annotations

import collections
import time

import numpy as np

from autoshard.passes.ilp.problem import IlpProblem, evaluate

_FORBIDDEN = 1e30  # stands for inf inside the search; never chosen when any finite option exists


def _neighbours(problem: IlpProblem) -> list[list[tuple[int, np.ndarray]]]:
    nb: list[list[tuple[int, np.ndarray]]] = [[] for _ in problem.node_costs]
    for (u, v), matrix in zip(problem.edges, problem.edge_costs):
        finite = np.where(np.isfinite(matrix), matrix, _FORBIDDEN)
        nb[u].append((v, finite))
        nb[v].append((u, finite.T))
    return nb


class _Charges:
    """Shared charges as the search sees them: per node, the charges it can incur, and how many members
    incur each one now (a charge costs a move only when no other member pays it)."""

    def __init__(self, problem: IlpProblem) -> None:
        self.cost = np.array([c.cost_s for c in problem.charges], dtype=float)
        self.of_node: list[list[tuple[int, np.ndarray]]] = [[] for _ in problem.node_costs]
        for k, charge in enumerate(problem.charges):
            for node, mask in charge.members:
                self.of_node[node].append((k, np.asarray(mask, dtype=bool)))
        self.members = [[node for node, _ in charge.members] for charge in problem.charges]
        self.active = np.zeros(len(self.cost), dtype=np.int64)

    def reset(self, x: np.ndarray) -> None:
        self.active[:] = 0
        for node, charges in enumerate(self.of_node):
            for k, mask in charges:
                self.active[k] += int(mask[x[node]])

    def move_cost(self, i: int, current: int) -> np.ndarray | float:
        """Per strategy of node i: the charges it would add, the others' choices held."""
        extra: np.ndarray | float = 0.0
        for k, mask in self.of_node[i]:
            if self.active[k] - int(mask[current]) == 0:
                extra = extra + self.cost[k] * mask
        return extra

    def moved(self, i: int, old: int, new: int) -> list[int]:
        """Update the counts; the members whose move costs changed."""
        touched: list[int] = []
        for k, mask in self.of_node[i]:
            delta = int(mask[new]) - int(mask[old])
            if delta:
                before = self.active[k]
                self.active[k] += delta
                if (before == 0) != (self.active[k] == 0) or min(before, self.active[k]) == 1:
                    touched += self.members[k]
        return touched


class _Reshards:
    """Shared reshards as the search sees them: per node, the groups it produces or reads, and what a move
    of it costs in them with every other node held."""

    def __init__(self, problem: IlpProblem) -> None:
        self.groups = problem.reshards
        self.of_node: list[list[int]] = [[] for _ in problem.node_costs]
        for k, group in enumerate(self.groups):
            for node in {group.producer, *(r for r, _ in group.readers)}:
                self.of_node[node].append(k)
        self.members = [sorted({g.producer, *(r for r, _ in g.readers)}) for g in self.groups]

    def move_cost(self, i: int, x: np.ndarray, size: int) -> np.ndarray | float:
        extra: np.ndarray | float = 0.0
        for k in self.of_node[i]:
            group = self.groups[k]
            layouts = group.costs.shape[1]
            used = np.zeros((size, layouts), dtype=bool)
            for node, layout in group.readers:
                if node == i:
                    ok = np.flatnonzero(layout >= 0)
                    used[ok, layout[ok]] = True
                elif layout[x[node]] >= 0:
                    used[:, layout[x[node]]] = True
            rows = group.costs if group.producer == i else group.costs[x[group.producer]][None, :]
            extra = extra + (rows * used).sum(axis=1)
        return extra


def _icm(x: np.ndarray, costs: list[np.ndarray], nb: list[list[tuple[int, np.ndarray]]],
         order: np.ndarray | list[int], charges: _Charges | None = None,
         reshards: _Reshards | None = None) -> np.ndarray:
    """Greedy single-node moves until none improves; a node is revisited only when a neighbour changed."""
    queue = collections.deque(int(i) for i in order)
    queued = np.zeros(len(costs), dtype=bool)
    queued[list(queue)] = True
    if charges is not None:
        charges.reset(x)
    while queue:
        i = queue.popleft()
        queued[i] = False
        total = costs[i].copy()
        for j, matrix in nb[i]:
            total += matrix[:, x[j]]
        if charges is not None:
            total = total + charges.move_cost(i, int(x[i]))
        if reshards is not None:
            total = total + reshards.move_cost(i, x, len(total))
        best = int(np.argmin(total))
        if total[best] < total[x[i]] * (1 - 1e-12) - 1e-18:
            old, x[i] = int(x[i]), best
            touched = [j for j, _ in nb[i]]
            if charges is not None:
                touched += charges.moved(i, old, best)
            if reshards is not None:
                touched += [j for k in reshards.of_node[i] for j in reshards.members[k] if j != i]
            for j in touched:
                if not queued[j]:
                    queued[j] = True
                    queue.append(j)
    return x


def local_search(problem: IlpProblem, start: np.ndarray, *, iterations: int = 300, seed: int = 0,
                 time_limit_s: float | None = None) -> np.ndarray:
    """A plan no worse than ``start`` (when ``start`` is feasible) under ``problem``'s model; ``time_limit_s``
    bounds the perturbation rounds (the first descent always runs to its end)."""
    began = time.perf_counter()
    start = np.asarray(start, dtype=np.int64).copy()
    costs = [np.where(np.isfinite(c), c, _FORBIDDEN) for c in problem.node_costs]
    nb = _neighbours(problem)
    n = len(costs)
    best, best_eval = start, evaluate(problem, start)
    if best_eval.violations:
        return start
    rng = np.random.default_rng(seed)

    edge_index = [(u, v, np.where(np.isfinite(m), m, _FORBIDDEN)) for (u, v), m in zip(problem.edges,
                                                                                       problem.edge_costs)]
    charges = _Charges(problem) if problem.charges else None
    reshards = _Reshards(problem) if problem.reshards else None

    def quick(x: np.ndarray) -> float:
        total = sum(c[x[i]] for i, c in enumerate(costs)) + sum(m[x[u], x[v]] for u, v, m in edge_index)
        total += sum(group.cost_s(x) for group in problem.reshards)
        return float(total + sum(c.cost_s for c in problem.charges if c.active(x)))

    def consider(candidate: np.ndarray) -> None:
        nonlocal best, best_eval
        if quick(candidate) >= best_eval.objective_s * (1 - 1e-12):
            return
        result = evaluate(problem, candidate)
        if not result.violations and result.objective_s < best_eval.objective_s * (1 - 1e-12):
            best, best_eval = candidate, result

    consider(_icm(start.copy(), costs, nb, np.arange(n), charges, reshards))
    for _ in range(iterations if n > 1 else 0):
        if time_limit_s is not None and time.perf_counter() - began > time_limit_s:
            break
        candidate = best.copy()
        count = int(rng.integers(1, max(2, n // 10)))
        moved = rng.choice(n, size=min(count, n), replace=False)
        for i in moved:
            candidate[i] = int(rng.integers(len(costs[i])))
        touched = {int(i) for i in moved} | {j for i in moved for j, _ in nb[int(i)]}
        if charges is not None:  # a redrawn node may start or stop a shared charge its co-members see
            touched |= {j for i in moved for k, _ in charges.of_node[int(i)] for j in charges.members[k]}
        if reshards is not None:
            touched |= {j for i in moved for k in reshards.of_node[int(i)] for j in reshards.members[k]}
        consider(_icm(candidate, costs, nb, rng.permutation(sorted(touched)), charges, reshards))
    return best
