"""The resharded copies a plan makes, learned into the ILP's memory points (passes/learned_memory.py): for the
plan they came from, the ILP's count at each memory point grows by exactly the copies live there in XLA's order
(the points' own), so each learned term is on for the plan's own choice of its reader."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from autoshard.ir.graph import dtype_itemsize
from autoshard.ir.trace import trace
from autoshard.meshes.cluster import get_cluster
from autoshard.meshes.logical import make_logical_mesh
from autoshard.passes.budget_search import BudgetSearch
from autoshard.passes.cost_graph import CostGraph, point_positions
from autoshard.passes.ilp import evaluate
from autoshard.passes.intra_op import IntraOpOptions
from autoshard.passes.learned_memory import CopiesLearned, with_learned
from autoshard.passes.memory_model import op_positions
from examples import gpt, moe


@pytest.mark.parametrize("model", [gpt, pytest.param(moe, marks=pytest.mark.slow)], ids=["gpt", "moe"])
def test_a_plan_s_copies_raise_its_ilp_count_by_the_copies_live_at_each_point(model):
    work = model.workload("tiny", abstract=True)
    cg = CostGraph(trace(work.step, *work.args), make_logical_mesh(get_cluster("1x8-a100"), (2, 4)),
                   IntraOpOptions(time_limit_s=2.0))
    search = BudgetSearch(cg)
    problem = search.problem(float(cg.mesh.cluster.memory_per_device_bytes))
    solved = search.solve(problem)
    # the search starts' plans (the classic layouts among them: FSDP gathers each weight for the forward and
    # again for the backward), the one with the most copies
    result = max((search.decoded(problem, dataclasses.replace(solved, choices=start), 0.0)
                  for start in search.search_starts()), key=lambda r: sum(bool(s.collectives) for s in r.reshards))
    # the copies, read off the plan's reshards alone: (value, layout) -> bytes and the ops that read it so
    copies: dict = {}
    for site in result.reshards:
        if site.op_index >= 0 and site.collectives:
            value = cg.graph.values[site.value]
            nbytes = float(np.prod(site.dst.shard_shape(value.shape, cg.sizes))) * dtype_itemsize(value.dtype)
            copies.setdefault((site.value, site.dst), [nbytes, []])[1].append(site.op_index)
    assert len(copies) >= 5, "the plans make too few resharded copies to learn from"
    assert any(len(set(ops)) > 1 for _, ops in copies.values())  # a copy read by several ops: a span to learn
    order = op_positions(cg.graph)  # the memory points' positions: XLA's breadth-first order
    want = np.array([sum(b for b, ops in copies.values() if min(order[ops]) <= t <= max(order[ops]))
                     for t in point_positions(cg)])

    learned = CopiesLearned(cg)
    assert learned.learn(result) == len(copies)
    assert learned.learn(result) == 0  # each copy is learned once
    before = np.array(evaluate(problem, result.class_choices).memory_bytes)
    after = np.array(evaluate(dataclasses.replace(problem, memory_points=learned.points()),
                              result.class_choices).memory_bytes)
    np.testing.assert_allclose(after - before, want, rtol=1e-9, atol=1.0)
    assert (after > before).any()


def test_learned_bytes_add_to_a_point_s_terms_class_by_class():
    points = (((0, np.array([1.0, 2.0])),), ((1, np.array([5.0])),))
    learned = {(0, 0): np.array([10.0, 0.0]), (0, 1): np.array([3.0]), (1, 1): np.array([1.0])}
    merged = with_learned(points, learned)
    assert [c for c, _ in merged[0]] == [0, 1] and [c for c, _ in merged[1]] == [1]
    np.testing.assert_array_equal(dict(merged[0])[0], [11.0, 2.0])
    np.testing.assert_array_equal(dict(merged[0])[1], [3.0])
    np.testing.assert_array_equal(dict(merged[1])[1], [6.0])
    assert with_learned(points, {}) is points
