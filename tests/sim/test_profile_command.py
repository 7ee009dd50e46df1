"""``autoshard profile`` on 8 simulated devices (under two minutes, a ClusterSpec that plans) and on one."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import autoshard
from autoshard.meshes.cluster import PRESETS, ClusterSpec

ROOT = Path(__file__).resolve().parents[2]


def test_profile_writes_a_cluster_spec_that_loads_and_plans(tmp_path):
    out = tmp_path / "cluster.json"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "autoshard.cli", "profile", "--out", str(out), "--repeats", "3"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - start
    assert done.returncode == 0, done.stderr[-2000:]
    assert seconds < 120, f"profile took {seconds:.0f} s"
    for line in ("matmul float32", "memory bandwidth", "all-reduce", "all-gather", "reduce-scatter", "all-to-all"):
        assert line in done.stdout, done.stdout
    assert "R^2" in done.stdout  # each fit is printed with its quality
    spec = ClusterSpec.load(out)
    assert spec.num_devices == 8 and spec.intra_node.bandwidth_bytes_per_s > 0
    from examples import mlp

    work = mlp.workload("tiny", abstract=True)
    plan = autoshard.plan(work.step, *work.args, mesh=(2, 4), cluster=str(out), num_stages=1)
    assert plan.cluster.name == spec.name


def _profile_one_device(out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "autoshard.cli", "profile", "--out", str(out), "--repeats", "2",
                           *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_profile_on_one_device_writes_unmeasured_links_that_plans_say_so(tmp_path):
    out = tmp_path / "one.json"
    done = _profile_one_device(out)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert "intra-node not measured; inter-node not measured" in done.stdout, done.stdout
    assert "sizes timed: 256" in done.stdout  # the matmul climb is reported
    spec = ClusterSpec.load(out)
    assert spec.num_devices == 1 and spec.intra_node.unmeasured and spec.inter_node.unmeasured
    assert spec.peak_flops_per_s["bfloat16"] > 0 and spec.memory_bandwidth_bytes_per_s > 0
    from examples import mlp

    work = mlp.workload("tiny", abstract=True)
    plan = autoshard.plan(work.step, *work.args, mesh=(2, 4), cluster=str(out), num_stages=1)
    assert "the intra-node link was not measured" in str(plan)


def test_profile_on_one_device_takes_a_presets_links(tmp_path):
    out = tmp_path / "one.json"
    done = _profile_one_device(out, "--links", "1x8-h100")
    assert done.returncode == 0, done.stderr[-2000:]
    spec, preset = ClusterSpec.load(out), PRESETS["1x8-h100"]
    assert not spec.intra_node.unmeasured and spec.intra_node.name == "nvlink (preset 1x8-h100)"
    assert spec.intra_node.bandwidth_bytes_per_s == preset.intra_node.bandwidth_bytes_per_s
    assert spec.inter_node.latency_s == preset.inter_node.latency_s
    wrong = _profile_one_device(out, "--links", "1x8-h1000")
    assert wrong.returncode != 0 and "did you mean '1x8-h100'" in wrong.stderr + wrong.stdout
    assert "Traceback" not in wrong.stderr
