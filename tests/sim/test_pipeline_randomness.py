"""A pipelined step whose loss draws a dropout mask over the batch runs as one device does.

The pipeline runs the loss a microbatch at a time; each microbatch draws its slice of the whole batch's bits
(``runtime/microbatch_bits.py``: threefry of the whole shape's indices of its own rows), where JAX would count
from 0 over the microbatch's shape (measured before: loss 1.2608 pipelined with 2 microbatches against 1.2633
on one device). A train graph traced for one layer is reused for the layers of its class only when they read
the same constants (``ir/train_graph.program_constants``): each block's ``fold_in(key, i)`` differs in ``i``,
and reusing the first block's graph gave every block its mask (loss 1.2326 even with one microbatch). A draw
that cannot be sliced (another key type) still warns. Without dropout the loss ignores its key, an operand
jax's dead-code pass drops from the marker's call: the tracer puts it back (``ir/trace._marker_operands_kept``).
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
from autoshard.runtime.microbatch_bits import mul_2x32, sliced_bits
from autoshard.runtime.pipeline import PipelineStep
from autoshard.runtime.spmd import make_jax_mesh
from dropout_steps import scanned_dropout_step

B, D = 64, 32


def _workload(dropout: bool, impl: str | None = None) -> tuple:
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

    return step, (params, tx.init(params), batch, jax.random.key(3, impl=impl))


def _run(devices8, step, args, microbatches: int) -> tuple[list, list]:
    mesh = make_jax_mesh((2, 4), ("x", "y"), devices=devices8)
    run = autoshard.autoshard(step, mesh=mesh, cluster="cpu-8", num_stages=2, num_microbatches=microbatches)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run(*args)
    assert len(run.plan.stages) == 2
    return got, [w for w in caught if issubclass(w.category, MicrobatchRandomnessWarning)]


def _assert_one_device(want, got) -> None:
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("dropout", "microbatches"), [(True, 1), (True, 2), (True, 4), (False, 2)])
def test_a_pipelined_dropout_mask_is_one_device_s(devices8, dropout, microbatches):
    step, args = _workload(dropout)
    want = jax.jit(step)(*args)
    got, said = _run(devices8, step, args, microbatches)
    assert not said
    _assert_one_device(want, got)


def test_the_jax_vjp_stage_path_draws_the_same_slices(devices8, monkeypatch):
    monkeypatch.setattr(PipelineStep, "_runner", lambda self, program, graphs: None)  # no train-graph runner
    step, args = _workload(True)
    want = jax.jit(step)(*args)
    got, said = _run(devices8, step, args, 2)
    assert not said
    _assert_one_device(want, got)


def test_a_draw_that_cannot_be_sliced_warns(devices8):
    step, args = _workload(True, impl="rbg")  # rbg bits are not threefry of the element's index
    got, said = _run(devices8, step, args, 2)
    assert said and "4 of 4 draws" in str(said[0].message) and "num_stages=1" in str(said[0].message)
    assert np.isfinite(float(got[2]))


def test_a_scanned_stack_s_dropout_is_one_device_s(devices8):
    """``nn.scan`` over blocks with dropout: the stack pipeline runs each stage's iterations as a scan, the draws
    inside its body (under a ``jit``) are re-emitted as the microbatch's slices. Without: loss 3.7183 against
    3.5167 on one device."""
    step, args = scanned_dropout_step(4, marked=True)
    want = jax.jit(step)(*args)
    got, said = _run(devices8, step, args, 2)
    assert not said
    _assert_one_device(want, got)


def test_a_draw_of_a_microbatch_s_shape_that_does_not_shrink_is_left_as_it_is():
    """Weight noise of shape (32, 32) beside a dropout mask of (64, 32) whose microbatch is (32, 32): a bind
    sees only the shape, so neither is sliced and the mask warns (the noise must stay the whole draw)."""
    from autoshard.ir.split import split_step
    from autoshard.ir.step_trace import TracedStep
    from autoshard.ir.trace import trace
    from autoshard.runtime.microbatch_bits import find_draws

    def loss_fn(w, x, key):
        noisy = w + 0.01 * jax.random.normal(jax.random.fold_in(key, 1), w.shape)
        h = jnp.tanh(x @ noisy)
        return jnp.mean(jnp.where(jax.random.bernoulli(key, 0.8, h.shape), h, 0.0) ** 2)

    def step(w, x, key):
        loss, grad = autoshard.value_and_grad(loss_fn)(w, x, key)
        return w - 0.1 * grad, loss

    args = (jax.ShapeDtypeStruct((D, D), jnp.float32), jax.ShapeDtypeStruct((B, D), jnp.float32), jax.random.key(0))
    graph = trace(step, *args)
    traced = TracedStep.of(step, args, graph, split_step(graph.jaxpr))
    draws = find_draws(traced.parts, traced.at_microbatches(2), 2)
    assert draws.count == 1 and not draws.sliced and len(draws.unsliced) == 1


def test_a_draw_in_a_cond_branch_warns(devices8):
    """A ``cond`` is bound whole, so the draw in its branch counts from 0 over the microbatch: it warns."""
    step, args = _workload(False)
    params, opt_state, batch, key = args
    tx = optax.sgd(0.1)

    def loss_fn(p, batch, key):
        h = jnp.tanh(batch["x"] @ p["w0"])
        h = jax.lax.cond(jnp.sum(batch["y"]) > -1e9,
                         lambda h: jnp.where(jax.random.bernoulli(key, 0.8, h.shape), h / 0.8, 0.0), lambda h: h, h)
        for i in range(1, 4):
            h = jnp.tanh(h @ p[f"w{i}"])
        return jnp.mean((h - batch["y"]) ** 2)

    def cond_step(params, opt_state, batch, key):
        loss, grads = autoshard.value_and_grad(loss_fn)(params, batch, key)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    got, said = _run(devices8, cond_step, args, 2)
    assert said and "1 of 1 draws" in str(said[0].message) and "cond" in str(said[0].message)
    assert np.isfinite(float(got[2]))


@pytest.mark.parametrize(("whole", "axis", "parts"), [((64, 32), 0, 2), ((8, 64, 5), 1, 4), ((3, 16), 1, 8)])
def test_a_slice_of_the_bits_equals_the_slice_of_the_whole_draw(whole, axis, parts):
    key = jax.random.key(7)
    for dtype, width in ((jnp.uint32, 32), (jnp.uint8, 8)):
        full = jax.random.bits(key, whole, dtype)
        shape = tuple(n // parts if d == axis else n for d, n in enumerate(whole))
        for m in range(parts):
            got = jax.jit(sliced_bits, static_argnums=(1, 2, 3, 4))(key, width, whole, shape, axis, m)
            want = jax.lax.slice_in_dim(full, m * shape[axis], (m + 1) * shape[axis], axis=axis)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_index_words_are_exact_past_two_to_the_32():
    a = np.random.default_rng(0).integers(0, 2**32, 512, dtype=np.uint64).astype(np.uint32)
    for b in (3, 2**31 + 5, 2**33 + 7, 3 * 2**40 + 12345):
        high, low = mul_2x32(jnp.asarray(a), b)
        got = [(int(h) << 32) | int(l) for h, l in zip(np.asarray(high), np.asarray(low))]
        assert got == [(int(x) * b) % 2**64 for x in a]
