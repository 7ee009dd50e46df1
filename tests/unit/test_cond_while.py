"""``while`` and ``cond`` in the planner: flattened into loop regions (ir/trace.py) with a trip count derived,
stated or guessed (ir/trips.py), a cond priced as its costliest branch, carries and branch results in one
layout each (passes/cost_graph.py, passes/strategies/control.py), and forms it cannot plan named in a warning.

Traced from shapes and planned only: nothing compiles (the numerics are in tests/sim/test_cond_while_numerics.py).
"""
from __future__ import annotations

import warnings

import jax
import numpy as np
import jax.numpy as jnp
import pytest

import autoshard
from autoshard.compiler.explain import loop_notes
from autoshard.errors import TripCountGuessWarning
from autoshard.ir.spec import Spec
from autoshard.ir.trace import trace
from autoshard.ir.trips import DEFAULT_TRIP_GUESS, trip_count_option
from autoshard.meshes.cluster import get_cluster
from autoshard.meshes.logical import make_logical_mesh
from autoshard.passes.cost_graph import CostGraph, IntraOpOptions
from autoshard.passes.intra_op import plan_intra_op
from autoshard.passes.strategies import UnsupportedPrimitiveWarning, strategies_for


def _f32(shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _mesh(shape=(2, 4)):
    return make_logical_mesh(get_cluster("1x8-a100"), shape)


def _whiles(graph):
    return [r for r in graph.loops if r.kind == "while"]


def _trace_quietly(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("error", TripCountGuessWarning)  # a counted loop must not guess
        return trace(fn, *args)


@pytest.mark.parametrize(("name", "fn", "trips"), [
    ("hand-written c[0] < n", lambda x: jax.lax.while_loop(lambda c: c[0] < 7, lambda c: (c[0] + 1, c[1] * 2.0),
                                                            (0, x))[1], 7),
    ("stepped by 2 from 1", lambda x: jax.lax.while_loop(lambda c: c[0] < 8, lambda c: (c[0] + 2, jnp.sin(c[1])),
                                                          (1, x))[1], 4),
    ("fori_loop, traced constant bounds", lambda x: jax.lax.fori_loop(jnp.int32(2), jnp.int32(5),
                                                                       lambda i, c: c @ c, x), 3),
    ("a weak-typed counter, converted before the compare", lambda x: jax.lax.while_loop(
        lambda c: c[0] < jnp.asarray(6, jnp.int32), lambda c: (c[0] + 3, c[1] + 1.0), (0, x))[1], 2),
    ("bound carried through unchanged", lambda x: jax.lax.while_loop(
        lambda c: c[0] < c[1], lambda c: (c[0] + 1, c[1], jnp.cos(c[2])), (0, jnp.int32(5), x))[2], 5),
])
def test_counted_while_derives_its_trip_count(name, fn, trips):
    graph = _trace_quietly(fn, _f32((16, 16)))
    (region,) = _whiles(graph)
    assert (region.length, region.trip_source) == (trips, "derived"), name
    body = graph.ops[region.cond_stop:region.body_stop]
    assert body and all(op.trip_count == trips for op in body)
    assert all(op.trip_count == trips + 1 for op in graph.ops[region.body_start:region.cond_stop])
    assert "while" not in graph.primitive_counts()


def _halve_until_small(x):
    return jax.lax.while_loop(lambda c: jnp.sum(c * c) > 1.0, lambda c: 0.5 * c, x)


def test_data_dependent_while_is_guessed_with_a_warning_or_bound_by_the_option():
    with pytest.warns(TripCountGuessWarning, match="while_trip_count=N") as caught:
        graph = trace(_halve_until_small, _f32((8, 8)))
    assert "test_cond_while.py" in str(caught[0].message)  # it names the loop by its source line
    (region,) = _whiles(graph)
    assert (region.length, region.trip_source) == (DEFAULT_TRIP_GUESS, "guess")
    with warnings.catch_warnings():
        warnings.simplefilter("error", TripCountGuessWarning)
        with trip_count_option(5):
            bound = trace(_halve_until_small, _f32((8, 8)))
        plan = autoshard.plan(_halve_until_small, _f32((8, 8)), mesh=(2, 4), cluster="1x8-a100", num_stages=1,
                              options=IntraOpOptions(time_limit_s=0.5), while_trip_count=3)
    (region,) = _whiles(bound)
    assert (region.length, region.trip_source) == (5, "bound")
    for traced, says in ((graph, f"trip count {DEFAULT_TRIP_GUESS}, a guess (set while_trip_count="),
                         (bound, "trip count 5, as stated by while_trip_count")):
        (note,) = loop_notes(plan_intra_op(traced, _mesh(), IntraOpOptions(time_limit_s=0.5)))
        assert says in note, note
    body = bound.ops[region.cond_stop:region.body_stop]
    assert body and all(op.trip_count == 5 for op in body)
    assert plan.mesh_shape == (2, 4)
    with pytest.raises(ValueError, match="positive integer"):
        autoshard.plan(_halve_until_small, _f32((8, 8)), mesh=(2, 4), while_trip_count=0)


def _two_branches(p, x, w):
    """One branch is a (256 x 512) @ (512 x 512) dot, the other an elementwise tanh: the dot's is costlier."""
    return jnp.sum(jax.lax.cond(p, lambda a: jnp.tanh(a), lambda a: a @ w, x))


def test_cond_costs_its_costliest_branch():
    graph = trace(_two_branches, jax.ShapeDtypeStruct((), jnp.bool_), _f32((256, 512)), _f32((512, 512)))
    (region,) = [r for r in graph.loops if r.kind == "cond"]
    assert "cond" not in graph.primitive_counts() and len(region.branches) == 2
    dot = next(j for j, op in enumerate(graph.ops) if op.primitive == "dot_general")
    tanh = next(j for j, op in enumerate(graph.ops) if op.primitive == "tanh")
    lo, hi = region.branches[region.priced_branch]
    assert lo <= dot < hi, "the dot's branch is the costlier one"
    cg = CostGraph(graph, _mesh(), IntraOpOptions(time_limit_s=0.5))
    lone = trace(lambda a, w: a @ w, _f32((256, 512)), _f32((512, 512)))
    one = CostGraph(lone, _mesh(), IntraOpOptions(time_limit_s=0.5))
    ours = {str(s): c for s, c in zip(cg.strategies[cg.num_inputs + dot], cg.op_work(dot)[0])}
    alone = {str(s): c for s, c in zip(one.strategies[one.num_inputs], one.op_work(0)[0])}
    assert ours == pytest.approx(alone)  # the priced branch costs what it costs alone
    assert graph.ops[tanh].trip_count == 0 and not cg.op_work(tanh)[0].any()  # the other adds nothing
    merge = region.final_ops[0]
    other = 1 - region.priced_branch
    assert cg.edge_weight(cg.num_inputs + merge, other) == 0
    assert cg.edge_weight(cg.num_inputs + merge, region.priced_branch) == 1
    result = plan_intra_op(graph, _mesh(), IntraOpOptions(time_limit_s=0.5))
    (note,) = loop_notes(result)
    assert f"costliest branch, branch {region.priced_branch} " in note and "2 branches" in note


def test_branch_results_and_carries_hold_one_spec():
    graph = trace(_two_branches, jax.ShapeDtypeStruct((), jnp.bool_), _f32((256, 512)), _f32((512, 512)))
    merge = next(op for op in graph.ops if op.primitive == "cond_merge")
    ins, outs = [graph.values[v] for v in merge.inputs], [graph.values[v] for v in merge.outputs]
    found = strategies_for(merge, ins, outs, _mesh())
    assert len(found) > 1 and all(set(s.in_specs) == {s.out_specs[0]} for s in found)
    assert all(not s.collectives for s in found)
    step = lambda w, x: jax.lax.while_loop(lambda c: c[0] < 4, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, x))[1]
    graph = _trace_quietly(step, _f32((512, 512)), _f32((1024, 512)))
    result = plan_intra_op(graph, _mesh(), IntraOpOptions(time_limit_s=0.5, memory_budget_bytes=3 * 2**20))
    (region,) = _whiles(graph)
    for carry, final in zip(region.carry_ops, region.final_ops):
        out, into = graph.ops[final].inputs[0], graph.ops[carry].outputs[0]
        if out != into:  # the carry out is in the carry's layout, or priced back into it every iteration
            assert result.value_specs[out] == result.value_specs[into] or any(
                site.value == out and site.op_index == -1 for site in result.reshards)
    (note,) = loop_notes(result)
    assert "trip count 4, derived from its counter" in note


LAYERS = 4


def _lars_update(stack, grads):
    """A counted while over the layers of a stack: each layer updated with its own trust ratio."""
    def body(c):
        i, s = c
        w = jax.lax.dynamic_index_in_dim(s, i, keepdims=False)
        g = jax.lax.dynamic_index_in_dim(grads, i, keepdims=False)
        return i + 1, jax.lax.dynamic_update_index_in_dim(s, w - 0.1 * jnp.linalg.norm(w) * g, i, 0)
    return jax.lax.while_loop(lambda c: c[0] < LAYERS, body, (0, stack))[1]


def _branch_weights(p, x, w1, w2):
    return jnp.sum(jax.lax.cond(p, lambda a: jnp.tanh(a @ w1), lambda a: jnp.sin(a @ w2), x) ** 2)


@pytest.mark.parametrize("form", ["while", "cond"])
def test_stacked_weights_of_a_planned_while_or_cond_are_sharded(form):
    if form == "while":  # 4 x 16 MiB of stack and as much gradient: 128 MiB replicated per device
        fn, args, weights = _lars_update, (_f32((LAYERS, 2048, 2048)), _f32((LAYERS, 2048, 2048))), (0,)
        graph, budget = _trace_quietly(fn, *args), 40 * 2**20
    else:  # two 16 MiB branch weights and a 16 MiB batch: replicated, the step peaks at 54 MiB per device
        fn = _branch_weights
        args = (jax.ShapeDtypeStruct((), jnp.bool_), _f32((2048, 2048)), _f32((2048, 2048)), _f32((2048, 2048)))
        weights = (2, 3)
        graph, budget = trace(fn, *args), 48 * 2**20
    result = plan_intra_op(graph, _mesh(), IntraOpOptions(time_limit_s=1.0, memory_budget_bytes=budget))
    assert result.peak_bytes <= budget
    for k in weights:
        assert not result.input_specs[k].is_replicated, f"input {k} of the {form} left whole"
    region = next(r for r in graph.loops if r.kind == form)
    body = [v for op in graph.ops[region.body_start:region.body_stop] if op.trip_count for v in op.outputs]
    assert any(not result.value_specs[v].is_replicated for v in body if graph.values[v].rank), "the body is whole"


def test_a_branch_that_is_not_priced_follows_its_neighbours():
    # both branches do the same work: the cond is priced at one, the other weighs nothing in the objective,
    # so the solver may leave it on any layout; XLA still allocates its buffers, so it must reshard no more
    # than the priced branch does, and the worst layouts it could take are moved back by follow_unpriced
    args = (jax.ShapeDtypeStruct((), jnp.bool_), _f32((2048, 2048)), _f32((2048, 2048)), _f32((2048, 2048)))
    graph = trace(_branch_weights, *args)
    result = plan_intra_op(graph, _mesh(), IntraOpOptions(time_limit_s=5.0))
    moved = [sum(c.nbytes for r in result.reshards if bool(r.runs) == priced for c in r.collectives)
             for priced in (True, False)]
    assert moved[1] <= moved[0], f"the branch not priced reshards {moved[1]} bytes, the priced one {moved[0]}"

    cg = CostGraph(graph, _mesh(), IntraOpOptions())
    never = [c for c in range(cg.classes.num_classes)
             if cg.classes.class_root[c] >= cg.num_inputs
             and not graph.ops[cg.classes.class_root[c] - cg.num_inputs].trip_count]
    assert never, "the branch not priced has no class of its own"

    def unpriced_s(choices):  # its reshards at one run each, as chosen
        total = 0.0
        for p, k, n, pos, vid in cg.edge_sites():
            if cg.edge_weight(n, pos) == 0:
                total += cg.edge_matrix(p, k, n, pos, vid, runs=1)[choices[cg.classes.node_class[p]],
                                                                   choices[cg.classes.node_class[n]]]
        return total

    worst = np.zeros(cg.classes.num_classes, dtype=np.int64)
    for c in never:  # the strategy that reads its operands at the highest price, as a solver might leave it
        worst[c] = int(np.argmax(np.where(np.isfinite(cg.terms.class_cost[c]), np.arange(cg.classes.class_size[c]),
                                          -1)))
    followed = cg.follow_unpriced(worst)
    assert all(followed[c] == worst[c] for c in range(cg.classes.num_classes) if c not in never)
    assert unpriced_s(followed) < unpriced_s(worst) or unpriced_s(worst) == 0.0
    assert unpriced_s(followed) <= unpriced_s(cg.follow_unpriced(followed)) + 1e-15  # settled


def test_loops_with_side_effects_still_warn_by_name():
    def with_while(x):
        def body(c):
            jax.debug.print("{}", jnp.sum(c))
            return c * 2.0
        return jax.lax.while_loop(lambda c: jnp.sum(c) < 10.0, body, x)

    def with_cond(p, x):
        def loud(a):
            jax.debug.print("{}", jnp.sum(a))
            return jnp.sin(a)
        return jax.lax.cond(p, loud, jnp.cos, x)

    mesh = _mesh()
    for fn, args, name in ((with_while, (_f32((8, 8)),), "while"),
                           (with_cond, (jax.ShapeDtypeStruct((), jnp.bool_), _f32((8, 8))), "cond")):
        graph = trace(fn, *args)
        assert not graph.loops
        op = next(op for op in graph.ops if op.primitive == name)
        with pytest.warns(UnsupportedPrimitiveWarning, match=rf"{name!r} \(its bodies have side effects"):
            found = strategies_for(op, [graph.values[v] for v in op.inputs], [graph.values[v] for v in op.outputs],
                                   mesh)
        assert [s.note for s in found] == ["replicated"]
        assert all(spec == Spec.replicated(len(spec.dims)) for s in found for spec in s.in_specs)


def test_cond_memory_counts_the_larger_branch():
    """Each branch's temporaries live only while it runs: the cond peaks at its larger branch, not their sum."""
    big = lambda x, w: jnp.sum(jnp.tanh(x @ w) @ w)  # two 4 MiB temporaries beside 8 MiB of inputs
    small = lambda x, w: jnp.sum(jnp.sin(x) * 3.0)  # none kept beside the inputs
    args = (_f32((1024, 1024)), _f32((1024, 1024)))
    pred = jax.ShapeDtypeStruct((), jnp.bool_)
    opts, one = IntraOpOptions(time_limit_s=0.5), _mesh((1, 1))
    peaks = {name: plan_intra_op(trace(fn, *a), one, opts).peak_bytes for name, fn, a in (
        ("big", big, args), ("small", small, args),
        ("cond", lambda p, x, w: jax.lax.cond(p, big, small, x, w), (pred, *args)))}
    assert peaks["big"] > peaks["small"]
    assert peaks["cond"] == pytest.approx(peaks["big"], rel=0.01), peaks


def test_planning_commands_take_a_while_trip_count():
    from autoshard.cli import build_parser

    parser = build_parser()
    for command in ("plan", "compare", "verify"):
        assert parser.parse_args([command, "examples/mlp.py", "--while-trip-count", "12"]).while_trip_count == 12
    with pytest.raises(SystemExit):
        parser.parse_args(["plan", "examples/mlp.py", "--while-trip-count", "0"])
