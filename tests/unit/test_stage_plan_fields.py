"""The per-stage intra-op fields of a pipeline plan file: optimizer-state layouts, per-equation specs and
predicted collectives and train-graph pins round-trip; a file written before them still loads (the fields come back empty, and
``runtime/applied_pipeline.stage_layouts`` then rebuilds the state layouts by rule); a bad spec in them fails
naming the field."""
from __future__ import annotations

import dataclasses
import json

import pytest
from plan_helpers import hand_plan

from autoshard.ir.graph import Role
from autoshard.ir.spec import Spec
from autoshard.ir.trace import trace
from autoshard.plans.plan import load_plan
from autoshard.plans.planfile import PlanFileError
from autoshard.plans.stage_plan import PipelineStage, PipelinePlan, StageMemory
from autoshard.plans.annotations import Annotations, TrainPins
from examples import gpt


TRAIN_PINS = TrainPins("layer-class", 5, Annotations(
    input_specs=(Spec((("x",), ())), Spec.replicated(1)), output_specs=(Spec((("x", "y"), ())),),
    op_out_specs={0: (Spec((("y",), ())),), 4: (Spec.replicated(2), Spec(((), ("x",))))},
    op_in_reshards={4: {0: (Spec.replicated(2), Spec((("y",), ())))}}, output_reshards={0: (Spec((("x",), ())),)}))


@pytest.fixture(scope="module")
def staged_plan():
    work = gpt.workload("tiny", abstract=True)
    graph = trace(work.step, *work.args)
    params = [graph.values[v].path for v in graph.inputs if graph.values[v].role == Role.PARAM]
    opt = [graph.values[v].path for v in graph.inputs if graph.values[v].role == Role.OPT_STATE]
    split = Spec((("x",), ()))
    stages = tuple(PipelineStage(
        index=s, first_layer=s, last_layer=s, submesh=(1, 4), device_indices=tuple(range(4 * s, 4 * s + 4)),
        mesh_shape=(2, 2), axis_names=("x", "y"), param_specs={p: split for p in params[:2]},
        batch_specs={"[2]['tokens']": Spec((("x",), ()))}, time_s=3e-3, compute_s=2e-3, sync_s=1e-4,
        transfer_out_s=0.0, memory=StageMemory(1e6, 1e6, 2e6, 3e6, 1), num_params=2,
        state_specs={**{p: split for p in params[:2]}, **{p: Spec((("x", "y"), ())) for p in opt[:1]}},
        op_out_specs={3: (split, None), 7: (Spec(((), ("y",))),)},
        op_in_reshards={7: {1: (Spec.replicated(2), Spec((("y",), ())))}},
        edge_pins={(3, 0, 1): ((Spec(((), ("x",))), split), (Spec.replicated(2),)),  # a path through S(-,x)
                   (7, 1, 0): ((Spec.replicated(2),), (split,))},
        collective_bytes={"forward": {"all-gather": 1024.0}, "backward": {"reduce-scatter": 2048.0}, "apply": {}},
        train_pins={s: TRAIN_PINS, s + 2: TRAIN_PINS})  # two layers of one class: its plan is stored once
        for s in range(2))
    summary = PipelinePlan(num_microbatches=2, schedule="1f1b", step_s=0.02, first_microbatch_latency_s=6e-3,
                              bottleneck_s=3e-3, bubble_fraction=0.2, layers=2, cost_model="intra-op",
                              intra_stage="per stage")
    return dataclasses.replace(hand_plan(graph), stages=stages, pipeline=summary, num_microbatches=2, schedule="1f1b")


def test_stage_intra_op_fields_round_trip(staged_plan, tmp_path):
    staged_plan.save(tmp_path / "plan.json")
    loaded = load_plan(tmp_path / "plan.json")
    assert loaded == staged_plan
    assert loaded.stages[0].op_out_specs[3] == (Spec((("x",), ())), None)
    assert loaded.stages[1].collective_bytes["backward"] == {"reduce-scatter": 2048.0}
    assert loaded.stages[0].edge_pins[(3, 0, 1)] == ((Spec(((), ("x",))), Spec((("x",), ()))), (Spec.replicated(2),))
    assert loaded.stages[1].train_pins == {1: TRAIN_PINS, 3: TRAIN_PINS}


def test_edge_pins_of_older_files_are_one_spec_a_side(staged_plan, tmp_path):
    """Files from before the pins held chains wrote one spec per side: each loads as a chain of one; a side
    without a spec fails naming the pin."""
    staged_plan.save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text())
    data["stages"][0]["edge_pins"] = {"3:0:1": [[["x"], []], [[], []]]}
    (tmp_path / "plan.json").write_text(json.dumps(data))
    assert load_plan(tmp_path / "plan.json").stages[0].edge_pins == {(3, 0, 1): ((Spec((("x",), ())),),
                                                                                 (Spec.replicated(2),))}
    data["stages"][0]["edge_pins"] = {"3:0:1": {"forward": [], "backward": [[[], []]]}}
    (tmp_path / "plan.json").write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match=r"edge_pins: expected .*each at least one spec.*'3:0:1'"):
        load_plan(tmp_path / "plan.json")


def test_train_pins_are_stored_once_per_layer_class(staged_plan, tmp_path):
    staged_plan.save(tmp_path / "plan.json")
    pins = json.loads((tmp_path / "plan.json").read_text())["stages"][0]["train_pins"]
    assert pins["layers"] == {"0": "layer-class", "2": "layer-class"} and list(pins["plans"]) == ["layer-class"]
    del pins["plans"]["layer-class"]
    data = json.loads((tmp_path / "plan.json").read_text())
    data["stages"][0]["train_pins"] = pins
    (tmp_path / "plan.json").write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match=r"stages\[0\]\.train_pins\.layers\[0\].*'layer-class'"):
        load_plan(tmp_path / "plan.json")


def test_files_without_the_fields_still_load(staged_plan, tmp_path):
    staged_plan.save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text())
    for stage in data["stages"]:
        for key in ("state_specs", "op_out_specs", "op_in_reshards", "edge_pins", "collective_bytes", "train_pins"):
            del stage[key]
    (tmp_path / "plan.json").write_text(json.dumps(data))
    loaded = load_plan(tmp_path / "plan.json")
    for stage in loaded.stages:
        assert stage.state_specs == {} and stage.op_out_specs == {} and stage.collective_bytes == {}
        assert stage.edge_pins == {} and stage.train_pins == {}
        assert stage.param_specs == staged_plan.stages[stage.index].param_specs


def test_a_bad_equation_spec_fails_naming_the_field(staged_plan, tmp_path):
    staged_plan.save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text())
    data["stages"][1]["op_out_specs"]["7"] = [[["tp"], []]]
    (tmp_path / "plan.json").write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match=r"stages\[1\]\.op_out_specs\[7\].*mesh axes \['tp'\]"):
        load_plan(tmp_path / "plan.json")
