"""What a plan does not know, said with it: planning cost, invariants kept, missing evidence, counter-signals.

``str(plan)``, ``autoshard explain`` (tables and HTML) and ``autoshard advise``
all show ``plan_caveats(plan)``:

- **planning cost**: the seconds planning took (``Plan.planning_s``) and the
  steps after which the modeled time saved over the best classic plan that
  fits repays them;
- **invariants kept**: the global batch and the optimizer update are the
  unsharded step's; whether a numerics check against one device was run
  (``Plan.checks["numerics"]``, which a launch bundle's ``--check-numerics``
  records);
- **missing evidence**: where the cluster numbers come from (a preset's
  built-in figures, or a file), links the plan crosses that its ClusterSpec
  marks unmeasured (profiled on one device), that step times are modeled, not measured,
  and the search space the optimum is taken over;
- **counter-signals**: a modeled gain over the best classic plan that fits
  below ``MODEL_ERROR`` (then that classic plan is the safer choice), a plan
  over its memory budget, a solver stopped by its time limit, another mesh
  within the model's error.

Everything is read from the plan's public fields (ledger, baselines, cluster,
solver, planning_s, checks), so a change of the cost model flows into these
lines with the ledger.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from autoshard.meshes.cluster import PRESETS
from autoshard.plans.ledger import fmt_bytes, fmt_gap, fmt_s

PlanLike = Any  # plans/plan.py imports this module; it reads a Plan's public fields

# A modeled gain smaller than this is within what the model gets wrong (the fidelity checks hold
# collectives to 10% and memory to 15%, and the roofline ignores overlap), so it is no reason to leave
# a classic strategy people already run.
MODEL_ERROR = 0.05
SAME_STEP = 1e-3  # modeled steps within 0.1% of each other are the same time under the model


@dataclass(frozen=True)
class Caveats:
    """``plan_caveats``' findings: one sentence each, grouped as the module docstring lists them."""

    planning: str
    invariants: tuple[str, ...]
    missing_evidence: tuple[str, ...]
    counter_signals: tuple[str, ...]
    safer_choice: str | None  # the classic plan to prefer, when a counter-signal names one
    payoff_steps: float | None  # steps until planning is repaid; None: never, or not compared

    def sections(self) -> list[tuple[str, tuple[str, ...]]]:
        return [("planning cost", (self.planning,)), ("invariants kept", self.invariants),
                ("missing evidence", self.missing_evidence),
                ("counter-signals", self.counter_signals or ("none found",))]

    def lines(self, indent: str = "  ") -> list[str]:
        out = []
        for title, items in self.sections():
            out += [f"{indent}{title + ':':18}{items[0]}"] + [f"{indent}{'':18}{item}" for item in items[1:]]
        return out


def global_batch(plan: PlanLike) -> int | None:
    """Dim 0 of the plan's batch inputs (the smallest, when they differ); None without batch inputs."""
    sizes = [shape[0] for path, (shape, _dtype) in plan.input_shapes.items()
             if plan.input_roles.get(path) == "batch" and shape]
    return min(sizes) if sizes else None


def _classic(plan: PlanLike) -> tuple[str, float] | None:
    """(name, modeled step) of the fastest compared classic plan that fits."""
    name = plan.best_baseline(fitting=True)
    return (name, float(plan.baselines[name]["step_s"])) if name else None


def _planning(plan: PlanLike) -> tuple[str, float | None]:
    seconds = float(sum(plan.planning_s.values()))
    spent = f"planning took {seconds:.1f} s"
    if not plan.baselines:
        return spent + "; its pay-off is unknown: the plan was not compared with the classic strategies", None
    classic = _classic(plan)
    if classic is None:
        return spent + "; no classic plan fits the budget, so there is nothing cheaper to run instead", None
    name, classic_s = classic
    saved = classic_s - plan.step_s
    if saved <= 0:
        return spent + f" and saves nothing per step over {name} under the model: it never pays off", None
    steps = seconds / saved
    return (spent + f"; it pays off after {math.ceil(round(steps, 6)):,} steps ({fmt_s(saved)} modeled saving per step "
            f"over {name}, the best classic plan that fits)"), steps


def _invariants(plan: PlanLike) -> tuple[str, ...]:
    batch = global_batch(plan)
    batch_text = f"the global batch ({batch})" if batch else "the batch"
    if plan.stages:
        kept = (f"{batch_text} and the optimizer update of the unsharded step: the batch runs as "
                f"{plan.num_microbatches} microbatches whose gradients are summed before one update (the same "
                "update when the loss is a mean over the batch)")
    else:
        kept = f"{batch_text} and the optimizer update of the unsharded step: only where arrays live changes"
    numerics = plan.checks.get("numerics")
    check = (f"numerics against one device: {numerics}" if numerics else
             "no numerics check against one device is recorded for this plan (its launch bundle's "
             "run.sh --check-numerics runs one and records it)")
    return (kept, check)


def _cluster_source(plan: PlanLike) -> str:
    cluster = plan.cluster
    base = cluster.name.split("[")[0]
    preset = PRESETS.get(base)
    same = preset is not None and all(
        getattr(preset, f) == getattr(cluster, f)
        for f in ("intra_node", "inter_node", "memory_bandwidth_bytes_per_s", "memory_per_device_bytes")
    ) and dict(preset.peak_flops_per_s) == dict(cluster.peak_flops_per_s)
    if same:
        return (f"cluster numbers are the preset '{base}' (built-in figures), not measured on your cluster: "
                "`autoshard profile --out cluster.json` on it measures links and FLOP/s (use --cluster cluster.json)")
    return (f"cluster numbers come from the ClusterSpec '{cluster.name}', measured only if whoever wrote it "
            "measured them")


def _unmeasured_links(plan: PlanLike) -> tuple[str, ...]:
    """A sentence when the plan's devices cross a link its ClusterSpec marks unmeasured."""
    scopes = plan.cluster.unmeasured_links(math.prod(plan.mesh_shape))
    if not scopes:
        return ()
    links = f"link{'s' if len(scopes) > 1 else ''} {'were' if len(scopes) > 1 else 'was'}"
    return (f"the {' and '.join(scopes)} {links} not measured in ClusterSpec '{plan.cluster.name}' (profiled on "
            "fewer devices than the plan spans): its collectives are priced with placeholder numbers; "
            "`autoshard profile` on the devices the plan spans measures them, or `--links PRESET` takes a "
            "preset's",)


def _search_space(plan: PlanLike) -> str:
    meshes = ", ".join(plan.alternatives) if plan.alternatives else "x".join(map(str, plan.mesh_shape))
    stages = (f"{len(plan.stages)} pipeline stages" if plan.stages else "no pipeline stages in this plan")
    return ("'optimal' means optimal within the search space: one sharding per op over the mesh axes (data, "
            f"FSDP/ZeRO, tensor and expert splits are points of it) on mesh {meshes}; {stages}; not searched: "
            "activation recomputation in SPMD plans, CPU/NVMe offload, gradient accumulation, dtype changes")


def _missing(plan: PlanLike) -> tuple[str, ...]:
    found = [_cluster_source(plan), *_unmeasured_links(plan),
             "step times are modeled (alpha-beta collectives, roofline compute, no overlap of communication "
             "with compute), not measured",
             _search_space(plan)]
    if not plan.baselines:
        found.append("not compared with the classic strategies (`autoshard compare TARGET --out plan.json` "
                     "records the comparison in the plan)")
    return tuple(found)


def _counter_signals(plan: PlanLike) -> tuple[tuple[str, ...], str | None]:
    found: list[str] = []
    safer = None
    classic = _classic(plan) if plan.baselines else None
    if classic is not None and plan.step_s > 0:
        name, classic_s = classic
        gain = classic_s / plan.step_s - 1
        if gain < MODEL_ERROR:
            safer = name
            found.append(f"the modeled gain over {name} is {gain:.1%}, below the model's error ({MODEL_ERROR:.0%}): "
                         f"{name}, the classic plan, is the safer choice")
    if not plan.fits:
        found.append(f"the modeled peak {fmt_bytes(plan.ledger.peak_memory_bytes)} per device exceeds the budget "
                     f"{fmt_bytes(plan.memory_budget_bytes)}")
    status = plan.solver.status
    if status not in ("optimal", "stage-dp"):  # the stage DP is exact over its choices
        found.append(f"the solver did not prove optimality (status '{status}', gap "
                     f"{fmt_gap(plan.solver.gap, 1)}): a better plan may exist under the model")
    mine = "x".join(map(str, plan.mesh_shape))
    # a mesh whose modeled step equals the chosen one's (to 0.1%: the same plan's time, e.g. both keep every
    # array whole) is a tie, not a signal against the choice
    close = [f"{shape} ({step / plan.step_s - 1:+.1%})" for shape, step in plan.alternatives.items()
             if shape != mine and plan.step_s > 0 and
             plan.step_s * (1 + SAME_STEP) <= step < plan.step_s * (1 + MODEL_ERROR)]
    if close:
        found.append(f"other meshes model within {MODEL_ERROR:.0%} of the chosen {mine}: " + ", ".join(close))
    return tuple(found), safer


def plan_caveats(plan: PlanLike) -> Caveats:
    """What ``plan`` does not know (module docstring)."""
    planning, steps = _planning(plan)
    signals, safer = _counter_signals(plan)
    return Caveats(planning=planning, invariants=_invariants(plan), missing_evidence=_missing(plan),
                   counter_signals=signals, safer_choice=safer, payoff_steps=steps)


def caveats_dict(caveats: Caveats) -> dict[str, Any]:
    """The caveats as plain JSON data (``advise`` writes them beside its configs)."""
    return asdict(caveats)
