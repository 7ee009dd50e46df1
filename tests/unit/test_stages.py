"""The inter-op stage DP against brute force, Alpa's own DP, and hand-worked cases."""
from __future__ import annotations

import math

import numpy as np
import pytest

from autoshard.errors import PlanningError
from autoshard.passes.stages import (
    StageInfeasibleError,
    StageProblem,
    brute_force_stages,
    evaluate_stages,
    microbatch_choices,
    solve_stages,
)

SUBMESH_POOL = ((1, 1), (1, 2), (1, 4), (2, 2), (1, 3))


def _random_problem(seed: int, *, zero_transfers: bool = False, memory: bool = True,
                    options: tuple[int, ...] | None = None, **overrides) -> StageProblem:
    rng = np.random.default_rng(seed)
    num_layers = int(rng.integers(1, 7))
    submeshes = tuple(SUBMESH_POOL[i] for i in sorted(rng.choice(len(SUBMESH_POOL), int(rng.integers(1, 5)),
                                                                 replace=False)))
    num_devices = int(rng.integers(1, 9))
    drawn = tuple(sorted(int(b) for b in rng.choice([1, 2, 3, 4, 6, 12], int(rng.integers(1, 4)), replace=False)))
    options = drawn if options is None else options
    num_sub, num_b = len(submeshes), len(options)
    sizes = np.array([n * d for n, d in submeshes], dtype=float)
    span = (np.arange(num_layers)[None, :] - np.arange(num_layers)[:, None] + 1).clip(1).astype(float)
    per_b = 1.0 / np.array(options, dtype=float)
    time = (rng.uniform(0.3, 2.0, (num_layers, num_layers, num_sub, num_b)) * span[:, :, None, None]
            / sizes[None, None, :, None] ** rng.uniform(0.3, 1.0) * per_b)
    time[rng.random(time.shape) < rng.uniform(0.0, 0.3)] = np.inf
    params = rng.uniform(1.0, 10.0, (num_layers, num_layers, num_sub)) * span[:, :, None] / sizes
    acts = rng.uniform(1.0, 6.0, (num_layers, num_layers, num_sub, num_b)) * span[:, :, None, None] * per_b
    if zero_transfers:
        transfer = np.zeros((num_layers - 1, num_sub, num_sub, num_b))
    else:
        transfer = rng.uniform(0.0, 0.6, (num_layers - 1, num_sub, num_sub, num_b)) * per_b
        transfer[rng.random(transfer.shape) < 0.1] = np.inf
        transfer[rng.random(transfer.shape) < 0.2] = 0.0
    fields = dict(
        num_layers=num_layers, submeshes=submeshes, num_devices=num_devices, global_batch=12,
        microbatch_options=options, stage_time_s=time, stage_param_bytes=params, stage_act_bytes=acts,
        transfer_s=transfer,
        memory_budget_bytes=float(rng.uniform(3.0, 40.0)) if memory and rng.random() < 0.8 else math.inf,
        schedule=str(rng.choice(["1f1b", "gpipe"])), cover_all=bool(rng.random() < 0.7),
        num_stages=int(rng.integers(1, 4)) if rng.random() < 0.15 else None,
        num_microbatches=options[-1] if rng.random() < 0.15 else None)
    fields.update(overrides)
    return StageProblem(**fields)


def _check_plan(problem: StageProblem, plan) -> None:
    """The plan is admissible and its numbers are what evaluate_stages recomputes."""
    again = evaluate_stages(problem, [(s.first_layer, s.last_layer, s.submesh_index) for s in plan.stages],
                            plan.num_microbatches)
    assert again == plan
    assert plan.peak_bytes <= problem.memory_budget_bytes
    assert plan.num_devices_used == problem.num_devices if problem.cover_all else \
        plan.num_devices_used <= problem.num_devices
    if problem.num_stages is not None:
        assert len(plan.stages) == problem.num_stages
    if problem.num_microbatches is not None:
        assert plan.num_microbatches == problem.num_microbatches
    assert math.isfinite(plan.step_time_s)


def _outcome(solver, problem):
    try:
        return solver(problem), None
    except StageInfeasibleError as error:
        return None, error


@pytest.mark.parametrize("seed", range(150))
def test_dp_matches_brute_force(seed):
    problem = _random_problem(seed)
    plan, error = _outcome(solve_stages, problem)
    expect, expect_error = _outcome(brute_force_stages, problem)
    if expect is None:
        assert plan is None, f"DP found {plan} where brute force found nothing"
        assert (error.smallest_budget_bytes is None) == (expect_error.smallest_budget_bytes is None)
        if expect_error.smallest_budget_bytes is not None:
            assert error.smallest_budget_bytes == pytest.approx(expect_error.smallest_budget_bytes, rel=1e-12)
        return
    assert plan is not None, f"DP raised {error} but brute force found {expect}"
    _check_plan(problem, plan)
    assert plan.step_time_s == pytest.approx(expect.step_time_s, rel=1e-9), f"DP {plan}\nbrute {expect}"


def test_random_instances_exercise_both_outcomes():
    outcomes = [_outcome(solve_stages, _random_problem(seed))[0] is not None for seed in range(150)]
    assert 60 <= sum(outcomes) <= 140
    multi = [p for p in (_outcome(solve_stages, _random_problem(s))[0] for s in range(150)) if p is not None]
    assert sum(len(p.stages) > 1 for p in multi) >= 20
    assert sum(p.num_microbatches > 1 for p in multi) >= 20


# ---------------------------------------------------------------------------
# Alpa's objective


def _alpa_training_dp(compute_cost: np.ndarray, sizes: list[int], num_devices: int, num_microbatches: int,
                      max_n_succ_stages: np.ndarray) -> float:
    """Alpa's stage_construction.training_dp (gap 0), loops as written there: f[s, i, d] = min sum of
    stage costs for layers i.. with s stages on d devices; best of sum + (B-1) * max_stage_cost."""
    num_layers = compute_cost.shape[0]
    best = math.inf
    for max_stage_cost in np.unique(compute_cost[np.isfinite(compute_cost)]):
        if max_stage_cost * (num_microbatches - 1) >= best:
            break
        f = np.full((num_layers + 1, num_layers + 1, num_devices + 1), np.inf)
        f[0, num_layers, 0] = 0
        for s in range(1, num_layers + 1):
            for i in range(num_layers - 1, -1, -1):
                for j in range(1, num_devices + 1):
                    for k in range(num_layers, i, -1):
                        for m, n_devices in enumerate(sizes):
                            if n_devices <= j and s - 1 <= max_n_succ_stages[i, k - 1, m]:
                                stage_cost = compute_cost[i, k - 1, m]
                                new_cost = f[s - 1, k, j - n_devices] + stage_cost
                                if stage_cost <= max_stage_cost and new_cost < f[s, i, j]:
                                    f[s, i, j] = new_cost
        total = f[1:, 0, num_devices].min()
        best = min(best, total + (num_microbatches - 1) * max_stage_cost)
    return best


@pytest.mark.parametrize("seed", range(60))
def test_zero_transfers_reproduce_alpa(seed):
    # One B >= L so the 1F1B cap min(S - s, B) never binds and our memory rule is Alpa's max_n_succ_stages.
    problem = _random_problem(seed, zero_transfers=True, options=(12,),
                              schedule="1f1b", cover_all=True, num_stages=None, num_microbatches=None)
    cost = problem.stage_time_s[..., 0]
    cost = np.where(np.triu(np.ones(cost.shape[:2], dtype=bool))[:, :, None], cost, np.inf)
    acts = problem.stage_act_bytes[..., 0]
    with np.errstate(divide="ignore", invalid="ignore"):
        succ = np.floor((problem.memory_budget_bytes - problem.stage_param_bytes) / acts) - 1
    alpa = _alpa_training_dp(cost, list(problem.submesh_sizes), problem.num_devices, 12, succ)
    plan, _ = _outcome(solve_stages, problem)
    if math.isinf(alpa):
        assert plan is None
    else:
        assert plan is not None and plan.step_time_s == pytest.approx(alpa, rel=1e-9)


# ---------------------------------------------------------------------------
# Hand-worked cases


def _two_layer_problem(x_s: float, **overrides) -> StageProblem:
    """Two layers, 2 devices, sub-meshes 1x1 and 1x2, B = 4.
    One stage (layers 0..1 on 1x2): t = 1.0  ->  T = 1.0 + 3 * 1.0 = 4.0.
    Two stages (each layer on 1x1): t = 0.4, 0.4, transfer x  ->  T = 0.8 + x + 3 * max(0.4, x)."""
    inf = math.inf
    time = np.full((2, 2, 2, 1), inf)
    time[0, 1, 1, 0] = 1.0
    time[0, 0, 0, 0] = time[1, 1, 0, 0] = 0.4
    transfer = np.full((1, 2, 2, 1), x_s)
    fields = dict(num_layers=2, submeshes=((1, 1), (1, 2)), num_devices=2, global_batch=4, microbatch_options=(4,),
                  stage_time_s=time, stage_param_bytes=np.full((2, 2, 2), 10.0),
                  stage_act_bytes=np.full((2, 2, 2, 1), 1.0), transfer_s=transfer)
    fields.update(overrides)
    return StageProblem(**fields)


def test_transfer_cost_changes_the_plan():
    free = solve_stages(_two_layer_problem(0.0))          # 0.8 + 0 + 3 * 0.4 = 2.0
    assert [str(s) for s in free.stages] == ["L0-0@1x1", "L1-1@1x1"]
    assert free.step_time_s == pytest.approx(2.0)
    mid = solve_stages(_two_layer_problem(0.5))           # 0.8 + 0.5 + 3 * 0.5 = 2.8: transfer is the bottleneck
    assert len(mid.stages) == 2
    assert mid.step_time_s == pytest.approx(2.8) and mid.bottleneck_s == pytest.approx(0.5)
    assert mid.first_microbatch_latency_s == pytest.approx(1.3)
    assert mid.bubble_fraction == pytest.approx(1 - 4 * 0.5 / 2.8)
    costly = solve_stages(_two_layer_problem(1.0))        # 0.8 + 1.0 + 3 * 1.0 = 4.8 > 4.0
    assert [str(s) for s in costly.stages] == ["L0-1@1x2"]
    assert costly.step_time_s == pytest.approx(4.0) and costly.bubble_fraction == pytest.approx(0.0)


def test_in_flight_rule_per_schedule():
    time = np.ones((3, 3, 1, 1))
    fields = dict(num_layers=3, submeshes=((1, 1),), num_devices=3, global_batch=2, microbatch_options=(2,),
                  stage_time_s=time, stage_param_bytes=np.full((3, 3, 1), 5.0),
                  stage_act_bytes=np.full((3, 3, 1, 1), 2.0), transfer_s=np.zeros((2, 1, 1, 1)))
    stages = [(0, 0, 0), (1, 1, 0), (2, 2, 0)]
    one_f_one_b = evaluate_stages(StageProblem(**fields, schedule="1f1b"), stages, 2)
    assert one_f_one_b.in_flight == (2, 2, 1)             # min(S - s, B) with S = 3, B = 2
    assert one_f_one_b.per_stage_peak_bytes == (9.0, 9.0, 7.0)
    gpipe = evaluate_stages(StageProblem(**fields, schedule="gpipe"), stages, 2)
    assert gpipe.in_flight == (2, 2, 2)
    # budget 8 admits the last 1F1B stage only, so no 3-stage plan fits; 9 does
    with pytest.raises(StageInfeasibleError):
        solve_stages(StageProblem(**fields, memory_budget_bytes=8.0))
    assert len(solve_stages(StageProblem(**fields, memory_budget_bytes=9.0)).stages) == 3


@pytest.mark.parametrize("seed", range(30))
def test_forced_num_stages_respected(seed):
    base = _random_problem(seed, memory=False, cover_all=False)
    for num_stages in (1, 2, 3):
        problem = _random_problem(seed, memory=False, cover_all=False, num_stages=num_stages,
                                  memory_budget_bytes=base.memory_budget_bytes)
        plan, _ = _outcome(solve_stages, problem)
        expect, _ = _outcome(brute_force_stages, problem)
        assert (plan is None) == (expect is None)
        if plan is not None:
            assert len(plan.stages) == num_stages
            assert plan.step_time_s == pytest.approx(expect.step_time_s, rel=1e-9)


def test_forced_stages_on_two_layer_case():
    plan = solve_stages(_two_layer_problem(1.0, num_stages=2))  # forced despite the costly transfer
    assert len(plan.stages) == 2 and plan.step_time_s == pytest.approx(4.8)


def test_infeasible_budget_names_stage_and_bytes():
    # Needs: one stage 10 + 1 * 1 = 11 bytes; two stages 10 + 2 * 1 = 12 and 10 + 1 = 11 (1F1B, B = 4).
    problem = _two_layer_problem(0.0, memory_budget_bytes=10.5)
    with pytest.raises(StageInfeasibleError) as caught:
        solve_stages(problem)
    error = caught.value
    assert isinstance(error, PlanningError)
    message = str(error)
    assert "layers 0..1" in message and "1x2" in message and "11 bytes" in message, message
    assert error.smallest_budget_bytes == 11.0 and error.required_bytes == 11.0
    assert (error.stage.first_layer, error.stage.last_layer, error.stage.submesh) == (0, 1, (1, 2))
    assert len(solve_stages(_two_layer_problem(0.0, memory_budget_bytes=11.0)).stages) == 1


@pytest.mark.parametrize("seed", range(40))
def test_smallest_budget_is_tight(seed):
    problem = _random_problem(seed, memory_budget_bytes=0.5)
    _, error = _outcome(solve_stages, problem)
    assert error is not None
    if error.smallest_budget_bytes is not None:
        fields = {name: getattr(problem, name) for name in problem.__dataclass_fields__}
        fields["memory_budget_bytes"] = error.smallest_budget_bytes
        _check_plan(StageProblem(**fields), solve_stages(StageProblem(**fields)))


def test_no_plan_at_any_budget_says_so():
    with pytest.raises(StageInfeasibleError, match="whatever the memory"):
        solve_stages(_two_layer_problem(0.0, num_devices=3))  # sub-meshes of 1 and 2 cannot cover 3 in <= 2 stages


def test_input_validation():
    with pytest.raises(ValueError, match="transfer_s must be a numpy array of shape"):
        _two_layer_problem(0.0, transfer_s=np.zeros((2, 2, 2, 1)))
    with pytest.raises(ValueError, match="divisors"):
        _two_layer_problem(0.0, microbatch_options=(3,))
    assert microbatch_choices(12) == (1, 2, 3, 4, 6, 12)
    assert microbatch_choices(12, 4) == (1, 2, 3, 4)
