"""Pipelines over a scanned layer stack at run time: each stage scans its own iteration range.

The planner (``compiler/pipeline_driver.py``) prices and lays out the step rewritten per iteration
(:func:`per_layer`: the stack cut into N one-iteration scans, ``ir/scan_stack.py``); its stage layouts are
keyed by that rewrite's leaves. :func:`scanned_step` takes the user's step at the microbatch, rewrites it
with one chunk per stage (the iterations of the stage's layers), re-keys each layout for it and builds a
:class:`ScanPipelineStep`: called like the user's step, it slices every stacked input into the stages'
rows, runs the stages (stage s holds only rows ``[lo, hi)`` of each stacked parameter, gradient and
optimizer state and runs a ``scan`` over them), and concatenates the stacked outputs on the first stage's
devices, so the step returns the user's stacked layout. ``autoshard.apply`` of a saved plan runs the same
(``runtime/applied_scan.py``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from autoshard.errors import PipelineError, PlanningError
from autoshard.ir.graph import OpGraph
from autoshard.ir.scan_stack import StackSplit, find_stack, split_stack
from autoshard.ir.split import StepParts, batch_inputs
from autoshard.ir.step_trace import TracedStep
from autoshard.ir.trace import trace
from autoshard.plans.plan import Plan
from autoshard.runtime.microbatch_bits import per_microbatch
from autoshard.runtime.pipeline import PipelineStep
from autoshard.runtime.stage_layout import PipelineRun, StageLayout, StepOptions, output_specs


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


@dataclass(frozen=True, eq=False)
class StackedView:
    """A step with a scanned layer stack as its pipeline plan sees it: cut per iteration (``split``, whose
    leaves the plan's layouts key) and traced so (``graph``, whose inputs and outputs the plan names)."""

    split: StackSplit
    graph: OpGraph


def stacked_view(traced: TracedStep, split: StackSplit | None = None) -> StackedView:
    """The per-iteration view of ``traced`` (``split``: its per-iteration cut, when already made)."""
    split = per_layer(traced.parts) if split is None else split
    graph = trace(stacked_function(traced.replay, traced.in_tree, traced.graph.out_tree, split),
                  *stacked_args(traced.arg_leaves, traced.in_tree, split))
    return StackedView(split, graph)


def stage_bounds(pricing: StackSplit, layer_eqns: Sequence[Sequence[int]], ranges: Sequence[tuple[int, int]]
                 ) -> list[tuple[int, int] | None]:
    """Per stage (its layer range, inclusive): the scan iterations ``[lo, hi)`` it runs, or None."""
    out: list[tuple[int, int] | None] = []
    for a, b in ranges:
        its = sorted(c for layer in layer_eqns[a:b + 1] for e in layer
                     if (c := pricing.chunk_of_eqn(e)) is not None)
        out.append((its[0], its[-1] + 1) if its else None)
    return out



def scanned_step(plan: Plan, traced: TracedStep, layouts: Sequence[StageLayout],
                 devices: Sequence[jax.Device] | None = None, options: StepOptions = StepOptions()) -> PipelineStep:
    """The runtime of a scanned-stack pipeline plan (module docstring) on the user's step ``traced``; ``layouts``
    are the plan's stages keyed by the per-iteration rewrite (``runtime/applied_pipeline.stage_layouts``)."""
    assert plan.pipeline is not None
    big_b = int(plan.num_microbatches)
    layer_eqns = plan.pipeline.layer_eqns
    small = traced.at_microbatches(big_b)
    stack = find_stack(small.forward) if small is not None else None
    if small is None or stack is None or stack.length != plan.pipeline.scan_layers:
        raise PipelineError(f"the loss traces to different equations at the microbatch size (batch / {big_b}); "
                            "a pipeline needs shape-independent loss code")
    pricing = split_stack(small, stack, range(stack.length + 1), mark_cuts=True)
    its = stage_bounds(pricing, layer_eqns, [(st.first_layer, st.last_layer) for st in layouts])
    held = [r for r in its if r is not None]
    if not held or any(a[1] != b[0] for a, b in zip(held[:-1], held[1:])) or held[0][0] != 0 \
            or held[-1][1] != stack.length:
        raise PipelineError(f"the stages' scan iterations {its} do not cover the {stack.length} scanned layers in "
                            "order: plan again")
    bounds = [0] + [hi for _lo, hi in held]
    run = split_stack(small, stack, bounds)
    chunk_of_stage = {s: held.index(r) for s, r in enumerate(its) if r is not None}
    rt_index = {o: j for j, o in enumerate(run.eqn_origin) if o is not None}
    rt_layers, rt_layouts = [], []
    for s, layout in enumerate(layouts):
        eqns = [rt_index[o] for layer in layer_eqns[layout.first_layer:layout.last_layer + 1] for e in layer
                if (o := pricing.eqn_origin[e]) is not None]
        if s in chunk_of_stage:
            eqns.append(run.chunk_eqns[chunk_of_stage[s]])
        rt_layers.append(tuple(sorted(eqns)))
        rt_layouts.append(_runtime_layout(layout, s, pricing, run, chunk_of_stage.get(s), traced.graph.carried))
    _, split = batch_inputs(run.parts)
    parts, draws = per_microbatch(traced.parts, small, big_b, run.parts)
    step = ScanPipelineStep(PipelineRun(parts, tuple(rt_layers), tuple(rt_layouts), big_b, plan.pipeline.schedule,
                                        tuple(split), draws=draws), devices, options)
    step.stack_split, step.user_in_tree, step.user_out_tree = run, traced.in_tree, traced.graph.out_tree
    step.stage_iterations = tuple(its)
    return step


def _runtime_layout(layout: StageLayout, s: int, pricing: StackSplit, run: StackSplit, chunk: int | None,
                    carried: Sequence[int | None]) -> StageLayout:
    """Stage s's layout (keyed by the per-iteration rewrite's leaves and inputs) keyed by the runtime rewrite's;
    ``carried``: the user's step output -> the input it updates (``OpGraph.carried``)."""
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
    # The updated state is written back in its stored layout: a chunk's updated slice of a stacked leaf as its
    # slice came in (the chunk's output of the user's output that updates that input), as ``output_specs`` does
    # for a step without a stack. Without it XLA chose the update's output layouts itself: a ZeRO-2 stage
    # returned its parameters split like their gradients, and their all-gather moved out of the executables.
    flat_in = {key: j for j, key in enumerate(run.inputs)}
    updates = [flat_in.get((carried[k], c)) if k < len(carried) and carried[k] is not None else None
               for k, c in run.outputs]  # ``OpGraph.carried`` of the rewritten step
    # The per-equation pins are keyed by the per-iteration rewrite's equations, which the chunk scans do not
    # keep: inside a chunk the stage's layouts come from its stored parameters, accumulators and inputs (XLA
    # propagates).
    return dataclasses.replace(layout, first_layer=s, last_layer=s, param_specs=params, grad_specs=grads,
                               input_specs=inputs, op_out_specs={}, op_in_reshards={}, edge_pins={}, train_pins={},
                               output_specs=output_specs(updates, inputs))


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


