"""benchmarks/pipeline_fidelity.py end to end on a one-node cell of 8 devices (it compiles each stage
executable, so it lives in tests/sim)."""
from __future__ import annotations

from benchmarks import pipeline_fidelity


def test_pipeline_fidelity_checks_every_stage_executable(devices8):
    """The best pipeline of the tiny GPT on cpu-8, every stage executable compiled and checked: every stage
    has rows, every figure is checked (the stages run their train graphs pinned), and they agree. The cell
    names its global batch (``@16``; the config's is 24), as the gpt-xl@8 cell does."""
    row = pipeline_fidelity.measure("gpt:tiny@16:cpu-8", time_limit_s=10.0)
    assert "B=" in row.pipeline and row.cell == "gpt:tiny@16:cpu-8"
    stages = row.pipeline.count("@")
    assert stages >= 2 and row.checked >= 3 * stages and row.unchecked == 0, row.report
    assert row.ok, row.report
    table = pipeline_fidelity.markdown([row], "0.0", 10.0)
    assert f"| {row.within}/{row.checked} |" in table and "## gpt:tiny@16:cpu-8" in table
    assert row.compiled_step_s > 0 and row.modeled_step_s > 0 and "pipeline step: compiled" in row.report
