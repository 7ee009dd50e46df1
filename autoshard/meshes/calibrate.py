"""From measured timings to a ClusterSpec: alpha-beta fits of collectives, peaks, bandwidths (pure numpy).

``runtime/profile.py`` times the devices present; this module turns the
timings into the numbers the cost model reads (``meshes/cost.py``):

- a collective over an axis of n devices, timed at several sizes, is fitted
  by least squares to ``t = a + b * bytes`` (both kept non-negative) and read
  through the ring formula of its kind: all-gather, reduce-scatter and
  all-to-all take ``(n - 1) alpha + (n - 1) / n * bytes / B``, all-reduce twice
  that, so ``alpha = a / (steps * (n - 1))`` and ``B = steps * (n - 1) / n / b``;
- a link's bandwidth and latency are the medians over the kinds measured on
  the axes that use it (inside a node; across nodes);
- the peak FLOP/s of a dtype is the best matmul rate measured, the memory
  bandwidth the best elementwise rate (bytes read + written per second);
- a link level no collective was measured on (one device; the inter-node
  link of one node) is marked ``unmeasured`` with placeholder numbers, unless
  the caller names the links (a preset's).

Each fit keeps its R^2 and worst relative residual so a user can judge it.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.meshes.cluster import ClusterSpec, LinkLevel

RING_STEPS = {"all-reduce": 2, "all-gather": 1, "reduce-scatter": 1, "all-to-all": 1}


@dataclass(frozen=True)
class LinearFit:
    """``seconds = intercept_s + slope_s_per_byte * bytes`` over the measured points."""

    intercept_s: float
    slope_s_per_byte: float
    r2: float
    worst_rel_residual: float
    points: int

    def __str__(self) -> str:
        return (f"t = {self.intercept_s * 1e6:.3g} us + bytes / {1 / max(self.slope_s_per_byte, 1e-30) / 1e9:.3g} GB/s"
                f"  (R^2 {self.r2:.3f}, worst residual {self.worst_rel_residual:.0%}, {self.points} sizes)")


def fit_line(nbytes: Sequence[float], seconds: Sequence[float]) -> LinearFit:
    """Least-squares ``t = a + b x`` with a, b >= 0 (a negative intercept is refitted through 0)."""
    x, y = np.asarray(nbytes, dtype=float), np.asarray(seconds, dtype=float)
    if len(x) < 2 or np.ptp(x) == 0:
        raise ValueError("a fit needs timings at two or more different sizes")
    b, a = np.polyfit(x, y, 1)
    if a < 0:
        a, b = 0.0, float(x @ y / (x @ x))
    b = max(float(b), 0.0)
    predicted = a + b * x
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - predicted) ** 2).sum()) / total if total > 0 else 1.0
    worst = float(np.max(np.abs(predicted - y) / np.maximum(y, 1e-30)))
    return LinearFit(float(a), b, r2, worst, len(x))


@dataclass(frozen=True)
class CollectiveFit:
    """One collective kind over one mesh axis: the line fitted and the ring parameters it implies."""

    kind: str
    axis: str
    size: int  # devices along the axis
    crosses_nodes: bool
    fit: LinearFit
    latency_s: float  # alpha per ring step
    bandwidth_bytes_per_s: float  # B per device

    def __str__(self) -> str:
        where = "across nodes" if self.crosses_nodes else "inside a node"
        return (f"{self.kind:14} axis {self.axis} ({self.size} devices, {where}): {self.fit}; ring: latency "
                f"{self.latency_s * 1e6:.3g} us per step, {self.bandwidth_bytes_per_s / 1e9:.3g} GB/s per device")


def collective_fit(kind: str, axis: str, size: int, crosses_nodes: bool, nbytes: Sequence[float],
                   seconds: Sequence[float]) -> CollectiveFit:
    """Fit the timings of ``kind`` over an axis of ``size`` devices (module docstring)."""
    if kind not in RING_STEPS:
        raise ValueError(f"unknown collective {kind!r}; one of {sorted(RING_STEPS)}")
    if size < 2:
        raise ValueError(f"axis {axis!r} has {size} device(s): a collective over it moves nothing to time")
    line = fit_line(nbytes, seconds)
    steps = RING_STEPS[kind] * (size - 1)
    bandwidth = steps / size / line.slope_s_per_byte if line.slope_s_per_byte > 0 else math.inf
    return CollectiveFit(kind, axis, size, crosses_nodes, line, line.intercept_s / steps, bandwidth)


def link_from(fits: Sequence[CollectiveFit], name: str) -> LinkLevel:
    """One link level from the collectives measured on it: median bandwidth and latency."""
    finite = [f.bandwidth_bytes_per_s for f in fits if math.isfinite(f.bandwidth_bytes_per_s)]
    if not finite:
        raise ValueError(f"no collective on the {name} link moved bytes at a measurable rate")
    latency = float(np.median([f.latency_s for f in fits]))
    return LinkLevel(name, float(np.median(finite)), latency)


def unmeasured(level: LinkLevel, what: str) -> LinkLevel:
    """``level``'s numbers as the placeholder of a link nobody measured (``LinkLevel.unmeasured``)."""
    return LinkLevel(f"not measured ({what})", level.bandwidth_bytes_per_s, level.latency_s, unmeasured=True)


def cluster_from(name: str, num_nodes: int, devices_per_node: int, fits: Sequence[CollectiveFit],
                 peak_flops_per_s: Mapping[str, float], memory_bandwidth_bytes_per_s: float,
                 memory_per_device_bytes: float, *, devices_per_process: int = 0,
                 links: tuple[LinkLevel, LinkLevel] | None = None,
                 placeholder: ClusterSpec | None = None) -> ClusterSpec:
    """A ClusterSpec from the fits and rates measured.

    ``links`` (intra-node, inter-node), when given, are used as they are (a preset's: ``profile --links``).
    Otherwise each level comes from the collectives measured on it; a level nothing was measured on is
    marked unmeasured: with one node the inter-node link takes the intra-node link's numbers (the cost
    model never uses it then), with one device both take ``placeholder``'s links."""
    if links is not None:
        intra, inter = links
    else:
        inside = [f for f in fits if not f.crosses_nodes]
        across = [f for f in fits if f.crosses_nodes]
        intra = link_from(inside, "measured-intra") if inside else None
        inter = link_from(across, "measured-inter") if across else None
        if intra is None and inter is None:
            if placeholder is None:
                raise ValueError("no collective was measured (the devices present form no axis of two or "
                                 "more): pass links (a preset's) or a placeholder ClusterSpec")
            intra = unmeasured(placeholder.intra_node, f"placeholder: {placeholder.name} {placeholder.intra_node.name}")
            inter = unmeasured(placeholder.inter_node, f"placeholder: {placeholder.name} {placeholder.inter_node.name}")
        intra = intra or inter
        inter = inter or unmeasured(intra, "one node: the intra-node numbers")
    return ClusterSpec(name=name, num_nodes=num_nodes, devices_per_node=devices_per_node, intra_node=intra,
                       inter_node=inter, peak_flops_per_s=dict(peak_flops_per_s),
                       memory_bandwidth_bytes_per_s=memory_bandwidth_bytes_per_s,
                       memory_per_device_bytes=memory_per_device_bytes, devices_per_process=devices_per_process)
