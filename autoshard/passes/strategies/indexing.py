"""Indexing rules: gather, the scatter family, dynamic_slice and dynamic_update_slice.

gather (an embedding lookup ``table[ids]``): the batch dims of the indices
split (each shard looks up its own ids in the whole table), and so do the
table's dims that every lookup takes whole and no index addresses (the
embedding feature dim), along with explicit operand/indices batching dims.
A dim the indices address (the vocabulary) never splits: its local lookup
would need a masked lookup plus an all-reduce, which is not a plain local
gather, so that strategy is not offered.

scatter-add / scatter-sub (the embedding gradient ``zeros.at[ids].add(g)``):
the same operand dims split, and the batch dims of indices and updates may
split too, as a *reduced* factor: each shard scatters its own updates and
the partial results are summed (all-reduce or reduce-scatter). Such a
strategy counts the operand once: only the first shard of the reduced axes
starts from it, the others from zeros (``PARTIAL_SCATTER_NOTE``). Plain
scatter and scatter-mul/min/max never split their updates' batch dims.

dynamic_slice / dynamic_update_slice split only the dims they take whole.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autoshard.ir.graph import Op, Value
from autoshard.meshes.logical import LogicalMesh
from autoshard.passes.strategies.base import (
    Factor, Shape, Strategy, factor_strategies, register, register_localizer,
)

PARTIAL_SCATTER_NOTE = "operand counted on the first shard of the reduced axes only"
SUMMING_SCATTERS = ("scatter-add", "scatter-sub")


def _window_dims(rank: int, *excluded: Sequence[int]) -> list[int]:
    return [d for d in range(rank) if not any(d in dims for dims in excluded)]


def gather_factors(operand: Value, indices: Value, out: Value, dnums: Any, slice_sizes: Shape) -> list[Factor]:
    """Indices' batch dims (the index vector is their last dim) and untouched whole-slice operand dims."""
    batch_out = [d for d in range(out.rank) if d not in dnums.offset_dims]
    factors = []
    for i, o in zip(range(indices.rank - 1), batch_out):
        op_dim = None
        if i in dnums.start_indices_batching_dims:
            op_dim = dnums.operand_batching_dims[dnums.start_indices_batching_dims.index(i)]
        factors.append(Factor(indices.shape[i], (op_dim, i), (o,)))
    window = _window_dims(operand.rank, dnums.collapsed_slice_dims, dnums.operand_batching_dims)
    for d, o in zip(window, dnums.offset_dims):
        if slice_sizes[d] == operand.shape[d] and d not in dnums.start_index_map:
            factors.append(Factor(operand.shape[d], (d, None), (o,)))
    return factors


@register("gather")
def _gather_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    operand, indices = ins
    factors = gather_factors(operand, indices, outs[0], op.params["dimension_numbers"], op.params["slice_sizes"])
    return factor_strategies(op, ins, outs, mesh, factors)


@register_localizer("gather")
def _gather_localizer(op: Op, ins: Sequence[Shape], outs: Sequence[Shape]) -> dict:
    dnums = op.params["dimension_numbers"]
    sizes = list(op.params["slice_sizes"])
    for d, o in zip(_window_dims(len(ins[0]), dnums.collapsed_slice_dims, dnums.operand_batching_dims),
                    dnums.offset_dims):
        sizes[d] = outs[0][o]
    return {"slice_sizes": tuple(sizes)}


def scatter_factors(operand: Value, indices: Value, updates: Value, dnums: Any, *,
                    summing: bool) -> list[Factor]:
    """Inputs are (operand, indices, updates). Batching dims and untouched window dims are parallel;
    the other batch dims of indices/updates are reduced when the scatter sums (else never split)."""
    update_batch = [d for d in range(updates.rank) if d not in dnums.update_window_dims]
    factors = []
    for i, u in zip(range(indices.rank - 1), update_batch):
        if i in dnums.scatter_indices_batching_dims:
            op_dim = dnums.operand_batching_dims[dnums.scatter_indices_batching_dims.index(i)]
            factors.append(Factor(indices.shape[i], (op_dim, i, u), (op_dim,)))
        elif summing:
            factors.append(Factor(indices.shape[i], (None, i, u), (None,)))
    window = _window_dims(operand.rank, dnums.inserted_window_dims, dnums.operand_batching_dims)
    for d, u in zip(window, dnums.update_window_dims):
        if updates.shape[u] == operand.shape[d] and d not in dnums.scatter_dims_to_operand_dims:
            factors.append(Factor(operand.shape[d], (d, None, u), (d,)))
    return factors


@register("scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min", "scatter-max")
def _scatter_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    operand, indices, updates = ins
    summing = op.primitive in SUMMING_SCATTERS
    factors = scatter_factors(operand, indices, updates, op.params["dimension_numbers"], summing=summing)
    return factor_strategies(op, ins, outs, mesh, factors, reduction="sum" if summing else None,
                             note=PARTIAL_SCATTER_NOTE)


@register("dynamic_slice")
def _dynamic_slice_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    operand, sizes = ins[0], op.params["slice_sizes"]
    n_starts = len(ins) - 1
    factors = [Factor(size, (d,) + (None,) * n_starts, (d,)) for d, size in enumerate(operand.shape)
               if sizes[d] == size]
    return factor_strategies(op, ins, outs, mesh, factors)


@register_localizer("dynamic_slice")
def _dynamic_slice_localizer(op: Op, ins: Sequence[Shape], outs: Sequence[Shape]) -> dict:
    return {"slice_sizes": outs[0]}


@register("dynamic_update_slice")
def _dynamic_update_slice_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value],
                               mesh: LogicalMesh) -> list[Strategy]:
    operand, update = ins[:2]
    n_starts = len(ins) - 2
    factors = [Factor(size, (d, d) + (None,) * n_starts, (d,)) for d, size in enumerate(operand.shape)
               if update.shape[d] == size]
    return factor_strategies(op, ins, outs, mesh, factors)
