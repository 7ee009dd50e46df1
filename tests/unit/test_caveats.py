"""What a plan does not know, said with it: pay-off, invariants, missing evidence, counter-signals.

Plans are hand-built (tests/plan_helpers.py) with a recorded comparison, so every figure the caveats quote can
be worked out here: the pay-off steps, the gain over the best classic plan that fits, the safer choice. The
same plan is shown through ``str(plan)``, ``autoshard explain`` and the HTML page.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
from plan_helpers import hand_plan

from autoshard import cli
from autoshard.html_report import report_html
from autoshard.ir.trace import trace
from autoshard.meshes.cluster import LinkLevel
from autoshard.plans.breakdown import LayerTime
from autoshard.plans.caveats import MODEL_ERROR, plan_caveats
from autoshard.plans.plan import load_plan
from examples import gpt

ROW = {"peak_memory_bytes": 1e6, "batch_ceiling": 4096, "speedup": 1.0}


@pytest.fixture(scope="module")
def graph():
    work = gpt.workload("tiny", abstract=True)
    return trace(work.step, *work.args)


def _plan(graph, *, dp_s: float, fsdp_s: float = 0.5e-3, fsdp_fits: bool = False, **fields):
    plan = hand_plan(graph)  # modeled step 1.3 ms; planning 1.5 s
    baselines = {"autoshard": {**ROW, "step_s": plan.step_s, "fits": True},
                 "DP": {**ROW, "step_s": dp_s, "fits": True},
                 "FSDP/ZeRO-3": {**ROW, "step_s": fsdp_s, "fits": fsdp_fits}}
    return dataclasses.replace(plan, baselines=baselines, **fields)


def test_a_gain_below_the_model_error_names_the_classic_plan_as_the_safer_choice(graph, tmp_path, capsys):
    # DP is 3% slower than autoshard; FSDP is faster still but does not fit, so DP is the one to compare with
    plan = _plan(graph, dp_s=1.03 * 1.3e-3)
    caveats = plan_caveats(plan)
    assert caveats.safer_choice == "DP"
    expected = ("the modeled gain over DP is 3.0%, below the model's error (5%): DP, the classic plan, is the "
                "safer choice")
    assert expected in caveats.counter_signals
    assert expected in str(plan)
    path = tmp_path / "plan.json"
    plan.save(path)
    assert cli.main(["explain", str(path), "--html", str(tmp_path / "report.html")]) == 0
    printed = capsys.readouterr().out
    assert "below the model's error" in printed and "safer choice: DP, the classic plan" in printed
    page = (tmp_path / "report.html").read_text()
    assert "Safer choice: DP, the classic plan" in page and "below the model&#x27;s error (5%)" in page


def test_a_gain_above_the_model_error_is_no_counter_signal(graph):
    plan = _plan(graph, dp_s=1.3e-3 * (1 + 4 * MODEL_ERROR))
    caveats = plan_caveats(plan)
    assert caveats.safer_choice is None and caveats.counter_signals == ()
    assert "counter-signals:  none found" in str(plan)
    assert "Safer choice" not in report_html(plan)


def test_planning_pays_off_after_the_planning_seconds_over_the_saving(graph):
    plan = _plan(graph, dp_s=2.3e-3)  # saves 1 ms per step over DP; planning took 1.5 s
    caveats = plan_caveats(plan)
    assert caveats.payoff_steps == pytest.approx(1500)
    assert "it pays off after 1,500 steps (1 ms modeled saving per step over DP" in caveats.planning
    never = plan_caveats(_plan(graph, dp_s=1.3e-3))
    assert never.payoff_steps is None and "it never pays off" in never.planning
    alone = plan_caveats(hand_plan(graph))
    assert "its pay-off is unknown" in alone.planning
    assert any("not compared with the classic strategies" in m for m in alone.missing_evidence)


def test_missing_evidence_says_where_the_cluster_numbers_come_from(graph):
    preset = plan_caveats(hand_plan(graph))
    assert preset.missing_evidence[0].startswith("cluster numbers are the preset '1x8-a100' (built-in figures)")
    plan = hand_plan(graph)
    measured = dataclasses.replace(plan, cluster=dataclasses.replace(
        plan.cluster, name="lab-cluster", intra_node=LinkLevel("nvlink", 2.1e11, 4e-6)))
    assert plan_caveats(measured).missing_evidence[0].startswith("cluster numbers come from the ClusterSpec "
                                                                "'lab-cluster'")
    assert any("'optimal' means optimal within the search space" in m for m in preset.missing_evidence)


def test_a_plan_that_crosses_an_unmeasured_link_says_so(graph):
    plan = hand_plan(graph)  # (2, 4) on one node of 1x8-a100: the intra-node link only
    blind = LinkLevel("not measured (profiled on one device)", 1e9, 1e-5, unmeasured=True)
    profiled = dataclasses.replace(plan, cluster=dataclasses.replace(plan.cluster, name="one-gpu", intra_node=blind,
                                                                     inter_node=blind))
    said = [m for m in plan_caveats(profiled).missing_evidence if "link was not measured" in m]
    assert said == ["the intra-node link was not measured in ClusterSpec 'one-gpu' (profiled on fewer devices "
                    "than the plan spans): its collectives are priced with placeholder numbers; `autoshard "
                    "profile` on the devices the plan spans measures them, or `--links PRESET` takes a preset's"]
    assert said[0] in str(profiled)
    assert not [m for m in plan_caveats(plan).missing_evidence if "link was not measured" in m]
    alone = dataclasses.replace(profiled, mesh_shape=(1, 1))  # one device crosses no link
    assert not [m for m in plan_caveats(alone).missing_evidence if "link was not measured" in m]


def test_invariants_say_whether_numerics_were_checked(graph):
    plan = hand_plan(graph)
    assert "the global batch (24) and the optimizer update" in plan_caveats(plan).invariants[0]
    assert plan_caveats(plan).invariants[1].startswith("no numerics check against one device")
    checked = dataclasses.replace(plan, checks={"numerics": "matched one device: 2 steps"})
    assert plan_caveats(checked).invariants[1] == "numerics against one device: matched one device: 2 steps"


def test_other_counter_signals(graph):
    plan = dataclasses.replace(hand_plan(graph, peak_bytes=3e6, budget_bytes=1e6),
                               solver=dataclasses.replace(hand_plan(graph).solver, status="feasible", gap=0.02),
                               alternatives={"2x4": 1.3e-3, "4x2": 1.33e-3, "8x1": 2e-3})
    signals = plan_caveats(plan).counter_signals
    assert any(s.startswith("the modeled peak 2.86 MiB per device exceeds the budget") for s in signals)
    assert any("did not prove optimality (status 'feasible', gap 2.0%)" in s for s in signals)
    assert any("other meshes model within 5% of the chosen 2x4: 4x2 (+2.3%)" in s for s in signals)


def test_checks_and_layer_times_round_trip_and_older_files_load(graph, tmp_path):
    times = (LayerTime("blocks.0", 1e-4, 2e-4, 3e-5, 0.0), LayerTime("lm_head", 5e-5, 0.0, 0.0, 1e-6))
    plan = dataclasses.replace(hand_plan(graph), checks={"numerics": "matched"}, layer_times=times)
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = load_plan(path)
    assert loaded.checks == {"numerics": "matched"} and loaded.layer_times == times
    data = json.loads(path.read_text())
    del data["checks"], data["layer_times"]  # a file written before these fields existed
    path.write_text(json.dumps(data))
    old = load_plan(path)
    assert old.checks == {} and old.layer_times == ()
