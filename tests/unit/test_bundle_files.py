"""Launch bundles without running them: what is written, what is refused, how a mesh spreads over processes.

tests/sim/test_launch_bundle.py runs a bundle in two processes.
"""
from __future__ import annotations

import dataclasses
import subprocess

import pytest
from plan_helpers import hand_plan

from autoshard import cli
from autoshard.bundle import write_bundle
from autoshard.errors import PlanningError
from autoshard.ir.trace import trace
from autoshard.plans.plan import load_plan
from autoshard.runtime.distributed import MultiProcessError, split_over_processes
from examples import gpt


@pytest.fixture(scope="module")
def plan():
    work = gpt.workload("tiny", abstract=True)
    return dataclasses.replace(hand_plan(trace(work.step, *work.args)),
                               origin={"target": "examples/gpt.py", "config": "tiny"})


def test_bundle_holds_the_plan_a_runnable_script_and_a_readme(plan, tmp_path):
    written = write_bundle(plan, tmp_path / "b")
    assert [p.name for p in written] == ["plan.json", "run.sh", "README.md"]
    assert load_plan(tmp_path / "b" / "plan.json").input_specs == plan.input_specs
    script = (tmp_path / "b" / "run.sh").read_text()
    assert "DEVICES=8" in script and "-m autoshard.cli launch" in script and "srun --ntasks-per-node=1" in script
    assert (tmp_path / "b" / "run.sh").stat().st_mode & 0o111
    readme = (tmp_path / "b" / "README.md").read_text()
    assert "./run.sh --local-processes 2" in readme and "What the plan does not know" in readme
    assert subprocess.run(["bash", "-n", str(tmp_path / "b" / "run.sh")]).returncode == 0


def test_run_sh_refuses_a_process_count_that_does_not_split_the_devices(plan, tmp_path):
    write_bundle(plan, tmp_path / "b")
    done = subprocess.run(["bash", str(tmp_path / "b" / "run.sh"), "--local-processes", "3"], capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 2 and "3 processes do not split the plan's 8 devices" in done.stderr


def test_pipeline_plans_and_plans_without_an_origin_are_refused(plan, tmp_path, capsys):
    staged = dataclasses.replace(plan, stages=({"name": "s0", "time_s": 1e-3},), num_microbatches=4,
                                 schedule="1f1b")
    with pytest.raises(MultiProcessError, match="pipeline plans do not run across processes"):
        write_bundle(staged, tmp_path / "p")
    with pytest.raises(PlanningError, match="does not record the step it was made from"):
        write_bundle(dataclasses.replace(plan, origin={}), tmp_path / "o")
    staged.save(tmp_path / "staged.json")
    assert cli.main(["export", str(tmp_path / "staged.json"), "--format", "launch", "--out", str(tmp_path / "x")]) == 2
    assert "pipeline plans do not run across processes" in capsys.readouterr().err


def test_a_mesh_spreads_over_processes_along_its_leading_axes():
    assert split_over_processes((2, 4), 2) == ((2, 1), (1, 4))
    assert split_over_processes((2, 4), 4) == ((2, 2), (1, 2))
    assert split_over_processes((4, 4), 8) == ((4, 2), (1, 2))
    assert split_over_processes((8,), 1) == ((1,), (8,))
    with pytest.raises(ValueError, match="cannot be spread over 3 processes"):
        split_over_processes((2, 4), 3)
