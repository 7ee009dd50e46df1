"""The array side of a deferred reduction (``passes/deferral.py``, ``plans.annotations.Deferral``) at run time.

The reducing op's result carries one leading dim per split contracting dim, each device's own partial sum
(``runtime/spmd.partial_result`` runs it, as the module that makes ``jax.sharding`` objects). The views on
its way to the loop's stacked output move those leading dims along in front (:func:`partial_view`), and after
the loop the stack is summed over them (:func:`summed_stack`): one reduction of the whole stack (an
all-reduce, or a reduce-scatter when its layout is split), where XLA would otherwise reduce in the loop body
once per iteration.
"""
from __future__ import annotations

from typing import Any

from autoshard.errors import PlanMismatchError
from autoshard.ir.graph import Op
from autoshard.plans.annotations import Deferral


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
