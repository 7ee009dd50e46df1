"""``@autoshard``: trace once per input signature, plan, compile, cache.

    @autoshard.autoshard(mesh=None, cluster=None, memory_budget=None)
    def train_step(params, opt_state, batch): ...

    params, opt_state, loss = train_step(params, opt_state, batch)   # plans on first call
    train_step.lower(*shape_structs).compile()                       # plan from shapes alone
    train_step.plan                     # the Plan; str() of it is a readable report

Like ``jax.jit`` with donation, the state arguments (those the step returns
updated) are donated: do not reuse the arrays you passed in.
"""
from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import Mesh

from autoshard.compiler.driver import PlannedStep, Progress, plan_step
from autoshard.compiler.pipeline_driver import PipelinePlanned, plan_pipeline
from autoshard.errors import UnusedDevicesWarning
from autoshard.ir.trace import signature
from autoshard.ir.trips import check_trip_count, trip_count_option
from autoshard.meshes.cluster import ClusterSpec
from autoshard.passes.intra_op import IntraOpOptions
from autoshard.plans.applied import annotations_for
from autoshard.plans.plan import Plan, load_plan
from autoshard.runtime.pipeline import PipelineStep
from autoshard.runtime.pipeline_lower import PipelineLowered, lower_pipeline
from autoshard.runtime.spmd import SpmdStep, make_jax_mesh

__all__ = ["AutoshardConfig", "AutoshardedFunction", "autoshard", "load_plan", "plan"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AutoshardConfig:
    mesh: Mesh | tuple[int, ...] | None = None  # None: all devices, logical shape searched
    cluster: ClusterSpec | str | None = None  # preset name, file, spec; None: describe the devices present
    memory_budget: float | None = None  # bytes per device; None: the cluster's device memory
    num_stages: int | None = None  # pipeline stages (None: searched against SPMD; 1: SPMD only)
    num_microbatches: int | None = None  # pipeline microbatches (None: searched)
    schedule: str = "1f1b"  # pipeline schedule: "1f1b" or "gpipe"
    options: IntraOpOptions | None = None  # solver knobs
    progress: Progress | None = None  # told a short line as each long phase starts: tracing, each solve, compiling
    # iterations a while loop runs when autoshard cannot derive it from the loop's counter (ir/trips.py);
    # None: a guess, with a TripCountGuessWarning naming the loop
    while_trip_count: int | None = None


class AutoshardedFunction:
    """The decorated train step. Calls are cached per input signature, like ``jax.jit``."""

    def __init__(self, fn: Callable[..., Any], config: AutoshardConfig) -> None:
        functools.update_wrapper(self, fn)
        self.fn, self.config = fn, config
        self._cache: dict[tuple[Any, ...], tuple[PlannedStep, SpmdStep]] = {}
        self._last: tuple[PlannedStep, SpmdStep] | None = None

    def _compiled(self, args: tuple[Any, ...]) -> tuple[PlannedStep | PipelinePlanned, SpmdStep | PipelineStep]:
        key = signature(args)
        if key not in self._cache:
            cfg = self.config
            shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.numpy.result_type(x)), args)
            common = dict(mesh=cfg.mesh, cluster=cfg.cluster, memory_budget=cfg.memory_budget,
                          options=cfg.options, progress=cfg.progress)
            with trip_count_option(cfg.while_trip_count):
                if cfg.num_stages == 1:
                    planned = plan_step(self.fn, shapes, **common)
                else:
                    planned = plan_pipeline(self.fn, shapes, num_stages=cfg.num_stages,
                                            num_microbatches=cfg.num_microbatches, schedule=cfg.schedule, **common)
            if isinstance(planned, PipelinePlanned):
                with trip_count_option(cfg.while_trip_count):
                    runner: SpmdStep | PipelineStep = planned.runtime()
            else:
                if not isinstance(cfg.mesh, Mesh):
                    _warn_unused_devices(planned.logical_mesh.num_devices)
                mesh = cfg.mesh if isinstance(cfg.mesh, Mesh) else make_jax_mesh(planned.logical_mesh)
                runner = SpmdStep(planned.graph, annotations_for(planned.plan, planned.graph), mesh)
            self._cache[key] = (planned, runner)
            log.info("%s", planned.plan)
        self._last = self._cache[key]
        return self._last

    def __call__(self, *args: Any) -> Any:
        progress = self.config.progress
        fresh = progress is not None and signature(args) not in self._cache
        _planned, step = self._compiled(args)
        if fresh:
            progress("compiling (the first call)")
        if isinstance(step, PipelineStep):
            return step(*args)
        return step.call_placed(args)

    def lower(self, *args: Any) -> Any | PipelineLowered:
        """Plan from arrays or ``jax.ShapeDtypeStruct``s; ``.compile()`` gives the XLA executable.

        A pipelined step gives a ``PipelineLowered``: its stage executables (forward, backward, apply per
        stage), listed by ``str()``; its ``.compile()`` compiles each."""
        _planned, step = self._compiled(args)
        if isinstance(step, PipelineStep):
            return lower_pipeline(step)
        return step.lower(*args)

    def planned(self, *args: Any) -> PlannedStep | PipelinePlanned:
        return self._compiled(args)[0]

    @property
    def plan(self) -> Plan:
        if self._last is None:
            raise RuntimeError("no plan yet: call the step or .lower(*args) first")
        return self._last[0].plan

    @property
    def spmd_step(self) -> SpmdStep:
        if self._last is None:
            raise RuntimeError("no plan yet: call the step or .lower(*args) first")
        if not isinstance(self._last[1], SpmdStep):
            raise RuntimeError("the plan is a pipeline: see .pipeline_step")
        return self._last[1]

    @property
    def pipeline_step(self) -> PipelineStep:
        if self._last is None or not isinstance(self._last[1], PipelineStep):
            raise RuntimeError("no pipeline plan: call the step first (num_stages=None may have chosen SPMD)")
        return self._last[1]


def _warn_unused_devices(used: int) -> None:
    """A mesh shape smaller than the devices present runs on the first ``used`` of them: say so."""
    present = len(jax.devices())
    if used < present:
        warnings.warn(f"the mesh has {used} device(s) but {present} are present: the step runs on the first {used} "
                      f"only; pass a mesh of {present} devices (or mesh=None) to use them all, or a jax Mesh to "
                      f"choose the devices", UnusedDevicesWarning, stacklevel=4)


def autoshard(fn: Callable[..., Any] | None = None, *, mesh: Mesh | tuple[int, ...] | None = None,
              cluster: ClusterSpec | str | None = None, memory_budget: float | None = None,
              num_stages: int | None = None, num_microbatches: int | None = None, schedule: str = "1f1b",
              options: IntraOpOptions | None = None, progress: Progress | None = None,
              while_trip_count: int | None = None) -> Any:
    """Decorate a train step; usable bare (``@autoshard``) or with options (``@autoshard(mesh=...)``).

    ``progress`` (e.g. ``print``) is told a short line as each long phase of the first call starts: tracing,
    each solve, compiling. ``while_trip_count``: the iterations a ``while`` loop whose trip count cannot be
    derived from its counter is priced at (None: a guess, with a ``TripCountGuessWarning``).
    """
    config = AutoshardConfig(mesh, cluster, memory_budget, num_stages, num_microbatches, schedule, options,
                             progress, check_trip_count(while_trip_count))
    if fn is None:
        return lambda f: AutoshardedFunction(f, config)
    return AutoshardedFunction(fn, config)


def plan(fn: Callable[..., Any], *args: Any, mesh: Mesh | tuple[int, ...] | None = None,
         cluster: ClusterSpec | str | None = None, memory_budget: float | None = None,
         num_stages: int | None = None, num_microbatches: int | None = None, schedule: str = "1f1b",
         options: IntraOpOptions | None = None, progress: Progress | None = None,
         while_trip_count: int | None = None) -> Plan:
    """Plan ``fn(*args)`` (arrays or ``jax.ShapeDtypeStruct``s) without running it.

    ``num_stages``: None searches pipelines against SPMD (a step using ``autoshard.value_and_grad``), 1 plans
    SPMD only, an integer forces that many stages; ``num_microbatches`` likewise; ``schedule`` "1f1b"|"gpipe";
    ``progress`` is told a short line as each long phase starts (tracing, each solve); ``while_trip_count`` as
    for ``autoshard``.
    """
    with trip_count_option(while_trip_count):
        if num_stages == 1:
            return plan_step(fn, args, mesh=mesh, cluster=cluster, memory_budget=memory_budget,
                             options=options, progress=progress).plan
        return plan_pipeline(fn, args, mesh=mesh, cluster=cluster, memory_budget=memory_budget,
                             num_stages=num_stages, num_microbatches=num_microbatches, schedule=schedule,
                             options=options, progress=progress).plan
