"""The cyclic garbage collector is paused while a plan is made (``compiler/collector.py``) and left as it was."""
from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import pytest

import autoshard
from autoshard.compiler.collector import collector_paused
from autoshard.passes.intra_op import IntraOpOptions


@pytest.fixture
def collector_on():
    was_on = gc.isenabled()
    gc.enable()
    yield
    if not was_on:
        gc.disable()


def test_paused_inside_and_restored_after(collector_on):
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled(), "a nested pause turned the collector back on early"
    assert gc.isenabled()
    with pytest.raises(ValueError), collector_paused():
        raise ValueError("planning failed")
    assert gc.isenabled(), "an error while planning left the collector off"


def test_left_off_when_it_was_off(collector_on):
    gc.disable()
    with collector_paused():
        pass
    assert not gc.isenabled()


def test_a_plan_traces_and_plans_with_the_collector_paused(collector_on):
    seen = []

    def step(w, x):
        seen.append(gc.isenabled())  # called while the step is traced
        return jnp.sum(jnp.tanh(x @ w))

    args = (jax.ShapeDtypeStruct((16, 16), jnp.float32), jax.ShapeDtypeStruct((32, 16), jnp.float32))
    autoshard.plan(step, *args, mesh=(2, 4), cluster="cpu-8", num_stages=1, options=IntraOpOptions(time_limit_s=1.0))
    assert seen and not any(seen)
    assert gc.isenabled()
