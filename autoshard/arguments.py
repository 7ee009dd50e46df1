"""Every planning argument checked before any tracing or planning, for the API and the command line alike.

``check_arguments`` takes what a caller passed (``autoshard.autoshard``,
``autoshard.plan`` or a command's flags) and returns it checked and normalized
(``PlanArguments``), or raises ``ArgumentError``: one line naming the argument
as the caller wrote it (``ArgumentNames``: ``memory_budget`` for the API,
``--memory-budget`` for the command line) and what to give instead. It needs
no devices, so it runs when a step is decorated; ``check_devices`` compares the
mesh with the devices present once they are (a decorated step's first call,
``autoshard.plan``).

What is checked:

- ``mesh``: None, a shape of positive integers or a ``jax.sharding.Mesh``;
  its device count no more than the cluster's (a preset or ClusterSpec is not
  silently grown: ``cpu-8`` is 8 devices; a one-device ClusterSpec, what
  ``autoshard profile`` writes on one GPU, describes the chip and grows to
  one node of the mesh's size) and, when the step runs or the cluster
  describes the devices present, no more than those present;
- ``cluster``: a known preset, a readable file, or a ClusterSpec;
- ``memory_budget``: bytes (a positive number) or a string with a unit,
  ``"40GiB"``, ``"512MiB"``, ``"1.5GB"`` (``parse_bytes``); a bare number in
  a string is refused, as its unit would be a guess;
- ``num_stages`` / ``num_microbatches``: None or positive integers, no more
  stages than devices; ``schedule``: ``"1f1b"``, ``"interleaved"`` or ``"gpipe"``;
- ``while_trip_count``: None or a positive integer.
"""
from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass
from typing import Any

from autoshard.errors import ArgumentError
from autoshard.meshes.cluster import ClusterSpec, ClusterSpecError, get_cluster
from autoshard.plans.schedules import SCHEDULES

__all__ = ["API_NAMES", "CLI_NAMES", "ArgumentNames", "PlanArguments", "check_arguments", "check_devices",
           "parse_bytes"]

# unit -> bytes; the binary units are what device memory is quoted in
BYTE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BYTES = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]+)\s*$", re.I)


@dataclass(frozen=True)
class ArgumentNames:
    """How the caller spells each argument: errors name it so."""

    mesh: str = "mesh"
    cluster: str = "cluster"
    memory_budget: str = "memory_budget"
    num_stages: str = "num_stages"
    num_microbatches: str = "num_microbatches"
    schedule: str = "schedule"
    while_trip_count: str = "while_trip_count"
    num_devices: str = "num_devices"


API_NAMES = ArgumentNames()
CLI_NAMES = ArgumentNames("--mesh", "--cluster", "--memory-budget", "--stages", "--microbatches", "--schedule",
                          "--while-trip-count", "--devices")


@dataclass(frozen=True)
class PlanArguments:
    """The checked arguments: the budget in bytes, the mesh a tuple or a jax Mesh."""

    mesh: Any  # None | tuple[int, ...] | jax.sharding.Mesh
    cluster: ClusterSpec | str | None  # as given (a name or file is resolved again where it is used)
    memory_budget: float | None  # bytes per device
    num_stages: int | None
    num_microbatches: int | None
    schedule: str
    while_trip_count: int | None
    mesh_devices: int | None  # devices the mesh covers (None: no mesh given)
    cluster_devices: int | None  # devices the given cluster has (None: no cluster given)


def parse_bytes(value: Any, name: str = API_NAMES.memory_budget) -> float:
    """Bytes of a budget: a positive number (bytes) or a string with a unit (``"40GiB"``, ``"512 MiB"``,
    ``"2e9B"``); ArgumentError otherwise, naming ``name``."""
    units = "units: B, KB, MB, GB, TB in powers of 1000; KiB, MiB, GiB, TiB in powers of 1024"
    if isinstance(value, str):
        match = _BYTES.match(value)
        if match is None:
            bare = re.fullmatch(r"\s*[0-9.eE+-]+\s*", value) is not None
            what = "has no unit" if bare else "is not a size"
            raise ArgumentError(f"{name} {value!r} {what}: write a number and a unit, e.g. "
                                f"{value.strip() if bare else '40'}GiB or 512MiB ({units})")
        number, unit = float(match.group(1)), match.group(2).lower()
        if unit not in BYTE_UNITS:
            raise ArgumentError(f"{name} {value!r}: unknown unit {match.group(2)!r} ({units})")
        value_bytes = number * BYTE_UNITS[unit]
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):  # numpy scalars too
        value_bytes = float(value)
    else:
        raise ArgumentError(f"{name} must be bytes (a number) or a size with a unit such as '40GiB', got "
                            f"{type(value).__name__} {value!r}")
    if not value_bytes > 0 or not math.isfinite(value_bytes):
        raise ArgumentError(f"{name} must be a positive size, got {value!r}; leave it out for the device memory")
    return value_bytes


def _positive_int(value: Any, name: str, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        raise ArgumentError(f"{name} must be a positive integer ({what}), got {value!r}; leave it out for the "
                            "default")
    return int(value)


def _mesh(mesh: Any, name: str) -> tuple[Any, int | None]:
    """(the mesh normalized, its device count)."""
    if mesh is None:
        return None, None
    if hasattr(mesh, "devices") and hasattr(mesh, "axis_names"):  # a jax Mesh: its devices exist
        return mesh, int(mesh.devices.size)
    if isinstance(mesh, (tuple, list)) and mesh and all(
            isinstance(s, numbers.Integral) and not isinstance(s, bool) and int(s) >= 1 for s in mesh):
        shape = tuple(int(s) for s in mesh)
        return shape, math.prod(shape)
    raise ArgumentError(f"{name} must be a shape of positive integers such as (2, 4), a jax.sharding.Mesh, or "
                        f"None (searched), got {mesh!r}")


def _cluster_devices(cluster: Any, name: str) -> int | None:
    if cluster is None:
        return None
    try:
        return get_cluster(cluster).num_devices
    except ClusterSpecError as err:
        raise ArgumentError(f"{name}: {err}") from None


def _shape_text(mesh: Any) -> str:
    shape = tuple(mesh.devices.shape) if hasattr(mesh, "devices") else tuple(mesh)
    return "x".join(map(str, shape))


def check_arguments(*, mesh: Any = None, cluster: Any = None, memory_budget: Any = None,
                    num_stages: Any = None, num_microbatches: Any = None, schedule: Any = "1f1b",
                    while_trip_count: Any = None, num_devices: Any = None,
                    names: ArgumentNames = API_NAMES) -> PlanArguments:
    """The arguments checked without devices (module docstring); ArgumentError names the first wrong one."""
    mesh, mesh_n = _mesh(mesh, names.mesh)
    cluster_n = _cluster_devices(cluster, names.cluster)
    budget = None if memory_budget is None else parse_bytes(memory_budget, names.memory_budget)
    stages = _positive_int(num_stages, names.num_stages, "pipeline stages")
    microbatches = _positive_int(num_microbatches, names.num_microbatches, "pipeline microbatches")
    trips = _positive_int(while_trip_count, names.while_trip_count,
                          "the iterations a while loop autoshard cannot count is priced at")
    devices = _positive_int(num_devices, names.num_devices, "the devices to plan for")
    if schedule not in SCHEDULES:
        raise ArgumentError(f"{names.schedule} must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if mesh_n is not None and devices is not None and devices != mesh_n:
        raise ArgumentError(f"{names.num_devices} {devices} contradicts {names.mesh} {_shape_text(mesh)} "
                            f"({mesh_n} devices): give one of them")
    wanted = mesh_n if mesh_n is not None else devices
    if cluster_n is not None and cluster_n > 1 and wanted is not None and wanted > cluster_n:
        what = f"{names.mesh} {_shape_text(mesh)}" if mesh_n is not None else f"{names.num_devices} {devices}"
        cluster_name = cluster if isinstance(cluster, str) else getattr(cluster, "name", "the cluster")
        raise ArgumentError(f"{what} needs {wanted} devices but {names.cluster} {cluster_name} has {cluster_n}: "
                            f"use a mesh of at most {cluster_n} devices, or a cluster with {wanted} (a ClusterSpec "
                            "file, or a larger preset)")
    limit = wanted if wanted is not None else cluster_n
    if stages is not None and limit is not None and stages > limit:
        raise ArgumentError(f"{names.num_stages} {stages} is more stages than the {limit} devices: each stage needs "
                            f"at least one; use at most {limit}")
    return PlanArguments(mesh, cluster, budget, stages, microbatches, schedule, trips, mesh_n, cluster_n)


def check_devices(args: PlanArguments, present: int, *, runs: bool, names: ArgumentNames = API_NAMES) -> None:
    """The checked arguments against the ``present`` devices: a step that runs, or a plan whose cluster is
    the devices present (no cluster given), cannot use more than there are."""
    if not (runs or args.cluster is None):
        return
    if args.mesh_devices is not None and args.mesh_devices > present:
        where = "" if runs else (f", or pass {names.cluster} (a preset or ClusterSpec with {args.mesh_devices} "
                                 "devices) to plan for other hardware")
        raise ArgumentError(f"{names.mesh} {_shape_text(args.mesh)} needs {args.mesh_devices} devices but "
                            f"{present} are present: use a mesh of at most {present} devices{where}")
    if args.mesh_devices is None and args.num_stages is not None and args.num_stages > present:
        raise ArgumentError(f"{names.num_stages} {args.num_stages} is more stages than the {present} devices "
                            f"present: use at most {present}")
