"""Elementwise rules: every output dim is a parallel factor, shared by each input that has it.

Unary math, binary arithmetic, comparisons, logic, bit ops and special
functions all run shard by shard: any split of the output that divides it is
valid, and the inputs follow it (scalar and size-1 broadcast inputs stay
replicated). ``pointwise_rule`` is reused by shape.py for the elementwise ops
that the brief files under shape (select_n, convert_element_type, copy,
stop_gradient) and by reduce.py for reduce_precision.
"""
from __future__ import annotations

from collections.abc import Sequence

from autoshard.ir.graph import Op, Value
from autoshard.meshes.logical import LogicalMesh
from autoshard.passes.strategies.base import Factor, Strategy, elementwise_factors, factor_strategies, register

UNARY = (
    "abs", "neg", "sign", "floor", "ceil", "round", "is_finite", "not", "population_count", "clz",
    "exp", "exp2", "expm1", "log", "log1p", "sqrt", "rsqrt", "cbrt", "square", "integer_pow", "logistic",
    "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh",
    "erf", "erfc", "erf_inv", "lgamma", "digamma", "bessel_i0e", "bessel_i1e",
    "real", "imag", "conj",
)
BINARY = (
    "add", "add_any", "sub", "mul", "div", "rem", "pow", "max", "min", "atan2", "nextafter", "complex",
    "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "xor",
    "shift_left", "shift_right_logical", "shift_right_arithmetic", "mulhi",
    "igamma", "igammac", "igamma_grad_a", "polygamma", "zeta",
)
TERNARY = ("clamp", "regularized_incomplete_beta")


@register(*UNARY, *BINARY, *TERNARY)
def pointwise_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    return factor_strategies(op, ins, outs, mesh, elementwise_factors(ins, outs[0]))


@register("bitcast_convert_type")
def _bitcast_convert_type_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value],
                               mesh: LogicalMesh) -> list[Strategy]:
    # A width change adds (narrowing) or drops (widening) a trailing dim; only the shared leading dims split.
    (x,), (out,) = ins, outs
    shared = min(x.rank, out.rank)
    return factor_strategies(op, ins, outs, mesh, [Factor(out.shape[d], (d,), (d,)) for d in range(shared)])
