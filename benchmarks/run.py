"""Run the benchmarks and write benchmarks/RESULTS.md.

    python -m benchmarks.run [--quick] [--out benchmarks/RESULTS.md] [--time-limit 10]

Default set: GPT small / medium / large / xl, the MoE transformer (large) and
the wide ResNet (convnet large) on one 8-GPU node (1x8-a100, mesh 2x4), two
nodes with a slow link (2x8-a100, 2x8) and four H100 nodes (4x8-h100, 4x8).
Every cell runs ``compare`` with compiled arbitration: autoshard's plan, its
next-best plans and every classic plan are compiled by XLA:CPU (8 simulated
devices in this process; 16 or 32 in a child process per cell) and priced
from their HLO on the cell's cluster; the targets are rated on those compiled
prices. autoshard's one-node plans are also set against the compiled HLO
figure by figure (fidelity); then the planning-time scaling study
(``benchmarks/planning_scaling.py``) and the planning time with pipeline stages
searched on two nodes (``benchmarks/stage_search_time.py``). ``--quick`` runs
the small configs only, skips both, and writes a file only when ``--out`` is
given.

Everything but planning time is modeled (cost model, compiled HLO): the
sharded steps are never timed on this CPU.
"""
from __future__ import annotations

import os

# 8 simulated CPU devices for the fidelity compiles; must be set before jax is imported.
from benchmarks.devices import simulate_devices

simulate_devices(8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# LLVM at -O0 for XLA:CPU's kernels: compiles faster; the optimized HLO, cost_analysis() and
# memory_analysis() the prices are read from do not change (tests/conftest.py checks the same flag).
if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import multiprocessing  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from concurrent.futures import ProcessPoolExecutor  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

from rich.console import Console  # noqa: E402

from autoshard.passes.intra_op import IntraOpOptions  # noqa: E402
from benchmarks import planning_scaling, stage_search_time  # noqa: E402
from benchmarks.machine import LoadSampler, Machine, describe  # noqa: E402
from benchmarks.quality import Cell, CellResult, run_cells  # noqa: E402
from benchmarks.sections import carry_over, replace_section, section  # noqa: E402
from benchmarks.tables import (baselines_table, contest_table, fidelity_table, hot_ops_table,  # noqa: E402
                               hotspot_table, long_solve_table, quality_table, render_markdown, render_rich,
                               scaling_fit_table, scaling_table)
from benchmarks.targets import Target, evaluate  # noqa: E402

CLUSTERS = ("1x8-a100", "2x8-a100", "4x8-h100")
# (model, config, global batch or None for the config's own). GPT-xl (6.9B) keeps every attention
# score in fp32 with no rematerialization: at its config's batch of 48 (or 16) no plan fits 80 GiB on one
# node, at 8 autoshard's does, so it runs at 8 on every cluster.
WORKLOADS: tuple[tuple[str, str, int | None], ...] = (
    ("gpt", "small", None), ("gpt", "medium", None), ("gpt", "large", None), ("gpt", "xl", 8),
    ("moe", "large", None), ("moe_topk", "large", None), ("convnet", "large", None),
    ("gpt_scan", "medium", None))  # gpt-medium with its blocks under nnx.scan: the body planned once
# Workloads whose one-node plan is also compiled for 8 simulated CPU devices (7-30 s each; gpt-xl left out).
FIDELITY = (("gpt", "small"), ("gpt", "medium"), ("gpt", "large"), ("moe", "large"), ("convnet", "large"),
            ("gpt_scan", "medium"))
# Cells re-solved with a long CP-SAT limit, to tell a solver that ran out of time from a search space (and
# cost model) that holds nothing better: a two-node dense cell and the two-node MoE cell.
LONG_SOLVE = (("gpt", "large", "2x8-a100"), ("moe", "large", "2x8-a100"))
LONG_SOLVE_S = 60.0
# (model, cluster) whose cells also plan pipelines (stages searched) and uniform GPipe: two nodes, where the
# slow link makes pipelining pay; the MoE cells too (each stage's plan may split its experts inside a node)
PIPELINE = (("gpt", "2x8-a100"), ("moe", "2x8-a100"), ("moe_topk", "2x8-a100"))
DEFAULT_OUT = Path(__file__).with_name("RESULTS.md")
SCALING_HEADING = "## Planning time against depth"
# the comparison solves at the planner's own default: a shorter limit rated plans no user gets (gpt-small on
# 1x8-a100 at 2 s: an unproven plan whose compiled collectives were 35% over the model's; at 10 s proven, exact)
DEFAULT_TIME_LIMIT_S = IntraOpOptions().time_limit_s
GAP_NOTE = (
    "*gap / status* is that of autoshard's solve in the cell. Where the cells run in parallel (see Run), a solve "
    "not proven within its limit may find no spare core for the cold start whose stopped dual simplex gives the "
    "bound (`autoshard/passes/ilp/lp.py`, `spare_core`): \"no bound\" there. "
    "`benchmarks/SOLVER_GAPS.md` (`python -m benchmarks.solver_gaps`) solves every cell alone at the planner's "
    "default limit and gives each one's gap and bound.")
PROFILED_LAYERS = 24  # the depth whose planning run is profiled to say where planning time goes
PROFILE_TITLE = f"where planning time goes: the {PROFILED_LAYERS}-layer GPT on (2, 4) under cProfile"


def default_cells() -> list[Cell]:
    cells = [Cell(m, c, cluster, batch, fidelity=(m, c) in FIDELITY and cluster == "1x8-a100",
                  long_solve_s=LONG_SOLVE_S if (m, c, cluster) in LONG_SOLVE else None,
                  pipeline=(m, cluster) in PIPELINE)
             for m, c, batch in WORKLOADS for cluster in CLUSTERS]
    return cells


def quick_cells() -> list[Cell]:
    return [Cell("gpt", "small", "1x8-a100", fidelity=True), Cell("moe", "small", "1x8-a100", fidelity=True),
            Cell("convnet", "small", "1x8-a100", fidelity=True), Cell("gpt", "tiny", "2x8-a100", pipeline=True)]


# ----------------------------------------------------------------------------- RESULTS.md


@dataclass(frozen=True)
class RunSettings:
    time_limit_s: float  # ILP seconds per solve in the comparison cells
    scaling_time_limit_s: float  # the same in the scaling study (the planner's default)
    jobs: int  # processes for the comparison cells
    runtime_s: float  # wall time of the whole run
    load: str  # the 1-minute load average sampled during the run
    cpu_s: float  # CPU seconds of this process and its workers


def _machine_lines(machine: Machine, run: RunSettings) -> list[str]:
    load_after = machine.load_now()
    versions = ", ".join(f"{k} {v}" for k, v in machine.versions.items())
    return [
        f"- command: `{machine.command}`",
        f"- date: {machine.date}; commit {machine.commit}",
        f"- machine: {machine.host}; {machine.cpus} CPUs (`nproc`), {machine.memory_gib:.0f} GiB memory",
        f"- load average (1/5/15 min): {'/'.join(f'{x:.2f}' for x in machine.load_before)} at the start, "
        f"{'/'.join(f'{x:.2f}' for x in load_after)} at the end. The two cores are shared with other work; "
        f"a load above {machine.cpus} means planning seconds here are pessimistic by about load / cores. "
        f"1-minute load during the run: {run.load}. Planning-time tables also give CPU seconds, which the "
        "load disturbs much less.",
        f"- versions: {versions}",
        f"- ILP time limit: {run.time_limit_s:g} s per solve in the comparison (7 solves per cell, then up to 3 "
        f"next-best re-solves for compiled arbitration; the planner's default is {run.scaling_time_limit_s:g} s), "
        f"{run.scaling_time_limit_s:g} s in the scaling study",
        f"- the comparison cells ran in {run.jobs} process{'es' if run.jobs > 1 else ''} (one workload at a time "
        "each), the scaling study and the stage search alone after them, in a fresh process of their own",
        f"- wall time of this run: {run.runtime_s / 60:.1f} min; CPU time {run.cpu_s / 60:.1f} min over all its "
        f"processes, so about {run.cpu_s / 60 / max(run.jobs, 1):.1f} min of wall time on {run.jobs} idle "
        f"core{'s' if run.jobs > 1 else ''} (the scaling study does not run in parallel, so somewhat more)",
    ]


def _targets_md(targets: Sequence[Target]) -> str:
    lines = ["| target | result | detail |", "|---|---|---|"]
    for t in targets:
        lines.append(f"| {t.name} | **{t.verdict}** | {t.detail.replace('|', '/')} |")
    return "\n".join(lines)


def markdown(machine: Machine, run: RunSettings, results: Sequence[CellResult],
             points: Sequence[planning_scaling.ScalingPoint], targets: Sequence[Target],
             spots: Sequence[planning_scaling.Hotspot] = (),
             staged: Sequence[stage_search_time.StageSearchPoint] = ()) -> str:
    parts = [
        "# Benchmark results",
        "",
        "Written by `python -m benchmarks.run` (benchmarks/run.py); regenerate rather than edit. "
        "Step times, memory and collective bytes are **modeled** (autoshard's alpha-beta + roofline cost model "
        "of the named ClusterSpec) and **compiled**: each plan compiled by XLA:CPU (8 simulated devices, or 16 "
        "and 32 in a child process) and priced from its HLO on the same ClusterSpec (FLOPs at peak, bytes "
        "accessed at HBM bandwidth, each collective at its replica groups' links and node crossings, "
        "`autoshard/compiler/verify.py`); the targets are rated on the compiled prices. Only planning seconds are "
        "measured on this machine.",
        "",
        "## Run",
        "",
        *_machine_lines(machine, run),
        "",
        "## Targets",
        "",
        _targets_md(targets),
        "",
        "## Plan quality",
        "",
        "Each cell plans the six classic strategies (DP, FSDP/ZeRO-3, ZeRO-2, HSDP, Megatron TP, DP x TP: their "
        "storage layouts pinned, every op's strategy left to the same ILP, `autoshard/compiler/baselines.py`) and then "
        "autoshard hinted with the fastest that fits. *speedup* is the fastest classic strategy that fits the "
        "80 GiB budget over autoshard's modeled step (its pipeline's where the cell plans one and it is faster: "
        "what autoshard returns with stages searched; \"kept X\": the solver did not beat its hint X, whose plan "
        "is kept). *of compute bound* is total FLOPs / (devices x peak) over the step. *batch ceiling* is the "
        "largest global batch whose modeled peak fits. Planning seconds are autoshard's own passes; the whole "
        "comparison (seven solves and two traces) takes longer, see the details. On two nodes the GPT cells also "
        "plan a pipeline (stages, sub-meshes, logical meshes, microbatches and recomputation searched; every "
        "stage's time and memory from the same intra-op model on its sub-mesh, `passes/stage_costs.py`) and "
        "uniform GPipe (equal stages, data parallel inside, a classic row): *pipeline speedup* is the fastest "
        "fitting other row (autoshard's SPMD plan, every classic strategy, uniform GPipe) over the pipeline's "
        "modeled step.",
        "",
        render_markdown(quality_table(results)),
        "",
        GAP_NOTE,
        "",
        "*autoshard compiled* is the program compiled arbitration returned (the fastest compiled program among "
        "autoshard's plan, its next-best distinct plans and every classic plan that fits); *compiled speedup* is "
        "the fastest compiled classic program that fits over it. *objective* is the objective checker on "
        "autoshard's plan: the ILP's objective, the objective recomputed on the unsimplified graph and the "
        "ledger's step, which must agree.",
        "",
        render_markdown(contest_table(results)),
        "",
        render_markdown(hot_ops_table(results)),
        "",
        "*best classic / FLOP bound*: the fastest fitting classic plan over total FLOPs / (devices x peak). "
        "*best classic / least compute*: the same plan over the least compute time of any plan in the cell "
        "(the model's compute is a roofline per op, memory-bound ops at HBM bandwidth): what a plan that kept "
        "that compute and had no communication at all would gain.",
        "",
        *([render_markdown(long_solve_table(results)), "",
           "\"optimal\": CP-SAT proved that no plan in autoshard's search space is cheaper under the model, "
           "so a missed speedup there is the search space's or the model's, not the solver's.", ""]
          if any(r.long_solve for r in results) else []),
        "## Fidelity: how far the model can be trusted",
        "",
        "autoshard's plans on one node (mesh 2x4), compiled by XLA:CPU for 8 simulated devices "
        "(`compiler/verify.py`): per-device collective bytes read from the optimized HLO (loop trip counts "
        "applied, all-reduce + dynamic-slice counted as reduce-scatter) and `memory_analysis()` peak "
        "(argument + output - alias + temp) against the plan's ledger.",
        "",
        render_markdown(fidelity_table(results)) if any(r.fidelity for r in results) else "(not run)",
        "",
    ]
    if points:
        parts += [
            SCALING_HEADING,
            "",
            planning_scaling.__doc__.split("\n\n", 2)[1].replace("\n", " "),
            "",
            render_markdown(scaling_table(points)),
            "",
            render_markdown(scaling_fit_table(points)),
            "",
        ]
    if spots:
        parts += [render_markdown(hotspot_table(spots, PROFILE_TITLE)), ""]
    if staged:
        parts += ["### With pipeline stages searched", "",
                  stage_search_time.__doc__.split("\n\n", 2)[1].replace("\n", " "), "",
                  stage_search_time.markdown(staged), ""]
    parts += [
        "## Details: every strategy in every cell",
        "",
        "Comparison wall time per cell: " + ", ".join(f"{r.cell} {r.compare_s:.0f} s" for r in results) + ".",
        "",
        render_markdown(baselines_table(results)),
        "",
    ]
    return "\n".join(parts)


# ----------------------------------------------------------------------------- main


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its finished worker processes."""
    own, workers = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + workers.ru_utime + workers.ru_stime


def merged(old: str, new: str, commit: str, scaled: bool) -> str:
    """``new`` with the sections other runners own carried over from ``old`` (the fuzz corpus) and, when this
    run skipped the scaling study, the last one, marked as carried over."""
    text = carry_over(old, new)
    kept = section(old, SCALING_HEADING) if not scaled else None
    if kept is None:
        return text
    heading, _, body = kept.partition("\n")
    return replace_section(text, SCALING_HEADING, f"{heading}\n\n*Carried over from an earlier run in this file: "
                           f"this run (commit {commit}) skipped the scaling study (`--no-scaling`).*\n{body}")


def write_decisions(folder: Path, results: Sequence[CellResult]) -> None:
    """``folder/<workload>_<cluster>.json``: each cell's plan decisions (``quality.plan_decisions``)."""
    folder.mkdir(parents=True, exist_ok=True)
    for r in results:
        decided = {"error": r.error, "autoshard": r.decisions, "pipeline": r.pipeline_decisions}
        (folder / f"{r.cell.workload}_{r.cell.cluster}.json").write_text(json.dumps(decided, indent=1) + "\n")


def timing_studies(options: IntraOpOptions, start: float) -> tuple[
        list[planning_scaling.ScalingPoint], tuple[planning_scaling.Hotspot, ...],
        list[stage_search_time.StageSearchPoint]]:
    """The planning-time scaling study, its profile and the stage search's times, run by ``main`` in a
    process of their own (spawned: jax imported afresh), so planning is timed as a user's process plans and
    not in one that holds every cell's results (whose heap the garbage collector walks: the 192-layer plan's
    decode + memory took 8.5 s there against 4.5 s in a process of its own). ``start``: the run's start, for
    the progress lines."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    def say(msg: str) -> None:
        print(f"{time.time() - start:7.1f}s {msg}", flush=True)

    points = planning_scaling.run(options=options, progress=lambda msg: say(f"scaling: {msg}"))
    say(f"scaling: profiling the {PROFILED_LAYERS}-layer plan on (2, 4)")
    spots = tuple(planning_scaling.hotspots(PROFILED_LAYERS, "1x8-a100", (2, 4), options))
    staged = stage_search_time.run(progress=lambda msg: say(f"stage search: {msg}"))
    return points, spots, staged


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small configs only, no scaling study (~8 CPU min)")
    parser.add_argument("--out", type=Path, default=None,
                        help="markdown file to write (default benchmarks/RESULTS.md; with --quick: none)")
    parser.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT_S,
                        help="ILP seconds per solve in the comparison cells (default: the planner's own)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="processes for the comparison cells (one workload per process at a time; the "
                             "scaling study always runs alone)")
    parser.add_argument("--no-scaling", action="store_true", help="skip the planning-time scaling study")
    parser.add_argument("--cells", nargs="+", default=None, metavar="WORKLOAD:CLUSTER",
                        help="only these cells of the run (e.g. gpt-medium:2x8-a100); the markdown then holds "
                             "those cells only: write it elsewhere than RESULTS.md")
    parser.add_argument("--plans", type=Path, default=None, metavar="DIR",
                        help="write each cell's decisions (autoshard's plan, its best pipeline) to DIR/<cell>.json: "
                             "diff two runs' folders to check that a change kept every plan")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    console = Console(width=None if sys.stdout.isatty() else 200)
    machine = describe(["run.py", *(argv if argv is not None else sys.argv[1:])])
    start, started_at = time.perf_counter(), time.time()

    def say(msg: str) -> None:
        console.print(f"[dim]{time.perf_counter() - start:7.1f}s {msg}[/dim]")

    cells = quick_cells() if args.quick else default_cells()
    if args.cells is not None:
        known = {f"{c.workload}:{c.cluster}": c for c in cells}
        unknown = [name for name in args.cells if name not in known]
        if unknown:
            parser.error(f"unknown cell(s) {', '.join(unknown)}; the run has {', '.join(known)}")
        if args.out is None or args.out.resolve() == DEFAULT_OUT.resolve():
            parser.error("--cells writes a partial table: give --out another file than RESULTS.md")
        cells = [known[name] for name in args.cells]
    options = IntraOpOptions(time_limit_s=args.time_limit)
    points: list[planning_scaling.ScalingPoint] = []
    spots: tuple[planning_scaling.Hotspot, ...] = ()
    staged: list[stage_search_time.StageSearchPoint] = []
    scaling_options = IntraOpOptions()  # what @autoshard and autoshard.plan use
    with LoadSampler() as load:
        results = run_cells(cells, options, jobs=args.jobs, progress=lambda cell, msg: say(f"{cell}: {msg}"))
        console.print(render_rich(quality_table(results)))
        console.print(render_rich(contest_table(results)))
        if any(r.long_solve for r in results):
            console.print(render_rich(long_solve_table(results)))
        if any(r.fidelity for r in results):
            console.print(render_rich(fidelity_table(results)))
        if not (args.quick or args.no_scaling):
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                points, spots, staged = pool.submit(timing_studies, scaling_options, started_at).result()
            console.print(render_rich(scaling_table(points)))
            console.print(render_rich(scaling_fit_table(points)))
            console.print(render_rich(hotspot_table(spots, PROFILE_TITLE)))
            console.print(stage_search_time.markdown(staged))

    if args.plans is not None:
        write_decisions(args.plans, results)
        console.print(f"wrote each cell's decisions under {args.plans}")
    targets = evaluate(results, points, spots, staged)
    for t in targets:
        console.print(f"[bold]{t.verdict:>7}[/bold]  {t.name}: {t.detail}")
    runtime_s = time.perf_counter() - start
    console.print(f"finished in {runtime_s / 60:.1f} min ({_cpu_seconds() / 60:.1f} CPU min); 1-minute load "
                  f"average {load.summary()}")
    out = args.out if args.out is not None else (None if args.quick else DEFAULT_OUT)
    if out is not None:
        run = RunSettings(args.time_limit, scaling_options.time_limit_s, args.jobs, runtime_s, load.summary(),
                          _cpu_seconds())
        text = markdown(machine, run, results, points, targets, spots, staged)
        out.write_text(merged(out.read_text(), text, machine.commit, bool(points)) if out.exists() else text)
        console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
