"""Reductions left to the end of a scan (passes/deferral.py, runtime/deferred.py): which ops may, how their
twins are priced and held in memory, and that the partial form sums to the op's own result."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from autoshard.ir.graph import Op
from autoshard.ir.spec import Collective, Spec
from autoshard.ir.trace import trace
from autoshard.meshes import cost
from autoshard.meshes.cluster import get_cluster
from autoshard.meshes.logical import LogicalMesh, make_logical_mesh
from autoshard.passes.cost_graph import CostGraph, IntraOpOptions
from autoshard.passes.deferral import extra_bytes, partial_sum_spans, reduced_dims, stack_sites, twins
from autoshard.passes.objective import group_latencies, late_reductions, own_comm_s
from autoshard.passes.search_starts import hint_from
from autoshard.passes.strategies import Strategy
from mlp_steps import scan_loss, train_step

LAYERS, WIDTH, BATCH = 3, 16, 8


def _scanned_graph():
    tx = optax.sgd(0.1)
    params = {"w": jax.ShapeDtypeStruct((LAYERS, WIDTH, WIDTH), jnp.float32)}
    batch = {"x": jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32), "y": jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32)}
    return trace(train_step(tx, scan_loss, marker=False), params, tx.init(params), batch)


def _mesh() -> LogicalMesh:
    return make_logical_mesh(get_cluster("1x8-a100"), (2, 4), ("x", "y"))


def test_the_weight_gradient_of_a_scanned_stack_is_a_site():
    graph = _scanned_graph()
    sites = stack_sites(graph)
    assert len(sites) == 1, sites  # the stacked weight's gradient; the forward's dot feeds the carry
    (j, site), = sites.items()
    op = graph.ops[j]
    assert op.primitive == "dot_general" and site.length == LAYERS
    assert graph.ops[site.stack].primitive == "loop_stack"
    assert all(graph.ops[t].primitive in ("transpose", "reshape") for t in site.chain)
    stacked = graph.values[graph.ops[site.stack].outputs[0]]
    assert stacked.shape == (LAYERS, WIDTH, WIDTH)


def _dot(dims=(((0,), (0,)), ((), ()))) -> Op:
    graph = trace(lambda a, b: jax.lax.dot_general(a, b, dims), jax.ShapeDtypeStruct((8, 4, 6), jnp.float32),
                  jax.ShapeDtypeStruct((8, 4, 5), jnp.float32))
    return next(op for op in graph.ops if op.primitive == "dot_general")


def _strategy(ins, out, axes=("x",), kind="all-reduce", reduction="sum") -> Strategy:
    return Strategy(in_specs=ins, out_specs=(out,), compute_s=1e-6, comm_s=2e-5,
                    collectives=(Collective(kind, axes, 1024.0),), reduction=reduction)


def test_only_a_sum_over_exactly_the_split_contracting_dims_can_wait():
    op = _dot()
    batch_x = Spec((("x",), (), ()))
    ok = _strategy((batch_x, batch_x), Spec.replicated(2))
    assert reduced_dims(op, ok) == ((0, 0, ("x",)),)
    assert reduced_dims(op, _strategy((batch_x, Spec.replicated(3)), Spec.replicated(2))) is None  # operands differ
    assert reduced_dims(op, _strategy((batch_x, batch_x), Spec.replicated(2), axes=("x", "y"))) is None
    assert reduced_dims(op, _strategy((batch_x, batch_x), Spec.replicated(2), reduction="max")) is None
    assert reduced_dims(op, dataclasses.replace(ok, collectives=())) is None
    graph = _scanned_graph()
    (j, site), = stack_sites(graph).items()
    cg = CostGraph(graph, _mesh(), IntraOpOptions(defer_stack_reductions=False))
    own = cg.strategies[cg.num_inputs + j]
    made = twins(graph, site, own, cg.sizes)
    assert len(made) == sum(reduced_dims(graph.ops[j], s) is not None for s in own) > 0
    assert all(m.deferred_over == LAYERS and m.apart_hbm_bytes >= 0 for m in made)
    assert not any(s.deferred_over for s in own)


def test_a_twin_pays_one_latency_per_loop_and_holds_its_partial_sums():
    graph, mesh = _scanned_graph(), _mesh()
    cg = CostGraph(graph, mesh, IntraOpOptions())
    (j, site), = cg.sites.items()
    mine = cg.strategies[cg.num_inputs + j]
    deferred = [s for s in mine if s.deferred_over]
    assert deferred, "no twin was made"
    late, loop, trips = late_reductions(graph), graph.loop_of(), graph.ops[j].trip_count
    assert trips == LAYERS
    for twin in deferred:
        plain = next(s for s in mine if not s.deferred_over and s.in_specs == twin.in_specs
                     and s.out_specs == twin.out_specs and s.collectives == twin.collectives)
        latency = sum(cost.latency_s(mesh, c) for c in twin.collectives)
        if j in late:  # the latency goes to the combined reduction after the loop, paid once
            assert own_comm_s(graph, mesh, j, twin, late) == pytest.approx(own_comm_s(graph, mesh, j, plain, late))
            (key, paid), = group_latencies(graph, mesh, j, twin, late, loop).items()
            (plain_key, plain_paid), = group_latencies(graph, mesh, j, plain, late, loop).items()
            assert key[3] == -1 and plain_key[3] == loop[j] >= 0
            assert paid == pytest.approx(plain_paid / LAYERS) == pytest.approx(latency)
        else:
            assert own_comm_s(graph, mesh, j, plain, late) - own_comm_s(graph, mesh, j, twin, late) == pytest.approx(
                (LAYERS - 1) * latency)
    held = extra_bytes(graph, site, mine, cg.sizes)
    value = graph.values[graph.ops[j].outputs[0]]
    for s, extra in zip(mine, held):
        scattered = s.out_specs[0].num_shards(cg.sizes)
        if not s.deferred_over or reduced_dims(graph.ops[j], s) is None:
            assert extra == 0
        else:  # the whole sum per device, over the loop, where the reduced layout holds 1/scattered of it
            rest = {a for *_, axes in reduced_dims(graph.ops[j], s) for a in axes}
            kept = int(np.prod([cg.sizes[a] for a in s.out_specs[0].used_axes if a not in rest]))
            assert extra == pytest.approx((LAYERS + 1) * (value.nbytes / kept - value.nbytes / scattered))
    spans = partial_sum_spans(graph, [cg.strategies[cg.num_inputs + t][0] if t != j else deferred[-1]
                                      for t in range(len(graph.ops))], cg.sizes)
    twin = deferred[-1]
    summed_over = {a for *_, axes in reduced_dims(graph.ops[j], twin) for a in axes}
    whole = value.nbytes / int(np.prod([cg.sizes[a] for a in twin.out_specs[0].used_axes if a not in summed_over]))
    # the partial sums over the loop, then the reduction's whole result beside them at the stack
    assert [(s.start, s.stop, s.nbytes) for s in spans] == [
        (next(r.start for r in graph.loops if site.stack in r.stack_ops), site.stack, held[mine.index(twin)]),
        (site.stack, site.stack, pytest.approx(LAYERS * whole))]


def test_a_hint_naming_a_twin_starts_from_the_twin_not_the_plain_strategy_of_its_specs():
    """``hint_from`` (a previous plan, or the classic plan ``compare`` hints autoshard with) reads each node's
    strategy back: a twin has its plain strategy's specs, and matching by specs alone restarted the search from
    the plain one, paying the loop's reductions every iteration (gpt_scan-medium on 4x8-h100: the DP x TP
    plan, 32.6 ms, read back as 34.7 ms, and autoshard returned a worse plan than its hint)."""
    graph = _scanned_graph()
    cg = CostGraph(graph, _mesh(), IntraOpOptions())
    (j, _site), = cg.sites.items()
    node = cg.num_inputs + j
    twin = next(s for s in cg.strategies[node] if s.deferred_over)
    plain = next(s for s in cg.strategies[node] if not s.deferred_over and s.in_specs == twin.in_specs
                 and s.out_specs == twin.out_specs)
    assert cg.strategies[node].index(plain) < cg.strategies[node].index(twin)  # the first of its specs
    for wanted in (twin, plain):
        strategies = [cg.strategies[i][cg.classes.strategy_map[i][0]] for i in range(len(cg.strategies))]
        strategies[node] = wanted
        choice = hint_from(cg, strategies)
        c = cg.classes.node_class[node]
        assert cg.strategies[node][cg.classes.strategy_map[node][choice[c]]] is wanted
