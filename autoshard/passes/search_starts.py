"""Starting points for the intra-op search, as class choices of a ``CostGraph`` (``passes/cost_graph.py``).

:func:`start_candidates` runs ICM (``local_search`` of ``passes/ilp/search.py``, no
perturbation rounds) from each of several greedy starts; :func:`best_start` keeps the best that fits a
budget; it becomes the ILP hint, so the plan is never worse than it under the model. The starts: the
batch split over all axes, each axis, or none, with state replicated or sharded
(:func:`_greedy_hint`); everything replicated (:func:`_replicated_start`); every
classic strategy's storage layouts (``passes/classic.py``) and the expert x data
layouts of a step with expert weights (``passes/experts.py``), unless
``classic_starts=False``, and the ``start_layouts`` option's (:func:`_layout_start`);
a previous plan's strategies (:func:`hint_from`). Every entry point searches
from the same starts.
"""
from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence

import numpy as np

from autoshard.ir.graph import Role
from autoshard.ir.spec import Spec
from autoshard.passes.classic import classic_layouts
from autoshard.passes.experts import expert_layouts
from autoshard.passes.cost_graph import ClassEdge, CostGraph, MemoryPoints, ProblemTerms
from autoshard.passes.ilp.problem import IlpProblem, evaluate
from autoshard.passes.ilp.search import local_search
from autoshard.passes.strategies import Strategy


def hint_from(cg: CostGraph, strategies: Sequence[Strategy] | None) -> np.ndarray | None:
    """Class choices matching a previous plan's per-node strategies (by specs, and among strategies of the
    same specs by how their reductions run: a scan's deferred twin is a strategy of its own); -1 where none
    matches."""
    if strategies is None or len(strategies) != len(cg.strategies):
        return None
    cls = cg.classes
    choice = np.full(cls.num_classes, -1, dtype=np.int64)
    for c, node in enumerate(cls.class_root):
        want = strategies[node]
        own = cg.strategies[node]
        same_specs = [a for a, i in enumerate(cls.strategy_map[node])
                      if (own[i].in_specs, own[i].out_specs) == (want.in_specs, want.out_specs)]
        exact = [a for a in same_specs if _same_run(own[cls.strategy_map[node][a]], want)]
        if exact or same_specs:
            choice[c] = (exact or same_specs)[0]
    return choice


def _same_run(a: Strategy, b: Strategy) -> bool:
    """Whether two strategies of the same specs communicate alike: the same kinds of collectives over the same
    axes, deferred alike (sizes aside: a hint may come from the same step at another batch)."""
    return a.deferred_over == b.deferred_over and ([(c.kind, c.axes) for c in a.collectives]
                                                   == [(c.kind, c.axes) for c in b.collectives])


def _layout_start(cg: CostGraph, layout: Mapping[int, Spec], start: np.ndarray | None) -> np.ndarray:
    """A partial start with the input classes set to ``layout``'s specs (where the class offers them)."""
    choice = np.full(cg.classes.num_classes, -1, dtype=np.int64) if start is None else start.copy()
    for i, spec in layout.items():
        c = int(cg.classes.node_class[i])
        specs = cg.out_specs(i, 0)
        if choice[c] < 0 and spec in specs:
            choice[c] = specs.index(spec)
    return choice


def _replicated_start(cg: CostGraph) -> np.ndarray | None:
    """Every class on its fully replicated strategy, or None when some class has none."""
    choice = np.full(cg.classes.num_classes, -1, dtype=np.int64)
    for c, root in enumerate(cg.classes.class_root):
        strategies = cg.strategies[root]
        mapping = cg.classes.strategy_map[root]
        found = [a for a, own in enumerate(mapping)
                 if all(spec.is_replicated for spec in strategies[own].in_specs + strategies[own].out_specs)]
        if not found:
            return None
        choice[c] = found[0]
    return choice


def start_candidates(cg: CostGraph, terms: ProblemTerms, start: np.ndarray | None) -> tuple[np.ndarray, ...]:
    """Every greedy start after ICM (no perturbation rounds, no budget): batch over all axes / each axis /
    none, state replicated or sharded, the classic strategies' layouts and the ``start_layouts``. One
    start only reaches one basin: on the GPT example the best plan differs from the data-parallel start in
    most classes, which no local move finds. They do not depend on the budget: ``best_start`` picks the
    best that fits one."""
    class_cost = list(terms.class_cost)
    # the greedy starts see a shared reshard as one edge per reader (each pays its layout); ICM and the
    # ranking in best_start price it exactly
    edges = list(terms.edges) + [(g.producer, c, g.costs[:, layout]) for g in terms.reshards
                                 for c, layout in g.readers if c != g.producer]
    probe = _probe(cg, terms, None)
    axes = [a for a in cg.mesh.axis_names if cg.sizes[a] > 1]
    batch_choices: list[tuple[str, ...] | None] = [None, *[(a,) for a in axes], ()]
    variants = [(None, batch_axes, shard_state) for batch_axes in batch_choices for shard_state in (False, True)]
    if start is not None:  # a previous plan (options.hint) is one more start, not a seed of every start
        variants.append((start, None, False))
    layouts: list[Mapping[int, Spec]] = []
    if cg.options.classic_starts and len(cg.options.pinned_inputs) < cg.num_inputs:
        layouts += classic_layouts(cg.graph, cg.mesh)
        layouts += expert_layouts(cg.graph, cg.mesh)
    if cg.options.start_layouts is not None:
        layouts += cg.options.start_layouts(cg.graph, cg.mesh)
    # a layout start fixes its own batch and state layouts
    variants += [(_layout_start(cg, layout, start), None, False) for layout in layouts]
    replicated = _replicated_start(cg)
    if replicated is not None:  # everything replicated: no communication at all (small models want it)
        variants.append((replicated, None, False))
    found = [local_search(probe, _greedy_hint(cg, class_cost, edges, first, batch_axes, shard_state), iterations=0)
             for first, batch_axes, shard_state in variants]
    return tuple(found) + (_greedy_hint(cg, class_cost, edges, start),)


def _probe(cg: CostGraph, terms: ProblemTerms, budget_bytes: float | None,
           points: MemoryPoints | None = None) -> IlpProblem:
    return IlpProblem(
        node_names=tuple(str(c) for c in range(cg.classes.num_classes)), node_costs=terms.class_cost,
        edges=tuple((u, v) for u, v, _ in terms.edges), edge_costs=tuple(m for _, _, m in terms.edges),
        memory_points=terms.points if points is None else points, memory_budget_bytes=budget_bytes,
        charges=terms.charges,
        reshards=terms.reshards,
    )


def best_start(cg: CostGraph, terms: ProblemTerms, candidates: Sequence[np.ndarray],
               budget_bytes: float | None = None, points: MemoryPoints | None = None) -> np.ndarray:
    """The cheapest of ``start_candidates`` that fits ``budget_bytes`` at the memory points ``points`` (default:
    the terms'; the last candidate, the plain greedy start, when none fits)."""
    probe = _probe(cg, terms, budget_bytes if budget_bytes is not None else cg.options.memory_budget_bytes, points)
    best, best_s = None, np.inf
    for candidate in candidates[:-1]:
        result = evaluate(probe, candidate)
        if not result.violations and result.objective_s < best_s:
            best, best_s = candidate, result.objective_s
    return best if best is not None else candidates[-1]


def _greedy_hint(cg: CostGraph, class_cost: list[np.ndarray], edges: list[ClassEdge],
                 start: np.ndarray | None = None, batch_axes: tuple[str, ...] | None = None,
                 shard_state: bool = False) -> np.ndarray:
    """A greedy start: the batch split on dim 0 over ``batch_axes`` (None: the most devices), state
    replicated (or, with ``shard_state``, split over the most devices), then each op class in program
    order picks its cheapest strategy given the classes already fixed. Classes already chosen in
    ``start`` (>= 0) keep their choice."""
    cls = cg.classes
    choice = np.full(cls.num_classes, -1, dtype=np.int64) if start is None else start.copy()
    for i, vid in enumerate(cg.graph.inputs):
        c = int(cls.node_class[i])
        if choice[c] >= 0:
            continue
        value = cg.graph.values[vid]
        specs = cg.out_specs(i, 0)
        if value.role == Role.BATCH:
            if batch_axes is None:
                score = [(s.num_shards(cg.sizes) if all(not d for d in s.dims[1:]) else 0) for s in specs]
            else:
                score = [2 if s.dims and s.dims[0] == batch_axes and all(not d for d in s.dims[1:])
                         else int(s.is_replicated) for s in specs]
        elif shard_state:
            score = [s.num_shards(cg.sizes) for s in specs]
        else:
            score = [1 if s.is_replicated else 0 for s in specs]
        choice[c] = int(np.argmax(score))
    neighbours: dict[int, list[tuple[int, np.ndarray]]] = collections.defaultdict(list)
    for u, v, m in edges:
        neighbours[u].append((v, m))
        neighbours[v].append((u, m.T))
    for c in np.argsort(np.array(cls.class_root), kind="stable"):
        if choice[c] >= 0:
            continue
        total = class_cost[c].copy()
        for other, m in neighbours[c]:
            if choice[other] >= 0:
                total = total + m[:, choice[other]]
        total = np.where(np.isfinite(total), total, np.inf)
        choice[c] = int(np.argmin(total))
    return choice
