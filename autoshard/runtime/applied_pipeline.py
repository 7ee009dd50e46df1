"""Run a pipeline Plan on a set of devices: ``autoshard.apply(plan, fn, mesh)`` for a plan with stages.

The plan holds what the runtime needs besides the step itself: each stage's
layer range and device indices (``Plan.stages``), the forward equations of each
layer (``PipelinePlan.layer_eqns``), the microbatch count and the schedule.
``AppliedPipeline`` traces ``fn`` on its first call, checks the trace against
the plan (argument paths, shapes and dtypes, operation count, the layers'
equations and each stage's parameters) and builds the stage executables; the
plan's device index i is the mesh's i-th device (``mesh.devices.flat``), so
the same plan runs on another device order.

A mismatch raises ``PlanMismatchError`` saying what differs.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from autoshard.errors import PlanMismatchError
from autoshard.ir.graph import OpGraph
from autoshard.ir.spec import Spec
from autoshard.ir.split import StepParts, split_step
from autoshard.ir.step_trace import TracedStep
from autoshard.ir.trace import signature, trace
from autoshard.plans.plan import Plan
from autoshard.plans.planfile import check_args, check_signature
from autoshard.plans.stage_plan import PipelineStage
from autoshard.runtime.microbatch_bits import per_microbatch
from autoshard.runtime.pipeline import PipelineStep
from autoshard.runtime.pipeline_lower import PipelineLowered, lower_pipeline
from autoshard.runtime.stage_layout import PipelineRun, StageLayout, StepOptions, output_specs, state_specs


def stage_layouts(plan: Plan, graph: OpGraph | None = None, parts: StepParts | None = None
                  ) -> tuple[StageLayout, ...]:
    """The runtime's view of the plan's stages: each stage's logical mesh, recomputation, the parameter and
    gradient-accumulator layouts the file records (older files: gradients in the parameter's layout), the
    optimizer-state layouts it records (older files: the state follows its parameter's gradient as the
    planner lays it out, ``state_specs``), the per-equation specs of its intra-op plan, the updated state
    written back in those layouts, and the axes its batch specs split."""
    leaf_of: dict[str, int] = {}
    flat_of: dict[str, int] = {}
    if graph is not None and parts is not None:
        paths = [graph.values[v].path for v in graph.inputs]
        leaf_of = {paths[src]: k for k, src in enumerate(parts.operand_inputs) if src is not None}
        flat_of = {path: i for i, path in enumerate(paths) if path is not None}
    out = []
    for st in plan.stages:
        if not isinstance(st, PipelineStage):
            raise PlanMismatchError(f"the pipeline plan's stage {len(out)} is not a pipeline stage ({st!r}): plan again")
        params = {leaf_of[path]: spec for path, spec in st.param_specs.items() if path in leaf_of}
        grads = {**params, **{leaf_of[path]: spec for path, spec in st.grad_specs.items() if path in leaf_of}}
        batch = [spec for spec in st.batch_specs.values() if spec.rank]
        recorded = st.state_specs
        if graph is None or parts is None:
            inputs: dict[int, Spec] = {}
        elif recorded:  # the plan's own optimizer-state layouts
            inputs = {flat_of[path]: spec for path, spec in recorded.items() if path in flat_of}
        else:  # an older file: the state follows its parameter's gradient, as the planner lays it out
            inputs = state_specs(graph, parts, params, grads)
        if st.batch_axes is not None:
            axes: tuple[str, ...] | None = st.batch_axes
        else:  # an older file: the axes its batch specs split
            axes = tuple(batch[0].dims[0]) if batch else None
        out.append(StageLayout(st.first_layer, st.last_layer, tuple(st.device_indices),
                               mesh_shape=tuple(st.mesh_shape), axis_names=tuple(st.axis_names),
                               param_specs=params, grad_specs=grads, input_specs=inputs, batch_axes=axes,
                               recompute=st.recompute, op_out_specs=dict(st.op_out_specs),
                               op_in_reshards=dict(st.op_in_reshards), edge_pins=dict(st.edge_pins),
                               train_pins=dict(st.train_pins),
                               output_specs=output_specs(graph.carried, inputs) if graph is not None else {}))
    return tuple(out)


def pipeline_devices(plan: Plan, mesh: Mesh | Sequence[jax.Device]) -> list[jax.Device]:
    """The devices a pipeline plan's device indices name: ``mesh.devices.flat`` (or the sequence) in order."""
    devices = list(mesh.devices.flat) if isinstance(mesh, Mesh) else list(mesh)
    needed = max((i for st in plan.stages for i in st.device_indices), default=-1) + 1
    if len(devices) < needed:
        raise PlanMismatchError(f"the pipeline plan's stages use device indices up to {needed - 1}; the mesh has "
                                f"{len(devices)} device(s): pass a mesh of at least {needed}")
    return devices


def check_pipeline(plan: Plan, graph: OpGraph, parts: StepParts | None) -> None:
    """Raise PlanMismatchError when the traced step is not the one the pipeline plan was made for."""
    check_signature(plan, graph)
    if parts is None:
        raise PlanMismatchError("the plan is a pipeline but the step has no autoshard.value_and_grad/grad marker: "
                                "mark the loss as when it was planned, or plan again")
    layer_eqns = plan.pipeline.layer_eqns if plan.pipeline is not None else ()
    if not layer_eqns:
        raise PlanMismatchError("the pipeline plan records no layer equations (written by an older autoshard): "
                                "plan again to apply it")
    problems = []
    num_eqns = len(parts.forward.eqns)
    free = {i for i, f in enumerate(parts.forward.free) if f}
    planned = [i for eqns in layer_eqns for i in eqns]
    if any(i >= num_eqns for i in planned) or sorted(planned) != [i for i in range(num_eqns) if i not in free]:
        problems.append(f"the loss forward has {num_eqns} equations ({num_eqns - len(free)} in layers); the plan's "
                        f"{len(layer_eqns)} layers hold {len(planned)}")
    if not problems:
        paths = [graph.values[v].path for v in graph.inputs]
        for st in plan.stages:
            eqns = [i for eqns in layer_eqns[st.first_layer: st.last_layer + 1] for i in eqns]
            reads = {a for i in eqns for a in parts.forward.eqns[i].ins if not hasattr(a, "val")}
            leaves = {k for k, (v, d) in enumerate(zip(parts.forward.invars, parts.forward.diff)) if d and v in reads}
            got = {paths[parts.operand_inputs[k]] for k in leaves if parts.operand_inputs[k] is not None}
            want = set(st.param_specs)
            if got != want:
                problems.append(f"stage {st.index} (layers {st.first_layer}-{st.last_layer}) reads parameters "
                                f"{sorted(got - want)[:4]} the plan does not give it, and not "
                                f"{sorted(want - got)[:4]} that it does")
    if problems:
        raise PlanMismatchError("the pipeline plan does not match this train step (plan again for the changed "
                                "model):\n  " + "\n  ".join(problems))


def traced_step(fn: Callable[..., Any], args: Sequence[Any]) -> tuple[OpGraph, StepParts | None]:
    """``fn`` traced at the shapes of ``args`` and taken apart at its marker (None: it has none)."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.numpy.result_type(x)), tuple(args))
    graph = trace(fn, *shapes)
    return graph, split_step(graph.jaxpr)


def microbatch_parts(plan: Plan, traced: TracedStep) -> StepParts:
    """The step at the plan's microbatch (traced once: the planner's trace when it priced that microbatch)."""
    small = traced.at_microbatches(int(plan.num_microbatches))
    if small is None:
        raise PlanMismatchError(f"the loss traces to different equations at the microbatch size (batch / "
                                f"{plan.num_microbatches}); a pipeline needs shape-independent loss code")
    return small


def pipeline_run(plan: Plan, traced: TracedStep) -> PipelineRun:
    """The plan's stages on the step at one microbatch: what a PipelineStep runs. Each microbatch draws its
    slice of the whole batch's random bits (``runtime/microbatch_bits.py``)."""
    assert plan.pipeline is not None
    small, draws = per_microbatch(traced.parts, microbatch_parts(plan, traced), int(plan.num_microbatches))
    graph = traced.graph
    return PipelineRun(small, plan.pipeline.layer_eqns, stage_layouts(plan, graph, small),
                       int(plan.num_microbatches), plan.pipeline.schedule, traced.split_inputs, graph.in_tree,
                       graph.out_tree, graph.output_paths, draws)


class AppliedPipeline:
    """A callable running ``fn`` as ``plan``'s pipeline on the devices of ``mesh``.

    ``traced``: the step already traced (the planner's traces, ``ir/step_trace.py``): nothing is traced again
    but, when the planner priced another microbatch, the step at the plan's."""

    def __init__(self, plan: Plan, fn: Callable[..., Any], mesh: Mesh | Sequence[jax.Device], *,
                 options: StepOptions = StepOptions(), traced: TracedStep | None = None) -> None:
        self.plan, self.fn, self.options, self.traced = plan, fn, options, traced
        self.devices = pipeline_devices(plan, mesh)
        self.step: PipelineStep | None = None
        self.called_with: Any = None

    def _traced(self, args: Sequence[Any] | None) -> TracedStep:
        """The step traced at the shapes of ``args`` and checked against the plan (or the one given)."""
        if self.traced is not None:
            check_pipeline(self.plan, self.traced.graph, self.traced.parts)
            return self.traced
        if args is None:
            raise ValueError("the pipeline has not been traced yet: call it, or prepare(args), with the step's arguments")
        graph, parts = traced_step(self.fn, args)
        check_pipeline(self.plan, graph, parts)
        assert parts is not None
        return TracedStep.of(self.fn, args, graph, parts)

    def prepare(self, args: tuple[Any, ...] | None = None) -> PipelineStep:
        """Trace ``fn`` at the shapes of ``args`` (unless it was given traced), check it against the plan, build
        the stages (once); a later call with other shapes raises PlanMismatchError naming them."""
        if self.step is None:
            traced = self._traced(args)
            self.step = PipelineStep(pipeline_run(self.plan, traced), self.devices, self.options)
            self.called_with = signature(tuple(args) if args is not None else traced.args)
        elif args is not None and signature(args) != self.called_with:
            check_args(self.plan, args)
        return self.step

    def __call__(self, *args: Any) -> Any:
        return self.prepare(args)(*args)

    def lower(self, *args: Any) -> PipelineLowered:
        """The stage executables, lowered (``.compile()`` compiles each)."""
        return lower_pipeline(self.prepare(args))
