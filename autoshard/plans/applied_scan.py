"""``plan.apply`` of a pipeline plan over a scanned layer stack (``PipelineSummary.scan_layers`` > 0).

The plan was made over the step rewritten per scan iteration (``runtime/scan_stages.per_layer``): its
argument paths are the rewrite's (``[0]['blocks']['mlp']['kernel'][2]``: iteration 2 of that stacked
leaf), its layers and stage parameters too. :class:`AppliedScanPipeline` traces the user's step, rewrites
it the same way, checks the rewrite against the plan as ``AppliedPipeline`` checks any step, and runs it
with ``runtime/scan_stages.scanned_step``: each stage scans its own iteration range on its own rows of the
stacked arrays; the user passes and gets back the stacked arrays.
"""
from __future__ import annotations

from typing import Any

import jax

from autoshard.errors import PlanMismatchError
from autoshard.ir.scan_stack import find_stack
from autoshard.ir.split import batch_inputs, split_step
from autoshard.ir.trace import signature, trace
from autoshard.plans.applied_pipeline import AppliedPipeline, check_pipeline, stage_layouts
from autoshard.plans.planfile import check_args
from autoshard.runtime.pipeline import PipelineStep
from autoshard.runtime.scan_stages import per_layer, scanned_step, stacked_args, stacked_function


class AppliedScanPipeline(AppliedPipeline):
    """A callable running ``fn`` as a scanned-stack pipeline ``plan`` on the devices of ``mesh``."""

    def prepare(self, args: tuple[Any, ...]) -> PipelineStep:
        if self.step is None:
            shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.numpy.result_type(x)), args)
            graph = trace(self.fn, *shapes)
            parts = split_step(graph.jaxpr)
            stack = find_stack(parts.forward) if parts is not None else None
            want = self.plan.pipeline.scan_layers
            if stack is None or stack.length != want:
                got = "no layer scan" if stack is None else f"a scan of {stack.length} layers"
                raise PlanMismatchError(f"the plan cuts a scanned stack of {want} layers; the step has {got}: plan "
                                        "again for the changed model")
            pricing = per_layer(parts)
            leaves = jax.tree_util.tree_leaves(shapes)
            vgraph = trace(stacked_function(self.fn, graph.in_tree, graph.out_tree, pricing),
                           *stacked_args(leaves, graph.in_tree, pricing))
            check_pipeline(self.plan, vgraph, pricing.parts)
            _batch, split = batch_inputs(parts)
            layouts = stage_layouts(self.plan, vgraph, pricing.parts)
            self.step = scanned_step(self.fn, graph.in_tree, leaves, split, stack.length,
                                     self.plan.pipeline.layer_eqns, layouts, int(self.plan.num_microbatches),
                                     self.plan.schedule, self.devices, **self.step_options)
            self.called_with = signature(args)
        elif signature(args) != self.called_with:
            check_args(self.plan, args)
        return self.step
