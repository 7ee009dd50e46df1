"""Small pipelines on 8 simulated devices: user layer markers, a parameter shared by two stages,
a searched microbatch count. Each compares 3 SGD steps with the same steps on one device."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import autoshard
from compiled_examples import FAST_COMPILE
from mlp_steps import mlp_loss, train_step


def _step(loss_fn, tx):
    return train_step(tx, loss_fn)


def _compare(step, params, tx, batch, **options):
    piped = autoshard.autoshard(step, **options, compiler_options=FAST_COMPILE)
    reference = jax.jit(step, compiler_options=FAST_COMPILE)
    ref = state = (params, tx.init(params))
    for _ in range(3):
        *ref, ref_loss = reference(*ref, batch)
        *state, loss = piped(*state, batch)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(state[0]), jax.tree.leaves(ref[0])):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    return piped.plan


def _data(width=16, batch=16, depth=4):
    keys = jax.random.split(jax.random.key(1), depth + 3)
    params = {"w": [jax.random.normal(k, (width, width)) / 4 for k in keys[:depth]],
              "shared": jax.random.normal(keys[depth], (width, width)) / 4}
    batch_ = {"x": jax.random.normal(keys[-2], (batch, width)), "y": jax.random.normal(keys[-1], (batch, width))}
    return params, batch_


def test_layer_markers_decide_the_cuts(devices8):
    loss = mlp_loss

    params, batch = _data()
    params.pop("shared")
    tx = optax.sgd(0.5)
    plan = _compare(_step(loss, tx), params, tx, batch, num_stages=4, schedule="gpipe")
    assert [(s.first_layer, s.last_layer) for s in plan.stages] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert plan.pipeline.layers == 4 and 16 % plan.num_microbatches == 0


def test_parameter_read_by_two_stages_sums_its_gradients(devices8):
    def loss(params, batch):
        x = jnp.tanh(batch["x"] @ params["shared"])
        for w in params["w"]:
            x = autoshard.layer_boundary(jnp.tanh(x @ w))
        x = x @ params["shared"].T  # the first stage's weight, read again by the last stage
        return jnp.mean((x - batch["y"]) ** 2)

    params, batch = _data()
    tx = optax.sgd(0.5)
    plan = _compare(_step(loss, tx), params, tx, batch, num_stages=2, num_microbatches=2, schedule="1f1b")
    assert len(plan.stages) == 2


def test_a_layer_reading_the_batch_runs_its_own_planned_backward(devices8, caplog):
    """The first block reads the batch leaf (no input cotangent to make: a train graph one op shorter than
    its class's other layers): it is a class of its own, so every stage runs the backward its plan priced
    instead of falling back to jax.vjp with collectives no plan predicted."""
    from autoshard.ir.split import split_step
    from autoshard.ir.trace import trace
    from autoshard.ir.train_graph import class_keys, one_layer_programs
    from autoshard.passes.layers import cluster_layers

    params, batch = _data()
    params.pop("shared")
    tx = optax.sgd(0.5)
    step = _step(mlp_loss, tx)
    forward = split_step(trace(step, params, tx.init(params), batch).jaxpr).forward
    layers = cluster_layers(forward, None)
    programs = one_layer_programs(forward, [layer.eqns for layer in layers])
    keys = class_keys(forward, [layer.structure for layer in layers], programs)
    assert len({layer.structure for layer in layers[:3]}) == 1  # the first three blocks: one structure
    assert keys[0] != keys[1] == keys[2] and keys[0].split("/")[0] == keys[1].split("/")[0]

    with caplog.at_level("WARNING", logger="autoshard"):
        _compare(step, params, tx, batch, num_stages=2, num_microbatches=2, schedule="1f1b")
    fallbacks = [r.getMessage() for r in caplog.records if "runs jax.vjp" in r.getMessage()]
    assert not fallbacks, fallbacks
