"""Plan files, baseline layouts, batch ceilings, validate, export and reports, on hand-built plans.

No ILP is solved and nothing is compiled here: plans are built from a traced
graph with chosen storage specs (tests/plan_helpers.py). tests/sim covers
the same tools on solved and compiled plans.
"""
from __future__ import annotations

import dataclasses
import io
import json
import re

import jax
import numpy as np
import pytest
from rich.console import Console
from plan_helpers import hand_plan

import autoshard
from autoshard import cli
from autoshard.passes.classic import Baseline, baseline_pins, batch_spec, divisible_axes, largest_dim_spec, node_axes
from autoshard.compiler.ceiling import BatchProbe, MemoryModel, args_at_batch
from autoshard.plans.export import flax_rules, flax_rules_python
from autoshard.ir.graph import Role
from autoshard.plans.plan import load_plan
from autoshard.plans.planfile import PlanFileError, check_mesh
from autoshard.ir.spec import Spec
from autoshard.ir.trace import trace
from autoshard.plans.validate import validate_plan
from autoshard.errors import PlanMismatchError
from autoshard.meshes.cluster import get_cluster
from autoshard.meshes.logical import make_logical_mesh
from autoshard.passes.megatron import roles_from_names, megatron_roles
from autoshard.figures import pipeline_schedule
from examples import gpt, mlp, moe


@pytest.fixture(scope="module")
def gpt_tiny():
    work = gpt.workload("tiny", abstract=True)
    return work, trace(work.step, *work.args)


def _index(graph, pattern: str) -> dict[str, int]:
    return {graph.values[v].path: i for i, v in enumerate(graph.inputs) if re.search(pattern, graph.values[v].path)}


def _paths(graph, indices) -> set[str]:
    return {graph.values[graph.inputs[i]].path for i in indices}


# ----------------------------------------------------------------------------- plan files


def test_plan_file_round_trip_keeps_every_field(gpt_tiny, tmp_path):
    _work, graph = gpt_tiny
    specs = {i: Spec((("x", "y"),) + ((),) * (graph.values[v].rank - 1)) for i, v in enumerate(graph.inputs)
             if graph.values[v].role == Role.BATCH}
    plan = hand_plan(graph, specs, stages=({"name": "s0", "time_s": 1e-3},))
    plan = dataclasses.replace(plan, origin={"target": "examples/gpt.py", "config": "tiny"},
                               baselines={"DP": {"step_s": 1.0, "fits": True, "batch_ceiling": 96}})
    plan.save(tmp_path / "plan.json")
    loaded = load_plan(tmp_path / "plan.json")
    assert loaded == plan
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["version"] == 2 and data["jax_version"] == jax.__version__ and data["autoshard_version"]
    assert data["signature"]["in_tree"].startswith("PyTreeDef")


def _pipeline_stages(graph) -> tuple:
    from autoshard.plans.stage_plan import PipelineStage, StageMemory

    params = [graph.values[v].path for v in graph.inputs if graph.values[v].role == Role.PARAM]
    return tuple(PipelineStage(
        index=s, first_layer=s, last_layer=s, submesh=(1, 4), device_indices=tuple(range(4 * s, 4 * s + 4)),
        mesh_shape=(4,), axis_names=("dp",), param_specs={p: Spec.replicated(1) for p in params[:2]},
        batch_specs={"[2]['tokens']": Spec((("dp",), ()))}, time_s=3e-3, compute_s=2e-3, sync_s=1e-4,
        transfer_out_s=1e-4 if s == 0 else 0.0, memory=StageMemory(1e6, 1e6, 2e6, 3e6, 2 - s), num_params=2)
        for s in range(2))


def test_pipeline_plan_file_round_trip(gpt_tiny, tmp_path):
    from autoshard.plans.stage_plan import PipelinePlan

    summary = PipelinePlan(num_microbatches=4, schedule="1f1b", step_s=0.02, first_microbatch_latency_s=6e-3,
                              bottleneck_s=3e-3, bubble_fraction=0.2, layers=2, cost_model="roofline",
                              intra_stage="data parallel", spmd_step_s=0.03, spmd_mesh="2x4", notes=("n",))
    plan = dataclasses.replace(hand_plan(gpt_tiny[1]), stages=_pipeline_stages(gpt_tiny[1]), pipeline=summary,
                               num_microbatches=4, schedule="1f1b")
    plan.save(tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json") == plan
    data = json.loads((tmp_path / "plan.json").read_text())
    data["stages"][1]["param_specs"]["[0]['lm_head']['bias']"] = [["tp"]]
    (tmp_path / "plan.json").write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match=r"stages\[1\]\.param_specs.*mesh axes \['tp'\] not in the plan's mesh"):
        load_plan(tmp_path / "plan.json")


def test_loading_a_plan_for_a_wider_model_names_the_parameter_and_both_shapes(tmp_path):
    small = gpt.workload("small", abstract=True)
    hand_plan(trace(small.step, *small.args)).save(tmp_path / "plan.json")
    wider = gpt.workload(dataclasses.replace(gpt.CONFIGS["small"], d_model=100), abstract=True)  # one step wider
    applied = autoshard.apply(load_plan(tmp_path / "plan.json"), wider.step, _mesh())
    with pytest.raises(PlanMismatchError) as err:
        applied.lower(*wider.args)
    text = str(err.value)
    assert "argument [0]['blocks'][0]['attn']['q']['kernel']: plan has float32[96, 96], function has " \
           "float32[100, 100]" in text
    assert "[0]['blocks'][0]['attn']['q']['bias']: plan has float32[96], function has float32[100]" in text
    assert re.search(r"\.\.\. and \d+ more", text)


def _mesh():
    return jax.make_mesh((2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def test_mesh_mismatch_names_the_axis(gpt_tiny):
    plan = hand_plan(gpt_tiny[1])
    with pytest.raises(PlanMismatchError, match=r"mesh axis 'x' has 4 devices, the plan needs 2"):
        check_mesh(plan, (4, 2), ("x", "y"))
    with pytest.raises(PlanMismatchError, match=r"mesh axes are \('data', 'model'\)"):
        check_mesh(plan, (2, 4), ("data", "model"))


@pytest.fixture()
def saved(gpt_tiny, tmp_path):
    path = tmp_path / "plan.json"
    hand_plan(gpt_tiny[1]).save(path)
    return path


def test_truncated_file_fails_clearly(saved):
    text = saved.read_text()
    saved.write_text(text[: len(text) // 2])
    with pytest.raises(PlanFileError, match=r"is not valid JSON \(truncated or hand-edited\?\)"):
        load_plan(saved)


def test_unknown_mesh_axis_in_a_spec_fails_naming_the_path(saved):
    data = json.loads(saved.read_text())
    path = "[0]['blocks'][0]['attn']['q']['kernel']"
    data["input_specs"][path] = [[], ["z"]]
    saved.write_text(json.dumps(data))
    with pytest.raises(PlanFileError) as err:
        load_plan(saved)
    assert f"input_specs[{path}]: spec RS(z) uses mesh axes ['z'] not in the plan's mesh ['x', 'y']" in str(err.value)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("ledger"), r"missing field 'ledger'"),
    (lambda d: d["ledger"].pop("peak_memory_bytes"), r"ledger: missing field\(s\) \['peak_memory_bytes'\]"),
    (lambda d: d["mesh"].pop("axis_names"), r"mesh: missing field 'axis_names'"),
    (lambda d: d["signature"]["inputs"]["[2]['tokens']"].update(shape="24x9"),
     r"signature.inputs\[\[2\]\['tokens'\]\]: field 'shape' should be list"),
    (lambda d: d["input_specs"].update({"[2]['tokens']": [["x"]]}), r"has 1 dims, the argument has shape \[24, 9\]"),
    (lambda d: d.update(version=99), r"version 99 is newer than this autoshard reads \(2\); upgrade autoshard"),
    (lambda d: d.update(format="pickle"), r"not an autoshard plan file"),
])
def test_hand_edited_invalid_files_fail_naming_the_field(saved, edit, message):
    data = json.loads(saved.read_text())
    edit(data)
    saved.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match=message):
        load_plan(saved)


# ----------------------------------------------------------------------------- baseline layouts


def test_layout_helpers():
    sizes = {"x": 2, "y": 4}
    assert divisible_axes(24, ("x", "y"), sizes) == ("x", "y")
    assert divisible_axes(12, ("x", "y"), sizes) == ("y",)  # 4 devices beat 2; inner axes win ties
    assert divisible_axes(6, ("x", "y"), sizes) == ("x",)
    assert divisible_axes(3, ("x", "y"), sizes) == ()
    assert largest_dim_spec((96, 384), ("x", "y"), sizes) == Spec(((), ("x", "y")))
    assert largest_dim_spec((8, 12), ("x", "y"), sizes) == Spec((("x", "y"), ()))  # 12 takes 4, 8 takes all 8
    assert largest_dim_spec((12, 6), ("x", "y"), sizes) == Spec((("y",), ()))
    assert largest_dim_spec((), ("x", "y"), sizes) == Spec(())
    assert batch_spec((24, 17), ("x",), sizes) == Spec((("x",), ()))


def test_node_axes():
    one_node = make_logical_mesh(get_cluster("1x8-a100"), (2, 4))
    assert node_axes(one_node) == (("y",), ("x",))  # the last axis plays the node
    two_nodes = make_logical_mesh(get_cluster("2x8-a100"), (2, 8))
    assert node_axes(two_nodes) == (("y",), ("x",))
    assert node_axes(make_logical_mesh(get_cluster("2x8-a100"), (16,))) == ((), ("x",))


def test_megatron_roles_from_the_gpt_graph(gpt_tiny):
    graph = gpt_tiny[1]
    roles = megatron_roles(graph)
    assert roles.source == "graph"
    names = lambda idx: {re.sub(r"\[0\]\['blocks'\]\[(\d)\]", r"\1", p) for p in _paths(graph, idx)}  # noqa: E731
    assert names(roles.column) == {f"{n}['{m}']['{k}']['kernel']" for n in "01"
                                   for m, k in [("attn", "q"), ("attn", "k"), ("attn", "v"), ("mlp", "up")]}
    assert names(roles.row) == {f"{n}['{m}']['{k}']['kernel']" for n in "01"
                                for m, k in [("attn", "out"), ("mlp", "down")]}
    assert names(roles.bias) == {f"{n}['{m}']['{k}']['bias']" for n in "01"
                                 for m, k in [("attn", "q"), ("attn", "k"), ("attn", "v"), ("mlp", "up")]}
    assert set(roles.column.values()) == {1} and set(roles.row.values()) == {0}  # output / input features
    by_names = roles_from_names(graph)
    assert by_names.source == "names" and by_names.column == roles.column and by_names.row == roles.row


def test_megatron_roles_moe_experts_and_mlp_alternation():
    work = moe.workload("small", abstract=True)
    graph = trace(work.step, *work.args)
    roles = megatron_roles(graph)
    experts = {graph.values[graph.inputs[i]].path.split("['moe']")[-1]: d
               for i, d in {**roles.column, **roles.row}.items() if "moe" in graph.values[graph.inputs[i]].path}
    assert experts == {"['w_in']": 2, "['w_out']": 1}  # [E, d, ff] split on ff, [E, ff, d] split on ff
    work = mlp.workload("small", abstract=True)
    graph = trace(work.step, *work.args)
    roles = megatron_roles(graph)
    order = sorted((graph.values[graph.inputs[i]].path, kind)
                   for kind, part in (("col", roles.column), ("row", roles.row)) for i in part)
    assert [kind for _, kind in order] == ["col", "row"] * (len(order) // 2)


@pytest.mark.parametrize("kind", list(Baseline))
def test_baseline_pins(gpt_tiny, kind):
    graph = gpt_tiny[1]
    mesh = make_logical_mesh(get_cluster("2x8-a100"), (2, 8))
    pins = baseline_pins(graph, mesh, kind)
    at = {graph.values[v].path: pins[i] for i, v in enumerate(graph.inputs)}
    tokens, q = at["[2]['tokens']"], at["[0]['blocks'][0]['attn']['q']['kernel']"]
    q_mu, ln = at["[1][0].mu['blocks'][0]['attn']['q']['kernel']"], at["[0]['ln_final']['scale']"]
    expected = {  # tokens [24, 9]: 16 devices do not divide 24, (y=8) does
        Baseline.DP: ("S(y)R", "RR", "RR", "R"),
        Baseline.FSDP: ("S(y)R", "S(x,y)R", "S(x,y)R", "S(x,y)"),
        Baseline.ZERO2: ("S(y)R", "RR", "S(x,y)R", "R"),
        Baseline.HSDP: ("S(y)R", "S(y)R", "S(y)R", "S(y)"),  # x crosses the two nodes
        Baseline.TP: ("RR", "RS(x,y)", "RS(x,y)", "R"),
        Baseline.DP_TP: ("S(x)R", "RS(y)", "RS(y)", "R"),
    }[kind]
    assert (str(tokens), str(q), str(q_mu), str(ln)) == expected


def test_batch_probe_rescales_the_traced_graph_exactly(gpt_tiny):
    work, graph = gpt_tiny
    probe = BatchProbe(work.step, work.args, graph)
    rescaled, traced = probe.graph(72), trace(work.step, *args_at_batch(graph, work.args, 72))
    assert probe._per_example is not None  # learned from the traces at 24 and 48: no trace at 72
    assert {v: x.shape for v, x in rescaled.values.items()} == {v: x.shape for v, x in traced.values.items()}


def test_memory_model_ceiling():
    # two points: 10 MB + 1 MB/example, and 30 MB + 0.5 MB/example; budget 100 MB
    model = MemoryModel(np.array([10e6, 30e6]), np.array([1e6, 0.5e6]), batch_multiple=8)
    assert model.peak_bytes(40) == 50e6
    assert model.ceiling(100e6) == 88  # min(90, 140) = 90 -> a multiple of 8
    assert model.ceiling(5e6) == 0
    assert MemoryModel(np.array([1.0]), np.array([0.0]), 1).ceiling(10.0) is None


# ----------------------------------------------------------------------------- validate and export


def _dp_plan(graph, **kwargs):
    mesh = make_logical_mesh(get_cluster("1x8-a100"), (2, 4))
    return hand_plan(graph, baseline_pins(graph, mesh, Baseline.DP), **kwargs)


def test_validate_catches_a_mesh_that_does_not_divide_a_sharded_dim(gpt_tiny):
    graph = gpt_tiny[1]
    assert not [f for f in validate_plan(_dp_plan(graph), cluster=get_cluster("1x8-a100")) if f.failed]
    tokens = next(i for i, v in enumerate(graph.inputs) if graph.values[v].role == Role.BATCH)
    wide = hand_plan(graph, {tokens: Spec((("x", "y"), ()))}, mesh_shape=(2, 8), cluster="2x8-a100")
    findings = validate_plan(wide, cluster=get_cluster("2x8-a100"), mesh_shape=(2, 8))
    [bad] = [f for f in findings if f.failed]
    assert bad.check == "divisibility"
    assert "argument [2]['tokens']: dim 0 of size 24 is split over x,y (16 devices), which does not divide 24" \
        in bad.message
    assert "the 16 devices of x,y must divide 24" in bad.fix and "autoshard plan TARGET --mesh 2x8" in bad.fix


def test_validate_catches_a_plan_over_the_memory_budget(gpt_tiny):
    plan = _dp_plan(gpt_tiny[1], peak_bytes=3 * 2**30)
    small = dataclasses.replace(get_cluster("1x8-a100"), memory_per_device_bytes=2 * 2**30, name="small-gpus")
    [bad] = [f for f in validate_plan(plan, cluster=small) if f.failed]
    assert bad.check == "memory"
    assert "peak 3 GiB per device" in bad.message and "exceeds the 2 GiB budget (small-gpus's device memory) by 1 GiB" \
        in bad.message
    assert "re-plan with --memory-budget 2GiB" in bad.fix and "at least 3 GiB" in bad.fix
    too_few = dataclasses.replace(small, devices_per_node=4, name="four")
    assert any(f.check == "devices" and f.failed and "needs 8 devices; cluster four has 4" in f.message
               for f in validate_plan(plan, cluster=too_few))


def test_validate_cli_exit_status_and_message(gpt_tiny, tmp_path, capsys):
    path = tmp_path / "plan.json"
    _dp_plan(gpt_tiny[1]).save(path)
    assert cli.main(["validate", str(path), "--cluster", "1x8-a100"]) == 0
    assert cli.main(["validate", str(path), "--cluster", "2x8-a100", "--mesh", "2x8"]) == 1
    out = capsys.readouterr().out
    assert "autoshard.apply refuses" in out and "1 check(s) failed: mesh" in out
    assert cli.main(["validate", str(path), "--memory-budget", "0.001GiB"]) == 1
    assert "exceeds the 1.02 MiB budget" in capsys.readouterr().out


def test_export_flax_rules_match_linen_logical_sharding(gpt_tiny, tmp_path):
    import flax.linen as nn

    work, graph = gpt_tiny
    mesh = make_logical_mesh(get_cluster("1x8-a100"), (2, 4))
    plan = hand_plan(graph, baseline_pins(graph, mesh, Baseline.DP_TP))
    data = json.loads(json.dumps(flax_rules(plan)))
    assert data["params"]["['blocks'][1]['attn']['q']['kernel']"] == [None, "y"]
    assert data["logical_axes"]["['blocks'][1]['attn']['q']['kernel']"] == ["blocks.#.attn.q.kernel/0",
                                                                             "blocks.#.attn.q.kernel/1"]
    assert ["blocks.#.attn.q.kernel/1", "y"] in data["rules"]
    assert data["opt_state"]["[0].mu['blocks'][1]['attn']['q']['kernel']"] == [None, "y"]
    module: dict = {}
    exec(flax_rules_python(data), module)  # noqa: S102 - the module we generate must import and run
    jmesh = _mesh()
    direct = jax.tree.leaves(module["param_shardings"](work.args[0], jmesh))
    logical = jax.tree.leaves(nn.logical_to_mesh_sharding(module["logical_specs"](work.args[0]), jmesh,
                                                          module["RULES"]))
    assert [s.spec for s in direct] == [s.spec for s in logical]
    assert len(direct) == len(plan.param_specs())
    path = tmp_path / "plan.json"
    plan.save(path)
    assert cli.main(["export", str(path), "--format", "flax-rules", "--out", str(tmp_path / "rules.json")]) == 0
    assert json.loads((tmp_path / "rules.json").read_text())["format"] == "autoshard-flax-rules"


# ----------------------------------------------------------------------------- reports


def test_pipeline_schedule_hand_worked():
    # 2 stages, 2 microbatches, forward 1, backward 2: (S - 1 + B) * (f + b) = 9 for both schedules
    for schedule in ("1f1b", "gpipe"):
        slots = pipeline_schedule([1.0, 1.0], [2.0, 2.0], 2, schedule)
        assert max(s.end_s for s in slots) == 9.0 and len(slots) == 8
    one_f_one_b = [(s.kind, s.microbatch, s.start_s)
                   for s in pipeline_schedule([1.0, 1.0], [2.0, 2.0], 2) if s.stage == 0]
    assert one_f_one_b == [("F", 0, 0.0), ("F", 1, 1.0), ("B", 0, 4.0), ("B", 1, 7.0)]


def test_explain_cli_tables_and_pictures(gpt_tiny, tmp_path, capsys):
    stages = _pipeline_stages(gpt_tiny[1])
    row = {"peak_memory_bytes": 1e6, "batch_ceiling": 4096, "speedup": 1.0}
    baselines = {"autoshard": {**row, "step_s": 1e-3, "fits": True}, "DP": {**row, "step_s": 2e-3, "fits": True},
                 "FSDP/ZeRO-3": {**row, "step_s": 1.5e-3, "fits": False, "batch_ceiling": None}}
    plan = dataclasses.replace(_dp_plan(gpt_tiny[1], stages=stages), num_microbatches=4, schedule="1f1b",
                               baselines=baselines)
    assert "best classic      FSDP/ZeRO-3; fallback (best classic that fits): DP" in str(plan)
    path = tmp_path / "plan.json"
    plan.save(path)
    html, png = tmp_path / "report.html", tmp_path / "report.png"
    assert cli.main(["explain", str(path), "--op", "3", "--html", str(html), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    # a pipeline plan's parameters as each stage keeps them (these stages hold the first two arrays)
    assert "parameters by path and pipeline stage" in out and "blocks.#.attn.k.kernel" in out
    assert "modeled step" in out and "why this plan" in out and "legend" in out
    assert "op 3 has no recorded alternatives" in out
    assert "best classic: FSDP/ZeRO-3; fallback (best classic that fits): DP" in out
    page = html.read_text()
    assert png.read_bytes()[:4] == b"\x89PNG" and page.count("data:image/png;base64") == 4
    for caption in ("comparison", "tensor layouts", "memory per device", "pipeline schedule"):
        assert f'alt="{caption}"' in page
    assert 'alt="time per layer"' not in page  # a hand-built plan has no per-layer times
    assert "modeled step" in html.read_text() and "blocks.#.attn.k.kernel" in html.read_text()


def test_verify_flags_figures_off_by_more_than_ten_percent():
    from autoshard.compiler.verify import FidelityReport, FidelityRow
    from autoshard.report import fidelity_lines, fidelity_table

    report = FidelityReport((FidelityRow("all-gather bytes", 115e3, 100e3, 0.10),
                             FidelityRow("all-reduce bytes", 1500.0, 1000.0, 0.10),  # 50% but only 500 bytes
                             FidelityRow("peak memory bytes", 1.09e6, 1e6, 0.15),
                             FidelityRow("flops per device", 1.06e9, 1e9, 0.05, immaterial_bytes=0.0),  # 6% > 5%
                             FidelityRow("hbm bytes per device", 1.15e9, 1e9, 0.20)), summary=None)  # 15% < 20%
    assert [line.flagged for line in fidelity_lines(report)] == [True, False, False, True, False]
    console = Console(record=True, width=120, file=io.StringIO())
    console.print(fidelity_table(report, "plan 'p' predicted vs compiled"))
    text = console.export_text()
    assert "all-gather" in text and "OFF" in text and "15.0%" in text
    assert "1.06e+09 FLOP" in text and "hbm bytes per device" in text


def test_data_parallel_baselines_keep_the_batch_split_in_every_op(gpt_tiny):
    from autoshard.compiler.baselines import plan_baseline
    from autoshard.passes.intra_op import IntraOpOptions

    work, graph = gpt_tiny
    batch_dims = BatchProbe(work.step, work.args, graph).batch_dims()
    planned = plan_baseline(graph, Baseline.DP, mesh=(2, 4), cluster="1x8-a100", explain=False,
                            options=IntraOpOptions(time_limit_s=1.0), batch_dims=batch_dims)
    specs = planned.result.value_specs
    produced = {v for op in graph.ops for v in op.outputs}
    split = [v for v in produced if batch_dims.get(v) and {"x", "y"} <= {a for d in batch_dims[v]
                                                                      for a in specs[v].dims[d]}]
    unsplit = [v for v in produced if batch_dims.get(v) and v not in split]
    assert len(unsplit) < 0.02 * len(split)  # the few others follow unsplit producers (a broadcast constant)
    assert planned.plan.ledger.collective_bytes.get("all-reduce", 0) > 0  # the gradient all-reduce
