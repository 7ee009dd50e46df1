"""Static checks of a plan against a cluster and a mesh, before anything runs.

``validate_plan`` returns one ``Finding`` per check: the plan file's versions,
the mesh (a plan runs only on a mesh of its own shape, as ``autoshard.apply``
checks), the device count, the divisibility of every spec against the
recorded shapes, and the per-device memory against the budget. An error's ``fix`` says what
to change; ``autoshard validate`` exits non-zero when any check fails.
"""
from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autoshard.plans.plan import GIB, Plan, fmt_bytes
from autoshard.ir.spec import Spec
from autoshard.meshes.cluster import ClusterSpec, ClusterSpecError, get_cluster

MAX_LISTED = 8  # divisibility problems listed one by one; the rest are counted


class Severity(str, enum.Enum):
    OK = "ok"
    WARNING = "warning"
    ERROR = "error"


@dataclass(frozen=True)
class Finding:
    check: str  # "version", "mesh", "devices", "divisibility", "memory", "cluster"
    severity: Severity
    message: str
    fix: str = ""

    @property
    def failed(self) -> bool:
        return self.severity == Severity.ERROR


def _versions(plan_versions: Mapping[str, str]) -> list[Finding]:
    import jax

    from autoshard.version import __version__

    found: list[Finding] = []
    if not plan_versions:
        return [Finding("version", Severity.OK, "versions not checked (the plan was not read from a file)")]
    made_jax = plan_versions.get("jax_version", "")
    made_autoshard = plan_versions.get("autoshard_version", "")
    file_version = plan_versions.get("version", "")
    base = f"plan file v{file_version}, made by autoshard {made_autoshard or '?'} on jax {made_jax or '?'}"
    if made_jax and made_jax.split(".")[:2] != jax.__version__.split(".")[:2]:
        found.append(Finding("version", Severity.WARNING, f"{base}; this is jax {jax.__version__}",
                             "XLA's partitioner may differ between jax versions: run `autoshard verify` on the "
                             "plan, or re-plan with this jax"))
    elif made_autoshard and made_autoshard != __version__:
        found.append(Finding("version", Severity.WARNING, f"{base}; this is autoshard {__version__}",
                             "re-plan to use this autoshard's cost model"))
    else:
        found.append(Finding("version", Severity.OK, base))
    return found


def _devices(plan: Plan, shape: Sequence[int], cluster: ClusterSpec | None) -> list[Finding]:
    needed = math.prod(shape)
    if cluster is None:
        return [Finding("devices", Severity.OK, f"the plan needs {needed} devices (no cluster given to check)")]
    if needed > cluster.num_devices:
        return [Finding("devices", Severity.ERROR,
                        f"the plan's mesh {tuple(shape)} needs {needed} devices; cluster {cluster.name} has "
                        f"{cluster.num_devices}",
                        f"run on a cluster with at least {needed} devices, or re-plan for this one: "
                        f"autoshard plan TARGET --cluster {cluster.name} --mesh <shape of {cluster.num_devices}>")]
    if needed < cluster.num_devices:
        return [Finding("devices", Severity.WARNING,
                        f"the plan uses {needed} of cluster {cluster.name}'s {cluster.num_devices} devices",
                        f"re-plan with a mesh of {cluster.num_devices} devices to use them all")]
    return [Finding("devices", Severity.OK, f"{needed} devices, as cluster {cluster.name} has")]


def _indivisible(spec: Spec, shape: Sequence[int], sizes: Mapping[str, int]) -> list[tuple[int, int, int, tuple]]:
    """(dim, size, shards, axes) of each split dimension that the shards do not divide."""
    bad = []
    for d, (size, axes) in enumerate(zip(shape, spec.dims)):
        n = math.prod(sizes.get(a, 1) for a in axes)
        if axes and size % n:
            bad.append((d, size, n, axes))
    return bad


def _divisibility(plan: Plan, names: Sequence[str], shape: Sequence[int]) -> list[Finding]:
    sizes = dict(zip(names, shape))
    entries = [("argument", p, s, plan.input_shapes.get(p)) for p, s in plan.input_specs.items()]
    entries += [("output", p, s, plan.output_shapes.get(p)) for p, s in plan.output_specs.items()]
    problems: list[str] = []
    faults: dict[tuple[str, ...], set[int]] = {}
    checked = 0
    for what, path, spec, recorded in entries:
        if recorded is None:
            continue
        dims = recorded[0]
        if spec.rank != len(dims):
            problems.append(f"{what} {path}: spec {spec} has {spec.rank} dims, shape {list(dims)} has {len(dims)}")
            continue
        checked += 1
        for d, size, n, axes in _indivisible(spec, dims, sizes):
            problems.append(f"{what} {path}: dim {d} of size {size} is split over {','.join(axes)} "
                            f"({n} devices), which does not divide {size}")
            faults.setdefault(axes, set()).add(size)
    if not problems:
        return [Finding("divisibility", Severity.OK,
                        f"every split divides its dimension ({checked} arrays on mesh {tuple(shape)})")]
    listed = problems[:MAX_LISTED] + ([f"... and {len(problems) - MAX_LISTED} more"]
                                      if len(problems) > MAX_LISTED else [])
    needs = "; ".join(f"the {math.prod(sizes[a] for a in axes)} devices of {','.join(axes)} must divide "
                      f"{', '.join(map(str, sorted(dims)[:4]))}" for axes, dims in sorted(faults.items()))
    mesh = "x".join(map(str, shape))
    fix = (f"use a mesh whose axes divide the dimensions they split ({needs}), or re-plan for this mesh: "
           f"autoshard plan TARGET --mesh {mesh}")
    return [Finding("divisibility", Severity.ERROR, "\n".join(listed), fix)]


def _memory(plan: Plan, budget: float, source: str) -> list[Finding]:
    peak = plan.ledger.peak_memory_bytes
    if peak <= budget:
        return [Finding("memory", Severity.OK,
                        f"peak {fmt_bytes(peak)} per device fits the {fmt_bytes(budget)} budget ({source})")]
    kinds = ", ".join(f"{k} {fmt_bytes(v)}"
                      for k, v in sorted(plan.ledger.memory_by_kind.items(), key=lambda kv: -kv[1]))
    ceiling = plan.baselines.get("autoshard", {}).get("batch_ceiling") if plan.baselines else None
    fix = (f"re-plan with --memory-budget {budget / GIB:.4g}GiB (autoshard then shards more state or "
           f"activations), use devices with at least {fmt_bytes(peak)}")
    fix += f", or lower the global batch to at most {ceiling}" if ceiling else ", or lower the batch size"
    return [Finding("memory", Severity.ERROR,
                    f"peak {fmt_bytes(peak)} per device ({kinds}) exceeds the {fmt_bytes(budget)} budget "
                    f"({source}) by {fmt_bytes(peak - budget)}", fix)]


def _mesh(plan: Plan, shape: tuple[int, ...]) -> list[Finding]:
    """``autoshard.apply`` runs a plan only on a mesh of its own shape; another shape is an error here too."""
    planned = "x".join(map(str, plan.mesh_shape))
    if shape == tuple(plan.mesh_shape):
        return [Finding("mesh", Severity.OK, f"mesh {planned} is the plan's")]
    axes = ", ".join(f"{n}={s}" for n, s in zip(plan.axis_names, plan.mesh_shape))
    wanted = "x".join(map(str, shape))
    return [Finding("mesh", Severity.ERROR,
                    f"the plan is for mesh {planned} ({axes}); autoshard.apply refuses a mesh of shape {wanted}",
                    f"re-plan for that mesh (autoshard plan TARGET --mesh {wanted}), or run on a {planned} mesh")]


def _cluster(plan: Plan, cluster: ClusterSpec | None) -> list[Finding]:
    """A warning when ``cluster``, on the plan's device count, prices differently from the plan's cluster."""
    if cluster is None:
        return []
    try:
        resized = get_cluster(cluster, num_devices=math.prod(plan.mesh_shape))
    except ClusterSpecError:
        resized = cluster
    if resized.same_hardware(plan.cluster):
        return []
    return [Finding("cluster", Severity.WARNING,
                    f"the plan was priced for cluster {plan.cluster.name}, not {cluster.name}",
                    f"its modeled times are for {plan.cluster.name}; re-plan with --cluster {cluster.name} "
                    "to price it for this one")]


def validate_plan(plan: Plan, *, cluster: ClusterSpec | None = None, mesh_shape: Sequence[int] | None = None,
                  memory_budget_bytes: float | None = None,
                  file_versions: Mapping[str, str] | None = None) -> list[Finding]:
    """Every static check (see the module docstring); ``mesh_shape`` is the mesh it is to run on: an error
    unless it is the plan's own (``autoshard.apply`` refuses another)."""
    findings = _versions(file_versions or {})
    shape = tuple(plan.mesh_shape)
    if mesh_shape is not None:
        findings += _mesh(plan, tuple(int(s) for s in mesh_shape))
    findings += _devices(plan, shape, cluster)
    findings += _divisibility(plan, plan.axis_names, shape)
    if memory_budget_bytes is not None:
        budget, source = memory_budget_bytes, "--memory-budget"
    elif cluster is not None:
        budget, source = cluster.memory_per_device_bytes, f"{cluster.name}'s device memory"
    else:
        budget, source = plan.memory_budget_bytes, "the plan's budget"
    findings += _memory(plan, budget, source)
    findings += _cluster(plan, cluster)
    return findings
