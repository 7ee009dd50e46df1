"""Intra-op parallelism: choose a strategy for every node of an OpGraph on one logical mesh.

The pass, in the order it runs:

- ``passes/cost_graph.py``: every node's strategies, the classes the ILP chooses for (followers and
  tied layers), node and edge costs, shared reshards, combined latencies and memory terms;
- ``passes/lowering.py``: the ``IlpProblem`` of a budget (the formulation is written out in
  ``passes/ilp/cpsat.py``), hinted with the best search start (``passes/search_starts.py``), so the
  result is never worse than any start under the model;
- ``passes/ilp``: HiGHS (or CP-SAT) solves it;
- ``passes/decode.py``: the class choices become a plan on the whole graph (``IntraOpResult``,
  ``passes/plan_result.py``), priced, its memory simulated, its objective checked on the unsimplified graph
  (``passes/objective.py``);
- ``passes/budget_search.py``: the ILP's budget is searched until the simulated plan fits.
"""
from __future__ import annotations

import time

from autoshard.errors import InfeasibleMemoryError
from autoshard.ir.graph import OpGraph
from autoshard.meshes.logical import LogicalMesh
from autoshard.passes.budget_search import BudgetSearch
from autoshard.passes.cost_graph import CostGraph, IntraOpOptions, node_strategies
from autoshard.passes.decode import decode, memory_profile
from autoshard.passes.lowering import build_problem
from autoshard.passes.plan_result import IlpStats, IntraOpResult, PassClock, ReshardSite
from autoshard.plans.ledger import fmt_bytes

__all__ = ["IlpStats", "IntraOpOptions", "IntraOpResult", "ReshardSite", "build_problem", "decode",
           "memory_profile", "node_strategies", "plan_intra_op"]


def plan_intra_op(graph: OpGraph, mesh: LogicalMesh, options: IntraOpOptions | None = None, *,
                  exact_smallest_budget: bool = True, cutoff_s: float | None = None) -> IntraOpResult:
    """Solve the intra-op ILP for ``graph`` on ``mesh`` and decode the chosen specs, within the budget.

    When nothing fits (``passes/budget_search.py``), ``InfeasibleMemoryError`` names a budget at which
    planning succeeds, within ~8% of the least one, found by planning again. With
    ``exact_smallest_budget=False`` that search is skipped and the error names the lowest simulated peak
    of the plans seen (a driver comparing meshes checks only the best one). With ``cutoff_s`` (the best
    step found elsewhere) it raises ``CutOffError`` as soon as the ILP's bound proves no plan here is faster.
    """
    options = options or IntraOpOptions()
    start_s, clock = time.perf_counter(), PassClock()
    with clock.timing("build", new_run=False):  # with the first ILP built (BudgetSearch.problem): one run
        cg = CostGraph(graph, mesh, options)
    search = BudgetSearch(cg, start_s=start_s, clock=clock)
    budget = float(options.memory_budget_bytes if options.memory_budget_bytes is not None
                   else mesh.cluster.memory_per_device_bytes)
    result, seen, floor = search.plan_within(budget, cutoff_s)
    if result is not None:
        return result
    smallest = search.smallest_budget(min(seen), floor) if exact_smallest_budget else min(seen)
    raise InfeasibleMemoryError(
        f"no plan fits in {fmt_bytes(budget)} per device on mesh {mesh}; the smallest budget that fits is "
        f"{fmt_bytes(smallest)} (simulated as XLA lays the plan out); raise memory_budget to at least that, use "
        "more devices, or a smaller batch", smallest, budget_bytes=budget)
