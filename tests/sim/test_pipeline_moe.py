"""Mixture-of-experts models as pipelines: any model with repeated layers is cut into stages, its expert
layers included (each stage's intra-op plan may split the experts over its sub-mesh). Routing groups are
sequences and the load-balancing loss is a mean over them, so microbatching keeps the step's numerics:
3 SGD steps equal the same steps on one device."""
from __future__ import annotations

import importlib

import jax
import optax
import pytest

import autoshard
from compiled_examples import FAST_COMPILE
from pipeline_helpers import assert_leaves_close, marked_step, rel


@pytest.mark.parametrize("model", ["moe", "moe_topk"])
def test_moe_pipeline_matches_one_device(model, devices8):
    work = importlib.import_module(f"examples.{model}").workload("tiny")
    params, _, batch = work.args
    tx = optax.sgd(0.1)
    step = marked_step(work.loss_fn, tx)
    reference = jax.jit(step, compiler_options=FAST_COMPILE)
    piped = autoshard.autoshard(step, num_stages=2, num_microbatches=2, cluster="cpu-8",
                                compiler_options=FAST_COMPILE)
    ref = state = (params, tx.init(params))
    for _ in range(3):
        *ref, ref_loss = reference(*ref, batch)
        *state, loss = piped(*state, batch)
        assert rel(loss, ref_loss) <= 1e-5, f"loss {float(loss)} vs one device {float(ref_loss)}"
    plan = piped.plan
    assert len(plan.stages) == 2 and plan.num_microbatches == 2
    layers = [st.last_layer - st.first_layer + 1 for st in plan.stages]
    assert sum(layers) == plan.pipeline.layers and min(layers) >= 1
    assert_leaves_close(state[0], ref[0], "params")
