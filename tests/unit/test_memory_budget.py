"""Plans stay within their budget (the ILP is re-solved with cuts until the simulated peak fits), and
compare() never keeps an over-budget plan while a classic one fits."""
from __future__ import annotations

import pytest

import autoshard
from autoshard.compiler.baselines import compare, plan_baseline
from autoshard.errors import InfeasibleMemoryError
from autoshard.ir.trace import trace
from autoshard.passes.classic import Baseline
from autoshard.passes.intra_op import IntraOpOptions
from examples import gpt

OPTIONS = IntraOpOptions(time_limit_s=0.5)


@pytest.fixture(scope="module")
def work():
    return gpt.workload("tiny", abstract=True)


def _plan(work, budget):
    return autoshard.plan(work.step, *work.args, mesh=(2, 4), cluster="cpu-8", memory_budget=budget,
                          num_stages=1, options=OPTIONS)


def test_plans_stay_within_shrinking_budgets(work):
    budget = _plan(work, None).ledger.peak_memory_bytes
    kept = 0
    while True:
        budget *= 0.5
        try:
            plan = _plan(work, budget)
        except InfeasibleMemoryError as err:
            assert err.smallest_budget_bytes > budget
            break
        assert plan.fits and plan.ledger.peak_memory_bytes <= budget
        kept += 1
    assert kept >= 1  # at least one budget below the unconstrained plan's peak was met


def test_compare_keeps_no_plan_over_budget(work):
    fsdp = plan_baseline(trace(work.step, *work.args), Baseline.FSDP, mesh=(2, 4), cluster="cpu-8", options=OPTIONS)
    budget = fsdp.plan.ledger.peak_memory_bytes * 1.01  # FSDP fits; data parallelism, replicating state, not
    tight = compare(work.step, work.args, mesh=(2, 4), cluster="cpu-8", memory_budget=budget, options=OPTIONS,
                    baselines=(Baseline.DP, Baseline.FSDP))
    assert tight.fallback is not None
    assert tight.autoshard.fits and tight.autoshard.peak_bytes <= budget
    assert tight.autoshard.step_s <= tight.fallback.step_s * (1 + 1e-9)
