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
