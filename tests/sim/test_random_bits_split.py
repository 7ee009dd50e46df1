"""A dropout mask is made where it is used: ``random_bits`` split like its reader, bit for bit one device's.

Planned replicated, every device made the whole mask of a batch-split activation, and on CPU XLA makes
threefry's bits in a loop it does not split: a ViT's train step on (2, 4) of 1x8-a100 priced 44 ms compiled
against 18 ms modeled (11.6 ms compiled without dropout). Split, XLA computes each device's slice of the counters alone
(``jax_threefry_partitionable``, JAX's default), so the compiled program holds no array of the whole mask
and the step equals one device's, the dropout masks included.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autoshard
from autoshard.ir.trace import trace
from autoshard.runtime.spmd import make_jax_mesh
from dropout_steps import scanned_dropout_step

B, D, H = 4096, 256, 1024


def _workload() -> tuple:
    rng = np.random.default_rng(0)
    params = {"w1": jnp.asarray(rng.normal(size=(D, H)) / np.sqrt(D), jnp.float32),
              "w2": jnp.asarray(rng.normal(size=(H, 1)) / np.sqrt(H), jnp.float32)}
    batch = {"x": jnp.asarray(rng.normal(size=(B, D)), jnp.float32),
             "y": jnp.asarray(rng.normal(size=(B, 1)), jnp.float32)}
    tx = optax.sgd(0.1)  # Adam would magnify the summation order of near-zero gradients

    def step(params, opt_state, batch, key):
        def loss_fn(p):
            h = jax.nn.relu(batch["x"] @ p["w1"])
            keep = jax.random.bernoulli(key, 0.8, h.shape)  # dropout, as Flax's nn.Dropout makes it
            h = jnp.where(keep, h / 0.8, 0.0)
            return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, tx.init(params), batch, jax.random.key(3))


def _run_like_one_device(step, args, devices, cluster: str):
    """The step decorated on (2, 4) of ``cluster``, run once and checked against ``jax.jit`` on one device;
    the decorated step, its graph and the indices of its ``random_bits`` ops."""
    want = jax.jit(step)(*args)
    run = autoshard.autoshard(step, mesh=make_jax_mesh((2, 4), ("x", "y"), devices=devices), cluster=cluster,
                              num_stages=1)
    got = run(*args)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-5, atol=2e-6)
    graph = trace(step, *args)
    return run, graph, [i for i, op in enumerate(graph.ops) if op.primitive == "random_bits"]


def test_a_dropout_mask_is_made_split_and_equals_one_devices(devices8):
    step, args = _workload()
    run, _, bits = _run_like_one_device(step, args, devices8, "1x8-a100")
    assert len(bits) == 1
    (spec,) = run.plan.op_out_specs[bits[0]]
    assert not spec.is_replicated, f"the mask's bits planned {spec}: every device makes all {B}x{H}"
    text = run.lower(*args).compile().as_text()
    assert not re.search(rf"u32\[{B},{H}\]", text), "the compiled program makes the whole mask's bits"


def test_bits_of_a_non_partitionable_threefry_stay_replicated(devices8):
    """Without ``jax_threefry_partitionable`` a shard of the bits is not computed alone: replicated."""
    step, args = _workload()
    with jax.threefry_partitionable(False):
        graph = trace(step, *args)
        plan = autoshard.plan(step, *args, mesh=(2, 4), cluster="1x8-a100", num_stages=1)
    bits = [i for i, op in enumerate(graph.ops) if op.primitive == "random_bits"]
    assert plan.op_out_specs[bits[0]][0].is_replicated


def test_a_scanned_layer_s_dropout_mask_is_split_inside_the_loop(devices8):
    """``nn.scan`` over blocks with dropout (``split_rngs={"dropout": True}``): the bits are drawn in the loop
    body, split there like their reader, and the step equals one device's."""
    step, args = scanned_dropout_step(3)
    run, graph, bits = _run_like_one_device(step, args, devices8, "cpu-8")
    in_body = [i for i in bits if any(loop.kind == "scan" and loop.body_start <= i < loop.body_stop
                                      for loop in graph.loops)]
    assert in_body and all(not run.plan.op_out_specs[i][0].is_replicated for i in in_body)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
