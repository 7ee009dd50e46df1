"""A benchmark cell with compiled arbitration (8 simulated devices): compiled prices for every strategy, the
contest, autoshard rated on them, fidelity read from the arbitration's own compile."""
from __future__ import annotations

import pytest

from autoshard.passes.intra_op import IntraOpOptions
from benchmarks.quality import Cell, WorkloadCache, run_cell
from benchmarks.tables import baselines_table, contest_table, quality_table, render_markdown
from benchmarks.targets import evaluate


def test_a_compiled_cell_rates_autoshard_on_compiled_prices():
    result = run_cell(Cell("mlp", "tiny", "1x8-a100", fidelity=True), WorkloadCache(),
                      IntraOpOptions(time_limit_s=1.0))
    assert result.error is None and result.autoshard is not None and result.autoshard.compiled is not None
    assert result.intra_op_s > 0  # the model's own solve, whichever contender arbitration returned
    assert all(b.compiled is not None for b in result.baselines)  # every classic strategy compiled here
    chosen = [c for c in result.contest if c.chosen]
    assert len(chosen) == 1 and chosen[0].compiled_s == pytest.approx(result.autoshard.compiled.step_s)
    assert len(result.contest) >= 1 + len(result.baselines)
    assert result.compiled_speedup is not None and result.compiled_speedup >= 1.0 - 1e-9
    assert result.fidelity is not None and result.fidelity.error is None and result.fidelity.rows
    minimum = evaluate([result], [])[0]
    assert minimum.met is True and "1 cells rated" in minimum.detail
    for table in (quality_table, contest_table, baselines_table):
        assert str(result.cell) in render_markdown(table([result])) or result.cell.workload in render_markdown(
            table([result]))
