"""Pipelines over a scanned layer stack: the scan's iterations are the layers, each stage scans its own range.

``plan_pipeline`` hands a step here when its loss runs a layer stack under ``lax.scan`` / ``nnx.scan`` /
``nn.scan`` (``ir/scan_stack.find_stack``). Nothing to mark: the usual ``autoshard.value_and_grad`` and
``num_stages`` / ``autoshard plan --stages N`` are enough.

- **Pricing**: the step is rewritten with the stack cut into its N iterations (``split_stack`` at bounds
  ``0, 1, ..., N``, each a one-iteration ``scan`` over its own slices of the stacked parameters), and a
  cut marked after every iteration but the last, so the layers are: the ops before the scan with
  iteration 0, iterations 1 .. N-2, iteration N-1 with the ops after it. The middle iterations have one
  structure hash: the intra-op ILP solves the scan body once per (sub-mesh, logical mesh, microbatch)
  and every range reuses it (``passes/stage_costs.py``). The stage DP is unchanged.
- **Runtime**: the step traced at the microbatch is rewritten again with one chunk per stage (the
  iteration range of its layers): stage s runs a ``scan`` over its own ``[lo, hi)`` (a loop, not
  unrolled), holds only those rows of every stacked parameter, gradient accumulator and optimizer
  state (Adam's moments are split with them when the update reads them row-wise), and updates them.
  :class:`ScanPipelineStep` slices the user's stacked arrays before each step and concatenates the
  stacked outputs (parameters, optimizer state) after it on the first stage's devices, so the step
  returns what the user's step returns.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from autoshard.compiler.driver import PlannedStep, Progress, plan_on
from autoshard.compiler.pipeline_pricing import STAGE_TIME_LIMIT_S, PipelinePlanned, finish_pipeline, price_pipeline, \
    trace_at
from autoshard.compiler.target import Target
from autoshard.errors import InfeasibleMemoryError, PlanningError
from autoshard.ir.graph import OpGraph
from autoshard.ir.scan_stack import ScanStack, StackSplit, find_stack, split_stack
from autoshard.ir.split import StepParts, batch_inputs, microbatch_shapes, split_step
from autoshard.ir.trace import trace
from autoshard.passes.intra_op import IntraOpOptions
from autoshard.passes.layers import Layer, cluster_layers
from autoshard.passes.stage_costs import StageCostOptions
from autoshard.passes.stages import StageInfeasibleError, solve_stages
from autoshard.runtime.pipeline import PipelineError, PipelineStep, StageLayout


def per_layer(parts: StepParts) -> StackSplit:
    """``parts`` with its layer stack cut into single iterations, a layer cut marked between them."""
    stack = find_stack(parts.forward)
    if stack is None:
        raise PlanningError("internal: the step traced at the microbatch has no layer scan")
    return split_stack(parts, stack, range(stack.length + 1), mark_cuts=True)


def stacked_function(fn: Callable[..., Any], in_tree: Any, out_tree: Any, split: StackSplit) -> Callable[..., Any]:
    """``fn`` over the rewritten step's inputs (each stacked leaf a tuple of its chunks) and outputs: the graph the
    plan reports (paths such as ``[0]['blocks']['mlp']['kernel'][2]``: chunk 2)."""
    num_inputs = in_tree.num_leaves

    def run(*vargs: Any) -> Any:
        vflat = jax.tree_util.tree_leaves(vargs)
        user: list[list[Any]] = [[] for _ in range(num_inputs)]
        for (i, _c), x in zip(split.inputs, vflat):
            user[i].append(x)
        flat = [xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=0) for xs in user]
        outs = jax.tree_util.tree_leaves(fn(*jax.tree_util.tree_unflatten(in_tree, flat)))
        leaves = []
        for k, out in enumerate(outs):
            chunks = [c for kk, c in split.outputs if kk == k]
            b = split.bounds
            leaves.append(out if chunks == [None] else tuple(out[b[c]:b[c + 1]] for c in chunks))
        return jax.tree_util.tree_unflatten(out_tree, leaves)

    return run


def stacked_args(arg_leaves: Sequence[Any], in_tree: Any, split: StackSplit) -> tuple[Any, ...]:
    """The user's arguments (ShapeDtypeStructs or arrays) with each split leaf a tuple of its chunk shapes."""
    leaves = []
    for i, leaf in enumerate(arg_leaves):
        chunks = [c for ii, c in split.inputs if ii == i]
        if chunks == [None]:
            leaves.append(leaf)
            continue
        shape, dtype = tuple(jnp.shape(leaf)), jnp.result_type(leaf)
        leaves.append(tuple(jax.ShapeDtypeStruct((split.bounds[c + 1] - split.bounds[c], *shape[1:]), dtype)
                            for c in chunks))
    return tuple(jax.tree_util.tree_unflatten(in_tree, leaves))


def plan_scanned(fn: Callable[..., Any], args: Sequence[Any], graph: OpGraph, parts: StepParts, stack: ScanStack,
                 target: Target, timings: dict[str, float], *, name: str, num_stages: int | None,
                 num_microbatches: int | None, schedule: str, options: IntraOpOptions | None,
                 num_layers: int | None, keep_both: bool, progress: Progress | None) -> Any:
    """``plan_pipeline`` for a step with a scanned layer stack (module docstring)."""
    say = progress or (lambda _line: None)
    if schedule not in ("1f1b", "gpipe"):
        raise PlanningError(f"schedule must be '1f1b' or 'gpipe'; got {schedule!r}")
    if num_stages is not None and num_stages > stack.length + 1:
        raise PlanningError(f"num_stages={num_stages} but the layer scan has only {stack.length} iterations; a "
                            "scanned stack is cut between iterations: ask for at most "
                            f"{stack.length} stages")
    t0 = time.perf_counter()
    pricing = per_layer(parts)
    layers = cluster_layers(pricing.parts.forward, num_layers)
    timings["layers"] = time.perf_counter() - t0
    say(f"pricing pipeline stages ({len(layers)} layers, {stack.length} of them scanned)")
    t0 = time.perf_counter()
    cost_options = StageCostOptions(
        schedule=schedule, num_stages=num_stages, num_microbatches=num_microbatches,
        memory_budget_bytes=target.memory_budget_bytes, min_stages=2 if num_stages is None else 1,
        time_limit_s=min(STAGE_TIME_LIMIT_S, (options or IntraOpOptions()).time_limit_s))
    priced, programs = price_pipeline(fn, args, graph, pricing.parts, layers, cost_options, target.cluster,
                                      target.num_devices, progress=say, prepare=lambda p: per_layer(p).parts)
    timings["pricing"] = time.perf_counter() - t0
    spmd: PlannedStep | None = None
    if num_stages is None:
        t0 = time.perf_counter()
        try:
            spmd = plan_on(graph, target, options, timings=dict(timings), name=name, progress=progress)
        except InfeasibleMemoryError:
            spmd = None
        timings["spmd"] = time.perf_counter() - t0
    say("choosing pipeline stages")
    t0 = time.perf_counter()
    try:
        stage_plan = solve_stages(priced.problem)
    except StageInfeasibleError:
        if spmd is not None:
            return spmd
        raise
    timings["stage-dp"] = time.perf_counter() - t0
    if spmd is not None and spmd.plan.step_s <= stage_plan.step_time_s and not keep_both:
        return spmd
    in_leaves = jax.tree_util.tree_leaves(tuple(args))
    vfn = stacked_function(fn, graph.in_tree, graph.out_tree, pricing)
    vargs = stacked_args(in_leaves, graph.in_tree, pricing)
    vgraph = trace(vfn, *vargs)
    piped = finish_pipeline(vfn, vargs, vgraph, pricing.parts, layers, stage_plan, priced, programs, target,
                            timings, name, spmd)
    _, user_split = batch_inputs(parts)
    scanned = ScanPipelinePlanned(**{f.name: getattr(piped, f.name) for f in dataclasses.fields(piped)},
                                  user_fn=fn, user_arg_leaves=tuple(in_leaves), user_in_tree=graph.in_tree,
                                  user_out_tree=graph.out_tree, user_split=user_split, stack_length=stack.length,
                                  stage_iterations=tuple(stage_bounds(pricing, layers, [
                                      (st.first_layer, st.last_layer) for st in stage_plan.stages])))
    return (scanned, spmd) if keep_both else scanned


def stage_bounds(pricing: StackSplit, layers: Sequence[Layer], ranges: Sequence[tuple[int, int]]
                 ) -> list[tuple[int, int] | None]:
    """Per stage (its layer range, inclusive): the scan iterations ``[lo, hi)`` it runs, or None."""
    out: list[tuple[int, int] | None] = []
    for a, b in ranges:
        its = sorted(c for layer in layers[a:b + 1] for e in layer.eqns
                     if (c := pricing.chunk_of_eqn(e)) is not None)
        out.append((its[0], its[-1] + 1) if its else None)
    return out


@dataclass(frozen=True, eq=False)
class ScanPipelinePlanned(PipelinePlanned):
    """A pipeline plan over a scanned stack: the plan and layouts are over the per-iteration rewrite; the runtime
    runs one scan per stage (module docstring)."""

    user_fn: Callable[..., Any] = None  # type: ignore[assignment]
    user_arg_leaves: tuple[Any, ...] = ()
    user_in_tree: Any = None
    user_out_tree: Any = None
    user_split: tuple[bool, ...] = ()
    stack_length: int = 0
    stage_iterations: tuple[tuple[int, int] | None, ...] = ()  # per stage: the scan iterations [lo, hi) it runs

    def runtime(self, devices: Sequence[jax.Device] | None = None, **step_options: Any) -> PipelineStep:
        big_b = self.stage_plan.num_microbatches
        user_graph = trace_at(self.user_fn, self.user_in_tree, microbatch_shapes(
            self.user_arg_leaves, self.user_split, big_b))
        small = split_step(user_graph.jaxpr)
        stack = find_stack(small.forward) if small is not None else None
        if stack is None or stack.length != self.stack_length:
            raise PipelineError(f"the loss traces to different equations at the microbatch size (batch / {big_b}); "
                                "a pipeline needs shape-independent loss code")
        pricing = split_stack(small, stack, range(stack.length + 1), mark_cuts=True)
        its = stage_bounds(pricing, self.layers, [(st.first_layer, st.last_layer) for st in self.layouts])
        held = [r for r in its if r is not None]
        if any(a[1] != b[0] for a, b in zip(held[:-1], held[1:])) or held[0][0] != 0 or held[-1][1] != stack.length:
            raise PipelineError(f"internal: stage iteration ranges {its} do not cover the scan in order")
        bounds = [0] + [hi for _lo, hi in held]
        run = split_stack(small, stack, bounds)
        chunk_of_stage = {s: held.index(r) for s, r in enumerate(its) if r is not None}
        rt_index = {o: j for j, o in enumerate(run.eqn_origin) if o is not None}
        rt_layers, rt_layouts = [], []
        for s, layout in enumerate(self.layouts):
            eqns = [rt_index[o] for layer in self.layers[layout.first_layer:layout.last_layer + 1] for e in layer.eqns
                    if (o := pricing.eqn_origin[e]) is not None]
            if s in chunk_of_stage:
                eqns.append(run.chunk_eqns[chunk_of_stage[s]])
            rt_layers.append(tuple(sorted(eqns)))
            rt_layouts.append(_runtime_layout(layout, s, pricing, run, chunk_of_stage.get(s)))
        _, split = batch_inputs(run.parts)
        step = ScanPipelineStep(run.parts, rt_layers, rt_layouts, big_b, self.stage_plan.schedule,
                                split_inputs=split, in_tree=None, out_tree=None, devices=devices, **step_options)
        step.stack_split, step.user_in_tree, step.user_out_tree = run, self.user_in_tree, self.user_out_tree
        step.stage_iterations = tuple(its)
        return step


def _runtime_layout(layout: StageLayout, s: int, pricing: StackSplit, run: StackSplit, chunk: int | None
                    ) -> StageLayout:
    """Stage s's layout (keyed by the per-iteration rewrite's leaves and inputs) keyed by the runtime rewrite's."""
    leaf_index = {key: j for j, key in enumerate(pricing.leaf_of)}
    input_index = {key: j for j, key in enumerate(pricing.inputs)}

    def leaf(key: tuple[int, int | None]) -> int | None:
        k, c = key
        return leaf_index.get((k, None if c is None else run.bounds[c]))

    params, grads, inputs = {}, {}, {}
    for j, key in enumerate(run.leaf_of):
        p = leaf(key)
        if key[1] is not None and key[1] != chunk:
            continue
        if p is not None and p in layout.param_specs:
            params[j] = layout.param_specs[p]
        if p is not None and p in layout.grad_specs:
            grads[j] = layout.grad_specs[p]
    for j, (i, c) in enumerate(run.inputs):
        if c is not None and c != chunk:
            continue
        p = input_index.get((i, None if c is None else run.bounds[c]))
        if p is not None and p in layout.input_specs:
            inputs[j] = layout.input_specs[p]
    return dataclasses.replace(layout, first_layer=s, last_layer=s, param_specs=params, grad_specs=grads,
                               input_specs=inputs)


class ScanPipelineStep(PipelineStep):
    """A pipelined step over a scanned stack, called like the user's step: stacked arrays in and out."""

    stack_split: StackSplit
    user_in_tree: Any
    user_out_tree: Any
    stage_iterations: tuple[tuple[int, int] | None, ...]

    def flatten_args(self, args: Sequence[Any]) -> list[Any]:
        leaves, tree = jax.tree_util.tree_flatten(tuple(args))
        if tree != self.user_in_tree:
            raise ValueError(f"arguments do not match the planned signature:\n  planned {self.user_in_tree}\n"
                             f"  got     {tree}")
        return self.stack_split.split_flat(leaves)

    def __call__(self, *args: Any) -> Any:
        outs = self.run_flat(self.flatten_args(args))
        joined = self.stack_split.join_outputs(outs, self.user_out_tree.num_leaves, join=_join)
        return jax.tree_util.tree_unflatten(self.user_out_tree, joined)


def _join(chunks: Sequence[Any]) -> Any:
    """Stacked chunks from several stages concatenated on the first one's devices."""
    first = chunks[0]
    sharding = getattr(first, "sharding", None)
    if isinstance(sharding, NamedSharding):
        where = NamedSharding(sharding.mesh, PartitionSpec())
        chunks = [jax.device_put(c, where) for c in chunks]
    return jnp.concatenate(chunks, axis=0)


