"""Expert parallelism on 8 simulated devices, for both dispatch styles: einsum masks (``examples.moe``,
GShard/Switch) and sort + gather/scatter top-k routing (``examples.moe_topk``).

On ``cpu-8`` (slow compute against its links) the planner splits the expert dim of the expert weights
and moves tokens between a group-split and an expert-split layout with all-to-alls. Each plan must
(1) split the experts, (2) give the same 3 SGD steps as one device (relative error <= 1e-5 on the loss
and on every updated parameter, scale floored as in test_autoshard_numerics.py) and (3) predict the
all-to-all bytes that XLA compiles for it within 10%.
"""
from __future__ import annotations

import importlib

import jax
import numpy as np
import optax
import pytest

import autoshard
from autoshard.compiler.verify import verify_compiled
from autoshard.passes.intra_op import IntraOpOptions
from examples.common import make_train_step

FAST = IntraOpOptions(time_limit_s=1.0)
STYLES = ["moe", "moe_topk"]


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _expert_specs(plan):
    """The planned storage spec of every expert weight (``w_in [E, d, ff]``, ``w_out [E, ff, d]``)."""
    return {p: s for p, s in plan.input_specs.items()
            if plan.input_roles.get(p) == "param" and p.endswith(("['w_in']", "['w_out']"))}


@pytest.mark.parametrize("model", STYLES)
def test_expert_parallel_steps_match_one_device(model, devices8):
    work = importlib.import_module(f"examples.{model}").workload("small")
    params, _, batch = work.args
    tx = optax.sgd(0.1)
    step_fn = make_train_step(work.loss_fn, tx)
    reference = jax.jit(step_fn)
    ref = jax.tree.map(lambda x: x.copy(), (params, tx.init(params)))
    sharded = autoshard.autoshard(step_fn, mesh=(2, 4), cluster="cpu-8", num_stages=1, options=FAST)
    state = (params, tx.init(params))
    for _ in range(3):
        *ref, ref_loss = reference(*ref, batch)
        *state, loss = sharded(*state, batch)
        assert _rel(loss, ref_loss) <= 1e-5, f"loss {float(loss)} vs one device {float(ref_loss)}"
    experts = _expert_specs(sharded.plan)
    assert len(experts) == 2 * work.config.num_layers
    assert all(spec.dims[0] for spec in experts.values()), f"expert dim not split: {experts}"
    floor = 1e-2 * max(float(np.max(np.abs(np.asarray(x)))) for x in jax.tree.leaves(ref[0]))
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(state[0]), jax.tree.leaves(ref[0])):
        err = float(np.max(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))))
        scale = max(float(np.max(np.abs(np.asarray(want)))), floor)
        assert err / scale <= 1e-5, f"{jax.tree_util.keystr(path)}: rel err {err / scale:.2e}"


@pytest.mark.parametrize("model", STYLES)
def test_expert_parallel_all_to_all_matches_compiled_hlo(model, devices8):
    work = importlib.import_module(f"examples.{model}").workload("small", abstract=True)
    step = autoshard.autoshard(work.step, mesh=(2, 4), cluster="cpu-8", num_stages=1, options=FAST)
    compiled = step.lower(*work.args).compile()
    assert all(spec.dims[0] for spec in _expert_specs(step.plan).values())
    report = verify_compiled(step.plan, compiled)
    a2a = report.row("all-to-all bytes")
    assert a2a.predicted > 0 and a2a.compiled > 0, str(report)
    assert a2a.rel_error <= 0.10, str(report)
    assert report.row("all collective bytes").rel_error <= 0.10, str(report)
