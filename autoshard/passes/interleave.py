"""Interleaved 1F1B: p device groups, each holding v non-adjacent stage chunks, searched beside the stage DP.

The stage DP (``passes/stages.py``) gives each stage its own devices. Interleaving (Megatron-LM) cuts the
layers into S = p v chunks and puts chunk c on device group c mod p, all groups alike (one sub-mesh variant
k, p n_k devices). A microbatch passes every group v times, so the pipeline fills and drains in chunk steps,
not stage steps: with equal chunks of time t and no transfers, a step takes (B v + p - 1) t against 1F1B's
(B + p - 1) v t on the same devices, the bubble divided by v; the price is v - 1 more transfers per
microbatch (one of them from the last group back to the first) and more activations in flight.

Objective, for chunks c = 0..S-1 with time t_c (forward and backward per microbatch, the same per-stage
times as the DP's, ``StageProblem.stage_time_s``) and transfer x_c after it (``transfer_s`` from the
variant to itself, or ``transfer_cross_node_s`` where the next group sits on another node; the wrap from
group p - 1 to group 0 included): a group's work per microbatch is
G_g = sum over its chunks of t_c + x_c, and

    T = B max_g G_g + sum_{c < p - 1} (t_c + x_c)

the steady state of the busiest group plus the fill through the first p - 1 chunks ((B v + p - 1) t for
equal chunks). Memory per device of group g: its chunks' state, plus w_g + 1 chunk-microbatches of
activations in flight (w_g: Megatron's warm-up count, ``plans/schedules.interleaved_warmup``), each priced
at the group's largest chunk activation, plus the largest one-off work bytes of its chunks.

Search: every variant k whose sub-mesh divides the devices into p >= 2 groups, every v in ``chunks`` with
p v <= L, every B that is a multiple of p; the layers are cut into S chunks minimising the largest chunk
time (a linear-partition DP over the layers, O(S L^2)). Pure numpy, no jax.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from autoshard.passes.stage_problem import StageChoice, StagePlan, StageProblem
from autoshard.plans.schedules import interleaved_step_s, interleaved_warmup

CHUNKS = (2, 3, 4)  # v values searched


def _balanced_cuts(times: np.ndarray, num_chunks: int) -> list[tuple[int, int]] | None:
    """``num_chunks`` contiguous layer ranges minimising the largest ``times[i, j]`` (None: too few layers)."""
    n = times.shape[0]
    if num_chunks > n:
        return None
    best = np.full((num_chunks + 1, n + 1), math.inf)
    arg = np.zeros((num_chunks + 1, n + 1), dtype=int)
    best[0, 0] = 0.0
    for c in range(1, num_chunks + 1):
        for j in range(c, n + 1):
            for i in range(c - 1, j):
                value = max(best[c - 1, i], float(times[i, j - 1]))
                if value < best[c, j]:
                    best[c, j], arg[c, j] = value, i
    if not math.isfinite(best[num_chunks, n]):
        return None
    cuts, j = [], n
    for c in range(num_chunks, 0, -1):
        i = int(arg[c, j])
        cuts.append((i, j - 1))
        j = i
    return cuts[::-1]


def _crosses_nodes(problem: StageProblem, k: int, groups: int) -> list[bool]:
    """Per device group g, whether the send from it to group g + 1 (mod p) crosses nodes: groups of sub-mesh k
    are placed in order (``passes/inter_op.place_stages``), so group g holds devices [g n_k, (g + 1) n_k)."""
    per_node = problem.devices_per_node
    size = int(problem.submesh_sizes[k])
    if per_node is None or problem.num_devices <= per_node:
        return [False] * groups
    node = [g * size // per_node for g in range(groups)]
    return [size > per_node or node[g] != node[(g + 1) % groups] for g in range(groups)]


def evaluate_interleaved(problem: StageProblem, chunks: Sequence[tuple[int, int]], k: int, groups: int,
                         num_microbatches: int) -> StagePlan:
    """Every quantity of the interleaved plan whose chunk c is layers ``chunks[c]`` on variant k, group
    c mod ``groups`` (module docstring)."""
    b = problem.microbatch_options.index(num_microbatches)
    num_chunks = len(chunks)
    v = num_chunks // groups
    times = tuple(float(problem.stage_time_s[i, j, k, b]) for i, j in chunks)
    crossing = _crosses_nodes(problem, k, groups)
    transfers = tuple(float(problem.transfer_cross_node_s[j, k, b])
                      if problem.transfer_cross_node_s is not None and crossing[c % groups]
                      else float(problem.transfer_s[j, k, k, b]) for c, (_, j) in enumerate(chunks[:-1]))
    step, busiest = interleaved_step_s(times, transfers, num_microbatches, groups)
    work = problem.work_bytes(b)
    peaks_by_group, flights_by_group = [], []
    for g in range(groups):
        mine = [chunks[c] for c in range(g, num_chunks, groups)]
        flight = interleaved_warmup(g, groups, v, num_microbatches) + 1
        state = sum(float(problem.stage_param_bytes[i, j, k]) for i, j in mine)
        act = max(float(problem.stage_act_bytes[i, j, k, b]) for i, j in mine)
        once = max(float(work[i, j, k]) for i, j in mine)
        peaks_by_group.append(state + min(flight, num_microbatches * v) * act + once)
        flights_by_group.append(min(flight, num_microbatches * v))
    latency = sum(times) + sum(transfers)
    n_k = int(problem.submesh_sizes[k])
    return StagePlan(
        stages=tuple(StageChoice(i, j, k, problem.submeshes[k]) for i, j in chunks),
        num_microbatches=num_microbatches, schedule="interleaved", step_time_s=step, bottleneck_s=busiest,
        first_microbatch_latency_s=latency,
        bubble_fraction=1.0 - num_microbatches * busiest / step if 0 < step < math.inf else 0.0,
        stage_times_s=times, transfer_times_s=transfers,
        per_stage_peak_bytes=tuple(peaks_by_group[c % groups] for c in range(num_chunks)),
        in_flight=tuple(flights_by_group[c % groups] for c in range(num_chunks)),
        num_devices_used=groups * n_k, chunks=v)


def solve_interleaved(problem: StageProblem, chunks: Sequence[int] = CHUNKS) -> StagePlan | None:
    """The fastest interleaved plan that fits (module docstring), or None when none does: too few layers,
    no variant that splits the devices into groups, no microbatch count that is a multiple of them, or none
    within the memory budget. A forced stage count is the device groups' count times v."""
    best: StagePlan | None = None
    bs = [b for b in problem.microbatch_options
          if problem.num_microbatches is None or b == problem.num_microbatches]
    for k, size in enumerate(problem.submesh_sizes):
        size = int(size)
        if problem.num_devices % size or problem.num_devices // size < 2:
            continue
        groups = problem.num_devices // size
        for v in chunks:
            num_chunks = groups * v
            if num_chunks > problem.num_layers or (problem.num_stages is not None and num_chunks != problem.num_stages):
                continue
            for b_count in bs:
                if b_count % groups:
                    continue
                b = problem.microbatch_options.index(b_count)
                cuts = _balanced_cuts(problem.stage_time_s[:, :, k, b], num_chunks)
                if cuts is None:
                    continue
                plan = evaluate_interleaved(problem, cuts, k, groups, b_count)
                if plan.peak_bytes > problem.memory_budget_bytes or not math.isfinite(plan.step_time_s):
                    continue
                if best is None or plan.step_time_s < best.step_time_s:
                    best = plan
    return best
