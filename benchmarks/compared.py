"""One comparison cell, compiled: autoshard and every classic plan ``compare`` makes, each compiled by XLA and
priced from its HLO on the cell's cluster (``check="compiled"``), for the benchmarks of model code the examples
do not have (``benchmarks/llama_style.py``, ``benchmarks/flax_zoo.py``)."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from autoshard.compiler.baselines import compare
from autoshard.passes.intra_op import IntraOpOptions
from autoshard.plans.plan import fmt_s


@dataclass(frozen=True)
class ComparedCell:
    cell: str
    seconds: float  # the whole comparison, wall
    rows: tuple[tuple[str, float, float | None, bool], ...]  # (strategy, modeled s, compiled s, fits); autoshard first
    returned: str  # the plan compiled arbitration returned
    solver: str = ""  # autoshard's solver status, with its gap when not proven

    @property
    def speedup(self) -> float | None:
        """The fastest compiled classic plan that fits, over autoshard's compiled step."""
        mine = self.rows[0][2]
        classic = [c for name, _, c, fits in self.rows[1:] if fits and c is not None]
        return min(classic) / mine if mine and classic else None

    @property
    def ok(self) -> bool:
        return self.speedup is not None and self.speedup >= 1.0


def compare_cell(cell: str, step: Callable[..., Any], args: Sequence[Any], cluster: str, mesh_text: str,
                 time_limit_s: float) -> ComparedCell:
    """``compare`` on mesh ``mesh_text`` ("2x8") of ``cluster``, every plan compiled and priced."""
    start = time.perf_counter()
    found = compare(step, args, mesh=tuple(int(n) for n in mesh_text.split("x")), cluster=cluster,
                    options=IntraOpOptions(time_limit_s=time_limit_s), check="compiled")
    rows = tuple((c.plan.name, c.plan.ledger.step_s, c.plan.ledger.compiled_step_s or None, c.plan.fits)
                 for c in (found.autoshard, *found.baselines))
    solver = found.autoshard.plan.solver
    status = solver.status if solver.status.startswith("optimal") else f"{solver.status}, gap {solver.gap:.1%}"
    return ComparedCell(cell, time.perf_counter() - start, rows, found.autoshard.plan.name, status)


def say(row: ComparedCell) -> str:
    speedup = f"{row.speedup:.2f}x" if row.speedup else "not rated"
    return f"{row.cell}: autoshard ({row.returned}) {speedup} the best classic compiled, {row.seconds:.0f} s"


def table_lines(rows: Sequence[ComparedCell]) -> list[str]:
    """The markdown table of every cell's strategies (modeled and compiled step, fit), then a line per cell."""
    lines = ["| cell | strategy | modeled | compiled | fits |", "|---|---|---:|---:|---|"]
    for r in rows:
        lines += [f"| {r.cell} | {name} | {fmt_s(m)} | {fmt_s(c) if c else '-'} | {'yes' if fits else 'no'} |"
                  for name, m, c, fits in r.rows]
    return [*lines, "", *(f"- {say(r)}" + (f"; solver {r.solver}" if r.solver else "") for r in rows), ""]
