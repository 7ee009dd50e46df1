"""A launch bundle runs its plan in 2 local processes and matches the step on one device.

The plan is the FSDP/ZeRO-3 baseline of GPT-tiny on a (2, 4) mesh of cpu-8: parameters, optimizer state and
the batch are split over both axes, so the run's all-gathers and reduce-scatters cross the process boundary
(axis x). The bundle is written by ``autoshard export --format launch`` and started with its own ``run.sh
--local-processes 2``; the one-device reference is computed here, with ``jax.jit`` of the unsharded step on
the same batches.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from autoshard import bundle, cli
from autoshard.compiler.baselines import plan_baseline
from autoshard.ir.trace import trace
from autoshard.passes.classic import Baseline
from autoshard.passes.intra_op import IntraOpOptions
from autoshard.plans.plan import load_plan
from examples import gpt

ROOT = Path(__file__).resolve().parents[2]
GPT = str(ROOT / "examples" / "gpt.py")
STEPS = 2


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory) -> Path:
    work = gpt.workload("tiny", abstract=True)
    planned = plan_baseline(trace(work.step, *work.args), Baseline.FSDP, mesh=(2, 4), cluster="cpu-8", explain=False,
                            options=IntraOpOptions(time_limit_s=2.0))
    plan = dataclasses.replace(planned.plan, origin={"target": GPT, "config": "tiny"})
    assert plan.input_specs["[2]['tokens']"].dims[0] == ("x", "y")  # the batch is split across the processes
    assert any("x" in spec.used_axes for spec in plan.param_specs().values())
    folder = tmp_path_factory.mktemp("bundle")
    plan.save(folder / "made.json")
    assert cli.main(["export", str(folder / "made.json"), "--format", "launch", "--out", str(folder / "b")]) == 0
    return folder / "b"


def _one_device_losses(steps: int) -> list[float]:
    work = gpt.workload("tiny", abstract=True)
    device = jax.devices()[0]
    with jax.default_device(device):
        params, opt_state, _ = jax.jit(work.init)(0)
        step = jax.jit(work.step)
        losses = []
        for i in range(steps):
            params, opt_state, loss = step(params, opt_state, jax.jit(lambda s: work.init(s)[2])(i))
            losses.append(float(loss))
    return losses


def test_bundle_runs_two_local_processes_like_one_device(bundle_dir, tmp_path):
    env = {**os.environ, "PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    out = tmp_path / "run"
    done = subprocess.run(["bash", str(bundle_dir / "run.sh"), "--local-processes", "2", "--steps", str(STEPS),
                           "--check-numerics", "--out", str(out)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[p0] 2 process(es) x 4 devices (autoshard)" in done.stdout
    digests = {line.split()[0]: line.split()[-1] for line in done.stdout.splitlines() if "runs plan sha256" in line}
    assert set(digests) == {"[p0]", "[p1]"} and len(set(digests.values())) == 1
    result = json.loads((out / "losses.json").read_text())
    assert result["processes"] == 2 and result["devices_per_process"] == 4
    reference = _one_device_losses(STEPS)
    np.testing.assert_allclose(result["losses"], reference, rtol=1e-5)
    assert result["losses"][1] < result["losses"][0]  # it trains
    checked = load_plan(out / "plan.json").checks["numerics"]
    assert checked.startswith("matched one device: 2 steps") and "2 processes x 4 devices" in checked


def test_bundle_refuses_a_step_that_is_not_the_planned_one(bundle_dir, tmp_path, capsys):
    # the same module at another config: other shapes, so the signature check refuses before anything runs
    code = bundle.main([str(bundle_dir), "--steps", "1", "--config", "small"])
    assert code == 2
    err = capsys.readouterr().err
    assert "the plan does not match this train step" in err and "float32[48]" in err and "float32[96]" in err
