"""Flax models written as Flax's examples write them (``benchmarks/flax_zoo.py``), run sharded like one device.

Dropout from the step's key, BatchNorm statistics as mutable state returned by the step, ``nn.RNN``'s scan, a
tied head under ``optax.MultiSteps`` (a ``cond``), ``nn.scan(nn.remat(...))``: each decorated step on (2, 4)
of ``cpu-8`` (slow compute against its links, so the planner splits these small models) returns what
``jax.jit`` returns on one device, and the plan splits something (its collectives are not empty).

Attention's key bias is left out of the comparison: its gradient is zero in exact arithmetic (softmax is
invariant to a shift shared by a query's scores), and AdamW turns its float noise into steps of the learning
rate, different on any other summation order (measured: 6e-5 against 5e-5 either side of zero; the loss and
every other leaf agree).
"""
from __future__ import annotations

import jax
import numpy as np
import pytest

import autoshard
from autoshard.passes.intra_op import IntraOpOptions
from autoshard.runtime.spmd import make_jax_mesh
from benchmarks.flax_zoo import MODELS


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_flax_zoo_step_runs_sharded_like_one_device(devices8, name):
    step, args = MODELS[name](small=True)
    want = jax.jit(step)(*args)
    mesh = make_jax_mesh((2, 4), ("x", "y"), devices=devices8)
    # a short limit: the test checks that the plan runs like one device, not that it is optimal (the small ViT's
    # LP, 116k columns, is unproven at 10 s on cpu-8)
    run = autoshard.autoshard(step, mesh=mesh, cluster="cpu-8", num_stages=1,
                              options=IntraOpOptions(time_limit_s=3.0))
    got = run(*args)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got)):
        where = jax.tree_util.keystr(path)
        if "['key']['bias']" not in where:
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5, err_msg=f"{name}{where}")
    assert sum(run.plan.ledger.collective_bytes.values()) > 0, f"{name}: planned without a split"
