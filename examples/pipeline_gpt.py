"""The GPT example with its loss marked for pipelining, written the usual way: the loss closes over the batch.

``workload(config, abstract=...)`` is ``examples.gpt``'s with the step

    loss, grads = autoshard.value_and_grad(lambda p: loss_fn(p, batch))(params)

so ``autoshard verify examples/pipeline_gpt.py --config tiny --stages 2`` plans it as a pipeline and checks
each stage executable against what XLA compiles.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import optax

import autoshard
from examples import gpt

CONFIGS = gpt.CONFIGS


def marked_step(loss_fn: Any, optimizer: optax.GradientTransformation) -> Any:
    def step(params: Any, opt_state: Any, batch: Any) -> Any:
        loss, grads = autoshard.value_and_grad(lambda p: loss_fn(p, batch))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def marked(work: Any) -> Any:
    """A GPT-family workload (adamw from its config) with its step's loss marked for pipelining."""
    cfg = work.config
    optimizer = optax.adamw(cfg.learning_rate, weight_decay=cfg.weight_decay)
    return dataclasses.replace(work, step=marked_step(work.loss_fn, optimizer))


def workload(config: str | gpt.Config = "small", *, abstract: bool = False, seed: int = 0,
             batch_size: int | None = None) -> Any:
    return marked(gpt.workload(config, abstract=abstract, seed=seed, batch_size=batch_size))
