"""Where a loss couples the examples of its batch: a batch statistic that flows back into per-example values.

A pipeline runs the loss a microbatch at a time and averages the microbatches' losses and gradients, which
is the whole batch's step only when each example's loss depends on that example alone. A loss that reduces
an activation across the batch and uses the result per example (``nn.BatchNorm`` in training: each example
normalised by the batch's mean and variance) computes, per microbatch, the microbatch's statistics instead.

:func:`batch_statistics` finds that from the loss traced at the whole batch and at one microbatch (the
equations align one to one): a value is *per-example* when its shape shrinks with the batch; an equation
that makes a value of the same shape at both sizes from per-example operands reduces across the batch
(a *statistic*, and so is everything computed from one); a statistic read by an equation that makes a
per-example value is a coupling. The loss's own mean over the batch is a statistic that nothing per-example
reads. Couplings that keep the batch's shape (a cumulative sum across the batch, in-batch negatives as a
``[B, B]`` product) are not seen.
"""
from __future__ import annotations

import warnings
from typing import Any

from jax.extend import core as jcore

from autoshard.errors import MicrobatchCouplingWarning
from autoshard.ir.split import Forward
from autoshard.ir.trace import eqn_source

__all__ = ["batch_statistics", "warn_coupled"]


def _shape(forward: Forward, atom: Any) -> tuple[int, ...] | None:
    if isinstance(atom, jcore.Literal):
        return None
    return tuple(forward.avals[atom].shape)


def batch_statistics(whole: Forward, small: Forward) -> list[str]:
    """The equations (their source lines, or primitive names) where a batch statistic flows into per-example
    values (module docstring); empty when none does or the two traces do not align."""
    if len(whole.eqns) != len(small.eqns):
        return []
    statistic: set[Any] = set()  # variables of ``small``
    found: list[str] = []
    for a, b in zip(whole.eqns, small.eqns):
        ins_per_example = [_shape(whole, x) != _shape(small, y) for x, y in zip(a.ins, b.ins)
                           if not isinstance(y, jcore.Literal)]
        outs_per_example = [_shape(whole, x) != _shape(small, y) for x, y in zip(a.outs, b.outs)]
        reads_statistic = any(not isinstance(y, jcore.Literal) and y in statistic for y in b.ins)
        if reads_statistic and any(outs_per_example):
            found.append(eqn_source(b.eqn) or b.eqn.primitive.name)
        for out, per_example in zip(b.outs, outs_per_example):
            if reads_statistic or (any(ins_per_example) and not per_example):
                statistic.add(out)
    return found


def warn_coupled(found: list[str], num_microbatches: int, stacklevel: int) -> None:
    """The ``MicrobatchCouplingWarning`` for the couplings ``found`` (:func:`batch_statistics`) of a step run
    ``num_microbatches`` microbatches at a time: the planner's when a count is forced, the runtime's."""
    where = ", ".join(list(dict.fromkeys(found))[:3])
    warnings.warn(
        f"the loss couples the examples of its batch: a statistic over the batch is used per example (such as "
        f"nn.BatchNorm's mean and variance in training) at {where}; with num_microbatches={num_microbatches} "
        "the pipeline runs it a microbatch at a time, each with its own statistic, so the step is not one "
        "device's. Plan with num_stages=1, or num_microbatches=1, to keep the whole batch's statistics.",
        MicrobatchCouplingWarning, stacklevel=stacklevel + 1)
