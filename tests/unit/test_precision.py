"""bf16 and mixed precision: roles, plans, export and the peak a dot runs at (no devices, no compiles).

``np.issubdtype(jnp.bfloat16, np.floating)`` is False, so a bf16 model once had no parameters: every
leaf it updated was taken for optimizer state and ``export`` wrote ``"params": {}``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard
from autoshard.ir.graph import Role
from autoshard.ir.trace import is_floating, trace
from autoshard.meshes import cost
from autoshard.meshes.cluster import PRESETS
from autoshard.passes.intra_op import IntraOpOptions
from autoshard.passes.strategies.base import op_dtype
from autoshard.plans.export import flax_rules
from examples import gpt

FAST = IntraOpOptions(time_limit_s=0.5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_every_floating_dtype_that_the_step_updates_is_a_parameter(dtype):
    def step(w, count, x):
        return w * 0.5 + x[0].astype(w.dtype), count + 1, jnp.sum(x)

    args = (jax.ShapeDtypeStruct((4, 8), dtype), jax.ShapeDtypeStruct((), jnp.int32),
            jax.ShapeDtypeStruct((2, 4, 8), jnp.float32))
    graph = trace(step, *args)
    roles = [graph.values[v].role for v in graph.inputs]
    assert roles == [Role.PARAM, Role.OPT_STATE, Role.BATCH]
    assert is_floating(np.dtype(dtype).name) and not is_floating("int32") and not is_floating("bool")


@pytest.mark.parametrize("config", ["tiny-bf16", "tiny-mixed"])
def test_gpt_in_bf16_plans_every_parameter_as_a_parameter_and_exports_it(config):
    work = gpt.workload(config, abstract=True)
    leaves = jax.tree_util.tree_leaves_with_path(work.args[0])
    want = "bfloat16" if config == "tiny-bf16" else "float32"
    assert leaves and all(np.dtype(x.dtype).name == want for _, x in leaves)
    plan = autoshard.plan(work.step, *work.args, mesh=(2, 4), cluster="1x8-a100", num_stages=1, options=FAST)
    params = [p for p, role in plan.input_roles.items() if role == Role.PARAM.value or role == Role.PARAM]
    assert len(params) == len(leaves)
    assert all(plan.input_shapes[p][1] == want for p in params)
    exported = flax_rules(plan)
    assert sorted(exported["params"]) == sorted(jax.tree_util.keystr(p) for p, _ in leaves)
    assert len(exported["opt_state"]) == 2 * len(leaves) + 1  # adamw's mu and nu, and its step count
    report = str(plan)  # the report lists them under "parameters", none as optimizer state
    listed = report.split("parameters (and their optimizer state")[1].split("  batch:")[0]
    assert all(jax.tree_util.keystr(p) in listed for p, _ in leaves)


def test_mixed_precision_keeps_fp32_masters_and_runs_every_dot_at_the_bf16_peak():
    graph = trace(*_step_and_args("tiny-mixed"))
    params = [graph.values[v] for v in graph.inputs if graph.values[v].role == Role.PARAM]
    assert params and all(v.dtype == "float32" for v in params)
    casts = [op for op in graph.ops if op.primitive == "convert_element_type"
             and op.inputs[0] in graph.inputs and graph.values[op.outputs[0]].dtype == "bfloat16"]
    assert len(casts) >= len([v for v in params if v.rank == 2])  # every kernel cast to bf16 in the forward
    dots = [op for op in graph.ops if op.primitive == "dot_general"]
    assert dots
    a100 = PRESETS["1x8-a100"]
    for op in dots:  # forward and backward: operands in bf16, so priced at 312 TFLOP/s (not TF32's 156)
        ins, outs = [graph.values[v] for v in op.inputs], [graph.values[v] for v in op.outputs]
        assert op_dtype(op, ins, outs) == "bfloat16", op
        assert cost.roofline_s(a100, op.flops, 0, op_dtype(op, ins, outs)) == pytest.approx(op.flops / 312e12)


def mixed_step(compute_dtype):
    """SGD on ``w`` (fp32 master) with the forward in ``compute_dtype``: Flax's ``dtype=`` pattern by hand."""

    def step(w, x):
        def loss(w):
            y = x.astype(compute_dtype) @ w.astype(compute_dtype)
            return jnp.mean(jnp.tanh(y).astype(jnp.float32) ** 2)

        value, grad = jax.value_and_grad(loss)(w)
        return w - 0.1 * grad, value

    return step


def test_mixed_precision_memory_holds_the_fp32_master_and_its_bf16_copy():
    """The fp32 weight (argument) and its bf16 cast (a temporary the backward reads again) are both in the
    modeled peak."""
    n = 1024
    args = (jax.ShapeDtypeStruct((n, n), jnp.float32), jax.ShapeDtypeStruct((8, n), jnp.float32))
    ledgers = {dt: autoshard.plan(mixed_step(dt), *args, mesh=(1, 1), cluster="1x8-a100", num_stages=1,
                                  options=FAST).ledger for dt in (jnp.float32, jnp.bfloat16)}
    master, copy = 4 * n * n, 2 * n * n
    f32, mixed = ledgers[jnp.float32], ledgers[jnp.bfloat16]
    assert mixed.memory_by_kind["param"] == f32.memory_by_kind["param"] == master
    assert mixed.peak_memory_bytes >= master + copy  # both copies at once


def test_bf16_parameters_and_moments_halve_the_argument_bytes():
    ledgers = {}
    for config in ("tiny", "tiny-mixed", "tiny-bf16"):
        work = gpt.workload(config, abstract=True)
        ledgers[config] = autoshard.plan(work.step, *work.args, mesh=(1, 1), cluster="1x8-a100", num_stages=1,
                                         options=FAST).ledger
    f32, mixed, bf16 = ledgers["tiny"], ledgers["tiny-mixed"], ledgers["tiny-bf16"]
    param_bytes = f32.memory_by_kind["param"]
    assert mixed.memory_by_kind["param"] == param_bytes  # fp32 masters
    assert bf16.memory_by_kind["param"] == param_bytes / 2
    assert bf16.memory_by_kind["opt_state"] == pytest.approx(f32.memory_by_kind["opt_state"] / 2, abs=8)


def _step_and_args(config):
    work = gpt.workload(config, abstract=True)
    return (work.step, *work.args)


def test_autoshard_plan_and_export_of_a_bf16_gpt_write_every_parameter_spec(tmp_path):
    """The command line, as a user runs it: ``autoshard plan`` then ``autoshard export``."""
    import json

    from autoshard import cli

    plan_file, rules = tmp_path / "plan.json", tmp_path / "rules.json"
    assert cli.main(["plan", "examples/gpt.py", "--config", "tiny-bf16", "--mesh", "2x4", "--cluster", "1x8-a100",
                     "--time-limit", "0.5", "--out", str(plan_file)]) == 0
    assert cli.main(["export", str(plan_file), "--format", "flax-rules", "--out", str(rules)]) == 0
    data = json.loads(rules.read_text())
    params = gpt.workload("tiny-bf16", abstract=True).args[0]
    assert sorted(data["params"]) == sorted(jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params))
    assert all(len(entries) == len(leaf.shape) for entries, leaf in
               zip((data["params"][jax.tree_util.keystr(p)] for p, _ in jax.tree_util.tree_leaves_with_path(params)),
                   jax.tree.leaves(params)))


def test_fp32_masters_with_bf16_compute_are_priced_and_advised_as_bf16(tmp_path):
    """The plan records which peaks its FLOPs run at: a fp32-master / bf16-compute GPT runs them at the bf16
    peak, so ``verify.compiled_price`` prices the compiled FLOPs there (not at TF32, the parameters' dtype), and
    ``advise`` writes Accelerate's ``mixed_precision: bf16`` for it (and "no" for the fp32 twin)."""
    from autoshard.compiler.advise import mixed_precision
    from autoshard.compiler.hlo import CompiledSummary
    from autoshard.compiler.verify import compiled_price

    plans = {}
    for config in ("tiny", "tiny-mixed", "tiny-bf16"):
        work = gpt.workload(config, abstract=True)
        plans[config] = autoshard.plan(work.step, *work.args, mesh=(2, 4), cluster="1x8-a100", num_stages=1,
                                       options=FAST)
    fp32, mixed, bf16 = plans["tiny"], plans["tiny-mixed"], plans["tiny-bf16"]
    assert fp32.ledger.main_compute_dtype == "tfloat32" and mixed.ledger.main_compute_dtype == "bfloat16"
    assert sum(mixed.ledger.flops_by_dtype.values()) == pytest.approx(mixed.ledger.flops_per_device)
    assert [mixed_precision(p) for p in (fp32, mixed, bf16)] == ["no", "bf16", "bf16"]
    path = tmp_path / "mixed.json"
    mixed.save(str(path))
    assert dict(autoshard.load_plan(str(path)).ledger.flops_by_dtype) == pytest.approx(dict(mixed.ledger.flops_by_dtype))

    a100 = PRESETS["1x8-a100"]
    summary = CompiledSummary(collectives=(), bytes_by_kind={}, argument_bytes=0, output_bytes=0, alias_bytes=0,
                              temp_bytes=0, peak_bytes=0, flops=1e12, bytes_accessed=0.0)
    share = {d: f / sum(mixed.ledger.flops_by_dtype.values()) for d, f in mixed.ledger.flops_by_dtype.items()}
    assert share["bfloat16"] > 0.5
    want = 1e12 * sum(s / a100.peak_flops(d) for d, s in share.items())
    assert compiled_price(mixed, summary).compute_s == pytest.approx(want)
    assert compiled_price(mixed, summary).compute_s < 0.75 * 1e12 / a100.peak_flops("tfloat32")
    assert compiled_price(fp32, summary).compute_s == pytest.approx(
        1e12 * sum(f / a100.peak_flops(d) for d, f in fp32.ledger.flops_by_dtype.items())
        / sum(fp32.ledger.flops_by_dtype.values()))
