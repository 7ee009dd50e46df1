"""The report of every example says nothing that contradicts itself (``tests/report_scan.py``).

Each example's tiny config is planned from abstract shapes on the 8-device CPU preset (the MLP over every
mesh shape, so its report lists the meshes tried; the others on 2x4; the pipeline examples as 2-stage
pipelines), one of them compared with the classic strategies, and its whole report (``str(plan)``,
``autoshard explain``'s tables) scanned. The scanner itself is checked on reports that print each
contradiction it knows.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib

import pytest

import autoshard
from autoshard.compiler.baselines import compare
from autoshard.passes.intra_op import IntraOpOptions
from autoshard.plans.ledger import SolverInfo
from report_scan import contradictions, report_text

FAST = IntraOpOptions(time_limit_s=1.0)
SPMD = ["mlp", "gpt", "gpt_scan", "moe", "moe_topk", "convnet"]
PIPELINES = ["pipeline_gpt", "pipeline_gpt_scan"]


@functools.cache
def _plan(example: str):
    work = importlib.import_module(f"examples.{example}").workload("tiny", abstract=True)
    stages = 2 if example in PIPELINES else 1
    micro = 2 if stages > 1 else None
    mesh = None if example in PIPELINES or example == "mlp" else (2, 4)
    return autoshard.plan(work.step, *work.args, mesh=mesh, cluster="cpu-8", num_stages=stages,
                          num_microbatches=micro, options=FAST)


@pytest.mark.parametrize("example", SPMD + PIPELINES)
def test_every_example_report_is_consistent(example):
    plan = _plan(example)
    assert plan.stages if example in PIPELINES else not plan.stages
    text = report_text(plan)
    assert "legend" in text and "S(x,y)" in text  # the notation is explained where it is used
    assert contradictions(plan, text) == []


def test_a_compared_plan_says_why_in_one_line():
    work = importlib.import_module("examples.mlp").workload("tiny", abstract=True)
    result = compare(work.step, work.args, (2, 4), "cpu-8", options=FAST)
    plan = dataclasses.replace(result.autoshard.plan, baselines=result.summary_dict())
    text = report_text(plan)
    best = plan.best_baseline(fitting=True)
    [line] = [ln for ln in str(plan).splitlines() if ln.strip().startswith("why this plan")]
    assert best in line and "the best classic plan that fits" in line
    assert contradictions(plan, text) == []


def test_the_scanner_finds_each_contradiction_it_knows():
    plan = _plan("pipeline_gpt")
    ledger = dataclasses.replace(plan.ledger, collective_bytes={})
    bad = dataclasses.replace(plan, ledger=ledger, solver=SolverInfo("feasible", 0.0, 1.0, 1, 1, 1, 1, 1))
    text = ("collectives / device │ none\n18 parameter arrays replicated [ZeRO-2 on 2x2]\n"
            "other meshes model within 5% of the chosen 2x4: 4x2 (-0.0%)\n"
            "the solver did not prove optimality (status 'feasible', gap 0.0%)\nmodeled 1.00x faster than DP\n"
            "2 ms (0.5x the compute lower bound)\nOVER BUDGET")
    found = contradictions(bad, text)
    assert len(found) == 7, found
    spmd = _plan("mlp")
    found = contradictions(spmd, report_text(spmd) + "\nstage 0: layers 0-1")
    assert found == ["an SPMD plan describing pipeline stages"]


def test_a_mesh_that_ties_the_chosen_one_is_no_counter_signal():
    plan = _plan("mlp")
    mine = "x".join(map(str, plan.mesh_shape))
    tied = dataclasses.replace(plan, alternatives={mine: plan.step_s, "other": plan.step_s * (1 + 1e-6)})
    assert not [s for s in tied.caveats.counter_signals if "other meshes" in s]
    close = dataclasses.replace(plan, alternatives={mine: plan.step_s, "other": plan.step_s * 1.02})
    assert [s for s in close.caveats.counter_signals if "other meshes" in s and "other (+2.0%)" in s]


def test_a_solve_without_a_bound_says_so_instead_of_an_infinite_gap():
    """A solve that stopped before its LP gave a bound has an infinite gap: reports say "no bound", not "inf%"."""
    from autoshard.plans.caveats import plan_caveats
    from autoshard.plans.ledger import solver_summary

    info = SolverInfo("feasible", float("inf"), 2.0, 392, 392, 92993, 45222, 500)
    summary = solver_summary(info)
    assert "gap no bound" in summary and "inf" not in summary and summary.count("no bound") == 1
    assert "gap 12.50%" in solver_summary(dataclasses.replace(info, gap=0.125))
    unbounded = dataclasses.replace(_plan("gpt"), solver=info)
    signals = plan_caveats(unbounded).counter_signals
    assert any("gap no bound" in c for c in signals), signals
