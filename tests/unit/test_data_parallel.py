"""Plain programs whose best plan is data parallelism plan it: the batch split over every device, no
collective larger than twice the parameters (gradients are reduced; activations never move).

The programs (tests/dp_programs.py: a linear regression, an MLP stack, a post-LN BERT layer with
dropout, a conv net, an embedding bag) have batches large against their parameters, so this holds on
every cluster preset; the default run plans each on one node and on two nodes (the slow link between
them), ``-m slow`` on every preset.
"""
from __future__ import annotations

import math

import jax
import pytest

from autoshard.compiler.driver import plan_step
from autoshard.passes.intra_op import IntraOpOptions
from tests.dp_programs import PROGRAMS

MESHES = {"1x8-a100": (2, 4), "2x8-a100": (2, 8), "4x8-h100": (4, 8), "tpu-v4-32": (4, 4), "tpu-v5e-8": (2, 4),
          "cpu-8": (2, 4)}
DEFAULT = ("1x8-a100", "2x8-a100")
# the solve is asked to be proven optimal: a wall-clock limit generous enough for a loaded 2-core machine
TIME_LIMIT_S = 120.0
CASES = [pytest.param(name, cluster, marks=() if cluster in DEFAULT else pytest.mark.slow)
         for name in PROGRAMS for cluster in MESHES]


@pytest.mark.parametrize("name, cluster", CASES)
def test_plain_programs_plan_data_parallelism(name: str, cluster: str) -> None:
    step, params, opt_state, batch = PROGRAMS[name]()
    planned = plan_step(step, (params, opt_state, batch), mesh=MESHES[cluster], cluster=cluster,
                        options=IntraOpOptions(time_limit_s=TIME_LIMIT_S))
    plan, result = planned.plan, planned.result
    mesh_axes = {a for a, n in zip(plan.axis_names, plan.mesh_shape) if n > 1}
    batch_leaves = {path: spec for path, spec in plan.input_specs.items()
                    if plan.input_roles[path] == "batch" and spec.dims}
    assert batch_leaves
    for path, spec in batch_leaves.items():
        assert set(spec.dims[0]) == mesh_axes, f"{name} on {cluster}: batch leaf {path} is {spec}, not split over all"
    param_bytes = sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(params))
    largest = max(result.collectives(), key=lambda c: c.nbytes, default=None)
    assert largest is None or largest.nbytes <= 2 * param_bytes, \
        f"{name} on {cluster}: {largest} moves more than twice the parameters ({param_bytes} B)"
    assert plan.solver.status == "optimal"
