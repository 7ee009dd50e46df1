"""Graph simplification: tandem repeats, followers and repeated layers sharing ILP variables."""
from __future__ import annotations

import dataclasses

import numpy as np

from autoshard.ir.trace import trace
from autoshard.meshes.cluster import get_cluster
from autoshard.meshes.logical import make_logical_mesh
from autoshard.passes.cost_graph import CostGraph, IntraOpOptions
from autoshard.passes.intra_op import build_problem
from autoshard.passes.simplify import find_tandem_repeats, layer_free_path, repeat_aliases


def test_tandem_repeats_find_layers_and_nest():
    # embed | layer x3 (a b c) | head, then two identical optimizer halves each repeating per layer
    tokens = [9, 1, 2, 3, 1, 2, 3, 1, 2, 3, 8, 5, 6, 5, 6, 5, 6]
    repeats = find_tandem_repeats(tokens)
    assert (1, 3, 3) in repeats
    alias = repeat_aliases(tokens)
    assert list(alias[1:10]) == [1, 2, 3, 1, 2, 3, 1, 2, 3]
    assert alias[0] == 0 and alias[10] == 10
    assert list(alias[11:]) == [11, 12, 11, 12, 11, 12]


def test_no_repeat_no_alias():
    tokens = list(range(10))
    assert find_tandem_repeats(tokens) == []
    assert list(repeat_aliases(tokens)) == tokens


def test_layer_free_paths():
    assert layer_free_path("[0]['blocks'][3]['q']['kernel']") == layer_free_path("[0]['blocks'][17]['q']['kernel']")
    assert layer_free_path("['layers_2']['w']") == layer_free_path("['layers_5']['w']")
    assert layer_free_path("[0]['blocks'][3]['q']") != layer_free_path("[0]['blocks'][3]['k']")


def _problem(num_layers: int):
    from examples import gpt

    cfg = dataclasses.replace(gpt.CONFIGS["small"], num_layers=num_layers)
    work = gpt.workload(cfg, abstract=True)
    graph = trace(work.step, *work.args)
    mesh = make_logical_mesh(get_cluster("cpu-8"), (2, 4))
    pb = CostGraph(graph, mesh, IntraOpOptions())
    problem = build_problem(pb)
    return graph, pb, problem


def test_ilp_of_24_layers_is_not_24_times_2_layers():
    g2, _, p2 = _problem(2)
    g24, pb24, p24 = _problem(24)
    assert len(g24.ops) > 8 * len(g2.ops)  # the graph does grow with depth...
    vars2 = sum(len(c) for c in p2.node_costs) + sum(m.size for m in p2.edge_costs)
    vars24 = sum(len(c) for c in p24.node_costs) + sum(m.size for m in p24.edge_costs)
    assert vars24 <= 2 * vars2, f"ILP grows with depth: {vars2} -> {vars24}"  # ...the ILP does not
    # the 24 copies of a layer's parameters share one variable
    cls = pb24.classes
    q_kernels = [i for i, v in enumerate(g24.inputs)
                 if g24.values[v].path.startswith("[0]['blocks']") and g24.values[v].path.endswith("['q']['kernel']")]
    assert len(q_kernels) == 24
    assert len({int(cls.node_class[i]) for i in q_kernels}) == 1
    # but different parameters of one layer keep their own (q is not tied to out)
    out_kernel = next(i for i, v in enumerate(g24.inputs) if g24.values[v].path == "[0]['blocks'][0]['attn']['out']['kernel']")
    assert cls.node_class[out_kernel] != cls.node_class[q_kernels[0]]
    # every class strategy maps to a real strategy of each member
    for node, mapping in enumerate(cls.strategy_map):
        assert len(mapping) == cls.class_size[cls.node_class[node]]
        assert np.all(mapping < len(pb24.strategies[node]))
