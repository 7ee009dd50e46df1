"""The benchmark tables as plain text rows, rendered to rich (console) or markdown (RESULTS.md).

Every table is built once as a ``TextTable`` (title, headers, rows of
strings) from result dataclasses; ``render_rich`` and ``render_markdown``
only lay it out, so the console and the file always show the same figures.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rich.table import Table

from autoshard.plans.ledger import fmt_bytes, fmt_gap, fmt_s
from benchmarks.planning_scaling import Hotspot, ScalingPoint, fits_by_pass
from benchmarks.quality import CellResult


@dataclass(frozen=True)
class TextTable:
    title: str
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    right: frozenset[int] = frozenset()  # columns aligned right (numbers)


def render_rich(table: TextTable) -> Table:
    out = Table(title=table.title, title_justify="left")
    for i, h in enumerate(table.headers):
        out.add_column(h, justify="right" if i in table.right else "left", overflow="fold")
    for row in table.rows:
        out.add_row(*row)
    return out


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(table: TextTable, *, title_level: int = 3) -> str:
    lines = [f"{'#' * title_level} {table.title}", ""] if table.title else []
    lines.append("| " + " | ".join(map(_md_cell, table.headers)) + " |")
    lines.append("|" + "|".join("---:" if i in table.right else "---" for i in range(len(table.headers))) + "|")
    lines += ["| " + " | ".join(map(_md_cell, row)) + " |" for row in table.rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- formatting


def _num(n: float | None, fmt: str = "{:.2f}", missing: str = "—") -> str:
    return missing if n is None or (isinstance(n, float) and not math.isfinite(n)) else fmt.format(n)


def _params(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def _ceiling(c: int | None) -> str:
    return "unbounded" if c is None else str(c)


def _mesh(mesh: Sequence[int]) -> str:
    return "x".join(map(str, mesh))


# ----------------------------------------------------------------------------- plan quality


def _objective(r: CellResult) -> str:
    o = r.objective
    if o is None:
        return "not available"
    return (f"{'agree' if o.agrees else 'DISAGREE'}: {fmt_s(o.ilp_s)} / {fmt_s(o.recomputed_s)} / "
            f"{fmt_s(o.ledger_s)}")


def _compiled_cells(r: CellResult) -> tuple[str, str, str]:
    """autoshard's compiled step, the fastest compiled classic that fits, and the speedup between them."""
    mine = r.compiled_answer
    best = r.compiled_fallback
    return (fmt_s(mine.step_s) if mine else "—",
            f"{best.name} {fmt_s(best.compiled.step_s)}" if best and best.compiled else "—",
            _num(r.compiled_speedup, "{:.2f}x"))


def quality_table(results: Sequence[CellResult]) -> TextTable:
    headers = ("workload", "cluster (mesh)", "autoshard step", "memory / device", "batch ceiling",
               "best classic that fits", "speedup", "autoshard compiled", "best classic compiled (fits)",
               "compiled speedup", "of compute bound", "planning s (trace / intra-op)",
               "ILP (nodes->classes, vars, cons)", "gap / status", "objective: ILP / recomputed / ledger",
               "pipeline step (stages)", "pipeline speedup")
    rows = []
    for r in results:
        name = f"{r.cell.workload} ({_params(r.num_params)}, batch {r.batch_size})"
        where = f"{r.cell.cluster} ({_mesh(r.cell.mesh)})"
        if r.autoshard is None:
            rows.append((name, where, "no plan fits", "—", "—", "—", "—", "—", "—", "—", "—",
                         f"{r.trace_s:.1f} / —", "—", r.error or "", "—", *_pipeline_cells(r)))
            continue
        a, best = r.autoshard, r.fallback
        memory = f"{fmt_bytes(a.peak_bytes)}" + ("" if a.fits else " (over budget)")
        best_text = f"{best.name} {fmt_s(best.step_s)}" if best else "none fits"
        speedup = ("— (autoshard over budget)" if r.over_budget else _num(r.speedup, "{:.2f}x")
                   + (f" (kept {r.kept})" if r.kept else ""))
        ilp = str(r.ilp) if r.ilp else "—"
        gap = f"{fmt_gap(r.ilp.gap, 0)} {r.ilp.status}" if r.ilp else "—"
        rows.append((name, where, fmt_s(a.step_s), memory, _ceiling(a.batch_ceiling), best_text, speedup,
                     *_compiled_cells(r), _num(r.bound_fraction, "{:.0%}"), f"{r.trace_s:.1f} / {r.intra_op_s:.1f}",
                     ilp, gap, _objective(r), *_pipeline_cells(r)))
    return TextTable("autoshard against the best classic strategy that fits (modeled, and compiled by XLA)", headers,
                     tuple(rows), frozenset({2, 3, 4, 6, 7, 9, 10, 16}))


def _pipeline_cells(r: CellResult) -> tuple[str, str]:
    """The pipeline's step (with its stages, planned in how long) and its speedup over every other row."""
    if r.pipeline is None:
        return "—", "—"
    p = r.pipeline
    step = (f"{fmt_s(p.step_s)}{'' if p.fits else ' (over budget)'}, {fmt_bytes(p.peak_bytes)}: "
            f"{r.pipeline_stages}; planned in {r.pipeline_s:.0f} s")
    return step, _num(r.pipeline_speedup, "{:.2f}x")


def baselines_table(results: Sequence[CellResult]) -> TextTable:
    """Every strategy of every cell: step, memory, fit, batch ceiling, autoshard's speedup over it."""
    headers = ("cell", "strategy", "modeled step", "compute", "collectives", "resharding", "memory / device", "fits",
               "batch ceiling", "autoshard speedup", "compiled, XLA-priced (compute + collectives)",
               "collectives crossing nodes", "FLOPs / bytes vs XLA")
    rows = []
    for r in results:
        if r.autoshard is None:
            rows.append((str(r.cell), "—", "—", "—", "—", "—", "—", "—", "—", r.error or "", "—", "—", "—"))
            continue
        for s in (r.autoshard, *r.baselines, *((r.pipeline,) if r.pipeline is not None else ())):
            speedup = s.step_s / r.autoshard.step_s if r.autoshard.step_s > 0 else math.nan
            c = s.compiled
            priced = f"{fmt_s(c.step_s)} ({fmt_s(c.compute_s)} + {fmt_s(c.collectives_s)})" if c else "—"
            errors = ("—" if c is None else "not compared (stage by stage)" if math.isnan(c.flops_error)
                      else f"{c.flops_error:.1%} / {c.bytes_error:.1%}" + ("" if c.ok else " OFF"))
            rows.append((str(r.cell), s.name, fmt_s(s.step_s), fmt_s(s.compute_s), fmt_s(s.comm_s),
                         fmt_s(s.reshard_s), fmt_bytes(s.peak_bytes), "yes" if s.fits else "NO",
                         _ceiling(s.batch_ceiling), "" if s is r.autoshard else f"{speedup:.2f}x", priced,
                         str(c.cross_node) if c else "—", errors))
    return TextTable("every strategy, every cell (compiled: XLA:CPU, 8 simulated devices here, 16 or 32 in a child "
                     "process)", headers, tuple(rows), frozenset({2, 3, 4, 5, 6, 8, 9, 10, 11, 12}))


def contest_table(results: Sequence[CellResult]) -> TextTable:
    """Each cell's compiled arbitration: every plan compiled, modeled against compiled, which one was returned."""
    headers = ("cell", "candidate", "modeled step", "compiled step", "model error", "fits", "returned", "arbitration s")
    rows = []
    for r in results:
        for c in r.contest:
            error = (f"{(c.modeled_s - c.compiled_s) / c.compiled_s:+.1%}" if c.compiled_s else "—")
            rows.append((str(r.cell), c.name, fmt_s(c.modeled_s),
                         fmt_s(c.compiled_s) if c.compiled_s is not None else f"did not compile: {c.error}", error,
                         "yes" if c.fits else "NO", "yes" if c.chosen else "", f"{r.arbitration_s:.0f}"))
    return TextTable("compiled arbitration: the fastest compiled program that fits is autoshard's answer", headers,
                     tuple(rows), frozenset({2, 3, 4, 7}))


def hot_ops_table(results: Sequence[CellResult]) -> TextTable:
    headers = ("cell", "autoshard: compute / collectives / resharding", "best classic / FLOP bound",
               "best classic / least compute", "top collective + reshard ops (priced locally)")
    rows = []
    for r in results:
        if r.autoshard is None:
            continue
        a = r.autoshard
        rows.append((str(r.cell), f"{fmt_s(a.compute_s)} / {fmt_s(a.comm_s)} / {fmt_s(a.reshard_s)}",
                     _num(r.headroom, "{:.2f}x"), _num(r.comm_headroom, "{:.2f}x"), "; ".join(r.hot_ops) or "none"))
    return TextTable("where autoshard's step goes beyond compute", headers, tuple(rows), frozenset({2, 3}))


def fidelity_table(results: Sequence[CellResult]) -> TextTable:
    headers = ("cell", "figure", "predicted", "compiled (HLO)", "error", "within tolerance", "compile s")
    rows = []
    for r in results:
        f = r.fidelity
        if f is None:
            continue
        if f.error:
            rows.append((str(r.cell), "—", "—", "—", "—", f.error, f"{f.compile_s:.1f}"))
            continue
        for row in f.rows:
            rows.append((str(r.cell), row.what, fmt_bytes(row.predicted), fmt_bytes(row.compiled),
                         _num(row.rel_error, "{:.1%}", "inf"), "yes" if row.ok else "NO", f"{f.compile_s:.1f}"))
    return TextTable("predicted by the plan vs compiled by XLA (8 simulated CPU devices, per device)", headers,
                     tuple(rows), frozenset({2, 3, 4, 6}))


# ----------------------------------------------------------------------------- planning time


def scaling_table(points: Sequence[ScalingPoint]) -> TextTable:
    headers = ("layers", "cluster (mesh)", "params", "ops", "ILP (nodes->classes, vars, cons)", "trace s",
               "build s", "solve s", "decode + memory s", "total s", "total CPU s", "gap / status")
    rows = []
    for p in points:
        if p.error:
            rows.append((str(p.layers), f"{p.cluster} ({_mesh(p.mesh)})", _params(p.num_params), str(p.num_ops),
                         "—", f"{p.trace_s:.1f}", "—", "—", "—", f"{p.total_s:.1f}", f"{p.total_cpu_s:.1f}",
                         p.error))
            continue
        rows.append((str(p.layers), f"{p.cluster} ({_mesh(p.mesh)})", _params(p.num_params), str(p.num_ops),
                     f"{p.nodes}->{p.classes}, {p.variables}, {p.constraints}", f"{p.trace_s:.1f}",
                     f"{p.build_s:.1f}", f"{p.solve_s:.1f}", f"{p.other_s:.1f}", f"{p.total_s:.1f}",
                     f"{p.total_cpu_s:.1f}", f"{fmt_gap(p.gap, 0)} {p.status}"))
    return TextTable("planning seconds by pass against depth (GPT, d_model 2048, batch 8)", headers, tuple(rows),
                     frozenset({0, 3, 5, 6, 7, 8, 9, 10}))


def scaling_fit_table(points: Sequence[ScalingPoint]) -> TextTable:
    headers = ("cluster", "seconds of", "exponent k", "R^2", "fit")
    rows = []
    for cluster in dict.fromkeys(p.cluster for p in points):
        for what, fit in fits_by_pass(points, cluster).items():
            rows.append((cluster, what, _num(fit.exponent if fit else None), _num(fit.r2 if fit else None),
                         str(fit) if fit else "—"))
    return TextTable("planning seconds = c * layers^k, least squares on log-log axes", headers, tuple(rows),
                     frozenset({2, 3}))


def hotspot_table(spots: Sequence[Hotspot], title: str) -> TextTable:
    rows = tuple((h.function, f"{h.cumulative_s:.1f}", f"{h.share:.0%}") for h in spots)
    return TextTable(title, ("function (cumulative: callees included)", "seconds under cProfile", "share"), rows,
                     frozenset({1, 2}))


def long_solve_table(results: Sequence[CellResult]) -> TextTable:
    headers = ("cell", "best classic that fits", "autoshard (comparison)", "re-solved", "status / gap",
               "speedup then", "re-solve s")
    rows = []
    for r in results:
        ls, best = r.long_solve, r.fallback
        if ls is None or r.autoshard is None:
            continue
        speedup = f"{best.step_s / ls.step_s:.3f}x" if best is not None and ls.step_s > 0 else "—"
        rows.append((str(r.cell), f"{best.name} {fmt_s(best.step_s)}" if best else "none fits",
                     f"{fmt_s(r.autoshard.step_s)} ({_num(r.speedup, '{:.3f}x')})",
                     f"{fmt_s(ls.step_s)} with {ls.time_limit_s:g} s", f"{ls.status}, gap {fmt_gap(ls.gap, 0)}",
                     speedup, f"{ls.seconds:.1f}"))
    return TextTable("solver or search space? autoshard re-solved with a long time limit", headers, tuple(rows),
                     frozenset({2, 3, 5, 6}))
