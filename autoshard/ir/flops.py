"""The one FLOP counter of a jax equation, shared by the OpGraph tracer and the step splitter.

Each primitive's rule is a fact of the primitive table (``ir/primitives.py``, ``FlopRule``): dots and
convolutions count 2 · multiply-adds exactly; data movement (reshapes, slices, gathers, converts, ...)
counts nothing; reductions count one per input element; ops that lower to several elementwise ops
(``flops_per_element``; a polynomial's Horner steps) count each; everything else one per output
element. Control flow counts its bodies: ``scan`` its body times ``length``, ``while`` one iteration
of its condition and body (the trip count is not static), ``cond`` its most expensive branch.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from autoshard.ir.primitives import FlopRule, facts


def elements(shape: Sequence[int]) -> int:
    return int(np.prod(shape, dtype=np.int64)) if len(shape) else 1


def dot_general_flops(lhs_shape: Sequence[int], rhs_shape: Sequence[int], dimension_numbers: Any) -> float:
    """2 · batch · M · N · K for ``lax.dot_general``."""
    (lc, rc), (lb, rb) = dimension_numbers
    contract = elements([lhs_shape[d] for d in lc])
    batch = elements([lhs_shape[d] for d in lb])
    lhs_free = elements([s for d, s in enumerate(lhs_shape) if d not in lc and d not in lb])
    rhs_free = elements([s for d, s in enumerate(rhs_shape) if d not in rc and d not in rb])
    return 2.0 * batch * lhs_free * rhs_free * contract


def _valid_taps(in_size: int, kernel: int, stride: int, pad: tuple[int, int], lhs_dilation: int,
                rhs_dilation: int) -> int:
    """(output position, kernel tap) pairs of one spatial dim that land on a real input element
    (not on padding, nor on a hole of a dilated input): XLA counts only those."""
    dilated = (in_size - 1) * lhs_dilation + 1
    span = (kernel - 1) * rhs_dilation + 1
    out = (dilated + pad[0] + pad[1] - span) // stride + 1
    if out <= 0 or in_size <= 0:
        return 0
    pos = (np.arange(out)[:, None] * stride + np.arange(kernel)[None, :] * rhs_dilation - pad[0])
    return int(((pos >= 0) & (pos < dilated) & (pos % lhs_dilation == 0)).sum())


def conv_flops(lhs_shape: Sequence[int], rhs_shape: Sequence[int], out_shape: Sequence[int],
               params: Mapping[str, Any]) -> float:
    """2 · output batch · output features · kernel input features · valid taps for
    ``lax.conv_general_dilated``, taps over padding or input holes left out (as XLA counts)."""
    dn = params["dimension_numbers"]
    strides = params.get("window_strides") or (1,) * (len(lhs_shape) - 2)
    padding = params.get("padding") or ((0, 0),) * (len(lhs_shape) - 2)
    lhs_dil = params.get("lhs_dilation") or (1,) * (len(lhs_shape) - 2)
    rhs_dil = params.get("rhs_dilation") or (1,) * (len(lhs_shape) - 2)
    taps = 1
    for i, (ld, rd) in enumerate(zip(dn.lhs_spec[2:], dn.rhs_spec[2:])):
        taps *= _valid_taps(lhs_shape[ld], rhs_shape[rd], strides[i], tuple(padding[i]), lhs_dil[i], rhs_dil[i])
    return 2.0 * out_shape[dn.out_spec[0]] * out_shape[dn.out_spec[1]] * rhs_shape[dn.rhs_spec[1]] * taps


def op_flops(name: str, params: Mapping[str, Any], in_shapes: Sequence[Sequence[int]],
             out_shapes: Sequence[Sequence[int]], body_flops: Sequence[float] = ()) -> float:
    """FLOPs of one equation; ``body_flops`` are its control-flow bodies' totals, in jax's order
    (scan: the body; while: condition, body; cond: the branches)."""
    row = facts(name)
    rule = row.flops
    if rule is FlopRule.DOT:
        return dot_general_flops(in_shapes[0], in_shapes[1], params["dimension_numbers"])
    if rule is FlopRule.CONV:
        return conv_flops(in_shapes[0], in_shapes[1], out_shapes[0], params)
    if rule is FlopRule.BODIES:
        if name == "scan":
            return float(params["length"]) * float(sum(body_flops))
        if name == "cond":
            return float(max(body_flops, default=0.0))
        return float(sum(body_flops))  # while: the trip count is not static, one iteration
    if rule is FlopRule.ZERO:
        return 0.0
    if rule is FlopRule.PER_INPUT:
        return float(max((elements(s) for s in in_shapes), default=0))
    if rule is FlopRule.POLYNOMIAL:  # Horner's rule over x's coefficients: a multiply and an add per further one
        return 2.0 * max(0, len(in_shapes) - 2) * float(sum(elements(s) for s in out_shapes))
    return row.flops_per_element * float(sum(elements(s) for s in out_shapes))
