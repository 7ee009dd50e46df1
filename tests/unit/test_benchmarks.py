"""A smoke run of the benchmark runner's pieces on the tiny MLP and GPT, so benchmarks/ does not rot (< 60 s).

The fidelity compile and the full default set are left to ``python -m benchmarks.run``.
"""
from __future__ import annotations

import math

import pytest

from autoshard.passes.intra_op import IntraOpOptions
from benchmarks import planning_scaling, run
from benchmarks.machine import describe
from benchmarks.quality import Cell, WorkloadCache, geomean, run_cell
from benchmarks.tables import quality_table, render_markdown, render_rich
from benchmarks.targets import evaluate

FAST = IntraOpOptions(time_limit_s=0.2)


def test_power_law_fit_recovers_the_exponent():
    layers = [2, 6, 12, 24, 48, 96]
    fit = planning_scaling.fit_power_law(layers, [0.5 * x**1.3 for x in layers])
    assert fit is not None
    assert fit.exponent == pytest.approx(1.3)
    assert fit.coefficient == pytest.approx(0.5)
    assert fit.r2 == pytest.approx(1.0)
    assert planning_scaling.fit_power_law([4], [1.0]) is None


def test_geomean_ignores_missing_values():
    assert geomean([2.0, 8.0, None]) == pytest.approx(4.0)
    assert geomean([]) is None


def test_default_set_covers_the_issue():
    cells = run.default_cells()
    gpt_sizes = {c.config for c in cells if c.model == "gpt"}
    assert {"small", "medium", "large", "xl"} <= gpt_sizes
    assert {c.cluster for c in cells} == {"1x8-a100", "2x8-a100", "4x8-h100"}
    assert any(c.model == "moe" for c in cells) and any(c.model == "convnet" for c in cells)
    assert all(c.cluster == "1x8-a100" for c in cells if c.fidelity)


def test_tiny_cell_scaling_and_report():
    result = run_cell(Cell("mlp", "tiny", "1x8-a100"), WorkloadCache(), FAST)
    assert result.error is None
    assert result.autoshard is not None and result.autoshard.fits
    assert {b.name for b in result.baselines} >= {"DP", "FSDP/ZeRO-3", "Megatron TP", "DP x TP"}
    assert result.speedup is not None and result.speedup >= 1.0 - 1e-9  # hinted with the best baseline
    assert 0 < result.bound_fraction <= 1.0
    assert result.ilp is not None and result.ilp.classes <= result.ilp.nodes

    points = planning_scaling.run([2], meshes=(("1x8-a100", (2, 4)),), options=FAST, base_config="tiny")
    assert len(points) == 1 and points[0].error is None
    assert points[0].total_s > 0 and points[0].total_cpu_s > 0 and math.isfinite(points[0].other_s)

    targets = evaluate([result], points)
    assert [t.met for t in targets][0] is True
    render_rich(quality_table([result]))
    settings = run.RunSettings(0.2, 0.2, 1, 1.0, "mean 1.0", 1.0)
    text = run.markdown(describe(["run.py", "--quick"]), settings, [result], points, targets)
    for heading in ("## Run", "## Targets", "## Plan quality", "## Planning time against depth", "## Details"):
        assert heading in text
    assert render_markdown(quality_table([result])).count("\n") == 4  # title, blank, header, rule, one row
    assert "python -m benchmarks.run --quick" in text


def test_hotspots_name_autoshard_functions():
    spots = planning_scaling.hotspots(2, "1x8-a100", (2, 4), FAST, base_config="tiny", top=4)
    assert 0 < len(spots) <= 4
    assert all(h.function.startswith("autoshard/") and 0 < h.share <= 1 for h in spots)
    assert [h.cumulative_s for h in spots] == sorted((h.cumulative_s for h in spots), reverse=True)
