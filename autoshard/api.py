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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import Mesh

from autoshard.arguments import PlanArguments, check_arguments, check_devices
from autoshard.compiler.arbiter import check_option
from autoshard.compiler.checked import checked as arbitrated, plan_checked
from autoshard.compiler.driver import PlannedStep, Progress, plan_step
from autoshard.compiler.pipeline_context import PipelinePlanned, PipelineRequest
from autoshard.compiler.pipeline_driver import plan_pipeline
from autoshard.errors import ReplanWarning, UnusedDevicesWarning
from autoshard.ir.trace import signature
from autoshard.ir.trips import trip_count_option
from autoshard.meshes.cluster import ClusterSpec
from autoshard.passes.intra_op import IntraOpOptions
from autoshard.runtime.applied import annotations_for
from autoshard.plans.plan import Plan, load_plan
from autoshard.runtime.pipeline import PipelineStep
from autoshard.runtime.pipeline_lower import PipelineLowered, lower_pipeline
from autoshard.runtime.run import run as apply
from autoshard.runtime.spmd import SpmdStep, make_jax_mesh
from autoshard.runtime.stage_layout import StepOptions

__all__ = ["AutoshardConfig", "AutoshardedFunction", "apply", "autoshard", "load_plan", "plan"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AutoshardConfig:
    mesh: Mesh | tuple[int, ...] | None = None  # None: all devices, logical shape searched
    cluster: ClusterSpec | str | None = None  # preset name, file, spec; None: describe the devices present
    memory_budget: float | None = None  # bytes per device (checked from bytes or "40GiB"); None: device memory
    num_stages: int | None = None  # pipeline stages (None: searched against SPMD; 1: SPMD only)
    num_microbatches: int | None = None  # pipeline microbatches (None: searched)
    schedule: str = "1f1b"  # pipeline schedule: "1f1b" (interleaving searched), "interleaved" or "gpipe"
    options: IntraOpOptions | None = None  # solver knobs
    progress: Progress | None = None  # told a short line as each long phase starts: tracing, each solve, compiling
    # iterations a while loop runs when autoshard cannot derive it from the loop's counter (ir/trips.py);
    # None: a guess, with a TripCountGuessWarning naming the loop
    while_trip_count: int | None = None
    # "compiled": compile the chosen plan, its next-best plans and the best classic plan, return the fastest
    # compiled program (compiler/arbiter.py); None: the cost model alone decides
    check: str | None = None
    # XLA compiler options for the step's executables, as ``jax.jit``'s ``compiler_options`` (None: XLA's
    # defaults); e.g. {"xla_cpu_use_fusion_emitters": False} compiles faster on CPU where only the numbers matter
    compiler_options: Mapping[str, Any] | None = None


class AutoshardedFunction:
    """The decorated train step. Calls are cached per input signature, like ``jax.jit``."""

    def __init__(self, fn: Callable[..., Any], config: AutoshardConfig, arguments: PlanArguments | None = None) -> None:
        functools.update_wrapper(self, fn)
        self.fn, self.config = fn, config
        self.arguments = arguments or _checked(config.mesh, config.cluster, config.memory_budget, config.num_stages,
                                               config.num_microbatches, config.schedule, config.while_trip_count)
        self._cache: dict[tuple[Any, ...], tuple[PlannedStep, SpmdStep]] = {}
        self._last: tuple[PlannedStep, SpmdStep] | None = None
        self._last_args: Any = None  # the shapes the last plan was made for (what a replan is told against)

    def _compiled(self, args: tuple[Any, ...], key: Any = None
                  ) -> tuple[PlannedStep | PipelinePlanned, SpmdStep | PipelineStep]:
        key = signature(args) if key is None else key
        if key not in self._cache:
            cfg = self.config
            check_devices(self.arguments, len(jax.devices()), runs=True)
            shapes = jax.tree.map(_shape_of, args)
            common = dict(mesh=cfg.mesh, cluster=cfg.cluster, memory_budget=cfg.memory_budget,
                          options=cfg.options, progress=cfg.progress)
            with trip_count_option(cfg.while_trip_count):
                planned = _plan_for(self.fn, shapes, cfg.num_stages, cfg.num_microbatches, cfg.schedule, cfg.check,
                                    **common)
            if isinstance(planned, PipelinePlanned):
                # a given mesh's device order is the one the stages' device indices name (as for autoshard.apply);
                # the runtime runs on the traces planning made
                devices = list(cfg.mesh.devices.flat) if isinstance(cfg.mesh, Mesh) else None
                runner: SpmdStep | PipelineStep = planned.runtime(
                    devices, StepOptions(compiler_options=dict(cfg.compiler_options) if cfg.compiler_options else None))
            else:
                if not isinstance(cfg.mesh, Mesh):
                    _warn_unused_devices(planned.logical_mesh.num_devices)
                mesh = cfg.mesh if isinstance(cfg.mesh, Mesh) else make_jax_mesh(planned.logical_mesh)
                runner = SpmdStep(planned.graph, annotations_for(planned.plan, planned.graph), mesh,
                                  compiler_options=cfg.compiler_options)
            self._cache[key] = (planned, runner)
            self._last_args = shapes
            log.info("%s", planned.plan)
        self._last = self._cache[key]
        return self._last

    def __call__(self, *args: Any) -> Any:
        progress = self.config.progress
        key = signature(args)
        fresh = key not in self._cache
        if fresh and self._last_args is not None:
            self._say_replan(args)
        _planned, step = self._compiled(args, key)
        if fresh and progress is not None:
            progress("compiling (the first call)" if len(self._cache) == 1 else "compiling (the new shapes)")
        if isinstance(step, PipelineStep):
            return step(*args)
        return step.call_placed(args)

    def _say_replan(self, args: tuple[Any, ...]) -> None:
        """Plans are per input signature: say once, before planning again, which arguments changed."""
        old_paths = {jax.tree_util.keystr(p): (tuple(x.shape), str(x.dtype)) for p, x in
                     jax.tree_util.tree_leaves_with_path(self._last_args)}
        changed = []
        for path, x in jax.tree_util.tree_leaves_with_path(args):
            key, now = jax.tree_util.keystr(path), (tuple(jax.numpy.shape(x)), str(jax.numpy.result_type(x)))
            if old_paths.get(key) != now:
                before = old_paths.get(key)
                changed.append(f"{key} {'new' if before is None else f'{before[0]} {before[1]}'} -> {now[0]} {now[1]}")
        reason = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "") \
            if changed else "the argument structure changed"
        name = getattr(self, "__name__", "the step")
        line = (f"planning {name} again: its arguments changed ({reason}); plans are made per argument shape, so "
                f"this shape gets its own plan and compile (keep shapes fixed, e.g. pad the last batch, to plan once)")
        if self.config.progress is not None:  # said once: where the other progress lines go, else as a warning
            self.config.progress(line)
        else:
            warnings.warn(line, ReplanWarning, stacklevel=3)

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


def _shape_of(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.numpy.result_type(x))


def _plan_for(fn: Callable[..., Any], shapes: Any, num_stages: int | None, num_microbatches: int | None,
              schedule: str, check: str | None, **common: Any) -> PlannedStep | PipelinePlanned:
    """The plan of ``fn`` at ``shapes``: SPMD (``num_stages`` 1) or with stages searched, then, with
    ``check="compiled"``, arbitrated on compiled programs (``compiler/checked.py``)."""
    if num_stages == 1:
        if check == "compiled":
            return plan_checked(fn, shapes, name=getattr(fn, "__name__", "autoshard"), **common)
        return plan_step(fn, shapes, **common)
    search = plan_pipeline(fn, shapes, PipelineRequest(num_stages=num_stages, num_microbatches=num_microbatches,
                                                       schedule=schedule, keep_both=check == "compiled", **common))
    if check == "compiled":  # both contenders compiled when the stage count was searched
        return arbitrated(fn, shapes, search, **common)
    return search.chosen


def _warn_unused_devices(used: int) -> None:
    """A mesh shape smaller than the devices present runs on the first ``used`` of them: say so."""
    present = len(jax.devices())
    if used < present:
        warnings.warn(f"the mesh has {used} device(s) but {present} are present: the step runs on the first {used} "
                      f"only; pass a mesh of {present} devices (or mesh=None) to use them all, or a jax Mesh to "
                      f"choose the devices", UnusedDevicesWarning, stacklevel=4)


def autoshard(fn: Callable[..., Any] | None = None, *, mesh: Mesh | tuple[int, ...] | None = None,
              cluster: ClusterSpec | str | None = None, memory_budget: float | str | None = None,
              num_stages: int | None = None, num_microbatches: int | None = None, schedule: str = "1f1b",
              options: IntraOpOptions | None = None, progress: Progress | None = None,
              while_trip_count: int | None = None, check: str | None = None,
              compiler_options: Mapping[str, Any] | None = None) -> Any:
    """Decorate a train step; usable bare (``@autoshard``) or with options (``@autoshard(mesh=...)``).

    ``memory_budget``: per device, bytes or a size with a unit (``"40GiB"``, ``"512MiB"``). ``progress``
    (e.g. ``print``) is told a short line as each long phase of the first call starts: tracing, each solve,
    compiling. ``while_trip_count``: the iterations a ``while`` loop whose trip count cannot be derived from its
    counter is priced at (None: a guess, with a ``TripCountGuessWarning``). ``check="compiled"``: compile the
    chosen plan, its next-best plans and the best classic plan and run the fastest compiled program
    (``compiler/arbiter.py``; minutes on a big model), a pipeline weighed against the SPMD plan stage by stage
    (``compiler/checked.py``); None (default): the cost model alone decides. Every
    argument is checked here (and the mesh against the devices at the first call), before any work:
    ``ArgumentError`` says what to change. ``compiler_options``: passed to XLA for the step's executables, as
    ``jax.jit``'s; planning ignores them.
    """
    checked = _checked(mesh, cluster, memory_budget, num_stages, num_microbatches, schedule, while_trip_count)
    config = AutoshardConfig(checked.mesh, cluster, checked.memory_budget, checked.num_stages,
                             checked.num_microbatches, checked.schedule, options, progress, checked.while_trip_count,
                             check_option(check), compiler_options)
    if fn is None:
        return lambda f: AutoshardedFunction(f, config, checked)
    return AutoshardedFunction(fn, config, checked)


def _checked(mesh: Any, cluster: Any, memory_budget: Any, num_stages: Any, num_microbatches: Any, schedule: Any,
             while_trip_count: Any) -> PlanArguments:
    """The arguments checked before any work (``autoshard/arguments.py``): ArgumentError names a wrong one."""
    return check_arguments(mesh=mesh, cluster=cluster, memory_budget=memory_budget, num_stages=num_stages,
                           num_microbatches=num_microbatches, schedule=schedule, while_trip_count=while_trip_count)


def plan(fn: Callable[..., Any], *args: Any, mesh: Mesh | tuple[int, ...] | None = None,
         cluster: ClusterSpec | str | None = None, memory_budget: float | str | None = None,
         num_stages: int | None = None, num_microbatches: int | None = None, schedule: str = "1f1b",
         options: IntraOpOptions | None = None, progress: Progress | None = None,
         while_trip_count: int | None = None, check: str | None = None) -> Plan:
    """Plan ``fn(*args)`` (arrays or ``jax.ShapeDtypeStruct``s) without running it.

    ``num_stages``: None searches pipelines against SPMD (a step using ``autoshard.value_and_grad``), 1 plans
    SPMD only, an integer forces that many stages; ``num_microbatches`` likewise; ``schedule`` "1f1b"|"interleaved"|"gpipe";
    ``progress`` is told a short line as each long phase starts (tracing, each solve); ``while_trip_count`` as
    for ``autoshard``; ``memory_budget`` and ``check`` too (``check="compiled"``: the plan's ledger carries its
    compiled price, ``Plan.arbitration`` every SPMD plan compiled, and with stages searched the best pipeline and
    the SPMD plan are both compiled, the faster returned). Every argument is checked before any work
    (``ArgumentError``).
    """
    check = check_option(check)
    a = _checked(mesh, cluster, memory_budget, num_stages, num_microbatches, schedule, while_trip_count)
    check_devices(a, len(jax.devices()), runs=False)
    with trip_count_option(a.while_trip_count):
        return _plan_for(fn, args, a.num_stages, a.num_microbatches, a.schedule, check, mesh=a.mesh,
                         cluster=cluster, memory_budget=a.memory_budget, options=options, progress=progress).plan
