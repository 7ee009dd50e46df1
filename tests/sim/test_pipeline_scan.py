"""A scanned layer stack cut into pipeline stages (``compiler/pipeline_driver.py``, ``ir/scan_stack.py``).

The GPT under ``nnx.scan`` (examples/gpt_scan.py) as a 2-stage pipeline: 3 steps equal the same steps on
one device (GPipe and 1F1B, B = 2); the stacked parameters come back stacked; each stage's executables
take only its rows of the stacked weights and still loop (a ``while`` in the compiled HLO); and the
stage DP cuts the stack where it cuts the unrolled twin (examples/gpt.py, the same config) on the same
cluster.
"""
from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import optax
import pytest

import autoshard
from autoshard.compiler.pipeline_context import PipelinePlanned, PipelineRequest
from autoshard.compiler.pipeline_driver import plan_pipeline
from autoshard.errors import PlanningError
from autoshard.ir.scan_stack import find_stack, split_stack
from autoshard.ir.split import split_step
from autoshard.ir.trace import trace
from autoshard.runtime.pipeline_lower import lower_pipeline
from compiled_examples import FAST_COMPILE
from examples import gpt, gpt_scan
from pipeline_helpers import assert_leaves_close, marked_step, rel

TINY = gpt.CONFIGS["tiny"]  # 2 layers


@pytest.fixture(scope="module")
def scanned():
    work = gpt_scan.workload("tiny")
    params, _, batch = work.args
    tx = optax.sgd(0.1)
    step = marked_step(work.loss_fn, tx)
    reference = jax.jit(step, compiler_options=FAST_COMPILE)
    state, losses = (params, tx.init(params)), []
    for _ in range(3):
        *state, loss = reference(*state, batch)
        losses.append(float(loss))
    return work, tx, step, losses, state[0]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_scanned_gpt_two_stages_match_one_device(scanned, schedule, devices8):
    work, tx, step, ref_losses, ref_params = scanned
    params, _, batch = work.args
    piped = autoshard.autoshard(step, num_stages=2, num_microbatches=2, schedule=schedule, cluster="cpu-8",
                                compiler_options=FAST_COMPILE)
    state = (params, tx.init(params))
    for ref_loss in ref_losses:
        *state, loss = piped(*state, batch)
        assert rel(loss, ref_loss) <= 1e-5, f"loss {float(loss)} vs one device {ref_loss}"
    assert jax.tree.structure(state[0]) == jax.tree.structure(ref_params)
    for got, want in zip(jax.tree.leaves(state[0]), jax.tree.leaves(ref_params)):
        assert got.shape == want.shape  # the user's stacked layout
    assert_leaves_close(state[0], ref_params, "params")
    run = piped.pipeline_step
    assert run.stage_iterations == ((0, 1), (1, 2))
    plan = piped.plan
    assert len(plan.stages) == 2 and plan.schedule == schedule and plan.num_microbatches == 2
    if schedule == "1f1b":
        _check_stage_executables(run)
        # each stage's apply writes its updated slices back in their stored layout, so the all-gather of a
        # ZeRO-2 stage's parameters runs inside it, as planned (it used to leave them split like their
        # gradients, the gather moved out of every executable)
        from autoshard.compiler.verify_pipeline import verify_pipeline

        report = verify_pipeline(plan, lower_pipeline(run).compile())
        applies = [r for r in report.rows if " apply " in r.what]
        assert applies and all(r.ok for r in applies), str(report)


def _check_stage_executables(run):
    """Each stage's executables take only its rows of the stacked weights, and its forward still loops."""
    fwd = run.parts.forward
    full = dict(jax.tree_util.tree_leaves_with_path(gpt_scan.init_params(TINY, jax.random.key(0))))
    full_kernel = full[next(p for p in full if "mlp" in jax.tree_util.keystr(p) and "up" in jax.tree_util.keystr(p)
                            and "kernel" in jax.tree_util.keystr(p))].shape
    for p in run.programs:
        shapes = [tuple(fwd.avals[fwd.invars[k]].shape) for k in p.param_leaves]
        assert (1, *full_kernel[1:]) in shapes, f"stage {p.index} does not hold its slice of mlp.up: {shapes}"
        assert full_kernel not in shapes, f"stage {p.index} holds the whole stacked mlp.up"
    stacked = {(2, 48, 192), (2, 192, 48)}  # the whole stacked MLP kernels
    loops = 0
    for exe in lower_pipeline(run):
        if exe.action == "apply":
            continue
        shapes = {tuple(getattr(x, "shape", ())) for x in jax.tree.leaves(exe.lowered.args_info)}
        assert not shapes & stacked, f"stage {exe.stage} {exe.action} takes a whole stacked kernel"
        compiled = exe.lowered.compile()
        loops += bool(re.search(r"\bwhile\b", compiled.as_text()))
        if exe.action == "forward":
            assert re.search(r"\bwhile\b", compiled.as_text()), f"stage {exe.stage} forward has no while loop"
            assert shapes & {(1, 48, 192), (1, 192, 48)}, f"stage {exe.stage} forward: {shapes}"
    assert loops >= 2


def _stage_blocks_unrolled(plan) -> list[set[int]]:
    out = []
    for st in plan.stages:
        out.append({int(m.group(1)) for path in st.param_specs for m in [re.search(r"\['blocks'\]\[['\"]?(\d+)", path)]
                    if m})
    return out


def _stage_blocks_scanned(planned: PipelinePlanned) -> list[set[int]]:
    return [set(range(*r)) if r is not None else set() for r in planned.stage_iterations]


SCAN_BODY_PRICED_HIGHER = pytest.mark.xfail(
    strict=True, reason="the loop-region model prices a scanned layer ~2x its unrolled twin's ops (two scanned "
    "layers 8.8 us a stage on 1x8-a100, three unrolled layers and the head 7.3 us), so the DP cuts 2+2 where the "
    "twin cuts 1+3 (open in the scanned-stacks issue)")


@pytest.mark.parametrize("num_layers, num_stages", [pytest.param(4, 2, marks=SCAN_BODY_PRICED_HIGHER),
                                                    pytest.param(4, 4, marks=pytest.mark.slow)])
def test_stage_cut_of_scanned_stack_equals_unrolled_twin(num_layers, num_stages):
    """Planning only: the same config on the same cluster, the DP's cut of the stack = its cut of the blocks."""
    config = dataclasses.replace(TINY, num_layers=num_layers)
    tx = optax.sgd(0.1)
    plans = []
    for module in (gpt_scan, gpt):
        work = module.workload(config, abstract=True)
        step = marked_step(work.loss_fn, tx)
        params, _, batch = work.args
        opt = jax.eval_shape(tx.init, params)
        plans.append(plan_pipeline(step, (params, opt, batch), PipelineRequest(
            cluster="1x8-a100", num_stages=num_stages, num_microbatches=2, num_devices=8,
            num_layers=None if module is gpt_scan else num_layers)).chosen)
    scanned_plan, unrolled_plan = plans
    assert isinstance(scanned_plan, PipelinePlanned) and scanned_plan.plan.pipeline.scanned
    got, want = _stage_blocks_scanned(scanned_plan), _stage_blocks_unrolled(unrolled_plan.plan)
    assert want == [set(b) for b in want] and sorted(x for s in want for x in s) == list(range(num_layers)), want
    assert got == want, f"scanned stages hold layers {got}, the unrolled twin's {want}"
    # the sub-mesh sizes may differ: the scan body's layer is priced by the loop-region model, not op by op
    for p in (scanned_plan, unrolled_plan):
        assert sorted(d for st in p.plan.stages for d in st.device_indices) == list(range(8))


def test_scan_that_cannot_be_cut_is_refused_clearly():
    """A scan carrying an integer counter beside the activation is refused with what to change."""
    import jax.numpy as jnp

    def loss(p, batch):
        def body(carry, w):
            h, n = carry
            return (jnp.tanh(h @ w) * (1.0 + 0.1 * n), n + 1), None

        (h, _), _ = jax.lax.scan(body, (batch, jnp.int32(0)), p)
        return jnp.mean(h ** 2)

    def step(p, batch):
        value, grads = autoshard.value_and_grad(loss)(p, batch)
        return p - 0.1 * grads, value

    args = (jax.ShapeDtypeStruct((3, 4, 4), jnp.float32), jax.ShapeDtypeStruct((8, 4), jnp.float32))
    parts = split_step(trace(step, *args).jaxpr)
    stack = find_stack(parts.forward)
    assert stack is not None and stack.length == 3
    with pytest.raises(PlanningError, match="carry only the activations"):
        split_stack(parts, stack, [0, 1, 3])
    with pytest.raises(PlanningError, match="carry only the activations"):
        plan_pipeline(step, args, PipelineRequest(cluster="cpu-8", num_stages=2, num_microbatches=2, num_devices=8))


def test_update_runs_per_chunk_and_equals_the_whole():
    """The rewritten step (stack cut at [0, 1, 2]) computes the same loss and adamw update as the user's."""
    work = gpt_scan.workload("tiny")
    tx = optax.adamw(1e-3)
    step = marked_step(work.loss_fn, tx)
    params, _, batch = work.args
    args = (params, tx.init(params), batch)
    parts = split_step(trace(step, *args).jaxpr)
    cut = split_stack(parts, find_stack(parts.forward), [0, 1, 2])
    assert cut.num_chunks == 2 and len(cut.chunk_eqns) == 2
    # Adam's moments of the stacked leaves are split with them (the update reads them row-wise)
    user_leaves = jax.tree_util.tree_leaves_with_path(args)
    split_paths = {jax.tree_util.keystr(user_leaves[i][0]) for i, c in cut.inputs if c is not None}
    assert any("mu" in p and "blocks" in p for p in split_paths) and any("nu" in p for p in split_paths)
    flat = [leaf for _, leaf in user_leaves]
    vflat = cut.split_flat(flat)
    fwd = cut.parts.forward
    def rewritten_loss(vflat):
        env = dict(fwd.consts)
        env.update({v: vflat[cut.parts.operand_inputs[k]] for k, v in enumerate(fwd.invars)})
        return fwd.run(range(len(fwd.eqns)), env)[fwd.outvar]

    loss, grads = jax.jit(jax.value_and_grad(work.loss_fn), compiler_options=FAST_COMPILE)(params, batch)
    assert rel(jax.jit(rewritten_loss, compiler_options=FAST_COMPILE)(vflat), loss) <= 1e-6
    # the per-chunk update on the whole gradients (sliced) equals the user's update
    grad_of_leaf = dict(zip(parts.grad_for_leaf, jax.tree.leaves(grads)))
    vgrads = []
    for j in cut.parts.grad_for_leaf:
        k, c = cut.leaf_of[j]
        g = grad_of_leaf[k]
        vgrads.append(g if c is None else g[cut.bounds[c]:cut.bounds[c + 1]])
    from jax.extend import core as jcore

    outs = jax.jit(jcore.jaxpr_as_fun(jcore.ClosedJaxpr(cut.parts.update, [])), compiler_options=FAST_COMPILE)(
        *parts.closed.consts, *vflat, loss, *vgrads)
    want = jax.jit(step, compiler_options=FAST_COMPILE)(*args)
    joined = cut.join_outputs(outs, len(jax.tree.leaves(want)))
    got = jax.tree.unflatten(jax.tree.structure(want), joined)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.shape == w.shape  # the user's stacked layout
    # Adam's first moment tightly; the parameters within the learning rate (Adam amplifies zero-gradient noise)
    assert_leaves_close(got[1][0].mu, want[1][0].mu, "mu")
    for g, w in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0])):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-3, rtol=0)
    assert rel(got[2], want[2]) <= 1e-6


def test_scanned_pipeline_plan_file_applies_on_reversed_devices(scanned, tmp_path, devices8):
    """Saved, loaded and applied on the reversed device order: the same losses; the stack's stage ranges kept."""
    work, tx, step, ref_losses, ref_params = scanned
    params, _, batch = work.args
    planned = autoshard.plan(step, params, tx.init(params), batch, cluster="cpu-8", num_stages=2,
                             num_microbatches=2, schedule="1f1b")
    plan = planned.plan if hasattr(planned, "plan") else planned
    assert plan.pipeline.scan_layers == TINY.num_layers
    plan.save(tmp_path / "plan.json")
    loaded = autoshard.load_plan(tmp_path / "plan.json")
    assert loaded.pipeline.scan_layers == TINY.num_layers
    assert [(s.first_layer, s.last_layer) for s in loaded.stages] == [(s.first_layer, s.last_layer) for s in plan.stages]
    run = autoshard.apply(loaded, step, list(reversed(jax.devices())), compiler_options=FAST_COMPILE)
    state = (params, tx.init(params))
    for ref_loss in ref_losses:
        *state, loss = run(*state, batch)
        assert rel(loss, ref_loss) <= 1e-5, f"loss {float(loss)} vs one device {ref_loss}"
    assert_leaves_close(state[0], ref_params, "params")
    assert run.step.stage_iterations == ((0, 1), (1, 2))


def test_plain_lax_scan_stack_with_adam_matches_one_device(devices8):
    """A model we did not write as an example: a lax.scan over 4 stacked tanh layers, Adam, 2 stages."""
    import jax.numpy as jnp

    def loss_fn(p, batch):
        h = batch["x"] @ p["w_in"]

        def body(h, layer):
            return jnp.tanh(h @ layer["w"] + layer["b"]), None

        h, _ = jax.lax.scan(body, h, p["layers"])
        return jnp.mean((h @ p["w_out"] - batch["y"]) ** 2)

    keys = jax.random.split(jax.random.key(1), 5)
    params = {"w_in": jax.random.normal(keys[0], (8, 16)) * 0.3,
              "layers": {"w": jax.random.normal(keys[1], (4, 16, 16)) * 0.3, "b": jnp.zeros((4, 16))},
              "w_out": jax.random.normal(keys[2], (16, 4)) * 0.3}
    batch = {"x": jax.random.normal(keys[3], (16, 8)), "y": jax.random.normal(keys[4], (16, 4))}
    tx = optax.adam(1e-2)
    step = marked_step(loss_fn, tx)
    reference = jax.jit(step, compiler_options=FAST_COMPILE)
    ref, losses = (params, tx.init(params)), []
    for _ in range(3):
        *ref, loss = reference(*ref, batch)
        losses.append(float(loss))
    piped = autoshard.autoshard(step, num_stages=2, num_microbatches=2, schedule="1f1b", cluster="cpu-8",
                                compiler_options=FAST_COMPILE)
    state = (params, tx.init(params))
    for want in losses:
        *state, loss = piped(*state, batch)
        assert rel(loss, want) <= 1e-5, f"loss {float(loss)} vs one device {want}"
    its = piped.pipeline_step.stage_iterations
    assert [r for r in its if r is not None][0][0] == 0 and [r for r in its if r is not None][-1][1] == 4
    assert state[1][0].mu["layers"]["w"].shape == (4, 16, 16)  # Adam's state comes back stacked too
    assert_leaves_close(state[1][0].mu, ref[1][0].mu, "mu")


@pytest.mark.parametrize("kind, message", [("ys", "returns per-layer outputs"), ("reverse", "runs in reverse"),
                                           ("outside", "also read outside it")])
def test_other_uncuttable_scans_are_refused(kind, message):
    """Per-layer outputs the loss reads, a reversed scan, stacked weights read outside the scan: each refused."""
    import jax.numpy as jnp

    def loss(p, batch):
        def body(h, w):
            h = jnp.tanh(h @ w)
            return h, jnp.sum(h)

        h, ys = jax.lax.scan(body, batch, p, reverse=kind == "reverse")
        extra = jnp.sum(ys) if kind == "ys" else jnp.sum(p) if kind == "outside" else 0.0
        return jnp.mean(h ** 2) + 1e-3 * extra

    def step(p, batch):
        value, grads = autoshard.value_and_grad(loss)(p, batch)
        return p - 0.1 * grads, value

    args = (jax.ShapeDtypeStruct((3, 4, 4), jnp.float32), jax.ShapeDtypeStruct((8, 4), jnp.float32))
    parts = split_step(trace(step, *args).jaxpr)
    stack = find_stack(parts.forward)
    assert stack is not None
    with pytest.raises(PlanningError, match=message):
        split_stack(parts, stack, [0, 1, 3])
