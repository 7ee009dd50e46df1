"""A pipelined step whose loss couples the examples of its batch says so, and a batch it cannot cut is named.

``nn.BatchNorm`` in training normalises each example by the batch's mean and variance; a pipeline runs the
loss a microbatch at a time, so each microbatch normalises by its own: ``MicrobatchCouplingWarning``
(``ir/batch_coupling.py``). With one microbatch the step is one device's. A per-channel statistic whose size
equals the batch's is taken for batch data and cut: the error names it and says what to change.
"""
from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autoshard
from autoshard.errors import MicrobatchCouplingWarning, PlanningError
from autoshard.runtime.spmd import make_jax_mesh


class BatchNormCNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        for features in (16, 32):
            x = nn.relu(nn.BatchNorm(use_running_average=False)(nn.Conv(features, (3, 3))(x)))
            x = nn.avg_pool(x, (2, 2), (2, 2))
        return nn.Dense(10)(x.mean(axis=(1, 2)))


def _workload(batch: int, stats_passed: bool = False) -> tuple:
    """``stats_passed``: the loss takes BatchNorm's statistics as an argument beside the batch (else it closes
    over them, and only the arguments it is passed are taken for batch data)."""
    model, tx = BatchNormCNN(), optax.sgd(0.05, momentum=0.9)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 3)))

    def step(params, batch_stats, opt_state, data):
        def loss_fn(p, data, stats):
            logits, updated = model.apply({"params": p, "batch_stats": stats}, data["image"],
                                          mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, data["label"]).mean(), updated
        if stats_passed:
            grad_fn = autoshard.value_and_grad(loss_fn, has_aux=True)
            (loss, updated), grads = grad_fn(params, data, batch_stats)
        else:
            grad_fn = autoshard.value_and_grad(lambda p, data: loss_fn(p, data, batch_stats), has_aux=True)
            (loss, updated), grads = grad_fn(params, data)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), updated["batch_stats"], opt_state, loss

    data = {"image": jax.random.normal(jax.random.key(1), (batch, 8, 8, 3)),
            "label": jax.random.randint(jax.random.key(2), (batch,), 0, 10)}
    params = variables["params"]
    return step, (params, variables["batch_stats"], tx.init(params), data)


def _run(devices8, batch: int, microbatches: int, stats_passed: bool = False):
    step, args = _workload(batch, stats_passed)
    mesh = make_jax_mesh((2, 4), ("x", "y"), devices=devices8)
    run = autoshard.autoshard(step, mesh=mesh, cluster="cpu-8", num_stages=2, num_microbatches=microbatches)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run(*args)
    return step, args, got, [w for w in caught if issubclass(w.category, MicrobatchCouplingWarning)]


def test_a_pipelined_batch_norm_warns_that_microbatches_have_their_own_statistics(devices8):
    _, _, got, said = _run(devices8, 48, 2)
    assert said and "normalization.py" in str(said[0].message) and "num_microbatches=1" in str(said[0].message)
    assert np.isfinite(float(got[-1]))


def test_one_microbatch_keeps_the_batch_s_statistics(devices8):
    step, args, got, said = _run(devices8, 48, 1)
    assert not said
    want = jax.jit(step)(*args)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("batch", [16, 32])  # the statistics have 16 and 32 channels
def test_closed_over_statistics_the_size_of_the_batch_are_not_cut(devices8, batch):
    _, _, got, said = _run(devices8, batch, 2)
    assert said and np.isfinite(float(got[-1]))


def test_a_statistic_the_size_of_the_batch_is_named_when_the_cut_fails(devices8):
    with pytest.raises(PlanningError, match=r"(?s)\['BatchNorm_1'\]\['mean'\].*num_stages=1"):
        _run(devices8, 32, 2, stats_passed=True)  # passed beside the batch: 32 channels taken for 32 examples
