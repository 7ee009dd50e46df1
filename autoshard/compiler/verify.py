"""Check a plan against what XLA compiled: predicted vs compiled collectives and memory.

The plan's ledger predicts per-device bytes for each collective kind and the
per-device peak memory. ``verify`` compiles the planned step, reads the
optimized HLO (``compiler/hlo.py``) and ``memory_analysis()``, and reports
each figure side by side with its relative error. A figure off by more than
its tolerance is flagged: either the cost model or the emitter is wrong.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autoshard.compiler.hlo import CompiledSummary, summarize_compiled
from autoshard.plans.plan import Plan

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
COLLECTIVE_TOLERANCE = 0.10
MEMORY_TOLERANCE = 0.15
# Peak memory is also ok within this many bytes: XLA:CPU keeps fixed buffers (a few hundred KiB) that are
# noise on a real model but 20% of a tiny one's (gpt tiny: 1.15 predicted vs 1.46 MiB compiled).
MEMORY_IMMATERIAL_BYTES = 2.0**20


@dataclass(frozen=True)
class FidelityRow:
    what: str
    predicted: float
    compiled: float
    tolerance: float
    # differences below this many bytes are immaterial (e.g. 1% of all collective bytes: a few kB that
    # XLA moves as a permute instead of a reduce-scatter in a plan that moves megabytes)
    immaterial_bytes: float = 1024.0

    @property
    def rel_error(self) -> float:
        if self.compiled == 0:
            return 0.0 if self.predicted == 0 else float("inf")
        return abs(self.predicted - self.compiled) / self.compiled

    @property
    def ok(self) -> bool:
        # Tiny absolute differences (a few scalars) are not model errors.
        return self.rel_error <= self.tolerance or abs(self.predicted - self.compiled) <= self.immaterial_bytes


@dataclass(frozen=True)
class FidelityReport:
    rows: tuple[FidelityRow, ...]
    summary: CompiledSummary

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    def row(self, what: str) -> FidelityRow:
        return next(r for r in self.rows if r.what == what)

    def __str__(self) -> str:
        lines = [f"{'figure':28} {'predicted':>14} {'compiled':>14} {'error':>8}"]
        for r in self.rows:
            flag = "" if r.ok else "  <-- off by more than " + f"{r.tolerance:.0%}"
            lines.append(f"{r.what:28} {r.predicted:14,.0f} {r.compiled:14,.0f} {r.rel_error:8.1%}{flag}")
        return "\n".join(lines)


def compare(plan: Plan, summary: CompiledSummary) -> FidelityReport:
    predicted = plan.ledger.collective_bytes
    total_p = float(sum(predicted.values()))
    total_c = float(sum(summary.bytes_by_kind.values()))
    immaterial = max(1024.0, 0.01 * total_c)
    rows = []
    for kind in KINDS:
        p, c = float(predicted.get(kind, 0.0)), float(summary.bytes_by_kind.get(kind, 0.0))
        if p or c:
            rows.append(FidelityRow(f"{kind} bytes", p, c, COLLECTIVE_TOLERANCE, immaterial))
    rows.append(FidelityRow("all collective bytes", total_p, total_c, COLLECTIVE_TOLERANCE))
    rows.append(FidelityRow("peak memory bytes", plan.ledger.peak_memory_bytes, float(summary.peak_bytes),
                            MEMORY_TOLERANCE, MEMORY_IMMATERIAL_BYTES))
    return FidelityReport(tuple(rows), summary)


def verify_compiled(plan: Plan, compiled: Any) -> FidelityReport:
    """Compare ``plan`` with an XLA executable of it (``step.lower(*args).compile()``)."""
    return compare(plan, summarize_compiled(compiled))
