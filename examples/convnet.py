"""Residual convolutional classifier on NHWC images, written with Flax linen.

A 3x3 stem convolution, then one stage per entry of ``widths``: stages after
the first open with a stride-2 3x3 convolution (downsampling), and every stage
holds ``blocks_per_stage`` residual blocks ``relu(x + conv(relu(conv(x))))``.
Global average pooling and a Dense head give ``num_classes`` logits; the loss
is softmax cross-entropy and the optimizer SGD with momentum. There is no
batch normalization, so the parameters are the whole state and the step stays
a pure function.

Batches are synthetic: ``x`` float32 ``[batch, H, W, channels]`` from a normal
distribution and ``y`` int32 labels from a fixed random linear teacher on the
flattened image, deterministic given the seed.
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
    """Conv net hyper-parameters; derive variants with ``dataclasses.replace``."""

    image_size: int = 16  # height = width of the input images
    channels: int = 3  # input channels (NHWC)
    widths: tuple[int, ...] = (24, 48)  # channels per stage; each later stage halves H and W
    blocks_per_stage: int = 1  # residual blocks per stage
    num_classes: int = 10  # classifier outputs
    batch_size: int = 24  # images per step
    learning_rate: float = 0.05  # SGD step size
    momentum: float = 0.9  # SGD momentum


CONFIGS: dict[str, Config] = {
    "tiny": Config(image_size=8, widths=(24,), batch_size=24),
    "small": Config(),
    # Wide-ResNet-ish, ~55M parameters, six residual blocks; used abstractly by the benchmarks.
    "large": Config(image_size=32, widths=(256, 512, 1024), blocks_per_stage=2, batch_size=96),
}


class ResidualBlock(nn.Module):
    """``relu(x + conv3x3(relu(conv3x3(x))))`` at constant width."""

    width: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        y = nn.relu(nn.Conv(self.width, (3, 3))(x))
        y = nn.Conv(self.width, (3, 3))(y)
        return nn.relu(x + y)


class ConvNet(nn.Module):
    """Stem, residual stages with stride-2 transitions, global average pool, Dense head."""

    widths: tuple[int, ...]
    blocks_per_stage: int
    num_classes: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Conv(self.widths[0], (3, 3))(x))
        for stage, width in enumerate(self.widths):
            if stage > 0:
                x = nn.relu(nn.Conv(width, (3, 3), strides=(2, 2))(x))
            for _ in range(self.blocks_per_stage):
                x = ResidualBlock(width)(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes)(x)


def model(config: Config) -> ConvNet:
    return ConvNet(widths=config.widths, blocks_per_stage=config.blocks_per_stage,
                   num_classes=config.num_classes)


def init_params(config: Config, key: jax.Array) -> Params:
    """Fresh linen parameters ``{"params": {...}}``."""
    images = jnp.zeros((1, config.image_size, config.image_size, config.channels), jnp.float32)
    return model(config).init(key, images)


def make_batch(config: Config, key: jax.Array, batch_size: int) -> Batch:
    """``x`` float32 ``[batch, H, W, C]`` and teacher labels ``y`` int32 ``[batch]``."""
    x_key, teacher_key = jax.random.split(key)
    shape = (batch_size, config.image_size, config.image_size, config.channels)
    x = jax.random.normal(x_key, shape, jnp.float32)
    teacher = jax.random.normal(teacher_key, (x[0].size, config.num_classes), jnp.float32)
    y = jnp.argmax(x.reshape(batch_size, -1) @ teacher, axis=-1).astype(jnp.int32)
    return {"x": x, "y": y}


def workload(
    config: str | Config = "small",
    *,
    abstract: bool = False,
    seed: int = 0,
    batch_size: int | None = None,
) -> Workload:
    """A conv net classification train step (SGD with momentum) with its arguments."""
    name, cfg = resolve_config("convnet", CONFIGS, config, batch_size)
    net = model(cfg)

    def loss_fn(params: Params, batch: Batch) -> jax.Array:
        logits = net.apply(params, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    return build_workload(
        name,
        cfg,
        init_params=lambda key: init_params(cfg, key),
        make_batch=lambda key, size: make_batch(cfg, key, size),
        loss_fn=loss_fn,
        optimizer=optax.sgd(cfg.learning_rate, momentum=cfg.momentum),
        abstract=abstract,
        seed=seed,
    )
