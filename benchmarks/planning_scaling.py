"""Planning time against model depth: GPT with 2 to 96 layers on a (2, 4) mesh and on 2 x 8.

The layers are gpt-large's (d_model 2048, 16 heads, sequence 1024) at a global batch of 8, so that a plan
fits 80 GiB per device up to 96 layers (5 billion parameters).

    python -m benchmarks.planning_scaling [--layers 2 6 12 24 48 96] [--time-limit 10]

Each depth is traced once (the trace does not depend on the mesh) and planned
on each mesh with the options ``@autoshard`` and ``autoshard.plan`` use (the
defaults, searching from every classic strategy's layouts too).
Seconds are split by pass (trace, intra-op) and inside the intra-op pass into
the build (strategy enumeration, resharding cost matrices, merged classes,
memory points, the ILP itself), the solve (deterministic local search, then
CP-SAT up to its time limit) and the rest (decoding the solution, the
simulated memory profile, the ledger). ``fit`` fits ``seconds = c * layers^k`` by least squares
on log-log axes; k <= 1 means planning time grows at most linearly with depth.
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import logging
import math
import pstats
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.compiler.driver import plan_graph
from autoshard.ir.trace import trace
from autoshard.errors import PlanningError
from autoshard.passes.intra_op import IntraOpOptions
from examples import gpt
from examples.common import count_params

log = logging.getLogger(__name__)

DEPTHS = (2, 6, 12, 24, 48, 96)
MESHES: tuple[tuple[str, tuple[int, ...]], ...] = (("1x8-a100", (2, 4)), ("2x8-a100", (2, 8)))
BASE_CONFIG = "large"  # d_model 2048, seq 1024
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


def run(depths: Sequence[int] = DEPTHS, meshes: Sequence[tuple[str, tuple[int, ...]]] = MESHES,
        options: IntraOpOptions | None = None, progress: Callable[[str], None] | None = None,
        base_config: str = BASE_CONFIG, batch_size: int | None = BATCH_SIZE) -> list[ScalingPoint]:
    say = progress or (lambda _msg: None)
    options = options or IntraOpOptions()
    points: list[ScalingPoint] = []
    for layers in depths:
        config = dataclasses.replace(gpt.CONFIGS[base_config], num_layers=layers)
        workload = gpt.workload(config, abstract=True, batch_size=batch_size)
        say(f"{layers} layers: tracing")
        start, cpu = time.perf_counter(), time.process_time()
        graph = trace(workload.step, *workload.args)
        trace_s, trace_cpu_s = time.perf_counter() - start, time.process_time() - cpu
        for cluster, mesh in meshes:
            say(f"{layers} layers: planning on {cluster} {'x'.join(map(str, mesh))}")
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
            points.append(ScalingPoint(
                layers, cluster, mesh, count_params(workload.args[0]), len(graph.ops), trace_s,
                planned.plan.planning_s["intra-op"], s.build_s, s.solve_s, s.num_nodes, s.num_classes,
                s.num_variables, s.num_constraints, s.num_edges, s.status, s.gap, trace_cpu_s, intra_cpu_s))
    return points


@dataclass(frozen=True)
class Hotspot:
    function: str  # "autoshard/passes/memory_model.py:simulate"
    cumulative_s: float  # under the profiler (which slows pure-Python code down)
    share: float  # of the profiled trace + plan


def hotspots(layers: int, cluster: str, mesh: tuple[int, ...], options: IntraOpOptions | None = None,
             base_config: str = BASE_CONFIG, batch_size: int | None = BATCH_SIZE, top: int = 10
             ) -> tuple[Hotspot, ...]:
    """Trace and plan one depth under cProfile; the autoshard functions with the most cumulative time.

    Run apart from the timed points (the profiler slows Python down); shares are what matter. The top-level
    wrappers (more than 95% of the total) are left out, so the list starts at the passes.
    """
    config = dataclasses.replace(gpt.CONFIGS[base_config], num_layers=layers)
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
    """Power-law fits of each pass's seconds against depth on one cluster."""
    mine = [p for p in points if p.cluster == cluster and p.error is None]
    xs = [p.layers for p in mine]
    return {
        "total": fit_power_law(xs, [p.total_s for p in mine]),
        "trace": fit_power_law(xs, [p.trace_s for p in mine]),
        "intra-op": fit_power_law(xs, [p.intra_op_s for p in mine]),
        "build": fit_power_law(xs, [p.build_s for p in mine]),
        "solve": fit_power_law(xs, [p.solve_s for p in mine]),
        "decode + memory": fit_power_law(xs, [p.other_s for p in mine]),
        "total without solve": fit_power_law(xs, [p.total_s - p.solve_s for p in mine]),
        "total CPU": fit_power_law(xs, [p.total_cpu_s for p in mine]),
    }


def main() -> None:
    from rich.console import Console

    from benchmarks.tables import render_rich, scaling_fit_table, scaling_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=list(DEPTHS))
    parser.add_argument("--time-limit", type=float, default=IntraOpOptions().time_limit_s,
                        help="CP-SAT seconds per solve (default: the planner's default)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    console = Console()
    start = time.perf_counter()
    points = run(args.layers, options=IntraOpOptions(time_limit_s=args.time_limit),
                 progress=lambda msg: console.print(f"[dim]{time.perf_counter() - start:7.1f}s {msg}[/dim]"))
    console.print(render_rich(scaling_table(points)))
    console.print(render_rich(scaling_fit_table(points)))


if __name__ == "__main__":
    main()
