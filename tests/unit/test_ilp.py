"""The intra-op ILP solver (passes/ilp/): a hand-built problem with its total worked out,
random small problems against brute force, memory infeasibility, determinism and the hint."""
from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest

from autoshard.errors import InfeasibleMemoryError, PlanningError, SolverTimeoutError
from autoshard.passes.ilp import IlpProblem, brute_force, evaluate, local_search, min_peak_memory, solve
from autoshard.passes.ilp import warm
from autoshard.passes.ilp.presolve import presolve
from autoshard.passes.ilp.problem import SharedCharge, SharedReshard

MS = 1e-3
INF = np.inf


def _mlp_problem(budget: float | None = 14.0) -> IlpProblem:
    """x @ w1 -> h -> relu -> loss on 2 devices; costs in ms, bytes per device.

    node  name  strategies (index: spec)            cost (ms)
    0     x     0: S(0)  1: R                       0.5  0     (splitting the batch costs a scatter)
    1     w1    0: R     1: S(1)                    0    0
    2     h     0: S(0)R 1: RS(1) 2: RR             2    2   8
    3     relu  0: S(0)R 1: RS(1) 2: RR             1    1   4
    4     loss  0: R                                1          (one strategy: folded by presolve)

    edges (resharding, ms)       rows = producer strategy, columns = consumer strategy
    x  -> h     S(0): [0 3 3]    R: [0 0 0]      (all-gather x unless h keeps the batch split)
    w1 -> h     R: [0 0 0]       S(1): [5 0 5]   (all-gather w1 unless h keeps it split)
    h  -> relu  [[0 2 2], [inf 0 2], [2 2 0]]   (RS(1) -> S(0)R is forbidden)
    relu->loss  S(0)R: 1  RS(1): 2  RR: 0       (reduce the partial loss)

    memory (bytes): point 0 = 1 (constant) + x [2 8] + w1 [8 2] + h [3 3 12];
                    point 1 = h [3 3 12] + relu [3 3 12]; budget 14.

    Unconstrained optimum: x=R, w1=R, h=S(0)R, relu=S(0)R:
        nodes 0 + 0 + 2 + 1 + 1 = 4, edges 0 + 0 + 0 + 1 = 1, total 5 ms; point 0 = 1 + 8 + 8 + 3 = 20 B.
    Under 14 B, x and w1 cannot both be replicated and h cannot be RR (1 + 2 + 2 + 12 > 14):
        x=S(0), w1=R,    h=S(0)R, relu=S(0)R: nodes 0.5 + 2 + 1 + 1, edges 1         = 5.5 ms, point 0 = 14 B
        x=R,    w1=S(1), h=RS(1), relu=RS(1): nodes 0 + 2 + 1 + 1,   edges 2         = 6   ms
        x=S(0), w1=S(1), h=RS(1), relu=RS(1): nodes 0.5 + 2 + 1 + 1, edges 3 + 2     = 9.5 ms
        (every other mix pays a 3 or 5 ms gather on top)                             -> 5.5 ms.
    Smallest peak: x=S(0), w1=S(1): point 0 = 1 + 2 + 2 + 3 = 8 B.
    """
    return IlpProblem(
        node_names=("x", "w1", "h", "relu", "loss"),
        node_costs=tuple(np.array(c) * MS for c in ([0.5, 0], [0, 0], [2, 2, 8], [1, 1, 4], [1])),
        edges=((0, 2), (1, 2), (2, 3), (3, 4)),
        edge_costs=tuple(np.array(m) * MS for m in (
            [[0, 3, 3], [0, 0, 0]],
            [[0, 0, 0], [5, 0, 5]],
            [[0, 2, 2], [INF, 0, 2], [2, 2, 0]],
            [[1], [2], [0]],
        )),
        memory_points=(
            ((0, np.array([2.0, 8.0])), (1, np.array([8.0, 2.0])), (2, np.array([3.0, 3.0, 12.0]))),
            ((2, np.array([3.0, 3.0, 12.0])), (3, np.array([3.0, 3.0, 12.0]))),
        ),
        memory_constant_bytes=(1.0, 0.0),
        memory_budget_bytes=budget,
    )


def test_hand_built_problem_matches_worked_total() -> None:
    problem = _mlp_problem()
    solution = solve(problem)
    assert solution.status == "optimal" and solution.gap == 0.0
    assert solution.choices.tolist() == [0, 0, 0, 0, 0]
    assert solution.objective_s == pytest.approx(5.5 * MS, rel=1e-12)
    check = evaluate(problem, solution.choices)
    assert check.violations == ()
    assert check.memory_bytes == (14.0, 6.0)
    assert check.node_s == pytest.approx(4.5 * MS) and check.edge_s == pytest.approx(1.0 * MS)

    free = solve(dataclasses.replace(problem, memory_budget_bytes=None))
    assert free.choices.tolist() == [1, 0, 0, 0, 0]
    assert free.objective_s == pytest.approx(5.0 * MS, rel=1e-12)
    assert min_peak_memory(problem) == 8.0


def test_hand_built_problem_below_min_peak_names_the_smallest_budget() -> None:
    with pytest.raises(InfeasibleMemoryError) as info:
        solve(_mlp_problem(budget=7.0))
    assert info.value.smallest_budget_bytes == 8.0
    assert info.value.budget_bytes == 7.0 and info.value.liveness_point == 0
    message = str(info.value)
    assert "smallest budget that fits is 8 B" in message and "liveness point 0" in message
    assert "raise memory_budget or use more devices" in message


def test_evaluate_reports_every_violation() -> None:
    problem = _mlp_problem(budget=10.0)
    check = evaluate(problem, np.array([1, 0, 1, 0, 5]))  # R, R, RS(1), S(0)R (forbidden pair), out of range
    text = " | ".join(check.violations)
    assert "'h' -> 'relu'" in text and "forbidden" in text
    assert "out of range" in text and "'loss'" in text
    assert "over budget at liveness point 0 by 10 bytes" in text  # 1 + 8 + 8 + 3 = 20 > 10
    assert check.objective_s == np.inf
    assert evaluate(problem, np.array([0, 0])).violations  # wrong length


def _random_problem(rng: np.random.Generator) -> IlpProblem:
    n = int(rng.integers(2, 9))
    sizes = rng.integers(1, 5, size=n)
    while np.prod(sizes) > 20_000:
        sizes[rng.integers(n)] = 1

    def costs(shape: tuple[int, ...], inf_rate: float) -> np.ndarray:
        c = rng.uniform(0.0, 1.0, size=shape) * (rng.random(shape) > 0.2)
        return np.where(rng.random(shape) < inf_rate, INF, c)

    edges = [tuple(int(x) for x in rng.choice(n, size=2, replace=False)) for _ in range(int(rng.integers(0, 2 * n)))]
    matrices = [costs((int(sizes[u]), int(sizes[v])), 0.15) for u, v in edges]
    for m in matrices:  # strategies that share a layout share a row or column of the edge matrix
        if rng.random() < 0.5:
            m[rng.integers(m.shape[0])] = m[rng.integers(m.shape[0])]
        if rng.random() < 0.5:
            m[:, rng.integers(m.shape[1])] = m[:, rng.integers(m.shape[1])]
    points = []
    for _ in range(int(rng.integers(0, 4))):
        members = rng.choice(n, size=int(rng.integers(1, n + 1)), replace=False)
        points.append(tuple((int(i), rng.integers(0, 11, size=sizes[i]).astype(np.float64)) for i in members))
    return IlpProblem(
        node_names=tuple(f"n{i}" for i in range(n)),
        node_costs=tuple(costs((int(k),), 0.1) for k in sizes),
        edges=tuple(edges),
        edge_costs=tuple(matrices),
        memory_points=tuple(points),
        memory_constant_bytes=tuple(float(rng.integers(0, 5)) for _ in points) if rng.random() < 0.5 else (),
        time_limit_s=10.0,
    )


def _outcome(run, problem: IlpProblem):
    try:
        return run(problem)
    except InfeasibleMemoryError as error:
        return error
    except PlanningError as error:
        return error


def _solved_as_brute_force(problem: IlpProblem, instance: int):
    """The solver's outcome, asserted to be brute force's (the same error, or the same objective); None on
    an error."""
    expected, got = _outcome(brute_force, problem), _outcome(solve, problem)
    assert type(got) is type(expected), (instance, expected, got)
    if isinstance(expected, PlanningError):
        return None
    assert got.objective_s == pytest.approx(expected.objective_s, rel=1e-6, abs=1e-12), instance
    return got


@pytest.mark.parametrize("backend", ["mip", "cpsat"])
def test_random_problems_match_brute_force(backend: str) -> None:
    rng = np.random.default_rng(2024)
    kinds = {"solved": 0, "memory": 0, "forbidden": 0}
    for instance in range(60):
        problem = dataclasses.replace(_random_problem(rng), solver=backend)
        lowest = None  # brute force's minimum peak
        try:
            brute_force(dataclasses.replace(problem, memory_budget_bytes=-1.0))
        except InfeasibleMemoryError as error:
            lowest = error.smallest_budget_bytes
        except PlanningError:
            pass
        if lowest is not None:
            assert min_peak_memory(problem) == lowest, instance
            if instance % 2:  # a budget around the minimum peak, sometimes below it
                problem = dataclasses.replace(problem, memory_budget_bytes=lowest + float(rng.integers(-2, 6)))
        expected, got = _outcome(brute_force, problem), _outcome(solve, problem)
        assert type(got) is type(expected), (instance, expected, got)
        if isinstance(expected, InfeasibleMemoryError):
            kinds["memory"] += 1
            assert got.smallest_budget_bytes == expected.smallest_budget_bytes == lowest, instance
        elif isinstance(expected, PlanningError):
            kinds["forbidden"] += 1
        else:
            kinds["solved"] += 1
            assert got.status == "optimal" and got.gap == 0.0, instance
            assert got.objective_s == pytest.approx(expected.objective_s, rel=1e-6, abs=1e-12), instance
            check = evaluate(problem, got.choices)
            assert check.violations == (), (instance, check.violations)
            assert check.objective_s == got.objective_s
    assert min(kinds.values()) >= 3, kinds  # every outcome was exercised


def _medium_problem(seed: int) -> IlpProblem:
    """A chain-like graph too big to enumerate: 80 nodes x 6 strategies."""
    rng = np.random.default_rng(seed)
    n, k = 80, 6
    edges = [(i, i + 1) for i in range(n - 1)] + [(i, i + int(rng.integers(2, 6))) for i in range(0, n - 6, 3)]
    return IlpProblem(
        node_names=tuple(f"op{i}" for i in range(n)),
        node_costs=tuple(rng.uniform(0, 1, size=k) for _ in range(n)),
        edges=tuple(edges),
        edge_costs=tuple(rng.uniform(0, 1, size=(k, k)) * (1 - np.eye(k)) for _ in edges),
        memory_points=tuple(tuple((j, rng.integers(1, 10, size=k).astype(float)) for j in range(i, i + 8))
                            for i in range(0, n - 8, 4)),
        memory_budget_bytes=45.0,
        time_limit_s=10.0,
    )


@pytest.mark.parametrize("backend", ["mip", "cpsat"])
def test_same_problem_same_answer(backend: str) -> None:
    problem = dataclasses.replace(_medium_problem(seed=7), solver=backend)
    first, second = solve(problem), solve(problem)
    assert first.status == "optimal"  # so the time limit played no part
    assert first.choices.tolist() == second.choices.tolist()
    assert first.objective_s == second.objective_s
    assert evaluate(problem, first.choices).violations == ()
    assert first.num_variables > problem.num_nodes and first.num_constraints > problem.num_nodes


@pytest.mark.parametrize("backend", ["mip", "cpsat"])
def test_never_worse_than_the_hint(backend: str) -> None:
    problem = dataclasses.replace(_medium_problem(seed=3), solver=backend)
    hint = np.zeros(problem.num_nodes, dtype=np.int64)
    hint_s = evaluate(dataclasses.replace(problem, memory_budget_bytes=None), hint).objective_s
    for time_limit_s in (1e-3, 0.05, 10.0):  # a time-out returns the hint rather than failing
        timed = dataclasses.replace(problem, memory_budget_bytes=None, hint=hint, time_limit_s=time_limit_s)
        solution = solve(timed)
        assert solution.objective_s <= hint_s
        assert evaluate(timed, solution.choices).violations == ()
        assert solution.gap >= 0.0


def test_hint_beats_a_plan_that_only_wins_by_rounding() -> None:
    """Costs below one tick: the integer model prefers r (1.4 -> 1 tick) over p + q (0.6 + 0.6 ->
    2 ticks), the float objective prefers p + q. Memory forces "p and q expensive" or "r expensive":
    point = p [1 0] + q [1 0] + r [2 0] <= 2. The hint (p + q) must come back."""
    tick = 1e-9  # the largest cost (node z) is 1 s = 1e9 ticks
    problem = IlpProblem(
        node_names=("p", "q", "r", "z"),
        node_costs=(np.array([0, 0.6 * tick]), np.array([0, 0.6 * tick]), np.array([0, 1.4 * tick]),
                    np.array([0, 1.0])),
        edges=(), edge_costs=(),
        # z's own point keeps its 1 s strategy from being dominated (presolve P5), so the scale stays
        memory_points=(((0, np.array([1.0, 0.0])), (1, np.array([1.0, 0.0])), (2, np.array([2.0, 0.0]))),
                       ((3, np.array([1.0, 0.0])),)),
        memory_budget_bytes=2.0, solver="cpsat",
    )
    assert solve(problem).choices.tolist() == [0, 0, 1, 0]  # the rounded model's optimum: 1.4 ticks
    assert brute_force(problem).objective_s == pytest.approx(1.2 * tick)
    hinted = solve(dataclasses.replace(problem, hint=np.array([1, 1, 0, 0])))
    assert hinted.choices.tolist() == [1, 1, 0, 0]
    assert hinted.objective_s == pytest.approx(1.2 * tick)
    # HiGHS prices in floating point: it finds the float optimum without the hint
    assert solve(dataclasses.replace(problem, solver="mip")).choices.tolist() == [1, 1, 0, 0]


def test_forbidden_everywhere_names_the_node() -> None:
    problem = IlpProblem(
        node_names=("a", "b"),
        node_costs=(np.array([0.0, INF]), np.array([1.0, 2.0])),
        edges=((0, 1),), edge_costs=(np.array([[INF, INF], [0.0, 0.0]]),),
        memory_points=(),
    )
    with pytest.raises(PlanningError, match="node 'a' has no allowed strategy"):
        solve(problem)


def test_malformed_problems_are_refused() -> None:
    with pytest.raises(ValueError, match="cost matrix must have shape"):
        dataclasses.replace(_mlp_problem(), edge_costs=(np.zeros((2, 2)),) * 4)
    with pytest.raises(ValueError, match="appears twice"):
        dataclasses.replace(_mlp_problem(), memory_points=(((0, np.ones(2)), (0, np.ones(2))),),
                            memory_constant_bytes=())


def test_brute_force_refuses_big_problems() -> None:
    with pytest.raises(ValueError, match="refused"):
        brute_force(_medium_problem(seed=0))


# ----------------------------------------------------------------------------- shared charges


def _charged(charge_s: float) -> IlpProblem:
    """Three gradient reductions: each replicated (0: 3 ms of compute) or split with an all-reduce
    (1: 1 ms), the all-reduces combined into one whose latency ``charge_s`` is paid once.

    all split: 1 + 1 + 1 + charge;  none split: 3 + 3 + 3 = 9;  a mix pays the charge and more compute.
    charge 5 ms: all split, 8 ms.  charge 7 ms: none split, 9 ms."""
    split = np.array([False, True])
    return IlpProblem(
        node_names=("g0", "g1", "g2"), node_costs=tuple(np.array([3.0, 1.0]) * MS for _ in range(3)),
        edges=(), edge_costs=(), memory_points=(),
        charges=(SharedCharge("combined all-reduce", charge_s * MS, ((0, split), (1, split), (2, split))),),
    )


@pytest.mark.parametrize("charge_s, want, total", [(5.0, [1, 1, 1], 8.0), (7.0, [0, 0, 0], 9.0)])
def test_a_shared_charge_is_paid_once(charge_s, want, total) -> None:
    problem = _charged(charge_s)
    for result in (solve(problem), brute_force(problem)):
        assert list(result.choices) == want
        assert result.objective_s == pytest.approx(total * MS)
    assert evaluate(problem, np.array([1, 0, 0])).charge_s == pytest.approx(charge_s * MS)
    assert evaluate(problem, np.array([1, 1, 1])).charge_s == pytest.approx(charge_s * MS)  # once, not 3 times
    assert evaluate(problem, np.array([0, 0, 0])).charge_s == 0.0


def test_local_search_sees_shared_charges() -> None:
    problem = _charged(5.0)
    # from none split, one move at a time: the first split pays the whole charge (a move up), ICM alone stays
    # put; the perturbation rounds find the all-split plan
    assert list(local_search(problem, np.array([0, 0, 0]), iterations=0)) == [0, 0, 0]
    assert list(local_search(problem, np.array([0, 0, 0]), iterations=50)) == [1, 1, 1]
    # from all split, dropping one saves no latency: stays
    assert list(local_search(problem, np.array([1, 1, 1]), iterations=0)) == [1, 1, 1]


@pytest.mark.parametrize("backend", ["mip", "cpsat"])
def test_random_problems_with_charges_match_brute_force(backend: str) -> None:
    rng = np.random.default_rng(7)
    for instance in range(30):
        base = _random_problem(rng)
        charges = []
        for k in range(int(rng.integers(1, 3))):
            members = rng.choice(base.num_nodes, size=int(rng.integers(1, base.num_nodes + 1)), replace=False)
            charges.append(SharedCharge(f"c{k}", float(rng.uniform(0, 1.5)), tuple(
                (int(i), rng.random(len(base.node_costs[i])) < 0.5) for i in members)))
        _solved_as_brute_force(dataclasses.replace(base, charges=tuple(charges), solver=backend), instance)


@pytest.mark.parametrize("backend", ["mip", "cpsat"])
def test_random_problems_with_shared_reshards_match_brute_force(backend: str) -> None:
    """A shared reshard pays each distinct layout its readers choose once: brute force, both backends and
    the local search's moves agree on it."""
    rng = np.random.default_rng(5)
    for instance in range(30):
        base = _random_problem(rng)
        groups = []
        for k in range(int(rng.integers(1, 3))):
            producer = int(rng.integers(base.num_nodes))
            others = [i for i in range(base.num_nodes) if i != producer]
            readers = rng.choice(others, size=min(len(others), int(rng.integers(1, 4))), replace=False)
            layouts = int(rng.integers(1, 4))
            groups.append(SharedReshard(f"r{k}", producer,
                                        rng.uniform(0, 1, size=(len(base.node_costs[producer]), layouts)),
                                        tuple((int(r), rng.integers(-1, layouts, size=len(base.node_costs[r])))
                                              for r in readers)))
        problem = dataclasses.replace(base, reshards=tuple(groups), solver=backend)
        got = _solved_as_brute_force(problem, instance)
        if got is None:
            continue
        check = evaluate(problem, got.choices)
        assert check.violations == () and check.reshard_s >= 0
        hinted = solve(dataclasses.replace(problem, hint=got.choices))
        assert hinted.objective_s == pytest.approx(got.objective_s, rel=1e-6, abs=1e-12), instance
    one = SharedReshard("made once", 0, np.array([[0.0, 5.0], [1.0, 0.0]]), ((1, np.array([1, 0])),
                                                                            (2, np.array([1, -1]))))
    # producer 0 (layout 0 free, layout 1 costs 5); readers 1 and 2 both read layout 1: paid once
    assert one.cost_s(np.array([0, 0, 0])) == 5.0
    # producer 1: reader 1 reads layout 0 (costs 1), reader 2 layout 1 (free from there)
    assert one.cost_s(np.array([1, 1, 0])) == 1.0


def test_a_pair_that_pays_a_reshard_wins_over_the_restricted_lp() -> None:
    """The MIP backend solves the LP without the pairs that pay a reshard first (``lp.solve_lp``): here
    every free pair costs more than reading a reshard, so the restricted optimum (both nodes in one layout,
    4 ms) is not the answer and the whole LP's (u in A, v in B, 1 + 1 + 0.5 ms) is."""
    problem = IlpProblem(
        node_names=("u", "v"), node_costs=(np.array([1.0, 3.0]) * MS, np.array([3.0, 1.0]) * MS),
        edges=((0, 1),), edge_costs=(np.array([[0.0, 0.5], [0.5, 0.0]]) * MS,), memory_points=(),
    )
    result = solve(problem)
    assert list(result.choices) == [0, 1] and result.status == "optimal"
    assert result.objective_s == pytest.approx(2.5 * MS)


def _dominance_problem(**extra) -> IlpProblem:
    """Node 0's strategy 1 costs more than strategy 0 and reshards alike: dominated; strategy 2 equals
    strategy 0 in every term: a tie, kept."""
    return IlpProblem(node_names=("a", "b"), node_costs=(np.array([1.0, 2.0, 1.0]) * MS, np.array([0.0, 3.0]) * MS),
                      edges=((0, 1),), edge_costs=(np.array([[0.0, 1.0], [0.0, 1.0], [0.0, 1.0]]) * MS,),
                      memory_points=extra.pop("memory_points", ()), **extra)


@pytest.mark.parametrize("extra, kept", [
    ({}, [0, 2]),
    ({"memory_points": (((0, np.array([8.0, 4.0, 8.0])),),), "memory_budget_bytes": 100.0}, [0, 1, 2]),
    ({"charges": (SharedCharge("latency", 1 * MS, ((0, np.array([True, False, True])),)),)}, [0, 1, 2]),
    ({"charges": (SharedCharge("latency", 1 * MS, ((0, np.array([False, True, False])),)),)}, [0, 2]),
    ({"reshards": (SharedReshard("read", 1, np.array([[0.0, 1.0], [1.0, 0.0]]) * MS,
                                 ((0, np.array([1, 0, 1])),)),)}, [0, 1, 2]),
    ({"reshards": (SharedReshard("read", 1, np.array([[0.0, 1.0], [1.0, 0.0]]) * MS,
                                 ((0, np.array([1, -1, 1])),)),)}, [0, 1, 2]),
    ({"reshards": (SharedReshard("read", 1, np.array([[0.0, 1.0], [1.0, 0.0]]) * MS,
                                 ((0, np.array([-1, 1, -1])),)),)}, [0, 2]),
    ({"excluded": ((np.array([True, False, False]), np.array([True, True])),)}, [0, 1, 2]),
], ids=["dominated", "needs-fewer-bytes", "escapes-a-charge", "pays-a-charge", "reads-another-layout",
        "reads-none-priced", "reads-a-layout-the-other-skips", "no-good-cuts"])
def test_presolve_drops_a_strategy_only_when_another_is_no_worse_everywhere(extra, kept) -> None:
    """P5 (``presolve.dominated``): strategy 1 goes only when strategy 0 is no worse in every term (bytes,
    shared charges, the layout it reads) and cheaper in one; brute force over the whole problem agrees."""
    problem = _dominance_problem(**extra)
    assert list(presolve(problem).allowed[0]) == kept
    assert solve(problem).objective_s == pytest.approx(brute_force(problem).objective_s)


def _frustrated_ring(size: int = 5) -> IlpProblem:
    """An odd ring of two-strategy nodes whose every edge charges 1 s for equal choices: some edge must pay
    (optimum 1 s), while the LP relaxation pays nothing (every node half on each strategy)."""
    equal = np.array([[1.0, 0.0], [0.0, 1.0]])
    return IlpProblem(node_names=tuple(f"n{i}" for i in range(size)),
                      node_costs=tuple(np.zeros(2) for _ in range(size)),
                      edges=tuple((i, (i + 1) % size) for i in range(size)),
                      edge_costs=tuple(equal for _ in range(size)), memory_points=(), time_limit_s=5.0)


def test_a_fractional_lp_without_time_for_the_mip_still_bounds_the_plan(monkeypatch) -> None:
    """Left no time for HiGHS's MIP, the fractional LP's rounding is priced and returned, and its optimum
    (0 s) is the bound: the gap is finite and true (100%), not unknown."""
    import autoshard.passes.ilp.mip as mip

    monkeypatch.setattr(mip, "_MIP_SHARE", 2.0)  # never enough time left for the MIP
    problem = _frustrated_ring()
    found = mip.solve_mip(problem)
    assert found.status == "feasible" and found.gap == pytest.approx(1.0)
    assert found.objective_s == evaluate(problem, found.choices).objective_s >= 1.0
    assert solve(problem).objective_s == pytest.approx(1.0)  # the local search mends the rounding
    monkeypatch.setattr(mip, "_MIP_SHARE", 0.3)
    assert mip.solve_mip(problem).status == "optimal"  # with time, the MIP proves it


def test_an_lp_out_of_time_without_a_plan_falls_back_on_the_hint_not_a_mip_in_overtime(monkeypatch) -> None:
    """The LP stopped at the time limit with no plan: with a hint and the limit spent, no MIP runs (one whose
    relaxation did not finish finds nothing in the tenth of a second it would be given) and the hint is the
    plan; without a hint, the MIP is still tried, as the only way to any plan."""
    import time

    import scipy.optimize

    import autoshard.passes.ilp.mip as mip
    from autoshard.passes.ilp.highs_model import MipBuilder

    problem = dataclasses.replace(_medium_problem(seed=7), time_limit_s=0.05)
    out_of_time = scipy.optimize.OptimizeResult(status=1, x=None, fun=None, message="Time limit reached")
    monkeypatch.setattr(mip, "solve_lp", lambda b, limit_s, *args: time.sleep(limit_s) or out_of_time)
    mips = []
    real = MipBuilder.solve
    monkeypatch.setattr(MipBuilder, "solve", lambda self, *a, **k: mips.append(1) or real(self, *a, **k))
    hint = np.zeros(problem.num_nodes, dtype=np.int64)
    hinted = dataclasses.replace(problem, memory_budget_bytes=None, hint=hint)
    found = mip.solve_mip(hinted, hint)
    assert mips == [] and found.choices.tolist() == hint.tolist() and found.status == "feasible"
    with contextlib.suppress(SolverTimeoutError):  # (whether the MIP finds a plan in its tenth of a second)
        mip.solve_mip(problem, None)
    assert mips == [1]


def test_a_hint_kept_after_an_lp_out_of_time_is_rated_against_the_stopped_dual_simplexs_bound(monkeypatch) -> None:
    """The LP stopped with no plan but with a stopped dual simplex's bound (``stopped_bound``, in the LP's
    units): the hint is the plan, and its gap is taken against that bound plus the seconds presolve took
    out of the LP, so the plan says how far from optimal it may be instead of "no bound"."""
    import time

    import scipy.optimize

    import autoshard.passes.ilp.mip as mip

    problem = dataclasses.replace(_medium_problem(seed=7), time_limit_s=0.05, memory_budget_bytes=None)
    optimum = solve(dataclasses.replace(problem, time_limit_s=10.0))
    assert optimum.status == "optimal"
    warm.clear()  # (from the kept basis of that optimum, the LP would be solved at once)
    red = presolve(problem)
    ticks = mip._ticks(red)
    lp_bound = 0.8 * (optimum.objective_s - red.const_s) * ticks  # a valid bound, short of the LP's optimum
    stopped = scipy.optimize.OptimizeResult(status=1, x=None, fun=None, mip_dual_bound=lp_bound,
                                            message="Time limit reached")
    monkeypatch.setattr(mip, "solve_lp", lambda b, limit_s, *args: time.sleep(limit_s) or stopped)
    hint = np.zeros(problem.num_nodes, dtype=np.int64)
    found = mip.solve_mip(dataclasses.replace(problem, hint=hint), hint)
    bound_s = lp_bound / ticks + red.const_s
    assert bound_s <= optimum.objective_s
    assert found.choices.tolist() == hint.tolist() and found.status == "feasible"
    assert found.gap == pytest.approx((found.objective_s - bound_s) / found.objective_s, rel=1e-9)
    assert 0 < found.gap < 1


def _edge_lp(problem: IlpProblem):
    """The LP builder of ``problem``'s strategies and edges (no memory rows), and its column upper bounds."""
    import autoshard.passes.ilp.mip as mip

    red = presolve(problem)
    ticks = mip._ticks(red)
    b = mip._new(problem, red, ticks)
    mip._add_edges(b, ticks)
    return b, np.concatenate(b.upper)


def test_a_fractional_lp_is_dived_to_an_integral_plan() -> None:
    """``mip.dive`` fixes one node at a time at its largest strategy variable and re-solves the LP warm until it is
    integral: on the frustrated ring (LP optimum 0 s, every node half on each strategy) the dive ends at a plan,
    and one that costs the optimum, 1 s."""
    import autoshard.passes.ilp.mip as mip
    from autoshard.passes.ilp.highs_model import highs_lp, run_highs
    from autoshard.passes.ilp.lp import integral

    problem = _frustrated_ring(7)
    b, upper = _edge_lp(problem)
    highs = highs_lp(b, upper)
    lp = run_highs(highs, 5.0)
    assert lp.status == 0 and not integral(b, lp.x) and lp.fun == pytest.approx(0.0, abs=1e-9)
    lp.highs = highs
    dived = mip.dive(b, lp, 5.0)
    assert dived is not None and integral(b, dived.x)
    assert evaluate(problem, mip._decode(b, dived.x)).objective_s == pytest.approx(1.0)


def _tied_chain(size: int = 6) -> IlpProblem:
    """A chain of two-strategy nodes that must all choose alike (a mismatched pair is forbidden): strategy 0
    costs nothing and holds 10 bytes, strategy 1 costs 1 ms and holds 1 byte; one memory point over them all
    at 7 bytes a node. The LP takes every node 2/3 on strategy 0 (the budget binds), so every node is split
    alike: one mixture of the all-0 plan, over the budget, and the all-1 plan, under it."""
    tied = np.array([[0.0, INF], [INF, 0.0]])
    return IlpProblem(node_names=tuple(f"n{i}" for i in range(size)),
                      node_costs=tuple(np.array([0.0, 1.0]) * MS for _ in range(size)),
                      edges=tuple((i, i + 1) for i in range(size - 1)),
                      edge_costs=tuple(tied for _ in range(size - 1)),
                      memory_points=(tuple((i, np.array([10.0, 1.0])) for i in range(size)),),
                      memory_budget_bytes=7.0 * size, time_limit_s=5.0)


def test_a_block_split_alike_is_fixed_to_its_other_share_in_one_re_solve(monkeypatch) -> None:
    """``mip.dive`` first fixes every node split alike (their largest variables equal) to its second-largest
    strategy at once, the plan a binding memory row lets through, and keeps it when the LP then stays within
    ``_DIVE_GAP`` of the bound: on the tied chain one re-solve gives the all-1 plan. Further from the bound the
    block's bounds are put back and the dive goes on a node at a time (here: fixing one node to strategy 0 forces
    all, over the budget, so the dive finds nothing)."""
    import time

    import autoshard.passes.ilp.mip as mip
    from autoshard.passes.ilp.highs_model import highs_lp, run_highs
    from autoshard.passes.ilp.lp import integral

    problem = _tied_chain()
    red = presolve(problem)
    ticks = mip._ticks(red)
    b = mip._new(problem, red, ticks)
    mip._add_edges(b, ticks)
    mip._add_memory(b, problem.memory_budget_bytes)

    def relaxed():
        highs = highs_lp(b, np.concatenate(b.upper))
        lp = run_highs(highs, 5.0)
        assert lp.status == 0 and not integral(b, lp.x)
        lp.highs = highs
        return lp

    lp = relaxed()
    assert len(mip.split_alike(b, lp.x)) == problem.num_nodes
    runs = []
    real = mip.run_highs
    monkeypatch.setattr(mip, "run_highs", lambda *a: runs.append(1) or real(*a))
    monkeypatch.setattr(mip, "_DIVE_GAP", 10.0)  # the all-1 plan (6 ms) is 3x the LP's 2 ms: let it through
    dived = mip.dive(b, lp, 5.0)
    assert dived is not None and integral(b, dived.x) and len(runs) == 1
    assert mip._decode(b, dived.x).tolist() == [1] * problem.num_nodes
    assert evaluate(problem, mip._decode(b, dived.x)).objective_s == pytest.approx(6 * MS)

    monkeypatch.setattr(mip, "_DIVE_GAP", 0.01)
    lp = relaxed()
    assert mip._block_fixed(b, lp.highs, lp.x, lp.fun, time.perf_counter() + 5.0) is None
    again = real(lp.highs, 5.0)  # the block's bounds are back: the LP has its first optimum again
    assert again.status == 0 and again.fun == pytest.approx(lp.fun) and not integral(b, again.x)
    assert mip.dive(b, relaxed(), 5.0) is None  # one node at a time: fixing one to strategy 0 fixes all, over budget


def test_a_dive_close_to_the_bound_leaves_the_mip_a_share_of_the_limit(monkeypatch) -> None:
    """A fractional LP's dive that lands within ``_DIVE_GAP`` of the LP's bound, counting what every plan pays
    (here a 1000 s op no choice changes, which presolve folds out of the LP), leaves HiGHS's MIP only
    ``_POLISH_SHARE`` of the limit to prove or better it, not the rest of the limit; the dive is the plan when the
    MIP finds nothing better, with its true gap. A dive further off leaves the MIP the rest of the limit."""
    import scipy.optimize

    import autoshard.passes.ilp.mip as mip
    from autoshard.passes.ilp.highs_model import MipBuilder

    given = []

    def nothing_found(_builder, time_limit_s, relaxed=False):
        given.append(time_limit_s)
        return scipy.optimize.OptimizeResult(status=1, x=None, fun=None, message="Time limit reached")

    ring = _frustrated_ring(5)
    problem = dataclasses.replace(ring, node_names=(*ring.node_names, "big"),
                                  node_costs=(*ring.node_costs, np.array([1000.0])), time_limit_s=5.0)
    monkeypatch.setattr(MipBuilder, "solve", nothing_found)
    found = mip.solve_mip(problem)
    assert found.objective_s == pytest.approx(1001.0) == evaluate(problem, found.choices).objective_s
    assert found.status == "feasible" and found.gap == pytest.approx(1.0 / 1001.0)
    assert given == [pytest.approx(mip._POLISH_SHARE * 5.0, rel=0.01)]  # (of the limit less the build)
    given.clear()
    monkeypatch.setattr(mip, "_DIVE_GAP", 1e-4)  # a dive further off than that: the MIP gets the rest
    assert mip.solve_mip(problem).objective_s == pytest.approx(1001.0)
    assert len(given) == 1 and given[0] > 0.9 * 5.0


def test_the_lp_race_returns_a_finished_optimum() -> None:
    """``lp.ColdStart`` solves the whole LP in a thread while the continuation runs in this one: what the race
    returns is an optimum of the LP (the same value as either alone) with the model that found it, whichever
    finishes first, also when the cold start has finished before the race begins; and a stopped cold start
    leaves no thread behind."""
    import threading
    import time

    from autoshard.passes.ilp.highs_model import highs_lp, run_highs
    from autoshard.passes.ilp.lp import ColdStart

    b, upper = _edge_lp(_frustrated_ring(7))
    alone = run_highs(highs_lp(b, upper), 5.0)
    cold = ColdStart(b, upper, time.perf_counter() + 5.0)
    found, model = cold.race(highs_lp(b, upper), time.perf_counter() + 5.0)
    assert found.status == 0 and found.fun == pytest.approx(alone.fun) and model is not None
    early = ColdStart(b, upper, time.perf_counter() + 5.0)
    assert early.finished.wait(5.0)
    found, model = early.race(highs_lp(b, upper), time.perf_counter() + 5.0)
    assert found.status == 0 and found.fun == pytest.approx(alone.fun) and model is early.model
    threads = threading.active_count()
    ColdStart(b, upper, time.perf_counter() + 5.0).stop()
    assert threading.active_count() == threads


@pytest.mark.parametrize("seed", range(6))
def test_the_lagrangian_bound_is_the_lp_optimum_at_its_duals_and_below_it_anywhere(seed: int) -> None:
    """``lp.lagrangian_bound`` (a stopped dual simplex's bound, ``solve_lp``) is a lower bound on the LP
    whatever the row multipliers, and the optimum itself at the optimal basis's duals: checked on chain-like problems
    with memory rows that bind, against random and perturbed multipliers and none."""
    import autoshard.passes.ilp.mip as mip
    from autoshard.passes.ilp.highs_model import highs_lp, row_duals, run_highs
    from autoshard.passes.ilp.lp import lagrangian_bound

    problem = _medium_problem(seed)
    red = presolve(problem)
    ticks = mip._ticks(red)
    b = mip._new(problem, red, ticks)
    mip._add_edges(b, ticks)
    mip._add_charges(b, ticks)
    mip._add_reshards(b, ticks)
    if problem.memory_budget_bytes is not None:
        assert mip._add_memory(b, problem.memory_budget_bytes)
    upper = np.concatenate(b.upper)
    highs = highs_lp(b, upper, dual=True)
    optimum = run_highs(highs, 30.0)
    assert optimum.status == 0
    duals = row_duals(b, highs)
    assert lagrangian_bound(b, duals, upper) == pytest.approx(optimum.fun, rel=1e-6, abs=1e-3)
    rng = np.random.default_rng(seed)
    scale = max(float(np.abs(duals).max()), 1.0)
    for y in (rng.normal(0.0, scale, size=len(duals)), duals + rng.normal(0.0, 0.05 * scale, size=len(duals)),
              np.zeros(len(duals))):
        assert lagrangian_bound(b, y, upper) <= optimum.fun + 1e-6 * abs(optimum.fun) + 1e-6


@pytest.mark.parametrize("budget, expected_ms", [(20.0, 5.0), (1e9, 5.0)])
def test_memory_rows_that_can_bind_are_proven_by_the_lp_alone(monkeypatch, budget: float, expected_ms: float) -> None:
    """Memory rows go into the LP relaxation like every other row: a budget the rows can reach (20 B: the
    unconstrained optimum peaks at exactly 20) and one they cannot are both proven optimal by the LP without
    HiGHS's MIP (which stopped at 50-75% gaps on the large cells when it was given such problems first)."""
    import autoshard.passes.ilp.mip as mip
    from autoshard.passes.ilp.highs_model import MipBuilder

    def no_mip(*_args, **_kwargs):
        raise AssertionError("HiGHS's MIP was called for a problem whose LP relaxation is integral")

    monkeypatch.setattr(MipBuilder, "solve", no_mip)
    found = mip.solve_mip(_mlp_problem(budget))
    assert found.status == "optimal" and found.objective_s == pytest.approx(expected_ms * MS)
    assert max(evaluate(_mlp_problem(budget), found.choices).memory_bytes) <= budget


def test_the_cold_start_runs_only_with_a_core_to_spare(monkeypatch) -> None:
    """``lp.spare_core`` reads the machine's busy time since its last look less this process's own: another
    process keeping a core busy on two cores leaves none for a second HiGHS thread, this process's own
    threads do not count, one usable core never races, and a window under ``WINDOW_S`` keeps the last
    answer. Without a spare core ``solve_lp`` starts no ``ColdStart`` and still reaches the same optimum."""
    import autoshard.passes.ilp.lp as lp

    clock = {"wall": 100.0, "busy": 0.0, "own": 0.0}
    monkeypatch.setattr(lp, "_cpu_now", lambda: (clock["wall"], clock["busy"], clock["own"]))
    monkeypatch.setattr(lp.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(lp.os, "sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    meter = lp._CoreMeter()

    def after(seconds: float, busy_cores: float, own_cores: float) -> bool:
        clock["wall"] += seconds
        clock["busy"] += seconds * busy_cores
        clock["own"] += seconds * own_cores
        return meter.spare()

    assert after(1.0, busy_cores=1.0, own_cores=1.0)  # only this process: a core is free
    assert after(1.0, busy_cores=2.0, own_cores=2.0)  # its own two threads: still this process's
    assert not after(1.0, busy_cores=2.0, own_cores=1.0)  # another process takes the second core
    assert not after(0.1, busy_cores=1.0, own_cores=1.0)  # too short a window: the last answer stands
    assert after(1.0, busy_cores=1.2, own_cores=1.0)  # a fifth of a core elsewhere leaves enough
    monkeypatch.setattr(lp.os, "sched_getaffinity", lambda _pid: {0}, raising=False)
    assert not after(1.0, busy_cores=1.0, own_cores=1.0)  # one usable core never races

    # proven in 0.4 s either way (seed 5 took 7.4 of its 10 s: on a loaded host it stopped "feasible")
    problem = _medium_problem(seed=7)
    monkeypatch.setattr(lp, "EARLY_COLD_COLUMNS", 0)  # every LP would start its cold start at once
    started = []

    class Counted(lp.ColdStart):
        def __init__(self, *args, **kwargs):
            started.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(lp, "ColdStart", Counted)
    monkeypatch.setattr(lp, "spare_core", lambda: True)
    with_race = solve(problem)
    assert started
    started.clear()
    monkeypatch.setattr(lp, "spare_core", lambda: False)
    alone = solve(problem)
    assert not started
    assert with_race.status == alone.status == "optimal" and alone.objective_s == pytest.approx(with_race.objective_s)


@pytest.mark.parametrize("extra", ["plain", "charges", "reshards"])
def test_a_cutoff_stops_the_solve_only_when_no_plan_beats_it(extra: str) -> None:
    """``IlpProblem.cutoff_s``: a solve given a cutoff above the optimum returns the optimum; below it, it may
    stop with ``CutOffError``, whose bound lies between the cutoff and the optimum (the LP's objective plus the
    seconds presolve takes out, ``Reduced.const_s``: an integral LP's bound is the optimum itself)."""
    from autoshard.errors import CutOffError

    rng = np.random.default_rng({"plain": 11, "charges": 12, "reshards": 13}[extra])
    cut = exact = 0
    for instance in range(40):
        problem = _random_problem(rng)
        if extra == "charges":
            problem = dataclasses.replace(problem, charges=tuple(
                SharedCharge(f"c{k}", float(rng.uniform(0, 1.5)), tuple(
                    (int(i), rng.random(len(problem.node_costs[i])) < 0.5)
                    for i in rng.choice(problem.num_nodes, size=int(rng.integers(1, problem.num_nodes + 1)),
                                        replace=False)))
                for k in range(2)))
        elif extra == "reshards":
            producer = int(rng.integers(problem.num_nodes))
            readers = [i for i in range(problem.num_nodes) if i != producer][:3]
            problem = dataclasses.replace(problem, reshards=(SharedReshard(
                "r", producer, rng.uniform(0, 1, size=(len(problem.node_costs[producer]), 2)),
                tuple((r, rng.integers(-1, 2, size=len(problem.node_costs[r]))) for r in readers)),))
        expected = _outcome(brute_force, problem)
        if isinstance(expected, PlanningError) or expected.objective_s <= 0:
            continue
        best = expected.objective_s
        above = solve(dataclasses.replace(problem, cutoff_s=best * (1 + 1e-6) + 1e-12))
        assert above.objective_s == pytest.approx(best, rel=1e-6, abs=1e-12), instance
        below = best * (1 - 1e-6)
        try:
            got = solve(dataclasses.replace(problem, cutoff_s=below))
        except CutOffError as err:
            assert below < err.bound_s <= best * (1 + 1e-9) + 1e-15, (instance, err.bound_s, best)
            cut += 1
            exact += err.bound_s == pytest.approx(best, rel=1e-9)
        else:
            assert got.objective_s == pytest.approx(best, rel=1e-6, abs=1e-12), instance
    assert cut >= 10 and exact >= 10, (cut, exact)


def test_the_cold_start_stops_at_a_cutoff_its_true_costs_prove() -> None:
    """``lp.ColdStart`` with a cutoff below the LP's optimum finishes with status 5 and a bound, recomputed
    with the true costs, above the cutoff and no higher than the optimum; above the optimum it solves on."""
    import time

    from autoshard.passes.ilp.highs_model import highs_lp, run_highs
    from autoshard.passes.ilp.lp import ColdStart

    b, upper = _edge_lp(_medium_problem(0))
    optimum = run_highs(highs_lp(b, upper), 5.0).fun
    assert optimum > 0
    low = ColdStart(b, upper, time.perf_counter() + 5.0, cutoff=0.6 * optimum)
    assert low.finished.wait(5.0)
    low.stop()
    assert low.result.status == 5 and 0.6 * optimum < low.result.bound <= optimum * (1 + 1e-9)
    high = ColdStart(b, upper, time.perf_counter() + 5.0, cutoff=2.0 * optimum)
    assert high.finished.wait(5.0)
    high.stop()
    assert high.result.status == 0 and high.result.fun == pytest.approx(optimum)


def test_a_cutoff_counts_the_seconds_presolve_takes_out() -> None:
    """Presolve moves each node's cheapest cost and every charge a fixed node incurs out of the LP
    (``Reduced.const_s``); the cutoff is compared with the LP's bound plus them, so a plan of 3.5 s is cut
    off at 3.4 s and kept at 3.6 s."""
    from autoshard.errors import CutOffError

    problem = IlpProblem(node_names=("fixed", "free"), node_costs=(np.array([2.0]), np.array([1.0, 3.0])),
                         edges=(), edge_costs=(), memory_points=(),
                         charges=(SharedCharge("paid", 0.5, ((0, np.array([True])), (1, np.array([False, True])))),),
                         time_limit_s=5.0)
    assert presolve(problem).const_s == pytest.approx(3.5)
    with pytest.raises(CutOffError) as cut:
        solve(dataclasses.replace(problem, cutoff_s=3.4))
    assert cut.value.bound_s == pytest.approx(3.5)
    assert solve(dataclasses.replace(problem, cutoff_s=3.6)).objective_s == pytest.approx(3.5)


def test_random_problems_outside_random_cuts_match_brute_force(monkeypatch) -> None:
    """The best plan outside no-good cuts (``disjunction.py``: branching on the cuts over the LP without their
    rows) is brute force's, for a cut of the best plan alone and with cuts marking a random part of every
    node's strategies, on problems with memory rows, shared charges and shared reshards; where the cuts leave
    no plan (that fits), both say so. ``next_best``'s k plans are brute force's k next objectives, from one
    search: the LP is solved once."""
    from autoshard.passes.ilp import disjunction
    from autoshard.passes.ilp.candidates import exact_cut, next_best

    runs, roots = [], []
    run, solve_lp = disjunction.CutSearch.run, disjunction.solve_lp
    monkeypatch.setattr(disjunction.CutSearch, "run", lambda *a, **k: runs.append(r := run(*a, **k)) or r)
    monkeypatch.setattr(disjunction, "solve_lp", lambda *a, **k: roots.append(1) or solve_lp(*a, **k))
    rng = np.random.default_rng(31)
    compared = refused = ranked = 0
    for instance in range(60):
        problem = _random_problem(rng)
        if instance % 3 == 1:
            problem = dataclasses.replace(problem, charges=(SharedCharge("c", float(rng.uniform(0, 1.5)), tuple(
                (int(i), rng.random(len(problem.node_costs[i])) < 0.5) for i in range(problem.num_nodes))),))
        elif instance % 3 == 2 and problem.num_nodes > 2:
            readers = tuple((r, rng.integers(-1, 2, size=len(problem.node_costs[r]))) for r in (1, 2))
            problem = dataclasses.replace(problem, reshards=(SharedReshard(
                "r", 0, rng.uniform(0, 1, size=(len(problem.node_costs[0]), 2)), readers),))
        first = _outcome(brute_force, problem)
        if isinstance(first, PlanningError):
            continue
        cuts = [exact_cut(problem, first.choices)]
        cuts += [tuple(rng.random(len(c)) < rng.uniform(0.3, 0.9) for c in problem.node_costs)
                 for _ in range(int(rng.integers(0, 3)))]
        cut = dataclasses.replace(problem, excluded=tuple(cuts))
        expected, got = _outcome(brute_force, cut), _outcome(solve, cut)
        assert isinstance(got, PlanningError) == isinstance(expected, PlanningError), (instance, expected, got)
        if isinstance(expected, PlanningError):
            refused += 1
            continue
        assert not evaluate(cut, got.choices).violations, instance
        assert got.objective_s == pytest.approx(expected.objective_s, rel=1e-6, abs=1e-12), instance
        assert got.status == "optimal", instance
        compared += 1
        sizes = [len(c) for c in problem.node_costs]
        every = sorted(e.objective_s for ch in np.ndindex(*sizes)
                       if not (e := evaluate(problem, np.array(ch))).violations)
        if len(every) >= 4:
            del roots[:]
            warm.clear()  # (else the root is the kept optimum of the solve above, and no LP is solved)
            found = next_best(problem, cuts[0], 3, lambda ch: exact_cut(problem, ch))
            assert [s.objective_s for s in found] == pytest.approx(every[1:4], rel=1e-6, abs=1e-12), instance
            assert len(roots) <= 1, instance  # one LP for the three plans (none: presolve decided the cut's nodes)
            ranked += len(roots)
    assert compared >= 25 and refused >= 1 and ranked >= 10, (compared, refused, ranked)
    assert sum(r is not None for r in runs) >= compared  # the branching, not the rows, found them


def test_the_model_a_raced_lp_hands_back_runs_again() -> None:
    """The race in ``lp.solve_lp`` stops the loser with ``cancelSolve``, which HiGHS keeps for as long as the
    model handles user interrupts: the model ``ColdStart.race`` hands back (for a dive, a plan's pricing, the
    boxes of ``disjunction.py``), whichever start won, has them off, so a cancel sent to it as the race ended
    does not stop its later runs."""
    import time

    import autoshard.passes.ilp.lp as lp
    from autoshard.passes.ilp import mip
    from autoshard.passes.ilp.presolve import presolve

    problem = _medium_problem(seed=7)
    red = presolve(problem)
    ticks = mip._ticks(red)
    b = mip._new(problem, red, ticks)
    mip._add_edges(b, ticks)
    upper = np.concatenate(b.upper)
    deadline = time.perf_counter() + 10.0
    result, model = lp.ColdStart(b, upper, deadline).race(lp.highs_lp(b, upper), deadline)
    assert result.status == 0
    model.cancelSolve()  # as the winner can be sent its rival's cancel when both finish together
    taken = int(np.flatnonzero(result.x[:b.num_cols] > 0.5)[0])  # a column of the optimum, held at 0: a new LP
    model.changeColsBounds(1, np.array([taken], dtype=np.int32), np.zeros(1), np.zeros(1))
    again = lp.run_highs(model, 5.0)
    assert again.status in (0, 2), again.message  # solved (status 4: stopped by the cancel)


@pytest.mark.parametrize("budget", [40.0, 45.0, 60.0])
def test_memory_rows_enter_the_lp_only_when_a_solution_breaks_them(budget: float) -> None:
    """``highs_model.highs_lp`` leaves the memory rows out and ``run_highs`` adds the ones an optimum breaks: the
    LP optimum is the one with every row in (SciPy's HiGHS on the whole matrix), and a row that never binds is
    never added. Each of the three budgets has all 18 points' rows in the builder (each can bind); at 40 bytes
    most are broken and added, at 45 (``_medium_problem``'s budget) a few, at 60 none."""
    import autoshard.passes.ilp.mip as mip
    from autoshard.passes.ilp.highs_model import highs_lp, run_highs

    problem = dataclasses.replace(_medium_problem(5), memory_budget_bytes=budget)
    red = presolve(problem)
    ticks = mip._ticks(red)
    b = mip._new(problem, red, ticks)
    mip._add_edges(b, ticks)
    assert mip._add_memory(b, budget)
    whole = b.solve(30.0, relaxed=True)
    assert whole.status == 0
    highs = highs_lp(b, np.concatenate(b.upper))
    assert len(highs.rows) == len(b.lower_rhs) - len(b.memory_rows)  # every memory row left out at first
    lazy = run_highs(highs, 30.0)
    assert lazy.status == 0
    assert lazy.fun == pytest.approx(whole.fun, rel=1e-7, abs=1e-6)
    added = [r for r in highs.rows if r in b.memory_rows]
    activity = b.matrix() @ lazy.x
    assert np.all(activity <= np.array(b.upper_rhs) + 1e-6)  # feasible for every row, the ones left out too
    assert len(b.memory_rows) == 18
    assert {40.0: len(added) > 9, 45.0: 0 < len(added) <= 9, 60.0: not added}[budget]


@pytest.mark.parametrize("budget, lazy", [(45.0, False), (60.0, True)])
def test_the_restricted_lp_says_whether_the_memory_rows_stay_out(budget: float, lazy: bool) -> None:
    """``lp.solve_lp`` asks the restricted LP without memory rows whether they nearly bind (``highs_model.TIGHT``):
    at 45 bytes they do, and every model of the solve holds them (``memory.tight``); with room to spare they
    stay out. The LP optimum is the whole LP's either way, and is feasible for every memory row."""
    import autoshard.passes.ilp.mip as mip
    from autoshard.passes.ilp.lp import solve_lp

    problem = dataclasses.replace(_medium_problem(5), memory_budget_bytes=budget)
    red = presolve(problem)
    ticks = mip._ticks(red)
    b = mip._new(problem, red, ticks)
    mip._add_edges(b, ticks)
    assert mip._add_memory(b, budget) and b.memory_rows
    whole = b.solve(30.0, relaxed=True)
    lp = solve_lp(b, 30.0)
    assert lp.status == 0 and whole.status == 0
    assert lp.fun == pytest.approx(whole.fun, rel=1e-7, abs=1e-6)
    assert np.all(b.matrix() @ lp.x <= np.array(b.upper_rhs) + 1e-6)
    assert b.memory.tight is not lazy
