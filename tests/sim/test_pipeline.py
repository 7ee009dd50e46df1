"""Pipelines on 8 simulated devices: 3 training steps equal the same steps on one device.

An 8-layer GPT (small width) is cut into 2 stages (GPipe) and 4 stages (1F1B) with B = 1, 2, 4
microbatches. Parameters are compared after SGD steps; with the example's AdamW, the loss over three
steps and Adam's first moment after the first (Adam divides rounding noise by its own magnitude where a
gradient is zero in theory, which makes its parameters a poor yardstick).
"""
from __future__ import annotations

import dataclasses

import jax
import optax
import pytest

import autoshard
from compiled_examples import FAST_COMPILE
from examples import gpt
from pipeline_helpers import assert_adamw_steps_match, assert_leaves_close, marked_step, rel

CONFIG = dataclasses.replace(gpt.CONFIGS["small"], num_layers=8, d_model=32, num_heads=2, seq_len=8, batch_size=8)
CASES = [(2, "gpipe", b) for b in (1, 2, 4)] + [(4, "1f1b", b) for b in (1, 2, 4)]


@pytest.fixture(scope="module")
def work():
    return gpt.workload(CONFIG)


@pytest.fixture(scope="module")
def sgd_reference(work):
    """Losses and parameters of 3 SGD steps on one device (computed once for every case)."""
    params, _, batch = work.args
    tx = optax.sgd(0.1)
    reference = jax.jit(marked_step(work.loss_fn, tx), compiler_options=FAST_COMPILE)
    state, losses = (params, tx.init(params)), []
    for _ in range(3):
        *state, loss = reference(*state, batch)
        losses.append(float(loss))
    return tx, losses, state[0]


# every case with -m slow: further cases of what every run checks. Planned pipelines against one device run in
# every run below (two stages, AdamW; a microbatch count not traced), in tests/sim/test_pipeline_planned_layouts.py
# (four stages, 1F1B, B = 4) and tests/sim/test_pipeline_intra.py (2 and 4 stages, both schedules, SGD parameters)
@pytest.mark.slow
@pytest.mark.parametrize("stages, schedule, microbatches", CASES, ids=[f"{s}stages-{sch}-B{b}" for s, sch, b in CASES])
def test_sgd_pipeline_matches_one_device(work, sgd_reference, stages, schedule, microbatches, devices8):
    params, _, batch = work.args
    tx, ref_losses, ref_params = sgd_reference
    piped = autoshard.autoshard(marked_step(work.loss_fn, tx), num_stages=stages, num_microbatches=microbatches,
                                schedule=schedule, compiler_options=FAST_COMPILE)
    state = (params, tx.init(params))
    for ref_loss in ref_losses:
        *state, loss = piped(*state, batch)
        assert rel(loss, ref_loss) <= 1e-5, f"loss {float(loss)} vs one device {ref_loss}"
    plan = piped.plan
    assert len(plan.stages) == stages and plan.num_microbatches == microbatches and plan.schedule == schedule
    assert sorted(d for st in plan.stages for d in st.device_indices) == list(range(8))
    assert_leaves_close(state[0], ref_params, "params")
    text = str(plan)
    assert "bubble" in text and "stage 1: layers" in text


def test_pipeline_at_a_microbatch_count_it_did_not_trace_matches_one_device(devices8):
    """Batch 16: the planner prices r = 8 microbatches and its stage DP chooses B = 4, a count it never traced:
    the runtime runs the step extrapolated from its two traces (``ir/rescale.py``), and three SGD steps equal
    the same steps on one device."""
    work = gpt.workload(dataclasses.replace(CONFIG, batch_size=16))
    params, _, batch = work.args
    tx = optax.sgd(0.1)
    step = marked_step(work.loss_fn, tx)
    reference = jax.jit(step, compiler_options=FAST_COMPILE)
    calls = []

    def counted(*args):
        calls.append(1)
        return step(*args)

    piped = autoshard.autoshard(counted, num_stages=2, compiler_options=FAST_COMPILE)
    ref, state = (params, tx.init(params)), (params, tx.init(params))
    for k in range(3):
        *ref, ref_loss = reference(*ref, batch)
        *state, loss = piped(*state, batch)
        assert rel(loss, ref_loss) <= 1e-5, f"step {k}: loss {float(loss)} vs one device {float(ref_loss)}"
    assert piped.plan.num_microbatches not in (1, 8), "the stage DP chose a traced count: pick another batch"
    assert len(calls) == 2  # the full batch and r = 8: B = 4 was extrapolated, not traced
    assert_leaves_close(state[0], ref[0], "params")


def test_adamw_pipeline_loss_and_first_moment(work, devices8):
    params, opt_state, batch = work.args
    tx = optax.adamw(CONFIG.learning_rate, weight_decay=CONFIG.weight_decay)
    step = marked_step(work.loss_fn, tx)
    piped = autoshard.autoshard(step, num_stages=2, num_microbatches=2, schedule="1f1b", compiler_options=FAST_COMPILE)
    assert_adamw_steps_match(piped, step, params, opt_state, batch)


# A GPT whose SPMD plan on two nodes is dominated by gradient traffic over 25 Gbit/s, cheap enough to plan
# here (the gpt-medium comparison is benchmarks/pipeline_vs_spmd.py).
COMM_BOUND = gpt.Config(vocab_size=4096, seq_len=256, d_model=512, num_heads=8, num_layers=2, batch_size=128)


@pytest.mark.slow
def test_planner_pipelines_across_slow_nodes_and_keeps_spmd_on_nvlink():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import pipeline_vs_spmd as bench

    gpt.CONFIGS["comm-bound"] = COMM_BOUND
    two = bench.compare("comm-bound", "2x8-a100", time_limit_s=1.0)
    assert two["chosen"] == "pipeline" and len(two["pipeline"].stages) >= 2
    assert two["pipeline_s"] < two["spmd_s"]
    one = bench.compare("comm-bound", "1x8-a100", time_limit_s=1.0)
    assert one["chosen"] == "spmd" and one["spmd_s"] <= one["pipeline_s"]
