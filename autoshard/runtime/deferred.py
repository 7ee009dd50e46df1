"""The partial form of a deferred reduction (``passes/deferral.py``, ``plans.annotations.Deferral``) at run time.

The reducing op runs on each device's own shards (``shard_map``), and its result gains one leading dim per
split contracting dim, split over that dim's mesh axes: each device's own partial sum, with no collective.
The views on its way to the loop's stacked output move those leading dims along in front, and after the loop
the stack is summed over them: one reduction of the whole stack (an all-reduce, or a reduce-scatter when its
layout is split), where XLA would otherwise reduce in the loop body once per iteration.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec

from autoshard.errors import PlanMismatchError
from autoshard.ir.graph import Op
from autoshard.ir.spec import Spec
from autoshard.plans.annotations import Deferral


def partial_result(op: Op, vals: Sequence[Any], deferral: Deferral, out_spec: Spec, mesh: Mesh) -> Any:
    """Op ``op`` (``dot_general`` or ``reduce_sum``) on ``vals`` without the reduction over the split
    contracting dims: its result (whose sum has layout ``out_spec``) with one leading dim per entry of
    ``deferral.reduced``, each device's own partial sum. Each device runs the op on its own shards
    (``shard_map`` over the whole mesh: the operands arrive in ``deferral.operands``, as the plan pinned
    them), so XLA moves nothing and copies no operand into another shape."""
    k = len(deferral.reduced)

    def local(*shards: Any) -> Any:
        out = op.prim.bind(*shards, **op.params)
        return out.reshape((1,) * k + tuple(out.shape))

    def entries(spec: Spec) -> PartitionSpec:
        return PartitionSpec(*spec.partition_entries())

    return jax.shard_map(local, mesh=mesh, in_specs=tuple(entries(s) for s in deferral.operands),
                         out_specs=entries(deferral.partial(out_spec)), check_vma=False)(*vals)


def partial_view(op: Op, value: Any, k: int) -> Any:
    """A view (``transpose``, ``reshape``, ``squeeze``) of a partial result with ``k`` leading partial dims,
    which stay in front."""
    if op.primitive == "transpose":
        perm = tuple(range(k)) + tuple(p + k for p in op.params["permutation"])
        return op.prim.bind(value, **{**op.params, "permutation": perm})
    if op.primitive == "squeeze":
        return op.prim.bind(value, **{**op.params, "dimensions": tuple(d + k for d in op.params["dimensions"])})
    if op.primitive == "reshape":
        sizes = tuple(value.shape[:k]) + tuple(op.params["new_sizes"])
        return op.prim.bind(value, **{**op.params, "new_sizes": sizes})
    raise PlanMismatchError(f"op {op.id} ({op.primitive}) carries partial sums in the plan; only views may")


def summed_stack(stacked: Any, deferral: Deferral) -> Any:
    """The stacked partial sums (loop axis first, then the partial dims) summed: the one reduction."""
    return stacked.sum(axis=tuple(range(1, 1 + len(deferral.reduced))))
