"""A chosen stage plan made concrete: each stage's layout for the runtime and the Plan that reports it.

``stage_layout`` turns the intra-op plans of a stage's layers (``passes/stage_costs.py``)
into what ``runtime/pipeline.py`` applies: the stage's logical mesh, the storage spec
of every parameter and gradient accumulator it holds, the optimizer state in the
accumulator's layout, the mesh axes its batch and activations are split over, and
whether it recomputes its forward. ``build_pipeline_plan`` writes the Plan: one
``PipelineStage`` per stage saying which intra-op plan it runs, its time and memory.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from autoshard.compiler.driver import PlannedStep
from autoshard.compiler.pipeline_context import PipelineContext, PricedPipeline, StepView
from autoshard.compiler.stage_boundaries import StageBoundaries, boundary_collectives, edge_pins
from autoshard.ir.graph import OpGraph
from autoshard.ir.spec import Spec
from autoshard.ir.split import StepParts, batch_inputs
from autoshard.ir.stage_programs import StageProgram
from autoshard.passes.hbm_traffic import compute_lower_bound_s, graph_flops_by_dtype
from autoshard.passes.stage_costs import MODES, PricedStages, lerp_microbatch
from autoshard.passes.stages import StageChoice, StagePlan
from autoshard.plans.ledger import Ledger, SolverInfo, fmt_s
from autoshard.plans.plan import Plan
from autoshard.plans.stage_plan import PipelinePlan, PipelineStage, StageMemory, batch_split_spec
from autoshard.runtime.stage_layout import StageLayout, output_specs, state_specs

COST_MODEL = ("intra-op: each distinct layer's forward + backward planned by the intra-op ILP on the stage's "
              "logical mesh (at B = 1 and B = r, linear in the microbatch between), optimizer update once per step "
              "in the gradient accumulator's layout, activation transfers both ways over the link crossed")
INTRA_STAGE = "per stage: its own intra-op plan (see each stage's intra-op line)"


def stage_layout(graph: OpGraph, parts: StepParts, programs: Sequence[StageProgram], priced: PricedStages,
                 choice: StageChoice, devices: Sequence[int], num_microbatches: int) -> StageLayout:
    """The runtime layout of one chosen stage (module docstring) in a pipeline of ``num_microbatches``."""
    k = choice.submesh_index
    variant = priced.variants[k]
    mesh = priced.meshes[priced.mesh_of[k]]
    params: dict[int, Spec] = {}
    grads: dict[int, Spec] = {}
    op_out: dict[int, tuple[Spec | None, ...]] = {}
    op_in: dict[int, dict[int, tuple[Spec, ...]]] = {}
    batch_axes: tuple[str, ...] | None = None
    for layer in range(choice.first_layer, choice.last_layer + 1):
        cost = priced.layer_cost(layer, k)
        na, npar, nd, nact = priced.groups[layer][:4]
        for p, leaf in enumerate(programs[layer].param_leaves):
            params.setdefault(leaf, cost.input_specs[na + p])
            grads.setdefault(leaf, cost.input_specs[p])
        eqns = programs[layer].eqns
        if len(cost.eqn_out_specs) == len(eqns):  # the layer class's plan, equation by equation
            for i, specs, moves in zip(eqns, cost.eqn_out_specs, cost.eqn_in_reshards):
                if specs is not None:
                    op_out.setdefault(i, specs)
                if moves:
                    op_in.setdefault(i, dict(moves))
        if batch_axes is None:
            leading = [s for s in cost.input_specs[na + npar:na + npar + nd + nact] if s.rank]
            if leading:
                batch_axes = tuple(leading[0].dims[0])
    pins = {layer: priced.layer_cost(layer, k).train_pins for layer in range(choice.first_layer, choice.last_layer + 1)}
    inputs = state_specs(graph, parts, params, grads)
    batch_axes = batch_axes if batch_axes is not None else ()
    edges = edge_pins(StageBoundaries(parts, programs, priced, choice.first_layer, choice.last_layer, k, batch_axes,
                                      num_microbatches))
    return StageLayout(choice.first_layer, choice.last_layer, tuple(devices), mesh_shape=tuple(mesh.shape),
                       axis_names=tuple(mesh.axis_names), param_specs=params, grad_specs=grads,
                       input_specs=inputs, batch_axes=batch_axes,
                       recompute=variant.recompute, op_out_specs=op_out, op_in_reshards=op_in,
                       output_specs=output_specs(graph.carried, inputs), edge_pins=edges,
                       train_pins=pins if all(p is not None for p in pins.values()) else {})


def stage_collectives(priced: PricedStages, choice: StageChoice, num_microbatches: int, last: bool,
                      boundary: tuple[Mapping[str, float], ...] = ({}, {}, {})
                      ) -> dict[str, dict[str, float]]:
    """Predicted per-device collective bytes per call of each stage executable, from its layers' plans:
    the forward's and the backward's per microbatch (the layer plans at B = 1 and B = r, linear in the
    microbatch between, as the stage times), summed over the stage's layers, plus the ``boundary`` reshards
    between them (``boundary_collectives``); the backward also runs the forward when it recomputes it or is
    the last stage's (which fuses it), one program in which a value resharded alike for readers in both
    halves is moved once (``LayerCost.fused_collectives``); the apply once per step."""
    k = choice.submesh_index
    variant = priced.variants[k]
    out: dict[str, dict[str, float]] = {"forward": dict(boundary[0]), "backward": dict(boundary[1]), "apply": {}}
    if last or variant.recompute:
        for kind, value in boundary[2].items():
            out["backward"][kind] = out["backward"].get(kind, 0.0) + value

    def add(action: str, figures: Mapping[str, float], other: Mapping[str, float]) -> None:
        for kind in set(figures) | set(other):
            value = lerp_microbatch(float(figures.get(kind, 0.0)), float(other.get(kind, 0.0)), priced.ratio,
                                    num_microbatches)
            out[action][kind] = out[action].get(kind, 0.0) + value

    for layer in range(choice.first_layer, choice.last_layer + 1):
        big, small = priced.costs[priced.layer_keys[layer], priced.mesh_of[k], MODES.index(variant.mode)]
        add("forward", big.forward_collectives, small.forward_collectives)
        if last or variant.recompute:  # the backward runs the forward too, in one program: a reshard once
            add("backward", big.fused_collectives, small.fused_collectives)
        else:
            add("backward", big.backward_collectives, small.backward_collectives)
        for kind, value in small.apply_collectives.items():
            out["apply"][kind] = out["apply"].get(kind, 0.0) + float(value)
    if last:
        out["forward"] = {}  # fused into its backward: no forward executable runs
    return {a: {kind: v for kind, v in kinds.items() if v > 0} for a, kinds in out.items()}


def device_memory(priced: PricedStages, sp: StagePlan, s: int) -> StageMemory:
    """Per-device bytes at the peak of the devices running stage s: its state, and its microbatches in flight
    times its activations plus its one-off work. Interleaved, the devices of stage s run every stage of its
    group (s mod p): their states add up, and the in-flight chunk-microbatches are priced at the group's
    largest chunk activation (as ``passes/interleave.py`` prices the plan)."""
    problem = priced.problem
    b = problem.microbatch_options.index(sp.num_microbatches)
    groups = len(sp.stages) // sp.chunks
    mine = [c for c in range(len(sp.stages)) if c % groups == s % groups] if sp.chunks > 1 else [s]
    ranges = [(sp.stages[c].first_layer, sp.stages[c].last_layer, sp.stages[c].submesh_index) for c in mine]
    state = sum(float(priced.state_bytes[i, j, k]) for i, j, k in ranges)
    grad = sum(float(priced.grad_bytes[i, j, k]) for i, j, k in ranges)
    opt = sum(float(priced.opt_bytes[i, j, k]) for i, j, k in ranges)
    act = max(float(problem.stage_act_bytes[i, j, k, b]) for i, j, k in ranges)
    work = max(float(problem.work_bytes(b)[i, j, k]) for i, j, k in ranges)
    return StageMemory(state - grad, grad, opt, sp.in_flight[s] * act + work, sp.in_flight[s])


def build_pipeline_plan(ctx: PipelineContext, view: StepView, sp: StagePlan, layouts: Sequence[StageLayout],
                        pricing: PricedPipeline, spmd: PlannedStep | None, name: str | None = None,
                        spmd_bound_s: float | None = None) -> Plan:
    """The Plan of a chosen stage plan over the step ``view`` (named ``name``, by default the context's): each
    layer's one-layer program (``pricing.programs``) lets each stage predict the reshards between its layers'
    plans (``boundary_collectives``)."""
    graph, parts, layers, priced, programs = view.graph, view.parts, ctx.layers, pricing.stages, pricing.programs
    cluster, budget, timings = ctx.target.cluster, ctx.target.memory_budget_bytes, ctx.timings
    _, split = batch_inputs(parts)
    values = graph.values
    paths = [values[v].path or f"[{i}]" for i, v in enumerate(graph.inputs)]
    shapes = {p: (values[v].shape, values[v].dtype) for p, v in zip(paths, graph.inputs)}
    problem = priced.problem
    b = problem.microbatch_options.index(sp.num_microbatches)
    stages = []
    for s, (choice, layout) in enumerate(zip(sp.stages, layouts)):
        i, j, k = choice.first_layer, choice.last_layer, choice.submesh_index
        pspecs = {paths[parts.operand_inputs[leaf]]: spec for leaf, spec in sorted(layout.param_specs.items())
                  if parts.operand_inputs[leaf] is not None}
        gspecs = {paths[parts.operand_inputs[leaf]]: spec for leaf, spec in sorted(layout.grad_specs.items())
                  if parts.operand_inputs[leaf] is not None}
        sizes = dict(zip(layout.names, layout.shape))
        bspecs = {}
        for idx, is_batch in enumerate(split):
            if is_batch:
                shape = shapes[paths[idx]][0]
                bspecs[paths[idx]] = batch_split_spec((shape[0] // sp.num_microbatches, *shape[1:]),
                                                      layout.split_axes, sizes)
        memory = device_memory(priced, sp, s)
        summaries = list(dict.fromkeys(priced.layer_cost(layer, k).summary for layer in range(i, j + 1)))
        variant = priced.variants[k]
        intra = "; ".join(summaries) + (" (lean: state pinned fully sharded)" if variant.mode == "lean" else "") + (
            "; forward recomputed in the backward" if variant.recompute else "")
        stages.append(PipelineStage(
            index=s, first_layer=i, last_layer=j, submesh=choice.submesh, device_indices=layout.device_indices,
            mesh_shape=layout.shape, axis_names=layout.names, param_specs=pspecs, batch_specs=bspecs,
            time_s=sp.stage_times_s[s], compute_s=float(priced.compute_s[i, j, k, b]),
            sync_s=float(priced.update_s[i, j, k]),
            transfer_out_s=sp.transfer_times_s[s] if s < len(sp.transfer_times_s) else 0.0,
            memory=memory, num_params=len(pspecs), intra_op=intra, recompute=variant.recompute,
            grad_specs=gspecs, state_specs={paths[f]: spec for f, spec in sorted(layout.input_specs.items())},
            op_out_specs=dict(layout.op_out_specs), op_in_reshards={i: dict(m) for i, m in layout.op_in_reshards.items()},
            edge_pins=dict(layout.edge_pins),
            train_pins=dict(layout.train_pins), batch_axes=layout.split_axes,
            collective_bytes=stage_collectives(
                priced, choice, sp.num_microbatches, s == len(sp.stages) - 1,
                boundary_collectives(StageBoundaries(parts, programs, priced, i, j, k, layout.split_axes,
                                                     sp.num_microbatches), layout.recompute,
                                     s == len(sp.stages) - 1) if programs else ({}, {}, {}))))
    times = list(sp.stage_times_s) + list(sp.transfer_times_s)
    worst = int(np.argmax(times))
    busy = sp.num_microbatches * sp.bottleneck_s
    frac = 0.0
    if worst < len(stages):
        st = stages[worst]
        frac = min(1.0, st.compute_s / st.time_s) if st.time_s > 0 else 1.0
    mem = max(stages, key=lambda st: st.memory.peak_bytes).memory
    ledger = Ledger(
        compute_s=busy * frac, comm_s=busy * (1 - frac), reshard_s=0.0, bubble_s=sp.step_time_s - busy,
        peak_memory_bytes=mem.peak_bytes,
        memory_by_kind={"param": mem.params_bytes, "grad": mem.grads_bytes, "opt_state": mem.opt_state_bytes,
                        "activation": mem.activations_bytes},
        collective_bytes={}, compute_lower_bound_s=compute_lower_bound_s(graph, cluster, cluster.num_devices),
        flops_by_dtype={d: f / cluster.num_devices for d, f in graph_flops_by_dtype(graph).items()})
    spmd_plan = spmd.plan if spmd is not None else None
    summary = PipelinePlan(
        num_microbatches=sp.num_microbatches, schedule=sp.schedule, step_s=sp.step_time_s,
        first_microbatch_latency_s=sp.first_microbatch_latency_s, bottleneck_s=sp.bottleneck_s,
        bubble_fraction=sp.bubble_fraction, layers=len(layers), cost_model=COST_MODEL, intra_stage=INTRA_STAGE,
        spmd_step_s=spmd_plan.step_s if spmd_plan is not None else None,
        spmd_mesh="x".join(map(str, spmd_plan.mesh_shape)) if spmd_plan is not None else "",
        layer_eqns=tuple(tuple(layer.eqns) for layer in layers),
        notes=(f"{priced.num_solves} layer solves for {len(set(priced.layer_keys))} distinct layers on "
               f"{len(priced.meshes)} logical meshes; {len(priced.variants)} stage variants",)
        + ((f"no SPMD-only plan beats these stages: on every mesh the ILP's bound proved each plan slower than "
            f"the stage search's {fmt_s(sp.step_time_s)} per step (the least bound {fmt_s(spmd_bound_s)}), so "
            "none was finished",)
           if spmd_bound_s is not None else ()),
        scan_layers=ctx.stack.length if ctx.stack is not None else 0)
    return Plan(
        mesh_shape=(problem.num_devices,), axis_names=("devices",), cluster=cluster,
        input_specs={p: Spec.replicated(len(shapes[p][0])) for p in paths},
        output_specs={}, input_roles={p: values[v].role.value for p, v in zip(paths, graph.inputs)},
        input_shapes=shapes, op_out_specs={}, op_in_reshards={}, ledger=ledger,
        solver=SolverInfo("stage-dp", 0.0, timings.get("stage-dp", 0.0), len(layers), len(problem.submeshes),
                          int(np.prod(problem.stage_time_s.shape)), 0, 0),
        planning_s=dict(timings), memory_budget_bytes=budget, num_ops=len(graph.ops), name=name or ctx.name,
        stages=tuple(stages), num_microbatches=sp.num_microbatches, schedule=sp.schedule,
        output_shapes={p: (values[v].shape, values[v].dtype)
                       for p, v in zip(graph.output_paths or [f"out[{k}]" for k in range(len(graph.outputs))],
                                       graph.outputs)},
        in_tree=str(graph.in_tree) if graph.in_tree is not None else "", pipeline=summary,
    )
