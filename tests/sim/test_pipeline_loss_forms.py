"""Pipelines of train steps written the usual ways: a loss that closes over the model and the batch,
``has_aux=True``, several differentiated arguments (``argnums=(0, 1)``) and keyword arguments.

Each runs 3 SGD steps as a 2-stage pipeline with 2 microbatches on 8 simulated devices and compares
the loss, the aux outputs and the parameters with the same step on one device (fp32, rel <= 1e-5).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autoshard
from compiled_examples import FAST_COMPILE

WIDTH, BATCH, DEPTH = 8, 16, 4
TX = optax.sgd(0.3)


def _data():
    keys = jax.random.split(jax.random.key(3), DEPTH + 3)
    w = [jax.random.normal(k, (WIDTH, WIDTH)) / 3 for k in keys[:DEPTH]]
    frozen = jax.random.normal(keys[DEPTH], (WIDTH,))
    batch = {"x": jax.random.normal(keys[-2], (BATCH, WIDTH)), "y": jax.random.normal(keys[-1], (BATCH, WIDTH))}
    return w, frozen, batch


def _mlp(ws, x):
    for i, w in enumerate(ws):
        x = jnp.tanh(x @ w)
        if i < len(ws) - 1:
            x = autoshard.layer_boundary(x)
    return x


SCHEDULES = [pytest.param("1f1b", 2, id="1f1b-2"), pytest.param("gpipe", 4, id="gpipe-4", marks=pytest.mark.slow)]


def _run(step, state, batch, outputs=1, schedule="1f1b", microbatches=2):
    """3 steps pipelined and on one device, compared after each step; returns the decorated step."""
    piped = autoshard.autoshard(step, num_stages=2, num_microbatches=microbatches, schedule=schedule,
                                compiler_options=FAST_COMPILE)
    reference = jax.jit(step, compiler_options=FAST_COMPILE)
    ref = got = state
    for _ in range(3):
        *ref, ref_out = (lambda r: (r[:-outputs], r[-outputs:]))(reference(*ref, batch))
        *got, got_out = (lambda r: (r[:-outputs], r[-outputs:]))(piped(*got, batch))
        ref, got = ref[0], got[0]
        for a, b in zip(jax.tree.leaves(got_out), jax.tree.leaves(ref_out)):
            assert np.shape(a) == np.shape(b)
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert len(piped.plan.stages) == 2
    return piped


@pytest.mark.parametrize("schedule, microbatches", SCHEDULES)
def test_loss_closing_over_the_model_and_the_batch(devices8, schedule, microbatches):
    def loss_fn(model, ws, batch):
        x = batch["x"] * model["scale"] + model["shift"]
        return jnp.mean((_mlp(ws, x) - batch["y"]) ** 2)

    def step(params, opt_state, batch):
        # the model the loss closes over: a step input and a leaf the step computes; the batch closed over too
        model = {"scale": params["frozen"], "shift": jnp.tanh(params["frozen"]) * 0.5}
        loss, grads = autoshard.value_and_grad(lambda ws: loss_fn(model, ws, batch))(params["w"])
        updates, opt_state = TX.update(grads, opt_state, params["w"])
        return {"w": optax.apply_updates(params["w"], updates), "frozen": params["frozen"]}, opt_state, loss

    w, frozen, batch = _data()
    piped = _run(step, ({"w": w, "frozen": frozen}, TX.init(w)), batch, schedule=schedule, microbatches=microbatches)
    assert piped.pipeline_step.parts.computed_leaves  # "shift" came from the step, not an argument


def test_loss_closing_over_a_batch_the_step_prepares(devices8):
    def step(ws, opt_state, batch):
        x = batch["x"] / 2.0 + 1.0  # computed per example before the loss: it runs on each microbatch
        loss, grads = autoshard.value_and_grad(lambda p: jnp.mean((_mlp(p, x) - batch["y"]) ** 2))(ws)
        updates, opt_state = TX.update(grads, opt_state, ws)
        return optax.apply_updates(ws, updates), opt_state, loss

    w, _, batch = _data()
    piped = _run(step, (w, TX.init(w)), batch)
    assert piped.pipeline_step.prologue.per_microbatch


@pytest.mark.parametrize("schedule, microbatches", SCHEDULES)
def test_has_aux_returns_the_whole_batch_aux(devices8, schedule, microbatches):
    def loss_fn(ws, batch):
        first = jnp.tanh(batch["x"] @ ws[0])
        early = jnp.mean(first ** 2)  # made before the first cut, in the first stage: it travels to the last
        pred = _mlp(ws[1:], autoshard.layer_boundary(first))
        err = (pred - batch["y"]) ** 2
        aux = {"pred": pred, "mae": jnp.mean(jnp.abs(pred - batch["y"])), "hits": jnp.sum(err < 0.5), "early": early}
        return jnp.mean(err), aux

    def step(ws, opt_state, batch):
        (loss, aux), grads = autoshard.value_and_grad(loss_fn, has_aux=True)(ws, batch)
        updates, opt_state = TX.update(grads, opt_state, ws)
        return optax.apply_updates(ws, updates), opt_state, loss, aux

    w, _, batch = _data()
    piped = _run(step, (w, TX.init(w)), batch, outputs=2, schedule=schedule, microbatches=microbatches)
    assert piped.pipeline_step.aux_per_example == (False, False, False, True)  # early, hits, mae, pred (sorted)
    runtime = piped.pipeline_step
    early_var = runtime.parts.forward.aux[0]
    assert early_var in runtime.programs[0].out_acts and early_var in runtime.programs[1].in_acts


def test_two_differentiated_arguments_and_keyword_arguments(devices8):
    def loss_fn(first, rest, *, batch, scale):
        return jnp.mean((_mlp([first, *rest], batch["x"] * scale) - batch["y"]) ** 2)

    def step(params, opt_state, batch):
        loss, (g0, g1) = autoshard.value_and_grad(loss_fn, argnums=(0, 1))(
            params["first"], params["rest"], batch=batch, scale=params["scale"])
        grads = {"first": g0, "rest": g1}
        trained = {"first": params["first"], "rest": params["rest"]}
        updates, opt_state = TX.update(grads, opt_state, trained)
        return {**optax.apply_updates(trained, updates), "scale": params["scale"]}, opt_state, loss

    w, frozen, batch = _data()
    params = {"first": w[0], "rest": w[1:], "scale": frozen}
    _run(step, (params, TX.init({"first": w[0], "rest": w[1:]})), batch)


def test_gpt_step_whose_loss_closes_over_the_batch(devices8):
    """The issue's report: ``value_and_grad(lambda p: loss_fn(p, batch))(params)`` with the nnx GPT."""
    import dataclasses

    from examples import gpt, pipeline_gpt

    config = dataclasses.replace(gpt.CONFIGS["small"], num_layers=4, d_model=32, num_heads=2, seq_len=8,
                                 batch_size=8)
    work = gpt.workload(config)
    params, _, batch = work.args
    step = pipeline_gpt.marked_step(work.loss_fn, TX)
    piped = _run(step, (params, TX.init(params)), batch)
    assert piped.pipeline_step.parts.arg_leaf_counts[0] == 1  # the closed-over tokens
