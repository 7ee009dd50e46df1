"""Check a pipeline plan against what XLA compiled, stage by stage (``compiler/verify.py`` for SPMD plans).

A pipeline runs one forward, backward and apply-update executable per stage
(``runtime/pipeline_lower.py``). For each executable the plan predicts the
per-device bytes of every collective kind it runs per call (per microbatch;
the apply once per step); for each stage, its per-device peak memory
(``PipelineStage.memory``: parameters, gradient accumulators, optimizer state
and the activations of the microbatches in flight).

Predicted collectives come from the stage: a stage planned with its own
intra-op plan carries per-executable figures (``collective_bytes``: {action:
{kind: bytes}}, ``compiler/pipeline_plan.stage_collectives``: its layer plans'
forward and backward collectives per microbatch summed over its layers, the
reshards between those plans and at its boundaries, the apply's once per
step), taken at their word. A stage that runs its layers' train graphs
(``runtime/stage_train.py``) pins every op of its forward and its backward, so
both are checked; one on the ``jax.vjp`` path (a plan file without train-graph
pins) pins its forward only, and its backward's figure is shown as an estimate,
not checked; a stage without an intra-op plan is data
parallel, and its backward all-reduces the gradient of every parameter it
holds whole when the stage's batch is split over more than one device. A
stage with an intra-op plan but no figures (a plan file written before they
were recorded) is not compared, and the report says so in ``notes``.

The compiled stage peak is composed from ``memory_analysis()`` of the stage's
executables, as the runtime holds their buffers: the apply executable's
arguments (parameters, accumulated gradients, optimizer state), plus the
per-microbatch activations in flight (what the runtime keeps from the forward: its residuals, or on the
``jax.vjp`` path all its outputs; for the last
stage, whose forward runs inside its backward, the backward's activation
inputs) times the stage's in-flight count, plus the largest temporary buffer of
the forward and backward. Tolerances are verify.py's.

``compiled_pipeline_price`` prices the step from those executables, as ``verify.compiled_price`` prices an
SPMD program: each executable's FLOPs, bytes accessed and HLO collectives on its stage's devices, stage s
taking forward + backward + apply / B per microbatch (the stage DP's own split,
``passes/stage_costs.price_stage_variants``), composed by the plan's schedule with the formula the stage DP
optimised (``plans/schedules.flush_step_s``, ``interleaved_step_s``). The sends between stages run in no
executable: they keep the plan's price.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from autoshard.compiler.hlo import CompiledSummary, summarize_compiled
from autoshard.compiler.verify import (MEMORY_IMMATERIAL_BYTES, MEMORY_TOLERANCE, CompiledPrice, FidelityRow,
                                       FidelityRows, collective_rows, price_summary, seconds_per_flop)
from autoshard.meshes.logical import make_logical_mesh
from autoshard.plans.ledger import fmt_s
from autoshard.plans.plan import Plan
from autoshard.plans.schedules import flush_step_s, interleaved_step_s
from autoshard.runtime.pipeline_lower import PipelineCompiled

ACTIONS = ("forward", "backward", "apply")


@dataclass(frozen=True)
class PipelineFidelityReport(FidelityRows):
    """Per stage executable, predicted vs compiled; ``rows`` flat, named ``stage s action figure``."""

    rows: tuple[FidelityRow, ...]
    summaries: Mapping[str, CompiledSummary]  # executable name -> what XLA compiled
    notes: tuple[str, ...] = ()  # what was not compared, and why

    def __str__(self) -> str:
        return "\n".join(self.text_lines(40) + list(self.notes))


def _itemsize(dtype: str) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        return 4


def predicted_collectives(plan: Plan, stage: Any) -> dict[str, dict[str, float]] | None:
    """{action: {collective kind: per-device bytes per call}} of one stage, or None when the stage runs a
    sharded intra-op plan that carries no figures of its own (module docstring)."""
    own = getattr(stage, "collective_bytes", None)
    if isinstance(own, Mapping) and own:
        return {a: {k: float(v) for k, v in own.get(a, {}).items()} for a in ACTIONS}
    if getattr(stage, "intra_op", ""):
        return None  # an intra-op stage plan: XLA's collectives follow it, not the data-parallel rule
    sizes = dict(zip(stage.axis_names, stage.mesh_shape))
    batch_axes = {ax for spec in stage.batch_specs.values() for ax in (spec.dims[0] if spec.dims else ())}
    split = int(np.prod([sizes[a] for a in batch_axes])) if batch_axes else 1
    grads = 0.0
    if split > 1:
        for path, spec in stage.param_specs.items():
            shape, dtype = plan.input_shapes[path]
            held = {ax for dim in spec.dims for ax in dim}
            if held & batch_axes:
                continue  # sharded over the batch axes: not an all-reduce (a stage plan says what it is)
            shards = int(np.prod([sizes[a] for a in held])) if held else 1
            grads += float(np.prod(shape, dtype=np.int64)) * _itemsize(dtype) / shards
    return {"forward": {}, "backward": {"all-reduce": grads} if grads else {}, "apply": {}}


def _activation_input_bytes(compiled: Any) -> float:
    """Per-device bytes of the activation arguments of a last-stage backward ``(params, data, acts, acc, loss)``."""
    infos, shardings = compiled.args_info[0][2], compiled.input_shardings[0][2]
    return float(sum(np.prod(sh.shard_shape(tuple(info.shape)), dtype=np.int64) * np.dtype(info.dtype).itemsize
                     for info, sh in zip(infos, shardings)))


def verify_pipeline(plan: Plan, compiled: PipelineCompiled) -> PipelineFidelityReport:
    """Compare a pipeline ``plan`` with its compiled stage executables (``step.lower(*args).compile()``)."""
    summaries: dict[str, CompiledSummary] = {}
    by_stage: dict[int, dict[str, tuple[Any, CompiledSummary]]] = {}
    for exe, comp in compiled:
        summary = summarize_compiled(comp)
        summaries[exe.name] = summary
        by_stage.setdefault(exe.stage, {})[exe.action] = (comp, summary, exe)
    rows: list[FidelityRow] = []
    notes: list[str] = []
    last = len(plan.stages) - 1
    parts: dict[int, tuple[float, float, float]] = {}  # per stage: state held, bytes per microbatch, temporaries
    for stage in plan.stages:
        got = by_stage.get(stage.index, {})
        predicted = predicted_collectives(plan, stage)
        if predicted is None:
            compiled_bytes = sum(float(sum(got[a][1].bytes_by_kind.values())) for a in ACTIONS if a in got)
            notes.append(f"stage {stage.index}: collectives not predicted (it runs its own intra-op plan: "
                         f"{stage.intra_op}, with no per-executable figures: re-plan to record them); "
                         f"compiled: {compiled_bytes:,.0f} bytes per device over its executables")
        for action in ACTIONS:
            if action in got and predicted is not None:
                # a stage running its train graphs pins every op, its backward's too; one on the jax.vjp path
                # pins its forward equations only and XLA places the backward's collectives: an estimate there
                estimate = action == "backward" and bool(getattr(stage, "intra_op", "")) \
                    and not got[action][2].pinned_per_op
                rows += collective_rows(predicted[action], got[action][1].bytes_by_kind,
                                        f"stage {stage.index} {action} ", checked=not estimate)
                if estimate:
                    notes.append(f"stage {stage.index} backward: its collectives are an estimate, not checked (the "
                                 "stage runs jax.vjp of its pinned forward, its plan carries no train-graph pins: "
                                 "re-plan to record them)")
        held = float(got["apply"][1].argument_bytes) if "apply" in got else 0.0
        if stage.index == last:
            per_mb = _activation_input_bytes(got["backward"][0])
        else:
            exe = got["forward"][2]
            per_mb = exe.kept_bytes if exe.kept_bytes > 0 else float(got["forward"][1].output_bytes)
        temp = max(float(got[a][1].temp_bytes) for a in ("forward", "backward") if a in got)
        parts[stage.index] = (held, per_mb, temp)
    # the devices of a stage hold every stage placed on them (interleaved: its device group's): their
    # states, the in-flight microbatches at the largest of their activations, the largest temporaries
    for stage in plan.stages:
        if stage.index not in parts:
            continue
        mine = [parts[st.index] for st in plan.stages
                if tuple(st.device_indices) == tuple(stage.device_indices) and st.index in parts]
        compiled_peak = (sum(h for h, _, _ in mine) + stage.memory.in_flight * max(p for _, p, _ in mine)
                         + max(t for _, _, t in mine))
        rows.append(FidelityRow(f"stage {stage.index} peak memory bytes", float(stage.memory.peak_bytes),
                                compiled_peak, MEMORY_TOLERANCE, MEMORY_IMMATERIAL_BYTES))
    return PipelineFidelityReport(tuple(rows), summaries, tuple(notes))


@dataclass(frozen=True)
class PipelinePrice:
    """A pipeline plan's step priced from its compiled stage executables (``compiled_pipeline_price``)."""

    executables: Mapping[str, CompiledPrice]  # "stage s forward" -> one call's price
    stage_s: tuple[float, ...]  # per stage, per microbatch: forward + backward + apply / B
    modeled_stage_s: tuple[float, ...]  # the plan's figure for the same (``PipelineStage.time_s``)
    transfer_s: tuple[float, ...]  # between consecutive stages, per microbatch: the plan's (module docstring)
    step_s: float
    modeled_step_s: float
    busy_compute_s: float  # over one step, on the busiest device group: its executables' compute
    busy_collectives_s: float  # ... and their collectives
    cross_node_collectives: int  # collectives run per step (every executable, its calls) whose groups span nodes

    @property
    def busy_s(self) -> float:
        return self.busy_compute_s + self.busy_collectives_s

    @property
    def bubble_s(self) -> float:
        """What the busiest device group waits over a step: fill, drain, and the transfers."""
        return self.step_s - self.busy_s

    @property
    def error(self) -> float:
        """(modeled - compiled) / compiled step."""
        return (self.modeled_step_s - self.step_s) / self.step_s if self.step_s > 0 else float("nan")

    def __str__(self) -> str:
        lines = [f"pipeline step: compiled {fmt_s(self.step_s)} (busiest devices: compute "
                 f"{fmt_s(self.busy_compute_s)} + collectives {fmt_s(self.busy_collectives_s)}, waiting "
                 f"{fmt_s(self.bubble_s)}), modeled {fmt_s(self.modeled_step_s)} ({self.error:+.1%})"]
        for s, (got, want) in enumerate(zip(self.stage_s, self.modeled_stage_s)):
            lines.append(f"  stage {s}: {fmt_s(got)} per microbatch compiled, {fmt_s(want)} modeled")
        return "\n".join(lines)


def compiled_pipeline_price(plan: Plan, compiled: PipelineCompiled) -> PipelinePrice:
    """What a pipeline ``plan``'s step costs on ``plan.cluster``, from its compiled stage executables (module
    docstring)."""
    if plan.pipeline is None or not plan.stages:
        raise ValueError(f"{plan.name} is an SPMD plan: price its one program with verify.compiled_price")
    b = plan.pipeline.num_microbatches
    per_flop = seconds_per_flop(plan)
    stages = {st.index: st for st in plan.stages}
    meshes = {i: make_logical_mesh(plan.cluster, tuple(st.mesh_shape), tuple(st.axis_names),
                                   tuple(st.device_indices)) for i, st in stages.items()}
    prices: dict[str, CompiledPrice] = {}
    per_step: dict[int, list[tuple[int, CompiledPrice]]] = {i: [] for i in stages}  # stage -> (calls, price)
    for exe, comp in compiled:
        price = price_summary(summarize_compiled(comp), meshes[exe.stage], per_flop)
        prices[exe.name] = price
        per_step[exe.stage].append((1 if exe.action == "apply" else b, price))
    order = sorted(stages)
    times = tuple(sum(calls * p.step_s for calls, p in per_step[i]) / b for i in order)
    transfers = tuple(stages[i].transfer_out_s for i in order[:-1])
    groups: dict[tuple[int, ...], list[int]] = {}
    for i in order:
        groups.setdefault(tuple(stages[i].device_indices), []).append(i)
    if plan.pipeline.schedule == "interleaved":
        step, _ = interleaved_step_s(times, transfers, b, len(groups))
    else:
        step, _, _ = flush_step_s(times, transfers, b)
    busy = [(sum(calls * p.compute_s for i in members for calls, p in per_step[i]),
             sum(calls * p.collectives_s for i in members for calls, p in per_step[i])) for members in groups.values()]
    compute, collectives = max(busy, key=sum)
    crossing = sum(calls * p.cross_node_collectives for i in order for calls, p in per_step[i])
    return PipelinePrice(prices, times, tuple(stages[i].time_s for i in order), transfers, step,
                         plan.pipeline.step_s, compute, collectives, crossing)
