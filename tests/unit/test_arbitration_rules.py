"""Compiled arbitration without compiling: the option, the no-good cuts, group pricing, the choice, the plan file.

- ``check`` takes None or "compiled" only, refused before any tracing;
- no-good cuts (``IlpProblem.excluded``): ``evaluate`` flags an excluded plan, brute force and CP-SAT skip it,
  and ``next_best`` returns the plans in the brute-force order of a hand-built problem;
- ``compiled_price`` prices each collective by its replica groups' links and node crossings;
- ``arbitrate`` returns the fastest compiled contender that fits (compiling faked: the summaries are given);
- a plan's compiled price and contest survive the plan file.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import autoshard
from autoshard.compiler import arbiter
from autoshard.compiler.arbiter import arbitrate, check_option
from autoshard.compiler.compile_plans import CompiledPlan
from autoshard.compiler.driver import plan_graph
from autoshard.compiler.hlo import CompiledSummary, HloCollective
from autoshard.compiler.hlo_parse import replica_groups_of
from autoshard.compiler.verify import collective_price_s, crosses_nodes
from autoshard.errors import PlanningError
from autoshard.ir.spec import Spec
from autoshard.ir.trace import trace
from autoshard.meshes import cost
from autoshard.meshes.cluster import get_cluster
from autoshard.meshes.logical import make_logical_mesh
from autoshard.passes.ilp import IlpProblem, brute_force, evaluate, solve
from autoshard.passes.ilp.candidates import exact_cut, next_best
from autoshard.passes.intra_op import IntraOpOptions
from autoshard.plans.plan import load_plan
from autoshard.report import arbitration_table, ledger_table

FAST = IntraOpOptions(time_limit_s=0.5)


# ----------------------------------------------------------------------------- the option


def test_check_values_are_refused_before_anything_runs():
    def step(_x):
        raise AssertionError("traced although the option was invalid")

    for bad in ("xla", "Compiled", True, 1):
        with pytest.raises(ValueError, match="check must be None"):
            autoshard.plan(step, np.zeros(4), check=bad)
        with pytest.raises(ValueError, match="check must be None"):
            autoshard.autoshard(step, check=bad)
    assert check_option(None) is None and check_option("compiled") == "compiled"


# ----------------------------------------------------------------------------- no-good cuts


def _problem() -> IlpProblem:
    """Three nodes in a chain; the costs make every plan's objective different."""
    rng = np.random.default_rng(3)
    costs = tuple(rng.uniform(0, 1, size=n) for n in (3, 2, 3))
    edges = ((0, 1), (1, 2))
    matrices = tuple(rng.uniform(0, 1, size=(len(costs[u]), len(costs[v]))) for u, v in edges)
    return IlpProblem(("a", "b", "c"), costs, edges, matrices, memory_points=(), memory_budget_bytes=None,
                      time_limit_s=5.0)


def test_excluded_plans_are_flagged_and_skipped_by_brute_force_and_cp_sat():
    problem = _problem()
    best = brute_force(problem)
    cut = dataclasses.replace(problem, excluded=(exact_cut(problem, best.choices),))
    assert any("no-good cut 0" in v for v in evaluate(cut, best.choices).violations)
    second = brute_force(cut)
    assert not np.array_equal(second.choices, best.choices) and second.objective_s > best.objective_s
    got = solve(cut)
    assert got.objective_s == pytest.approx(second.objective_s) and np.array_equal(got.choices, second.choices)
    # a cut marking two strategies of node 0 excludes both plans that differ only there
    wide = tuple(m.copy() for m in exact_cut(problem, best.choices))
    wide[0][:] = True
    both = dataclasses.replace(problem, excluded=(wide,))
    assert not np.array_equal(solve(both).choices[1:], best.choices[1:])
    everything = dataclasses.replace(problem, excluded=(tuple(np.ones(len(c), bool) for c in problem.node_costs),))
    with pytest.raises(PlanningError, match="exclude every plan"):
        solve(everything)


def test_next_best_follows_the_brute_force_order():
    problem = _problem()
    sizes = [len(c) for c in problem.node_costs]
    every = sorted((evaluate(problem, np.array(ch)).objective_s, ch) for ch in np.ndindex(*sizes))
    best = brute_force(problem)
    found = next_best(problem, exact_cut(problem, best.choices), 3, lambda ch: exact_cut(problem, ch))
    assert [tuple(s.choices) for s in found] == [ch for _, ch in every[1:4]]
    # a plan ``keep`` refuses is cut and not returned
    refused = tuple(every[1][1])
    kept = next_best(problem, exact_cut(problem, best.choices), 2, lambda ch: exact_cut(problem, ch),
                     keep=lambda s: tuple(s.choices) != refused)
    assert [tuple(s.choices) for s in kept] == [ch for _, ch in every[2:4]]


# ----------------------------------------------------------------------------- group pricing


def _collective(kind: str, groups: tuple[tuple[int, ...], ...], nbytes: int = 2**24) -> HloCollective:
    return HloCollective(kind, nbytes, max(map(len, groups)), len(groups), 1, "", groups)  # type: ignore[arg-type]


def test_replica_groups_read_their_members():
    assert replica_groups_of("[4,2]<=[2,4]T(1,0)") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert replica_groups_of("mesh['a'=2,'b'=8] {'a'}") == tuple((j, 8 + j) for j in range(8))
    assert replica_groups_of("mesh['a'=8] {'a':(2)2}") == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert replica_groups_of("mesh['x'=1,'y'=4,'z'=2], device_ids=([2,4]T(1,0)) {'y'}") == ((0, 1, 2, 3),
                                                                                           (4, 5, 6, 7))
    assert replica_groups_of("{}", 4) == ((0, 1, 2, 3),)


def test_compiled_collectives_are_priced_by_their_groups_links_and_node_crossings():
    two_nodes = get_cluster("2x8-a100")
    mesh = make_logical_mesh(two_nodes, (2, 8), ("x", "y"))
    intra, inter = two_nodes.intra_node, two_nodes.inter_node
    rows = tuple(tuple(range(8 * i, 8 * i + 8)) for i in range(2))
    cols = tuple((j, 8 + j) for j in range(8))
    # the groups of an axis: priced as the planner prices that axis
    assert collective_price_s(mesh, _collective("all-reduce", rows)) == pytest.approx(
        cost.all_reduce_s(mesh, "y", 2**24))
    assert collective_price_s(mesh, _collective("all-reduce", cols)) == pytest.approx(
        cost.ring_all_reduce_s(2**24, 2, inter))
    assert not crosses_nodes(mesh, _collective("all-reduce", rows))
    assert crosses_nodes(mesh, _collective("all-reduce", cols))
    # two of the sixteen in each group, both on one node: a ring on NVLink, not the 2-device axis x across nodes
    pairs = tuple((2 * k, 2 * k + 1) for k in range(8))
    assert collective_price_s(mesh, _collective("all-gather", pairs)) == pytest.approx(
        cost.ring_all_gather_s(2**24, 2, intra))
    # the same group size across nodes, with two members per node: two NICs
    across = tuple((k, k + 1, 8 + k, 9 + k) for k in range(0, 8, 2))
    link = collective_price_s(mesh, _collective("reduce-scatter", across))
    assert link == pytest.approx(cost.ring_reduce_scatter_s(
        2**24, 4, dataclasses.replace(inter, bandwidth_bytes_per_s=2 * inter.bandwidth_bytes_per_s)))
    # a permute: one message at the slowest link any pair crosses
    assert collective_price_s(mesh, _collective("collective-permute", ((0, 1), (1, 0)))) == pytest.approx(
        cost.point_to_point_s(2**24, intra))
    assert collective_price_s(mesh, _collective("collective-permute", ((0, 1), (7, 8)))) == pytest.approx(
        cost.point_to_point_s(2**24, inter))


# ----------------------------------------------------------------------------- the choice and the plan file


@pytest.fixture(scope="module")
def steps():
    from examples import mlp

    work = mlp.workload("tiny", abstract=True)
    graph = trace(work.step, *work.args)
    planned = plan_graph(graph, mesh=(2, 4), cluster="1x8-a100", options=FAST)
    pins = {i: Spec.replicated(graph.values[v].rank) for i, v in enumerate(graph.inputs)}
    replicated = plan_graph(graph, mesh=(2, 4), cluster="1x8-a100",
                            options=dataclasses.replace(FAST, pinned_inputs=pins))
    return planned, replicated


def _summary(flops: float) -> CompiledSummary:
    return CompiledSummary((), {}, 0, 0, 0, 0, 0, flops, 0.0)


def test_arbitration_returns_the_fastest_compiled_contender_that_fits(steps, monkeypatch):
    first, second = steps
    flops = {"model's choice": 4e12, "second": 1e12, "over budget": 1e11, "broken": None}
    over = dataclasses.replace(second, plan=dataclasses.replace(second.plan, memory_budget_bytes=1.0,
                                                                name="over budget"))
    contenders = [("model's choice", first), ("second", second), ("over budget", over), ("broken", second)]

    named = [(n, dataclasses.replace(s, plan=dataclasses.replace(s.plan, name=n))) for n, s in contenders]
    compiled: list[str] = []

    def fake_compile(_graph, plans):
        compiled.extend(p.name for p in plans)
        return [CompiledPlan(None, "did not compile", 0.0, "here") if flops[p.name] is None
                else CompiledPlan(_summary(flops[p.name]), None, 0.0, "here") for p in plans]

    monkeypatch.setattr(arbiter, "compile_plans", fake_compile)
    same = arbitrate(named[1:])  # one plan under three names: one program, compiled once, priced alike
    assert compiled == ["second"] and same.winner.name == "second"
    assert len({c.compiled_s for c in same.contenders}) == 1
    monkeypatch.setattr(arbiter, "program_key", lambda plan: plan.name)  # now pretend they are four programs
    got = arbitrate(named)
    assert got.winner.name == "second"  # the over-budget one is faster but cannot win
    by_name = {c.name: c for c in got.contenders}
    assert by_name["broken"].price is None and by_name["broken"].error == "did not compile"
    assert got.winner.plan.ledger.compiled_step_s == pytest.approx(got.winner.price.step_s)
    assert min(c.compiled_s for c in got.contenders if c.compiled_s is not None and c.plan.fits) == \
        got.winner.compiled_s
    table = got.table()
    assert table["second"]["chosen"] == 1.0 and "compiled_s" not in table["broken"]
    assert table["model's choice"]["compiled_s"] > table["second"]["compiled_s"]


def test_compiled_price_and_contest_survive_the_plan_file(steps, tmp_path):
    planned, _ = steps
    plan = planned.plan
    led = dataclasses.replace(plan.ledger, compiled_step_s=2.5e-6, compiled_compute_s=2e-6,
                              compiled_collectives_s=0.5e-6)
    contest = {"autoshard": {"modeled_s": plan.step_s, "compiled_s": 2.5e-6, "fits": 1.0, "chosen": 1.0},
               "DP": {"modeled_s": 3e-6, "fits": 1.0, "chosen": 0.0}}
    plan = dataclasses.replace(plan, ledger=led, arbitration=contest, checks={"compiled arbitration": "autoshard"})
    plan.save(tmp_path / "plan.json")
    back = load_plan(tmp_path / "plan.json")
    assert back.ledger.compiled_step_s == 2.5e-6 and back.ledger.prediction_error == pytest.approx(
        (plan.step_s - 2.5e-6) / 2.5e-6)
    assert back.arbitration == contest
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(ledger_table(back), arbitration_table(back))
    text = console.export_text()
    assert "compiled step (XLA)" in text and "did not compile" in text
    assert dataclasses.replace(plan.ledger, compiled_step_s=0.0).prediction_error is None
