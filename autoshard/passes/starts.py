"""Starting points for the intra-op search, as class choices of a ``_Problem`` (``passes/intra_op.py``).

:func:`best_start` runs ICM (``local_search`` of ``passes/ilp_search.py``, no
perturbation rounds) from each of several greedy starts and keeps the best valid one; it becomes the
ILP hint, so the plan is never worse than it under the model. The starts: the
batch split over all axes, each axis, or none, with state replicated or sharded
(:func:`_greedy_hint`); everything replicated (:func:`_replicated_start`); the
``start_layouts`` option's storage layouts (:func:`_layout_start`); a previous
plan's strategies (:func:`hint_from`).
"""
from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from autoshard.compiler.graph import Role
from autoshard.compiler.spec import Spec
from autoshard.passes import ilp
from autoshard.passes.ilp_search import local_search
from autoshard.passes.strategies import Strategy

if TYPE_CHECKING:  # intra_op.py imports this module
    from autoshard.passes.intra_op import _Problem


def hint_from(pb: _Problem, strategies: Sequence[Strategy] | None) -> np.ndarray | None:
    """Class choices matching a previous plan's per-node strategies (by specs); -1 where none matches."""
    if strategies is None or len(strategies) != len(pb.strategies):
        return None
    cls = pb.classes
    choice = np.full(cls.num_classes, -1, dtype=np.int64)
    for c, node in enumerate(cls.class_root):
        want = (strategies[node].in_specs, strategies[node].out_specs)
        own = pb.strategies[node]
        for a, i in enumerate(cls.strategy_map[node]):
            if (own[i].in_specs, own[i].out_specs) == want:
                choice[c] = a
                break
    return choice


def _layout_start(pb: _Problem, layout: Mapping[int, Spec], start: np.ndarray | None) -> np.ndarray:
    """A partial start with the input classes set to ``layout``'s specs (where the class offers them)."""
    choice = np.full(pb.classes.num_classes, -1, dtype=np.int64) if start is None else start.copy()
    for i, spec in layout.items():
        c = int(pb.classes.node_class[i])
        specs = pb.out_specs(i, 0)
        if choice[c] < 0 and spec in specs:
            choice[c] = specs.index(spec)
    return choice


def _replicated_start(pb: _Problem) -> np.ndarray | None:
    """Every class on its fully replicated strategy, or None when some class has none."""
    choice = np.full(pb.classes.num_classes, -1, dtype=np.int64)
    for c, root in enumerate(pb.classes.class_root):
        strategies = pb.strategies[root]
        mapping = pb.classes.strategy_map[root]
        found = [a for a, own in enumerate(mapping)
                 if all(spec.is_replicated for spec in strategies[own].in_specs + strategies[own].out_specs)]
        if not found:
            return None
        choice[c] = found[0]
    return choice


def best_start(pb: _Problem, class_cost: list[np.ndarray], edges: list[tuple[int, int, np.ndarray]],
                points: tuple, start: np.ndarray | None) -> np.ndarray:
    """The best of several greedy starts after ICM: batch over all axes / each axis / none, state
    replicated or sharded, and the ``start_layouts`` (the classic strategies' layouts when the API
    asks). One start only reaches one basin: on the GPT example the best plan differs
    from the data-parallel start in most classes, which no local move finds."""
    probe = ilp.IlpProblem(
        node_names=tuple(str(c) for c in range(pb.classes.num_classes)), node_costs=tuple(class_cost),
        edges=tuple((u, v) for u, v, _ in edges), edge_costs=tuple(m for _, _, m in edges),
        memory_points=points, memory_budget_bytes=pb.options.memory_budget_bytes,
    )
    axes = [a for a in pb.mesh.axis_names if pb.sizes[a] > 1]
    batch_choices: list[tuple[str, ...] | None] = [None, *[(a,) for a in axes], ()]
    variants = [(None, batch_axes, shard_state) for batch_axes in batch_choices for shard_state in (False, True)]
    if start is not None:  # a previous plan (options.hint) is one more start, not a seed of every start
        variants.append((start, None, False))
    if pb.options.start_layouts is not None:  # a layout start fixes its own batch and state layouts
        variants += [(_layout_start(pb, layout, start), None, False)
                     for layout in pb.options.start_layouts(pb.graph, pb.mesh)]
    replicated = _replicated_start(pb)
    if replicated is not None:  # everything replicated: no communication at all (small models want it)
        variants.append((replicated, None, False))
    best, best_s = None, np.inf
    for first, batch_axes, shard_state in variants:
        candidate = local_search(probe, _greedy_hint(pb, class_cost, edges, first, batch_axes, shard_state),
                                 iterations=0)
        result = ilp.evaluate(probe, candidate)
        if not result.violations and result.objective_s < best_s:
            best, best_s = candidate, result.objective_s
    return best if best is not None else _greedy_hint(pb, class_cost, edges, start)


def _greedy_hint(pb: _Problem, class_cost: list[np.ndarray], edges: list[tuple[int, int, np.ndarray]],
                 start: np.ndarray | None = None, batch_axes: tuple[str, ...] | None = None,
                 shard_state: bool = False) -> np.ndarray:
    """A greedy start: the batch split on dim 0 over ``batch_axes`` (None: the most devices), state
    replicated (or, with ``shard_state``, split over the most devices), then each op class in program
    order picks its cheapest strategy given the classes already fixed. Classes already chosen in
    ``start`` (>= 0) keep their choice."""
    cls = pb.classes
    choice = np.full(cls.num_classes, -1, dtype=np.int64) if start is None else start.copy()
    for i, vid in enumerate(pb.graph.inputs):
        c = int(cls.node_class[i])
        if choice[c] >= 0:
            continue
        value = pb.graph.values[vid]
        specs = pb.out_specs(i, 0)
        if value.role == Role.BATCH:
            if batch_axes is None:
                score = [(s.num_shards(pb.sizes) if all(not d for d in s.dims[1:]) else 0) for s in specs]
            else:
                score = [2 if s.dims and s.dims[0] == batch_axes and all(not d for d in s.dims[1:])
                         else int(s.is_replicated) for s in specs]
        elif shard_state:
            score = [s.num_shards(pb.sizes) for s in specs]
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
