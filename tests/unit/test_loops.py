"""Loops in the planner: a scan's body flattened into the graph (ir/trace.py), planned with trip-count
weights and one layout per carry (passes/cost_graph.py), and loops it cannot plan named in a warning.

Traced from shapes and planned only: nothing compiles (the numerics are in tests/sim/test_scan_layers.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from autoshard.compiler.explain import loop_notes, op_explanations
from autoshard.ir.trace import trace
from autoshard.meshes.cluster import get_cluster
from autoshard.meshes.logical import make_logical_mesh
from autoshard.passes.cost_graph import CostGraph, IntraOpOptions
from autoshard.passes.intra_op import plan_intra_op
from autoshard.passes.strategies import strategies_for

LENGTH = 6


def _f32(shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _stack_step(stack, x):
    """A scan over a stack of (64, 64) layers; its loss and gradient (a transposed scan)."""
    def loss(stack):
        h, _ = jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, stack)
        return jnp.sum(h ** 2)

    return jax.value_and_grad(loss)(stack)


def _mesh(shape=(2, 4)):
    return make_logical_mesh(get_cluster("1x8-a100"), shape)


def test_scan_body_is_flattened_with_trip_counts():
    graph = trace(_stack_step, _f32((LENGTH, 64, 64)), _f32((32, 64)))
    assert "scan" not in graph.primitive_counts()
    assert len(graph.loops) == 2  # the forward scan and its transpose
    for region in graph.loops:
        assert region.length == LENGTH
        body = graph.ops[region.body_start:region.body_stop]
        assert body and all(op.trip_count == LENGTH for op in body)
        assert all(graph.ops[t].primitive == "loop_carry" for t in region.carry_ops)
        for t in region.slice_ops:  # a stacked input gives the body one slice
            stacked, piece = (graph.values[v] for v in (graph.ops[t].inputs[0], graph.ops[t].outputs[0]))
            assert stacked.shape == (LENGTH, *piece.shape)
    outside = [op for t, op in enumerate(graph.ops) if not any(r.body_start <= t < r.body_stop for r in graph.loops)]
    # a stacked output is written every iteration (resharding into it runs LENGTH times); the rest run once
    assert all(op.trip_count == (LENGTH if op.primitive == "loop_stack" else 1) for op in outside)
    # the forward dot counts every iteration: 6 x 2 x 32 x 64 x 64
    dot = next(op for op in graph.ops if op.primitive == "dot_general")
    assert dot.flops == pytest.approx(LENGTH * 2 * 32 * 64 * 64)


def test_fori_loop_with_static_bounds_is_a_planned_loop():
    def f(w, x):
        return jax.lax.fori_loop(0, 5, lambda i, c: jnp.tanh(c @ w), x)

    graph = trace(f, _f32((64, 64)), _f32((32, 64)))
    assert len(graph.loops) == 1 and graph.loops[0].length == 5


def test_stacked_layouts_keep_the_layer_axis_whole():
    graph = trace(_stack_step, _f32((LENGTH, 64, 64)), _f32((32, 64)))
    mesh = _mesh()
    for prim in ("loop_slice", "loop_stack"):
        op = next(op for op in graph.ops if op.primitive == prim)
        ins, outs = [graph.values[v] for v in op.inputs], [graph.values[v] for v in op.outputs]
        strategies = strategies_for(op, ins, outs, mesh)
        assert len(strategies) > 1
        for s in strategies:
            stacked, piece = (s.in_specs[0], s.out_specs[0]) if prim == "loop_slice" else (s.out_specs[0], s.in_specs[0])
            assert stacked.dims[0] == () and stacked.dims[1:] == piece.dims, str(s)
            assert not s.collectives


def test_body_costs_count_every_iteration_and_carries_are_tied():
    graph = trace(_stack_step, _f32((LENGTH, 64, 64)), _f32((32, 64)))
    cg = CostGraph(graph, _mesh(), IntraOpOptions(time_limit_s=1.0))
    dot = next(j for j, op in enumerate(graph.ops) if op.primitive == "dot_general")
    single = trace(lambda c, w: c @ w, _f32((32, 64)), _f32((64, 64)))
    one = CostGraph(single, _mesh(), IntraOpOptions(time_limit_s=1.0))
    # the same dot, strategy by strategy: the body's costs LENGTH times the lone one's
    ours = {str(s): c for s, c in zip(cg.strategies[cg.num_inputs + dot], cg.op_work(dot)[0])}
    lone = {str(s): c for s, c in zip(one.strategies[one.num_inputs], one.op_work(0)[0])}
    assert ours.keys() == lone.keys()
    for key, seconds in lone.items():
        assert ours[key] == pytest.approx(LENGTH * seconds)
    # each carry's carry out is priced against the carry's layout, every iteration
    back = [(p, c, pos) for p, _k, c, pos, _v in cg.edge_sites()
            if pos < 0 and c >= cg.num_inputs and graph.ops[c - cg.num_inputs].primitive == "loop_carry"]
    assert back and all(cg.edge_weight(c, pos) == LENGTH for _p, c, pos in back)


def test_planned_scan_keeps_one_layout_per_carry_and_explains_it():
    graph = trace(_stack_step, _f32((LENGTH, 1024, 1024)), _f32((1024, 1024)))
    # 24 MiB of stack, 24 of its gradient, 4 of batch: replicated the step needs ~68 MiB per device
    result = plan_intra_op(graph, _mesh(), IntraOpOptions(time_limit_s=1.0, memory_budget_bytes=40 * 2**20))
    assert result.peak_bytes <= 40 * 2**20
    for region in graph.loops:
        for carry, final in zip(region.carry_ops, region.final_ops):
            carry_out = graph.ops[final].inputs[0]
            carry_in = graph.ops[carry].outputs[0]
            if carry_out != carry_in:
                assert result.value_specs[carry_out] == result.value_specs[carry_in] or any(
                    site.value == carry_out and site.op_index == -1 for site in result.reshards)
        for t in region.slice_ops:
            assert result.op_strategy(t).in_specs[0].dims[0] == ()
    body = [v for r in graph.loops for op in graph.ops[r.body_start:r.body_stop] for v in op.outputs]
    assert any(not result.value_specs[v].is_replicated for v in body), "the body was left whole"
    notes = loop_notes(result)
    assert len(notes) == 2 and all(f"{LENGTH} iterations" in n for n in notes)
    explained = op_explanations(result)
    inside = [e for j, e in explained.items() if any(r.body_start <= j < r.body_stop for r in graph.loops)]
    assert inside and all("in the body of the scan" in e.loop for e in inside)
    carries = [explained[t] for r in graph.loops for t in r.carry_ops if t in explained]
    assert all("at the boundary of the scan" in e.loop for e in carries)

# while / cond: tests/unit/test_cond_while.py (a loop with side effects still warns by name there)
