"""A cell's compiled prices: what ``compare``'s compiled arbitration read from XLA, as plain benchmark rows.

``compare`` (``check="compiled"``) compiles autoshard's plan, its next-best distinct plans and every classic
plan of a cell (8-device meshes here, 16 and 32 in a child process) and prices each from its HLO on the
cell's cluster (``autoshard/compiler/verify.compiled_price``). This module keeps those numbers per strategy
(``CompiledRow``), the contest (``ContestRow``), and the objective checker's result (``ObjectiveRow``).

The objective checker is the lead's ``autoshard.passes.objective.check(graph, mesh, node_strategies, ilp_s,
ledger_s)`` (ILP objective, the objective recomputed on the unsimplified graph, the ledger's step). It is read
through ``OBJECTIVE_CHECKER`` when this autoshard has it; without it the column says "not available".
"""
from __future__ import annotations

import importlib
import logging
import math
from dataclasses import dataclass

from autoshard.compiler.arbiter import Arbitration, Contender
from autoshard.compiler.driver import PlannedStep
from autoshard.compiler.verify import compare as fidelity_compare

log = logging.getLogger(__name__)

# (module, function) of the objective checker: check(graph, mesh, node_strategies, ilp_s, ledger_s) -> an object
# with ilp_s, recomputed_s, ledger_s and agrees()
OBJECTIVE_CHECKER = ("autoshard.passes.objective", "check")


@dataclass(frozen=True)
class CompiledRow:
    """One plan compiled by XLA: its own FLOPs, bytes accessed and collectives priced on the cell's cluster,
    and the ledger's predictions against them."""

    step_s: float  # max(FLOPs / peak, bytes / HBM) + HLO collectives at their groups' links
    compute_s: float
    collectives_s: float
    flops_error: float  # |predicted - compiled| / compiled
    bytes_error: float
    ok: bool  # FLOPs within 5% and bytes within 20%
    cross_node: int = 0  # collectives run per step whose groups span nodes
    where: str = "here"  # compiled in this process, or in a child process of N devices


@dataclass(frozen=True)
class ContestRow:
    """One contender of the cell's compiled arbitration."""

    name: str
    modeled_s: float
    compiled_s: float | None  # None: did not compile (error)
    fits: bool
    chosen: bool
    error: str | None = None


@dataclass(frozen=True)
class ObjectiveRow:
    """The objective checker on autoshard's returned plan: three figures that must agree."""

    ilp_s: float
    recomputed_s: float
    ledger_s: float
    agrees: bool


def compiled_row(contender: Contender) -> CompiledRow | None:
    """A contender's compiled price and the ledger's FLOPs and bytes against the HLO; None: not compiled."""
    compiled, price = contender.compiled, contender.price
    if compiled is None or compiled.summary is None or price is None:
        return None
    rows = {r.what: r for r in fidelity_compare(contender.plan, compiled.summary).rows}
    flops, hbm = rows.get("flops per device"), rows.get("hbm bytes per device")
    return CompiledRow(price.step_s, price.compute_s, price.collectives_s,
                       flops.rel_error if flops else math.nan, hbm.rel_error if hbm else math.nan,
                       bool(flops and hbm and flops.ok and hbm.ok), price.cross_node_collectives, compiled.where)


def contest_rows(arbitration: Arbitration) -> tuple[ContestRow, ...]:
    return tuple(ContestRow(c.name, c.plan.step_s, c.compiled_s, c.plan.fits, c is arbitration.winner, c.error)
                 for c in arbitration.contenders)


def objective_row(planned: PlannedStep | None) -> ObjectiveRow | None:
    """``OBJECTIVE_CHECKER`` on ``planned`` (None when this autoshard has no checker or the plan no ILP
    objective); a checker that fails is logged and reads as None."""
    if planned is None:
        return None
    module, name = OBJECTIVE_CHECKER
    try:
        check = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    ilp_s = getattr(planned.result.ilp, "objective_s", None)
    if ilp_s is None:
        return None
    try:
        got = check(planned.graph, planned.logical_mesh, planned.result.node_strategies, ilp_s, planned.plan.step_s)
    except Exception:  # noqa: BLE001 — a benchmark records a failing check and carries on
        log.exception("the objective checker failed")
        return None
    return ObjectiveRow(float(got.ilp_s), float(got.recomputed_s), float(got.ledger_s), bool(got.agrees()))
