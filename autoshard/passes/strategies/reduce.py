"""Reduction rules: reduce_*, argmax/argmin, cumulative ops, sort, top_k and windowed reductions.

A reduce over a split dim leaves one partial result per shard, combined by
an all-reduce (or reduce-scatter) with the reduction's own operation: sum,
max, min, prod, and, or, xor. Ops whose local result on a shard of the
reduced dim is not a piece of the global one split only their other dims:
argmax/argmin (an index into the shard), cumsum & co. (no carry from earlier
shards), sort and top_k (rank within the shard), generic ``reduce`` (its
computation is arbitrary). Windowed reductions (pooling) split only dims
whose window is trivial (size 1, stride 1, no padding or dilation).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from autoshard.ir.graph import Op, Value
from autoshard.meshes.logical import LogicalMesh
from autoshard.passes.strategies.base import Factor, Reduction, Strategy, factor_strategies, register

REDUCE_KINDS: dict[str, Reduction] = {
    "reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min", "reduce_prod": "prod",
    "reduce_and": "and", "reduce_or": "or", "reduce_xor": "xor",
}


def reduce_factors(x: Value, reduced: Sequence[int], *, splittable: bool) -> list[Factor]:
    """Kept dims are parallel (output dims in order); reduced dims are reduced factors or, if not
    ``splittable``, never split. Every input and output listed is ``x``-shaped up to the reduction."""
    kept = [d for d in range(x.rank) if d not in reduced]
    return [
        Factor(size, (d,), (kept.index(d),) if d in kept else (None,), replicate_only=d in reduced and not splittable)
        for d, size in enumerate(x.shape)
    ]


@register(*REDUCE_KINDS)
def _reduce_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    factors = reduce_factors(ins[0], op.params["axes"], splittable=True)
    return factor_strategies(op, ins, outs, mesh, factors, reduction=REDUCE_KINDS[op.primitive])


@register("argmax", "argmin")
def _arg_reduce_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    return factor_strategies(op, ins, outs, mesh, reduce_factors(ins[0], op.params["axes"], splittable=False))


@register("reduce")
def _generic_reduce_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    # Inputs: n operands then n scalar init values; outputs: n reduced arrays.
    n = len(outs)
    x, dims = ins[0], op.params["dimensions"]
    kept = [d for d in range(x.rank) if d not in dims]
    factors = [
        Factor(x.shape[d], (d,) * n + (None,) * n, (kept.index(d),) * n) for d in kept
    ]
    return factor_strategies(op, ins, outs, mesh, factors)


def _all_but(x: Value, axis: int, n_in: int, n_out: int) -> list[Factor]:
    """Every dim of ``x`` except ``axis`` passes through all ``n_in`` inputs and ``n_out`` outputs."""
    return [Factor(size, (d,) * n_in, (d,) * n_out) for d, size in enumerate(x.shape) if d != axis]


@register("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
def _cumulative_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    return factor_strategies(op, ins, outs, mesh, _all_but(ins[0], op.params["axis"], 1, 1))


@register("sort")
def _sort_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    return factor_strategies(op, ins, outs, mesh, _all_but(ins[0], op.params["dimension"], len(ins), len(outs)))


@register("top_k")
def _top_k_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    x = ins[0]
    axis = op.params.get("axis", x.rank - 1) % x.rank  # jax 0.10 added ``axis``; older top_k used the last dim
    return factor_strategies(op, ins, outs, mesh, _all_but(x, axis, 1, len(outs)))


@register("approx_top_k")
def _approx_top_k_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    x = ins[0]
    return factor_strategies(op, ins, outs, mesh, _all_but(x, op.params["reduction_dimension"] % x.rank,
                                                          len(ins), len(outs)))


# ---- windowed reductions (pooling and its gradients) -------------------------------------------


def trivial_window_dims(params: Mapping[str, Any], rank: int) -> list[int]:
    """Dims whose window is one element with stride 1 and no padding or dilation: they split freely."""
    ones = (1,) * rank
    window, strides = params["window_dimensions"], params["window_strides"]
    padding = params["padding"]
    base, dilation = params.get("base_dilation", ones), params.get("window_dilation", ones)
    return [d for d in range(rank)
            if window[d] == 1 and strides[d] == 1 and tuple(padding[d]) == (0, 0) and base[d] == 1
            and dilation[d] == 1]


@register("reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window",
          "select_and_scatter_add", "select_and_gather_add", "select_and_scatter")
def _window_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    # Array inputs (operands, sources) share every trivial dim with the outputs; scalar init values have none.
    rank = outs[0].rank
    dims = trivial_window_dims(op.params, rank)
    factors = [Factor(outs[0].shape[d], tuple(d if v.rank == rank else None for v in ins), (d,) * len(outs))
               for d in dims]
    return factor_strategies(op, ins, outs, mesh, factors)
