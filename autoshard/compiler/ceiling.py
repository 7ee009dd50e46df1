"""Batch-size ceilings: the largest global batch whose plan fits the per-device memory budget.

For a fixed plan (every value's spec fixed) each array's per-device bytes are
affine in the global batch: arrays with a batch dimension grow with it, state
does not. So each program point's live bytes are nearly ``a_t + s_t * batch``
(nearly: the memory simulation follows XLA's schedule and fusion, which can
shift with the sizes). ``batch_ceiling``:

1. traces the step at the batch B it was planned for and at 2B, applies the
   plan's specs to both graphs (same structure, same value ids), and solves
   ``max_t a_t + s_t b = budget`` for b (``MemoryModel.ceiling``);
2. traces the step at that estimate and takes a secant step through the two
   evaluated batches nearest the budget crossing, up to ``max_traces`` traces;
3. returns the largest evaluated batch that fits, a multiple of the batch's
   shard count. It fits by construction; it is the largest that fits up to the
   last secant step's error (within a few percent on the examples).

The batch dimension of every batch input is taken to be dim 0. A step that
cannot be traced at another batch size has no ceiling (None).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from autoshard.compiler.graph import OpGraph, Role
from autoshard.compiler.trace import trace
from autoshard.passes.intra_op import IntraOpResult, memory_profile

log = logging.getLogger(__name__)


def args_at_batch(graph: OpGraph, args: Sequence[Any], batch: int) -> tuple[Any, ...]:
    """``args`` as ShapeDtypeStructs with every batch input's dim 0 set to ``batch``."""
    leaves = jax.tree_util.tree_leaves(tuple(args))
    out = []
    for vid, leaf in zip(graph.inputs, leaves):
        value = graph.values[vid]
        shape = tuple(value.shape)
        if value.role == Role.BATCH and shape:
            shape = (batch,) + shape[1:]
        out.append(jax.ShapeDtypeStruct(shape, getattr(leaf, "dtype", value.dtype)))
    return tuple(jax.tree_util.tree_unflatten(graph.in_tree, out))


def batch_size_of(graph: OpGraph) -> int | None:
    sizes = {graph.values[v].shape[0] for v in graph.inputs
             if graph.values[v].role == Role.BATCH and graph.values[v].shape}
    return min(sizes) if sizes else None


def same_structure(a: OpGraph, b: OpGraph) -> bool:
    return len(a.ops) == len(b.ops) and all(x.primitive == y.primitive and x.inputs == y.inputs
                                            and x.outputs == y.outputs for x, y in zip(a.ops, b.ops))


class BatchProbe:
    """The step traced at other global batch sizes (cached); None where it cannot be or its structure changes."""

    def __init__(self, fn: Callable[..., Any], args: Sequence[Any], graph: OpGraph) -> None:
        self.fn, self.args, self.base = fn, tuple(args), graph
        self.batch = batch_size_of(graph)
        self._graphs: dict[int, OpGraph | None] = {self.batch: graph} if self.batch else {}

    def graph(self, batch: int) -> OpGraph | None:
        if self.batch is None:
            return None
        if batch not in self._graphs:
            try:
                traced = trace(self.fn, *args_at_batch(self.base, self.args, batch))
            except Exception as err:  # a step that only runs at some batch sizes has no ceiling there
                log.warning("could not trace the step at global batch %d: %s", batch, err)
                traced = None
            self._graphs[batch] = traced if traced is not None and same_structure(self.base, traced) else None
        return self._graphs[batch]


def _profile(result: IntraOpResult, graph: OpGraph) -> np.ndarray:
    sizes = dict(zip(result.mesh.axis_names, result.mesh.shape))
    profile, _ = memory_profile(graph, result.value_specs, sizes, result.reshards,
                                op_strategies=result.node_strategies[len(graph.inputs):])
    return profile


def batch_multiple(result: IntraOpResult) -> int:
    """The batch's shard count under the plan: a global batch must be a multiple of it."""
    graph = result.graph
    sizes = dict(zip(result.mesh.axis_names, result.mesh.shape))
    multiple = 1
    for vid, spec in zip(graph.inputs, result.input_specs):
        if graph.values[vid].role == Role.BATCH and spec.dims:
            multiple = max(multiple, math.prod(sizes[a] for a in spec.dims[0]))
    return multiple


@dataclass(frozen=True)
class MemoryModel:
    """Per-device live bytes at each program point as ``intercept + slope * global batch``."""

    intercept: np.ndarray
    slope: np.ndarray
    batch_multiple: int  # the global batch must be a multiple of this (the batch's shard count)

    def peak_bytes(self, batch: int) -> float:
        return float((self.intercept + self.slope * batch).max())

    def ceiling(self, budget_bytes: float) -> int | None:
        """Largest global batch whose peak fits ``budget_bytes``; None if memory does not grow with it."""
        growing = self.slope > 1e-9
        if not growing.any():
            return None
        largest = float(((budget_bytes - self.intercept[growing]) / self.slope[growing]).min())
        if largest < self.batch_multiple:
            return 0
        return int(largest // self.batch_multiple) * self.batch_multiple


def memory_model(result: IntraOpResult, scaled: OpGraph) -> MemoryModel | None:
    """The affine memory model of ``result``'s plan from its graph and the same step at another batch."""
    graph = result.graph
    b1, b2 = batch_size_of(graph), batch_size_of(scaled)
    if b1 is None or b2 is None or b1 == b2 or not same_structure(graph, scaled):
        return None
    p1, p2 = result.memory_profile, _profile(result, scaled)
    if len(p1) != len(p2):
        return None
    slope = (p2 - p1) / (b2 - b1)
    return MemoryModel(p1 - slope * b1, slope, batch_multiple(result))


def batch_ceiling(result: IntraOpResult, probe: BatchProbe, budget_bytes: float, *, max_traces: int = 2) -> int | None:
    """The largest global batch (a multiple of the batch's shard count) whose peak fits; see the module docstring.

    None when memory does not grow with the batch or the step cannot be traced at another batch size.
    """
    b1 = probe.batch
    g2 = probe.graph(2 * b1) if b1 else None
    model = memory_model(result, g2) if g2 is not None else None
    if model is None:
        return None
    m = model.batch_multiple
    estimate = model.ceiling(budget_bytes)
    if estimate is None:
        return None
    known = {b1: float(result.memory_profile.max()), 2 * b1: float(_profile(result, g2).max())}
    for _ in range(max_traces):
        if estimate < m or estimate in known:
            break
        graph = probe.graph(estimate)
        if graph is None:
            break
        known[estimate] = float(_profile(result, graph).max())
        fits = [b for b, p in known.items() if p <= budget_bytes]
        over = [b for b, p in known.items() if p > budget_bytes]
        lo, hi = max(fits, default=None), min(over, default=None)
        if lo is not None and hi is not None and hi - lo <= m:
            break
        # secant through the two evaluated batches nearest the crossing (interpolating when it is bracketed)
        near = sorted(known, key=lambda b: abs(known[b] - budget_bytes))[:2]
        (x0, p0), (x1, p1) = sorted((b, known[b]) for b in near)
        if p1 <= p0:
            break
        guess = x0 + (budget_bytes - p0) * (x1 - x0) / (p1 - p0)
        if lo is not None:
            guess = max(guess, lo + m)
        if hi is not None:
            guess = min(guess, hi - m)
        estimate = int(guess // m) * m
    fitting = [b for b, p in known.items() if p <= budget_bytes and b % m == 0]
    return max(fitting, default=0)
