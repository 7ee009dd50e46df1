"""A Flax stack of blocks under ``nn.scan`` with dropout in its body, shared by the SPMD and pipeline tests of
random bits (``tests/sim/test_random_bits_split.py``, ``tests/sim/test_pipeline_randomness.py``)."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import autoshard


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        y = nn.Dense(64)(nn.gelu(nn.Dense(128)(x)))
        return x + nn.Dropout(0.2, deterministic=False)(y), None


class _Stack(nn.Module):
    length: int

    @nn.compact
    def __call__(self, x):
        blocks = nn.scan(_Block, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
                         length=self.length)
        x, _ = blocks()(nn.Dense(64)(x), None)
        return nn.Dense(1)(x)


def scanned_dropout_step(length: int, marked: bool = False) -> tuple:
    """(step, args): SGD on a regression through ``length`` scanned blocks, each with dropout from the step's
    key; ``marked``: gradients by ``autoshard.value_and_grad`` with the batch and key passed (it may pipeline)."""
    model, tx = _Stack(length), optax.sgd(0.1)
    x, y = jax.random.normal(jax.random.key(1), (256, 32)), jax.random.normal(jax.random.key(2), (256, 1))
    params = model.init({"params": jax.random.key(0), "dropout": jax.random.key(5)}, x)["params"]

    def loss_fn(p, batch, key):
        return jnp.mean((model.apply({"params": p}, batch[0], rngs={"dropout": key}) - batch[1]) ** 2)

    def step(params, opt_state, batch, key):
        if marked:
            loss, grads = autoshard.value_and_grad(loss_fn)(params, batch, key)
        else:
            loss, grads = jax.value_and_grad(lambda p: loss_fn(p, batch, key))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, tx.init(params), (x, y), jax.random.key(9))
