"""The memory promise: a plan is never over its budget, and the budget an InfeasibleMemoryError names is
one at which planning succeeds, with a compiled peak near it (issue: keep the memory promise)."""
from __future__ import annotations

import re

import pytest

import autoshard
from autoshard.compiler.verify import verify_compiled
from autoshard.errors import InfeasibleMemoryError
from autoshard.passes.intra_op import IntraOpOptions
from examples import gpt

OPTIONS = IntraOpOptions(time_limit_s=0.5)  # the promise holds at any solver limit
READABLE = re.compile(r"smallest budget that fits is (\d+(?:\.\d+)?) (B|KiB|MiB|GiB)")


@pytest.fixture(scope="module")
def work():
    return gpt.workload("small", abstract=True)


def _named(work, mesh):
    with pytest.raises(InfeasibleMemoryError) as info:
        autoshard.plan(work.step, *work.args, mesh=mesh, cluster="cpu-8", memory_budget=1e6, num_stages=1,
                       options=OPTIONS)
    found = READABLE.search(str(info.value))
    assert found and float(found.group(1)) > 0, f"the error should name a real budget: {info.value}"
    return info.value.smallest_budget_bytes


def test_the_named_budget_plans_and_compiles_near_it(work, devices8):
    budget = _named(work, (2, 4))
    step = autoshard.autoshard(work.step, mesh=(2, 4), cluster="cpu-8", memory_budget=budget, num_stages=1,
                               options=OPTIONS)
    compiled = step.lower(*work.args).compile()
    assert step.plan.fits and step.plan.ledger.peak_memory_bytes <= budget
    peak = verify_compiled(step.plan, compiled).row("peak memory bytes").compiled
    assert abs(peak - budget) <= 0.15 * budget, f"compiled peak {peak:.0f} vs the named budget {budget:.0f}"


def test_a_searched_mesh_names_a_real_budget_that_plans(work):
    budget = _named(work, None)
    plan = autoshard.plan(work.step, *work.args, cluster="cpu-8", memory_budget=budget, num_stages=1,
                          options=OPTIONS)
    assert plan.fits
