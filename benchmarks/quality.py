"""Plan quality: autoshard against the classic strategies on one (workload, cluster) cell.

Each cell traces an example workload from abstract shapes, runs
``autoshard.compiler.baselines.compare`` (DP, FSDP/ZeRO-3, ZeRO-2, HSDP, Megatron TP,
DP x TP, then autoshard hinted with the best one that fits, then compiled
arbitration: autoshard's plan, its next-best plans and every classic plan
compiled by XLA and priced from their HLO on the cell's cluster, the fastest
returned) and keeps plain numbers: modeled and compiled step time, per-device
peak memory, batch ceiling, the compute lower bound, planning seconds by pass,
the ILP's size and gap, and the objective checker's result
(``benchmarks/compiled.py``). For cells on one 8-device node it also sets the
plan's predicted collective bytes and peak memory against the compiled HLO
(``compiler/verify.py``).
"""
from __future__ import annotations

import collections
import importlib
import logging
import math
import multiprocessing
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace

from autoshard.compiler.baselines import Candidate, Comparison, compare
from benchmarks.compiled import CompiledRow, ContestRow, ObjectiveRow, compiled_row, contest_rows, objective_row
from autoshard.compiler.driver import plan_graph
from autoshard.plans.plan import Plan, fmt_s
from autoshard.ir.trace import trace
from autoshard.errors import InfeasibleMemoryError
from autoshard.passes.intra_op import IntraOpOptions
from examples.common import Workload, count_params

log = logging.getLogger(__name__)
Progress = Callable[[str], None]

MESHES: dict[str, tuple[int, ...]] = {
    "1x8-a100": (2, 4),  # one node: 2 x 4 over NVLink
    "2x8-a100": (2, 8),  # axis 0 crosses the slow (25 Gbit/s) inter-node link
    "4x8-h100": (4, 8),  # axis 0 crosses nodes (400 Gbit/s)
}
FIDELITY_DEVICES = 8  # simulated CPU devices the fidelity check compiles for


@dataclass(frozen=True)
class Cell:
    model: str  # examples module: gpt, moe, convnet, mlp
    config: str  # its CONFIGS key
    cluster: str  # ClusterSpec preset
    batch_size: int | None = None  # None: the config's own
    fidelity: bool = False  # also compile autoshard's plan with XLA (needs a mesh of FIDELITY_DEVICES)
    long_solve_s: float | None = None  # also re-solve autoshard with this CP-SAT time limit: solver or space?
    pipeline: bool = False  # also plan pipelines (stages searched) and uniform GPipe, under the same model
    compiled: bool = True  # compiled arbitration (compare's check="compiled"); False: the model alone (no compiles)

    @property
    def workload(self) -> str:
        return f"{self.model}-{self.config}" + (f"@{self.batch_size}" if self.batch_size else "")

    @property
    def mesh(self) -> tuple[int, ...]:
        return MESHES[self.cluster]

    def __str__(self) -> str:
        return f"{self.workload} on {self.cluster} {'x'.join(map(str, self.mesh))}"


@dataclass(frozen=True)
class StrategyRow:
    name: str
    step_s: float
    peak_bytes: float
    fits: bool
    batch_ceiling: int | None  # largest global batch that fits; None: memory does not grow with the batch
    compute_s: float
    comm_s: float  # collectives inside op strategies
    reshard_s: float  # resharding between ops
    compiled: CompiledRow | None = None  # the plan compiled with XLA and priced from what XLA compiled

    @classmethod
    def of(cls, c: Candidate) -> StrategyRow:
        led = c.plan.ledger
        return cls(c.name, c.step_s, c.peak_bytes, c.fits, c.batch_ceiling, led.compute_s, led.comm_s, led.reshard_s)

    @property
    def split(self) -> str:
        return f"compute {fmt_s(self.compute_s)}, collectives {fmt_s(self.comm_s)}, resharding {fmt_s(self.reshard_s)}"


@dataclass(frozen=True)
class IlpSize:
    nodes: int
    classes: int
    variables: int
    constraints: int
    edges: int
    status: str
    gap: float
    build_s: float
    solve_s: float

    def __str__(self) -> str:
        return f"{self.nodes}->{self.classes} nodes, {self.variables} vars, {self.constraints} cons"


@dataclass(frozen=True)
class FidelityRow:
    what: str
    predicted: float
    compiled: float
    rel_error: float
    ok: bool


@dataclass(frozen=True)
class Fidelity:
    rows: tuple[FidelityRow, ...] = ()
    compile_s: float = 0.0
    error: str | None = None

    def row(self, what: str) -> FidelityRow | None:
        return next((r for r in self.rows if r.what == what), None)


@dataclass(frozen=True)
class LongSolve:
    """autoshard re-solved with a long time limit, from the same hint: does more search find more?"""

    time_limit_s: float
    step_s: float
    status: str  # "optimal": nothing better exists in the ILP
    gap: float
    seconds: float  # the re-solve's intra-op pass, wall


@dataclass(frozen=True)
class CellResult:
    cell: Cell
    num_params: int
    batch_size: int
    budget_bytes: float
    autoshard: StrategyRow | None  # None: no plan fits (see error)
    baselines: tuple[StrategyRow, ...]
    lower_bound_s: float  # total FLOPs / (devices x peak)
    trace_s: float  # autoshard's trace pass (cold; the baselines reuse jax's trace cache)
    intra_op_s: float  # autoshard's intra-op pass (hinted with the best classic plan)
    compare_s: float  # the whole comparison: traces, six baselines, autoshard, batch ceilings
    ilp: IlpSize | None
    kept: str | None = None  # the baseline compare kept as autoshard's plan (solver did not beat its hint)
    hot_ops: tuple[str, ...] = ()  # where autoshard's plan spends collective and resharding time
    fidelity: Fidelity | None = None
    long_solve: LongSolve | None = None
    error: str | None = None
    pipeline: StrategyRow | None = None  # the best pipeline of >= 2 stages (cell.pipeline); None: not planned
    pipeline_stages: str = ""  # its stages, sub-meshes, B and schedule
    pipeline_s: float = math.nan  # planning seconds of the pipeline (stages searched, its SPMD plan included)
    contest: tuple[ContestRow, ...] = ()  # compare's compiled arbitration: every plan compiled, the one returned
    arbitration_s: float = math.nan  # its next-best solves and compiles, wall
    decisions: dict | None = None  # autoshard's plan as ``plan_decisions`` gives it (``run.py --plans`` saves it)
    pipeline_decisions: dict | None = None  # the best pipeline's, likewise
    objective: ObjectiveRow | None = None  # the objective checker on autoshard's plan (None: not available)

    @property
    def compiled_fallback(self) -> StrategyRow | None:
        """The classic strategy that fits whose compiled program is fastest (priced from its HLO)."""
        return min((b for b in self.baselines if b.fits and b.compiled is not None),
                   key=lambda b: b.compiled.step_s, default=None)  # type: ignore[union-attr]

    @property
    def compiled_answer(self) -> CompiledRow | None:
        """What ``check="compiled"`` returns, priced from its compiled program(s): the SPMD plan after compiled
        arbitration, or, where the cell searched stages, the faster compiled of it and the best pipeline
        (``compiler/checked.py``); None when neither fits and compiled."""
        rows = [r for r in (self.autoshard, self.pipeline) if r is not None and r.fits and r.compiled is not None]
        return min((r.compiled for r in rows), key=lambda c: c.step_s, default=None)

    @property
    def compiled_answer_row(self) -> StrategyRow | None:
        """The row ``compiled_answer`` is the price of (None: none)."""
        mine = self.compiled_answer
        return next((r for r in (self.autoshard, self.pipeline) if r is not None and r.compiled is mine), None) \
            if mine is not None else None

    def compiled_speedup_over(self, row: StrategyRow | None) -> float | None:
        """``row``'s compiled step over autoshard's answer's (both priced from their HLO); None when either is
        missing, or autoshard's plan is over the budget."""
        mine = self.compiled_answer
        if mine is None or row is None or row.compiled is None or mine.step_s <= 0:
            return None
        return row.compiled.step_s / mine.step_s

    @property
    def compiled_speedup(self) -> float | None:
        """autoshard's compiled program against the fastest compiled classic program that fits."""
        return self.compiled_speedup_over(self.compiled_fallback)

    def baseline(self, name: str) -> StrategyRow | None:
        return next((b for b in self.baselines if b.name == name), None)

    @property
    def pipeline_speedup(self) -> float | None:
        """The fastest fitting plan of every other row (autoshard's SPMD plan, every classic strategy and
        uniform GPipe) over the pipeline's step; None when the pipeline was not planned or does not fit."""
        if self.pipeline is None or not self.pipeline.fits or self.pipeline.step_s <= 0:
            return None
        others = [r.step_s for r in (self.autoshard, *self.baselines) if r is not None and r.fits]
        return min(others) / self.pipeline.step_s if others else None

    @property
    def fallback(self) -> StrategyRow | None:
        """The fastest classic strategy that fits the memory budget."""
        return min((b for b in self.baselines if b.fits), key=lambda b: b.step_s, default=None)

    @property
    def answer(self) -> StrategyRow | None:
        """What autoshard returns for the cell: its SPMD plan, or the pipeline where the cell searched stages and
        the pipeline fits and is faster (``plan_pipeline`` with stages searched keeps the faster of the two)."""
        piped = self.pipeline
        if piped is not None and piped.fits and piped.step_s > 0 and (
                self.autoshard is None or not self.autoshard.fits or piped.step_s < self.autoshard.step_s):
            return piped
        return self.autoshard

    @property
    def speedup(self) -> float | None:
        """autoshard's answer (``answer``) over the fastest classic strategy that fits (uniform GPipe included
        where planned); None when either is missing or autoshard's plan is over the memory budget (it could not
        run)."""
        best, mine = self.fallback, self.answer
        if mine is None or not mine.fits or best is None or mine.step_s <= 0:
            return None
        return best.step_s / mine.step_s

    @property
    def over_budget(self) -> bool:
        """autoshard returned a plan whose modeled peak exceeds the budget."""
        return self.autoshard is not None and not self.autoshard.fits

    @property
    def headroom(self) -> float | None:
        """The most any plan could gain over the best fitting classic one: its step / the compute bound."""
        best = self.fallback
        if best is None or self.lower_bound_s <= 0:
            return None
        return best.step_s / self.lower_bound_s

    @property
    def comm_headroom(self) -> float | None:
        """The best fitting classic plan's step over the least compute time of any plan in the cell.

        The cost model's compute is a roofline per op (memory-bound ops at HBM bandwidth), well above the
        FLOP bound for these models; no plan here computes in less than this least compute time, so a plan
        that also removed all communication would gain at most this factor.
        """
        best = self.fallback
        least = min((s.compute_s for s in (self.autoshard, *self.baselines) if s is not None), default=0.0)
        if best is None or least <= 0:
            return None
        return best.step_s / least

    @property
    def bound_fraction(self) -> float | None:
        """compute lower bound / autoshard's step: 1.0 is perfect scaling with no communication."""
        if self.autoshard is None or self.autoshard.step_s <= 0:
            return None
        return self.lower_bound_s / self.autoshard.step_s


# ----------------------------------------------------------------------------- workloads


@dataclass
class WorkloadCache:
    """Each workload is built and traced once; later cells on other clusters reuse jax's trace cache."""

    workloads: dict[tuple[str, str, int | None], tuple[Workload, float]] = field(default_factory=dict)

    def get(self, cell: Cell) -> tuple[Workload, float]:
        """(workload, cold trace seconds)."""
        key = (cell.model, cell.config, cell.batch_size)
        if key not in self.workloads:
            module = importlib.import_module(f"examples.{cell.model}")
            workload = module.workload(cell.config, abstract=True, batch_size=cell.batch_size)
            start = time.perf_counter()
            trace(workload.step, *workload.args)
            self.workloads[key] = (workload, time.perf_counter() - start)
        return self.workloads[key]


# ----------------------------------------------------------------------------- one cell


def hot_ops(plan: Plan, top: int = 3) -> tuple[str, ...]:
    """The ops (grouped over repeated layers) whose chosen strategy costs the most collective + reshard time.

    Priced locally (``compiler/explain.py``): an op's collectives plus the resharding from its producers'
    layouts and to its consumers', so a reshard between two listed ops counts for both.
    """
    total: dict[tuple[str, str, str, str], float] = collections.defaultdict(float)
    count: collections.Counter[tuple[str, str, str, str]] = collections.Counter()
    for e in plan.explanations.values():
        seconds = e.chosen.comm_s + e.chosen.reshard_s
        if seconds > 0:
            key = (e.primitive, e.shapes, e.source or "?", e.chosen.strategy)
            total[key] += seconds
            count[key] += 1
    out = []
    for key, seconds in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        prim, shapes, source, strategy = key
        copies = f" over {count[key]} copies" if count[key] > 1 else ""
        out.append(f"{prim} {shapes} at {source} as {strategy}: {fmt_s(seconds)}{copies}")
    return tuple(out)


def _row_sizes(comparison: Comparison) -> IlpSize:
    s = comparison.autoshard.plan.solver
    planned = comparison.autoshard.planned
    build_s = planned.result.ilp.build_s if planned is not None else math.nan
    return IlpSize(s.num_nodes, s.num_classes, s.num_variables, s.num_constraints, s.num_edges, s.status, s.gap,
                   build_s, s.solve_s)


def plan_decisions(plan: Plan) -> dict:
    """What a plan decided, as plain data (strings, lists, dicts) without its timings and figures: the mesh,
    every input's storage spec, every op's output specs and pinned reshards, the outputs' reshards, and a
    pipeline's stages, microbatches and schedule. Two runs that decide alike give equal data (``run.py
    --plans`` writes it as JSON: a change meant to keep every plan is checked by diffing two such dumps)."""
    def specs(xs) -> list[str]:
        return [str(x) for x in xs]

    stages = [{k: str(v) for k, v in sorted((st if isinstance(st, dict) else vars(st)).items())
               if not isinstance(v, float)} for st in plan.stages]  # a stage's times are figures
    return {
        "mesh": list(plan.mesh_shape),
        "inputs": {k: str(v) for k, v in sorted(plan.input_specs.items())},
        "ops": {str(k): specs(v) for k, v in sorted(plan.op_out_specs.items())},
        "op_reshards": {str(k): {str(p): specs(v) for p, v in sorted(by.items())}
                        for k, by in sorted(plan.op_in_reshards.items())},
        "output_reshards": {str(k): specs(v) for k, v in sorted(plan.output_reshards.items())},
        "stages": stages, "num_microbatches": plan.num_microbatches, "schedule": plan.schedule,
    }


def run_cell(cell: Cell, cache: WorkloadCache, options: IntraOpOptions, progress: Progress | None = None) -> CellResult:
    """Compare autoshard with the classic strategies on ``cell``; failures are recorded, not raised."""
    say = progress or (lambda _msg: None)
    say("building and tracing the workload")
    workload, trace_s = cache.get(cell)
    num_params = count_params(workload.args[0])
    batch = int(getattr(workload.config, "batch_size", 0))
    start = time.perf_counter()
    try:
        comparison = compare(workload.step, workload.args, mesh=cell.mesh, cluster=cell.cluster, options=options,
                             progress=say, check="compiled" if cell.compiled else None)
    except Exception as err:  # noqa: BLE001 — one failing cell is recorded; the run carries on
        smallest = getattr(err, "smallest_budget_bytes", None)
        note = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
        if isinstance(err, InfeasibleMemoryError):
            log.warning("%s: %s", cell, note)
        else:
            log.exception("%s: the comparison failed", cell)
        return CellResult(cell, num_params, batch, math.nan, None, (), math.nan, trace_s, math.nan,
                          time.perf_counter() - start, None,
                          error=note + (f" (smallest budget {smallest / 2**30:.1f} GiB)" if smallest else ""))
    auto = comparison.autoshard
    plan = auto.plan
    status = plan.solver.status
    kept = status.split("kept ", 1)[1] if "kept " in status else None
    # the model's own plan timed the intra-op pass; a next-best plan arbitration returns was re-solved apart
    arbitration = comparison.arbitration
    solved = next((c.plan for c in arbitration.contenders if c.name == "autoshard"), plan) if arbitration else plan
    result = CellResult(
        cell=cell, num_params=num_params, batch_size=batch, budget_bytes=comparison.memory_budget_bytes,
        autoshard=StrategyRow.of(auto), baselines=tuple(StrategyRow.of(b) for b in comparison.baselines),
        lower_bound_s=plan.ledger.compute_lower_bound_s, trace_s=trace_s,
        intra_op_s=float(solved.planning_s.get("intra-op", math.nan)), compare_s=time.perf_counter() - start,
        ilp=_row_sizes(comparison), kept=kept, hot_ops=hot_ops(plan), decisions=plan_decisions(plan),
    )
    if cell.pipeline:
        result = _with_pipeline(result, cell, workload, options, say)
    if cell.long_solve_s:
        say(f"re-solving autoshard with a {cell.long_solve_s:g} s time limit")
        result = replace(result, long_solve=_long_solve(comparison, options, cell.long_solve_s))
    result = _with_compiled(result, comparison)
    if cell.fidelity:
        say("autoshard's plan against what XLA compiled")
        result = _with_fidelity(result, comparison, workload)
    return result


def marked_step(workload: Workload) -> Callable[..., object]:
    """The workload's step with the loss marked for pipelining (``autoshard.value_and_grad``)."""
    import autoshard
    import optax

    tx = workload.optimizer

    def step(params, opt_state, batch):  # noqa: ANN001, ANN202 — the workload's own pytrees
        loss, grads = autoshard.value_and_grad(workload.loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def _with_pipeline(result: CellResult, cell: Cell, workload: Workload, options: IntraOpOptions,
                   say: Progress) -> CellResult:
    """Add the best pipeline (stages searched, >= 2 stages) and uniform GPipe (a classic row) to a cell, priced
    by the same intra-op model as the SPMD rows; a failure is logged and leaves the cell as it was."""
    from autoshard.compiler.baselines import UNIFORM_GPIPE, plan_uniform_gpipe
    from autoshard.compiler.pipeline_context import PipelineRequest
    from autoshard.compiler.pipeline_driver import plan_pipeline
    from autoshard.meshes.cluster import get_cluster

    if workload.optimizer is None:
        return result
    step = marked_step(workload)
    devices = get_cluster(cell.cluster).num_devices
    start = time.perf_counter()
    try:
        say("planning pipelines (stages searched)")
        piped = plan_pipeline(step, workload.args, PipelineRequest(
            cluster=cell.cluster, num_devices=devices, options=options, keep_both=True, progress=say)).pipeline
        seconds = time.perf_counter() - start
        say("planning uniform GPipe")
        gpipe = plan_uniform_gpipe(step, workload.args, cluster=cell.cluster, num_devices=devices, options=options,
                                   progress=say)
    except Exception:  # noqa: BLE001 — one failing pipeline is recorded in the log; the cell keeps its rows
        log.exception("%s: planning the pipeline failed", cell)
        return result
    if piped is None:  # keep_both: only when no pipeline fits
        log.warning("%s: no pipeline of two or more stages fits", cell)
        return result
    plan = piped.plan
    stages = " | ".join(f"L{s.first_layer}-{s.last_layer}@{'x'.join(map(str, s.mesh_shape))}" for s in plan.stages)
    rows = []
    for name, made in (("pipeline", plan), (UNIFORM_GPIPE, gpipe)):
        priced = None
        if cell.compiled:
            say(f"compiling the {name} stage by stage")
            priced = pipeline_compiled(made, step, workload.args)
        rows.append(_pipeline_row(name, made, priced))
    return replace(result, pipeline=rows[0], pipeline_s=seconds,
                   pipeline_decisions=plan_decisions(plan),
                   pipeline_stages=f"{len(plan.stages)} stages [{stages}] B={plan.num_microbatches} {plan.schedule}",
                   baselines=(*result.baselines, rows[1]))


def _pipeline_row(name: str, plan: Plan, compiled: CompiledRow | None = None) -> StrategyRow:
    led = plan.ledger
    return StrategyRow(name, plan.step_s, led.peak_memory_bytes, plan.fits, None, led.compute_s, led.comm_s, 0.0,
                       compiled)


def pipeline_compiled(plan: Plan, step: Callable[..., object], args: Sequence[object]) -> CompiledRow | None:
    """A pipeline plan's stage executables compiled in this process (``compiler/compile_plans.compile_pipeline``:
    a 16-device plan's stages on 8 simulated devices) and its step priced from them
    (``compiler/verify_pipeline.compiled_pipeline_price``); None (logged) when it does not compile."""
    from autoshard.compiler.compile_plans import compile_pipeline
    from autoshard.compiler.verify_pipeline import compiled_pipeline_price

    start = time.perf_counter()
    try:
        price = compiled_pipeline_price(plan, compile_pipeline(plan, step, args))
    except Exception:  # noqa: BLE001 — a benchmark records the failure and keeps the modeled row
        log.exception("%s: compiling the pipeline failed", plan.name)
        return None
    log.info("%s compiled in %.0f s:\n%s", plan.name, time.perf_counter() - start, price)
    return CompiledRow(price.step_s, price.busy_compute_s, price.busy_collectives_s, math.nan, math.nan, True,
                       price.cross_node_collectives, "here, stage by stage")


def _long_solve(comparison: Comparison, options: IntraOpOptions, time_limit_s: float) -> LongSolve | None:
    """Solve again, hinted as ``compare`` hints (the fastest fitting baseline's strategies), for longer."""
    best = comparison.fallback
    planned = comparison.autoshard.planned
    if planned is None:
        return None
    hint = tuple(best.planned.result.node_strategies) if best is not None and best.planned is not None else None
    opts = replace(options, time_limit_s=time_limit_s, hint=hint)
    again = plan_graph(planned.graph, mesh=planned.logical_mesh.shape, cluster=planned.logical_mesh.cluster,
                       memory_budget=comparison.memory_budget_bytes, options=opts, explain=False)
    s = again.plan.solver
    return LongSolve(time_limit_s, again.plan.step_s, s.status, s.gap, float(again.plan.planning_s["intra-op"]))


def _with_compiled(result: CellResult, comparison: Comparison) -> CellResult:
    """Every plan's compiled price from the comparison's arbitration, the contest, and the objective check."""
    arbitration = comparison.arbitration
    checked = objective_row(comparison.autoshard.planned)
    if arbitration is None or result.autoshard is None:
        return replace(result, objective=checked)
    by_name = {c.name: c for c in arbitration.contenders}
    auto = replace(result.autoshard, compiled=compiled_row(arbitration.winner))
    rows = tuple(replace(row, compiled=compiled_row(by_name[row.name])) if row.name in by_name else row
                 for row in result.baselines)
    return replace(result, autoshard=auto, baselines=rows, contest=contest_rows(arbitration),
                   arbitration_s=arbitration.seconds, objective=checked)


def _with_fidelity(result: CellResult, comparison: Comparison, workload: Workload) -> CellResult:
    """autoshard's plan against XLA's program of it: the arbitration's compile when it ran here (on this
    process's devices, donation included), else a compile of its own."""
    import jax

    from autoshard.compiler.verify import compare as fidelity_compare, verify_compiled
    from autoshard.runtime.run import run
    from autoshard.runtime.spmd import make_jax_mesh

    plan = comparison.autoshard.plan
    won = comparison.arbitration.winner.compiled if comparison.arbitration is not None else None
    if won is not None and won.summary is not None and won.where == "here":
        rows = tuple(FidelityRow(r.what, r.predicted, r.compiled, r.rel_error, r.ok)
                     for r in fidelity_compare(plan, won.summary).rows)
        return replace(result, fidelity=Fidelity(rows, won.compile_s))
    if math.prod(plan.mesh_shape) > len(jax.devices()):
        note = (f"needs {math.prod(plan.mesh_shape)} devices, jax has {len(jax.devices())}: set XLA_FLAGS="
                f"--xla_force_host_platform_device_count={FIDELITY_DEVICES} before jax is imported")
        return replace(result, fidelity=Fidelity(error=note))
    start = time.perf_counter()
    try:
        mesh = make_jax_mesh(tuple(plan.mesh_shape), plan.axis_names)
        compiled = run(plan, workload.step, mesh).lower(*workload.args).compile()
        report = verify_compiled(plan, compiled)
    except Exception as err:  # noqa: BLE001 — a benchmark records a failed compile and carries on
        log.warning("%s: compiling the plan failed: %s", result.cell, err)
        return replace(result, fidelity=Fidelity(compile_s=time.perf_counter() - start,
                                                 error=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"))
    rows = tuple(FidelityRow(r.what, r.predicted, r.compiled, r.rel_error, r.ok) for r in report.rows)
    return replace(result, fidelity=Fidelity(rows, time.perf_counter() - start))


# Relative planning cost of a workload's cells, to start the longest first when cells run in parallel.
EXPECTED_COST = {("gpt", "xl"): 8.0, ("moe", "large"): 6.0, ("gpt", "large"): 4.0, ("gpt", "medium"): 3.0}


def _stamp(start: float, cell: Cell, msg: str) -> None:
    print(f"{time.time() - start:7.1f}s {cell}: {msg}", flush=True)


def _run_group(cells: Sequence[Cell], options: IntraOpOptions, start: float) -> list[CellResult]:
    """One workload's cells in one process, so its trace is reused (the unit of parallel work)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")  # a spawned worker
    cache = WorkloadCache()
    return [run_cell(cell, cache, options, lambda msg, c=cell: _stamp(start, c, msg)) for cell in cells]


def run_cells(cells: Sequence[Cell], options: IntraOpOptions, jobs: int = 1,
              progress: Callable[[Cell, str], None] | None = None) -> list[CellResult]:
    """Every cell, in ``cells`` order. ``jobs`` > 1: workloads spread over that many processes
    (spawned, so each imports jax afresh with the parent's XLA_FLAGS); progress is then printed by them."""
    if jobs <= 1:
        cache = WorkloadCache()
        out = []
        for cell in cells:
            say: Progress = (lambda msg, c=cell: progress(c, msg)) if progress else (lambda _msg: None)
            out.append(run_cell(cell, cache, options, say))
        return out
    groups: dict[tuple[str, str, int | None], list[Cell]] = collections.defaultdict(list)
    for cell in cells:
        groups[(cell.model, cell.config, cell.batch_size)].append(cell)
    order = sorted(groups.values(), key=lambda g: -EXPECTED_COST.get((g[0].model, g[0].config), 1.0) * len(g))
    start = time.time()
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_run_group, group, options, start) for group in order]
        done = {r.cell: r for f in futures for r in f.result()}
    return [done[cell] for cell in cells]


def geomean(values: Sequence[float]) -> float | None:
    values = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None
