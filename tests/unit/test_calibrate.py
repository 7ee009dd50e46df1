"""Fitting measured timings to the alpha-beta model (meshes/calibrate.py), on synthetic timings."""
from __future__ import annotations

import math

import numpy as np
import pytest

from autoshard.meshes.calibrate import cluster_from, collective_fit, fit_line, link_from
from autoshard.meshes.cluster import PRESETS, ClusterSpec, LinkLevel, get_cluster
from autoshard.meshes.cost import ring_all_gather_s, ring_all_reduce_s

SIZES = [4096 * 4 ** k for k in range(6)]
LINK = LinkLevel("synthetic", 50e9, 3e-6)


def _noisy(values, rel, seed=0):
    rng = np.random.default_rng(seed)
    return [v * (1 + rel * rng.uniform(-1, 1)) for v in values]


def test_a_line_is_recovered_with_its_quality():
    seconds = [7e-6 + b / 20e9 for b in SIZES]
    line = fit_line(SIZES, seconds)
    assert line.intercept_s == pytest.approx(7e-6, rel=1e-6)
    assert 1 / line.slope_s_per_byte == pytest.approx(20e9, rel=1e-6)
    assert line.r2 == pytest.approx(1.0) and line.worst_rel_residual < 1e-9
    rough = fit_line(SIZES, _noisy(seconds, 0.2))
    assert rough.r2 < 1.0 and rough.worst_rel_residual > 0.01  # the fit says how rough it was
    with pytest.raises(ValueError, match="two or more different sizes"):
        fit_line([1024, 1024], [1e-6, 2e-6])


def test_a_negative_intercept_is_refitted_through_zero():
    line = fit_line([1e3, 2e3, 3e3], [0.9e-6, 2.1e-6, 2.9e-6])
    assert line.intercept_s == 0.0 and line.slope_s_per_byte > 0


@pytest.mark.parametrize("kind, model", [("all-reduce", ring_all_reduce_s), ("all-gather", ring_all_gather_s)])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_parameters_come_back_from_ring_timings(kind, model, n):
    seconds = [model(b, n, LINK) for b in SIZES]
    fit = collective_fit(kind, "x", n, False, SIZES, seconds)
    assert fit.latency_s == pytest.approx(LINK.latency_s, rel=1e-6)
    assert fit.bandwidth_bytes_per_s == pytest.approx(LINK.bandwidth_bytes_per_s, rel=1e-6)
    noisy = collective_fit(kind, "x", n, False, SIZES, _noisy(seconds, 0.05, seed=n))
    assert noisy.bandwidth_bytes_per_s == pytest.approx(LINK.bandwidth_bytes_per_s, rel=0.2)


def test_a_cluster_spec_from_fits_loads_and_prices_like_its_links(tmp_path):
    inside = [collective_fit(k, "devices", 8, False, SIZES, [ring_all_gather_s(b, 8, LINK) * s for b in SIZES])
              for k, s in (("all-gather", 1), ("reduce-scatter", 1))]
    slow = LinkLevel("nic", 5e9, 20e-6)
    across = [collective_fit("all-reduce", "nodes", 2, True, SIZES, [ring_all_reduce_s(b, 2, slow) for b in SIZES])]
    spec = cluster_from("fitted", 2, 8, inside + across, {"float32": 1e12}, 2e12, 16 * 2**30)
    assert spec.intra_node.bandwidth_bytes_per_s == pytest.approx(50e9, rel=1e-6)
    assert spec.inter_node.bandwidth_bytes_per_s == pytest.approx(5e9, rel=1e-6)
    assert spec.inter_node.latency_s == pytest.approx(20e-6, rel=1e-6)
    path = tmp_path / "cluster.json"
    spec.save(path)
    assert ClusterSpec.load(path) == spec
    one_node = cluster_from("one", 1, 8, inside, {"float32": 1e12}, 2e12, 2**30)
    assert one_node.inter_node.bandwidth_bytes_per_s == one_node.intra_node.bandwidth_bytes_per_s
    assert one_node.inter_node.unmeasured and not one_node.intra_node.unmeasured
    with pytest.raises(ValueError, match="no collective was measured"):
        cluster_from("none", 1, 1, [], {"float32": 1e12}, 2e12, 2**30)
    assert math.isfinite(link_from(inside, "l").bandwidth_bytes_per_s)


def test_one_device_marks_its_links_unmeasured_or_takes_a_presets(tmp_path):
    alone = cluster_from("one-gpu", 1, 1, [], {"bfloat16": 9e14}, 4.8e12, 140 * 2**30, placeholder=PRESETS["1x8-h100"])
    assert alone.intra_node.unmeasured and alone.inter_node.unmeasured
    assert alone.intra_node.bandwidth_bytes_per_s == PRESETS["1x8-h100"].intra_node.bandwidth_bytes_per_s
    assert alone.unmeasured_links(1) == ()  # one device crosses nothing
    assert get_cluster(alone, num_devices=8).unmeasured_links(8) == ("intra-node",)  # resized, the mark stays
    path = tmp_path / "one.json"
    alone.save(path)
    assert ClusterSpec.load(path) == alone  # the mark survives the file
    preset = PRESETS["1x8-h100"]
    named = cluster_from("one-gpu", 1, 1, [], {"bfloat16": 9e14}, 4.8e12, 140 * 2**30,
                         links=(preset.intra_node, preset.inter_node))
    assert named.intra_node == preset.intra_node and named.unmeasured_links(16) == ()
