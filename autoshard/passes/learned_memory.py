"""The resharded copies of a plan over its budget, taught to the ILP's memory points (``BudgetSearch``).

The ILP counts each value's buffer at its memory points by its producer's choice. A resharded copy
(``passes/memory_model.py``, rule 4: one buffer per value and target layout, made by collectives and shared by
the readers of that layout, so a backward op that reads a forward activation in the layout a forward op
gathered it to keeps the gathered copy alive in between) depends on the producer's and the readers' choices
together, and the ILP does not see it. On gpt-xl@8 on 2x8-a100 the first plan peaked at 87.6 GiB in the
simulation, 24.7 GiB of it resharded copies, where the ILP counted 60 GiB; the budget search then lowered the
ILP's budget by the whole difference, to 52 GiB, and its solves under that budget stopped at a 40% gap.

So a plan over its budget teaches the ILP its copies before the next round (``CopiesLearned.learn``): for each
of its resharded buffers (a value, a target layout, the ops that read it so), every memory point from the
first of those readers to the last, in XLA's order (``memory_model.op_positions``: the memory points' own
positions), counts the copy's bytes on the last reader's class, for
each strategy of the class that reads the value in that layout. The ILP's count of the plan the copies came
from then includes each copy wherever it was live in that order; another plan pays a copy while the last
reader reads that layout (once more than due when the producer itself makes that layout, which needs no copy:
a cut learned from one plan, checked, like every plan, by the simulation). A copy is learned once per
(value, layout), from the first plan that made it. On the gpt-xl@8 cell the ILP then counts 84.6 GiB of that
plan and the next round's budget is 77 GiB: given 40 s, that round's plan fits at 995.7 ms, 0.2% from the bound
at 80 GiB (at the former 10 s default its MIP was left too little time and the search kept its hint; the
default is 20 s now, at which the cell ends 0.2% from its bound: benchmarks/SOLVER_GAPS.md).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from autoshard.ir.graph import ValueId
from autoshard.ir.spec import Spec
from autoshard.passes.cost_graph import CostGraph, MemoryPoints, point_positions
from autoshard.passes.memory_model import op_positions
from autoshard.passes.plan_result import IntraOpResult

__all__ = ["CopiesLearned", "with_learned"]


def with_learned(points: MemoryPoints, learned: Mapping[tuple[int, int], np.ndarray]) -> MemoryPoints:
    """``points`` with the learned bytes (per (point, class), over the class's strategies) added."""
    if not learned:
        return points
    extra: dict[int, dict[int, np.ndarray]] = defaultdict(dict)
    for (p, c), nbytes in learned.items():
        extra[p][c] = nbytes
    out = []
    for p, terms in enumerate(points):
        merged = dict(terms)
        for c, nbytes in extra.get(p, {}).items():
            merged[c] = merged[c] + nbytes if c in merged else nbytes
        out.append(tuple(sorted(merged.items())))
    return tuple(out)


@dataclass
class CopiesLearned:
    """The copies one cost graph's ILP has learned (module docstring), and its memory points with them."""
    cg: CostGraph
    bytes_at: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)  # (point, class) -> bytes
    copies: set[tuple[ValueId, Spec]] = field(default_factory=set)  # (value, layout) already learned
    _positions: list[int] | None = None
    _points: tuple[int, MemoryPoints] | None = None  # (copies learned when made, the points)

    def learn(self, result: IntraOpResult) -> int:
        """Learn the resharded copies of ``result`` not learned before; how many were new."""
        cg = self.cg
        if self._positions is None:
            self._positions = point_positions(cg)
        order = op_positions(cg.graph)  # the positions of the memory points: XLA's order, not the program's
        readers: dict[tuple[ValueId, Spec], list[tuple[int, int]]] = defaultdict(list)
        for site in result.reshards:
            if site.op_index >= 0 and site.collectives:  # a reshard without collectives is a fused slice
                readers[(site.value, site.dst)].append((site.op_index, site.input_pos))
        new = 0
        for key, reads in readers.items():
            if key in self.copies:
                continue
            self.copies.add(key)
            vid, dst = key
            first = min(int(order[op]) for op, _ in reads)
            last_op, pos = max(reads, key=lambda read: int(order[read[0]]))
            last = int(order[last_op])
            node = cg.num_inputs + last_op
            own = cg.strategies[node]
            reads_it = np.array([own[i].in_specs[pos] == dst for i in cg.classes.strategy_map[node]])
            nbytes = cg.graph.values[vid].nbytes / dst.num_shards(cg.sizes)  # as the ILP counts a value's bytes
            if not reads_it.any() or nbytes <= 0:
                continue
            c = int(cg.classes.node_class[node])
            for p, t in enumerate(self._positions):
                if first <= t <= last:
                    self.bytes_at[(p, c)] = self.bytes_at.get((p, c), 0.0) + nbytes * reads_it
            new += 1
        return new

    def points(self) -> MemoryPoints:
        """The cost graph's memory points with every copy learned so far."""
        if self._points is None or self._points[0] != len(self.copies):
            self._points = (len(self.copies), with_learned(self.cg.terms.points, self.bytes_at))
        return self._points[1]
