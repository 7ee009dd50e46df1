"""Plans stay within their budget (the ILP is re-solved with cuts until the simulated peak fits), and
compare() never keeps an over-budget plan while a classic one fits."""
from __future__ import annotations

import collections
import dataclasses
import math
import time

import numpy as np
import pytest

import autoshard
from autoshard.compiler.baselines import compare, plan_baseline
from autoshard.compiler.target import state_floor_bytes
from autoshard.errors import InfeasibleMemoryError, SolverTimeoutError
from autoshard.ir.trace import trace
from autoshard.passes import budget_search
from autoshard.passes.classic import Baseline
from autoshard.passes.ilp import warm
from autoshard.passes.intra_op import IntraOpOptions
from autoshard.passes.lowering import search_starts_of
from autoshard.plans.ledger import SolverInfo, solver_summary
from examples import gpt

OPTIONS = IntraOpOptions(time_limit_s=0.5)


@pytest.fixture(scope="module")
def work():
    return gpt.workload("tiny", abstract=True)


def _plan(work, budget):
    return autoshard.plan(work.step, *work.args, mesh=(2, 4), cluster="cpu-8", memory_budget=budget,
                          num_stages=1, options=OPTIONS)


@pytest.mark.slow  # a further case: test_every_budget_at_or_above_the_named_smallest_plans sweeps the budgets
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
                    baselines=(Baseline.DP, Baseline.FSDP), check=None)
    assert tight.fallback is not None
    assert tight.autoshard.fits and tight.autoshard.peak_bytes <= budget
    assert tight.autoshard.step_s <= tight.fallback.step_s * (1 + 1e-9)


def _mlp12():
    """The issue's 12-layer MLP (H 2048, batch 4096, Adam): refused at 567 MiB with "472 MiB fits" once."""
    import jax
    import jax.numpy as jnp
    import optax

    width, batch, depth = 2048, 4096, 12
    tx = optax.adam(1e-3)

    def loss_fn(params, data):
        x = data["x"]
        for w in params:
            x = jax.nn.relu(x @ w)
        return jnp.mean((x - data["y"]) ** 2)

    def step(params, opt_state, data):
        loss, grads = jax.value_and_grad(loss_fn)(params, data)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = [jax.ShapeDtypeStruct((width, width), jnp.float32) for _ in range(depth)]
    data = {k: jax.ShapeDtypeStruct((batch, width), jnp.float32) for k in ("x", "y")}
    return step, (params, jax.eval_shape(tx.init, params), data), (1, 4), "1x8-a100"


def _gpt_tiny():
    work = gpt.workload("tiny", abstract=True)
    return work.step, work.args, (2, 4), "cpu-8"


@pytest.mark.parametrize("model", [pytest.param(_mlp12, marks=pytest.mark.slow), _gpt_tiny])
def test_every_budget_at_or_above_the_named_smallest_plans(model):
    """The infeasibility search and the error agree: the smallest budget an InfeasibleMemoryError names
    plans, and so does every larger budget, each plan within its budget."""
    step, args, mesh, cluster = model()

    def plan(budget):  # the promise holds at any solver limit: a short one keeps the sweep's ~40 solves quick
        return autoshard.plan(step, *args, mesh=mesh, cluster=cluster, memory_budget=budget, num_stages=1,
                              options=IntraOpOptions(time_limit_s=0.5))

    free = plan(None).ledger.peak_memory_bytes
    # just above what the parameters and optimizer state need split over every device (below it the budget
    # is refused before any search, without a smallest budget: compiler/target.check_budget_floor)
    floor = state_floor_bytes(trace(step, *args), math.prod(mesh))
    with pytest.raises(InfeasibleMemoryError) as refused:
        plan(floor * 1.2)
    smallest = refused.value.smallest_budget_bytes
    assert 0 < smallest <= free * (1 + 1e-9)
    for factor in (1.0, 1.03, 1.2, 1.5):
        budget = min(smallest * factor, free)
        got = plan(budget)
        assert got.ledger.peak_memory_bytes <= budget * (1 + 1e-9), (factor, budget)
    assert plan(567 * 2**20) if model is _mlp12 else True  # the budget plans


def test_a_plan_found_below_its_budget_is_bounded_at_the_budget(work):
    """A plan the budget search found below its budget (the ILP's budget lowered after the plan at the budget
    peaked over it with copies the ILP does not count) is proven only against the bound of the solve at the
    budget itself, which holds for every plan that fits (``budget_search.bounded``): its gap is measured from
    there, it is optimal only when it reaches that bound, and without a bound its gap is unknown (inf)."""
    from autoshard.meshes.cluster import get_cluster
    from autoshard.meshes.logical import make_logical_mesh
    from autoshard.passes.budget_search import bounded
    from autoshard.passes.intra_op import plan_intra_op

    result = plan_intra_op(trace(work.step, *work.args), make_logical_mesh(get_cluster("cpu-8"), (2, 4)), OPTIONS)
    cost = result.ilp.objective_s
    below = bounded(result, 0.8 * cost)
    assert below.ilp.status == "feasible (memory budget lowered)" and below.ilp.gap == pytest.approx(0.2)
    assert below.ilp.objective_s == cost and below.step_s == result.step_s  # only the proof changes
    reached = bounded(result, cost * (1 - 1e-9))
    assert reached.ilp.status == "optimal" and reached.ilp.gap == 0.0
    unknown = bounded(result, -math.inf)
    assert unknown.ilp.status == "feasible (memory budget lowered)" and unknown.ilp.gap == math.inf
    least_memory = dataclasses.replace(result, ilp=dataclasses.replace(result.ilp, status="least-memory"))
    least = bounded(least_memory, 0.5 * cost)
    assert least.ilp.status == "least-memory" and least.ilp.gap == pytest.approx(0.5)
    summary = solver_summary(SolverInfo(below.ilp.status, below.ilp.gap, 1.0, 1, 1, 1, 1, 1))
    assert "re-solved below the budget" in summary


def test_the_rounds_of_a_budget_search_share_the_time_limit(work, monkeypatch):
    """Every round of ``plan_within`` whose plan peaks over the budget solves again: the rounds share the solver's
    limit (each later one gets what is left of it, at least ``ROUND_SHARE`` of it), so a budget that binds costs
    about one limit and a few shares, not one limit a round (7 rounds of a toy step's search each ran its whole
    limit out). Here every solve runs its limit out and every plan peaks over the budget: all rounds run."""
    from autoshard.ir.trace import trace as trace_step
    from autoshard.meshes.cluster import get_cluster
    from autoshard.meshes.logical import make_logical_mesh
    from autoshard.passes.cost_graph import CostGraph
    from autoshard.passes.ilp import IlpSolution, evaluate

    limit = 0.3
    cg = CostGraph(trace_step(work.step, *work.args), make_logical_mesh(get_cluster("cpu-8"), (2, 4)),
                   IntraOpOptions(time_limit_s=limit))
    limits = []

    def out_of_time(problem, later_hint=None):  # a solve that runs its limit out and keeps its hint
        limits.append(problem.time_limit_s)
        time.sleep(problem.time_limit_s)
        hint = problem.hint if problem.hint is not None else later_hint() if later_hint is not None else None
        if hint is None:
            raise SolverTimeoutError("out of time without a plan")
        return IlpSolution(np.asarray(hint), evaluate(problem, hint).objective_s, "feasible", math.inf,
                           problem.time_limit_s, 0, 0)

    monkeypatch.setattr(budget_search, "solve", out_of_time)
    monkeypatch.setattr(budget_search, "fits", lambda peak, budget: False)  # no plan fits: every round runs
    for kept, share in ((False, budget_search.ROUND_SHARE), (True, budget_search.WARM_ROUND_SHARE)):
        # a round whose LP starts from an earlier optimum's basis gets the larger share
        monkeypatch.setattr(budget_search, "starts_warm", lambda problem, kept=kept: kept)
        limits.clear()
        budget_search.BudgetSearch(cg).plan_within(2.0**30)
        rounds = limits[:budget_search.MAX_MEMORY_ROUNDS]
        assert len(rounds) == budget_search.MAX_MEMORY_ROUNDS and rounds[0] == limit
        assert all(r == pytest.approx(share * limit) for r in rounds[2:]), rounds
        assert sum(rounds) <= limit * (2 + share * (len(rounds) - 2)), rounds


def test_a_named_budget_plans_again_when_the_solves_find_nothing_that_fits(monkeypatch):
    """The plan that proved the budget an error named is remembered: planning again at that budget succeeds
    even when this time's (time-limited) solves, the least-memory plan and the search's starts all peak over
    it, so the promise does not rest on the solves repeating themselves."""
    work = gpt.workload("tiny", abstract=True)

    def plan(budget):
        return autoshard.plan(work.step, *work.args, mesh=(2, 4), cluster="cpu-8", memory_budget=budget,
                              num_stages=1, options=IntraOpOptions(time_limit_s=0.5))

    floor = state_floor_bytes(trace(work.step, *work.args), 8)
    with pytest.raises(InfeasibleMemoryError) as refused:
        plan(floor * 1.2)
    named = refused.value.smallest_budget_bytes

    def nothing(problem, later_hint=None):
        raise SolverTimeoutError("this time the solve found no plan")

    def replicated(cg_or_problem):  # every class on its first strategy: no plan at all near the named budget
        n = cg_or_problem.num_nodes if hasattr(cg_or_problem, "num_nodes") else cg_or_problem.classes.num_classes
        return np.zeros(n, dtype=np.int64)

    monkeypatch.setattr(budget_search, "solve", nothing)
    monkeypatch.setattr(budget_search, "min_peak_plan", lambda problem: (0.0, replicated(problem)))
    monkeypatch.setattr(budget_search, "search_starts_of", lambda cg: (replicated(cg),))
    again = plan(named)
    assert again.fits and again.ledger.peak_memory_bytes <= named * (1 + 1e-9)
    monkeypatch.setattr(budget_search, "_PROVEN", collections.OrderedDict())  # forget it: the test can fail
    with pytest.raises(InfeasibleMemoryError):
        plan(named)


def test_the_search_starts_are_made_only_for_a_solve_left_unproven(work, monkeypatch):
    """HiGHS reads its hint, the best search start, after the LP: a solve the LP proves never makes the starts
    (on small programs their greedy descents were a third of the pass); one cut short falls back on them."""
    made = []
    monkeypatch.setattr(budget_search, "search_starts_of", lambda cg: made.append(cg) or search_starts_of(cg))

    def plan(seconds):
        return autoshard.plan(work.step, *work.args, mesh=(2, 4), cluster="cpu-8", num_stages=1,
                              options=IntraOpOptions(time_limit_s=seconds))

    proven = plan(30.0)
    assert proven.solver.status == "optimal" and made == []
    warm.clear()  # (from the proven LP's kept basis the solve at 0.01 s would be proven too)
    cut_short = plan(0.01)
    assert cut_short.solver.status != "optimal" and len(made) == 1
    assert cut_short.step_s >= proven.step_s * (1 - 1e-9)
