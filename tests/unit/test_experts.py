"""Expert weights found from the jaxpr, and the expert x data search starts built from them."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from autoshard.ir.graph import Role
from autoshard.ir.spec import Spec
from autoshard.ir.trace import trace
from autoshard.meshes.cluster import PRESETS
from autoshard.meshes.logical import make_logical_mesh
from autoshard.passes.experts import expert_dims, expert_layouts
from examples import gpt, moe, moe_topk


def _graph(module):
    work = module.workload("tiny", abstract=True)
    return trace(work.step, *work.args)


@pytest.mark.parametrize("module", [moe, moe_topk], ids=["einsum", "sort-gather"])
def test_expert_weights_are_the_parameters_a_dot_batches_over(module):
    graph = _graph(module)
    found = {graph.values[graph.inputs[i]].path: d for i, d in expert_dims(graph).items()}
    layers = module.CONFIGS["tiny"].num_layers
    want = {f"[0]['blocks'][{k}]['moe']['{w}']": 0 for k in range(layers) for w in ("w_in", "w_out")}
    assert found == want


def test_dense_models_and_casts():
    assert expert_dims(_graph(gpt)) == {}

    def step(w, x):  # a bf16 cast between the weight and the batched dot still marks it
        def loss(w):
            return jnp.sum(jnp.einsum("egd,edf->egf", x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)))
        return w - 0.1 * jax.grad(loss)(w), loss(w)

    graph = trace(step, jax.ShapeDtypeStruct((4, 8, 16), jnp.float32), jax.ShapeDtypeStruct((4, 6, 8), jnp.float32))
    assert expert_dims(graph) == {0: 0}


def test_expert_layouts_split_experts_and_keep_the_batch_split_everywhere():
    graph = _graph(moe)  # 4 experts
    mesh = make_logical_mesh(PRESETS["1x8-a100"], (2, 4))
    layouts = expert_layouts(graph, mesh)
    experts = expert_dims(graph)
    # E = 4: over x (2) or y (4), not over both (8); each with the rest replicated or sharded
    assert len(layouts) == 4
    seen = set()
    for layout in layouts:
        axes = {layout[i].dims[0] for i in experts}
        assert len(axes) == 1
        seen.add(axes.pop())
        for i, vid in enumerate(graph.inputs):
            value = graph.values[vid]
            if value.role == Role.BATCH:
                assert layout[i] == Spec((("x", "y"),) + ((),) * (value.rank - 1))
            mirrored = value.role == Role.OPT_STATE and any(
                (value.path or "").endswith(graph.values[graph.inputs[j]].path[3:]) for j in experts)
            if mirrored:
                assert layout[i].dims[0], value.path  # Adam's moments follow their expert weight
    assert seen == {("x",), ("y",)}
    assert expert_layouts(_graph(gpt), mesh) == []

