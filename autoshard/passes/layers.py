"""Layers: cut the loss forward of a split step (``ir/split.py``) into layers.

:func:`cluster_layers` groups the forward's equations into L layers, in
program order. *Free* equations (functions of the batch alone) belong to no
layer: every stage that reads them recomputes them, so only
parameter-dependent activations cross stage boundaries. User
``layer_boundary`` markers decide the cuts when present; otherwise a DP picks
L-1 cut positions minimising the bytes that cross them, subject to every
layer's FLOPs staying within ``(1 + slack)`` of total / L (the slack grows
until a partition exists).
"""
from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from autoshard.errors import PlanningError
from autoshard.ir.graph import Op, Role, Value
from autoshard.ir.split import Forward, VarId
from autoshard.ir.stage_programs import free_closure
from autoshard.meshes.cluster import ClusterSpec
from autoshard.meshes.cost import roofline_s
from autoshard.passes.strategies.base import op_dtype

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------
# Layers


@dataclass(frozen=True)
class Layer:
    index: int
    eqns: tuple[int, ...]  # forward equation indices (non-free), in order
    flops: float  # forward FLOPs at the full batch
    param_leaves: tuple[int, ...]  # loss-argument leaves (differentiated) it reads
    act_bytes: float  # bytes of everything it produces (what a forward keeps for backward, at full batch)
    out_bytes: float  # bytes crossing the cut after it (0 for the last layer)
    structure: str  # hash of its equations and shapes: equal layers are priced once
    # per equation: (flops, bytes read and written, the dtype whose peak it runs at), for rooflines
    op_costs: tuple[tuple[float, float, str], ...] = ()

    def forward_s(self, cluster: ClusterSpec) -> float:
        """Forward seconds at the full batch on one device: the sum of per-op rooflines (every operand
        through HBM: an upper bound used where the traced forward + backward is not available)."""
        return float(sum(roofline_s(cluster, f, b, dtype) for f, b, dtype in self.op_costs))


def crossing_bytes(forward: Forward, order: Sequence[int]) -> np.ndarray:
    """Bytes live across each cut of the non-free equations ``order``: entry p is the cut before order[p]."""
    n = len(order)
    pos = {i: p for p, i in enumerate(order)}
    produced: dict[VarId, int] = {v: pos[i] for i in order for v in forward.eqns[i].outs}
    last: dict[VarId, int] = {}
    for p, i in enumerate(order):
        for a in forward.eqns[i].ins:
            if not isinstance(a, jcore.Literal) and a in produced:
                last[a] = p
    if not isinstance(forward.outvar, jcore.Literal) and forward.outvar in produced:
        last[forward.outvar] = n
    diff = np.zeros(n + 2)
    for v, p in produced.items():
        if v in last and last[v] > p:
            diff[p + 1] += forward.nbytes(v)
            diff[last[v] + 1] -= forward.nbytes(v)
    return np.cumsum(diff)[: n + 1]


def non_float_crossing(forward: Forward, order: Sequence[int]) -> np.ndarray:
    """Per cut of ``order`` (as :func:`crossing_bytes`), whether a value that is not a float (routing indices,
    masks, counters) would cross it: stages exchange activations and their cotangents, which such a value
    has none of, so no layer boundary goes there."""
    n = len(order)
    pos = {i: p for p, i in enumerate(order)}
    produced = {v: pos[i] for i in order for v in forward.eqns[i].outs
                if not jnp.issubdtype(forward.avals[v].dtype, jnp.floating)}
    blocked = np.zeros(n + 1, dtype=np.int64)
    for p, i in enumerate(order):
        for a in forward.eqns[i].ins:
            if not isinstance(a, jcore.Literal) and a in produced and produced[a] < p:
                blocked[produced[a] + 1] += 1  # every cut after its producer, up to this reader
                blocked[p + 1] -= 1
    return np.cumsum(blocked) > 0


def cluster_layers(forward: Forward, num_layers: int | None = None, *, max_layers: int = 16,
                   slack: float = 0.25) -> tuple[Layer, ...]:
    """Group the non-free forward equations into layers (module docstring)."""
    order = [i for i, f in enumerate(forward.free) if not f]
    if not order:
        raise PlanningError("the loss does not depend on the differentiated arguments: nothing to pipeline")
    cross = crossing_bytes(forward, order)
    blocked = non_float_crossing(forward, order)
    flops = np.array([forward.eqns[i].flops for i in order])
    markers = [p + 1 for p, i in enumerate(order) if forward.eqns[i].marker and p + 1 < len(order)]
    dropped = [p for p in markers if blocked[p]]
    if dropped:
        log.warning("%d layer_boundary marker(s) ignored: a value that is not a float (indices, a mask) crosses "
                    "there, and stages exchange only float activations", len(dropped))
        markers = [p for p in markers if not blocked[p]]
    if markers:
        cuts = markers if num_layers is None or num_layers - 1 >= len(markers) else _balanced_subset(
            markers, flops, num_layers)
    else:
        allowed = int(np.count_nonzero(~blocked[1:len(order)]))
        target = min(num_layers or max_layers, len(order), allowed + 1)
        cuts = _auto_cuts(flops, np.where(blocked, math.inf, cross), target, slack)
    bounds = [0, *cuts, len(order)]
    producer = {v: i for i, e in enumerate(forward.eqns) for v in e.outs}
    held = set(order)  # every equation a layer holds; the rest are free
    layers = []
    for index, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        members = tuple(order[a:b])
        free = sorted(free_closure(forward, members, producer, held))
        layers.append(_make_layer(forward, index, members, float(cross[b]) if b < len(order) else 0.0, free))
    log.info("clustered %d forward ops into %d layers (%s)", len(order), len(layers),
             "markers" if markers else "auto")
    return tuple(layers)


def _balanced_subset(candidates: list[int], flops: np.ndarray, num_layers: int) -> list[int]:
    """num_layers - 1 of the candidate cuts whose largest layer has the fewest FLOPs."""
    prefix = np.concatenate([[0.0], np.cumsum(flops)])
    cand = [0, *candidates, len(flops)]
    m, need = len(cand), num_layers
    best = np.full((need + 1, m), math.inf)
    arg = np.zeros((need + 1, m), dtype=int)
    best[0, 0] = 0.0
    for layers in range(1, need + 1):
        for j in range(1, m):
            costs = [max(best[layers - 1, q], prefix[cand[j]] - prefix[cand[q]]) for q in range(j)]
            q = int(np.argmin(costs))
            best[layers, j], arg[layers, j] = costs[q], q
    cuts, j = [], m - 1
    for layers in range(need, 0, -1):
        j = int(arg[layers, j])
        cuts.append(cand[j])
    return sorted(c for c in cuts if 0 < c < len(flops))


def _auto_cuts(flops: np.ndarray, cross: np.ndarray, num_layers: int, slack: float) -> list[int]:
    """L-1 cuts minimising the crossing bytes with every layer's FLOPs <= (1 + slack) * total / L."""
    n = len(flops)
    if num_layers <= 1:
        return []
    prefix = np.concatenate([[0.0], np.cumsum(flops)])
    total = prefix[-1]
    while True:
        cap = (1 + slack) * total / num_layers + 1e-9 * max(total, 1.0)
        # f[l, p]: least crossing bytes splitting the first p ops into l layers (cut at p counted when p < n)
        f = np.full((num_layers + 1, n + 1), math.inf)
        arg = np.zeros((num_layers + 1, n + 1), dtype=int)
        f[0, 0] = 0.0
        start = np.searchsorted(prefix, prefix - cap, side="left")  # smallest q with prefix[p] - prefix[q] <= cap
        for layers in range(1, num_layers + 1):
            prev = f[layers - 1]
            for p in range(layers, n + 1):
                lo, hi = max(int(start[p]), layers - 1), p
                if lo >= hi:
                    continue
                window = prev[lo:hi]
                q = lo + int(np.argmin(window))
                f[layers, p] = window[q - lo] + (cross[p] if p < n else 0.0)
                arg[layers, p] = q
        if math.isfinite(f[num_layers, n]):
            break
        slack = slack * 2 + 0.25
    cuts, p = [], n
    for layers in range(num_layers, 0, -1):
        p = int(arg[layers, p])
        cuts.append(p)
    return sorted(c for c in cuts if 0 < c < n)


def _make_layer(forward: Forward, index: int, members: tuple[int, ...], out_bytes: float,
                free: Sequence[int]) -> Layer:
    """The layer of ``members``; ``free``: the free equations its program recomputes, in program order."""
    params = set()
    diff_pos = {v: k for k, (v, d) in enumerate(zip(forward.invars, forward.diff)) if d}
    act = 0.0
    digest = hashlib.sha1()
    local: dict[VarId, int] = {}
    for i in members:
        e = forward.eqns[i]
        for a in e.ins:
            if not isinstance(a, jcore.Literal) and a in diff_pos:
                params.add(diff_pos[a])
        act += sum(forward.nbytes(v) for v in e.outs)
        ins = [f"L{a.val}" if isinstance(a, jcore.Literal) else
               f"v{local[a]}" if a in local else str(forward.avals[a].str_short()) for a in e.ins]
        for v in e.outs:
            local[v] = len(local)
        params_str = {k: v for k, v in e.eqn.params.items() if not isinstance(v, (jcore.ClosedJaxpr, jcore.Jaxpr))}
        digest.update(f"{e.eqn.primitive.name}{ins}{params_str}".encode())
    # the free equations its program recomputes, by structure (not their literals, which the runtime's train graphs
    # tell apart, ``ir/train_graph.program_constants``): nnx's dropout stream counts its draws, so block k derives
    # its key through one more ``add`` than block k-1, and a class over both priced and pinned block k with block
    # k-1's train graph, which its own did not fit at run time (the stage then ran ``jax.vjp``, unplanned)
    free_local: dict[VarId, int] = {}
    for i in free:
        e = forward.eqns[i]
        ins = ["L" if isinstance(a, jcore.Literal) else f"f{free_local[a]}" if a in free_local else
               str(forward.avals[a].str_short()) for a in e.ins]
        for v in e.outs:
            free_local[v] = len(free_local)
        digest.update(f"free:{e.eqn.primitive.name}{ins}".encode())
    return Layer(index, members, float(sum(forward.eqns[i].flops for i in members)), tuple(sorted(params)),
                 act, out_bytes, digest.hexdigest()[:16],
                 tuple((forward.eqns[i].flops, forward.eqns[i].nbytes, _peak_dtype(forward, i)) for i in members))


def _peak_dtype(forward: Forward, i: int) -> str:
    """``strategies.base.op_dtype`` of a forward equation."""
    e = forward.eqns[i]
    ins = [Value(-1, tuple(getattr(a, "aval", a).shape), str(getattr(a, "aval", a).dtype), Role.ACTIVATION)
           for a in e.eqn.invars[:1]]
    outs = [Value(-1, tuple(forward.avals[v].shape), str(forward.avals[v].dtype), Role.ACTIVATION) for v in e.outs[:1]]
    op = Op(-1, e.eqn.primitive.name, dict(e.eqn.params), (), (), e.flops, e.nbytes)
    return op_dtype(op, ins, outs)


