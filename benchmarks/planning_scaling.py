"""Planning time against model depth: GPT with 12 to 192 layers on a (2, 4) mesh, every pass timed.

The layers are gpt-large's (d_model 2048, 16 heads) at sequence 512 and a global batch of 8, so that a plan
fits 80 GiB per device at every depth (192 layers: 10 billion parameters; at sequence 1024 the smallest
budget that fits 192 layers is 89.3 GiB, and that depth stopped with InfeasibleMemoryError).

    python -m benchmarks.planning_scaling [--layers 12 24 48 96 192] [--json out.json] [--markdown out.md]

Each depth is traced once (abstract parameters, nothing compiled) and planned on each mesh with the
options ``@autoshard`` and ``autoshard.plan`` use (one stage: the SPMD planner; no compiled arbitration).
Each pass is timed in wall and CPU seconds (``time.process_time``: this process, all threads), the
planner's own record (``IlpStats.pass_times``) for the passes inside the intra-op planner: trace; build
(strategies, classes, cost terms, search starts, the ILP); solve (HiGHS up to its time limit, the
least-memory solves if any); decode (specs, reshards, pricing, the objective check); memory (the
simulated memory profile). ``fit`` fits ``seconds = c * layers^k`` by least squares on log-log axes per
pass; k <= 1.05 is the target for every pass but the solve, which its time limit caps. The machine's load
average is recorded beside each depth: on a shared machine CPU seconds are the figure to read.
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import logging
import math
import pstats
import time
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.compiler.collector import collector_paused
from autoshard.compiler.driver import plan_graph
from autoshard.ir.trace import trace
from autoshard.errors import PlanningError
from autoshard.passes.intra_op import IntraOpOptions
from benchmarks.machine import recorded_args
from examples import gpt
from examples.common import count_params

log = logging.getLogger(__name__)

DEPTHS = (12, 24, 48, 96, 192)
MESHES: tuple[tuple[str, tuple[int, ...]], ...] = (("1x8-a100", (2, 4)),)
PASSES = ("trace", "build", "solve", "decode", "memory")
LINEAR_EXPONENT = 1.05  # the most any pass but the solve may grow with depth (seconds ~ layers^k)
BASE_CONFIG = "large"  # d_model 2048
SEQ_LEN = 512  # gpt-large's 1024 leaves 192 layers no plan in 80 GiB (module docstring)
# At gpt-large's batch of 48, 48 or more such layers fit no plan in 80 GiB on 8 devices (every attention score
# is kept in fp32): the planner then stops early with InfeasibleMemoryError and times nothing useful.
BATCH_SIZE = 8


@dataclass(frozen=True)
class ScalingPoint:
    layers: int
    cluster: str
    mesh: tuple[int, ...]
    num_params: int
    num_ops: int
    trace_s: float
    intra_op_s: float
    build_s: float  # strategies, cost matrices, classes, ILP (inside intra-op)
    solve_s: float  # local search + CP-SAT (inside intra-op)
    nodes: int
    classes: int
    variables: int
    constraints: int
    edges: int
    status: str
    gap: float
    trace_cpu_s: float  # CPU seconds of this process (all threads): what the pass costs on an unloaded core
    intra_op_cpu_s: float
    error: str | None = None
    pass_s: Mapping[str, float] = dataclasses.field(default_factory=dict)  # wall seconds per pass (PASSES)
    pass_cpu_s: Mapping[str, float] = dataclasses.field(default_factory=dict)  # CPU seconds per pass
    load: tuple[float, float] = (math.nan, math.nan)  # 1-minute load average before and after planning
    pass_runs: Mapping[str, int] = dataclasses.field(default_factory=dict)  # times each pass ran (budget search)

    @property
    def total_s(self) -> float:
        return self.trace_s + self.intra_op_s

    @property
    def total_cpu_s(self) -> float:
        return self.trace_cpu_s + self.intra_op_cpu_s

    @property
    def other_s(self) -> float:
        """Intra-op seconds after the solve: decoding, the memory profile, the ledger."""
        return self.intra_op_s - self.build_s - self.solve_s


@dataclass(frozen=True)
class Fit:
    exponent: float  # k in seconds = c * layers^k
    coefficient: float  # c
    r2: float

    def __str__(self) -> str:
        return f"t ~ {self.coefficient:.3g} * L^{self.exponent:.2f} (R^2 {self.r2:.2f})"


def fit_power_law(layers: Sequence[float], seconds: Sequence[float]) -> Fit | None:
    """Least squares of log(seconds) on log(layers); None with fewer than two usable points."""
    pairs = [(x, y) for x, y in zip(layers, seconds) if x > 0 and y > 0 and math.isfinite(y)]
    if len(pairs) < 2:
        return None
    x = np.log([p[0] for p in pairs])
    y = np.log([p[1] for p in pairs])
    k, logc = np.polyfit(x, y, 1)
    residual = y - (k * x + logc)
    total = ((y - y.mean()) ** 2).sum()
    r2 = 1.0 - float((residual**2).sum() / total) if total > 0 else 1.0
    return Fit(float(k), float(math.exp(logc)), r2)


def _config(base_config: str, layers: int, seq_len: int | None) -> gpt.Config:
    """``base_config`` with ``layers`` layers (and ``seq_len`` tokens: None keeps the config's)."""
    config = dataclasses.replace(gpt.CONFIGS[base_config], num_layers=layers)
    return config if seq_len is None else dataclasses.replace(config, seq_len=seq_len)


def run(depths: Sequence[int] = DEPTHS, meshes: Sequence[tuple[str, tuple[int, ...]]] = MESHES,
        options: IntraOpOptions | None = None, progress: Callable[[str], None] | None = None,
        base_config: str = BASE_CONFIG, batch_size: int | None = BATCH_SIZE, seq_len: int | None = SEQ_LEN,
        after_each: Callable[[list[ScalingPoint]], None] | None = None) -> list[ScalingPoint]:
    """Trace and plan each depth (module docstring); ``after_each`` is told the points so far after each plan."""
    say = progress or (lambda _msg: None)
    options = options or IntraOpOptions()
    points: list[ScalingPoint] = []
    for layers in depths:
        config = _config(base_config, layers, seq_len)
        workload = gpt.workload(config, abstract=True, batch_size=batch_size)
        say(f"{layers} layers: tracing")
        start, cpu = time.perf_counter(), time.process_time()
        with collector_paused():  # as autoshard.plan traces (compiler/collector.py)
            graph = trace(workload.step, *workload.args)
        trace_s, trace_cpu_s = time.perf_counter() - start, time.process_time() - cpu
        for cluster, mesh in meshes:
            say(f"{layers} layers: planning on {cluster} {'x'.join(map(str, mesh))}")
            load_before = os.getloadavg()[0]
            start, cpu = time.perf_counter(), time.process_time()
            try:
                planned = plan_graph(graph, mesh=mesh, cluster=cluster, options=options, explain=False)
            except PlanningError as err:
                points.append(ScalingPoint(layers, cluster, mesh, count_params(workload.args[0]), len(graph.ops),
                                           trace_s, time.perf_counter() - start, math.nan, math.nan, 0, 0, 0, 0, 0,
                                           "error", math.nan, trace_cpu_s, time.process_time() - cpu,
                                           f"{type(err).__name__}: {str(err).splitlines()[0]}"))
                continue
            intra_cpu_s = time.process_time() - cpu
            s = planned.result.ilp
            times = s.pass_times
            build, solve = times.get("build"), times.get("solve")
            points.append(ScalingPoint(
                layers, cluster, mesh, count_params(workload.args[0]), len(graph.ops), trace_s,
                planned.plan.planning_s["intra-op"], build.wall_s if build else s.build_s,
                solve.wall_s if solve else s.solve_s, s.num_nodes, s.num_classes, s.num_variables,
                s.num_constraints, s.num_edges, s.status, s.gap, trace_cpu_s, intra_cpu_s,
                pass_s={"trace": trace_s, **{k: t.wall_s for k, t in times.items()}},
                pass_cpu_s={"trace": trace_cpu_s, **{k: t.cpu_s for k, t in times.items()}},
                load=(load_before, os.getloadavg()[0]), pass_runs={k: t.runs for k, t in times.items()}))
            if after_each is not None:
                after_each(points)
    return points


@dataclass(frozen=True)
class Hotspot:
    function: str  # "autoshard/passes/memory_model.py:simulate"
    cumulative_s: float  # under the profiler (which slows pure-Python code down)
    share: float  # of the profiled trace + plan


def hotspots(layers: int, cluster: str, mesh: tuple[int, ...], options: IntraOpOptions | None = None,
             base_config: str = BASE_CONFIG, batch_size: int | None = BATCH_SIZE, seq_len: int | None = SEQ_LEN,
             top: int = 10
             ) -> tuple[Hotspot, ...]:
    """Trace and plan one depth under cProfile; the autoshard functions with the most cumulative time.

    Run apart from the timed points (the profiler slows Python down); shares are what matter. The top-level
    wrappers (more than 95% of the total) are left out, so the list starts at the passes.
    """
    config = _config(base_config, layers, seq_len)
    workload = gpt.workload(config, abstract=True, batch_size=batch_size)
    profiler = cProfile.Profile()
    profiler.enable()
    graph = trace(workload.step, *workload.args)
    plan_graph(graph, mesh=mesh, cluster=cluster, options=options or IntraOpOptions(),
               explain=False)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (cc, nc, tottime, cumtime, callers)}
    total = sum(tt for _cc, _nc, tt, _ct, _callers in stats.values())
    rows = []
    for (path, _line, name), (_cc, _nc, _tt, cumulative, _callers) in stats.items():
        where = path.replace("\\", "/")
        if "/autoshard/" not in where or name.startswith("<") or cumulative > 0.95 * total:
            continue
        rows.append(Hotspot("autoshard/" + where.split("/autoshard/", 1)[1] + ":" + name, cumulative,
                            cumulative / total))
    return tuple(sorted(rows, key=lambda h: -h.cumulative_s)[:top])


def fits_by_pass(points: Sequence[ScalingPoint], cluster: str) -> dict[str, Fit | None]:
    """Power-law fits of each pass's seconds against depth on one cluster: wall seconds, then CPU seconds
    of each pass the planner timed (``PASSES``)."""
    mine = [p for p in points if p.cluster == cluster and p.error is None]
    xs = [p.layers for p in mine]
    fits = {
        "total": fit_power_law(xs, [p.total_s for p in mine]),
        "trace": fit_power_law(xs, [p.trace_s for p in mine]),
        "intra-op": fit_power_law(xs, [p.intra_op_s for p in mine]),
        "build": fit_power_law(xs, [p.build_s for p in mine]),
        "solve": fit_power_law(xs, [p.solve_s for p in mine]),
        "decode + memory": fit_power_law(xs, [p.other_s for p in mine]),
        "total without solve": fit_power_law(xs, [p.total_s - p.solve_s for p in mine]),
        "total CPU": fit_power_law(xs, [p.total_cpu_s for p in mine]),
    }
    for name in PASSES:
        if all(name in p.pass_cpu_s for p in mine):
            fits[f"{name} CPU"] = fit_power_law(xs, [p.pass_cpu_s[name] for p in mine])
    return fits


def superlinear_passes(points: Sequence[ScalingPoint], cluster: str,
                       limit: float = LINEAR_EXPONENT) -> dict[str, float]:
    """Passes (all but the solve, which its time limit caps) whose CPU seconds grow faster than
    layers^``limit``: name -> fitted exponent."""
    fits = fits_by_pass(points, cluster)
    out = {}
    for name in PASSES:
        fit = fits.get(f"{name} CPU")
        if name != "solve" and fit is not None and fit.exponent > limit:
            out[name] = fit.exponent
    return out


def as_json(points: Sequence[ScalingPoint]) -> dict:
    """Every point and, per cluster, every fit: what ``--json`` writes."""
    clusters = list(dict.fromkeys(p.cluster for p in points))
    return {
        "points": [dict(dataclasses.asdict(p), total_s=p.total_s, total_cpu_s=p.total_cpu_s) for p in points],
        "fits": {c: {k: (None if f is None else dataclasses.asdict(f)) for k, f in fits_by_pass(points, c).items()}
                 for c in clusters},
        "superlinear": {c: superlinear_passes(points, c) for c in clusters},
        "linear_exponent": LINEAR_EXPONENT,
    }


def _mesh(mesh: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, mesh)) + ")"


def pass_table_markdown(points: Sequence[ScalingPoint]) -> str:
    """Per depth, wall / CPU seconds of every pass and the load; then the per-pass CPU exponents."""
    head = "| layers | ops | " + " | ".join(f"{n} s (wall / CPU)" for n in PASSES) + " | total s (wall / CPU) | load |"
    lines = [head, "|" + "---:|" * (len(PASSES) + 4)]
    for p in points:
        if p.error:
            lines.append(f"| {p.layers} | {p.num_ops} | " + " | ".join("—" for _ in PASSES) + f" | — | {p.error} |")
            continue
        cells = [f"{p.pass_s.get(n, math.nan):.1f} / {p.pass_cpu_s.get(n, math.nan):.1f}"
                 + (f" ({p.pass_runs[n]}x)" if p.pass_runs.get(n, 1) > 1 else "") for n in PASSES]
        lines.append(f"| {p.layers} | {p.num_ops} | " + " | ".join(cells)
                     + f" | {p.total_s:.1f} / {p.total_cpu_s:.1f} | {p.load[0]:.1f} → {p.load[1]:.1f} |")
    for cluster in dict.fromkeys(p.cluster for p in points):
        fits = fits_by_pass(points, cluster)
        lines += ["", f"CPU seconds = c * layers^k on {cluster}:", "",
                  "| pass | k | R^2 |", "|---|---:|---:|"]
        for name in (*PASSES, "total"):
            fit = fits.get(f"{name} CPU")
            if fit is not None:
                lines.append(f"| {name} | {fit.exponent:.2f} | {fit.r2:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    from rich.console import Console

    from benchmarks.tables import render_rich, scaling_fit_table, scaling_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=list(DEPTHS))
    parser.add_argument("--time-limit", type=float, default=IntraOpOptions().time_limit_s,
                        help="solver seconds per solve (default: the planner's default)")
    parser.add_argument("--json", type=str, default=None, help="write every point and fit here")
    parser.add_argument("--markdown", type=str, default=None, help="write the per-pass table here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    console = Console()
    start, cpu = time.perf_counter(), time.process_time()
    load_start = " ".join(f"{x:.2f}" for x in os.getloadavg())
    console.print(f"load average at the start: {load_start}")
    def write(points: list[ScalingPoint]) -> None:  # after every depth: a long run killed keeps what it did
        load_now = " ".join(f"{x:.2f}" for x in os.getloadavg())
        if args.json:
            with open(args.json, "w") as f:
                json.dump(as_json(points), f, indent=1, default=str)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(f"Written by `python -m benchmarks.planning_scaling {' '.join(recorded_args(sys.argv[1:]))}`: GPT "
                        f"(d_model 2048, sequence {SEQ_LEN}, batch {BATCH_SIZE}) on {', '.join(f'{c} {_mesh(m)}' for c, m in MESHES)}, solver "
                        f"limit {args.time_limit:g} s; {os.cpu_count()} CPUs, load average (1/5/15 min) "
                        f"{load_start} at the start, {load_now} at the end; {time.perf_counter() - start:.0f} s "
                        f"wall, {time.process_time() - cpu:.0f} s CPU in all. The load column is the 1-minute "
                        f"average before and after each plan; (Nx): a pass the budget search ran N times."
                        f"\n\n{pass_table_markdown(points)}")

    points = run(args.layers, options=IntraOpOptions(time_limit_s=args.time_limit),
                 progress=lambda msg: console.print(f"[dim]{time.perf_counter() - start:7.1f}s {msg}[/dim]"),
                 after_each=write)
    console.print(render_rich(scaling_table(points)))
    console.print(render_rich(scaling_fit_table(points)))
    table = pass_table_markdown(points)
    console.print(table)
    for cluster in dict.fromkeys(p.cluster for p in points):
        slow = superlinear_passes(points, cluster)
        verdict = ("every pass but the solve within L^" + f"{LINEAR_EXPONENT}") if not slow else (
            "superlinear: " + ", ".join(f"{k} L^{v:.2f}" for k, v in slow.items()))
        console.print(f"{cluster}: {verdict}")
    console.print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
