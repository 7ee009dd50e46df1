"""The IR evaluated on real arrays: a traced OpGraph and a split step's forward give the step's numbers.

(The structural halves of these checks trace from shapes in tests/unit.)
"""
from __future__ import annotations

import jax
import numpy as np
import optax

from autoshard.ir.split import split_step
from autoshard.ir.trace import trace
from mlp_steps import mlp_loss, train_step


def _args(depth=4, width=8, batch=12):
    keys = jax.random.split(jax.random.key(0), depth + 2)
    params = {"w": [jax.random.normal(k, (width, width)) / 3 for k in keys[:depth]]}
    data = {"x": jax.random.normal(keys[-2], (batch, width)), "y": jax.random.normal(keys[-1], (batch, width))}
    return params, data


def test_graph_evaluate_matches_the_step():
    params, data = _args()
    tx = optax.adam(1e-3)
    args = (params, tx.init(params), data)
    step = train_step(tx, marker=False)
    graph = trace(step, *args)
    got = graph.evaluate(jax.tree.leaves(args))
    for a, b in zip(got, jax.tree.leaves(step(*args))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_split_forward_computes_the_loss():
    params, data = _args()
    tx = optax.sgd(0.1)
    parts = split_step(trace(train_step(tx), params, tx.init(params), data).jaxpr)
    fwd = parts.forward
    env = dict(fwd.consts)
    env.update(zip(fwd.invars, [*params["w"], data["x"], data["y"]]))
    fwd.run(range(len(fwd.eqns)), env)
    np.testing.assert_allclose(env[fwd.outvar], mlp_loss(params, data), rtol=1e-6)
