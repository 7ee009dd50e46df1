"""Markers a train step may use so the compiler can see its structure.

``autoshard.grad`` / ``autoshard.value_and_grad`` behave exactly like the jax
functions; they name the loss computation (``jax.named_scope``) so that
passes can tell forward, backward and optimizer apart. ``layer_boundary(x)``
returns ``x`` unchanged and marks a preferred pipeline cut. A step written
with plain ``jax.grad`` plans as well, as one SPMD stage.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

LOSS_SCOPE = "autoshard_loss"


def _scoped(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with jax.named_scope(LOSS_SCOPE):
            return fn(*args, **kwargs)

    return wrapped


def value_and_grad(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
    """``jax.value_and_grad`` that marks ``fun`` as the loss."""
    return jax.value_and_grad(_scoped(fun), *args, **kwargs)


def grad(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
    """``jax.grad`` that marks ``fun`` as the loss."""
    return jax.grad(_scoped(fun), *args, **kwargs)


def layer_boundary(x: Any) -> Any:
    """Identity; will mark a preferred pipeline stage boundary after ``x``.

    The inter-op (pipeline) planner is not in this release, so this marker has
    no effect on plans yet; it is accepted so model code can carry it already.
    """
    return x
