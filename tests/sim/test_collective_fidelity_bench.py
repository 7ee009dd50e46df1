"""benchmarks/collective_fidelity.py end to end on a tiny cell (it compiles, so it lives in tests/sim)."""
from __future__ import annotations

from benchmarks import collective_fidelity


def test_collective_fidelity_prices_a_compiled_plan_against_its_prediction(devices8):
    """Planned, compiled, its HLO collectives priced on the cell's cluster: predicted and compiled figures are
    both there and the table says whether they agree."""
    row = collective_fidelity.measure("gpt:tiny:1x8-a100:2x4", time_limit_s=60.0)
    assert row.compiled_step_s > 0 and row.predicted_step_s > 0
    assert (row.ratio is None) == (row.predicted_comm_s <= 0 and row.compiled_comm_s <= 0)
    table = collective_fidelity.markdown([row], "0.0")
    assert "gpt:tiny:1x8-a100:2x4" in table and ("| yes |" in table or "| NO |" in table)
