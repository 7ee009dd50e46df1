"""A pipeline whose loss draws a dropout mask over the batch says its step is not bit for bit one device's.

The pipeline runs the loss a microbatch at a time, and each microbatch draws its own bits (JAX's counters start
at 0 for the microbatch's shape), where one device draws the whole batch's mask once; SPMD splits that mask
and keeps it (``tests/sim/test_random_bits_split.py``). Measured on this step: loss 1.2608 pipelined against
1.2633 on one device. The warning names it; a step without random bits, or one microbatch, does not warn.
Without dropout the loss ignores its key, an operand jax's dead-code pass drops from the marker's call: the
tracer puts it back (``ir/trace._marker_operands_kept``), so the step still splits and runs as one device.
"""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autoshard
from autoshard.errors import MicrobatchRandomnessWarning
from autoshard.runtime.spmd import make_jax_mesh

B, D = 64, 32


def _workload(dropout: bool) -> tuple:
    rng = np.random.default_rng(0)
    params = {f"w{i}": jnp.asarray(rng.normal(size=(D, D)) / np.sqrt(D), jnp.float32) for i in range(4)}
    batch = {"x": jnp.asarray(rng.normal(size=(B, D)), jnp.float32),
             "y": jnp.asarray(rng.normal(size=(B, D)), jnp.float32)}
    tx = optax.sgd(0.1)

    def loss_fn(p, batch, key):
        h = batch["x"]
        for i in range(4):
            h = jnp.tanh(h @ p[f"w{i}"])
            if dropout:
                h = jnp.where(jax.random.bernoulli(jax.random.fold_in(key, i), 0.8, h.shape), h / 0.8, 0.0)
        return jnp.mean((h - batch["y"]) ** 2)

    def step(params, opt_state, batch, key):
        loss, grads = autoshard.value_and_grad(loss_fn)(params, batch, key)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, tx.init(params), batch, jax.random.key(3))


@pytest.mark.parametrize(("dropout", "microbatches"), [(True, 2), (False, 2), (True, 1)])
def test_a_pipelined_dropout_mask_warns_that_each_microbatch_draws_its_own(devices8, dropout, microbatches):
    step, args = _workload(dropout)
    want = jax.jit(step)(*args)
    mesh = make_jax_mesh((2, 4), ("x", "y"), devices=devices8)
    run = autoshard.autoshard(step, mesh=mesh, cluster="cpu-8", num_stages=2, num_microbatches=microbatches)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run(*args)
    assert len(run.plan.stages) == 2
    said = [w for w in caught if issubclass(w.category, MicrobatchRandomnessWarning)]
    if dropout and microbatches > 1:
        assert said and "4 draws" in str(said[0].message) and "num_stages=1" in str(said[0].message)
    else:
        assert not said
    if not dropout:  # the loss ignores its key: the marker keeps the operand, and the step is one device's
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
