"""The example workloads run: one jitted step per small config, the loss falls, routing keeps capacity.

Steps are compiled with ``FAST_COMPILE`` (XLA:CPU's backend optimizations and fusion emitters off): the tests
check numerics and structure, and compile time dominates on this machine.
"""
from __future__ import annotations

import functools
import math
from types import ModuleType

import jax
import jax.numpy as jnp
import optax
import pytest

from compiled_examples import FAST_COMPILE
from examples import Workload, common, convnet, gpt, is_abstract, mlp, moe, moe_topk

MODULES: dict[str, ModuleType] = {"mlp": mlp, "gpt": gpt, "moe": moe, "moe_topk": moe_topk, "convnet": convnet}


@functools.cache
def _small(model: str) -> tuple[Workload, jax.stages.Wrapped]:
    """The small workload of ``model`` and its jitted step, built once per session."""
    work = MODULES[model].workload("small")
    return work, jax.jit(work.step, compiler_options=FAST_COMPILE)


def _same_leaves(a: object, b: object) -> bool:
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        x.shape == y.shape and x.dtype == y.dtype for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


@pytest.mark.parametrize("model", sorted(MODULES))
def test_small_step_runs_under_jit(model: str) -> None:
    work, step = _small(model)
    assert work.name == f"{model}-small"
    assert work.config == MODULES[model].CONFIGS["small"]
    params, opt_state, batch = work.args
    assert not is_abstract(work.args)
    assert all(leaf.dtype != jnp.float64 for leaf in jax.tree.leaves(work.args))
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(params))

    new_params, new_opt_state, loss = step(params, opt_state, batch)

    assert loss.shape == () and loss.dtype == jnp.float32
    assert math.isfinite(float(loss))
    assert _same_leaves(new_params, params)
    assert _same_leaves(new_opt_state, opt_state)
    # The optimizer's first moment after one step is a multiple of the gradient: every
    # parameter (router included, for moe) must receive some gradient.
    first_moment = optax.tree_utils.tree_get(new_opt_state, "trace" if model == "convnet" else "mu")
    assert _same_leaves(first_moment, params)
    no_grad = [jax.tree_util.keystr(path) for path, leaf in jax.tree_util.tree_leaves_with_path(first_moment)
               if not bool(jnp.any(leaf != 0))]
    assert not no_grad, f"parameters with an all-zero gradient: {no_grad}"


def test_gpt_small_loss_decreases() -> None:
    work, step = _small("gpt")
    params, opt_state, batch = work.args
    losses = []
    for _ in range(5):
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    assert all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0] - 0.1, losses


def test_workload_is_deterministic_given_seed() -> None:
    first, again = mlp.workload("tiny", seed=3), mlp.workload("tiny", seed=3)
    same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), first.args, again.args)
    assert all(jax.tree.leaves(same)), "not deterministic given the seed"


def test_moe_routing_respects_capacity() -> None:
    config = moe.CONFIGS["small"]
    groups, tokens = 6, config.seq_len

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def route() -> tuple[jax.Array, jax.Array, jax.Array]:
        router = moe.Top2Router(config.d_model, config.num_experts, config.capacity,
                                rngs=common.InitKeys(jax.random.key(0)))
        return router(jax.random.normal(jax.random.key(1), (groups, tokens, config.d_model)))

    dispatch, combine, aux_loss = route()
    assert dispatch.shape == (groups, tokens, config.num_experts, config.capacity)
    assert float(dispatch.sum(axis=1).max()) <= 1.0  # a slot holds at most one token
    assert float(dispatch.sum(axis=(2, 3)).max()) <= 2.0  # a token goes to at most two experts
    assert bool(jnp.all((combine > 0) == (dispatch > 0)))
    kept = dispatch.sum(axis=(2, 3)) > 0
    gate_sums = combine.sum(axis=(2, 3))
    assert bool(jnp.allclose(jnp.where(kept, gate_sums, 1.0), 1.0, atol=1e-5))
    assert float(dispatch.sum()) > 0.5 * groups * tokens  # most tokens are routed
    assert math.isfinite(float(aux_loss)) and float(aux_loss) > 0


def test_topk_moe_matches_a_token_by_token_reference_with_drops() -> None:
    """The sort + gather/scatter MoE layer against a loop over tokens: top-k experts by probability,
    first choices before second ones and earlier tokens first, at most ``capacity`` per expert and group;
    a capacity factor of 0.75 forces drops."""
    import dataclasses

    import numpy as np

    config = dataclasses.replace(moe_topk.CONFIGS["tiny"], capacity_factor=0.75)
    layer = moe_topk.TopKMoeMlp(config, rngs=common.InitKeys(jax.random.key(1)))
    x = jax.random.normal(jax.random.key(2), (3, config.seq_len, config.d_model))
    got, aux_loss = layer(x)
    probs = np.asarray(jax.nn.softmax(layer.router.gate(x), axis=-1))
    w_in, b_in, w_out, b_out = (np.asarray(p[...]) for p in (layer.w_in, layer.b_in, layer.w_out, layer.b_out))
    xs, want, dropped = np.asarray(x), np.zeros(x.shape, np.float32), 0
    for g in range(x.shape[0]):
        experts = np.argsort(-probs[g], axis=-1, kind="stable")[:, : config.top_k]
        gates = np.take_along_axis(probs[g], experts, axis=-1)
        gates = gates / gates.sum(axis=-1, keepdims=True)
        filled = [0] * config.num_experts
        for choice in range(config.top_k):
            for t in range(config.seq_len):
                e = experts[t, choice]
                if filled[e] == config.capacity:
                    dropped += 1
                    continue
                filled[e] += 1
                hidden = np.asarray(jax.nn.gelu(jnp.asarray(xs[g, t] @ w_in[e] + b_in[e])))
                want[g, t] += gates[t, choice] * (hidden @ w_out[e] + b_out[e])
    assert dropped > 0
    assert float(np.max(np.abs(np.asarray(got) - want))) <= 1e-5 * float(np.max(np.abs(want)))
    assert math.isfinite(float(aux_loss)) and float(aux_loss) > 0
