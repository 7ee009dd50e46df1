"""A small marked MLP train step shared by the unit and sim tests of step splitting and layers."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import autoshard


def mlp_loss(params, batch):
    """tanh layers with a ``layer_boundary`` after each but the last: the markers decide the cuts."""
    x = batch["x"]
    for i, w in enumerate(params["w"]):
        x = jnp.tanh(x @ w)
        if i < len(params["w"]) - 1:
            x = autoshard.layer_boundary(x)
    return jnp.mean((x - batch["y"]) ** 2)


def scan_loss(params, batch):
    """The same tanh layers under ``lax.scan`` over a stacked ``params["w"]`` (layers, width, width): a scanned
    stack, whose iterations are the layers (no markers)."""
    def body(x, w):
        return jnp.tanh(x @ w), None

    x, _ = jax.lax.scan(body, batch["x"], params["w"])
    return jnp.mean((x - batch["y"]) ** 2)


def train_step(tx: optax.GradientTransformation, loss_fn=mlp_loss, marker: bool = True):
    """``step(params, opt_state, batch)``; ``marker`` picks autoshard.value_and_grad over jax's."""
    vag = autoshard.value_and_grad if marker else jax.value_and_grad

    def step(params, opt_state, batch):
        loss, grads = vag(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def host_args(tx: optax.GradientTransformation, width: int = 32, batch: int = 16, depth: int = 4, seed: int = 0):
    """``(params, opt_state, batch)`` as host (numpy) arrays, the same in every process that asks."""
    import numpy as np

    rng = np.random.RandomState(seed)
    params = {"w": [(rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32) for _ in range(depth)]}
    data = {"x": rng.standard_normal((batch, width)).astype(np.float32),
            "y": rng.standard_normal((batch, width)).astype(np.float32)}
    opt_state = jax.tree.map(np.asarray, tx.init(params))
    return params, opt_state, data
