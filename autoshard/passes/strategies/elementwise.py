"""Elementwise rules: every output dim is a parallel factor, shared by each input that has it.

Unary math, binary arithmetic, comparisons, logic, bit ops, special functions, n-ary ones (clamp,
polynomial), selects, casts and copies all run shard by shard: any split of the output that divides it is
valid, and the inputs follow it (scalar and size-1 broadcast inputs stay replicated). ``pointwise_rule``
is registered for the elementwise family of the primitive table (``ir/primitives.py``): a primitive is
made elementwise there, once.
"""
from __future__ import annotations

from collections.abc import Sequence

from autoshard.ir.graph import Op, Value
from autoshard.ir.primitives import ELEMENTWISE
from autoshard.meshes.logical import LogicalMesh
from autoshard.passes.strategies.base import Factor, Strategy, elementwise_factors, factor_strategies, register

# every elementwise primitive of the table but bitcast_convert_type, whose rule is its own (below)
POINTWISE = tuple(sorted(ELEMENTWISE - {"bitcast_convert_type"}))


@register(*POINTWISE)
def pointwise_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    return factor_strategies(op, ins, outs, mesh, elementwise_factors(ins, outs[0]))


@register("bitcast_convert_type")
def _bitcast_convert_type_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value],
                               mesh: LogicalMesh) -> list[Strategy]:
    # A width change adds (narrowing) or drops (widening) a trailing dim; only the shared leading dims split.
    (x,), (out,) = ins, outs
    shared = min(x.rank, out.rank)
    return factor_strategies(op, ins, outs, mesh, [Factor(out.shape[d], (d,), (d,)) for d in range(shared)])
