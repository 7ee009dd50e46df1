"""Pipelines whose stage layouts the PLANNER chooses (not set by hand), against one device.

Under a per-device budget below what a stage holds with replicated parameters, gradients and AdamW state,
the stage DP must pick sharded intra-op plans inside its stages. The test asserts that the chosen layouts
are sharded (storage specs and the per-equation specs the stage executables pin), then runs 3 steps of the
pipeline (GPipe or 1F1B, B = 1, 2, 4) against the same steps on one device: fp32 losses within 1e-5 at every
step and AdamW's first moment (the averaged gradients) after the first step within 1e-5. Parameters are not
compared: Adam divides rounding noise by tiny second moments where a gradient is zero in theory (attention
key biases).
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest

import autoshard
from compiled_examples import FAST_COMPILE
from examples import gpt
from pipeline_helpers import assert_leaves_close, marked_step, rel

CONFIG = dataclasses.replace(gpt.CONFIGS["small"], vocab_size=512, num_layers=4, d_model=64, num_heads=2, seq_len=8,
                             batch_size=8)
# (stages, schedule, microbatches, budget as a fraction of the parameter bytes)
# one default case (tests/sim/test_pipeline_intra.py's memory-bound test runs 2 planned stages, 1F1B, B = 2 by
# default); the others are slow
CASES = [(4, "1f1b", 4, 0.8), pytest.param(2, "gpipe", 1, 1.25, marks=pytest.mark.slow),
         pytest.param(4, "gpipe", 2, 0.8, marks=pytest.mark.slow)]


def _ids(case) -> str:
    s, sch, b, f = case.values if hasattr(case, "values") else case
    return f"{s}stages-{sch}-B{b}-budget{f}P"


@pytest.mark.parametrize("stages, schedule, microbatches, fraction", CASES, ids=[_ids(c) for c in CASES])
def test_planner_sharded_stages_match_one_device(stages, schedule, microbatches, fraction, devices8):
    work = gpt.workload(CONFIG)
    params, opt_state, batch = work.args
    tx = optax.adamw(CONFIG.learning_rate, weight_decay=CONFIG.weight_decay)
    step = marked_step(work.loss_fn, tx)
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    budget = fraction * param_bytes
    piped = autoshard.autoshard(step, cluster="cpu-8", memory_budget=budget, num_stages=stages,
                                num_microbatches=microbatches, schedule=schedule, compiler_options=FAST_COMPILE)
    reference = jax.jit(step, compiler_options=FAST_COMPILE)
    ref, state = (params, opt_state), (params, opt_state)
    for k in range(3):
        *ref, ref_loss = reference(*ref, batch)
        *state, loss = piped(*state, batch)
        assert rel(loss, ref_loss) <= 1e-5, f"step {k}: loss {float(loss)} vs one device {float(ref_loss)}"
        if k == 0:
            assert_leaves_close(state[1][0].mu, ref[1][0].mu, "mu")
    plan = piped.plan
    assert len(plan.stages) == stages and plan.num_microbatches == microbatches and plan.schedule == schedule
    sharded_stages = 0
    for stage in plan.stages:
        assert stage.memory.peak_bytes <= budget
        # replicated, a stage holds its parameters, their gradients and AdamW's two moments: 4 x its parameters
        replicated_bytes = 4 * sum(np.prod(plan.input_shapes[p][0]) * 4 for p in stage.param_specs)
        state_specs = list(stage.param_specs.values()) + list(stage.grad_specs.values())
        sharded = any(not spec.is_replicated for spec in state_specs)
        assert sharded or replicated_bytes <= budget, f"stage {stage.index} keeps its state replicated over budget"
        sharded_stages += sharded
        assert stage.state_specs
        if sharded:  # the stage executables pin the layer plans' layouts, sharded ones among them
            assert any(s is not None and not s.is_replicated for specs in stage.op_out_specs.values() for s in specs)
    assert sharded_stages >= 1
    # the runtime really holds the updated state in the planned layouts (the apply's out_shardings)
    run = piped.planned(params, opt_state, batch).runtime()
    shardings = [run.output_sharding(s, k) for s, layout in enumerate(run.layouts) for k in layout.output_specs]
    assert shardings and any(not sh.is_fully_replicated for sh in shardings)


@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
def test_planned_stage_collectives_match_compiled_hlo(recompute, devices8):
    """Per stage executable (forward and backward per microbatch, apply once per step), the collectives
    predicted from the stage's layer plans equal those in its compiled HLO, and each stage's peak memory the
    one composed from its executables, within verify's tolerances, for a plan whose stages the planner shards
    (a budget under which replicated state does not fit; the stages' state fully sharded, "lean"); with the
    residuals kept between forward and backward, and with the forward recomputed in the backward. Each stage
    runs its layers' train graphs pinned op by op (``runtime/stage_train.py``), so the backward rows are
    checked like the others."""
    from autoshard.compiler.pipeline_context import PipelineRequest, pipeline_context
    from autoshard.compiler.pipeline_pricing import finish_pipeline, price_pipeline
    from autoshard.compiler.target import resolve_target
    from autoshard.compiler.verify_pipeline import verify_pipeline
    from autoshard.ir.split import split_step
    from autoshard.ir.trace import trace
    from autoshard.passes.stage_costs import StageCostOptions
    from autoshard.passes.stages import solve_stages
    from autoshard.runtime.pipeline_lower import lower_pipeline

    config = dataclasses.replace(CONFIG, batch_size=64)
    work = gpt.workload(config)
    params, opt_state, batch = work.args
    tx = optax.adamw(config.learning_rate, weight_decay=config.weight_decay)
    step = marked_step(work.loss_fn, tx)
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    args = (params, opt_state, batch)
    graph = trace(step, *args)
    parts = split_step(graph.jaxpr)
    target = resolve_target(None, "cpu-8", 2.6 * param_bytes)
    ctx = pipeline_context(step, args, PipelineRequest(name="fidelity"), graph, parts, target, {})
    # "lean": every layer's state pinned fully sharded (FSDP), as a stage of many layers needs when memory binds
    options = StageCostOptions(num_stages=2, num_microbatches=2, memory_budget_bytes=target.memory_budget_bytes,
                               recompute=(recompute,), modes=("lean",), time_limit_s=0.05)
    priced = price_pipeline(ctx, options)
    piped = finish_pipeline(ctx, priced, solve_stages(priced.stages.problem), None)
    plan = piped.plan
    assert len(plan.stages) == 2 and all(st.recompute == recompute for st in plan.stages)
    assert any(not s.is_replicated for st in plan.stages for s in [*st.param_specs.values(), *st.grad_specs.values()])
    runtime = piped.runtime()
    assert all(r is not None for r in runtime.runners), "every stage runs its layers' train graphs"
    report = verify_pipeline(plan, lower_pipeline(runtime).compile())
    assert not report.notes, report.notes
    for st in plan.stages:
        backward = [r for r in report.rows if r.what.startswith(f"stage {st.index} backward ")]
        assert any(r.what.endswith("all collective bytes") and r.predicted > 0 for r in backward)
    assert all(r.checked for r in report.rows if "collective" in r.what)
    # A backward that runs the forward too (the last stage fuses it, a recomputing stage re-runs it) is one
    # program: each planned reshard is made once there (runtime/spmd.SharedPins, the inputs' pins included) and
    # counted once (LayerCost.fused_collectives); its all-gathers now match within 0.2%. Before, XLA shared
    # some of the two halves' collectives and not others (per half: 12% over; once: 22-33% under). One 64 KiB
    # reduce-scatter still comes and goes with the 0.05 s layer solves (the load decides): those rows are held
    # to 25%, every other row to verify's tolerances.
    fused = {f"stage {st.index} backward " for st in plan.stages
             if st.recompute or st.index == len(plan.stages) - 1}
    for r in report.rows:
        if any(r.what.startswith(p) for p in fused) and r.what.endswith(" bytes") and "memory" not in r.what:
            assert abs(r.predicted - r.compiled) <= 0.25 * max(r.compiled, 1.0), str(report)
        else:
            assert r.ok, str(report)
