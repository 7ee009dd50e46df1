"""@autoshard on model code this project did not write: penzai's Llama-like transformer (its own builder,
``penzai.models.transformer.variants.llamalike_common``), its blocks unrolled and stacked in penzai's
``LayerStack`` (a scan over the layer axis), trained as penzai's own ``basic_training`` does (parameters
unbound from the model, bound again inside the loss, named arrays in and out).

Three sharded SGD steps equal the same steps on one device, and the plan's predicted collectives, peak memory,
FLOPs and HBM bytes are what XLA compiles (``verify_compiled``, within its tolerances). Marked with
``autoshard.value_and_grad``, the step runs on two pipeline stages with two microbatches like one device too
(the layer stack cut between the stages). penzai is a dev
dependency (pyproject's ``dev`` extra); without it the module skips.
"""
from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import autoshard
from autoshard.compiler.verify import verify_compiled
from autoshard.passes.intra_op import IntraOpOptions

pz = pytest.importorskip("penzai.pz", reason="penzai is a dev dependency: pip install -e '.[dev]'")
llamalike = pytest.importorskip("penzai.models.transformer.variants.llamalike_common")

STEPS, LR = 3, 0.1
OPTIONS = IntraOpOptions(time_limit_s=10.0)


def _llama(stacked: bool):
    """A small Llama-like model (grouped-query attention, SwiGLU, RoPE, RMSNorm): (unbound model, parameters)."""
    config = llamalike.LlamalikeTransformerConfig(
        num_kv_heads=2, query_head_multiplier=2, embedding_dim=64, projection_dim=16, mlp_hidden_dim=128,
        num_decoder_blocks=2, vocab_size=256, mlp_variant="swiglu", tie_embedder_and_logits=False,
        use_layer_stack=stacked)
    model = llamalike.build_llamalike_transformer(config, init_base_rng=jax.random.key(0))
    return pz.unbind_params(model, freeze=True)


def _train_step(unbound, tx, marked: bool = False):
    def loss_fn(params, tokens):
        model = pz.bind_variables(unbound, params)
        logits = model(pz.nx.wrap(tokens[:, :-1]).tag("batch", "seq")).unwrap("batch", "seq", "vocabulary")
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def step(params, opt_state, tokens):
        loss, grads = (autoshard.value_and_grad if marked else jax.value_and_grad)(loss_fn)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


@pytest.mark.parametrize("stacked", [False, True], ids=["unrolled", "layer-stack"])
def test_penzai_llama_steps_match_one_device(stacked, devices8):
    unbound, params = _llama(stacked)
    tx = optax.sgd(LR)
    step = _train_step(unbound, tx)
    tokens = jax.random.randint(jax.random.key(1), (16, 33), 0, 256)

    one = jax.jit(step)
    ref_params, ref_state, ref_losses = params, tx.init(params), []
    for _ in range(STEPS):
        ref_params, ref_state, loss = one(ref_params, ref_state, tokens)
        ref_losses.append(float(loss))

    sharded = autoshard.autoshard(step, mesh=(2, 4), cluster="1x8-a100", options=OPTIONS)
    state = jax.tree.map(lambda x: x.copy(), (params, tx.init(params)))  # the sharded step donates them
    for want in ref_losses:
        *state, loss = sharded(*state, tokens)
        assert abs(float(loss) - want) <= 1e-5 * abs(want), f"loss {float(loss)} vs one device {want}"
    got, want = jax.tree.leaves(state[0]), jax.tree.leaves(ref_params)
    assert len(got) == len(want) and got
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(state[0]), want):
        err = float(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64))))
        assert err <= 1e-5 * max(float(np.max(np.abs(np.asarray(w)))), 1e-3), f"{jax.tree_util.keystr(path)}: {err}"

    plan = sharded.plan
    assert any(not spec.is_replicated for spec in plan.input_specs.values()), "the plan shards nothing"
    report = verify_compiled(plan, sharded.lower(params, tx.init(params), tokens).compile())
    assert "all collective bytes" in {row.what for row in report.rows}
    assert report.ok, "\n".join(f"{r.what}: predicted {r.predicted:.4g}, compiled {r.compiled:.4g}"
                                 for r in report.rows)


@pytest.mark.parametrize("stacked", [False, True], ids=["unrolled", "layer-stack"])
def test_penzai_llama_pipelined_matches_one_device(stacked, devices8):
    unbound, params = _llama(stacked)
    tx = optax.sgd(LR)
    step = _train_step(unbound, tx, marked=True)
    tokens = jax.random.randint(jax.random.key(1), (16, 33), 0, 256)
    want = jax.jit(step)(params, tx.init(params), tokens)
    run = autoshard.autoshard(step, mesh=(2, 4), cluster="cpu-8", num_stages=2, num_microbatches=2,
                              options=OPTIONS)
    got = run(params, tx.init(params), tokens)
    assert len(run.plan.stages) == 2
    assert abs(float(got[2]) - float(want[2])) <= 1e-5 * abs(float(want[2]))
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got[0]), jax.tree.leaves(want[0])):
        err = float(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64))))
        assert err <= 1e-5 * max(float(np.max(np.abs(np.asarray(w)))), 1e-3), f"{jax.tree_util.keystr(path)}: {err}"
