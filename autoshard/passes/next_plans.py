"""The next-best distinct plans after a chosen one, for compiled arbitration (``compiler/arbiter.py``).

The model ranks plans; XLA may run the second one faster. So the ILP of the
chosen plan's cost graph is solved again with no-good cuts
(``passes/ilp/candidates.py``): each cut excludes every plan that lays out
every node as an excluded plan does. Two strategies of an op with the same
input and output specs compile to the same program (the annotations the
runtime pins are specs), so a cut marks, per class, every strategy whose
member nodes all keep the excluded plan's specs: each plan returned differs
from the chosen one and from each other in some node's layout, not just in a
class index. Plans whose simulated peak is over the budget are cut and
skipped.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from autoshard.ir.graph import OpGraph
from autoshard.ir.spec import Spec
from autoshard.meshes.logical import LogicalMesh
from autoshard.passes.budget_search import followed
from autoshard.passes.cost_graph import CostGraph, IntraOpOptions
from autoshard.passes.ilp import IlpProblem, IlpSolution, evaluate
from autoshard.passes.ilp.candidates import Cut, next_best
from autoshard.passes.intra_op import IlpStats, IntraOpResult, build_problem, decode
from autoshard.passes.search_starts import hint_from
from autoshard.passes.strategies import Strategy

__all__ = ["layout_cut", "next_best_plans"]

log = logging.getLogger(__name__)

Layout = tuple[tuple[Spec, ...], tuple[Spec, ...]]  # a strategy's (input specs, output specs)


def _layout(strategy: Strategy) -> Layout:
    return tuple(strategy.in_specs), tuple(strategy.out_specs)


def layout_cut(cg: CostGraph, problem: IlpProblem, chosen: Sequence[Strategy]) -> Cut:
    """Per class, the strategies that give each of its member nodes the layout it has in ``chosen`` (one
    strategy per node: inputs first, then ops)."""
    cls = cg.classes
    masks = [np.ones(len(costs), dtype=bool) for costs in problem.node_costs]
    for node, strategies in enumerate(cg.strategies):
        want = _layout(chosen[node])
        own = cls.strategy_map[node]
        c = int(cls.node_class[node])
        masks[c] &= np.fromiter((_layout(strategies[int(a)]) == want for a in own), dtype=bool, count=len(own))
    return tuple(masks)


def _choices_like(cg: CostGraph, problem: IlpProblem, strategies: Sequence[Strategy]) -> np.ndarray | None:
    """Class choices giving every node the layout it has in ``strategies``; None when some class has none (a
    plan made under other pins can tie nodes this cost graph's classes keep together)."""
    masks = layout_cut(cg, problem, strategies)
    return np.array([int(np.argmax(m)) for m in masks], dtype=np.int64) if all(m.any() for m in masks) else None


def _chosen_strategies(cg: CostGraph, choices: np.ndarray) -> list[Strategy]:
    cls = cg.classes
    return [cg.strategies[n][int(cls.strategy_map[n][int(choices[cls.node_class[n]])])]
            for n in range(len(cg.strategies))]


def next_best_plans(graph: OpGraph, mesh: LogicalMesh, options: IntraOpOptions, chosen: IntraOpResult, k: int = 3,
                    time_limit_s: float | None = None, starts: Sequence[Sequence[Strategy]] = ()
                    ) -> list[IntraOpResult]:
    """Up to ``k`` plans of ``graph`` on ``mesh``, other than ``chosen`` and distinct from it and from each
    other in layout, best first under the model, each within the options' memory budget.

    ``options`` must be those ``chosen`` was planned with (pins, required splits, budget); each re-solve
    runs for at most ``time_limit_s`` (default: the options' limit). ``starts``: other plans' per-node
    strategies (the classic plans, say) to hint the re-solves with where no cut excludes them.
    """
    start = time.perf_counter()
    if time_limit_s is not None:
        options = replace(options, time_limit_s=time_limit_s)
    cg = CostGraph(graph, mesh, options)
    budget = float(options.memory_budget_bytes if options.memory_budget_bytes is not None
                   else mesh.cluster.memory_per_device_bytes)
    problem = build_problem(cg, budget)
    build_s = time.perf_counter() - start
    decoded: dict[int, IntraOpResult] = {}
    chosen_layouts = [_layout(s) for s in chosen.node_strategies]

    def fits(found: IlpSolution) -> bool:
        solution = followed(cg, problem, found)
        if [_layout(s) for s in _chosen_strategies(cg, solution.choices)] == chosen_layouts:
            return False  # the chosen plan itself (its layouts were not all in this cost graph's classes)
        stats = IlpStats(len(cg.strategies), cg.classes.num_classes, cg.classes.num_followers, cg.classes.num_tied,
                         solution.num_variables, solution.num_constraints, len(problem.edges),
                         f"next-best ({solution.status})", solution.gap, solution.solve_s, build_s,
                         objective_s=evaluate(problem, solution.choices).objective_s)
        result = decode(cg, solution.choices, stats)
        if result.peak_bytes > budget * (1 + 1e-9):
            log.info("a next-best plan peaks at %.3g bytes, over the budget: skipped", result.peak_bytes)
            return False
        decoded[id(found)] = result
        return True

    first = layout_cut(cg, problem, chosen.node_strategies)
    exact = [_choices_like(cg, problem, s) for s in starts]
    hints = [h for h in (e if e is not None else hint_from(cg, s) for e, s in zip(exact, starts)) if h is not None]
    found = next_best(problem, first, k, lambda choices: layout_cut(cg, problem, _chosen_strategies(cg, choices)),
                      keep=fits, starts=hints)
    log.info("%d next-best plans on %s in %.1fs", len(found), mesh, time.perf_counter() - start)
    return [decoded[id(s)] for s in found]
