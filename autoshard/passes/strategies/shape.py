"""Shape rules: broadcast, reshape, transpose, squeeze, slicing, padding, joining and iota.

Only dims a shard computes on its own split: a dim that slice/pad/rev/
concatenate/split/tile touches stays whole, as does iota's counting dim; a
reshape splits a merged or split group only through its major dims, when the
split divides both (then the flat order of the group keeps each shard
contiguous). Broadcast dims split freely: each shard makes its own piece.
select_n, convert_element_type, copy and stop_gradient are elementwise (elementwise.py).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from autoshard.ir.graph import Op, Value
from autoshard.meshes.logical import LogicalMesh
from autoshard.passes.strategies.base import (
    Factor, Shape, Strategy, factor_strategies, register, register_localizer,
)


@register("broadcast_in_dim")
def _broadcast_in_dim_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value],
                           mesh: LogicalMesh) -> list[Strategy]:
    x, out = ins[0], outs[0]
    source = {o: i for i, o in enumerate(op.params["broadcast_dimensions"])}
    factors = []
    for d, size in enumerate(out.shape):
        i = source.get(d)
        kept = i is not None and x.shape[i] == size  # a size-1 operand dim broadcast up stays whole
        factors.append(Factor(size, (i if kept else None,) + (None,) * (len(ins) - 1), (d,)))
    return factor_strategies(op, ins, outs, mesh, factors)


def reshape_groups(in_shape: Shape, out_shape: Shape) -> list[tuple[list[int], list[int]]]:
    """Minimal runs of input and output dims with equal products, size-1 dims left out.

    ``(4, 6) -> (4, 2, 3)`` gives ``[([0], [0]), ([1], [1, 2])]``.
    """
    if 0 in in_shape or 0 in out_shape:
        return []
    ins = [d for d, s in enumerate(in_shape) if s != 1]
    outs = [d for d, s in enumerate(out_shape) if s != 1]
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(ins) and j < len(outs):
        gi, gj = [ins[i]], [outs[j]]
        pi, pj = in_shape[ins[i]], out_shape[outs[j]]
        while pi != pj:
            if pi < pj:
                i += 1
                gi.append(ins[i])
                pi *= in_shape[ins[i]]
            else:
                j += 1
                gj.append(outs[j])
                pj *= out_shape[outs[j]]
        groups.append((gi, gj))
        i, j = i + 1, j + 1
    return groups


@register("reshape")
def _reshape_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    x, out = ins[0], outs[0]
    if op.params.get("dimensions") is not None:
        return []
    # Splitting the major dims of a group by n cuts the group's flat order into n contiguous blocks
    # on both sides, which needs n to divide both major dims: the factor's size is their gcd.
    factors = [
        Factor(math.gcd(x.shape[gi[0]], out.shape[gj[0]]), (gi[0],) + (None,) * (len(ins) - 1), (gj[0],))
        for gi, gj in reshape_groups(x.shape, out.shape)
    ]
    return factor_strategies(op, ins, outs, mesh, factors)


@register("transpose")
def _transpose_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    perm = op.params["permutation"]
    factors = [Factor(size, (perm[d],), (d,)) for d, size in enumerate(outs[0].shape)]
    return factor_strategies(op, ins, outs, mesh, factors)


@register("squeeze")
def _squeeze_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    x = ins[0]
    dropped = {d % x.rank for d in op.params["dimensions"]}
    kept = [d for d in range(x.rank) if d not in dropped]
    return factor_strategies(op, ins, outs, mesh, [Factor(x.shape[d], (d,), (k,)) for k, d in enumerate(kept)])


def _identity_dims(x: Value, whole: Sequence[int], n_in: int = 1, n_out: int = 1) -> list[Factor]:
    """Factors for every dim of ``x`` not in ``whole``, at the same position in each array listed."""
    return [Factor(size, (d,) * n_in, (d,) * n_out) for d, size in enumerate(x.shape) if d not in whole]


@register("slice")
def _slice_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    x = ins[0]
    start, limit = op.params["start_indices"], op.params["limit_indices"]
    strides = op.params["strides"] or (1,) * x.rank
    touched = [d for d in range(x.rank) if (start[d], limit[d], strides[d]) != (0, x.shape[d], 1)]
    return factor_strategies(op, ins, outs, mesh, _identity_dims(x, touched))


@register_localizer("slice")
def _slice_localizer(op: Op, ins: Sequence[Shape], outs: Sequence[Shape]) -> dict:
    # Only untouched (full) dims split, so their limit becomes the local size.
    return {"limit_indices": tuple(min(lim, size) for lim, size in zip(op.params["limit_indices"], ins[0]))}


@register("pad")
def _pad_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    x = ins[0]
    touched = [d for d, cfg in enumerate(op.params["padding_config"]) if tuple(cfg) != (0, 0, 0)]
    factors = [Factor(f.size, (f.in_dims[0], None), f.out_dims) for f in _identity_dims(x, touched)]
    return factor_strategies(op, ins, outs, mesh, factors)


@register("concatenate")
def _concatenate_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    return factor_strategies(op, ins, outs, mesh, _identity_dims(outs[0], [op.params["dimension"]], n_in=len(ins)))


@register("split")
def _split_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    return factor_strategies(op, ins, outs, mesh, _identity_dims(ins[0], [op.params["axis"]], n_out=len(outs)))


@register("rev")
def _rev_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    return factor_strategies(op, ins, outs, mesh, _identity_dims(ins[0], op.params["dimensions"]))


@register("tile")
def _tile_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    reps = op.params["reps"]
    return factor_strategies(op, ins, outs, mesh, _identity_dims(ins[0], [d for d, r in enumerate(reps) if r != 1]))


@register("stack")
def _stack_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    axis = op.params["axis"]
    factors = [Factor(size, (d,) * len(ins), (d if d < axis else d + 1,)) for d, size in enumerate(ins[0].shape)]
    return factor_strategies(op, ins, outs, mesh, factors)


@register("unstack")
def _unstack_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    axis = op.params["axis"]
    factors = [Factor(size, (d if d < axis else d + 1,), (d,) * len(outs)) for d, size in enumerate(outs[0].shape)]
    return factor_strategies(op, ins, outs, mesh, factors)


@register("iota")
def _iota_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    # A shard of the counting dim would count from 0 again: only the broadcast dims split.
    out = outs[0]
    factors = [Factor(size, (None,) * len(ins), (d,)) for d, size in enumerate(out.shape)
               if d != op.params["dimension"]]
    return factor_strategies(op, ins, outs, mesh, factors)


@register_localizer("broadcast_in_dim", "iota")
def _shape_localizer(op: Op, ins: Sequence[Shape], outs: Sequence[Shape]) -> dict:
    return {"shape": outs[0]}


@register_localizer("reshape")
def _reshape_localizer(op: Op, ins: Sequence[Shape], outs: Sequence[Shape]) -> dict:
    return {"new_sizes": outs[0]}
