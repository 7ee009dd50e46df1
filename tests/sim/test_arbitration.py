"""Compiled arbitration on real XLA compiles (8 simulated devices; 16 in a child process).

- ``autoshard.plan(..., check="compiled")`` returns the contender whose compiled program is fastest among
  those that fit; its ledger carries the compiled price beside the modeled one, its plan file the contest;
- the model's order does not decide: a slower program listed first loses;
- the next-best plans differ from the chosen one and from each other in layout;
- a 16-device plan compiles in a child process, and its collectives over both nodes are priced so;
- the decorator with ``check="compiled"`` runs the plan it chose: loss and updated parameters as on one device.
"""
from __future__ import annotations

import dataclasses

import pytest

import autoshard
from autoshard.compiler.arbiter import arbitrate, next_best_steps, program_key
from autoshard.compiler.baselines import Baseline, plan_baseline
from autoshard.compiler.compile_plans import compile_plans
from autoshard.compiler.verify import compiled_price
from autoshard.ir.trace import trace
from autoshard.passes.intra_op import IntraOpOptions
from examples import mlp

FAST = IntraOpOptions(time_limit_s=1.0)


@pytest.fixture(scope="module")
def work():
    return mlp.workload("tiny", abstract=True)


def test_plan_check_compiled_returns_the_fastest_compiled_contender(work, tmp_path):
    plan = autoshard.plan(work.step, *work.args, mesh=(2, 4), cluster="1x8-a100", num_stages=1, options=FAST,
                          check="compiled")
    contest = plan.arbitration
    assert len(contest) >= 3  # the model's choice, next-best plans, the best classic plan
    assert [name for name, row in contest.items() if row["chosen"]] and plan.ledger.compiled_step_s > 0
    fitting = {name: row["compiled_s"] for name, row in contest.items() if row["fits"] and "compiled_s" in row}
    chosen = next(name for name, row in contest.items() if row["chosen"])
    assert fitting[chosen] == min(fitting.values()) == pytest.approx(plan.ledger.compiled_step_s)
    assert plan.ledger.step_s == pytest.approx(contest[chosen]["modeled_s"])
    assert plan.ledger.prediction_error is not None and "compiled arbitration" in plan.checks
    plan.save(tmp_path / "plan.json")
    back = autoshard.load_plan(tmp_path / "plan.json")
    assert back.arbitration == contest and back.ledger.compiled_step_s == plan.ledger.compiled_step_s


def test_a_slower_program_listed_first_loses(work):
    graph = trace(work.step, *work.args)
    fsdp = plan_baseline(graph, Baseline.FSDP, mesh=(2, 4), cluster="1x8-a100", options=FAST)
    dp = plan_baseline(graph, Baseline.DP, mesh=(2, 4), cluster="1x8-a100", options=FAST)
    got = arbitrate([("FSDP first", fsdp), ("DP", dp)])
    prices = {c.name: c.compiled_s for c in got.contenders}
    assert None not in prices.values()
    assert got.winner.name == min(prices, key=prices.get)
    assert got.winner.name == "DP"  # a tiny batch: gathering and scattering the state costs more than it saves


def test_next_best_plans_are_distinct_programs_that_fit(work):
    chosen = autoshard.compiler.driver.plan_step(work.step, work.args, mesh=(2, 4), cluster="1x8-a100",
                                                 options=FAST)
    # a ceiling: the three plans are proven in 0.3-0.7 s each (with cut rows, HiGHS took 6-8 s each)
    nexts = next_best_steps(chosen, FAST, k=3, time_limit_s=10.0)
    assert nexts, "no next-best plan found"
    keys = [program_key(s.plan) for s in (chosen, *nexts)]
    assert len(set(keys)) == len(keys)
    assert all(s.plan.fits for s in nexts)
    assert [s.plan.name for s in nexts] == [f"autoshard next-best {i}" for i in range(1, len(nexts) + 1)]


def test_a_sixteen_device_plan_compiles_in_a_child_process():
    work = mlp.workload("tiny", abstract=True, batch_size=64)  # the batch splits over all 16 devices
    graph = trace(work.step, *work.args)
    dp = plan_baseline(graph, Baseline.DP, mesh=(2, 8), cluster="2x8-a100", options=FAST)
    [got] = compile_plans(graph, [dp.plan])
    assert got.error is None and got.where == "child process of 16 devices"
    price = compiled_price(dp.plan, got.summary)
    assert any(c.group_size == 16 for c in got.summary.collectives)  # a collective over both nodes
    assert price.cross_node_collectives >= 1 and price.collectives_s > 0
    modeled = dataclasses.asdict(dp.plan.ledger)["collective_bytes"]
    assert sum(modeled.values()) == pytest.approx(sum(got.summary.bytes_by_kind.values()), rel=0.1)


def test_the_decorator_runs_the_arbitrated_plan_with_one_device_numerics():
    import jax
    import numpy as np

    real = mlp.workload("tiny")
    want = jax.jit(real.step)(*jax.device_put(real.args, jax.devices()[0]))
    step = autoshard.autoshard(real.step, mesh=(2, 4), cluster="1x8-a100", num_stages=1, options=FAST,
                               check="compiled")
    got = step(*mlp.workload("tiny").args)  # fresh arrays: the decorated step donates its state
    assert step.plan.ledger.compiled_step_s > 0 and step.plan.arbitration
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=1e-6)  # the loss
    for a, b in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0])):  # parameters after one Adam step
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
