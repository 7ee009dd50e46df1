"""One trace per SPMD plan: ``jax.make_jaxpr`` runs once on the step, and so does its Python function.

(jax caches traces by function and shapes, so the Python call count alone would not see a second
``make_jaxpr`` of the same step: both are counted.)"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import autoshard

TX = optax.adam(1e-2)


def _loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"])
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def _counted(marker: bool):
    """A train step that counts how often jax traces it."""
    calls = {"n": 0}
    grad = autoshard.value_and_grad if marker else jax.value_and_grad

    def step(params, opt_state, batch):
        calls["n"] += 1
        loss, grads = grad(_loss)(params, batch)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, calls


def _shapes():
    f32 = jnp.float32
    params = {"w1": jax.ShapeDtypeStruct((16, 32), f32), "w2": jax.ShapeDtypeStruct((32, 8), f32)}
    batch = {"x": jax.ShapeDtypeStruct((16, 16), f32), "y": jax.ShapeDtypeStruct((16, 8), f32)}
    return params, jax.eval_shape(TX.init, params), batch


@pytest.fixture
def make_jaxpr_calls(monkeypatch):
    """How many times anything calls ``jax.make_jaxpr`` during the test."""
    seen = {"n": 0}
    original = jax.make_jaxpr

    def counting(*args, **kwargs):
        seen["n"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(jax, "make_jaxpr", counting)
    return seen


@pytest.mark.parametrize("marker", [False, True], ids=["jax-grad", "autoshard-grad"])
@pytest.mark.parametrize("mesh", [None, (2, 4)], ids=["mesh-searched", "mesh-given"])
def test_autoshard_plan_traces_once(marker, mesh, make_jaxpr_calls):
    step, calls = _counted(marker)
    num_stages = 1 if marker and mesh is None else None  # a marked step with no mesh also prices pipelines
    plan = autoshard.plan(step, *_shapes(), mesh=mesh, cluster="cpu-8", num_stages=num_stages,
                          options=autoshard.api.IntraOpOptions(time_limit_s=1.0))
    assert not plan.stages
    assert calls["n"] == 1 and make_jaxpr_calls["n"] == 1


def test_decorator_lower_traces_once(make_jaxpr_calls):
    step, calls = _counted(marker=True)
    wrapped = autoshard.autoshard(step, mesh=(2, 4), cluster="cpu-8",
                                  options=autoshard.api.IntraOpOptions(time_limit_s=1.0))
    wrapped.lower(*_shapes())  # plans and lowers; nothing is compiled
    wrapped.lower(*_shapes())  # the same signature: cached
    assert calls["n"] == 1 and make_jaxpr_calls["n"] == 1


def test_plan_and_decorator_search_the_same_way():
    """autoshard.plan and @autoshard plan from the same starts (the classic layouts included): same plan."""
    options = autoshard.api.IntraOpOptions(time_limit_s=1.0)
    step, _ = _counted(marker=False)
    planned = autoshard.plan(step, *_shapes(), mesh=(2, 4), cluster="1x8-a100", options=options)
    wrapped = autoshard.autoshard(step, mesh=(2, 4), cluster="1x8-a100", options=options)
    wrapped.lower(*_shapes())
    assert wrapped.plan.input_specs == planned.input_specs
    assert wrapped.plan.op_out_specs == planned.op_out_specs
    assert wrapped.plan.step_s == planned.step_s
