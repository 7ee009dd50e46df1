"""``ir/batch_coupling.batch_statistics``: a statistic over the batch used per example is found from the loss
traced at two batch sizes; per-example reductions and the loss's own mean are not (traced only, no compile)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import autoshard
from autoshard.errors import MicrobatchCouplingWarning
from autoshard.ir.batch_coupling import batch_statistics
from autoshard.ir.split import split_step
from autoshard.ir.trace import trace

D = 16


def _forward(normalise, batch: int):
    def loss_fn(w, x):
        return jnp.mean(normalise(x @ w) ** 2)

    def step(w, x):
        loss, grad = autoshard.value_and_grad(loss_fn)(w, x)
        return w - 0.1 * grad, loss

    args = (jax.ShapeDtypeStruct((D, D), jnp.float32), jax.ShapeDtypeStruct((batch, D), jnp.float32))
    return split_step(trace(step, *args).jaxpr).forward


@pytest.mark.parametrize(("name", "normalise", "coupled"), [
    ("batch-centred (BatchNorm's mean)", lambda h: h - jnp.mean(h, axis=0), True),
    ("batch-scaled (a max over the batch)", lambda h: h / jnp.max(jnp.abs(h)), True),
    ("per-example (LayerNorm's mean)", lambda h: h - jnp.mean(h, axis=1, keepdims=True), False),
    ("elementwise", jnp.tanh, False),
])
def test_a_batch_statistic_used_per_example_is_found(name, normalise, coupled):
    found = batch_statistics(_forward(normalise, 64), _forward(normalise, 32))
    assert bool(found) == coupled, (name, found)
    if coupled:
        assert "test_batch_coupling.py" in found[0]


def test_traces_that_do_not_align_find_nothing():
    assert batch_statistics(_forward(jnp.tanh, 64), _forward(lambda h: h - jnp.mean(h, axis=0), 32)) == []


@pytest.mark.parametrize(("normalise", "want"), [(lambda h: h - jnp.mean(h, axis=0), 1), (jnp.tanh, None)])
def test_a_searched_microbatch_count_is_one_when_the_loss_couples_its_batch(normalise, want):
    """Searching stages (no count given), a coupled loss is priced at one microbatch only: more would give each
    microbatch its own statistic; an uncoupled one leaves the count to the search. Traced only."""
    from autoshard.compiler.pipeline_context import PipelineRequest, pipeline_context
    from autoshard.compiler.pipeline_pricing import stage_cost_options
    from autoshard.compiler.target import resolve_target

    def loss_fn(ws, x):
        for w in ws:
            x = normalise(x @ w)
        return jnp.mean(x ** 2)

    def step(ws, x):
        loss, grads = autoshard.value_and_grad(loss_fn)(ws, x)
        return [w - 0.1 * g for w, g in zip(ws, grads)], loss

    args = ([jax.ShapeDtypeStruct((D, D), jnp.float32)] * 4, jax.ShapeDtypeStruct((64, D), jnp.float32))
    graph = trace(step, *args)
    ctx = pipeline_context(step, args, PipelineRequest(cluster="cpu-8", num_devices=8), graph,
                           split_step(graph.jaxpr), resolve_target(None, "cpu-8", None), {})
    assert stage_cost_options(ctx).num_microbatches == want
    if want is not None:  # a count given above one is kept, and warned of
        forced = pipeline_context(step, args, PipelineRequest(cluster="cpu-8", num_devices=8, num_microbatches=2),
                                  graph, split_step(graph.jaxpr), resolve_target(None, "cpu-8", None), {})
        with pytest.warns(MicrobatchCouplingWarning, match="num_microbatches=2"):
            assert stage_cost_options(forced).num_microbatches == 2


def test_a_step_that_cannot_be_cut_into_microbatches_plans_as_spmd_when_stages_are_searched():
    """A closed-over vector as long as the batch is taken for batch data and cut, and the loss no longer traces:
    a searched stage count falls back to one SPMD stage (it raised before); a forced one says what was cut."""
    from autoshard.errors import MicrobatchTraceError

    def step(w, stats, x):
        loss, grad = autoshard.value_and_grad(lambda w: jnp.mean((x @ w - stats) ** 2))(w)
        return w - 0.1 * grad, loss

    args = (jax.ShapeDtypeStruct((D, D), jnp.float32), jax.ShapeDtypeStruct((D,), jnp.float32),
            jax.ShapeDtypeStruct((D, D), jnp.float32))  # 16 examples of 16 features, 16 statistics
    assert autoshard.plan(step, *args, cluster="cpu-8").pipeline is None
    with pytest.raises(MicrobatchTraceError, match=r"the inputs \[1\], \[2\] cut"):
        autoshard.plan(step, *args, cluster="cpu-8", num_stages=2)
