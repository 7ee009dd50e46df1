"""``autoshard.apply`` of a pipeline plan over a scanned layer stack (``PipelinePlan.scan_layers`` > 0).

The plan was made over the step rewritten per scan iteration (``runtime/scan_stages.per_layer``): its
argument paths are the rewrite's (``[0]['blocks']['mlp']['kernel'][2]``: iteration 2 of that stacked
leaf), its layers and stage parameters too. :class:`AppliedScanPipeline` traces the user's step, rewrites
it the same way, checks the rewrite against the plan as ``AppliedPipeline`` checks any step, and runs it
with ``runtime/scan_stages.scanned_step``: each stage scans its own iteration range on its own rows of the
stacked arrays; the user passes and gets back the stacked arrays.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from autoshard.errors import PlanMismatchError
from autoshard.ir.scan_stack import find_stack
from autoshard.ir.step_trace import TracedStep
from autoshard.ir.trace import signature
from autoshard.plans.plan import Plan
from autoshard.plans.planfile import check_args
from autoshard.runtime.applied_pipeline import AppliedPipeline, check_pipeline, stage_layouts, traced_step
from autoshard.runtime.pipeline import PipelineStep
from autoshard.runtime.scan_stages import StackedView, scanned_step, stacked_view
from autoshard.runtime.stage_layout import StepOptions


class AppliedScanPipeline(AppliedPipeline):
    """A callable running ``fn`` as a scanned-stack pipeline ``plan`` on the devices of ``mesh``.

    ``traced`` and ``view``: the user's step and its per-iteration view already traced (the planner's)."""

    def __init__(self, plan: Plan, fn: Callable[..., Any], mesh: Mesh | Sequence[jax.Device], *,
                 options: StepOptions = StepOptions(), traced: TracedStep | None = None,
                 view: StackedView | None = None) -> None:
        super().__init__(plan, fn, mesh, options=options, traced=traced)
        self.view = view

    def _user_step(self, args: Sequence[Any] | None) -> TracedStep:
        """The user's step traced (or the one given), refused unless it scans the plan's stack."""
        assert self.plan.pipeline is not None
        if self.traced is not None:
            graph, parts = self.traced.graph, self.traced.parts
        elif args is None:
            raise ValueError("the pipeline has not been traced yet: call it, or prepare(args), with the step's arguments")
        else:
            graph, parts = traced_step(self.fn, args)
        stack = find_stack(parts.forward) if parts is not None else None
        want = self.plan.pipeline.scan_layers
        if parts is None or stack is None or stack.length != want:
            got = "no layer scan" if stack is None else f"a scan of {stack.length} layers"
            raise PlanMismatchError(f"the plan cuts a scanned stack of {want} layers; the step has {got}: plan "
                                    "again for the changed model")
        return self.traced if self.traced is not None else TracedStep.of(self.fn, args or (), graph, parts)

    def prepare(self, args: tuple[Any, ...] | None = None) -> PipelineStep:
        if self.step is None:
            traced = self._user_step(args)
            view = self.view if self.view is not None else stacked_view(traced)
            check_pipeline(self.plan, view.graph, view.split.parts)
            layouts = stage_layouts(self.plan, view.graph, view.split.parts)
            self.step = scanned_step(self.plan, traced, layouts, self.devices, self.options)
            self.called_with = signature(tuple(args) if args is not None else traced.args)
        elif args is not None and signature(args) != self.called_with:
            check_args(self.plan, args)
        return self.step
