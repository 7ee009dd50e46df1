"""Pipelines whose stages run sharded intra-op plans (FSDP or TP on 2-axis sub-meshes), against one device.

``test_sharded_stages_match_one_device`` runs 2- and 4-stage pipelines (GPipe and 1F1B, B = 1, 2, 4) with
every stage's parameters and gradient accumulators stored FSDP-style (largest dimension split over every
axis of the stage's mesh) or TP-style (the last dimension of each matrix split over the last axis, the
batch over the others), 3 SGD steps, fp32: losses and parameters within 1e-5 of the same steps on one
device. ``test_memory_bound_pipeline_shards_inside_stages`` gives the planner a budget under which no stage
fits with replicated parameters and AdamW state, and checks that the planned pipeline shards its state
inside the stages, fits, and matches one device.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest

import autoshard
from autoshard.compiler.pipeline_context import PipelineRequest
from autoshard.compiler.pipeline_driver import plan_pipeline
from autoshard.ir.spec import Spec
from autoshard.passes.classic import largest_dim_spec
from autoshard.runtime.pipeline import PipelineStep
from autoshard.runtime.stage_layout import PipelineRun, StageLayout, StepOptions, state_specs
from compiled_examples import FAST_COMPILE
from examples import gpt
from pipeline_helpers import assert_adamw_steps_match, assert_leaves_close, marked_step, rel

CONFIG = dataclasses.replace(gpt.CONFIGS["small"], vocab_size=256, num_layers=4, d_model=32, num_heads=2, seq_len=8,
                             batch_size=8)
CASES = [(2, "gpipe", 1, "fsdp"), (2, "1f1b", 2, "tp"), (4, "1f1b", 4, "fsdp"), (4, "gpipe", 2, "tp")]


@pytest.fixture(scope="module")
def setup():
    work = gpt.workload(CONFIG)
    tx = optax.sgd(0.1)
    step = marked_step(work.loss_fn, tx)
    params, _, batch = work.args
    piped = plan_pipeline(step, (params, tx.init(params), batch), PipelineRequest(
        cluster="cpu-8", num_stages=2, num_microbatches=2, num_layers=4)).chosen
    reference = jax.jit(step, compiler_options=FAST_COMPILE)
    state, losses = (params, tx.init(params)), []
    for _ in range(3):
        *state, loss = reference(*state, batch)
        losses.append(float(loss))
    return work, tx, step, piped, losses, state[0]


def _spec(shape, kind: str, names, sizes) -> Spec:
    if kind == "fsdp":
        return largest_dim_spec(shape, names, sizes)
    dims: list[tuple[str, ...]] = [()] * len(shape)
    if len(shape) == 2 and shape[-1] % sizes[names[-1]] == 0:
        dims[-1] = (names[-1],)
    return Spec(tuple(dims))


def _layouts(piped, num_stages: int, kind: str) -> list[StageLayout]:
    fwd = piped.context.parts.forward
    per_stage = len(piped.layers) // num_stages
    n = 8 // num_stages
    shape = (2, n // 2) if n >= 4 else (n,)
    names = ("x", "y")[:len(shape)]
    sizes = dict(zip(names, shape))
    out = []
    for s in range(num_stages):
        first, last = s * per_stage, (s + 1) * per_stage - 1
        leaves = sorted({k for layer in piped.layers[first:last + 1] for k in layer.param_leaves})
        specs = {k: _spec(tuple(fwd.avals[fwd.invars[k]].shape), kind, names, sizes) for k in leaves}
        batch_axes = names if kind == "fsdp" else names[:-1]
        out.append(StageLayout(first, last, tuple(range(s * n, (s + 1) * n)), mesh_shape=shape, axis_names=names,
                               param_specs=specs, grad_specs=specs,
                               input_specs=state_specs(piped.context.traced.graph, piped.context.parts, specs, specs),
                               batch_axes=batch_axes))
    return out


@pytest.mark.parametrize("stages, schedule, microbatches, kind", CASES,
                         ids=[f"{s}stages-{sch}-B{b}-{k}" for s, sch, b, k in CASES])
def test_sharded_stages_match_one_device(setup, stages, schedule, microbatches, kind, devices8):
    work, tx, step, piped, ref_losses, ref_params = setup
    params, _, batch = work.args
    layouts = _layouts(piped, stages, kind)
    assert any(not spec.is_replicated for lay in layouts for spec in lay.param_specs.values())
    traced = piped.context.traced
    run = PipelineStep(PipelineRun(traced.at_microbatches(microbatches), tuple(layer.eqns for layer in piped.layers),
                                   tuple(layouts), microbatches, schedule, traced.split_inputs, traced.in_tree,
                                   traced.graph.out_tree, traced.graph.output_paths),
                       options=StepOptions(compiler_options=FAST_COMPILE))
    assert [m.devices.shape for m in run.meshes] == [lay.shape for lay in layouts]
    state = (params, tx.init(params))
    for ref_loss in ref_losses:
        *state, loss = run(*state, batch)
        assert rel(loss, ref_loss) <= 1e-5, f"loss {float(loss)} vs one device {ref_loss}"
    assert_leaves_close(state[0], ref_params, "params")
    # the parameters really are stored sharded on the stages' meshes
    sharded = [run.param_sharding(p.index, k) for p in run.programs for k in p.param_leaves]
    assert any(not sh.is_fully_replicated for sh in sharded)
    assert all(len(sh.mesh.axis_names) == len(layouts[0].shape) for sh in sharded)


def test_memory_bound_pipeline_shards_inside_stages(devices8):
    config = dataclasses.replace(CONFIG, vocab_size=512, d_model=64)
    work = gpt.workload(config)
    params, opt_state, batch = work.args
    tx = optax.adamw(config.learning_rate, weight_decay=config.weight_decay)
    step = marked_step(work.loss_fn, tx)
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    # Replicated, a stage holds params + grads + AdamW's two moments: 4 x its params. Of two stages one holds
    # at least half the parameters, so 4 x P / 2 = 2 P; a budget of P leaves no replicated stage a fit.
    budget = float(param_bytes)
    piped = autoshard.autoshard(step, cluster="cpu-8", memory_budget=budget, num_stages=2, num_microbatches=2,
                                compiler_options=FAST_COMPILE)
    assert_adamw_steps_match(piped, step, params, opt_state, batch)
    plan = piped.plan
    assert len(plan.stages) == 2
    assert plan.ledger.peak_memory_bytes <= budget
    for stage in plan.stages:
        assert stage.memory.peak_bytes <= budget
        replicated_state = 4 * sum(np.prod(plan.input_shapes[p][0]) * 4 for p in stage.param_specs)
        assert replicated_state > budget or stage.memory.params_bytes + stage.memory.grads_bytes < replicated_state / 2
        assert any(not spec.is_replicated for spec in stage.param_specs.values()) or stage.memory.grads_bytes < (
            stage.memory.params_bytes)
