"""The plan's predicted collectives agree with the HLO XLA compiles for it (JAX-NOTES: reading HLO)."""
from __future__ import annotations

import importlib

import pytest

import autoshard
from autoshard.compiler.verify import verify_compiled
from autoshard.passes.intra_op import IntraOpOptions

CASES = [("mlp", (2, 4)), ("gpt", (2, 4)), ("gpt", (1, 8)), ("moe", (2, 4))]


@pytest.mark.parametrize("model, mesh", CASES, ids=[f"{m}-{'x'.join(map(str, s))}" for m, s in CASES])
def test_predicted_collectives_match_compiled_hlo(model, mesh, devices8):
    work = importlib.import_module(f"examples.{model}").workload("small", abstract=True)
    step = autoshard.autoshard(work.step, mesh=mesh, options=IntraOpOptions(time_limit_s=1.0))
    compiled = step.lower(*work.args).compile()
    report = verify_compiled(step.plan, compiled)
    total = report.row("all collective bytes")
    assert total.compiled > 0, "the plan should communicate"
    assert total.rel_error <= 0.10, str(report)
    for kind in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all"):
        rows = [r for r in report.rows if r.what == f"{kind} bytes"]
        assert all(r.ok for r in rows), str(report)
