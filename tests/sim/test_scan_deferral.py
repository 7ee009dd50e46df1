"""A scanned stack's gradients reduced once after the loop (passes/deferral.py, runtime/deferred.py), on 8 CPU
devices: the partial form sums to the op it replaces, and a planned scanned step runs no reduction in its loop
bodies yet equals the same step on one device, also from a plan file."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import autoshard
from autoshard.compiler.hlo import read_hlo_collectives
from autoshard.ir.spec import Spec
from autoshard.ir.trace import trace
from autoshard.meshes.cluster import ClusterSpec, get_cluster
from autoshard.passes.intra_op import IntraOpOptions
from autoshard.plans.annotations import Deferral
from autoshard.runtime.deferred import partial_view
from autoshard.runtime.run import run
from autoshard.runtime.spmd import partial_result
from compiled_examples import FAST_COMPILE
from mlp_steps import scan_loss, train_step

REDUCTIONS = ("all-reduce", "reduce-scatter")


def _mesh() -> Mesh:
    return Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


@pytest.mark.parametrize("dims,shapes,operands,out", [
    ((((0,), (0,)), ((), ())), ((16, 6), (16, 5)), ([["x", "y"], []],) * 2, [[], []]),  # a weight gradient x^T g
    ((((0, 1), (0, 1)), ((), ())), ((4, 8, 3), (4, 8, 5)), ([["x"], ["y"], []],) * 2, [[], []]),  # batch, sequence
    ((((0,), (0,)), ((), ())), ((8, 6), (8, 8)), ([["x"], []], [["x"], ["y"]]), [[], ["y"]]),  # a Megatron-split weight
])
def test_the_partial_form_of_a_contraction_sums_to_it(dims, shapes, operands, out, devices8):
    mesh = _mesh()
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal(s).astype(np.float32) for s in shapes)
    op = next(o for o in trace(lambda u, v: jax.lax.dot_general(u, v, dims), a, b).ops if o.primitive == "dot_general")
    specs = tuple(Spec.from_json(s) for s in operands)
    (lc, rc), _ = dims
    reduced = tuple((i, j, specs[0].dims[i]) for i, j in zip(lc, rc) if specs[0].dims[i])
    deferral = Deferral(reduced, (), 0, specs)
    out_spec = Spec.from_json(out)
    perm = tuple(reversed(range(len(out_spec.dims))))
    transpose = trace(lambda u: jnp.transpose(u, perm), np.ones([2] * len(perm), np.float32)).ops[0]

    @jax.jit
    def partial(u, v):
        whole = partial_result(op, [u, v], deferral, out_spec, mesh)
        return whole, partial_view(transpose, whole, len(reduced))

    placed = [jax.device_put(x, NamedSharding(mesh, P(*s.partition_entries()))) for x, s in zip((a, b), specs)]
    whole, viewed = partial(*placed)
    lead = tuple(range(len(reduced)))
    assert whole.shape[:len(reduced)] == tuple(int(np.prod([dict(x=2, y=4)[n] for n in axes])) for *_, axes in reduced)
    want = np.asarray(jax.lax.dot_general(a, b, dims))
    np.testing.assert_allclose(np.asarray(whole).sum(axis=lead), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(viewed).sum(axis=lead), want.transpose(perm), rtol=1e-5, atol=1e-5)


def _work(width: int = 64, batch: int = 64, depth: int = 4):
    rng = np.random.default_rng(0)
    tx = optax.adam(1e-2)
    params = {"w": (rng.standard_normal((depth, width, width)) / np.sqrt(width)).astype(np.float32)}
    data = {"x": rng.standard_normal((batch, width)).astype(np.float32),
            "y": rng.standard_normal((batch, width)).astype(np.float32)}
    return train_step(tx, scan_loss, marker=False), params, tx.init(params), data


def _reductions_in_loops(hlo: str) -> tuple[int, list[str]]:
    found = [c for c in read_hlo_collectives(hlo) if c.kind in REDUCTIONS]
    return sum(c.count for c in found), [str(c) for c in found if c.count > 1]


def _slow_chips() -> ClusterSpec:
    """1x8-a100 with arithmetic 10,000 times slower (memory and links as they are): a small step whose work pays
    to split."""
    a100 = get_cluster("1x8-a100")
    return dataclasses.replace(a100, name="slow-chips", peak_flops_per_s={k: v / 1e4 for k, v in a100.peak_flops_per_s.items()})


@pytest.fixture(scope="module")
def planned(devices8):
    """The scanned MLP's step planned on (2, 4) with and without deferred reductions."""
    step, params, opt_state, data = _work()
    made = {}
    for defer in (True, False):
        made[defer] = autoshard.autoshard(step, mesh=(2, 4), cluster=_slow_chips(), num_stages=1,
                                          options=IntraOpOptions(time_limit_s=5.0, defer_stack_reductions=defer),
                                          compiler_options=FAST_COMPILE)
        made[defer](jax.tree.map(np.copy, params), jax.tree.map(np.copy, opt_state), data)  # plans on first call
    return made


def _three_steps(call, params, opt_state, data):
    state = (jax.tree.map(np.copy, params), jax.tree.map(np.copy, opt_state))
    for _ in range(3):
        *state, loss = call(*state, data)
    return state[0], float(loss)


def test_a_scanned_step_reduces_its_stacked_gradients_after_the_loop(planned):
    step, params, opt_state, data = _work()
    deferred, plain = planned[True], planned[False]
    assert deferred.plan.op_deferred, "the plan reduces no stacked gradient after its loop"
    assert not plain.plan.op_deferred
    runs, in_loops = _reductions_in_loops(deferred.lower(params, opt_state, data).compile().as_text())
    assert not in_loops, f"reductions run in a loop body: {in_loops}"
    plain_runs, plain_in_loops = _reductions_in_loops(plain.lower(params, opt_state, data).compile().as_text())
    assert plain_in_loops and runs < plain_runs  # the control: XLA reduces in the body unless told otherwise
    assert deferred.plan.ledger.step_s < plain.plan.ledger.step_s  # one latency instead of one per layer


def test_a_deferred_plan_matches_one_device_also_from_its_file(planned, tmp_path):
    step, params, opt_state, data = _work()
    want, want_loss = _three_steps(jax.jit(step, compiler_options=FAST_COMPILE), params, opt_state, data)
    got, loss = _three_steps(planned[True], params, opt_state, data)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    np.testing.assert_allclose(np.asarray(got["w"]), np.asarray(want["w"]), rtol=1e-4, atol=1e-5)
    plan = planned[True].plan
    plan.save(tmp_path / "plan.json")
    back = autoshard.load_plan(tmp_path / "plan.json")
    assert back.op_deferred == plan.op_deferred
    again, again_loss = _three_steps(run(back, step, _mesh(), compiler_options=FAST_COMPILE), params, opt_state, data)
    assert again_loss == pytest.approx(loss, rel=1e-6)
    np.testing.assert_allclose(np.asarray(again["w"]), np.asarray(got["w"]), rtol=1e-6, atol=1e-7)
