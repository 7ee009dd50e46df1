"""The intra-op solve of every benchmark cell at the planner's default time limit: status, gap and bound.

    python -m benchmarks.solver_gaps [--out benchmarks/SOLVER_GAPS.md] [--time-limit 10]

RESULTS.md's comparison solves each cell at a short limit (seven solves per cell); this table solves each
cell once as ``autoshard.plan`` does (one stage, the planner's default limit and search starts) and gives
what the solver proved: "optimal", or the plan's gap to the solver's bound, and the seconds it took (wall
and CPU: the machine's load is noted). The cells are RESULTS.md's (``benchmarks/run.py``).
"""
from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from autoshard.compiler.driver import plan_graph
from autoshard.ir.trace import trace
from autoshard.passes.intra_op import IntraOpOptions
from autoshard.plans.ledger import fmt_gap
from benchmarks.quality import Cell, WorkloadCache
from benchmarks.run import default_cells

DEFAULT_OUT = Path(__file__).with_name("SOLVER_GAPS.md")


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


@dataclass(frozen=True)
class GapRow:
    cell: str
    status: str
    gap: float
    objective_s: float
    bound_s: float
    solve_s: float
    wall_s: float
    cpu_s: float
    columns: int


def measure(cell: Cell, cache: WorkloadCache, options: IntraOpOptions) -> GapRow:
    workload, _ = cache.get(cell)
    graph = trace(workload.step, *workload.args)
    wall, cpu = time.perf_counter(), time.process_time()
    planned = plan_graph(graph, mesh=cell.mesh, cluster=cell.cluster, options=options, explain=False)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    s = planned.result.ilp
    bound = s.objective_s * (1.0 - s.gap) if math.isfinite(s.gap) else math.nan
    return GapRow(str(cell), s.status, s.gap, s.objective_s, bound, s.solve_s, wall, cpu, s.num_variables)


def markdown(rows: Sequence[GapRow], options: IntraOpOptions, load: tuple[str, str], elapsed_s: float) -> str:
    solved = sum(r.status == "optimal" or r.gap <= 0.01 for r in rows)
    lines = [
        "# The intra-op solve at the planner's default time limit",
        "",
        f"Written by `python -m benchmarks.solver_gaps --out benchmarks/SOLVER_GAPS.md` (time limit "
        f"{options.time_limit_s:g} s, one stage, the cells of RESULTS.md); {os.cpu_count()} CPUs, load average "
        f"(1/5/15 min) {load[0]} at the start, {load[1]} at the end; {elapsed_s / 60:.1f} min in all. The "
        "objective is the modeled seconds the solver minimised (the ILP's, before the decoded plan's ledger); "
        "the bound is the solver's proof that no plan is cheaper; intra-op is the whole pass (build, solve, "
        "decode, memory), wall / CPU seconds.",
        "",
        f"**{solved} of {len(rows)} cells** proven optimal or within 1% of the bound.",
        "",
        "| cell | status | gap | objective ms | bound ms | solve s | intra-op s (wall / CPU) | LP columns |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        gap = "0" if r.status == "optimal" else fmt_gap(r.gap, 1)
        bound = "-" if math.isnan(r.bound_s) else f"{r.bound_s * 1e3:.3f}"
        lines.append(f"| {r.cell} | {r.status} | {gap} | {r.objective_s * 1e3:.3f} | {bound} | {r.solve_s:.1f} | "
                     f"{r.wall_s:.1f} / {r.cpu_s:.1f} | {r.columns} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--time-limit", type=float, default=IntraOpOptions().time_limit_s)
    parser.add_argument("--cells", nargs="*", help="a subset, as 'gpt-small on 1x8-a100 2x4' prints them")
    args = parser.parse_args(argv)
    options = IntraOpOptions(time_limit_s=args.time_limit)
    cells = [c for c in default_cells() if not args.cells or str(c) in args.cells]
    cache, rows, start, before = WorkloadCache(), [], time.perf_counter(), load_average()
    for cell in cells:
        row = measure(cell, cache, options)
        print(f"{row.cell}: {row.status}, gap {row.gap:.3g}, solve {row.solve_s:.1f} s", flush=True)
        rows.append(row)
    text = markdown(rows, options, (before, load_average()), time.perf_counter() - start)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
