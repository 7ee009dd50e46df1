"""Any ``jax.sharding.Mesh`` runs a plan: Explicit axes (``jax.make_mesh``'s default), Auto axes, or both.

The decorator and ``autoshard.apply`` on each kind of mesh give the same losses as the step on one device, and
the arrays they return live on the caller's mesh with the planned specs (the runtime plans its sharding
constraints on the mesh's Auto twin, ``runtime/spmd.auto_twin``). A pipeline plan applied to an Explicit
mesh runs its stages on that mesh's devices.
"""
from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh

import autoshard
from autoshard.passes.intra_op import IntraOpOptions
from autoshard.runtime.spmd import partition_spec
from examples import mlp
from mlp_steps import host_args, train_step
from pipeline_helpers import rel

FAST = IntraOpOptions(time_limit_s=1.0)
KINDS = {"explicit": (AxisType.Explicit, AxisType.Explicit), "auto": (AxisType.Auto, AxisType.Auto),
         "mixed": (AxisType.Explicit, AxisType.Auto)}


def _mesh(kind: str) -> Mesh:
    if kind == "explicit":  # what a JAX 0.10 user builds first
        mesh = jax.make_mesh((2, 4), ("x", "y"))
        assert mesh.axis_types == KINDS["explicit"]
        return mesh
    return jax.make_mesh((2, 4), ("x", "y"), axis_types=KINDS[kind])


@pytest.fixture(scope="module")
def work():
    return mlp.workload("small")


@pytest.fixture(scope="module")
def reference(work):
    """Losses of 3 steps of the unsharded step on one device."""
    state, losses = _host(work.args[:2]), []
    step = jax.jit(work.step)
    for _ in range(3):
        *state, loss = step(*state, work.args[2])
        losses.append(float(loss))
    return losses


def _host(tree):
    """Host copies: the runs donate their state, so each starts from its own."""
    return jax.tree.map(np.array, tree)


def _run(run, work, mesh: Mesh, ref_losses: list[float], plan_of) -> None:
    state = _host(work.args[:2])
    for ref_loss in ref_losses:
        *state, loss = run(*state, work.args[2])
        assert rel(loss, ref_loss) <= 1e-5, f"loss {float(loss)} vs one device {ref_loss}"
    plan = plan_of()
    specs = list(plan.output_specs.values())
    leaves = jax.tree.leaves((state[0], state[1]))
    assert any(not s.is_replicated for s in specs), "the plan shards nothing: the test would not pin any axis"
    for leaf, spec in zip(leaves, specs):
        assert leaf.sharding.mesh == mesh, f"returned on {leaf.sharding.mesh}, not the caller's mesh"
        assert leaf.sharding.spec == partition_spec(spec)


@pytest.mark.parametrize("kind", list(KINDS))
def test_decorator_on_any_mesh_matches_one_device(work, reference, kind, devices8):
    mesh = _mesh(kind)
    step = autoshard.autoshard(work.step, mesh=mesh, cluster="cpu-8", num_stages=1, options=FAST)
    _run(step, work, mesh, reference, lambda: step.plan)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_plan_apply_on_any_mesh_matches_one_device(work, reference, kind, devices8):
    plan = autoshard.plan(work.step, *work.args, mesh=(2, 4), cluster="cpu-8", num_stages=1, options=FAST)
    mesh = _mesh(kind)
    _run(autoshard.apply(plan, work.step, mesh), work, mesh, reference, lambda: plan)


def test_pipeline_plan_applies_to_an_explicit_mesh(devices8):
    """A 2-stage pipeline plan run through autoshard.apply on jax.make_mesh's Explicit mesh, against one device;
    the mesh's device order is the one the stages' device indices name."""
    tx = optax.sgd(0.1)
    step = train_step(tx)
    args = host_args(tx, width=16, batch=8, depth=4)
    plan = autoshard.plan(step, *args, cluster="cpu-8", num_stages=2, num_microbatches=2, options=FAST)
    assert len(plan.stages) == 2
    reversed_devices = np.asarray(jax.devices()[::-1]).reshape(2, 4)
    mesh = Mesh(reversed_devices, ("x", "y"), axis_types=KINDS["explicit"])
    run = autoshard.apply(plan, step, mesh)
    ref = jax.jit(step)
    state, ref_state = _host(args[:2]), args[:2]
    for _ in range(2):
        *state, loss = run(*state, args[2])
        *ref_state, ref_loss = ref(*ref_state, args[2])
        assert rel(loss, ref_loss) <= 1e-5, f"loss {float(loss)} vs one device {float(ref_loss)}"
    stage_devices = [{reversed_devices.flat[i] for i in st.device_indices} for st in plan.stages]
    for leaf in jax.tree.leaves(state[0]):
        assert any(leaf.sharding.device_set <= ds for ds in stage_devices), \
            f"a parameter on {sorted(d.id for d in leaf.sharding.device_set)}: not one stage's devices (mesh order)"
