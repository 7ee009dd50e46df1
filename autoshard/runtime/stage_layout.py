"""What a pipeline runs (``runtime/pipeline.py``): each stage's place and layouts (:class:`StageLayout`), the
step at one microbatch with the plan's stages on it (:class:`PipelineRun`), and the runtime's own options."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autoshard.ir.graph import OpGraph, Role
from autoshard.ir.spec import Spec
from autoshard.ir.split import StepParts
from autoshard.ir.stage_programs import LayerEqns
from autoshard.plans.annotations import TrainPins
from autoshard.plans.schedules import PipelineSchedule
from autoshard.plans.stage_plan import EdgePin, batch_split_spec
from autoshard.runtime.microbatch_bits import Draws
from autoshard.runtime.spmd import named_sharding


@dataclass(frozen=True)
class StageLayout:
    """Where a stage runs: a layer range and the (jax) device indices of its sub-mesh."""

    first_layer: int
    last_layer: int  # inclusive
    device_indices: tuple[int, ...]
    mesh_shape: tuple[int, ...] = ()  # the stage's logical mesh; (): one axis "dp" over its devices
    axis_names: tuple[str, ...] = ()
    param_specs: Mapping[int, Spec] = field(default_factory=dict)  # loss-argument leaf -> storage spec
    grad_specs: Mapping[int, Spec] = field(default_factory=dict)  # loss-argument leaf -> accumulator spec
    input_specs: Mapping[int, Spec] = field(default_factory=dict)  # flat step input (params, optimizer state)
    # axes splitting data and activations at the stage's boundary (``split_axes``); None: every axis (a layout
    # without a plan is data parallel)
    batch_axes: tuple[str, ...] | None = None
    recompute: bool = False  # the backward re-runs the stage's forward from its input (keeps no residuals)
    # the stage's intra-op plan per forward equation (``runtime/stage_pins.py``): the spec of each output
    # (None: not pinned) and, per input position, the layouts it is resharded through first
    op_out_specs: Mapping[int, tuple[Spec | None, ...]] = field(default_factory=dict)
    op_in_reshards: Mapping[int, Mapping[int, tuple[Spec, ...]]] = field(default_factory=dict)
    output_specs: Mapping[int, Spec] = field(default_factory=dict)  # flat step output -> its planned spec
    # activations crossing between layer plans: (forward equation, 0: an input / 1: an output, position) ->
    # (the layouts the value is pinned through going forward, those its cotangent is pinned through coming back)
    edge_pins: Mapping[tuple[int, int, int], EdgePin] = field(default_factory=dict)
    # layer -> its train-graph plan (``plans/annotations.TrainPins``): with one for every layer the stage runs
    # its layers' train graphs pinned op by op, the backward as planned; without, jax.vjp of the pinned forward
    train_pins: Mapping[int, TrainPins] = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.mesh_shape or (len(self.device_indices),)

    @property
    def names(self) -> tuple[str, ...]:
        return self.axis_names or ("dp",)

    @property
    def split_axes(self) -> tuple[str, ...]:
        """The axes the stage splits its batch leaves and boundary activations over, as the planner prices them
        and the runtime places them (``plans/stage_plan.batch_split_spec``)."""
        return self.names if self.batch_axes is None else self.batch_axes


@dataclass(frozen=True, eq=False)
class PipelineRun:
    """What a ``PipelineStep`` runs: the step at one microbatch and the plan's stages on it."""

    parts: StepParts  # the step traced at one microbatch (batch leaves cut to 1/B: ``ir/split.microbatch_shapes``)
    layers: tuple[LayerEqns, ...]  # the forward equation indices of each layer
    layouts: tuple[StageLayout, ...]  # per stage: its layer range, devices and layouts
    num_microbatches: int
    schedule: PipelineSchedule
    split_inputs: tuple[bool, ...]  # per flat step input: a batch leaf, cut into num_microbatches slices
    in_tree: Any = None  # the step's argument and output pytrees (None: called on flat lists only)
    out_tree: Any = None
    out_paths: tuple[str, ...] = ()  # the step outputs' pytree paths, for messages
    # the loss's draws over the batch each microbatch draws its slice of (``runtime/microbatch_bits.py``)
    draws: Draws | None = None


@dataclass(frozen=True)
class StepOptions:
    """How the runtime runs a pipeline, beside what the plan says."""

    recompute: bool = False  # every stage's backward re-runs its forward (keeps no residuals), whatever planned
    compiler_options: Mapping[str, Any] | None = None  # XLA options for every stage executable


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def split_leading(mesh: Mesh, shape: Sequence[int], axes: Sequence[str]) -> NamedSharding:
    """A batch leaf or an activation at a stage's boundary, as the planner priced it (``batch_split_spec``)."""
    return planned_sharding(mesh, batch_split_spec(shape, axes, dict(mesh.shape)), shape)


def planned_sharding(mesh: Mesh, spec: Spec | None, shape: Sequence[int]) -> NamedSharding:
    """A planned storage spec on the stage's mesh; replicated when none is planned or it does not divide."""
    if spec is None or spec.is_replicated or spec.rank != len(shape) or not spec.divides(shape, dict(mesh.shape)):
        return replicated(mesh)
    return named_sharding(spec, mesh)


def deliver(x: Any, where: NamedSharding) -> Any:
    """Move an activation to another stage's sharding: one split send, then, for a replicated destination,
    an all-gather inside the destination mesh (the module docstring)."""
    mesh = where.mesh
    if where.is_fully_replicated and mesh.devices.size > 1 and x.ndim >= 1 \
            and x.shape[0] % mesh.devices.size == 0 and set(x.sharding.device_set) != set(where.device_set):
        split = NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))
        return jax.device_put(jax.device_put(x, split), where)
    return jax.device_put(x, where)


def state_specs(graph: OpGraph, parts: StepParts, params: Mapping[int, Spec], grads: Mapping[int, Spec]
                 ) -> dict[int, Spec]:
    """Flat step input -> spec, for the parameters a stage holds and the optimizer state that follows them:
    an optimizer-state leaf whose pytree path ends with a parameter's path (``mu['w']`` of ``['w']``) and whose
    shape is the parameter's is stored in that parameter's gradient layout."""
    values = graph.values
    out: dict[int, Spec] = {}
    suffix: dict[tuple[str, tuple[int, ...]], Spec] = {}
    for leaf, spec in params.items():
        flat = parts.operand_inputs[leaf]
        if flat is None:
            continue
        out[flat] = spec
        value = values[graph.inputs[flat]]
        path = value.path or ""
        tail = path[path.index("]") + 1:] if path.startswith("[") and "]" in path else path
        if tail:
            suffix[tail, tuple(value.shape)] = grads.get(leaf, spec)
    for flat, vid in enumerate(graph.inputs):
        value = values[vid]
        if value.role != Role.OPT_STATE or not value.path:
            continue
        for (tail, shape), spec in suffix.items():
            if tuple(value.shape) == shape and value.path.endswith(tail):
                out[flat] = spec
                break
    return out


def output_specs(carried: Sequence[int | None], inputs: Mapping[int, Spec]) -> dict[int, Spec]:
    """Flat step output -> spec: each updated state leaf (``OpGraph.carried``) in its input's planned layout."""
    return {k: inputs[i] for k, i in enumerate(carried) if i is not None and i in inputs}
