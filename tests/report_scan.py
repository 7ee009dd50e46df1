"""Contradictions a plan's report must never print, found by reading it as a person would.

``report_text(plan)`` renders everything a user reads about a plan (``str(plan)`` and ``autoshard explain``'s
tables, legend included); ``contradictions(plan, text)`` lists the fields in it that contradict each other or
the plan's own data. Each rule names a contradiction once printed by a real report (issue 27).
"""
from __future__ import annotations

import io
import re

from rich.console import Console

from autoshard.plans.plan import Plan
from autoshard.report import explain_renderables


def report_text(plan: Plan) -> str:
    console = Console(file=io.StringIO(), width=400, record=True)
    for item in explain_renderables(plan):
        console.print(item)
    return str(plan) + "\n" + console.export_text()


def contradictions(plan: Plan, text: str) -> list[str]:
    found = []
    if plan.ledger.comm_s > 0 and re.search(r"collectives(?: / device)?[\s│]+none\b", text):
        found.append("collectives 'none' beside nonzero modeled collective time")
    if re.search(r"parameter arrays replicated \[(ZeRO|FSDP)", text):
        found.append("a stage's parameter arrays 'replicated' beside a sharded strategy's name")
    for stage in plan.stages:
        storage = stage.storage()
        if stage.intra_op.startswith("FSDP") and "parameters replicated" in storage:
            found.append(f"stage {stage.index}: FSDP with its parameters replicated ({storage})")
        if stage.intra_op.startswith("ZeRO-2") and "split" not in storage:
            found.append(f"stage {stage.index}: ZeRO-2 with nothing split ({storage})")
    if re.search(r"within \d+% of the chosen [^:]*: .*\([+-]0\.0%\)", text):
        found.append("a mesh flagged as a counter-signal with the same modeled step (±0.0%)")
    if re.search(r"did not prove optimality \(status '[^']+', gap 0\.0%\)", text):
        found.append("'did not prove optimality' beside a 0.0% gap")
    if re.search(r"\b1\.00x (faster|slower)\b", text):
        found.append("'1.00x faster/slower': no margin said as one")
    if re.search(r"\(0\.\d+x the compute lower bound\)", text):
        found.append("a modeled step below the compute lower bound")
    if plan.fits == ("OVER BUDGET" in text):
        found.append(f"'fits' is {plan.fits} but the report says {'OVER BUDGET' if not plan.fits else 'fits'}")
    if not plan.stages and re.search(r"\bstage \d+:", text):
        found.append("an SPMD plan describing pipeline stages")
    return found
