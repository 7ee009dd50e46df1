"""Advice for PyTorch users: the nearest classic strategy that fits, with its batch arithmetic.

``advise(comparison)`` reads a ``Comparison`` (``compiler/baselines.py``:
autoshard and every classic plan on one mesh, priced by the one cost model)
and picks the classic strategy to run: the fastest under the model among those
that fit the budget at the traced batch; failing that, among those that fit a
smaller micro-batch (their batch ceiling holds at least one sample per
data-parallel rank) with gradient accumulation. HSDP is left out on one node
(HYBRID_SHARD there is FULL_SHARD with extra groups) and DP x TP on a mesh
without two split axes.

**Batch arithmetic.** The world is every device of the mesh, one process per
device; Megatron TP spans all of them, DP x TP the mesh's inner axis; the
data-parallel degree ``dp`` is the rest. The global batch ``G`` (the traced
batch unless given) is raised to a multiple of ``dp`` when it does not divide
(and the advice says so). The micro-batch per GPU is the largest divisor of
``G / dp`` whose global batch ``micro x dp`` is within the strategy's batch
ceiling; the accumulation is ``G / (dp x micro)``.

**Why it wins.** Each row says whether the plan fits and where its modeled
step goes (compute share, split into FLOP- and HBM-bound when the plan has
per-layer times, against collectives and resharding), read from the plans'
public ledgers, so a refined cost model shows up here unchanged.
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from autoshard.compiler.baselines import Candidate, Comparison
from autoshard.errors import PlanningError
from autoshard.ir.clipping import global_norm_clip
from autoshard.ir.graph import OpGraph
from autoshard.passes.classic import Baseline
from autoshard.passes.megatron import MegatronRoles
from autoshard.plans.ledger import fmt_bytes
from autoshard.plans.plan import Plan
from autoshard.plans.torch_configs import TorchSetup

LEAF_NAMES = frozenset({"kernel", "weight", "bias", "scale", "embedding", "w", "b"})


@dataclass(frozen=True)
class StrategyRow:
    """One strategy in the advice table: its comparison row, where its time goes, and the verdict."""

    candidate: Candidate  # name, modeled step, peak memory, fit and batch ceiling
    bound: str  # where the modeled step goes, e.g. "communication-bound (71% collectives + resharding)"
    verdict: str  # why it is chosen, or why not

    @property
    def name(self) -> str:
        return self.candidate.name


@dataclass(frozen=True)
class Advice:
    setup: TorchSetup
    chosen: str  # the classic strategy's label
    rows: tuple[StrategyRow, ...]  # autoshard first, then the classic strategies in comparison order
    autoshard_speedup: float  # the chosen strategy's modeled step / autoshard's (>= 1: autoshard is ahead)
    traced_batch: int
    global_batch: int
    notes: tuple[str, ...]


def bound_text(plan: Plan) -> str:
    """Where ``plan``'s modeled step goes, in a few words."""
    led = plan.ledger
    if led.step_s <= 0:
        return "no modeled time"
    compute = led.compute_s / led.step_s
    comm = (led.comm_s + led.reshard_s) / led.step_s
    if compute >= comm:
        hbm = sum(t.hbm_s for t in plan.layer_times)
        flops = sum(t.flops_s for t in plan.layer_times)
        kind = "HBM-bound" if hbm > flops else "compute-bound"
        return f"{kind} ({compute:.0%} compute)"
    return f"communication-bound ({comm:.0%} collectives + resharding)"


def _expressible(kind: Baseline, plan: Plan) -> str | None:
    """Why a classic strategy cannot be written for PyTorch on this cluster, or None."""
    if kind is Baseline.HSDP and plan.cluster.num_nodes == 1:
        return "HSDP needs more than one node (HYBRID_SHARD on one node is FULL_SHARD)"
    if kind is Baseline.DP_TP and sum(1 for s in plan.mesh_shape if s > 1) < 2:
        return "DP x TP needs a mesh with two split axes"
    return None


def _degrees(kind: Baseline, plan: Plan) -> tuple[int, int]:
    """(tensor-parallel, data-parallel) degrees of a classic strategy on the plan's mesh."""
    world = math.prod(plan.mesh_shape)
    tp = world if kind is Baseline.TP else plan.mesh_shape[-1] if kind is Baseline.DP_TP else 1
    return tp, world // tp


def micro_batch(per_rank: int, data_parallel: int, ceiling: int | None) -> int:
    """The largest divisor of ``per_rank`` whose global batch ``micro x data_parallel`` is within ``ceiling``."""
    limit = per_rank if ceiling is None else min(per_rank, ceiling // data_parallel)
    return max((m for m in range(1, limit + 1) if per_rank % m == 0), default=0)


def mixed_precision(plan: Plan) -> str:
    """Accelerate's ``mixed_precision``: the half dtype the step computes in, whether its parameters are stored
    in it or are fp32 masters cast down in the forward (the dtype most of its FLOPs run in)."""
    dtypes = {dtype for path, (_shape, dtype) in plan.input_shapes.items() if plan.input_roles.get(path) == "param"}
    compute = plan.ledger.main_compute_dtype
    if dtypes == {"bfloat16"} or compute == "bfloat16":
        return "bf16"
    return "fp16" if dtypes == {"float16"} or compute == "float16" else "no"


def module_names(graph: OpGraph, indices: Sequence[int]) -> tuple[str, tuple[str, ...]]:
    """(the container of the repeated blocks, block-relative module names) of parameter leaves."""
    container, names = "", []
    for i in indices:
        keys = re.findall(r"\['([^']*)'\]|\[(\d+)\]|\.(\w+)", re.sub(r"^\[\d+\]", "", graph.values[graph.inputs[i]].path
                                                                   or ""))
        parts = [a or b or c for a, b, c in keys]
        layer = next((k for k, part in enumerate(parts) if part.isdigit()), None)
        if layer is not None:
            container = container or ".".join(parts[:layer])
            parts = parts[layer + 1:]
        if parts and parts[-1] in LEAF_NAMES:
            parts = parts[:-1]
        name = ".".join(parts)
        if name and name not in names:
            names.append(name)
    return container, tuple(names)


def _layer_container(graph: OpGraph) -> str:
    return module_names(graph, range(len(graph.inputs)))[0]


def advise(comparison: Comparison, *, global_batch: int | None = None, fsdp_version: int = 2,
           source: str = "") -> Advice:
    """The classic strategy to run instead of autoshard's plan, and its PyTorch setup (module docstring).

    ``source`` names what was planned in the files' headers (e.g. "gpt-tiny").
    """
    auto = comparison.autoshard
    plan = auto.plan
    graph = auto.planned.graph if auto.planned is not None else None
    traced = comparison.batch_size or 1
    kinds = {kind.label: kind for kind in Baseline}
    rows: list[StrategyRow] = [StrategyRow(auto, bound_text(plan), "autoshard's own plan (JAX): the reference")]
    ranked: list[tuple[int, float, Candidate]] = []
    reasons: dict[str, str] = {}
    for cand in comparison.baselines:
        kind = kinds[cand.name]
        tp, dp = _degrees(kind, cand.plan)
        why_not = _expressible(kind, cand.plan)
        if why_not:
            reasons[cand.name] = why_not
        elif cand.fits:
            ranked.append((0, cand.step_s, cand))
        elif cand.batch_ceiling is not None and cand.batch_ceiling >= dp:
            ranked.append((1, cand.step_s, cand))
            reasons[cand.name] = (f"fits only with a smaller micro-batch (ceiling {cand.batch_ceiling:,} < batch "
                                  f"{traced})")
        else:
            reasons[cand.name] = (f"does not fit: {fmt_bytes(cand.peak_bytes)} per device over the budget "
                                  f"{fmt_bytes(comparison.memory_budget_bytes)}, even at one sample per GPU")
    if not ranked:
        raise PlanningError("no classic strategy fits the memory budget "
                            f"{fmt_bytes(comparison.memory_budget_bytes)} per device, even at one sample per GPU: "
                            "raise --memory-budget, use more devices, or run autoshard's plan")
    ranked.sort(key=lambda r: (r[0], r[1]))
    chosen = ranked[0][2]
    kind = kinds[chosen.name]
    tp, dp = _degrees(kind, chosen.plan)
    notes: list[str] = []
    wanted = global_batch or traced
    batch = -(-wanted // dp) * dp
    if batch != wanted:
        notes.append(f"the global batch {wanted} does not split over {dp} data-parallel ranks: the configs use "
                     f"{batch}, the next multiple (pass --global-batch to choose another)")
    per_rank = batch // dp
    micro = micro_batch(per_rank, dp, chosen.batch_ceiling)
    if micro == 0:
        raise PlanningError(f"{chosen.name} fits no sample per GPU within the budget")
    if global_batch and global_batch != traced:
        notes.append(f"modeled times are at the traced batch {traced}; the configs run global batch {batch}")
    for cand in comparison.baselines:
        if cand is chosen:
            verdict = f"chosen: the fastest classic plan that {'fits' if cand.fits else 'fits with accumulation'}"
        elif cand.name in reasons:
            verdict = reasons[cand.name]
        else:
            verdict = f"{cand.step_s / chosen.step_s:.2f}x the chosen step"
        rows.append(StrategyRow(cand, bound_text(cand.plan), verdict))
    column: tuple[str, ...] = ()
    row: tuple[str, ...] = ()
    container = _layer_container(graph) if graph is not None else ""
    if graph is not None and kind in (Baseline.TP, Baseline.DP_TP):
        roles: MegatronRoles = comparison.megatron
        container, column = module_names(graph, sorted(roles.column))
        row = module_names(graph, sorted(roles.row))[1]
    clip = global_norm_clip(graph) if graph is not None else None
    cluster = plan.cluster
    setup = TorchSetup(
        strategy=kind.value, label=kind.label, num_machines=cluster.num_nodes,
        processes_per_machine=cluster.devices_per_node, tensor_parallel=tp, micro_batch_per_gpu=micro,
        gradient_accumulation=per_rank // micro, mixed_precision=mixed_precision(plan), gradient_clipping=clip,
        fsdp_version=fsdp_version, layer_container=container, column_modules=column, row_modules=row,
        source=f"{source or plan.name} on {cluster.name}")
    return Advice(setup=setup, chosen=chosen.name, rows=tuple(rows), autoshard_speedup=comparison.speedup(chosen),
                  traced_batch=traced, global_batch=batch, notes=tuple(notes))
