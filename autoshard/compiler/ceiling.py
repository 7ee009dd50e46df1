"""Batch-size ceilings: the largest global batch whose plan fits the per-device memory budget.

For a fixed plan (every value's spec fixed) each array's per-device bytes are
affine in the global batch: arrays with a batch dimension grow with it, state
does not. So each program point's live bytes are nearly ``a_t + s_t * batch``
(nearly: the memory simulation follows XLA's schedule and fusion, which can
shift with the sizes). ``batch_ceiling``:

1. traces the step at the batch B it was planned for and at 2B, applies the
   plan's specs to both graphs (same structure, same value ids), and solves
   ``max_t a_t + s_t b = budget`` for b (``MemoryModel.ceiling``);
2. evaluates the plan at that estimate (the graph at another batch is the
   traced one with rescaled shapes: ``BatchProbe``) and refines it: secant steps upward while
   the evaluated batches fit, then regula falsi inside the bracket (bisection
   after a step that overshoots), until the bracket is within ``rel_tol`` or
   ``max_steps`` evaluations are spent;
3. returns the largest evaluated batch that fits, a multiple of the batch's
   shard count: it fits by construction, and is the largest that fits to
   within the final bracket (2% unless ``max_steps`` ran out).

The batch dimension of every batch input is taken to be dim 0. A step that
cannot be traced at another batch size has no ceiling (None).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax
import numpy as np

from autoshard.ir.graph import OpGraph, Role, ValueId, same_structure
from autoshard.ir.trace import trace
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


class BatchProbe:
    """The step's graph at other global batch sizes (cached); None where it cannot be had or its structure changes.

    The step is traced at B and 2B; when every array dimension is either the
    same in both or proportional to the batch (``k * batch``), the graph at any
    other batch is those two with its shapes rescaled, no trace needed (memory
    simulation reads shapes, not the ops' shape parameters). Otherwise each
    batch size is traced.
    """

    def __init__(self, fn: Callable[..., Any], args: Sequence[Any], graph: OpGraph) -> None:
        self.fn, self.args, self.base = fn, tuple(args), graph
        self.batch = batch_size_of(graph)
        self._graphs: dict[int, OpGraph | None] = {self.batch: graph} if self.batch else {}
        self._per_example: dict[ValueId, tuple[int | None, ...]] | None = None  # per dim: k of k*batch, or None

    def _trace(self, batch: int) -> OpGraph | None:
        try:
            traced = trace(self.fn, *args_at_batch(self.base, self.args, batch))
        except Exception as err:  # a step that only runs at some batch sizes has no ceiling there
            log.warning("could not trace the step at global batch %d: %s", batch, err)
            return None
        return traced if same_structure(self.base, traced) else None

    def _learn_scaling(self, doubled: OpGraph) -> None:
        b = self.batch
        per_example: dict[ValueId, tuple[int | None, ...]] = {}
        for vid, value in self.base.values.items():
            other = doubled.values[vid].shape
            if len(other) != len(value.shape):
                return
            dims: list[int | None] = []
            for d1, d2 in zip(value.shape, other):
                if d1 == d2:
                    dims.append(None)
                elif d2 == 2 * d1 and d1 % b == 0:
                    dims.append(d1 // b)
                else:
                    return
            per_example[vid] = tuple(dims)
        self._per_example = per_example

    def _rescaled(self, batch: int) -> OpGraph:
        assert self._per_example is not None
        values = {vid: replace(value, shape=tuple(d if k is None else k * batch
                                                  for d, k in zip(value.shape, self._per_example[vid])))
                  if any(k is not None for k in self._per_example[vid]) else value
                  for vid, value in self.base.values.items()}
        return replace(self.base, values=values)

    def batch_dims(self) -> dict[ValueId, tuple[int, ...]] | None:
        """Per value, the dimensions that grow with the global batch (None if that cannot be learned)."""
        if self.batch is not None:
            self.graph(2 * self.batch)
        if self._per_example is None:
            return None
        return {vid: tuple(d for d, k in enumerate(ks) if k is not None) for vid, ks in self._per_example.items()}

    def graph(self, batch: int) -> OpGraph | None:
        if self.batch is None:
            return None
        if batch not in self._graphs:
            doubled = 2 * self.batch
            if doubled not in self._graphs:
                self._graphs[doubled] = self._trace(doubled)
                if self._graphs[doubled] is not None:
                    self._learn_scaling(self._graphs[doubled])
            if batch not in self._graphs:
                self._graphs[batch] = self._rescaled(batch) if self._per_example is not None else self._trace(batch)
        return self._graphs[batch]


def _profile(result: IntraOpResult, graph: OpGraph) -> np.ndarray:
    sizes = dict(zip(result.mesh.axis_names, result.mesh.shape))
    profile, _ = memory_profile(graph, result.value_specs, sizes, result.reshards,
                                op_strategies=result.node_strategies[len(graph.inputs):],
                                f32_compute_dtypes=result.mesh.cluster.f32_compute_dtypes)
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


def batch_ceiling(result: IntraOpResult, probe: BatchProbe, budget_bytes: float, *, max_steps: int = 12,
                  rel_tol: float = 0.02) -> int | None:
    """The largest global batch (a multiple of the batch's shard count) whose peak fits; see the module docstring.

    None when memory does not grow with the batch or the step cannot be traced at another batch size.
    """
    b1 = probe.batch
    g2 = probe.graph(2 * b1) if b1 else None
    model = memory_model(result, g2) if g2 is not None else None
    if model is None:
        return None
    m = model.batch_multiple
    guess = model.ceiling(budget_bytes)
    if guess is None:
        return None
    known = {b1: float(result.memory_profile.max()), 2 * b1: float(_profile(result, g2).max())}
    last_over = False
    for _ in range(max_steps):
        if guess < m or guess in known:
            break
        graph = probe.graph(guess)
        if graph is None:
            break
        known[guess] = float(_profile(result, graph).max())
        fits = [b for b, p in known.items() if p <= budget_bytes]
        over = [b for b, p in known.items() if p > budget_bytes]
        lo, hi = max(fits, default=None), min(over, default=None)
        if lo is None:  # even the planned batch does not fit
            break
        if hi is not None and hi - lo <= max(m, rel_tol * lo):
            break
        if hi is None:  # extrapolate up through the two largest fitting batches
            (x0, p0), (x1, p1) = sorted((b, known[b]) for b in fits)[-2:]
        else:  # regula falsi inside the bracket; bisect after a guess that overshot (a concave stretch)
            (x0, p0), (x1, p1) = (lo, known[lo]), (hi, known[hi])
        if p1 <= p0:
            break
        point = x0 + (budget_bytes - p0) * (x1 - x0) / (p1 - p0)
        if hi is not None and last_over:
            point = (lo + hi) / 2
        last_over = guess == hi
        point = max(point, lo + m) if hi is None else min(max(point, lo + m), hi - m)
        guess = int(point // m) * m
    fitting = [b for b, p in known.items() if p <= budget_bytes and b % m == 0]
    return max(fitting, default=0)
