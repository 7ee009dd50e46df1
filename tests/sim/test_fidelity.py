"""The plan's predicted collectives agree with the HLO XLA compiles for it (compiler/hlo.py reads it)."""
from __future__ import annotations

import pytest

from compiled_examples import planned_example

# one pytest-xdist worker for every test that reads compiled_examples.planned_example's shared plans
pytestmark = pytest.mark.xdist_group("planned_examples")

CASES = [("mlp", (2, 4)), ("gpt", (2, 4)), ("gpt", (1, 8)), ("moe", (2, 4))]


@pytest.mark.parametrize("model, mesh", CASES, ids=[f"{m}-{'x'.join(map(str, s))}" for m, s in CASES])
def test_predicted_collectives_match_compiled_hlo(model, mesh, devices8):
    # the plans of test_memory_fidelity.py and of the FLOP/HBM cases below (gpt-2x4, gpt-1x8, moe-2x4): one plan each
    report = planned_example(model, mesh, cluster="cpu-8", num_stages=1).report
    total = report.row("all collective bytes")
    assert total.compiled > 0, "the plan should communicate"
    assert total.rel_error <= 0.10, str(report)
    for kind in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all"):
        rows = [r for r in report.rows if r.what == f"{kind} bytes"]
        assert all(r.ok for r in rows), str(report)


COMPUTE_CASES = [(m, s) for m in ("gpt", "moe", "convnet") for s in ((2, 4), (1, 8), (8, 1))]


@pytest.mark.parametrize("model, mesh", COMPUTE_CASES, ids=[f"{m}-{'x'.join(map(str, s))}" for m, s in COMPUTE_CASES])
def test_predicted_flops_and_hbm_bytes_match_cost_analysis(model, mesh, devices8):
    """The ledger's per-device FLOPs (5%) and HBM bytes (20%) against the compiled program's cost_analysis().

    On cpu-8 (slow compute against its links) the plans shard the small models."""
    report = planned_example(model, mesh, cluster="cpu-8", num_stages=1).report  # moe-2x4: test_expert_parallel's
    flops, hbm = report.row("flops per device"), report.row("hbm bytes per device")
    assert flops.rel_error <= 0.05, str(report)
    assert hbm.rel_error <= 0.20, str(report)


def test_a_cheap_value_read_by_many_fusions_is_materialised_as_xla_does():
    """``a = x + y`` read by 20 reductions: XLA:CPU writes ``a`` once and the reductions read it, rather than
    recomputing it (reading x and y) in each; the model's bytes (one device, nothing split) are cost_analysis's."""
    import jax
    import jax.numpy as jnp

    from autoshard.ir.trace import trace
    from autoshard.meshes.cluster import PRESETS
    from autoshard.passes.hbm_traffic import graph_costs

    def fan(x, y, w):
        a = x + y
        return [jnp.sum(a * w[i]) for i in range(20)]

    args = (jnp.ones(1 << 16), jnp.ones(1 << 16), jnp.ones((20, 1)))
    cost = jax.jit(fan).lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    modeled = float(graph_costs(trace(fan, *args), PRESETS["1x8-a100"]).hbm_bytes.sum())
    assert modeled == pytest.approx(float(cost["bytes accessed"]), rel=0.05)
