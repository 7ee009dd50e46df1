"""A pipeline plan traces the user's step at most twice: once at its full batch, once at one microbatch
(``ir/step_trace.py``); the runtime the decorator builds runs on those traces.

Counted two ways: the step's own Python calls, and every ``jax.make_jaxpr`` / ``jax.eval_shape`` of the step
(jax caches traces by function and shapes, so the Python count alone would miss a repeated ``make_jaxpr``).
The layers' train graphs are traced too, but they are other functions: not the step."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import autoshard
from autoshard.passes.intra_op import IntraOpOptions
from mlp_steps import scan_loss, train_step

TX = optax.sgd(0.1)


def _args(depth: int = 4, width: int = 8, batch: int = 8):
    f32 = jnp.float32
    params = {"w": [jax.ShapeDtypeStruct((width, width), f32) for _ in range(depth)]}
    data = {"x": jax.ShapeDtypeStruct((batch, width), f32), "y": jax.ShapeDtypeStruct((batch, width), f32)}
    return params, jax.eval_shape(TX.init, params), data


def _scan_args(depth: int = 4, width: int = 8, batch: int = 8):
    f32 = jnp.float32
    params = {"w": jax.ShapeDtypeStruct((depth, width, width), f32)}
    data = {"x": jax.ShapeDtypeStruct((batch, width), f32), "y": jax.ShapeDtypeStruct((batch, width), f32)}
    return params, jax.eval_shape(TX.init, params), data


def _counted(monkeypatch, inner):
    """``inner`` wrapped, and how often it was called and handed to make_jaxpr / eval_shape."""
    seen = {"calls": 0, "traces": 0}

    def step(params, opt_state, batch):
        seen["calls"] += 1
        return inner(params, opt_state, batch)

    make_jaxpr, eval_shape = jax.make_jaxpr, jax.eval_shape

    def counting_make_jaxpr(fn, *args, **kwargs):
        seen["traces"] += fn is step
        return make_jaxpr(fn, *args, **kwargs)

    def counting_eval_shape(fn, *args, **kwargs):
        seen["traces"] += fn is step
        return eval_shape(fn, *args, **kwargs)

    monkeypatch.setattr(jax, "make_jaxpr", counting_make_jaxpr)
    monkeypatch.setattr(jax, "eval_shape", counting_eval_shape)
    return step, seen


@pytest.fixture
def counted(monkeypatch):
    """A marked MLP step, and how often it was called and handed to make_jaxpr / eval_shape."""
    return _counted(monkeypatch, train_step(TX))


@pytest.fixture
def counted_scan(monkeypatch):
    """The MLP's layers as a scanned stack, counted the same way."""
    return _counted(monkeypatch, train_step(TX, scan_loss))


OPTIONS = IntraOpOptions(time_limit_s=1.0)


@pytest.mark.parametrize(("num_stages", "num_microbatches"), [(2, 2), (None, None), (2, None)],
                         ids=["stages-given", "stages-and-microbatches-searched", "microbatches-searched"])
def test_pipeline_plan_traces_the_step_at_most_twice(counted, num_stages, num_microbatches):
    """With B searched on batch 8 the layers are priced at r = 4 and the stage DP chooses B = 2: that count is
    extrapolated from the two traces (``ir/rescale.py``), not traced."""
    step, seen = counted
    plan = autoshard.plan(step, *_args(), cluster="cpu-8", num_stages=num_stages,
                          num_microbatches=num_microbatches, options=OPTIONS)
    if num_stages == 2:
        assert len(plan.stages) == 2 and plan.pipeline is not None
    if (num_stages, num_microbatches) == (2, None):
        assert plan.num_microbatches == 2, "the stage DP chose a traced count here: pick a case that does not"
    assert seen["traces"] == 2  # the full batch and one microbatch
    assert seen["calls"] <= 2


def test_scanned_stack_pipeline_plan_traces_the_step_twice(counted_scan):
    """A scanned stack's plan reports the step cut per iteration: that view replays the full-batch trace (the
    jaxpr) rather than calling the step a third time."""
    step, seen = counted_scan
    plan = autoshard.plan(step, *_scan_args(), cluster="cpu-8", num_stages=2, num_microbatches=2, options=OPTIONS)
    assert len(plan.stages) == 2 and plan.pipeline is not None and plan.pipeline.scan_layers == 4
    assert seen["traces"] == 2 and seen["calls"] <= 2


@pytest.mark.parametrize("num_microbatches", [2, None], ids=["given", "searched"])
def test_decorated_pipeline_plans_and_builds_its_runtime_on_two_traces(counted, num_microbatches):
    """The runtime runs on the planner's microbatch traces: the priced one, or (a B the stage DP chose) the one
    extrapolated from it (``ir/rescale.py``)."""
    step, seen = counted
    wrapped = autoshard.autoshard(step, cluster="cpu-8", num_stages=2, num_microbatches=num_microbatches,
                                  options=OPTIONS)
    planned = wrapped.planned(*_args())  # plans and builds the pipeline runtime (lowering would compile)
    assert len(planned.plan.stages) == 2 and planned.plan is wrapped.plan
    assert seen["traces"] == 2 and seen["calls"] <= 2
