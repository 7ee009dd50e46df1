"""``autoshard profile`` on the 8 simulated devices: under two minutes, a ClusterSpec that plans."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import autoshard
from autoshard.meshes.cluster import ClusterSpec

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
