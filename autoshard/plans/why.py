"""Why this plan, in a line or two: against the best classic plan whenever a comparison exists, against the
best SPMD plan for a pipeline, and a note when the step is latency-bound (too short for splitting to pay).

``why_lines(plan)`` is read by ``str(plan)``, the explain and HTML reports. Everything comes from the plan's
public fields and the one cost model (``meshes/cost.py``).
"""
from __future__ import annotations

from typing import Any

from autoshard.ir.spec import Collective
from autoshard.meshes.cost import latency_s
from autoshard.meshes.logical import make_logical_mesh
from autoshard.plans.caveats import SAME_STEP as SAME
from autoshard.plans.ledger import fmt_bytes, fmt_s

PlanLike = Any  # plans/plan.py imports this module; it reads a Plan's public fields


def _vs_classic(plan: PlanLike) -> str | None:
    if not plan.baselines or plan.step_s <= 0:
        return None
    name = plan.best_baseline(fitting=True)
    if name is None:
        fits = "and this one does" if plan.fits else "and neither does this one"
        return f"no classic plan fits the {fmt_bytes(plan.memory_budget_bytes)} budget per device, {fits}"
    row = plan.baselines[name]
    classic_s, classic_peak = float(row["step_s"]), float(row.get("peak_memory_bytes", 0.0))
    ratio = classic_s / plan.step_s
    figures = (f"{fmt_s(plan.step_s)} vs {fmt_s(classic_s)} per step, peak {fmt_bytes(plan.ledger.peak_memory_bytes)} "
               f"vs {fmt_bytes(classic_peak)} per device")
    if abs(ratio - 1) < SAME:
        return f"the same modeled step as {name}, the best classic plan that fits ({figures})"
    margin = f"{ratio:.2f}x faster" if ratio > 1 else f"{1 / ratio:.2f}x slower"
    return f"modeled {margin} than {name}, the best classic plan that fits ({figures})"


def _vs_spmd(plan: PlanLike) -> str | None:
    summary = plan.pipeline
    spmd = getattr(summary, "spmd_step_s", None) if plan.stages else None
    if spmd is None or plan.step_s <= 0:
        return None
    ratio = spmd / plan.step_s
    margin = (f"{ratio:.2f}x faster" if ratio >= 1 + SAME else f"{1 / ratio:.2f}x slower" if ratio <= 1 - SAME
              else "as fast")
    return (f"{len(plan.stages)} pipeline stages model {margin} than the best SPMD plan "
            f"({summary.spmd_mesh}: {fmt_s(spmd)} per step)")


def one_collective_latency_s(plan: PlanLike) -> float:
    """The fixed latency of one all-reduce over every axis of the plan's mesh (0 on one device)."""
    axes = tuple(a for a, n in zip(plan.axis_names, plan.mesh_shape) if n > 1)
    if not axes:
        return 0.0
    mesh = make_logical_mesh(plan.cluster, tuple(plan.mesh_shape), tuple(plan.axis_names))
    return latency_s(mesh, Collective("all-reduce", axes, 0.0))


def latency_note(plan: PlanLike) -> str | None:
    """A note when the whole modeled step is shorter than one collective's latency across the mesh: then no
    split of the work can pay for the communication it needs, and the plan keeps most arrays whole."""
    latency = one_collective_latency_s(plan)
    if latency <= 0 or plan.step_s <= 0 or plan.step_s >= latency:
        return None
    devices = 1
    for n in plan.mesh_shape:
        devices *= n
    return (f"latency-bound: the whole modeled step ({fmt_s(plan.step_s)}) is shorter than one all-reduce's "
            f"latency across the {devices} devices ({fmt_s(latency)}), so splitting work costs more than it saves "
            f"and the plan keeps most arrays whole; sharding pays on a larger model or batch")


def why_lines(plan: PlanLike) -> tuple[str, ...]:
    """The plan's reasons in one line each (module docstring); empty when there is nothing to compare with
    and nothing to note."""
    return tuple(line for line in (_vs_classic(plan), _vs_spmd(plan), latency_note(plan)) if line)
