"""The ledger's per-device peak memory against XLA:CPU's ``memory_analysis()`` for whole train steps.

``compiled.memory_analysis()`` reports argument + output − alias + temp bytes
per device; ``passes/liveness.py`` predicts the same figure from the plan
(fusion, breadth-first schedule, collectives, donation). Each case plans an
example workload with autoshard, compiles it from abstract arguments and
checks the prediction: arguments exactly, the peak within 15%; the GPT example in
fp32, bf16 and mixed precision (fp32 master weights, bf16 compute) within 10%, on one
device as well as sharded (XLA:CPU computes bf16 dots in f32: rule 10 of
``passes/memory_model.py``).
"""
from __future__ import annotations

import numpy as np
import pytest

from autoshard.plans.plan import Plan
from autoshard.compiler.verify import MEMORY_TOLERANCE
from compiled_examples import planned_example

# one pytest-xdist worker for every test that reads compiled_examples.planned_example's shared plans
pytestmark = pytest.mark.xdist_group("planned_examples")

CASES = [("mlp", (2, 4)), ("mlp", (1, 8)), ("gpt", (2, 4)), ("gpt", (8, 1))]


def _argument_bytes(plan: Plan) -> int:
    """Per-device bytes of every argument in its planned storage layout (XLA pads uneven shards)."""
    sizes = dict(zip(plan.axis_names, plan.mesh_shape))
    total = 0
    for path, spec in plan.input_specs.items():
        shape, dtype = plan.input_shapes[path]
        total += int(np.prod(spec.shard_shape(shape, sizes), dtype=np.int64)) * np.dtype(dtype).itemsize
    return total


@pytest.mark.parametrize(("example", "mesh"), CASES, ids=[f"{e}-{m[0]}x{m[1]}" for e, m in CASES])
def test_predicted_peak_memory_matches_xla(devices8, example, mesh):
    shared = planned_example(example, mesh, cluster="cpu-8", num_stages=1)  # mlp-2x4, gpt-2x4: test_fidelity.py's too
    compiled, plan = shared.compiled, shared.step.plan
    stats = compiled.memory_analysis()

    input_roles = set(plan.input_roles.values())
    predicted_args = sum(v for k, v in plan.ledger.memory_by_kind.items() if k in input_roles)
    assert predicted_args == stats.argument_size_in_bytes
    assert _argument_bytes(plan) == stats.argument_size_in_bytes

    row = shared.report.row("peak memory bytes")
    assert row.rel_error <= MEMORY_TOLERANCE, f"{example} on {mesh}:\n{shared.report}\nby kind: {plan.ledger.memory_by_kind}"


# one device too: XLA:CPU keeps narrow-float math in float32 between ops (rule 10's excess precision); without it
# bf16 and mixed were 17% under on one device (now 7-8% under: the broadcasts XLA:CPU's YNNPACK reductions
# materialise, a LayerNorm scale's and its rsqrt's, are not modeled; the fp32 step is 9% under from them)
PRECISION_CASES = [("tiny", (1,)), ("tiny-bf16", (2, 4)), ("tiny-mixed", (2, 4)), ("tiny-bf16", (1,)),
                   ("tiny-mixed", (1,))]


@pytest.mark.parametrize(("config", "mesh"), PRECISION_CASES,
                         ids=lambda v: v if isinstance(v, str) else "x".join(map(str, v)))
def test_predicted_peak_memory_matches_xla_in_each_precision(devices8, config, mesh):
    shared = planned_example("gpt", mesh, config=config)
    stats = shared.compiled.memory_analysis()
    assert _argument_bytes(shared.step.plan) == stats.argument_size_in_bytes
    row = shared.report.row("peak memory bytes")
    assert row.rel_error <= 0.10, f"gpt {config} on {mesh}:\n{shared.report}"
