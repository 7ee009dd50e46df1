"""Interleaved 1F1B on the CPU sub-meshes: two device groups of 4, each running two non-adjacent stages of
the tiny GPT. 3 SGD steps equal the same steps on one device, and a saved plan runs again as planned."""
from __future__ import annotations

import jax
import optax
import pytest

import autoshard
from compiled_examples import FAST_COMPILE
from examples import gpt
from pipeline_helpers import assert_leaves_close, marked_step, rel


def _interleaved_against_one_device(work, steps: int):
    """``steps`` SGD steps of ``work`` as an interleaved pipeline of 4 stages (2 groups x 2 chunks, B = 2)
    against the same steps on one device: the loss each step and the parameters after. Returns the step,
    its optimizer and the decorated step."""
    params, _, batch = work.args
    tx = optax.sgd(0.1)
    step = marked_step(work.loss_fn, tx)
    piped = autoshard.autoshard(step, schedule="interleaved", num_stages=4, num_microbatches=2, cluster="cpu-8",
                                compiler_options=FAST_COMPILE)
    reference = jax.jit(step, compiler_options=FAST_COMPILE)
    ref = state = (params, tx.init(params))
    for _ in range(steps):
        *ref, ref_loss = reference(*ref, batch)
        *state, loss = piped(*state, batch)
        assert rel(loss, ref_loss) <= 1e-5, f"loss {float(loss)} vs one device {float(ref_loss)}"
    assert_leaves_close(state[0], ref[0], "params")
    assert piped.plan.schedule == "interleaved" and len(piped.plan.stages) == 4
    return step, tx, piped


def test_interleaved_pipeline_matches_one_device(devices8, tmp_path):
    work = gpt.workload("tiny")
    params, _, batch = work.args
    step, tx, piped = _interleaved_against_one_device(work, steps=3)
    plan = piped.plan
    groups = [tuple(st.device_indices) for st in plan.stages]
    assert groups[0] == groups[2] != groups[1] == groups[3]  # stage s on device group s mod 2
    assert sorted(set(groups[0]) | set(groups[1])) == list(range(8))
    # a device holds both of its group's stages: each stage reports the device's peak, the two stages' state
    # summed (stages 0 and 2 hold different layers, so their own states differ)
    mem = [st.memory for st in plan.stages]
    assert mem[0] == mem[2] and mem[1] == mem[3] and mem[0].params_bytes > 0
    # each stage executable runs the collectives its plan predicts; a device group's peak adds its stages
    from autoshard.compiler.verify_pipeline import verify_pipeline

    compiled = piped.lower(params, tx.init(params), batch).compile()
    report = verify_pipeline(plan, compiled)
    assert all(r.ok for r in report.rows), str(report)
    # priced from the executables as interleaving runs them: the busiest group's chunks B times, the fill once
    from autoshard.compiler.verify_pipeline import compiled_pipeline_price

    price = compiled_pipeline_price(plan, compiled)
    t, x, b = price.stage_s, price.transfer_s + (0.0,), plan.pipeline.num_microbatches
    load = [sum(t[c] + x[c] for c in range(g, len(t), 2)) for g in range(2)]
    assert price.step_s == pytest.approx(b * max(load) + t[0] + x[0]), str(price)
    assert report.row("stage 0 peak memory bytes").compiled == report.row("stage 2 peak memory bytes").compiled
    # the stages run their layers' train graphs, and a reshard between two layer plans that passes through
    # intermediate layouts (the plan's edge pins) is pinned through them there too (stage_train.LayerEdges)
    runtime = piped.planned(params, tx.init(params), batch).runtime()
    assert all(r is not None for r in runtime.runners), "every stage runs its layers' train graphs"
    for st, runner in zip(plan.stages, runtime.runners):
        pinned = {s for e in runner.edges for m in (e.into, e.back_from, e.data_into, e.out_of, e.back_into)
                  for chain in m.values() for s in chain}
        planned = {s for (_, side, _), (ahead, back) in st.edge_pins.items()
                   for s in ((*ahead[:-1], *back[1:]) if side == 0 else (*ahead[1:], *back[:-1]))}
        assert pinned <= planned and bool(pinned) == bool(planned), (st.index, pinned, planned)
    path = tmp_path / "interleaved.plan.json"
    plan.save(path)
    again = autoshard.apply(autoshard.load_plan(path), step, jax.devices())
    *_, loss = again(params, tx.init(params), batch)
    first = jax.jit(step, compiler_options=FAST_COMPILE)(params, tx.init(params), batch)[-1]
    assert rel(loss, first) <= 1e-5


def test_interleaved_scanned_stack_matches_one_device(devices8):
    """A stack under nnx.scan, interleaved: each stage runs its own iteration range as a loop, two ranges per
    device group."""
    import dataclasses

    from examples import gpt_scan

    work = gpt_scan.workload(dataclasses.replace(gpt_scan.CONFIGS["tiny"], num_layers=6))
    _, _, piped = _interleaved_against_one_device(work, steps=2)
    assert piped.plan.pipeline.scanned
    ranges = piped.pipeline_step.stage_iterations
    assert [lo for lo, _ in ranges] == sorted(lo for lo, _ in ranges) and ranges[-1][1] == 6
