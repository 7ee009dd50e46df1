"""Markers a train step may use so the compiler can see its structure.

``autoshard.grad`` / ``autoshard.value_and_grad`` behave exactly like the jax
functions. They run the differentiation inside one ``jax.jit`` named
``autoshard_value_and_grad`` (``VG_NAME``), so the traced step shows a single
equation whose operands are the loss arguments and whose results are
``(loss, *grad leaves)``: the step splitter (``ir/split.py``) finds
the loss computation there, the optimizer update after it, and needs no
global registry. The loss itself runs under ``jax.named_scope`` (``LOSS_SCOPE``).

``layer_boundary(x)`` returns ``x`` unchanged: a ``copy`` of each leaf under
the named scope ``LAYER_SCOPE``, which the layer clustering reads as a
preferred pipeline cut. Under plain jit it costs one copy XLA removes.

A step written with plain ``jax.grad`` plans as well, as one SPMD stage.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

LOSS_SCOPE = "autoshard_loss"
LAYER_SCOPE = "autoshard_layer_boundary"
VG_NAME = "autoshard_value_and_grad"


def _scoped(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with jax.named_scope(LOSS_SCOPE):
            return fn(*args, **kwargs)

    return wrapped


def vg_name(argnums: int | Sequence[int], has_aux: bool, leaf_counts: Sequence[int] = (),
            num_kwarg_leaves: int = 0) -> str:
    """The jit name that encodes the call: ``autoshard_value_and_grad.0.1.aux.L3_2.K1``.

    The numbers are the differentiated positions; ``L`` the flat leaves of each positional argument,
    ``K`` those of the keyword arguments (which follow them). Leaves the loss closes over are hoisted
    by jit in front of all of these, so the splitter knows them as the leading surplus of operands.
    """
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    parts = [VG_NAME, *map(str, nums)] + (["aux"] if has_aux else [])
    if leaf_counts:
        parts += ["L" + "_".join(map(str, leaf_counts)), f"K{num_kwarg_leaves}"]
    return ".".join(parts)


def value_and_grad(fun: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False,
                   **kwargs: Any) -> Callable[..., Any]:
    """``jax.value_and_grad`` that marks ``fun`` as the loss.

    Like jax's, the result takes positional and keyword arguments (keyword arguments are not
    differentiated) and ``fun`` may close over arrays of the step (the model, the batch).
    """
    inner = jax.value_and_grad(_scoped(fun), argnums=argnums, has_aux=has_aux, **kwargs)
    jitted: dict[str, Callable[..., Any]] = {}

    @functools.wraps(fun)
    def call(*args: Any, **kw: Any) -> Any:
        counts = tuple(len(jax.tree.leaves(a)) for a in args)
        name = vg_name(argnums, has_aux, counts, len(jax.tree.leaves(kw)))
        if name not in jitted:
            def marked(*a: Any, **k: Any) -> Any:
                return inner(*a, **k)

            marked.__name__ = marked.__qualname__ = name
            jitted[name] = jax.jit(marked)
        return jitted[name](*args, **kw)

    return call


def grad(fun: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False,
         **kwargs: Any) -> Callable[..., Any]:
    """``jax.grad`` that marks ``fun`` as the loss."""
    vg = value_and_grad(fun, argnums=argnums, has_aux=has_aux, **kwargs)

    @functools.wraps(fun)
    def grads_only(*args: Any, **kw: Any) -> Any:
        value, grads = vg(*args, **kw)
        return (grads, value[1]) if has_aux else grads

    return grads_only


def layer_boundary(x: Any) -> Any:
    """Identity on a pytree of arrays; marks a preferred pipeline stage boundary after ``x``."""
    with jax.named_scope(LAYER_SCOPE):
        return jax.tree.map(lambda a: jnp.array(a, copy=True), x)
