"""A train graph cut into the forward and backward halves a pipeline stage runs (``runtime/stage_train.py``).

The cut must put nothing that reads the gradient accumulator or a cotangent into the forward, keep as
residuals exactly the forward values the backward reads, and running the two halves one after the other must
give what the whole graph gives (the layer's outputs, its accumulated gradients and its input cotangents).
"""
from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from compiled_examples import FAST_COMPILE
from pipeline_helpers import marked_step

from autoshard.ir.spec import Spec
from autoshard.ir.split import split_step
from autoshard.ir.trace import trace
from autoshard.passes.layers import cluster_layers
from autoshard.ir.train_graph import one_layer_programs, split_phases, train_graph
from autoshard.plans.annotations import Annotations, TrainPins
from autoshard.runtime.spmd import make_jax_mesh
from autoshard.runtime.stage_train import LayerRunner
from examples import gpt


@pytest.fixture(scope="module")
def layer_graph():
    work = gpt.workload("tiny")
    tx = optax.adamw(1e-3)
    step = marked_step(work.loss_fn, tx)
    parts = split_step(trace(step, *work.args).jaxpr)
    layers = cluster_layers(parts.forward, None)
    programs = one_layer_programs(parts.forward, [layer.eqns for layer in layers])
    middle = len(layers) // 2  # a transformer block: parameters, an entering activation, a leaving one
    graph, groups = train_graph(parts.forward, programs[middle])
    return graph, groups


def test_the_forward_reads_no_cotangent_and_the_residuals_are_what_the_backward_reads(layer_graph):
    graph, groups = layer_graph
    na, npar, nd, nact, nct = groups
    phases = split_phases(graph, groups)
    assert phases.forward and phases.backward
    forward_ops = phases.forward_ops()
    grads_and_cts = set(graph.inputs[:na]) | set(graph.inputs[na + npar + nd + nact:])
    made_forward = {v for t in forward_ops for v in graph.ops[t].outputs}
    for t in forward_ops:
        assert not set(graph.ops[t].inputs) & grads_and_cts, f"forward op {graph.ops[t]} reads a gradient input"
    assert set(graph.outputs[na:na + nct]) <= made_forward | set(graph.inputs)
    read_back = {v for t in range(len(graph.ops)) if t not in forward_ops for v in graph.ops[t].inputs}
    assert set(phases.residuals) == made_forward & (read_back | set(graph.outputs[:na]) | set(graph.outputs[na + nct:]))
    assert phases.residuals, "a transformer block's backward reads forward values"


def test_the_two_halves_compute_what_the_whole_graph_does(layer_graph):
    graph, groups = layer_graph
    na, npar, nd, nact, nct = groups
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(graph.values[v].shape).astype(graph.values[v].dtype)
            if np.issubdtype(np.dtype(graph.values[v].dtype), np.floating)
            else np.zeros(graph.values[v].shape, graph.values[v].dtype) for v in graph.inputs]
    want = jax.jit(graph.evaluate, compiler_options=FAST_COMPILE)(args)
    mesh = make_jax_mesh((1,), ("x",))
    rep = [Spec.replicated(graph.values[v].rank) for v in graph.inputs]
    out_rep = [Spec.replicated(graph.values[v].rank) for v in graph.outputs]
    runner = LayerRunner(graph, groups, TrainPins("k", len(graph.ops), Annotations(tuple(rep), tuple(out_rep), {}, {})),
                         mesh)
    acc, params, data = args[:na], args[na:na + npar], args[na + npar:na + npar + nd]
    acts, cts = args[na + npar + nd:na + npar + nd + nact], args[na + npar + nd + nact:]

    def both(params, data, acts, cts, acc):
        out, kept = runner.forward(params, data, acts)
        acc, dacts = runner.backward(params, data, kept, cts, acc)
        return [*acc, *out, *dacts]

    got = jax.jit(both, compiler_options=FAST_COMPILE)(params, data, acts, cts, acc)
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6, err_msg=f"output {k}")
