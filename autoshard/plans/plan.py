"""Plan: everything autoshard decided for one train step, as plain data.

A Plan names the logical mesh, a Spec per input and output leaf (by pytree
path), per-op output specs and reshards (by op index in the traced graph),
and a ledger of what the cost model predicts: compute, communication and
resharding time, per-device memory by kind, the collectives by kind, and how
the solver and each pass fared. ``str(plan)`` is a readable report.

A pipeline plan also holds its stages (``PipelineStage``) and a ``PipelinePlan`` (B, schedule, the
layers' equations). Plain data: the runtime runs a plan (``autoshard.apply(plan, fn, mesh)``,
``runtime/run.py``), nothing here does.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoshard.ir.spec import Spec
from autoshard.meshes.cluster import ClusterSpec
from autoshard.plans import planfile
from autoshard.plans.annotations import Deferral
from autoshard.plans.breakdown import LayerTime, state_slots
from autoshard.plans.caveats import Caveats, plan_caveats
from autoshard.plans.ledger import GIB, Ledger, OpExplanation, SolverInfo, fmt_bytes, fmt_s, solver_summary
from autoshard.plans.legend import SHORT_LEGEND
from autoshard.plans.stage_plan import PipelinePlan, PipelineStage
from autoshard.plans.why import why_lines

__all__ = ["GIB", "Ledger", "OpExplanation", "Plan", "SolverInfo", "fmt_bytes", "fmt_s", "load_plan"]


@dataclass(frozen=True)
class Plan:
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    cluster: ClusterSpec
    input_specs: Mapping[str, Spec]  # pytree path -> storage spec
    output_specs: Mapping[str, Spec]
    input_roles: Mapping[str, str]
    input_shapes: Mapping[str, tuple[tuple[int, ...], str]]  # path -> (shape, dtype): the traced signature
    op_out_specs: Mapping[int, tuple[Spec, ...]]
    op_in_reshards: Mapping[int, Mapping[int, tuple[Spec, ...]]]  # op -> {input position: layouts to pin}
    ledger: Ledger
    solver: SolverInfo
    planning_s: Mapping[str, float]  # seconds per pass
    memory_budget_bytes: float
    num_ops: int
    name: str = "autoshard"
    # pipeline stages (plan files may hold other stage objects as plain mappings: kept, never run)
    stages: tuple[PipelineStage | Mapping[str, Any], ...] = ()
    num_microbatches: int = 1
    schedule: str = "spmd"
    alternatives: Mapping[str, float] = field(default_factory=dict)  # other mesh shapes tried -> modeled step s
    output_reshards: Mapping[int, tuple[Spec, ...]] = field(default_factory=dict)  # flat output -> layouts to pin
    op_deferred: Mapping[int, Deferral] = field(default_factory=dict)  # op -> partial sums reduced after its scan
    output_shapes: Mapping[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)  # path -> (shape, dtype)
    in_tree: str = ""  # the arguments' pytree structure (str of the PyTreeDef)
    explanations: Mapping[int, OpExplanation] = field(default_factory=dict)  # op index -> why its strategy
    origin: Mapping[str, str] = field(default_factory=dict)  # how to rebuild the step, e.g. {target, config}
    baselines: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # compared strategies -> figures
    pipeline: PipelinePlan | None = None  # a pipeline plan's B, schedule, latency, bubble, layers; None: SPMD
    checks: Mapping[str, str] = field(default_factory=dict)  # checks run on this plan -> result, e.g. numerics
    layer_times: tuple[LayerTime, ...] = ()  # the modeled step split per layer (SPMD plans; plans/breakdown.py)
    # check="compiled": every plan compiled to choose this one -> {modeled_s, compiled_s (absent: did not
    # compile), fits, chosen (1.0 for the one returned)}; compiler/arbiter.py
    arbitration: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    @property
    def step_s(self) -> float:
        return self.ledger.step_s

    @property
    def fits(self) -> bool:
        return self.ledger.peak_memory_bytes <= self.memory_budget_bytes

    def save(self, path: str | Path) -> None:
        """Write the plan as a versioned JSON file (see plans/planfile.py)."""
        planfile.write_json(planfile.plan_to_json(self), path)

    @classmethod
    def from_json(cls, data: Any, source: str = "plan") -> "Plan":
        """A plan from the JSON of a plan file; ``PlanFileError`` names a missing or mistyped field."""
        return cls(**planfile.plan_fields(data, source))

    @property
    def caveats(self) -> Caveats:
        """What this plan does not know: planning cost, invariants, missing evidence, counter-signals."""
        return plan_caveats(self)

    def param_specs(self) -> dict[str, Spec]:
        return {p: s for p, s in self.input_specs.items() if self.input_roles.get(p) == "param"}

    def state_specs(self) -> dict[str, dict[str, Spec]]:
        """Per parameter path, the specs of its optimizer-state leaves by slot (``{"mu": ..., "nu": ...}``).

        A state leaf belongs to the parameter whose path (without the argument index) ends its path and
        whose shape it has: ``[1][0].mu['blocks'][0]['q']`` is slot ``mu`` of ``[0]['blocks'][0]['q']``.
        """
        state = {p: s for p, s in self.input_specs.items() if self.input_roles.get(p) == "opt_state"}
        return state_slots(self.param_specs(), state,
                           lambda owner, path: self.input_shapes[owner][0] == self.input_shapes[path][0])

    def collectives_summary(self) -> str:
        """Predicted collective bytes per device by kind; for a pipeline, per stage (its devices run only its
        executables); never "none" beside modeled collective time."""
        led = self.ledger
        if led.collective_bytes:
            return ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(led.collective_bytes.items()))
        per_stage = [(st.index, st.collectives_per_step(self.num_microbatches)) for st in self.stages
                     if isinstance(st, PipelineStage)]
        if any(kinds for _, kinds in per_stage):
            return "; ".join(f"stage {i}: " + (", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(kinds.items()))
                                                or "none") for i, kinds in per_stage) + " per step"
        if led.comm_s > 0:
            return f"{fmt_s(led.comm_s)} modeled, bytes not itemized in this plan"
        return "none"

    def best_baseline(self, *, fitting: bool = False) -> str | None:
        """The fastest compared classic strategy (``fitting``: among those that fit: the fallback)."""
        rows = [(float(r["step_s"]), name) for name, r in self.baselines.items()
                if name != "autoshard" and (r.get("fits", True) or not fitting)]
        return min(rows)[1] if rows else None

    def _baseline_lines(self) -> list[str]:
        if not self.baselines:
            return []
        lines = ["  compared with     " + ", ".join(
            f"{name} {fmt_s(float(r['step_s']))} ({self.step_s and float(r['step_s']) / self.step_s:.2f}x"
            + ("" if r.get("fits", True) else ", does not fit") + ")"
            for name, r in self.baselines.items() if name != "autoshard")]
        best, fallback = self.best_baseline(), self.best_baseline(fitting=True)
        lines.append(f"  best classic      {best}; fallback (best classic that fits): {fallback or 'none fits'}")
        return lines

    def __str__(self) -> str:
        led = self.ledger
        mesh = " x ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.mesh_shape))
        lines = [
            f"autoshard plan '{self.name}' on mesh ({mesh}) of {self.cluster.name}",
            f"  modeled step      {led.step_s * 1e3:10.3f} ms  (compute {led.compute_s * 1e3:.3f}, "
            f"collectives {led.comm_s * 1e3:.3f}, resharding {led.reshard_s * 1e3:.3f}, bubble {led.bubble_s * 1e3:.3f}"
            + (f", batch from host {led.input_s * 1e3:.3f}" if led.input_s else "") + ")",
            f"  compute bound     {led.compute_lower_bound_s * 1e3:10.3f} ms  "
            f"({led.compute_lower_bound_s / led.step_s:.0%} of it reached)" if led.step_s > 0 else "",
            "  time split        " + ", ".join(f"{k} {v:.0%}" for k, v in led.bound_shares().items() if v > 0)
            if led.compute_bound_s or led.memory_bound_s else "",
            f"  per device        {led.flops_per_device:.3g} FLOP, {fmt_bytes(led.hbm_bytes_per_device)} through HBM"
            if led.flops_per_device else "",
            f"  peak memory       {fmt_bytes(led.peak_memory_bytes):>10} per device (budget "
            f"{fmt_bytes(self.memory_budget_bytes)}): "
            + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(led.memory_by_kind.items())),
            "  collectives       " + self.collectives_summary(),
            f"  solver            {solver_summary(self.solver)}",
            "  planning          " + ", ".join(f"{k} {v:.2f}s" for k, v in self.planning_s.items()),
        ]
        if self.alternatives:
            lines.append("  meshes tried      " + ", ".join(f"{k}: {v * 1e3:.3f} ms" for k, v in self.alternatives.items()))
        lines += self._baseline_lines()
        lines += [f"  {'why this plan' if i == 0 else '':18}{line}" for i, line in enumerate(why_lines(self))]
        lines += ["  what this plan does not know:"] + self.caveats.lines("    ")
        if self.stages:
            lines += [f"  {self.pipeline}"] if self.pipeline is not None else []
            lines += [f"    {stage}" for stage in self.stages]
        lines.append("  parameters (and their optimizer state where it is laid out otherwise):")
        state = self.state_specs()
        for path, spec in self.param_specs().items():
            shape = self.input_shapes[path][0]
            other = state_note(spec, state.get(path, {}))
            lines.append(f"    {path:60} {str(shape):22} {spec}" + (f"   state: {other}" if other not in ("", "alike") else ""))
        others = [(p, s) for p, s in self.input_specs.items() if self.input_roles.get(p) == "batch"]
        if others:
            lines.append("  batch:")
            for path, spec in others:
                lines.append(f"    {path:60} {str(self.input_shapes[path][0]):22} {spec}")
        lines.append(f"  notation          {SHORT_LEGEND}")
        return "\n".join(line for line in lines if line)


def state_note(spec: Spec, slots: Mapping[str, Spec]) -> str:
    """'alike' when every optimizer-state slot of a parameter has its spec, '' with none, else the slots."""
    if not slots:
        return ""
    if all(s == spec for s in slots.values()):
        return "alike"
    return ", ".join(f"{slot} {s}" for slot, s in slots.items())


def load_plan(path: str | Path) -> Plan:
    """Read a plan file written by ``Plan.save``."""
    return Plan.from_json(planfile.read_json(path), str(path))
