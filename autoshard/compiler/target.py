"""Where a plan runs: the one resolution of (mesh, cluster, memory budget) for every entry point.

``resolve_target`` turns what a user passes (a jax ``Mesh``, a mesh shape or
None; a preset name, a file, a ``ClusterSpec`` or None; a budget in bytes or
None) into a :class:`Target`: the device count, the ClusterSpec that prices
them (resized to that count, ``meshes/cluster.get_cluster``), the per-device
budget (the cluster's device memory by default) and the logical meshes to plan
on: the given one, or, with no mesh, every factorization of the device count
into two axes (Alpa's logical-mesh search). The SPMD driver, the pipeline
driver, the baselines and the batch ceilings all start from a Target.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

import jax
import numpy as np
from jax.sharding import Mesh

from autoshard.errors import InfeasibleMemoryError
from autoshard.ir.graph import OpGraph, Role
from autoshard.meshes.cluster import ClusterSpec, get_cluster
from autoshard.meshes.logical import LogicalMesh, factorizations, make_logical_mesh
from autoshard.plans.ledger import fmt_bytes

MeshLike: TypeAlias = Mesh | tuple[int, ...] | None
ClusterLike: TypeAlias = ClusterSpec | str | None


@dataclass(frozen=True)
class Target:
    num_devices: int
    cluster: ClusterSpec  # sized to num_devices
    memory_budget_bytes: float  # per device
    meshes: tuple[LogicalMesh, ...]  # candidate logical meshes (one when the mesh was given)
    mesh: MeshLike  # as given: a jax Mesh keeps its device order for the runtime

    @property
    def mesh_given(self) -> bool:
        return self.mesh is not None

    @property
    def device_indices(self) -> tuple[int, ...] | None:
        """Cluster device indices of a given jax Mesh, in its order (None for a shape or no mesh)."""
        if not isinstance(self.mesh, Mesh):
            return None
        index = {d.id: i for i, d in enumerate(jax.devices())}
        return tuple(index.get(d.id, i) for i, d in enumerate(self.mesh.devices.flat))


def mesh_devices(mesh: MeshLike, num_devices: int | None = None) -> int:
    """The device count a mesh (or, without one, ``num_devices`` or the devices present) covers."""
    if isinstance(mesh, Mesh):
        return int(mesh.devices.size)
    if mesh is not None:
        return int(np.prod(mesh))
    return int(num_devices or len(jax.devices()))


def candidate_meshes(mesh: MeshLike, cluster: ClusterSpec, num_devices: int) -> list[LogicalMesh]:
    if isinstance(mesh, Mesh):
        index = {d.id: i for i, d in enumerate(jax.devices())}
        device_indices = tuple(index.get(d.id, i) for i, d in enumerate(mesh.devices.flat))
        return [make_logical_mesh(cluster, tuple(mesh.devices.shape), tuple(mesh.axis_names), device_indices)]
    if mesh is not None:
        return [make_logical_mesh(cluster, tuple(int(s) for s in mesh))]
    # (n, 1) is (1, n) with its axes renamed (one axis over the same devices, in the same order): the same plans
    shapes = [s for s in factorizations(num_devices, 2) if len(s) == 2 and (s[1] > 1 or num_devices == 1)]
    return [make_logical_mesh(cluster, s) for s in shapes]


def resolve_target(mesh: MeshLike = None, cluster: ClusterLike = None, memory_budget: float | None = None,
                   *, num_devices: int | None = None) -> Target:
    """The Target of an entry point's arguments (module docstring)."""
    n = mesh_devices(mesh, num_devices)
    spec = get_cluster(cluster, num_devices=n)
    budget = float(memory_budget if memory_budget is not None else spec.memory_per_device_bytes)
    return Target(n, spec, budget, tuple(candidate_meshes(mesh, spec, n)), mesh)


def state_floor_bytes(graph: OpGraph, num_devices: int) -> float:
    """Bytes per device that no plan of ``graph`` on ``num_devices`` devices can go below: its parameters and
    optimizer state, split evenly over every device (each byte of them is held by some device)."""
    state = sum(graph.values[v].nbytes for v in graph.inputs
                if graph.values[v].role in (Role.PARAM, Role.OPT_STATE))
    return state / max(num_devices, 1)


def check_budget_floor(graph: OpGraph, target: Target) -> None:
    """Raise InfeasibleMemoryError at once, before any search, when the budget is below ``state_floor_bytes``
    (an impossible budget is known in the time a trace takes, not after the smallest feasible one is
    searched for)."""
    floor = state_floor_bytes(graph, target.num_devices)
    budget = target.memory_budget_bytes
    if budget < floor:
        raise InfeasibleMemoryError(
            f"no plan fits {fmt_bytes(budget)} per device: the parameters and optimizer state alone take "
            f"{fmt_bytes(floor)} per device even split over all {target.num_devices} devices (activations and the "
            f"batch come on top); raise memory_budget above {fmt_bytes(floor)} or use more devices",
            None, budget_bytes=budget)
