"""Inter-op stage DP: cut L layers into pipeline stages on sub-meshes, pick B.

Pure numpy, no jax (the stage DP is a pure function of cost arrays): profiling and the intra-op pass fill
the arrays of a :class:`StageProblem`; :func:`solve_stages` returns a
:class:`StagePlan`; :func:`brute_force_stages` enumerates every plan and is
what the tests compare against; :func:`evaluate_stages` recomputes every
quantity of a given plan from the arrays and is the one place the objective is
written down in code.

Objective
---------
A plan is S contiguous stages s = 0..S-1 (stage s = layers i_s..j_s on
sub-mesh k_s) and a microbatch count B. Per microbatch (of size
global_batch / B) stage s takes t_s = stage_time_s[i_s, j_s, k_s, b] (forward
plus backward) and boundary s (after layer j_s, from k_s to k_{s+1}) takes
x_s = transfer_s[j_s, k_s, k_{s+1}, b] (activation forward plus its gradient
back). A transfer sits on the critical path like a stage, so it is treated as
a pseudo-stage of time x_s::

    T = sum_s t_s + sum_s x_s + (B - 1) * max(max_s t_s, max_s x_s)

``first_microbatch_latency_s`` = sum t + sum x (one microbatch through the
pipe), ``bottleneck_s`` = max(max t, max x), and
``bubble_fraction`` = 1 - B * bottleneck_s / T (0 for one stage, and
(S-1)/(S+B-1) for S equal stages without transfers). With every transfer 0
this is Alpa's objective sum t + (B-1) max t exactly.

Constraints
-----------
* the stages partition layers 0..L-1 in order;
* the sub-meshes use exactly ``num_devices`` devices (``cover_all``, Alpa's
  rule) or at most that many;
* memory: stage s needs, per device,
  ``stage_param_bytes[i, j, k] + in_flight(s) * stage_act_bytes[i, j, k, b]``
  with in_flight(s) = min(S - s, B) for 1F1B and B for GPipe, and that must be
  <= ``memory_budget_bytes``;
* a stage or transfer of infinite time is not allowed;
* optionally a forced stage count S (``num_stages``) and a forced B
  (``num_microbatches``).

Algorithm
---------
For each B, Alpa's trick: for a cap tau on the largest stage/transfer time,
g(tau) = min sum t + sum x over plans whose every t_s, x_s <= tau is a sum DP,
and T* = min over tau of g(tau) + (B - 1) * tau over the distinct times. The DP
runs over suffixes, state (first layer l, devices used d, stages r from l to
the end, sub-mesh k of the stage starting at l); r is exactly S - s, which is
what the 1F1B memory rule needs, and k is what the transfer into the stage
needs::

    F[l, d, r, k] = min_{j >= l} t[l, j, k] + E[j + 1, d - n_k, r - 1, k]
    E[m, d, r, k] = min_{k2} x[m - 1, k, k2] + F[m, d, r, k2]     (m < L)
    E[L, d, r, k] = 0 if d == r == 0 else inf

with stages over memory or over tau masked to inf (tables are stored
[l, k, d, r]); each layer step is one gather and one reduction over
(j, k, d, r). Instead of sweeping every tau, taus are visited downward:
solving at tau gives a plan with actual max m <= tau, and g is constant on
[m, tau], so the next tau is the largest time below m. g only grows as tau
falls, so the sweep stops once g(tau) + (B - 1) * m_min cannot beat the best
plan found, where m_min, the smallest bottleneck of any admissible plan, is the
same DP with (max, min) in place of (+, min). That (max, min) DP over memory
instead of time gives the smallest budget that admits any plan, reported when
nothing fits. B values are tried largest first (usually the winner, so the
others prune early).
"""
from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass

import numpy as np

from autoshard.passes.stage_problem import (Combine, StageChoice, StageInfeasibleError, StagePlan,
                                           StageProblem, SubmeshShape, evaluate_stages, in_flight,
                                           is_admissible, microbatch_choices)

__all__ = ["StageChoice", "StageInfeasibleError", "StagePlan", "StageProblem", "SubmeshShape", "brute_force_stages",
           "evaluate_stages", "in_flight", "microbatch_choices", "solve_stages"]

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------
# The DP


@dataclass(frozen=True)
class _Tables:
    """Suffix-DP tables for one (B, tau), laid out [layer, k, d, r]; see the module docstring for F and E."""

    f: np.ndarray       # [L, K, D+1, R+1]
    arg_j: np.ndarray   # [L, K, D+1, R+1] last layer of the stage starting at l
    e: np.ndarray       # [L+1, K, D+1, R+1]
    arg_k2: np.ndarray  # [L+1, K, D+1, R+1] sub-mesh of the stage starting at m


def _suffix_dp(stage_cost: np.ndarray, boundary_cost: np.ndarray, sizes: np.ndarray, num_devices: int,
               combine: Combine) -> _Tables:
    """(combine, min) DP over suffixes. stage_cost [L, L, K, R+1] (inf = not allowed; column r = stages
    from this one to the end), boundary_cost [L-1, K, K]. ``combine`` is np.add (time) or np.maximum (memory).
    Each layer step is one gather + one reduction over (j, k, d, r)."""
    num_layers, _, num_sub, r_dim = stage_cost.shape
    d_dim = num_devices + 1
    usable = sizes < d_dim
    pad = int(sizes[usable].max()) if usable.any() else 0
    # e_pad[m, k, pad + d, r] = E[m, k, d, r]; the pad rows (d < 0) stay inf
    e_pad = np.full((num_layers + 1, num_sub, pad + d_dim, r_dim), np.inf)
    e_pad[num_layers, :, pad, 0] = 0.0
    f = np.full((num_layers, num_sub, d_dim, r_dim), np.inf)
    arg_j = np.zeros(f.shape, dtype=np.int32)
    arg_k2 = np.zeros(e_pad[:, :, pad:].shape, dtype=np.int32)
    source_d = pad + np.arange(d_dim)[None, :] - np.where(usable, sizes, d_dim + pad)[:, None]  # [K, D+1]
    source_d = source_d.clip(0)
    rows = np.arange(num_sub)[:, None]
    for l in range(num_layers - 1, -1, -1):
        rest = e_pad[l + 1:, rows, source_d, : r_dim - 1]                   # [j - l, k, d, r - 1]
        cand = combine(stage_cost[l, l:, :, None, 1:], rest)                # [j - l, k, d, r]
        best = np.argmin(cand, axis=0)
        f[l, :, :, 1:] = np.take_along_axis(cand, best[None], axis=0)[0]
        arg_j[l, :, :, 1:] = best + l
        if l > 0:
            cand = combine(boundary_cost[l - 1][:, :, None, None], f[l][None])  # [k, k2, d, r]
            arg_k2[l] = np.argmin(cand, axis=1)
            e_pad[l, :, pad:] = np.take_along_axis(cand, arg_k2[l][:, None], axis=1)[:, 0]
    return _Tables(f, arg_j, e_pad[:, :, pad:], arg_k2)


def _best_start(tables: _Tables, problem: StageProblem) -> tuple[float, int, int, int]:
    """(value, d, r, k) of the best whole-model state at layer 0 under cover_all / num_stages."""
    f0 = tables.f[0].copy()  # [K, D+1, R+1]
    if problem.cover_all:
        f0[:, : problem.num_devices] = np.inf
    if problem.num_stages is not None:
        keep = np.zeros(f0.shape[2], dtype=bool)
        if problem.num_stages < f0.shape[2]:
            keep[problem.num_stages] = True
        f0[:, :, ~keep] = np.inf
    k, d, r = np.unravel_index(int(np.argmin(f0)), f0.shape)
    return float(f0[k, d, r]), int(d), int(r), int(k)


def _trace_back(tables: _Tables, sizes: np.ndarray, d: int, r: int, k: int) -> list[tuple[int, int, int]]:
    num_layers = tables.f.shape[0]
    stages, l = [], 0
    while True:
        j = int(tables.arg_j[l, k, d, r])
        stages.append((l, j, k))
        if j == num_layers - 1:
            return stages
        d, r = d - int(sizes[k]), r - 1
        k = int(tables.arg_k2[j + 1, k, d, r])
        l = j + 1


def _max_stages(problem: StageProblem) -> int:
    most = min(problem.num_layers, problem.num_devices // int(problem.submesh_sizes.min()))
    if problem.num_stages is not None:
        most = min(most, problem.num_stages)
    return max(most, 0)


def _per_b_arrays(problem: StageProblem, b: int, max_stages: int) -> tuple[np.ndarray, np.ndarray]:
    """Stage-time array [L, L, K, R+1] with invalid (i > j), infinite-time, over-budget entries at inf;
    and the memory array of the same shape (inf where the time is inf)."""
    num_layers = problem.num_layers
    upper = np.triu(np.ones((num_layers, num_layers), dtype=bool))[:, :, None, None]
    big_b = problem.microbatch_options[b]
    flights = np.array([in_flight(problem.schedule, max(r, 1), big_b) for r in range(max_stages + 1)], dtype=float)
    memory = ((problem.stage_param_bytes + problem.work_bytes(b))[..., None]
              + flights[None, None, None, :] * problem.stage_act_bytes[:, :, :, b, None])
    time = np.broadcast_to(problem.stage_time_s[:, :, :, b, None], memory.shape)
    ok = upper & np.isfinite(time)
    ok[..., 0] = False  # r = 0 is only the end-of-model sentinel
    memory = np.where(ok, memory, np.inf)
    time = np.where(ok & (memory <= problem.memory_budget_bytes), time, np.inf)
    return time, memory


def _solve_one_b(problem: StageProblem, b: int, max_stages: int, best_total: float
                 ) -> tuple[float, list[tuple[int, int, int]] | None, int]:
    """Best (total, stages) for microbatch option b with total < best_total; also the number of DP solves."""
    big_b = problem.microbatch_options[b]
    sizes = problem.submesh_sizes
    time, _ = _per_b_arrays(problem, b, max_stages)
    transfer = problem.transfer_s[..., b]
    taus = np.unique(np.concatenate([time[np.isfinite(time)], transfer[np.isfinite(transfer)]]))
    # the smallest bottleneck any admissible plan can have: the same DP in (max, min)
    lower, *_ = _best_start(_suffix_dp(time, transfer, sizes, problem.num_devices, np.maximum), problem)
    best_stages, tau, solves = None, math.inf, 0
    while True:
        tables = _suffix_dp(np.where(time <= tau, time, np.inf), np.where(transfer <= tau, transfer, np.inf),
                            sizes, problem.num_devices, np.add)
        solves += 1
        g, d, r, k = _best_start(tables, problem)
        if not math.isfinite(g):
            break
        stages = _trace_back(tables, sizes, d, r, k)
        worst = max([time[i, j, kk, r - s] for s, (i, j, kk) in enumerate(stages)]
                    + [transfer[j, kk, k2] for (_, j, kk), (_, _, k2) in zip(stages[:-1], stages[1:])])
        total = g + (big_b - 1) * float(worst)
        if total < best_total:
            best_total, best_stages = total, stages
        if big_b == 1 or g + (big_b - 1) * lower >= best_total:
            break
        below = int(np.searchsorted(taus, worst, side="left"))  # taus[below - 1] < worst
        if below == 0 or taus[below - 1] < lower:
            break
        tau = float(taus[below - 1])
    return best_total, best_stages, solves


def solve_stages(problem: StageProblem) -> StagePlan:
    """The plan minimising the step time (module docstring); raises StageInfeasibleError if none fits."""
    max_stages = _max_stages(problem)
    options = _b_indices(problem)
    best_total, best = math.inf, None
    for b in options:
        total, stages, solves = _solve_one_b(problem, b, max_stages, best_total)
        log.debug("stage DP: B=%d took %d solves, best %.6g", problem.microbatch_options[b], solves, total)
        if stages is not None:
            best_total, best = total, (stages, problem.microbatch_options[b])
    if best is None:
        _raise_infeasible(problem, max_stages, options)
    return evaluate_stages(problem, best[0], best[1])


def _b_indices(problem: StageProblem) -> list[int]:
    """Indices of the B values to search, largest B first: it usually wins, and a good plan found early
    prunes the tau sweep of the others."""
    if problem.num_microbatches is not None:
        return [problem.microbatch_options.index(problem.num_microbatches)]
    return sorted(range(len(problem.microbatch_options)), key=lambda b: -problem.microbatch_options[b])


def _raise_infeasible(problem: StageProblem, max_stages: int, options: list[int]) -> None:
    """Find the plan needing the least memory (bottleneck DP) and raise with its binding stage."""
    sizes = problem.submesh_sizes
    least, least_plan = math.inf, None
    for b in options:
        _, memory = _per_b_arrays(problem, b, max_stages)
        transfer_ok = np.where(np.isfinite(problem.transfer_s[..., b]), 0.0, np.inf)
        tables = _suffix_dp(memory, transfer_ok, sizes, problem.num_devices, np.maximum)
        need, d, r, k = _best_start(tables, problem)
        if need < least:
            least, least_plan = need, evaluate_stages(problem, _trace_back(tables, sizes, d, r, k),
                                                      problem.microbatch_options[b])
    forced = "".join([f", num_stages={problem.num_stages}" if problem.num_stages is not None else "",
                      f", num_microbatches={problem.num_microbatches}" if problem.num_microbatches else ""])
    cover = "exactly" if problem.cover_all else "at most"
    if least_plan is None:
        raise StageInfeasibleError(
            f"no pipeline plan exists for {problem.num_layers} layers on sub-meshes {list(problem.submeshes)} "
            f"using {cover} {problem.num_devices} devices{forced}, whatever the memory: every candidate has an "
            f"infinite stage or transfer time or cannot match the device count. Add sub-mesh shapes, set "
            f"cover_all=False, or drop the forced stage/microbatch count.")
    s = int(np.argmax(least_plan.per_stage_peak_bytes))
    stage = least_plan.stages[s]
    b = problem.microbatch_options.index(least_plan.num_microbatches)
    i, j, k = stage.first_layer, stage.last_layer, stage.submesh_index
    params = float(problem.stage_param_bytes[i, j, k] + problem.work_bytes(b)[i, j, k])
    acts = float(problem.stage_act_bytes[i, j, k, b])
    raise StageInfeasibleError(
        f"no pipeline plan fits memory_budget_bytes={problem.memory_budget_bytes:.6g} ({problem.schedule}"
        f"{forced}). Closest: stage {s} of {len(least_plan.stages)} (layers {i}..{j} on sub-mesh "
        f"{stage.submesh[0]}x{stage.submesh[1]}, index {k}) with B={least_plan.num_microbatches} needs "
        f"{least:.6g} bytes per device ({params:.6g} params/grads/optimizer state and one microbatch's temporaries + "
        f"{least_plan.in_flight[s]} in-flight microbatches x {acts:.6g} activation bytes). The smallest budget "
        f"that admits any plan is {least:.6g} bytes; raise the budget to that, or allow more stages, devices "
        f"or microbatches.",
        stage=stage, required_bytes=least, smallest_budget_bytes=least)


# ---------------------------------------------------------------------------
# Brute force (for tests)


def _partitions(num_layers: int) -> list[list[tuple[int, int]]]:
    """Every cut of layers 0..L-1 into contiguous (first, last) ranges."""
    result = []
    for cuts in itertools.product((False, True), repeat=num_layers - 1):
        ranges, start = [], 0
        for layer, cut in enumerate(cuts):
            if cut:
                ranges.append((start, layer))
                start = layer + 1
        ranges.append((start, num_layers - 1))
        result.append(ranges)
    return result


def brute_force_stages(problem: StageProblem) -> StagePlan:
    """Enumerate every partition x sub-mesh per stage x B, score each with evaluate_stages; for tests."""
    sizes = problem.submesh_sizes
    best: StagePlan | None = None
    least: StagePlan | None = None
    for ranges in _partitions(problem.num_layers):
        if problem.num_stages is not None and len(ranges) != problem.num_stages:
            continue
        for subs in itertools.product(range(len(problem.submeshes)), repeat=len(ranges)):
            if int(sizes[list(subs)].sum()) > problem.num_devices:
                continue
            stages = [(i, j, k) for (i, j), k in zip(ranges, subs)]
            for b in _b_indices(problem):
                plan = evaluate_stages(problem, stages, problem.microbatch_options[b])
                if not is_admissible(problem, plan, check_memory=False):
                    continue
                if least is None or plan.peak_bytes < least.peak_bytes:
                    least = plan
                if plan.peak_bytes <= problem.memory_budget_bytes and (
                        best is None or plan.step_time_s < best.step_time_s):
                    best = plan
    if best is None:
        if least is None:
            raise StageInfeasibleError("no pipeline plan exists whatever the memory (brute force)")
        s = int(np.argmax(least.per_stage_peak_bytes))
        raise StageInfeasibleError(
            f"no pipeline plan fits memory_budget_bytes={problem.memory_budget_bytes:.6g}; stage {least.stages[s]} "
            f"needs {least.peak_bytes:.6g} bytes (brute force)", stage=least.stages[s],
            required_bytes=least.peak_bytes, smallest_budget_bytes=least.peak_bytes)
    return best


# ---------------------------------------------------------------------------
# Input validation
