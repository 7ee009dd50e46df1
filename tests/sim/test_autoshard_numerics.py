"""@autoshard on the GPT and MoE train steps: 3 sharded steps equal the same steps on one device.

Parameters are compared after SGD steps (relative error <= 1e-5 per leaf). With the examples' own AdamW
the loss and Adam's first moment are compared tightly: Adam divides rounding noise by its own magnitude
where a gradient is zero in theory (attention key biases), which makes its parameters a poor yardstick.
"""
from __future__ import annotations

import importlib

import jax
import numpy as np
import pytest

import autoshard
from autoshard.passes.intra_op import IntraOpOptions
from compiled_examples import FAST_COMPILE, planned_example, sgd_reference

FAST = IntraOpOptions(time_limit_s=1.0)  # local search finds these plans; CP-SAT only polishes
CASES = [(model, mesh) for model in ("gpt", "moe") for mesh in ((2, 4), (1, 8), (8, 1), (2, 3))]


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


@pytest.mark.parametrize("model, mesh", CASES, ids=[f"{m}-{'x'.join(map(str, s))}" for m, s in CASES])
def test_sgd_steps_match_one_device(model, mesh, devices8):
    ref = sgd_reference(model)  # the one-device run, once per model (test_expert_parallel.py's too)
    batch = ref.work.args[2]
    step = autoshard.autoshard(ref.step_fn, mesh=mesh, options=FAST, compiler_options=FAST_COMPILE)
    state = ref.fresh_state()
    for ref_loss in ref.losses:
        *state, loss = step(*state, batch)
        assert _rel(loss, ref_loss) <= 1e-5, f"loss {float(loss)} vs one device {ref_loss}"
    assert step.plan.mesh_shape == mesh
    assert any(not spec.is_replicated for spec in step.plan.input_specs.values()), "the plan shards nothing"
    # Relative error per leaf, against the leaf's scale; a leaf whose gradient is zero in theory (attention
    # key biases: softmax ignores them) holds only rounding noise, so its scale is floored at 1% of the
    # largest parameter.
    floor = 1e-2 * max(float(np.max(np.abs(np.asarray(x)))) for x in jax.tree.leaves(ref.params))
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(state[0]), jax.tree.leaves(ref.params)):
        err = float(np.max(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))))
        scale = max(float(np.max(np.abs(np.asarray(want)))), floor)
        assert err / scale <= 1e-5, f"{jax.tree_util.keystr(path)}: rel err {err / scale:.2e}"


def _first_moment(opt_state):
    """Adam's first moment (``mu``) as a pytree shaped like the parameters."""
    for node in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "mu")):
        if hasattr(node, "mu"):
            return node.mu
    raise AssertionError("no Adam state in opt_state")


@pytest.mark.xdist_group("planned_examples")  # runs test_fidelity.py's {model}-2x4 plan: on its worker
@pytest.mark.parametrize("model", ["gpt", "moe"])
def test_adamw_steps_match_one_device(model, devices8):
    """Loss over 3 AdamW steps; the first moment after the first step (the gradient, scaled) tightly."""
    work = importlib.import_module(f"examples.{model}").workload("small")
    params, opt_state, batch = work.args
    reference = jax.jit(work.step, compiler_options=FAST_COMPILE)
    ref_params, ref_opt, _ = reference(*jax.tree.map(lambda x: x.copy(), (params, opt_state)), batch)
    # the same step planned the same way (options FAST) as test_fidelity.py's {model}-2x4 case: run its plan
    sharded = planned_example(model, (2, 4), time_limit_s=FAST.time_limit_s).step
    new_params, new_opt, _ = sharded(params, opt_state, batch)
    mu_got, mu_want = jax.tree.leaves(_first_moment(new_opt)), jax.tree.leaves(_first_moment(ref_opt))
    assert len(mu_got) == len(mu_want) > 0
    floor = 1e-2 * max(float(np.max(np.abs(np.asarray(x)))) for x in mu_want)
    for got, want in zip(mu_got, mu_want):
        err = float(np.max(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))))
        assert err / max(float(np.max(np.abs(np.asarray(want)))), floor) <= 1e-5
    ref, state = (ref_params, ref_opt), (new_params, new_opt)
    for _ in range(2):
        *ref, ref_loss = reference(*ref, batch)
        *state, loss = sharded(*state, batch)
        assert _rel(loss, ref_loss) <= 1e-5, f"loss {float(loss)} vs one device {float(ref_loss)}"


def test_step_with_a_prng_key_matches_one_device(devices8):
    import jax.numpy as jnp

    def step(w, batch, key):
        def loss(w):
            x = batch @ w
            keep = jax.random.bernoulli(key, 0.9, x.shape)
            return jnp.mean(jnp.where(keep, x, 0.0) ** 2)

        value, grad = jax.value_and_grad(loss)(w)
        return w - 0.1 * grad, value

    w, batch, key = jnp.linspace(0, 1, 16 * 8).reshape(16, 8), jnp.ones((32, 16)), jax.random.key(0)
    want_w, want_loss = jax.jit(step, compiler_options=FAST_COMPILE)(w, batch, key)
    sharded = autoshard.autoshard(step, mesh=(2, 4), options=FAST, compiler_options=FAST_COMPILE)
    got_w, got_loss = sharded(w, batch, key)
    assert _rel(got_loss, want_loss) <= 1e-6
    assert _rel(got_w, want_w) <= 1e-6
