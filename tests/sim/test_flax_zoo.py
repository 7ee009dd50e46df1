"""Flax models written as Flax's examples write them (``benchmarks/flax_zoo.py``), run sharded like one device.

Dropout from the step's key, BatchNorm statistics as mutable state returned by the step, ``nn.RNN``'s scan, a
tied head under ``optax.MultiSteps`` (a ``cond``), ``nn.scan(nn.remat(...))``: each decorated step on (2, 4)
of ``cpu-8`` (slow compute against its links, so the planner splits these small models) returns what
``jax.jit`` returns on one device, and the plan splits something (its collectives are not empty).

Attention's key bias is left out of the comparison: its gradient is zero in exact arithmetic (softmax is
invariant to a shift shared by a query's scores), and AdamW turns its float noise into steps of the learning
rate, different on any other summation order (measured: 6e-5 against 5e-5 either side of zero; the loss and
every other leaf agree).

Marked (``autoshard.value_and_grad``), three of them run on two pipeline stages with two microbatches like
one device too (the tied LM's ``MultiSteps`` cond over every leaf, the GRU's scan over time, the scanned remat
stack cut between stages); the ViT's global-norm clip is refused with the reason, and the BatchNorm net's
statistics, as many as its batch's examples, are named when the cut fails.
"""
from __future__ import annotations

import warnings

import jax
import numpy as np
import pytest

import autoshard
from autoshard.errors import MicrobatchCouplingWarning, PipelineError, PlanningError
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


def _pipelined(devices8, name):
    step, args = MODELS[name](small=True, marked=True)
    mesh = make_jax_mesh((2, 4), ("x", "y"), devices=devices8)
    run = autoshard.autoshard(step, mesh=mesh, cluster="cpu-8", num_stages=2, num_microbatches=2,
                              options=IntraOpOptions(time_limit_s=3.0))
    return step, args, run


@pytest.mark.parametrize("name", ["gru", "scan_remat", "tied_lm"])
def test_a_marked_flax_zoo_step_runs_pipelined_like_one_device(devices8, name):
    step, args, run = _pipelined(devices8, name)
    want = jax.jit(step)(*args)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MicrobatchCouplingWarning)
        got = run(*args)
    assert len(run.plan.stages) == 2
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5,
                                   err_msg=f"{name}{jax.tree_util.keystr(path)}")


def test_what_a_pipeline_cannot_run_as_one_device_is_said(devices8):
    _, args, run = _pipelined(devices8, "vit")
    with pytest.raises(PipelineError, match="clip_by_global_norm"):
        run(*args)
    # the BatchNorm net closes over its statistics and its batch alike, and its second BatchNorm has as many
    # channels as the batch has examples (64): the cut cannot tell them apart, and says so (with a batch of
    # another size it runs, and warns of the per-microbatch statistics: tests/sim/test_pipeline_coupling.py)
    _, args, run = _pipelined(devices8, "bn_cnn")
    with pytest.raises(PlanningError, match=r"(?s)\['BatchNorm_1'\]\['mean'\].*num_stages=1"):
        run(*args)
