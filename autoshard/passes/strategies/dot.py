"""Contraction rules: dot_general and conv_general_dilated.

dot_general is the einsum ``b m k, b k n -> b m n`` over its dimension
numbers: batch dims and free dims are parallel factors, contracting dims are
reduced (a split contracting dim leaves partial sums: all-reduce, or
reduce-scatter onto an output dim).

conv_general_dilated: batch and output features are parallel, input features
are reduced (the weight gradient of a data-parallel conv contracts the batch,
which is its lhs feature dim, so it gets the all-reduce it needs). Spatial dims
never split (windows cross shard borders). Grouped convs split whole groups:
input channels, output features and the group count together, with the local
``feature_group_count`` rewritten. A conv with ``batch_group_count > 1`` (the
weight gradient of a grouped conv) only splits its input features.
"""
from __future__ import annotations

from collections.abc import Sequence

from autoshard.ir.graph import Op, Value
from autoshard.meshes.logical import LogicalMesh
from autoshard.passes.strategies.base import (
    Factor, Shape, Strategy, factor_strategies, register, register_localizer,
)


def dot_general_factors(lhs: Value, rhs: Value, dimension_numbers: tuple) -> list[Factor]:
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    lhs_free = [d for d in range(lhs.rank) if d not in lhs_contract and d not in lhs_batch]
    rhs_free = [d for d in range(rhs.rank) if d not in rhs_contract and d not in rhs_batch]
    nb, nl = len(lhs_batch), len(lhs_free)
    factors = [Factor(lhs.shape[lb], (lb, rb), (i,)) for i, (lb, rb) in enumerate(zip(lhs_batch, rhs_batch))]
    factors += [Factor(lhs.shape[d], (d, None), (nb + i,)) for i, d in enumerate(lhs_free)]
    factors += [Factor(rhs.shape[d], (None, d), (nb + nl + i,)) for i, d in enumerate(rhs_free)]
    factors += [Factor(lhs.shape[lc], (lc, rc), (None,)) for lc, rc in zip(lhs_contract, rhs_contract)]
    return factors


@register("dot_general")
def _dot_general_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    lhs, rhs = ins
    return factor_strategies(op, ins, outs, mesh, dot_general_factors(lhs, rhs, op.params["dimension_numbers"]))


def conv_factors(lhs: Value, rhs: Value, out: Value, params: dict) -> list[Factor]:
    dn = params["dimension_numbers"]
    (lhs_b, lhs_f), (rhs_o, rhs_i), (out_b, out_f) = dn.lhs_spec[:2], dn.rhs_spec[:2], dn.out_spec[:2]
    groups, batch_groups = params["feature_group_count"], params["batch_group_count"]
    if batch_groups > 1:
        return [Factor(lhs.shape[lhs_f], (lhs_f, rhs_i), (None,))]
    batch = Factor(lhs.shape[lhs_b], (lhs_b, None), (out_b,))
    if groups > 1:
        # Group g reads input channels [g*C/G, (g+1)*C/G) and writes features [g*O/G, (g+1)*O/G).
        return [batch, Factor(groups, (lhs_f, rhs_o), (out_f,))]
    return [batch, Factor(rhs.shape[rhs_o], (None, rhs_o), (out_f,)),
            Factor(lhs.shape[lhs_f], (lhs_f, rhs_i), (None,))]


@register("conv_general_dilated")
def _conv_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    lhs, rhs = ins
    return factor_strategies(op, ins, outs, mesh, conv_factors(lhs, rhs, outs[0], dict(op.params)))


@register_localizer("conv_general_dilated")
def _conv_localizer(op: Op, ins: Sequence[Shape], outs: Sequence[Shape]) -> dict:
    if op.params["feature_group_count"] == 1:
        return {}
    dn = op.params["dimension_numbers"]
    lhs, rhs = ins
    return {"feature_group_count": lhs[dn.lhs_spec[1]] // rhs[dn.rhs_spec[1]]}
