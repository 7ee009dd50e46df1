"""Stage costs from the intra-op pass (passes/stage_costs.py): one solve per distinct layer and mesh, whatever
the depth; variants over logical meshes and recomputation; the stage DP's memory with the work bytes."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest

import autoshard
from autoshard.compiler.baselines import plan_uniform_gpipe
from autoshard.compiler.pipeline_context import PipelineRequest
from autoshard.compiler.pipeline_driver import plan_pipeline
from autoshard.passes.stage_costs import logical_shapes, stage_submeshes
from autoshard.passes.stages import StageInfeasibleError, evaluate_stages, solve_stages
from examples import gpt
from pipeline_helpers import marked_step

BASE = dataclasses.replace(gpt.CONFIGS["small"], d_model=32, num_heads=2, seq_len=8, batch_size=8)


def _plan(num_layers: int, config=BASE, **kwargs):
    work = gpt.workload(dataclasses.replace(config, num_layers=num_layers), abstract=True)
    step = marked_step(work.loss_fn, optax.adamw(1e-3))
    kwargs.setdefault("num_stages", 2)
    kwargs.setdefault("num_microbatches", 2)
    return plan_pipeline(step, work.args, PipelineRequest(cluster="cpu-8", num_devices=8, num_layers=num_layers,
                                                          **kwargs)).chosen


@pytest.fixture(scope="module")
def shallow():
    return _plan(3)


def test_solves_do_not_grow_with_depth(shallow):
    deep = _plan(6)
    for piped in (shallow, deep):
        priced = piped.priced
        distinct = len(set(priced.layer_keys))
        assert priced.num_solves == distinct * len(priced.meshes)  # B forced: one microbatch size
    assert len(deep.layers) == 2 * len(shallow.layers)
    assert len(set(deep.priced.layer_keys)) < len(deep.layers)  # repeated layers share one solve
    assert deep.priced.num_solves < 2 * shallow.priced.num_solves  # twice the depth, not twice the solves


def test_variants_cover_two_axis_meshes_and_recompute(shallow):
    variants = shallow.priced.variants
    assert any(len(v.mesh_shape) == 2 for v in variants)
    assert {v.recompute for v in variants} == {False, True}
    # S = 2 on 8 devices: no stage can take all 8
    assert all(v.submesh[0] * v.submesh[1] < 8 for v in variants)
    problem = shallow.priced.problem
    b = problem.microbatch_options.index(2)
    rec = [k for k, v in enumerate(variants) if v.recompute]
    keep = [k for k, v in enumerate(variants) if not v.recompute]
    last = problem.num_layers - 1
    for k_rec, k_keep in zip(rec, keep):  # same mesh and mode, recompute off / on
        assert variants[k_rec].mesh_shape == variants[k_keep].mesh_shape
        assert problem.stage_act_bytes[0, last, k_rec, b] <= problem.stage_act_bytes[0, last, k_keep, b]
        assert problem.stage_time_s[0, last, k_rec, b] >= problem.stage_time_s[0, last, k_keep, b]


def test_plan_reports_each_stage_intra_op_plan(shallow):
    plan = shallow.plan
    assert plan.pipeline.intra_stage.startswith("per stage")
    for stage in plan.stages:
        assert stage.intra_op and " on " in stage.intra_op
        assert stage.mesh_shape == shallow.layouts[stage.index].shape
        assert f"as mesh {'x'.join(map(str, stage.mesh_shape))}" in str(stage)
    sp = shallow.stage_plan
    again = evaluate_stages(shallow.priced.problem, [(s.first_layer, s.last_layer, s.submesh_index)
                                                     for s in sp.stages], sp.num_microbatches)
    assert again.step_time_s == pytest.approx(sp.step_time_s)
    assert np.allclose(again.per_stage_peak_bytes, [st.memory.peak_bytes for st in plan.stages], rtol=1e-9)


def test_submesh_and_logical_shapes():
    spec = autoshard.PRESETS["2x8-a100"]
    assert stage_submeshes(spec, 16) == ((1, 1), (1, 2), (1, 4), (1, 8), (2, 8))
    assert logical_shapes((2, 8)) == [(2, 8)]
    assert logical_shapes((1, 8)) == [(2, 4), (4, 2)]
    assert logical_shapes((1, 2)) == [(2,)]


def _smallest_budget(problem) -> float:
    with pytest.raises(StageInfeasibleError) as info:
        solve_stages(dataclasses.replace(problem, memory_budget_bytes=0.0))
    return info.value.smallest_budget_bytes


def test_recomputation_is_searched_per_stage():
    """When activations bind, the DP turns recomputation on (for some stage) rather than fail."""
    long_sequences = dataclasses.replace(BASE, vocab_size=64, seq_len=64)  # activations outweigh the parameters
    priced = _plan(2, long_sequences, num_microbatches=4, schedule="gpipe").priced
    problem = priced.problem
    rec = np.array([v.recompute for v in priced.variants])
    without = dataclasses.replace(problem, stage_time_s=np.where(rec[None, None, :, None], np.inf,
                                                                 problem.stage_time_s))
    least_without, least_any = _smallest_budget(without), _smallest_budget(problem)
    assert least_any < least_without  # recomputation saves activation memory here
    budget = (least_any + least_without) / 2
    with pytest.raises(StageInfeasibleError):
        solve_stages(dataclasses.replace(without, memory_budget_bytes=budget))
    plan = solve_stages(dataclasses.replace(problem, memory_budget_bytes=budget))
    assert plan.peak_bytes <= budget
    assert any(priced.variants[s.submesh_index].recompute for s in plan.stages)


def test_uniform_gpipe_baseline_is_equal_data_parallel_stages():
    work = gpt.workload(dataclasses.replace(BASE, num_layers=4), abstract=True)
    step = marked_step(work.loss_fn, optax.adamw(1e-3))
    plan = plan_uniform_gpipe(step, work.args, cluster="cpu-8", num_devices=8, num_layers=4)
    assert plan.schedule == "gpipe" and len(plan.stages) == 2
    assert [(s.first_layer, s.last_layer) for s in plan.stages] == [(0, 1), (2, 3)]
    assert all(len(s.device_indices) == 4 for s in plan.stages)
    for stage in plan.stages:
        assert all(spec.is_replicated for spec in stage.param_specs.values())
        assert stage.intra_op.startswith("DP on") and not stage.recompute


def test_stage_counts_and_cuts_reuse_one_solve_per_key(shallow):
    """One intra-op solve per (layer class, sub-mesh and logical shape, microbatch size, mode): pricing the same
    step again for other stage counts solves nothing new, and its variants read the very same solves."""
    from autoshard.compiler.pipeline_pricing import price_pipeline, stage_cost_options

    ctx, first = shallow.context, shallow.priced
    kept = dict(ctx.solves.costs)
    keys = [key for _, key in kept]
    classes = set(first.layer_keys)
    # B is given: one microbatch size (8 sequences / 2); no budget: the fast mode only
    assert {k.microbatch for k in keys} == {ctx.traced.global_batch // 2} == {4}
    assert {k.mode for k in keys} == {"fast"}
    assert {k.layer_class for k in keys} == classes
    assert {(k.submesh, k.mesh_shape) for k in keys} == {(v.submesh, v.mesh_shape) for v in first.variants}
    assert first.num_solves == len(kept) == ctx.solves.solves == len(classes) * len(first.meshes)
    options = stage_cost_options(ctx)
    for num_stages in (3, None):  # another stage count, and the count searched: the same solves
        again = price_pipeline(ctx, dataclasses.replace(options, num_stages=num_stages,
                                                        min_stages=2 if num_stages is None else 1)).stages
        assert again.num_solves == 0 and ctx.solves.solves == len(kept)
        assert again.costs.keys() == first.costs.keys()
        assert all(again.costs[k][1] is first.costs[k][1] for k in again.costs)
        assert solve_stages(again.problem).stages  # the DP runs on them unchanged


def test_the_chosen_stages_run_plans_solved_at_their_own_microbatch(shallow):
    """The DP interpolates each layer between its solves at B = 1 and B = r; the runtime pins one plan per
    layer at the chosen B. So the chosen stages' layers are solved at batch / B (one solve per class, mesh and
    mode they use) and every figure the plan reads from them is that plan's."""
    from autoshard.compiler.pipeline_pricing import at_runtime_microbatch
    from autoshard.passes.layer_solves import LayerSolves
    from autoshard.passes.stage_costs import MODES

    ctx, pricing = shallow.context, shallow.pricing
    assert at_runtime_microbatch(ctx, pricing, shallow.stage_plan) is pricing  # B = r: priced there already
    fresh = dataclasses.replace(ctx, solves=LayerSolves())  # count this test's solves alone
    at4 = dataclasses.replace(shallow.stage_plan, num_microbatches=4)  # 8 sequences: 2 per microbatch
    stages = at_runtime_microbatch(fresh, pricing, at4).stages
    used = {(stages.layer_keys[layer], stages.mesh_of[st.submesh_index],
             MODES.index(stages.variants[st.submesh_index].mode))
            for st in at4.stages for layer in range(st.first_layer, st.last_layer + 1)}
    assert fresh.solves.solves == len(used)
    made = {id(cost): key for (_, key), cost in fresh.solves.costs.items()}
    for key in used:
        first, second = stages.costs[key]
        assert first is second and made[id(second)].microbatch == 2 and made[id(second)].layer_class == key[0]
        assert pricing.stages.costs[key][1] is not second  # the B = r plan is not what this stage runs
    untouched = set(stages.costs) - used
    assert all(stages.costs[k] is pricing.stages.costs[k] for k in untouched)
    # the plan's memory reads those plans too (the compiled stages are checked against it): both ends of their
    # interpolation are the plan at B, so every microbatch option reads it
    b = 0
    first = at4.stages[0]
    held = sum(stages.layer_cost(layer, first.submesh_index).act_bytes
               for layer in range(first.first_layer, first.last_layer + 1))
    assert stages.problem.stage_act_bytes[first.first_layer, first.last_layer, first.submesh_index, b] == \
        pytest.approx(held)


def test_stage_memory_holds_residuals_and_combined_gradient_reductions(shallow):
    """A stage's peak beyond its state and in-flight activations (``stage_arrays``): a stage whose backward is
    an executable apart holds every residual to its end (the layer's held peak) while the partial sums of the
    layers it already ran wait; a stage run as one program (the last) holds the residuals of the layers whose
    backward has not run yet; either way XLA reduces the stage's gradients in one combined collective at its
    end, operands and results live at once (the gpt-large 2x8 stage 0 compiled 4.66 GB of temporaries this way,
    where the model had said 0.16 GB)."""
    from autoshard.passes.stage_costs import MODES, stage_arrays

    priced = shallow.priced
    variant = dataclasses.replace(priced.variants[0], recompute=False)
    base = priced.layer_cost(0, 0)
    MB = 1e6
    layers = {"a": dict(held_extra_bytes=7 * MB, pending_bytes=1 * MB, fused_act_bytes=3 * MB,
                        fused_extra_bytes=2 * MB, in_bytes=0.5 * MB),
              "b": dict(held_extra_bytes=2 * MB, pending_bytes=4 * MB, fused_act_bytes=1 * MB,
                        fused_extra_bytes=9 * MB, in_bytes=0.5 * MB)}
    costs = {}
    for key, fields in layers.items():
        cost = dataclasses.replace(base, **fields)
        costs[key, 0, MODES.index(variant.mode)] = (cost, cost)
    arrays = stage_arrays(costs, ("a", "b", "a"), (variant,), (0,), (1,), 1)
    work = arrays.work_bytes[..., 0, 0] / MB
    # apart (not the last layer), layers [0, 1] = a, b: b's backward runs first and its 4 MB wait while a's runs
    # (7 + 4), above b's own held peak (2) and the combined 2 x (1 + 4)
    assert work[0, 1] == pytest.approx(11.0)
    assert work[0, 0] == pytest.approx(7.0)  # one layer: its held peak beats 2 x 1 MB of combined reductions
    assert work[1, 1] == pytest.approx(8.0)  # 2 x 4 MB combined beat its held peak of 2 MB
    # the last stage runs as one program, layers [1, 2] = b, a: a's backward runs first (2 + 3 MB) with b's
    # residuals held (1): 6; then b's (9 + 1) with a's 1 MB pending: 11; less b's input (counted in the in-flight
    # activations): 10.5, above the combined 2 x 5. (Every residual held through the peak would say 12.5.)
    assert work[1, 2] == pytest.approx(10.5)
    assert work[2, 2] == pytest.approx(2 + 3 - 0.5)


def test_a_layer_forward_is_its_forward_executable_not_a_prefix_of_its_ops():
    """``jax.vjp`` interleaves the JVP rules' derivative factors with the primal ops, so a layer's forward is
    not the first ops of its train graph: its forward seconds and the residuals it holds in one program are
    read from the forward the runtime cuts (``Phases``). Checked additively: an attention layer and the MLP
    after it, priced alone and as one layer, have the forward seconds and one-program residuals of the two
    added (a prefix cut kept 1.38e-5 of the MLP's 3.74e-5 forward seconds and 49 of its 115 KB)."""
    from autoshard.ir.split import split_step
    from autoshard.ir.trace import step_jaxpr
    from autoshard.ir.train_graph import layer_graph, one_layer_programs
    from autoshard.meshes.cluster import PRESETS
    from autoshard.meshes.logical import make_logical_mesh
    from autoshard.passes.layers import cluster_layers
    from autoshard.passes.stage_costs import StageCostOptions, solve_layer

    work = gpt.workload(dataclasses.replace(BASE, num_layers=4), abstract=True)
    tx = optax.sgd(1e-3)
    step = marked_step(work.loss_fn, tx)
    params, batch = work.args[0], work.args[-1]
    fwd = split_step(step_jaxpr(step, params, jax.eval_shape(tx.init, params), batch)[0]).forward
    layers = cluster_layers(fwd, 8)
    tanh = [i for i, layer in enumerate(layers) if any(fwd.eqns[e].eqn.primitive.name == "tanh" for e in layer.eqns)
            and not any(fwd.eqns[e].eqn.primitive.name == "exp" for e in layer.eqns)]
    mlp = next(i for i in tanh if i > 0 and any(fwd.eqns[e].eqn.primitive.name == "exp" for e in layers[i - 1].eqns))
    eqns = [layer.eqns for layer in layers]
    alone = one_layer_programs(fwd, eqns)
    together = one_layer_programs(fwd, eqns[:mlp - 1] + [eqns[mlp - 1] + eqns[mlp]] + eqns[mlp + 1:])[mlp - 1]
    mesh = make_logical_mesh(PRESETS["cpu-8"], (1,), device_indices=(0,))
    options = StageCostOptions(time_limit_s=2.0)

    def cost(program, key):
        train = layer_graph(fwd, program, key)
        return train, solve_layer(train, mesh, "fast", [0.0] * len(program.param_leaves), 0.0, options)

    (attn_train, attn), (_, dense), (_, both) = (cost(alone[mlp - 1], "attention"), cost(alone[mlp], "mlp"),
                                                 cost(together, "block"))
    in_forward = attn_train.phases.forward_ops()
    assert max(in_forward) >= len(in_forward)  # not a prefix: backward ops come before its last forward op
    assert both.forward_s == pytest.approx(attn.forward_s + dense.forward_s, rel=0.01)
    assert both.forward_s < both.time_s
    # the MLP's input (the attention's output) is a residual of the block, and an input of the MLP alone
    assert both.fused_act_bytes == pytest.approx(attn.fused_act_bytes + dense.fused_act_bytes, rel=0.02)
