"""The pipeline part of a Plan: one ``PipelineStage`` per stage, and a ``PipelinePlan``.

``Plan.stages`` holds the stages (layer range, sub-mesh and its devices, the
spec of every parameter on that sub-mesh, modeled time and a memory ledger);
``Plan.pipeline`` what the runtime needs besides them (B, the schedule, each
layer's forward equations, whether the layers are a scanned stack's
iterations) and the summary (step time, first-microbatch latency, bottleneck,
bubble fraction, the SPMD plan it was compared with). All plain frozen data
with readable ``__str__`` and ``to_dict``; :func:`batch_split_spec` is the one
rule for how a stage splits a batch leaf or an activation at its boundary,
which the planner prices and the runtime applies.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from autoshard.ir.spec import Spec
from autoshard.plans.annotations import TrainPins
from autoshard.plans.breakdown import state_slots
from autoshard.plans.ledger import fmt_bytes, fmt_s
from autoshard.plans.schedules import PipelineSchedule


# an activation crossing between layer plans: the layouts it is pinned through going forward, and those its
# cotangent is pinned through coming back (on a reading equation the forward chain ends in the reader's input
# spec and the cotangent's starts in its gradient spec; on a making equation the forward chain starts in the
# maker's output spec and the cotangent's ends in its cotangent spec)
EdgePin = tuple[tuple[Spec, ...], tuple[Spec, ...]]


def batch_split_spec(shape: Sequence[int], batch_axes: Sequence[str], sizes: Mapping[str, int]) -> Spec:
    """How a pipeline stage lays out a batch leaf or an activation at its boundary: its leading (batch) dim
    split over the stage's ``batch_axes`` of size > 1 when their product divides it, else replicated. The
    planner prices the sends and reshards at the boundaries with it; the runtime places the values with it."""
    axes = tuple(a for a in batch_axes if sizes.get(a, 1) > 1)
    n = math.prod(sizes[a] for a in axes)
    if shape and n > 1 and shape[0] % n == 0:
        return Spec((axes,) + ((),) * (len(shape) - 1))
    return Spec.replicated(len(shape))


@dataclass(frozen=True)
class StageMemory:
    """Per-device bytes of one stage at its peak."""

    params_bytes: float
    grads_bytes: float  # gradient accumulators
    opt_state_bytes: float
    activations_bytes: float  # all microbatches in flight
    in_flight: int  # microbatches whose activations the stage holds at its peak

    @property
    def peak_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.opt_state_bytes + self.activations_bytes

    def __str__(self) -> str:
        return (f"peak {fmt_bytes(self.peak_bytes)} = params {fmt_bytes(self.params_bytes)} + grads "
                f"{fmt_bytes(self.grads_bytes)} + optimizer {fmt_bytes(self.opt_state_bytes)} + activations "
                f"{fmt_bytes(self.activations_bytes)} ({self.in_flight} microbatch"
                f"{'es' if self.in_flight != 1 else ''} in flight)")


@dataclass(frozen=True)
class PipelineStage:
    index: int
    first_layer: int
    last_layer: int  # inclusive
    submesh: tuple[int, int]  # (nodes, devices per node)
    device_indices: tuple[int, ...]
    mesh_shape: tuple[int, ...]  # the stage's jax mesh
    axis_names: tuple[str, ...]
    param_specs: Mapping[str, Spec]  # parameter path -> spec on the stage's mesh
    batch_specs: Mapping[str, Spec]  # batch leaf path -> spec of one microbatch on the stage's mesh
    time_s: float  # forward + backward per microbatch (once-per-step work spread over the microbatches)
    compute_s: float  # per microbatch
    sync_s: float  # once per step: gradient all-reduce + optimizer apply
    transfer_out_s: float  # activation to the next stage and its gradient back, per microbatch (0 for the last)
    memory: StageMemory
    num_params: int = 0  # parameter leaves
    intra_op: str = ""  # the stage's intra-op plan, per distinct layer (DP / FSDP / ZeRO-2 / TP / DP x TP ...)
    recompute: bool = False  # the backward recomputes the stage's forward
    grad_specs: Mapping[str, Spec] = field(default_factory=dict)  # parameter path -> its gradient accumulator's spec
    # flat step input path -> its storage spec on the stage's mesh: the parameters and the optimizer state the
    # stage's update reads and writes (older files: none; the state then follows its parameter's gradient)
    state_specs: Mapping[str, Spec] = field(default_factory=dict)
    # the stage's intra-op plan per forward equation: each output's spec (None: not pinned), and per input
    # position the layouts it is resharded through (``runtime/stage_pins.py``)
    op_out_specs: Mapping[int, tuple[Spec | None, ...]] = field(default_factory=dict)
    op_in_reshards: Mapping[int, Mapping[int, tuple[Spec, ...]]] = field(default_factory=dict)
    # activations crossing between layer plans: (equation, 0 input / 1 output, position) -> (the layouts the
    # value is pinned through going forward, those its cotangent is pinned through coming back),
    # ``runtime/stage_pins.two_way_pin``
    edge_pins: Mapping[tuple[int, int, int], EdgePin] = field(default_factory=dict)
    # predicted per-device bytes by collective kind per call of each executable: {forward|backward|apply: {kind:
    # bytes}} (forward, backward per microbatch; apply once per step); empty: not predicted
    collective_bytes: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    # layer -> its train-graph plan (``plans/annotations.TrainPins``): the stage runs its layers' train graphs
    # pinned op by op, its backward as planned (empty, older files: jax.vjp of the pinned forward)
    train_pins: Mapping[int, TrainPins] = field(default_factory=dict)
    # the axes the stage splits its batch leaves and boundary activations over (``batch_split_spec``); None
    # (older files): those its batch specs split
    batch_axes: tuple[str, ...] | None = None

    def state_slots(self) -> dict[str, dict[str, Spec]]:
        """Per parameter path, the specs of its optimizer-state leaves on this stage by slot (``{"mu": ...}``):
        a state leaf belongs to the parameter whose path, without the argument index, ends its own."""
        return state_slots(self.param_specs, self.state_specs)

    def storage(self) -> str:
        """Where the stage keeps its parameters, gradients and optimizer state, in words: "parameters
        replicated; gradients and optimizer state split"."""
        state = [s for slots in self.state_slots().values() for s in slots.values()]
        groups = (("parameters", list(self.param_specs.values())), ("gradients", list(self.grad_specs.values())),
                  ("optimizer state", state))
        words: dict[str, list[str]] = {}
        for name, specs in groups:
            if specs:
                split = sum(not s.is_replicated for s in specs)
                how = ("replicated" if not split else "split" if split == len(specs)
                       else f"split ({split} of {len(specs)})")
                words.setdefault(how, []).append(name)
        return "; ".join(f"{' and '.join(names)} {how}" for how, names in words.items())

    def __str__(self) -> str:
        devices = self.device_indices
        span = f"{devices[0]}..{devices[-1]}" if devices == tuple(range(devices[0], devices[-1] + 1)) else \
            ",".join(map(str, devices))
        return (f"stage {self.index}: layers {self.first_layer}-{self.last_layer} on {self.submesh[0]}x"
                f"{self.submesh[1]} (devices {span}) as mesh {'x'.join(map(str, self.mesh_shape))}, {self.num_params} "
                f"parameter arrays: {self.storage()}{' (' + self.intra_op + ')' if self.intra_op else ''}; "
                f"{fmt_s(self.time_s)}/microbatch (compute {fmt_s(self.compute_s)}, sync+apply "
                f"{fmt_s(self.sync_s)}/step), send {fmt_s(self.transfer_out_s)}; {self.memory}")

    def collectives_per_step(self, num_microbatches: int) -> dict[str, float]:
        """Predicted per-device bytes by collective kind over one step: forward and backward once per
        microbatch, apply once (empty: not predicted)."""
        total: dict[str, float] = {}
        for action, kinds in self.collective_bytes.items():
            times = 1 if action == "apply" else num_microbatches
            for kind, nbytes in kinds.items():
                total[kind] = total.get(kind, 0.0) + times * float(nbytes)
        return total

    def to_dict(self) -> dict[str, Any]:
        data = asdict(dataclasses.replace(self, train_pins={}))
        data["train_pins"] = {layer: pins.key for layer, pins in self.train_pins.items()}  # the plans: plan files
        data["param_specs"] = {k: str(v) for k, v in self.param_specs.items()}
        data["batch_specs"] = {k: str(v) for k, v in self.batch_specs.items()}
        data["state_specs"] = {k: str(v) for k, v in self.state_specs.items()}
        data["op_out_specs"] = {k: [str(s) if s is not None else None for s in v] for k, v in self.op_out_specs.items()}
        data["edge_pins"] = {":".join(map(str, k)): {"forward": [str(s) for s in a], "backward": [str(s) for s in b]}
                             for k, (a, b) in self.edge_pins.items()}
        data["op_in_reshards"] = {k: {p: [str(s) for s in c] for p, c in v.items()} for k, v in self.op_in_reshards.items()}
        return data


@dataclass(frozen=True)
class PipelinePlan:
    num_microbatches: int
    schedule: PipelineSchedule
    step_s: float  # modeled: sum t + sum x + (B - 1) * bottleneck
    first_microbatch_latency_s: float  # sum t + sum x
    bottleneck_s: float  # the slowest stage or transfer, per microbatch
    bubble_fraction: float
    layers: int  # L, the layers the DP grouped into stages
    cost_model: str  # how stage times were priced
    intra_stage: str  # how each stage is sharded inside its sub-mesh
    spmd_step_s: float | None = None  # the best SPMD-only plan it was compared with (None: not compared)
    spmd_mesh: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)
    # the forward equation indices of each layer (``ir/split.py``): what the runtime runs in each stage
    layer_eqns: tuple[tuple[int, ...], ...] = ()
    # > 0: the layers are the iterations of a scanned stack of that many layers, the forward rewritten per
    # iteration (``ir/scan_stack.py``); ``layer_eqns`` index that rewrite (``runtime/applied_scan.py``)
    scan_layers: int = 0

    @property
    def scanned(self) -> bool:
        """Whether the layers are the iterations of a scanned stack (the runtime scans each stage's range)."""
        return self.scan_layers > 0

    def __str__(self) -> str:
        line = (f"pipeline          {self.schedule}, B={self.num_microbatches} microbatches over {self.layers} "
                f"layers: step {fmt_s(self.step_s)}, first microbatch {fmt_s(self.first_microbatch_latency_s)}, "
                f"bottleneck {fmt_s(self.bottleneck_s)}/microbatch, bubble {self.bubble_fraction:.1%}")
        if self.spmd_step_s is not None:
            line += f"; best SPMD-only plan ({self.spmd_mesh}) {fmt_s(self.spmd_step_s)}"
        return line

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
