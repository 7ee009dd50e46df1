"""Logical meshes over a cluster: named axes, each mapped to the link its collectives run at.

Devices are laid out row-major over the mesh axes (the last axis varies
fastest), the way ``jax.make_mesh`` and ``mesh_utils`` order a single-slice
device list. An axis whose device groups stay inside one node uses the
intra-node link. A group that spans nodes with m members on each node drives
m NICs at once (rail-optimized clusters: one NIC per device; NCCL splits a
ring over m channels, one per rail), so its node-crossing bandwidth is m times
the per-device inter-node bandwidth, capped by the intra-node link the ring
also crosses: ``group_link`` gives that link for any set of axes, and each
axis's ``link`` is its own group's. A group with one member per node gets one
NIC. ``meshes/cost.py`` prices a collective over several axes as the cheaper
of that one flat ring and the hierarchical algorithm, axis by axis.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.meshes.cluster import ClusterSpec, LinkLevel

DEFAULT_AXIS_NAMES = ("x", "y", "z", "w")


@dataclass(frozen=True)
class MeshAxis:
    name: str
    size: int
    link: LinkLevel
    crosses_nodes: bool = False  # its device groups span nodes (the link is the inter-node one)

    def __str__(self) -> str:
        return f"{self.name}={self.size}({self.link.name})"


@dataclass(frozen=True)
class LogicalMesh:
    axes: tuple[MeshAxis, ...]
    cluster: ClusterSpec
    device_indices: tuple[int, ...]  # cluster device indices covered, row-major over the axes

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(a.size for a in self.axes)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.axes)

    @property
    def num_devices(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def axis(self, name: str) -> MeshAxis:
        for a in self.axes:
            if a.name == name:
                return a
        raise KeyError(f"mesh has no axis {name!r}; axes are {self.axis_names}")

    def size_of(self, axes: tuple[str, ...] | str) -> int:
        if isinstance(axes, str):
            axes = (axes,)
        return int(np.prod([self.axis(a).size for a in axes], dtype=np.int64))

    def group_link(self, axes: tuple[str, ...] | str) -> LinkLevel:
        """The link one flat ring over the device groups of ``axes`` runs at (module docstring)."""
        return _cached_group_link(self, (axes,) if isinstance(axes, str) else tuple(axes))

    def __str__(self) -> str:
        return "(" + ", ".join(map(str, self.axes)) + f") on {self.cluster.name}"


@functools.lru_cache(maxsize=4096)
def _cached_group_link(mesh: LogicalMesh, axes: tuple[str, ...]) -> LinkLevel:
    grid = np.asarray(mesh.device_indices).reshape(mesh.shape)
    return group_link(mesh.cluster, grid, [mesh.axis_names.index(a) for a in axes])


def axis_groups(grid: np.ndarray, dims: Sequence[int]) -> np.ndarray:
    """[groups, members]: the devices of ``grid`` that differ only along ``dims``."""
    rest = [d for d in range(grid.ndim) if d not in dims]
    moved = np.transpose(grid, rest + list(dims))
    return moved.reshape(-1, int(np.prod([grid.shape[d] for d in dims], dtype=np.int64)))


def group_link(cluster: ClusterSpec, grid: np.ndarray, dims: list[int]) -> LinkLevel:
    """The intra-node link, or, for groups that span nodes with m members per node, the inter-node
    link at m times its per-device bandwidth (at most the intra-node bandwidth)."""
    groups = axis_groups(grid, dims) // cluster.devices_per_node
    if not (groups != groups[:, :1]).any():
        return cluster.intra_node
    members = max(int(np.unique(row, return_counts=True)[1].max()) for row in groups)
    inter, intra = cluster.inter_node, cluster.intra_node
    if members <= 1:
        return inter
    bandwidth = min(intra.bandwidth_bytes_per_s, members * inter.bandwidth_bytes_per_s)
    return LinkLevel(f"{inter.name}x{members}", bandwidth, inter.latency_s,
                     unmeasured=inter.unmeasured or intra.unmeasured)


def _crosses_nodes(cluster: ClusterSpec, grid: np.ndarray, axis: int) -> bool:
    nodes = axis_groups(grid, [axis]) // cluster.devices_per_node
    return bool((nodes != nodes[:, :1]).any())


def make_logical_mesh(
    cluster: ClusterSpec,
    shape: tuple[int, ...],
    axis_names: tuple[str, ...] | None = None,
    device_indices: tuple[int, ...] | None = None,
) -> LogicalMesh:
    """A logical mesh of ``shape`` over ``device_indices`` (default: the first devices of the cluster)."""
    shape = tuple(int(s) for s in shape)
    if any(s < 1 for s in shape):
        raise ValueError(f"mesh shape {shape} has a non-positive axis")
    if axis_names is None:
        axis_names = DEFAULT_AXIS_NAMES[: len(shape)]
    if len(axis_names) != len(shape):
        raise ValueError(f"mesh shape {shape} and axis names {axis_names} differ in length")
    size = int(np.prod(shape, dtype=np.int64))
    if device_indices is None:
        if size > cluster.num_devices:
            raise ValueError(f"mesh {shape} needs {size} devices; cluster {cluster.name} has {cluster.num_devices}")
        device_indices = tuple(range(size))
    if len(device_indices) != size:
        raise ValueError(f"mesh {shape} needs {size} devices, got {len(device_indices)} device indices")
    grid = np.asarray(device_indices).reshape(shape)
    crossing = [_crosses_nodes(cluster, grid, i) for i in range(len(shape))]
    axes = tuple(MeshAxis(name, n, group_link(cluster, grid, [i]), crossing[i])
                 for i, (name, n) in enumerate(zip(axis_names, shape)))
    return LogicalMesh(axes=axes, cluster=cluster, device_indices=tuple(int(d) for d in device_indices))


def factorizations(num_devices: int, max_axes: int = 2) -> list[tuple[int, ...]]:
    """Mesh shapes with up to ``max_axes`` axes whose product is ``num_devices`` (Alpa's logical-mesh search).

    Axes of size 1 are included ((1, 6) beside (6,)): a sub-mesh of one host row is such a shape.
    """
    if num_devices < 1:
        raise ValueError(f"num_devices must be positive, got {num_devices}")
    divisors = [d for d in range(1, num_devices + 1) if num_devices % d == 0]

    def shapes_of(n: int, rank: int) -> list[tuple[int, ...]]:
        if rank == 1:
            return [(n,)]
        return [(d, *rest) for d in divisors if n % d == 0 for rest in shapes_of(n // d, rank - 1)]

    shapes = {s for rank in range(1, max_axes + 1) for s in shapes_of(num_devices, rank)}
    return sorted(shapes, key=lambda s: (len(s), s))
