"""Lowering: a cost graph and a memory budget become an ``IlpProblem`` (passes/ilp), hinted.

The problem's terms come from the cost graph (``CostGraph.terms``: class costs, edges, shared reshards,
combined latencies, memory points), its hint from the search starts (``passes/search_starts.py``) that
fit the budget, its solver options from ``IntraOpOptions``.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from autoshard.passes.cost_graph import CostGraph, MemoryPoints, class_name
from autoshard.passes.ilp import IlpProblem
from autoshard.passes.search_starts import best_start, hint_from, start_candidates

__all__ = ["build_problem", "search_starts_of"]


def search_starts_of(cg: CostGraph) -> tuple[np.ndarray, ...]:
    """The search's starting points for ``cg`` (budget-free: ``build_problem`` picks the best that fits)."""
    return start_candidates(cg, cg.terms, hint_from(cg, cg.options.hint))


def build_problem(cg: CostGraph, budget_bytes: float | None = None,
                  starts: Sequence[np.ndarray] | None = None, hinted: bool = True,
                  points: MemoryPoints | None = None) -> IlpProblem:
    """The ILP of a cost graph under ``budget_bytes`` (default: the options', else the device memory),
    hinted with the best search start (``passes/search_starts.py``; ``starts``: computed before for this
    cost graph) that fits it; not hinted, and no start computed, when ``hinted`` is false. ``points``
    replaces the cost graph's memory points (``passes/learned_memory.py`` adds to them)."""
    terms = cg.terms
    points = terms.points if points is None else points
    budget = budget_bytes if budget_bytes is not None else cg.options.memory_budget_bytes
    if budget is None:
        budget = cg.mesh.cluster.memory_per_device_bytes
    if starts is None and hinted:
        starts = search_starts_of(cg)
    hint = best_start(cg, terms, starts, float(budget), points) if hinted and starts is not None else None
    return IlpProblem(
        node_names=tuple(class_name(cg, c) for c in range(cg.classes.num_classes)),
        node_costs=terms.class_cost,
        edges=tuple((u, v) for u, v, _ in terms.edges),
        edge_costs=tuple(m for _, _, m in terms.edges),
        memory_points=points,
        memory_budget_bytes=float(budget),
        hint=hint,
        charges=terms.charges,
        reshards=terms.reshards,
        time_limit_s=cg.options.time_limit_s,
        seed=cg.options.seed,
        solver=cg.options.solver,
    )
