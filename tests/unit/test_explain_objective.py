"""Explanations are the objective: each op's explained price is its contribution to the objective the ILP
minimized (``objective.PlanObjective``), the contributions sum to that objective, and two strategies'
explained totals differ exactly as the step recomputed with either does.

On the examples, planned on a (2, 4) mesh of the CPU preset.
"""
from __future__ import annotations

import functools
import math

import pytest

from autoshard.compiler.explain import op_explanations
from autoshard.compiler.target import resolve_target
from autoshard.ir.trace import trace
from autoshard.passes.cost_graph import IntraOpOptions
from autoshard.passes.intra_op import plan_intra_op
from autoshard.passes.objective import PlanObjective, plan_cost
from autoshard.passes.plan_result import IntraOpResult
from autoshard.passes.strategies import strategies_for
from examples import convnet, gpt, mlp, moe

EXAMPLES = {"mlp": (mlp, "tiny"), "convnet": (convnet, "tiny"), "gpt": (gpt, "tiny"), "moe": (moe, "tiny"),
            "gpt-small": (gpt, "small")}
CASES = [pytest.param(name, marks=pytest.mark.slow if name == "gpt-small" else ()) for name in EXAMPLES]
REL = 1e-9


@functools.cache
def planned(name: str) -> IntraOpResult:
    module, config = EXAMPLES[name]
    work = module.workload(config, abstract=True)
    mesh = resolve_target((2, 4), "cpu-8", None).meshes[0]
    return plan_intra_op(trace(work.step, *work.args), mesh, IntraOpOptions(time_limit_s=5.0))


@pytest.mark.parametrize("name", CASES)
def test_explained_prices_are_the_contributions_and_sum_to_the_objective(name: str) -> None:
    result = planned(name)
    graph = result.graph
    terms = PlanObjective(graph, result.mesh, result.node_strategies)
    parts = [terms.contribution(j) for j in range(len(graph.ops))]
    explained = op_explanations(result)
    assert len(explained) > 5
    for j, e in explained.items():  # the chosen alternative's explained total is its contribution
        assert (e.chosen.compute_s, e.chosen.comm_s, e.chosen.reshard_s) == pytest.approx(
            (parts[j].compute_s, parts[j].comm_s, parts[j].reshard_s), rel=REL, abs=1e-15), (j, e.primitive)
    total = (sum(p.total_s for p in parts) + terms.write_back_s + terms.charges_s + terms.input_s
             + terms.input_comm_s)
    check = result.objective
    assert check is not None and check.agrees()
    assert total == pytest.approx(check.recomputed_s, rel=REL)
    assert total == pytest.approx(check.ilp_s, rel=1e-6)  # the ILP's own objective of the chosen classes
    assert total == pytest.approx(result.step_s, rel=1e-6)
    assert sum(p.reshard_s for p in parts) + terms.write_back_s == pytest.approx(check.recomputed.reshard_s,
                                                                                 rel=REL, abs=1e-15)


@pytest.mark.parametrize("name", CASES)
def test_alternatives_differ_as_the_step_does(name: str) -> None:
    """An alternative's explained total less the chosen one's is the objective of the plan with that
    alternative less the plan's own, recomputed on the whole graph (consumers' reshards, shared copies and
    combined latencies included); checked on a sample of explained ops."""
    result = planned(name)
    graph, mesh = result.graph, result.mesh
    base = plan_cost(graph, mesh, result.node_strategies).total_s
    explained = op_explanations(result, top_k=3)
    sample = sorted(explained)[::max(1, len(explained) // 12)]
    checked = 0
    for j in sample:
        op = graph.ops[j]
        options = {str(s): s for s in strategies_for(op, [graph.values[v] for v in op.inputs],
                                                     [graph.values[v] for v in op.outputs], mesh)}
        e = explained[j]
        for alt in e.alternatives:
            swapped = list(result.node_strategies)
            swapped[len(graph.inputs) + j] = options[alt.strategy]
            step = plan_cost(graph, mesh, swapped).total_s
            assert alt.total_s - e.chosen.total_s == pytest.approx(step - base, rel=1e-9, abs=base * 1e-12), (
                j, e.primitive, alt.strategy)
            checked += 1
    assert checked >= 5
    for e in explained.values():  # the alternatives kept are the cheapest, cheapest first
        totals = [a.total_s for a in e.alternatives]
        assert totals == sorted(totals) and all(math.isfinite(t) for t in totals)


def test_a_plans_explanations_are_made_when_first_read(monkeypatch) -> None:
    """``Plan.explanations`` are priced when read, once, not while planning (most plans are never explained);
    a pickled plan (a compile worker's) carries them made, equal to the op-by-op pricing."""
    import pickle

    import autoshard
    from autoshard.compiler import driver

    made = []
    monkeypatch.setattr(driver, "op_explanations", lambda result: made.append(result) or op_explanations(result))
    work = mlp.workload("tiny", abstract=True)
    plan = autoshard.plan(work.step, *work.args, mesh=(2, 4), cluster="cpu-8", num_stages=1)
    assert not made, "explanations priced while planning"
    explained = dict(plan.explanations)
    assert len(made) == 1 and explained == op_explanations(made[0]) and len(explained) > 2
    assert plan.explanations == explained and len(made) == 1  # made once
    again = pickle.loads(pickle.dumps(plan))
    assert type(again.explanations) is dict and again.explanations == explained and len(made) == 1
