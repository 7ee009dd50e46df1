"""The issues' targets, judged from the results, with where and why when missed.

Every speed target is rated on **compiled** prices: each plan compiled by XLA and priced from its HLO
on the cell's cluster (``CellResult.compiled_speedup``: autoshard's returned program against the fastest
compiled classic program that fits). A cell whose programs did not compile is not rated and says why.

- autoshard >= 1.0x the fastest classic strategy that fits, in every cell;
- >= 1.10x geometric mean over the one- and two-node cells (1x8-a100, 2x8-a100);
- GPT-medium on two nodes >= 1.10x data parallel;
- >= 1.5x geometric mean on the MoE cells and on the two-node cells (the earlier issue's targets);
- a 24-layer GPT planned in <= 10 s (arbitration off) and a 96-layer one in <= 30 s on (2, 4);
- planning time growing at most linearly with depth (fitted exponent <= 1);
- with pipeline stages searched on two nodes, GPT-large (24 layers) planned in <= 30 s and GPT-XL at batch 8
  in <= 90 s (``benchmarks/stage_search_time.py``).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from autoshard.plans.ledger import fmt_gap
from autoshard.plans.plan import fmt_bytes, fmt_s
from benchmarks.planning_scaling import Hotspot, ScalingPoint, fits_by_pass
from benchmarks.quality import CellResult, geomean
from benchmarks.stage_search_time import CASES as STAGE_SEARCH_CASES, StageSearchPoint


def _num(x: float | None) -> str:
    return "?" if x is None else f"{x:.2f}"

TIE = 1e-9  # relative: a kept baseline is exactly 1.0x
MIN_SPEEDUP = 1.0
GEOMEAN_SPEEDUP = 1.5
NODES_GEOMEAN = 1.10
OVER_DP = 1.10
DP_CELL = ("gpt", "medium", "2x8-a100")  # (model, config, cluster) rated against data parallelism
PLANNING_LIMITS_S = {24: 10.0, 96: 30.0}
PLANNING_MESH = "1x8-a100"  # the (2, 4) mesh
ONE_NODE_CLUSTER = "1x8-a100"
TWO_NODE_CLUSTER = "2x8-a100"
TOY_PARAMS = 10_000_000  # below this a step is latency, not compute: geomeans are also given without these
SUPERLINEAR = 1.1  # a pass whose seconds grow faster than layers^this is named in the linear-growth target
COLLECTIVE_TOLERANCE = 0.10  # the returned plan's compiled collective seconds against its modeled ones


@dataclass(frozen=True)
class Target:
    name: str
    met: bool | None  # None: not measured in this run
    detail: str

    caveat: str | None = None  # met, but only for a reason the detail gives

    @property
    def verdict(self) -> str:
        if self.met is None:
            return "not run"
        return ("met, with a caveat" if self.caveat else "met") if self.met else "MISSED"


def _split(row: object) -> str:
    c = getattr(row, "compiled", None)
    return f"{fmt_s(c.step_s)} = compute {fmt_s(c.compute_s)} + collectives {fmt_s(c.collectives_s)}" if c else "—"


def _why_slow(r: CellResult, wanted: float) -> str:
    """Where a cell's compiled speedup stops: the programs' split, the model's own ceiling, the solver."""
    best = r.compiled_fallback
    kept = f"; autoshard returned {r.kept}'s plan" if r.kept else ""
    text = (f"{r.cell}: {_num(r.compiled_speedup)}x compiled ({_num(r.speedup)}x modeled){kept}; autoshard "
            f"{_split(r.compiled_answer_row or r.answer)}, {best.name if best else 'best classic'} {_split(best)}")
    if r.comm_headroom is not None and r.comm_headroom < wanted:
        return text + (f"; the best classic plan is {r.comm_headroom:.2f}x the least modeled compute of any plan, "
                       f"so even a plan with no communication at all could not reach {wanted:.1f}x")
    gap = f"; ILP gap {fmt_gap(r.ilp.gap, 0)}" if r.ilp else ""
    if r.long_solve is not None and r.long_solve.status == "optimal":
        gap = (f"; re-solved for {r.long_solve.time_limit_s:g} s, the solver proves {fmt_s(r.long_solve.step_s)} "
               "optimal under the model")
    top = r.hot_ops[0] if r.hot_ops else "none"
    return text + f"{gap}; costliest op (modeled): {top}"


def _unrated(r: CellResult) -> str:
    if r.error:
        return r.error
    if r.over_budget:
        return "autoshard's plan over budget"
    if r.answer is not None and r.compiled_answer is None:
        return f"autoshard's plan ({r.answer.name}) was not compiled" + (f" ({r.contest[0].error})" if r.contest else "")
    return "no classic strategy that fits compiled"


def _min_speedup(results: Sequence[CellResult]) -> Target:
    name = f"autoshard >= {MIN_SPEEDUP:.1f}x the best classic strategy that fits, every cell (compiled prices)"
    rated = [r for r in results if r.compiled_speedup is not None]
    unrated = [r for r in results if r.compiled_speedup is None]
    over = [r for r in results if r.over_budget]
    if not rated:
        return Target(name, None, "no cell rated: " + ", ".join(f"{r.cell} ({_unrated(r)})" for r in results))
    below = [r for r in rated if r.compiled_speedup < MIN_SPEEDUP * (1 - TIE)]
    worst = min(rated, key=lambda r: r.compiled_speedup)
    ties = [r for r in rated if abs(r.compiled_speedup - 1.0) <= 1e-6]
    parts = [f"{len(rated)} cells rated; lowest {worst.compiled_speedup:.2f}x ({worst.cell}); {len(ties)} exactly "
             f"1.00x (the returned program is a classic one)"]
    if unrated:
        parts.append("not rated: " + ", ".join(f"{r.cell} ({_unrated(r)})" for r in unrated))
    if below:
        parts.append("below 1.0x: " + "; ".join(_why_slow(r, MIN_SPEEDUP) for r in below))
    if over:
        parts.append("autoshard's plan is over the memory budget, so not a plan at all, in " + "; ".join(
            f"{r.cell} ({fmt_bytes(r.autoshard.peak_bytes)} of {fmt_bytes(r.budget_bytes)})" for r in over))
    return Target(name, not below and not any(r.fallback for r in over), "; ".join(parts))


def _geomean_target(name: str, cells: Sequence[CellResult], wanted: float) -> Target:
    rated = [r for r in cells if r.compiled_speedup is not None]
    if not rated:
        missing = ", ".join(f"{r.cell} ({_unrated(r)})" for r in cells) or "none run"
        return Target(name, None, f"no rated cell: {missing}")
    gm = geomean([r.compiled_speedup for r in rated])
    per_cell = ", ".join(f"{r.cell.workload} on {r.cell.cluster} {r.compiled_speedup:.2f}x" for r in rated)
    # two decimals, or four where two would round a miss up to the target
    shown = f"{gm:.4f}" if gm < wanted <= round(gm, 2) else f"{gm:.2f}"
    detail = f"geomean {shown}x (compiled) over {per_cell}"
    unrated = [r for r in cells if r.compiled_speedup is None]
    if unrated:
        detail += "; not rated: " + ", ".join(f"{r.cell} ({_unrated(r)})" for r in unrated)
    met = gm is not None and gm >= wanted
    real = [r for r in rated if r.num_params >= TOY_PARAMS]
    real_gm = geomean([r.compiled_speedup for r in real])
    if met and len(real) < len(rated) and (real_gm is None or real_gm < wanted):
        caveat = (f"met only through the toy models (under {TOY_PARAMS / 1e6:.0f}M parameters), whose steps are "
                  f"microseconds of latency: without them the geomean is "
                  + (f"{real_gm:.2f}x" if real_gm else "undefined"))
        return Target(name, met, f"Caveat: {caveat}. " + detail, caveat)
    if not met:
        detail += ". Why: " + "; ".join(_why_slow(r, wanted)
                                        for r in sorted(rated, key=lambda r: r.compiled_speedup)[:2])
    return Target(name, met, detail)


def _over_dp_target(results: Sequence[CellResult]) -> Target:
    model, config, cluster = DP_CELL
    name = f"{model}-{config} on two nodes ({cluster}) >= {OVER_DP:.2f}x data parallel (compiled prices)"
    cell = next((r for r in results if (r.cell.model, r.cell.config, r.cell.cluster) == DP_CELL), None)
    if cell is None:
        return Target(name, None, "cell not run")
    dp = cell.baseline("DP")
    got = cell.compiled_speedup_over(dp)
    if got is None:
        return Target(name, None, f"not rated: {_unrated(cell)}" + ("" if dp and dp.compiled else "; DP not compiled"))
    mine = cell.compiled_answer_row
    detail = (f"{got:.2f}x: autoshard ({mine.name}) {_split(mine)}, DP {_split(dp)}; collectives crossing nodes: "
              f"autoshard {mine.compiled.cross_node}, DP {dp.compiled.cross_node}")
    return Target(name, got >= OVER_DP, detail)


def _collective_target(results: Sequence[CellResult]) -> Target:
    """What XLA runs is what was priced: the returned SPMD plan's modeled collectives (its ops' own and the
    reshards between them) against the collectives of its compiled program, priced on the cell's cluster."""
    name = (f"the returned plan's compiled collectives within {COLLECTIVE_TOLERANCE:.0%} of its modeled ones, "
            "every cell")
    rated, off, skipped = [], [], []
    for r in results:
        row = r.autoshard
        if row is None or row.compiled is None:
            skipped.append(f"{r.cell} ({_unrated(r)})")
            continue
        if r.compiled_answer_row is not row:
            skipped.append(f"{r.cell} (a pipeline is returned: its stages are compared one by one, not here)")
            continue
        modeled, compiled = row.comm_s + row.reshard_s, row.compiled.collectives_s
        error = (modeled - compiled) / compiled if compiled > 0 else (0.0 if modeled == 0 else math.inf)
        rated.append(r)
        if abs(error) > COLLECTIVE_TOLERANCE:
            off.append(f"{r.cell} modeled {fmt_s(modeled)}, compiled {fmt_s(compiled)} ({error:+.0%})")
    if not rated:
        return Target(name, None, "no cell rated" + (": " + ", ".join(skipped) if skipped else ""))
    parts = [f"{len(rated) - len(off)} of {len(rated)} cells within {COLLECTIVE_TOLERANCE:.0%}"]
    if off:
        parts.append("off: " + "; ".join(off))
    if skipped:
        parts.append("not rated: " + ", ".join(skipped))
    return Target(name, not off, "; ".join(parts))


def _planning_target(points: Sequence[ScalingPoint], layers: int, limit_s: float,
                     spots: Sequence[Hotspot]) -> Target:
    name = f"{layers}-layer GPT planned in <= {limit_s:.0f} s on (2, 4), arbitration off"
    point = next((p for p in points if p.layers == layers and p.cluster == PLANNING_MESH), None)
    if point is None:
        return Target(name, None, "scaling study not run")
    if point.error:
        return Target(name, False, f"planning failed: {point.error}")
    passes = {"trace": point.trace_s, "ILP build": point.build_s, "ILP solve": point.solve_s,
              "decode + memory profile": point.other_s}
    split = ", ".join(f"{k} {v:.1f} s" for k, v in passes.items())
    detail = (f"{point.total_s:.1f} s wall ({split}), {point.total_cpu_s:.1f} s CPU; "
              f"ILP {point.nodes} nodes -> {point.classes} classes")
    met = point.total_s <= limit_s
    if not met:
        slowest = max(passes, key=passes.get)
        detail += f". Slowest pass: {slowest} ({passes[slowest] / point.total_s:.0%})"
        if spots:
            detail += "; profiled, the costliest functions are " + ", ".join(
                f"{h.function.rsplit('/', 1)[-1]} {h.share:.0%}" for h in spots[:5])
        if point.total_cpu_s <= limit_s:
            detail += (f"; the CPU time ({point.total_cpu_s:.1f} s) is within the limit: the wall time is "
                       "inflated by the machine's load")
    return Target(name, met, detail)


def _stage_search_target(points: Sequence[StageSearchPoint], case: str, limit_s: float) -> Target:
    point = next((p for p in points if p.case == case), None)
    name = f"gpt-{case} planned with pipeline stages searched in <= {limit_s:.0f} s"
    if point is None:
        return Target(name, None, "stage search timing not run")
    name = f"gpt-{case} ({point.layers} layers) on {point.cluster} planned with stages searched in <= {limit_s:.0f} s"
    if point.error:
        return Target(name, False, f"planning failed: {point.error}")
    passes = ", ".join(f"{k} {v:.1f} s" for k, v in point.passes.items())
    detail = (f"{point.wall_s:.1f} s wall ({passes}), {point.cpu_s:.1f} s CPU, load {point.load[0]:.1f} -> "
              f"{point.load[1]:.1f}; {point.answer}")
    met = point.wall_s <= limit_s
    if not met and point.cpu_s <= limit_s:
        detail += f"; the CPU time ({point.cpu_s:.1f} s) is within the limit: the wall time is inflated by the load"
    return Target(name, met, detail)


def _linear_target(points: Sequence[ScalingPoint]) -> Target:
    name = "planning time grows at most linearly with depth (fitted exponent of CPU seconds <= 1)"
    clusters = list(dict.fromkeys(p.cluster for p in points))
    if not clusters:
        return Target(name, None, "scaling study not run")
    parts, met = [], True
    for cluster in clusters:
        fits = fits_by_pass(points, cluster)
        total = fits["total CPU"]  # CPU seconds: the algorithm's growth, less disturbed by load than wall time
        if total is None:
            parts.append(f"{cluster}: too few points")
            met = False
            continue
        mine = {p.layers: p for p in points if p.cluster == cluster and p.error is None}
        local = ""
        if 24 in mine and 96 in mine:
            slope = math.log(mine[96].total_cpu_s / mine[24].total_cpu_s) / math.log(4)
            local = f", 24->96 layers k = {slope:.2f}"
        by_pass = ", ".join(f"{k} {f.exponent:.2f}" for k, f in fits.items() if f is not None and k != "total CPU")
        parts.append(f"{cluster}: CPU seconds k = {total.exponent:.2f} (R^2 {total.r2:.2f}){local}; wall seconds "
                     f"by pass: {by_pass}")
        deepest = mine[max(mine)] if mine else None
        per_pass = {"trace": "trace_s", "build": "build_s", "solve": "solve_s", "decode + memory": "other_s"}
        for what, attr in per_pass.items():
            fit = fits.get(what)
            if fit is not None and deepest is not None and fit.exponent > SUPERLINEAR:
                seconds = getattr(deepest, attr)
                parts.append(f"{cluster}: superlinear pass: {what} grows as L^{fit.exponent:.2f}, {seconds:.1f} s of "
                             f"{deepest.total_s:.1f} s at {deepest.layers} layers; the total stays sublinear only "
                             f"because the solve is capped by its time limit")
        met &= total.exponent <= 1.0
    return Target(name, met, "; ".join(parts))


def evaluate(results: Sequence[CellResult], points: Sequence[ScalingPoint],
             spots: Sequence[Hotspot] = (), staged: Sequence[StageSearchPoint] = ()) -> list[Target]:
    """``spots``: a profile of one planning run (planning_scaling.hotspots), quoted where planning is slow."""
    big = [r for r in results if r.cell.config != "small" or r.cell.model == "gpt"]
    moe = [r for r in big if r.cell.model in ("moe", "moe_topk")]
    two_node = [r for r in big if r.cell.cluster == TWO_NODE_CLUSTER]
    nodes = [r for r in big if r.cell.cluster in (ONE_NODE_CLUSTER, TWO_NODE_CLUSTER)]
    return [
        _min_speedup(results),
        _geomean_target(f"geomean >= {NODES_GEOMEAN:.2f}x over the one- and two-node ({ONE_NODE_CLUSTER}, "
                        f"{TWO_NODE_CLUSTER}) cells (compiled prices)", nodes, NODES_GEOMEAN),
        _over_dp_target(results),
        _geomean_target(f"geomean >= {GEOMEAN_SPEEDUP}x on the MoE cells (compiled prices)", moe, GEOMEAN_SPEEDUP),
        _geomean_target(f"geomean >= {GEOMEAN_SPEEDUP}x on the two-node ({TWO_NODE_CLUSTER}) cells (compiled "
                        "prices)", two_node, GEOMEAN_SPEEDUP),
        _collective_target(results),
        *(_planning_target(points, layers, limit, spots) for layers, limit in PLANNING_LIMITS_S.items()),
        _linear_target(points),
        *(_stage_search_target(staged, case, limit) for case, limit in STAGE_SEARCH_CASES),
    ]
