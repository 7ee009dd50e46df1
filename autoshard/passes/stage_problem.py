"""The stage DP's input and output as plain data, and its objective written once (``evaluate_stages``).

See ``passes/stages.py`` for the objective, the constraints and the algorithm that solves it.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np

from autoshard.errors import PlanningError
from autoshard.plans.schedules import PipelineSchedule, flush_step_s

SubmeshShape: TypeAlias = tuple[int, int]  # (nodes, devices_per_node)
LayerIndex: TypeAlias = int
SubmeshIndex: TypeAlias = int
Combine: TypeAlias = Callable[[np.ndarray, np.ndarray], np.ndarray]  # np.add or np.maximum


class StageInfeasibleError(PlanningError):
    """No stage plan exists; for a memory cause it names the binding stage and bytes."""

    def __init__(self, message: str, *, stage: StageChoice | None = None, required_bytes: float | None = None,
                 smallest_budget_bytes: float | None = None) -> None:
        super().__init__(message)
        self.stage = stage                                  # the stage of the least-memory plan that binds
        self.required_bytes = required_bytes                # what that stage needs per device
        self.smallest_budget_bytes = smallest_budget_bytes  # smallest budget admitting any plan; None: none does


@dataclass(frozen=True, eq=False)
class StageProblem:
    """Cost arrays for the stage DP. L layers, K sub-mesh candidates, nB microbatch options.

    Entries with first layer > last layer are ignored. ``inf`` time means the
    stage (or transfer) is infeasible or was not computed.
    """

    num_layers: int                           # L
    submeshes: tuple[SubmeshShape, ...]       # K candidate (nodes, devices_per_node); uses nodes*devices_per_node devices
    num_devices: int                          # N, devices in the cluster
    global_batch: int                         # every microbatch option must divide it
    microbatch_options: tuple[int, ...]       # B values; axis b of the arrays indexes this tuple
    stage_time_s: np.ndarray                  # [L, L, K, nB] fwd+bwd seconds per microbatch of layers i..j on sub-mesh k
    stage_param_bytes: np.ndarray             # [L, L, K] params+grads+optimizer state per device (independent of B)
    stage_act_bytes: np.ndarray               # [L, L, K, nB] activation bytes per device per microbatch in flight
    transfer_s: np.ndarray                    # [L-1, K, K, nB] send after layer i from sub-mesh k1 to k2 (+ grad back)
    memory_budget_bytes: float = math.inf     # per device
    schedule: PipelineSchedule = "1f1b"
    cover_all: bool = True                    # stages use exactly num_devices (Alpa); False: at most num_devices
    num_stages: int | None = None             # force S
    num_microbatches: int | None = None       # force B (must be in microbatch_options)
    # [L, L, K, nB] per-device bytes one microbatch needs once, beside the in-flight ones (the temporaries
    # of a backward, a recomputed forward's residuals); None: zeros
    stage_work_bytes: np.ndarray | None = None
    # [L-1, K, nB] the send after layer i from sub-mesh k to an equal one on another node (+ grad back), for
    # placements that know which boundaries cross nodes (interleaving); None: transfer_s[i, k, k] throughout
    transfer_cross_node_s: np.ndarray | None = None
    devices_per_node: int | None = None       # None: every sub-mesh fits one node's devices

    def __post_init__(self) -> None:
        _validate(self)

    def work_bytes(self, b: int) -> np.ndarray:
        """[L, L, K] stage_work_bytes at microbatch option b (zeros when not given)."""
        if self.stage_work_bytes is None:
            return np.zeros(self.stage_param_bytes.shape)
        return self.stage_work_bytes[..., b]

    @property
    def submesh_sizes(self) -> np.ndarray:
        return np.array([n * d for n, d in self.submeshes], dtype=np.int64)


@dataclass(frozen=True)
class StageChoice:
    first_layer: LayerIndex
    last_layer: LayerIndex        # inclusive
    submesh_index: SubmeshIndex
    submesh: SubmeshShape

    def __str__(self) -> str:
        return f"L{self.first_layer}-{self.last_layer}@{self.submesh[0]}x{self.submesh[1]}"


@dataclass(frozen=True)
class StagePlan:
    stages: tuple[StageChoice, ...]
    num_microbatches: int
    schedule: PipelineSchedule
    step_time_s: float                        # sum t + sum x + (B-1) * bottleneck_s
    bottleneck_s: float                       # max over stage times and transfer times
    first_microbatch_latency_s: float         # sum t + sum x
    bubble_fraction: float                    # 1 - B * bottleneck_s / step_time_s
    stage_times_s: tuple[float, ...]          # t_s per microbatch
    transfer_times_s: tuple[float, ...]       # x_s per microbatch, S-1 of them
    per_stage_peak_bytes: tuple[float, ...]   # params + in_flight * activations, per device
    in_flight: tuple[int, ...]                # microbatches whose activations stage s holds at peak
    num_devices_used: int
    chunks: int = 1                           # interleaved: stage chunks per device group (stage s on group s mod p)

    @property
    def peak_bytes(self) -> float:
        return max(self.per_stage_peak_bytes)

    def __str__(self) -> str:
        stages = " | ".join(map(str, self.stages))
        chunks = f" ({self.chunks} chunks per device group)" if self.chunks > 1 else ""
        return (f"{len(self.stages)} stages [{stages}] B={self.num_microbatches} {self.schedule}{chunks}: "
                f"step {self.step_time_s:.4g}s (bottleneck {self.bottleneck_s:.4g}s, "
                f"bubble {self.bubble_fraction:.1%}), peak {self.peak_bytes:.4g} B/device")


def microbatch_choices(global_batch: int, max_microbatches: int | None = None) -> tuple[int, ...]:
    """The divisors of ``global_batch`` (up to ``max_microbatches``): the B values worth profiling."""
    limit = global_batch if max_microbatches is None else min(global_batch, max_microbatches)
    return tuple(b for b in range(1, limit + 1) if global_batch % b == 0)


def in_flight(schedule: PipelineSchedule, stages_from_here: int, num_microbatches: int) -> int:
    """Microbatches whose activations a stage holds at peak; ``stages_from_here`` = S - s."""
    if schedule == "gpipe":
        return num_microbatches
    return min(stages_from_here, num_microbatches)


# ---------------------------------------------------------------------------
# Evaluation: the objective, written once


def evaluate_stages(problem: StageProblem, stages: Sequence[tuple[LayerIndex, LayerIndex, SubmeshIndex]],
                    num_microbatches: int) -> StagePlan:
    """Recompute every quantity of a plan from the arrays (infeasibility shows as inf / over-budget bytes)."""
    if num_microbatches not in problem.microbatch_options:
        raise ValueError(f"B={num_microbatches} is not one of microbatch_options {problem.microbatch_options}")
    b = problem.microbatch_options.index(num_microbatches)
    expect = 0
    for i, j, k in stages:
        if i != expect or j < i or j >= problem.num_layers or not 0 <= k < len(problem.submeshes):
            raise ValueError(f"stages {list(stages)} do not partition layers 0..{problem.num_layers - 1} in order")
        expect = j + 1
    if expect != problem.num_layers:
        raise ValueError(f"stages {list(stages)} stop before layer {problem.num_layers - 1}")
    num_stages = len(stages)
    times = tuple(float(problem.stage_time_s[i, j, k, b]) for i, j, k in stages)
    transfers = tuple(float(problem.transfer_s[j, k, k2, b])
                      for (_, j, k), (_, _, k2) in zip(stages[:-1], stages[1:]))
    flights = tuple(in_flight(problem.schedule, num_stages - s, num_microbatches) for s in range(num_stages))
    work = problem.work_bytes(b)
    peaks = tuple(float(problem.stage_param_bytes[i, j, k]) + f * float(problem.stage_act_bytes[i, j, k, b])
                  + float(work[i, j, k]) for (i, j, k), f in zip(stages, flights))
    step, bottleneck, latency = flush_step_s(times, transfers, num_microbatches)
    bubble = 1.0 - num_microbatches * bottleneck / step if 0 < step < math.inf else 0.0
    return StagePlan(
        stages=tuple(StageChoice(i, j, k, problem.submeshes[k]) for i, j, k in stages),
        num_microbatches=num_microbatches, schedule=problem.schedule, step_time_s=step, bottleneck_s=bottleneck,
        first_microbatch_latency_s=latency, bubble_fraction=bubble, stage_times_s=times,
        transfer_times_s=transfers, per_stage_peak_bytes=peaks, in_flight=flights,
        num_devices_used=int(sum(problem.submesh_sizes[k] for _, _, k in stages)))


def is_admissible(problem: StageProblem, plan: StagePlan, *, check_memory: bool = True) -> bool:
    """Device count, forced S, finite times, and (optionally) memory."""
    used = plan.num_devices_used
    if used > problem.num_devices or (problem.cover_all and used != problem.num_devices):
        return False
    if problem.num_stages is not None and len(plan.stages) != problem.num_stages:
        return False
    if not math.isfinite(plan.step_time_s):
        return False
    return not check_memory or plan.peak_bytes <= problem.memory_budget_bytes


def _validate(p: StageProblem) -> None:
    num_layers, num_sub, num_b = p.num_layers, len(p.submeshes), len(p.microbatch_options)
    if num_layers < 1 or num_sub < 1 or num_b < 1:
        raise ValueError(f"need >= 1 layer, sub-mesh and microbatch option; got L={num_layers}, "
                         f"K={num_sub}, nB={num_b}")
    if any(n < 1 or d < 1 for n, d in p.submeshes):
        raise ValueError(f"sub-mesh shapes must be positive (nodes, devices_per_node); got {p.submeshes}")
    if p.num_devices < 1:
        raise ValueError(f"num_devices must be positive; got {p.num_devices}")
    bad = [b for b in p.microbatch_options if b < 1 or p.global_batch % b]
    if bad or len(set(p.microbatch_options)) != num_b:
        raise ValueError(f"microbatch_options {p.microbatch_options} must be distinct divisors of "
                         f"global_batch={p.global_batch}; bad: {bad}")
    if p.num_microbatches is not None and p.num_microbatches not in p.microbatch_options:
        raise ValueError(f"num_microbatches={p.num_microbatches} is not one of {p.microbatch_options}")
    if p.num_stages is not None and p.num_stages < 1:
        raise ValueError(f"num_stages must be positive; got {p.num_stages}")
    if p.schedule not in ("1f1b", "gpipe"):
        raise ValueError(f"schedule must be '1f1b' or 'gpipe'; got {p.schedule!r}")
    expected = {
        "stage_time_s": (num_layers, num_layers, num_sub, num_b),
        "stage_param_bytes": (num_layers, num_layers, num_sub),
        "stage_act_bytes": (num_layers, num_layers, num_sub, num_b),
        "transfer_s": (num_layers - 1, num_sub, num_sub, num_b),
    }
    if p.stage_work_bytes is not None:
        expected["stage_work_bytes"] = (num_layers, num_layers, num_sub, num_b)
    if p.transfer_cross_node_s is not None:
        expected["transfer_cross_node_s"] = (num_layers - 1, num_sub, num_b)
    for name, shape in expected.items():
        value = getattr(p, name)
        if not isinstance(value, np.ndarray) or value.shape != shape:
            got = value.shape if isinstance(value, np.ndarray) else type(value).__name__
            raise ValueError(f"{name} must be a numpy array of shape {shape} (L={num_layers}, K={num_sub}, "
                             f"nB={num_b}); got {got}")
        if np.isnan(value).any() or (value < 0).any():
            raise ValueError(f"{name} has NaN or negative entries")
