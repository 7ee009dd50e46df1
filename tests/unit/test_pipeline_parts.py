"""Pipeline pieces without running a pipeline: schedules, transfers, step splitting, layers, errors."""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import optax
import pytest

import autoshard
from autoshard.meshes.cluster import PRESETS
from autoshard.passes.inter_op import cross_mesh_send_s, submesh_candidates
from autoshard.ir.split import batch_inputs, split_step
from autoshard.passes.layers import cluster_layers
from autoshard.passes.stages import StageInfeasibleError
from autoshard.errors import PipelineError
from autoshard.ir.stage_programs import assign_outputs
from autoshard.plans.schedules import schedule_actions
from mlp_steps import train_step
from pipeline_helpers import assert_dispatch_order, peak_in_flight


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_schedules_run_every_action_once_in_dependency_order(schedule):
    for stages, micro in itertools.product(range(1, 5), range(1, 6)):
        order = schedule_actions(schedule, stages, micro)
        assert_dispatch_order(order, stages, micro)
        # microbatches whose activations a stage holds: 1F1B keeps at most S - s, GPipe up to B
        for s in range(stages):
            peak = peak_in_flight(order, lambda st, s=s: st == s)
            assert peak == (micro if schedule == "gpipe" else min(stages - s, micro))


def test_cross_mesh_send_prices_send_once_then_all_gather():
    cluster = PRESETS["2x8-a100"]
    nbytes = 64e6
    split = cross_mesh_send_s(cluster, nbytes, 8, 8, cross_node=True, dst_replicated=False)
    assert split == pytest.approx(nbytes / 8 / cluster.inter_node.bandwidth_bytes_per_s + cluster.inter_node.latency_s)
    # a replicated destination: each device pulling the whole tensor over the slow link costs 8x more
    # than sending it once (split) and all-gathering over NVLink
    direct = nbytes / cluster.inter_node.bandwidth_bytes_per_s + cluster.inter_node.latency_s
    once = cross_mesh_send_s(cluster, nbytes, 8, 8, cross_node=True, dst_replicated=True)
    gather = 7 / 8 * nbytes / cluster.intra_node.bandwidth_bytes_per_s + 7 * cluster.intra_node.latency_s
    assert once == pytest.approx(split + gather) and once < direct / 4
    assert cross_mesh_send_s(cluster, 0.0, 8, 8, cross_node=True, dst_replicated=True) == 0.0


def test_submesh_candidates_include_uneven_widths_and_whole_nodes():
    assert submesh_candidates(PRESETS["2x8-a100"], 16) == tuple((1, d) for d in range(1, 9)) + ((2, 8),)
    assert submesh_candidates(PRESETS["cpu-8"], 6) == tuple((1, d) for d in range(1, 7))


def _mlp_args(depth=4, width=8, batch=12):
    """Abstract parameters and batch: unit tests trace, they do not run (tests/sim runs the numerics)."""
    f32 = jnp.float32
    params = {"w": [jax.ShapeDtypeStruct((width, width), f32) for _ in range(depth)]}
    data = {"x": jax.ShapeDtypeStruct((batch, width), f32), "y": jax.ShapeDtypeStruct((batch, width), f32)}
    return params, data


def _opt_state(tx, params):
    return jax.eval_shape(tx.init, params)


def test_split_step_recovers_the_loss_and_the_layer_markers():
    params, data = _mlp_args()
    tx = optax.sgd(0.1)
    closed = jax.make_jaxpr(train_step(tx))(params, _opt_state(tx, params), data)
    parts = split_step(closed)
    assert parts is not None and parts.num_grads == 4 and parts.forward.diff == (True,) * 4 + (False, False)
    fwd = parts.forward

    def run_forward(*leaves):
        env = dict(fwd.consts)
        env.update(zip(fwd.invars, leaves))
        return fwd.run(range(len(fwd.eqns)), env)[fwd.outvar]

    loss = jax.eval_shape(run_forward, *params["w"], data["x"], data["y"])  # numerics: tests/sim
    assert loss.shape == () and loss.dtype == jnp.float32
    layers = cluster_layers(fwd)  # the three markers decide: four layers, one weight each
    assert [layer.param_leaves for layer in layers] == [(0,), (1,), (2,), (3,)]
    assert all(layer.out_bytes == 12 * 8 * 4 for layer in layers[:-1])
    assert batch_inputs(parts) == (12, (False,) * 4 + (True, True))
    assert split_step(jax.make_jaxpr(train_step(tx, marker=False))(params, _opt_state(tx, params), data)) is None


def test_auto_layers_balance_flops_and_cut_where_little_crosses():
    def loss(params, batch):
        x = batch["x"]
        for w in params["w"]:
            x = jnp.tanh(x @ w) + x  # residual: only x crosses between blocks
        return jnp.mean(x ** 2)

    params, data = _mlp_args(depth=6)
    tx = optax.sgd(0.1)
    parts = split_step(jax.make_jaxpr(train_step(tx, loss))(params, _opt_state(tx, params), data))
    layers = cluster_layers(parts.forward, 3)
    assert [layer.param_leaves for layer in layers] == [(0, 1), (2, 3), (4, 5)]
    assert layers[0].structure == layers[1].structure != layers[2].structure


def test_no_layer_boundary_where_indices_cross(caplog):
    """Top-k routing: indices made by one block's router are read by its combine. Stages exchange float
    activations (and their cotangents) only, so neither an automatic cut nor a user's marker goes between
    them; the marker is dropped with a warning, and every layer is a program of its own."""
    from autoshard.ir.train_graph import one_layer_programs
    from autoshard.passes.layers import non_float_crossing

    def loss(params, batch):
        x = batch["x"]
        for w in params["w"]:
            idx = jnp.argmax(x @ w, axis=-1)  # int32, read again below
            h = autoshard.layer_boundary(jnp.tanh(x @ w))  # a marker between the indices and their reader
            x = h + jnp.take_along_axis(x, idx[:, None], axis=-1)
        return jnp.mean(x ** 2)

    params, data = _mlp_args(depth=4)
    tx = optax.sgd(0.1)
    parts = split_step(jax.make_jaxpr(train_step(tx, loss))(params, _opt_state(tx, params), data))
    order = [i for i, f in enumerate(parts.forward.free) if not f]
    blocked = non_float_crossing(parts.forward, order)
    assert blocked.any() and not blocked.all()
    with caplog.at_level("WARNING", logger="autoshard"):
        layers = cluster_layers(parts.forward)
    assert any("marker(s) ignored" in r.getMessage() for r in caplog.records)
    programs = one_layer_programs(parts.forward, [layer.eqns for layer in layers])  # raised PipelineError before
    assert len(programs) == len(layers) >= 1
    for n in (2, 3):
        parts_auto = split_step(jax.make_jaxpr(train_step(tx, _unmarked(loss)))(params, _opt_state(tx, params), data))
        auto = cluster_layers(parts_auto.forward, n)
        one_layer_programs(parts_auto.forward, [layer.eqns for layer in auto])


def _unmarked(loss):
    """``loss`` with autoshard.layer_boundary as the identity: the cuts are automatic."""
    def run(params, batch):
        original = autoshard.layer_boundary
        autoshard.layer_boundary = lambda x: x
        try:
            return loss(params, batch)
        finally:
            autoshard.layer_boundary = original
    return run


def test_optimizer_coupling_stages_is_refused():
    params, data = _mlp_args()
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))
    closed, out = jax.make_jaxpr(train_step(tx), return_shape=True)(params, _opt_state(tx, params), data)
    parts = split_step(closed)
    with pytest.raises(PipelineError, match="couples parameters across stages"):
        assign_outputs(parts, [0, 0, 1, 1], ())
    # per-leaf optimizers split cleanly: each new weight belongs to its gradient's stage
    tx = optax.adamw(1e-3)
    parts = split_step(jax.make_jaxpr(train_step(tx))(params, _opt_state(tx, params), data))
    stages = assign_outputs(parts, [0, 0, 1, 1], ())
    assert stages[:4] == [0, 0, 1, 1]
    # gradient accumulation (optax.MultiSteps) updates every leaf in one cond on its step count: each output
    # still reads its own leaf's gradient in each branch (the cond's operands as a whole read them all)
    tx = optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2)
    parts = split_step(jax.make_jaxpr(train_step(tx))(params, _opt_state(tx, params), data))
    stages = assign_outputs(parts, [0, 0, 1, 1], ())
    assert stages[:4] == [0, 0, 1, 1]


def test_budget_too_small_names_the_stage_and_its_memory():
    params, data = _mlp_args(width=64, batch=16)
    tx = optax.adam(1e-3)
    shapes = (params, _opt_state(tx, params), data)
    with pytest.raises(StageInfeasibleError, match=r"stage \d of 2 \(layers \d\.\.\d.*needs [\d.e+]+ bytes per device"
                       ) as info:
        # above the floor no plan goes below (the parameters and Adam state split over all 8 devices, 24.6 KiB:
        # a budget below it is refused before any stage is priced), below what a stage needs
        autoshard.plan(train_step(tx), *shapes, num_stages=2, num_microbatches=1, memory_budget="26KB",
                       cluster="cpu-8")
    assert info.value.required_bytes > 26e3 and info.value.stage is not None


def test_forced_stage_count_without_marker_says_what_to_use():
    params, data = _mlp_args()
    tx = optax.sgd(0.1)
    with pytest.raises(autoshard.PlanningError, match="autoshard.value_and_grad"):
        autoshard.plan(train_step(tx, marker=False), params, _opt_state(tx, params), data, num_stages=2)


def test_split_step_reads_closures_keywords_argnums_and_aux_from_the_marker():
    params, data = _mlp_args(depth=3)
    tx = optax.sgd(0.1)

    def loss_fn(model, ws, batch, *, scale):
        x = batch["x"] * scale + model["shift"]
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.mean((x - batch["y"]) ** 2), {"out": x, "norm": jnp.sum(x ** 2)}

    def step(params, opt_state, batch):
        model = {"shift": jnp.tanh(params["w"][0][0])}  # computed by the step: a prologue leaf
        (loss, aux), (g0, g1) = autoshard.value_and_grad(
            lambda first, rest, scale: loss_fn(model, [first, *rest], batch, scale=scale),
            argnums=(0, 1), has_aux=True)(params["w"][0], params["w"][1:], scale=2.0)
        updates, opt_state = tx.update([g0, *g1], opt_state, params["w"])
        return {"w": optax.apply_updates(params["w"], updates)}, opt_state, loss, aux

    parts = split_step(jax.make_jaxpr(step)(params, _opt_state(tx, params), data))
    # operands: closed over (batch x, y and the computed shift), first, rest (2 leaves), the keyword
    assert parts.arg_leaf_counts == (3, 1, 2, 1)
    assert parts.forward.diff == (False, False, False, True, True, True, False)
    assert parts.num_grads == 3 and parts.num_aux == 2 and len(parts.forward.aux) == 2
    assert len(parts.computed_leaves) == 1 and parts.prologue is not None
    batch, split = batch_inputs(parts)
    assert batch == 12 and sum(split) == 2  # x and y, closed over, are still the microbatched inputs


def test_pipeline_plan_file_keeps_the_layer_equations_and_names_a_bad_entry():
    from autoshard.plans.planfile import PlanFileError, plan_fields, plan_to_json
    from autoshard.plans.plan import Plan

    params, data = _mlp_args()
    tx = optax.sgd(0.1)
    plan = autoshard.plan(train_step(tx), params, _opt_state(tx, params), data, num_stages=2, num_microbatches=2)
    text = plan_to_json(plan)
    assert text["pipeline"]["layer_eqns"][0] == [[0, len(plan.pipeline.layer_eqns[0]) - 1]]  # one run per layer
    again = Plan(**plan_fields(text))
    assert again.pipeline.layer_eqns == plan.pipeline.layer_eqns and again.stages == plan.stages
    text["pipeline"]["layer_eqns"][1] = [[3]]
    with pytest.raises(PlanFileError, match=r"pipeline\.layer_eqns\[1\]: expected \[\[first, last\]"):
        plan_fields(text)


def test_plan_command_with_stages_writes_a_pipeline_plan_that_verify_can_rebuild(tmp_path, capsys):
    from autoshard import cli

    out = tmp_path / "pipe.json"
    code = cli.main(["plan", "examples/pipeline_gpt.py", "--config", "tiny", "--stages", "2", "--microbatches", "2",
                     "--cluster", "cpu-8", "--out", str(out)])
    assert code == 0 and "stage 1: layers" in capsys.readouterr().out
    plan = autoshard.load_plan(out)
    assert len(plan.stages) == 2 and plan.num_microbatches == 2 and plan.pipeline.layer_eqns
    assert plan.origin["target"].endswith("examples/pipeline_gpt.py") and plan.origin["config"] == "tiny"


def test_a_loss_that_ignores_an_argument_still_splits():
    """jax's dead-code pass drops the marker call's unused operand (a key without dropout); the tracer puts it
    back, so the marker's operands are still its argument leaves, each mapped to its step input."""
    from autoshard.ir.trace import step_jaxpr

    def loss_fn(w, x, key):
        return jnp.sum((x @ w) ** 2)

    def step(w, x, key):
        loss, g = autoshard.value_and_grad(loss_fn)(w, x, key)
        return w - 0.1 * g, loss

    key = jax.eval_shape(lambda: jax.random.key(0))  # its shape only: tests/unit do not compile
    args = (jax.ShapeDtypeStruct((4, 4), jnp.float32), jax.ShapeDtypeStruct((8, 4), jnp.float32), key)
    closed, _ = step_jaxpr(step, *args)
    parts = split_step(closed)
    assert parts is not None and parts.operand_inputs == (0, 1, 2)
    assert parts.grad_for_leaf == (0,)


@pytest.mark.parametrize("counted", [False, True])
def test_a_layer_class_sees_the_free_equations_its_program_recomputes(counted):
    """Each block draws a dropout mask from a key it derives from one key the batch carries. With
    ``fold_in(key, i)`` the blocks' programs differ only in a literal, which the runtime's train graphs tell
    apart: the blocks stay one class. Counting draws as nnx's ``Rngs`` stream does (``count = count + 1`` per
    block) block k recomputes one more ``add`` than block k-1, so its train graph has another op count: it is a
    class of its own (priced and pinned with a graph that fits it; sharing block 1's, the stage fell back to
    ``jax.vjp`` at run time)."""
    def loss(params, batch):
        x, key, count = batch["x"], batch["key"], jnp.zeros((), jnp.uint32)
        for i, w in enumerate(params["w"]):
            if counted:
                count = count + 1
            k = jax.random.fold_in(key, count if counted else i)
            x = jnp.where(jax.random.bernoulli(k, 0.8, x.shape), jnp.tanh(x @ w) / 0.8, 0.0)
            if i < len(params["w"]) - 1:
                x = autoshard.layer_boundary(x)
        return jnp.mean((x - batch["y"]) ** 2)

    params, data = _mlp_args(depth=4)
    data = {**data, "key": jax.eval_shape(lambda: jax.random.key(0))}
    tx = optax.sgd(0.1)
    parts = split_step(jax.make_jaxpr(train_step(tx, loss))(params, _opt_state(tx, params), data))
    structures = [layer.structure for layer in cluster_layers(parts.forward)]
    assert len(structures) == 4
    middle = structures[1:3]  # the first reads the batch, the last the loss: classes of their own either way
    assert (middle[0] != middle[1]) is counted
