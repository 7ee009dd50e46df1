"""Interleaved 1F1B: its dispatch order, its objective on hand-worked uniform cases, and when it is chosen."""
from __future__ import annotations

import math

import numpy as np
import pytest

from autoshard.compiler.pipeline_pricing import choose_stages
from autoshard.errors import PlanningError
from autoshard.passes.interleave import evaluate_interleaved, solve_interleaved
from autoshard.passes.stages import StageProblem, solve_stages
from autoshard.plans.schedules import interleaved_warmup, schedule_actions
from pipeline_helpers import assert_dispatch_order, peak_in_flight


@pytest.mark.parametrize(("groups", "chunks"), [(2, 2), (2, 3), (3, 2), (4, 2), (1, 3)])
def test_interleaved_order_runs_every_action_once_in_dependency_order(groups, chunks):
    stages = groups * chunks
    for micro in range(groups, 4 * groups + 1, groups):
        order = schedule_actions("interleaved", stages, micro, chunks)
        assert_dispatch_order(order, stages, micro)
        # chunk-microbatches a device group holds at its peak: Megatron's warm-up count plus one
        for g in range(groups):
            peak = peak_in_flight(order, lambda st, g=g: st % groups == g)
            assert peak <= min(interleaved_warmup(g, groups, chunks, micro) + 1, micro * chunks)


def test_interleaved_order_needs_whole_groups_of_microbatches():
    with pytest.raises(ValueError, match="multiple of the device groups"):
        schedule_actions("interleaved", 4, 3, chunks=2)
    with pytest.raises(ValueError, match="chunks per device group"):
        schedule_actions("interleaved", 5, 2, chunks=2)


def _uniform(num_layers: int, t: float, x: float, *, devices: int = 4, options=(4,), **overrides) -> StageProblem:
    """Equal layers of time t per microbatch on single devices (sub-mesh (1, 1)), transfers x; a layer's
    state and activations are 1 byte each."""
    span = (np.arange(num_layers)[None, :] - np.arange(num_layers)[:, None] + 1).clip(0).astype(float)
    time = (span * t)[:, :, None, None].repeat(len(options), axis=-1)
    time[span == 0] = math.inf
    fields = dict(num_layers=num_layers, submeshes=((1, 1),), num_devices=devices, global_batch=24,
                  microbatch_options=options, stage_time_s=time, stage_param_bytes=span[:, :, None],
                  stage_act_bytes=span[:, :, None, None].repeat(len(options), axis=3),
                  transfer_s=np.full((num_layers - 1, 1, 1, len(options)), x))
    fields.update(overrides)
    return StageProblem(**fields)


def test_uniform_chunks_take_b_v_plus_p_minus_one_chunk_steps():
    """8 equal layers on 4 single devices, B = 4, no transfers: 1F1B's 4 stages of 2 layers take
    (B + p - 1) 2 t = 14 t; interleaved with v = 2 (8 chunks of one layer) (B v + p - 1) t = 11 t."""
    problem = _uniform(8, 1.0, 0.0)
    plain = solve_stages(problem)
    assert plain.step_time_s == pytest.approx(14.0)
    inter = evaluate_interleaved(problem, [(i, i) for i in range(8)], 0, 4, 4)
    assert inter.step_time_s == pytest.approx(11.0) and inter.chunks == 2 and inter.schedule == "interleaved"
    assert inter.bottleneck_s == pytest.approx(2.0) and inter.num_devices_used == 4
    assert [st.first_layer for st in inter.stages] == list(range(8))
    # device group 0 holds chunks 0 and 4: both chunks' state, (p - 1) 2 + (v - 1) p + 1 = 11 -> min(11, B v = 8)
    assert inter.in_flight[0] == inter.in_flight[4] == 8 and inter.per_stage_peak_bytes[0] == pytest.approx(2 + 8 * 1)
    best = solve_interleaved(problem)
    assert best is not None and best.step_time_s <= inter.step_time_s + 1e-12
    chosen = choose_stages(problem, "1f1b")  # 1F1B with v searched: interleaving wins here
    assert chosen.schedule == "interleaved" and chosen.step_time_s < plain.step_time_s


def test_costly_transfers_keep_plain_one_f_one_b():
    """Each extra chunk boundary pays a transfer: when it costs as much as a layer, v = 1 is best."""
    problem = _uniform(8, 1.0, 1.0)
    chosen = choose_stages(problem, "1f1b")
    assert chosen.schedule == "1f1b" and chosen.chunks == 1
    forced = choose_stages(problem, "interleaved")  # asked for: the best interleaved plan, though slower
    assert forced.schedule == "interleaved" and forced.step_time_s > chosen.step_time_s


def test_interleaving_respects_budget_forced_counts_and_says_why_not():
    problem = _uniform(8, 1.0, 0.0)
    assert solve_interleaved(_uniform(8, 1.0, 0.0, num_stages=8)).chunks == 2
    assert solve_interleaved(_uniform(8, 1.0, 0.0, num_stages=3)) is None  # 3 is no multiple of groups x v
    assert solve_interleaved(_uniform(3, 1.0, 0.0)) is None  # too few layers for 2 chunks per group
    best = solve_interleaved(problem)
    tight = _uniform(8, 1.0, 0.0, memory_budget_bytes=best.peak_bytes - 1e-9)
    under = solve_interleaved(tight)
    assert under is None or under.peak_bytes <= tight.memory_budget_bytes
    with pytest.raises(PlanningError, match="no interleaved 1F1B plan fits"):
        choose_stages(_uniform(8, 1.0, 0.0, options=(3,)), "interleaved")  # 3 microbatches on 2 or 4 groups


def test_boundaries_between_nodes_pay_the_cross_node_send():
    """4 single-device groups on two nodes of 2: the sends from group 1 to 2 and from 3 back to 0 cross nodes
    (1.0 each), the others stay inside one (free). Chunks 1 and 5 (group 1) and chunk 3 (group 3) pay it:
    busiest group 1: 2 t + 2 = 4; fill through chunks 0-2: 3 t + 1 = 4; T = B 4 + 4 = 20."""
    problem = _uniform(8, 1.0, 0.0, devices_per_node=2, transfer_cross_node_s=np.full((7, 1, 1), 1.0))
    inter = evaluate_interleaved(problem, [(i, i) for i in range(8)], 0, 4, 4)
    assert inter.transfer_times_s == (0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0)
    assert inter.bottleneck_s == pytest.approx(4.0) and inter.step_time_s == pytest.approx(20.0)
    one_node = evaluate_interleaved(_uniform(8, 1.0, 0.0, transfer_cross_node_s=np.full((7, 1, 1), 1.0)),
                                    [(i, i) for i in range(8)], 0, 4, 4)
    assert one_node.step_time_s == pytest.approx(11.0)  # no devices_per_node: one node, nothing crosses
