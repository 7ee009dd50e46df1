"""Alpha-beta collective costs and roofline compute, as pure functions.

Ring algorithms on a mesh axis of n devices with per-device bandwidth B and
per-hop latency a (the axis's link level decides both):

    all-reduce      2(n-1)/n * bytes / B + 2(n-1) a
    all-gather       (n-1)/n * bytes / B +  (n-1) a     bytes = gathered (output) size
    reduce-scatter   (n-1)/n * bytes / B +  (n-1) a     bytes = input (unscattered) size
    all-to-all       (n-1)/n * bytes / B +  (n-1) a     bytes = the buffer (input = output size)
    point-to-point           bytes / B +        a

The link of an axis (``meshes/logical.py``) is the intra-node one, or for an
axis whose groups span nodes with m members on each node, the inter-node link
at m times the per-device NIC bandwidth (rail-optimized: m NICs in parallel;
at most the intra-node bandwidth). A collective over several axes is the
cheaper of two algorithms: axis by axis (hierarchically: an all-gather gathers
over the slowest axis first, while the buffer is smallest; a reduce-scatter
scatters over the fastest axis first; an all-reduce is a reduce-scatter
followed by an all-gather, both hierarchical) and one flat ring over the whole
group at the group's link (``LogicalMesh.group_link``); an all-to-all is the
cheaper of one exchange per axis and one direct exchange over the whole group
(see all_to_all_s). Compute is a roofline: max(flops / peak, bytes / memory
bandwidth).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from autoshard.ir.spec import Collective
from autoshard.meshes.cluster import ClusterSpec, LinkLevel
from autoshard.meshes.logical import LogicalMesh, MeshAxis


def ring_all_reduce_s(nbytes: float, n: int, link: LinkLevel) -> float:
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bandwidth_bytes_per_s + 2 * (n - 1) * link.latency_s


def ring_all_gather_s(out_bytes: float, n: int, link: LinkLevel) -> float:
    if n <= 1:
        return 0.0
    return (n - 1) / n * out_bytes / link.bandwidth_bytes_per_s + (n - 1) * link.latency_s


def ring_reduce_scatter_s(in_bytes: float, n: int, link: LinkLevel) -> float:
    return ring_all_gather_s(in_bytes, n, link)


def ring_all_to_all_s(nbytes: float, n: int, link: LinkLevel) -> float:
    return ring_all_gather_s(nbytes, n, link)


def point_to_point_s(nbytes: float, link: LinkLevel) -> float:
    if nbytes <= 0:
        return 0.0
    return nbytes / link.bandwidth_bytes_per_s + link.latency_s


def _axes(mesh: LogicalMesh, axes: Sequence[str] | str) -> list[MeshAxis]:
    if isinstance(axes, str):
        axes = (axes,)
    return [mesh.axis(a) for a in axes if mesh.axis(a).size > 1]


def _slowest_first(axes: list[MeshAxis]) -> list[MeshAxis]:
    return sorted(axes, key=lambda a: a.link.bandwidth_bytes_per_s)


def _flat(found: list[MeshAxis], mesh: LogicalMesh) -> tuple[int, LinkLevel]:
    """Size and link of one ring over the whole group of ``found`` axes."""
    n = 1
    for a in found:
        n *= a.size
    return n, mesh.group_link(tuple(a.name for a in found))


def all_gather_s(mesh: LogicalMesh, axes: Sequence[str] | str, out_bytes: float) -> float:
    """Gather a buffer to ``out_bytes`` per device over ``axes``: slowest axis first, or one flat ring."""
    found = _axes(mesh, axes)
    order = _slowest_first(found)
    total = 1
    for a in order:
        total *= a.size
    seconds, chunk = 0.0, out_bytes / total
    for a in order:
        chunk *= a.size
        seconds += ring_all_gather_s(chunk, a.size, a.link)
    if len(found) > 1:
        n, link = _flat(found, mesh)
        seconds = min(seconds, ring_all_gather_s(out_bytes, n, link))
    return seconds


def reduce_scatter_s(mesh: LogicalMesh, axes: Sequence[str] | str, in_bytes: float) -> float:
    """Reduce-scatter ``in_bytes`` per device over ``axes``: fastest axis first (mirror of all-gather),
    or one flat ring."""
    found = _axes(mesh, axes)
    seconds, chunk = 0.0, float(in_bytes)
    for a in reversed(_slowest_first(found)):
        seconds += ring_reduce_scatter_s(chunk, a.size, a.link)
        chunk /= a.size
    if len(found) > 1:
        n, link = _flat(found, mesh)
        seconds = min(seconds, ring_reduce_scatter_s(in_bytes, n, link))
    return seconds


def all_reduce_s(mesh: LogicalMesh, axes: Sequence[str] | str, nbytes: float) -> float:
    """All-reduce ``nbytes`` per device over ``axes``: one ring per axis, or, over several axes, the
    cheaper of the hierarchical reduce-scatter + all-gather and one flat ring over the whole group."""
    found = _axes(mesh, axes)
    if len(found) == 1:
        return ring_all_reduce_s(nbytes, found[0].size, found[0].link)
    n, link = _flat(found, mesh)
    return min(reduce_scatter_s(mesh, axes, nbytes) + all_gather_s(mesh, axes, nbytes),
               ring_all_reduce_s(nbytes, n, link))


def all_to_all_s(mesh: LogicalMesh, axes: Sequence[str] | str, nbytes: float) -> float:
    """All-to-all of ``nbytes`` per device over ``axes``: the cheaper of two algorithms.

    Hierarchical: one full-buffer exchange per axis, (n-1)/n * nbytes / B + (n-1) a each.
    Direct (what XLA emits: one all-to-all over the combined group of N devices): each
    device sends nbytes/N to every peer, over the slowest link on which the two differ;
    with axes slowest first, axis i carries (n_i - 1) / (n_1...n_i) * nbytes in
    (n_i - 1) * n_(i+1)...n_k messages. On one axis both are the ring formula.
    """
    found = _axes(mesh, axes)
    hierarchical = sum(ring_all_to_all_s(nbytes, a.size, a.link) for a in found)
    order = _slowest_first(found)
    direct, before, after = 0.0, 1, 1
    for a in order:
        after *= a.size
    for a in order:
        before *= a.size
        after //= a.size
        direct += ((a.size - 1) / before * nbytes / a.link.bandwidth_bytes_per_s
                   + (a.size - 1) * after * a.link.latency_s)
    return min(hierarchical, direct)


_BY_KIND = {"all-reduce": "all_reduce_s", "all-gather": "all_gather_s", "reduce-scatter": "reduce_scatter_s",
            "all-to-all": "all_to_all_s"}


def collective_s(mesh: LogicalMesh, collective: Collective) -> float:
    """Seconds of one collective (its ``nbytes`` as HLO shows it) under this model; a collective-permute
    is one point-to-point message on the slowest link among its axes."""
    if collective.kind == "collective-permute":
        links = [mesh.axis(a).link for a in collective.axes if mesh.axis(a).size > 1]
        slowest = min(links, key=lambda link: link.bandwidth_bytes_per_s, default=None)
        return 0.0 if slowest is None else point_to_point_s(collective.nbytes, slowest)
    return globals()[_BY_KIND[collective.kind]](mesh, collective.axes, collective.nbytes)


def latency_s(mesh: LogicalMesh, collective: Collective) -> float:
    """The part of ``collective_s`` that does not depend on the bytes: what a combined collective pays
    once for all its members (XLA's all-reduce combiner)."""
    return collective_s(mesh, Collective(collective.kind, collective.axes, 0.0))


def host_load_s(cluster: ClusterSpec, nbytes: float) -> float:
    """Seconds for ``nbytes`` of a step's input to reach one device from its host (0 when the host link is
    unknown: ``ClusterSpec.host_bandwidth_bytes_per_s`` 0)."""
    bandwidth = cluster.host_bandwidth_bytes_per_s
    return float(nbytes) / bandwidth if bandwidth > 0 else 0.0


def send_s(cluster: ClusterSpec, nbytes: float, *, cross_node: bool) -> float:
    """Point-to-point transfer between two devices."""
    return point_to_point_s(nbytes, cluster.inter_node if cross_node else cluster.intra_node)


def roofline_s(cluster: ClusterSpec, flops: ArrayLike, bytes_accessed: ArrayLike, dtype: str = "float32") -> Any:
    """Roofline time of one device doing ``flops`` and moving ``bytes_accessed`` through HBM: the one
    compute model of every pass. Scalars give a float; arrays (one entry per op) give an array."""
    seconds = np.maximum(np.asarray(flops, dtype=float) / cluster.peak_flops(dtype),
                         np.asarray(bytes_accessed, dtype=float) / cluster.memory_bandwidth_bytes_per_s)
    return float(seconds) if seconds.ndim == 0 else seconds
