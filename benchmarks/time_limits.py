"""What a solver time limit buys: the modeled step of the plan found at each limit, against the proven optimum.

    python -m benchmarks.time_limits [--limits 2 10 60] [--out benchmarks/TIME_LIMITS.md]

Each workload is planned on a (2, 4) mesh of 1x8-a100 (one stage) at every limit; the table gives the
plan's modeled step, the solver's status and the planning wall time, and the step over the best proven
plan among the limits (1.00 when the short limit already found it). Below the time of the LP restricted to
the pairs that pay no reshard (``passes/ilp/mip.py``) a plan is the best search start after a local search;
between that and the whole LP's time it is the restricted LP's plan, without a proof; beyond, the proven
optimum. Planning time is real work on this machine; the steps are modeled, not measured.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

import autoshard
from autoshard.passes.intra_op import IntraOpOptions
from examples import gpt

WORKLOADS = {
    "gpt-small": lambda: gpt.workload("small", abstract=True),
    "gpt-medium": lambda: gpt.workload("medium", abstract=True),
    "gpt-d512-4l": lambda: gpt.workload(gpt.Config(vocab_size=2048, seq_len=128, d_model=512, num_heads=8,
                                                   num_layers=4, batch_size=32), abstract=True),
}


@dataclass(frozen=True)
class Row:
    workload: str
    limit_s: float
    step_s: float
    status: str
    plan_s: float


def measure(name: str, limits: list[float]) -> list[Row]:
    work = WORKLOADS[name]()
    rows = []
    for limit in limits:
        start = time.perf_counter()
        plan = autoshard.plan(work.step, *work.args, mesh=(2, 4), cluster="1x8-a100", num_stages=1,
                              options=IntraOpOptions(time_limit_s=limit))
        rows.append(Row(name, limit, plan.step_s, plan.solver.status, time.perf_counter() - start))
    return rows


def table(rows: list[Row]) -> Table:
    out = Table(title="plans against the solver's time limit ((2, 4) of 1x8-a100, modeled)")
    for column in ("workload", "limit", "modeled step", "status", "planning", "over the best proven"):
        out.add_column(column, justify="left" if column in ("workload", "status") else "right")
    for row in rows:
        proven = [r.step_s for r in rows if r.workload == row.workload and r.status == "optimal"]
        ratio = f"{row.step_s / min(proven):.2f}x" if proven else "-"
        out.add_row(row.workload, f"{row.limit_s:g} s", f"{row.step_s * 1e3:.3f} ms", row.status,
                    f"{row.plan_s:.1f} s", ratio)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limits", type=float, nargs="+", default=[2.0, 10.0, 60.0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--out", help="also write the table as Markdown here")
    args = parser.parse_args()
    rows = [row for name in args.workloads for row in measure(name, sorted(args.limits))]
    console = Console(record=bool(args.out))
    console.print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            f.write("# Plans against the solver's time limit\n\n```\n" + console.export_text() + "```\n\n"
                    "Command: `python -m benchmarks.time_limits --out benchmarks/TIME_LIMITS.md`.\n")


if __name__ == "__main__":
    main()
