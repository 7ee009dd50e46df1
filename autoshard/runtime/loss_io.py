"""What a pipeline feeds the loss besides the parameters, and what it returns besides the loss.

- :class:`Prologue`: loss arguments the step computes before the loss (a model the loss closes over,
  built from the state; ``x = batch["x"] / 255`` closed over). The equations that compute them
  (``StepParts.prologue``) run once per step, or on each microbatch's slice of the batch when they
  read the batch, like the loss does.
- The aux outputs (``has_aux=True``): each microbatch's are gathered by the last stage, then
  :func:`combine_aux` makes the whole batch's: per-example leaves (:func:`aux_per_example`)
  concatenated in microbatch order, other float leaves averaged (the assumption already made for the
  loss: a mean over the batch), integer leaves (counts) summed.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from autoshard.errors import PlanningError
from autoshard.ir.split import StepParts, prologue_reads


class Prologue:
    """The step's equations before the loss that compute loss-argument leaves."""

    def __init__(self, parts: StepParts, split_inputs: Sequence[bool], num_microbatches: int,
                 jit_options: dict[str, Any] | None = None) -> None:
        self.parts, self.split_inputs, self.num_microbatches = parts, tuple(split_inputs), int(num_microbatches)
        self.fn: Callable[..., Any] | None = None
        self.per_microbatch = False
        if parts.prologue is None:
            return
        reads = prologue_reads(parts)
        batchy = [j for j, r in enumerate(reads) if any(self.split_inputs[i] for i in r)]
        diff = [parts.computed_leaves[j] for j in batchy if parts.forward.diff[parts.computed_leaves[j]]]
        if diff:
            raise PlanningError(f"differentiated loss-argument leaves {diff} are computed from the batch before the "
                                "loss; compute them inside the loss, or use num_stages=1")
        self.fn = jax.jit(jcore.jaxpr_as_fun(jcore.ClosedJaxpr(parts.prologue, [])), **(jit_options or {}))
        self.per_microbatch = bool(batchy)

    def leaves(self, flat: Sequence[Any]) -> list[dict[int, Any]]:
        """Per microbatch: {loss-argument leaf: value} of the computed leaves ({} when there are none)."""
        num_mb = self.num_microbatches
        if self.fn is None:
            return [{} for _ in range(num_mb)]
        consts = list(self.parts.closed.consts)
        out = []
        for m in range(num_mb if self.per_microbatch else 1):
            ins = [_slice(x, m, num_mb) if split else x for x, split in zip(flat, self.split_inputs)]
            out.append(dict(zip(self.parts.computed_leaves, self.fn(*consts, *ins))))
        return out if self.per_microbatch else out * num_mb


def _slice(x: Any, m: int, num_mb: int) -> Any:
    size = x.shape[0] // num_mb
    return x[m * size:(m + 1) * size]


def aux_per_example(parts: StepParts, split_inputs: Sequence[bool]) -> tuple[bool, ...]:
    """Per aux output: a per-example value, concatenated over microbatches (it depends on the microbatched
    batch and its leading dimension is the microbatch size); the others are reduced."""
    fwd = parts.forward
    split_leaf = [src is not None and bool(split_inputs[src]) for src in parts.operand_inputs]
    sizes = {fwd.avals[v].shape[0] for v, s in zip(fwd.invars, split_leaf) if s}
    for j, reads in enumerate(prologue_reads(parts)):
        if any(split_inputs[i] for i in reads):
            split_leaf[parts.computed_leaves[j]] = True
    tainted = {v for v, s in zip(fwd.invars, split_leaf) if s}
    for e in fwd.eqns:
        if any(not isinstance(a, jcore.Literal) and a in tainted for a in e.ins):
            tainted.update(e.outs)
    return tuple(not isinstance(a, jcore.Literal) and a in tainted and len(fwd.avals[a].shape) >= 1
                 and fwd.avals[a].shape[0] in sizes for a in fwd.aux)


def combine_aux(per_example: Sequence[bool], per_mb: Sequence[Sequence[Any]]) -> list[Any]:
    """The whole batch's aux outputs from each microbatch's (module docstring)."""
    out = []
    for j, concat in enumerate(per_example):
        vals = [jnp.asarray(mb[j]) for mb in per_mb]
        if concat:
            out.append(jnp.concatenate(vals, axis=0))
        elif jnp.issubdtype(vals[0].dtype, jnp.inexact):
            out.append(sum(vals[1:], vals[0]) / len(vals))
        else:
            out.append(sum(vals[1:], vals[0]))
    return out
