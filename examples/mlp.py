"""Multi-layer perceptron regression, written with Flax linen.

``num_layers`` Dense + GELU hidden layers of width ``hidden`` and a linear
output layer, trained with mean squared error and ``optax.adam`` on a
synthetic teacher: targets are ``tanh(x @ W_teacher)`` for a fixed random
``W_teacher`` drawn from the batch key, so the problem is learnable and the
batch is deterministic given the seed.

Parameters are linen's plain dict, ``{"params": {"Dense_0": {"kernel", "bias"}, ...}}``.
"""
from __future__ import annotations

from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from examples.common import Batch, Params, Workload, build_workload, resolve_config


@dataclass(frozen=True)
class Config:
    """MLP hyper-parameters; derive variants with ``dataclasses.replace``."""

    in_features: int = 96  # input width
    hidden: int = 192  # width of every hidden layer
    num_layers: int = 4  # hidden Dense + GELU layers
    out_features: int = 48  # regression targets per example
    batch_size: int = 48  # examples per step
    learning_rate: float = 1e-3  # adam step size


CONFIGS: dict[str, Config] = {
    "tiny": Config(in_features=24, hidden=48, num_layers=2, out_features=24, batch_size=24),
    "small": Config(),
    # ~537M parameters; used abstractly.
    "large": Config(in_features=8192, hidden=8192, num_layers=7, out_features=8192, batch_size=1536),
}


class Mlp(nn.Module):
    """``num_layers`` x (Dense(hidden) -> GELU), then Dense(out_features)."""

    hidden: int
    num_layers: int
    out_features: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for _ in range(self.num_layers):
            x = nn.gelu(nn.Dense(self.hidden)(x))
        return nn.Dense(self.out_features)(x)


def model(config: Config) -> Mlp:
    return Mlp(hidden=config.hidden, num_layers=config.num_layers, out_features=config.out_features)


def init_params(config: Config, key: jax.Array) -> Params:
    """Fresh linen parameters ``{"params": {...}}``."""
    return model(config).init(key, jnp.zeros((1, config.in_features), jnp.float32))


def make_batch(config: Config, key: jax.Array, batch_size: int) -> Batch:
    """``x`` float32 ``[batch, in_features]``, ``y = tanh(x @ W_teacher)`` ``[batch, out_features]``."""
    x_key, teacher_key = jax.random.split(key)
    x = jax.random.normal(x_key, (batch_size, config.in_features), jnp.float32)
    teacher = jax.random.normal(teacher_key, (config.in_features, config.out_features), jnp.float32)
    return {"x": x, "y": jnp.tanh(x @ teacher / jnp.sqrt(config.in_features))}


def workload(
    config: str | Config = "small",
    *,
    abstract: bool = False,
    seed: int = 0,
    batch_size: int | None = None,
) -> Workload:
    """An MLP regression train step (adam, MSE) with its arguments."""
    name, cfg = resolve_config("mlp", CONFIGS, config, batch_size)
    net = model(cfg)

    def loss_fn(params: Params, batch: Batch) -> jax.Array:
        return jnp.mean((net.apply(params, batch["x"]) - batch["y"]) ** 2)

    return build_workload(
        name,
        cfg,
        init_params=lambda key: init_params(cfg, key),
        make_batch=lambda key, size: make_batch(cfg, key, size),
        loss_fn=loss_fn,
        optimizer=optax.adam(cfg.learning_rate),
        abstract=abstract,
        seed=seed,
    )
