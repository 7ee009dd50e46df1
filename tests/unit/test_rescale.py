"""A step's jaxpr at a third batch size, extrapolated from its jaxprs at two (``ir/rescale.py``), is the jaxpr
jax traces there: printed, the two are the same text (every shape, reshape size, mean divisor, random-bits
shape and nested body). Where the two jaxprs do not explain a third, ``extrapolate`` says None and the caller
traces. Also: a pipeline's TracedStep makes a third microbatch count without tracing the step."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import autoshard
import dp_programs
from autoshard.ir.rescale import extrapolate
from autoshard.ir.split import split_step
from autoshard.ir.step_trace import TracedStep, same_step
from autoshard.ir.trace import step_jaxpr, trace
from examples import convnet, gpt, gpt_scan, moe_topk
from mlp_steps import scan_loss, train_step


def _marked(work):
    def step(params, opt_state, batch):
        loss, grads = autoshard.value_and_grad(work.loss_fn)(params, batch)
        updates, opt_state = work.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step


def _cut(args, batch: int, count: int):
    """The step's arguments with every batch-leading leaf of its last argument cut to batch / count."""
    def leaf(x):
        if len(getattr(x, "shape", ())) and x.shape[0] == batch:
            return jax.ShapeDtypeStruct((batch // count, *x.shape[1:]), x.dtype)
        return x
    return (*args[:-1], jax.tree.map(leaf, args[-1]))


def _example(module, config: str, batch: int):
    work = module.workload(config, abstract=True, batch_size=batch)
    return _marked(work), work.args, batch


def _dp(name: str):
    step, params, opt_state, data = getattr(dp_programs, name)()
    batch = next(x.shape[0] for x in jax.tree.leaves(data) if len(getattr(x, "shape", ())))
    return step, (params, opt_state, data), batch


CASES = {
    "gpt": lambda: _example(gpt, "tiny", 48),
    "gpt-scanned-stack": lambda: _example(gpt_scan, "tiny", 48),
    "moe-top-k": lambda: _example(moe_topk, "small", 32),
    "convnet-relu-custom-jvp": lambda: _example(convnet, "tiny", 32),
    "bert-layer-dropout": lambda: _dp("bert_layer"),
    "embedding-bag": lambda: _dp("embedding_bag"),
    "linear-regression": lambda: _dp("linear_regression"),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(("ratio", "count"), [(8, 2), (4, 8)], ids=["fewer", "more"])
def test_extrapolated_jaxpr_is_the_traced_one(case, ratio, count):
    step, args, batch = CASES[case]()
    full = step_jaxpr(step, *args)[0]
    small = step_jaxpr(step, *_cut(args, batch, ratio))[0]
    made = extrapolate(full, small, ratio, count)
    assert made is not None, f"{case}: the two traces were not explained"
    assert str(made) == str(step_jaxpr(step, *_cut(args, batch, count))[0])


def test_a_custom_jvp_rule_is_extrapolated_too():
    """The convnet's relu is a custom_jvp call inside the loss: its rule, traced by jax at the call's shapes,
    differentiates at the new batch to what jax traces there."""
    step, args, batch = CASES["convnet-relu-custom-jvp"]()
    full, small = step_jaxpr(step, *args)[0], step_jaxpr(step, *_cut(args, batch, 8))[0]
    made, truth = extrapolate(full, small, 8, 2), step_jaxpr(step, *_cut(args, batch, 2))[0]

    def rules(closed):
        found = []

        def walk(jaxpr):
            for e in jaxpr.eqns:
                if e.primitive.name == "custom_jvp_call":
                    nonzero = (False,) * (len(e.invars) - e.params["num_consts"])
                    found.append(str(e.params["jvp_jaxpr_fun"].call_wrapped(*nonzero)[0]))
                for v in e.params.values():
                    inner = getattr(v, "jaxpr", None)
                    if inner is not None and hasattr(inner, "eqns"):
                        walk(inner)
        walk(closed.jaxpr)
        return found

    assert rules(truth) and rules(made) == rules(truth)


def test_numbers_that_are_not_proportional_to_the_batch_are_traced():
    """``x[1:]`` has N - 1 rows: neither constant nor proportional, so no third jaxpr is guessed."""
    def step(w, batch):
        return jnp.mean(batch["x"][1:] @ w)

    args = (jax.ShapeDtypeStruct((4, 4), jnp.float32), {"x": jax.ShapeDtypeStruct((48, 4), jnp.float32)})
    full, small = step_jaxpr(step, *args)[0], step_jaxpr(step, *_cut(args, 48, 8))[0]
    assert extrapolate(full, small, 8, 4) is None


def test_a_size_the_new_count_does_not_divide_is_traced():
    step, args, batch = CASES["linear-regression"]()
    small_args = _cut(args, batch, 8)
    full, small = step_jaxpr(step, *args)[0], step_jaxpr(step, *small_args)[0]
    assert extrapolate(full, small, 8, 3) is None  # 32768 / 3


def test_traced_step_makes_a_third_microbatch_count_without_tracing(monkeypatch):
    """The planner's full-batch trace and its first microbatch trace; a third count (the stage DP's choice)
    is extrapolated: the step is not traced again, and its split is the traced one's."""
    tx = optax.adamw(1e-3)
    seen = {"traces": 0}
    inner = train_step(tx)

    def step(params, opt_state, batch):
        seen["traces"] += 1
        return inner(params, opt_state, batch)

    f32 = jnp.float32
    params = {"w": [jax.ShapeDtypeStruct((8, 8), f32) for _ in range(3)]}
    data = {"x": jax.ShapeDtypeStruct((24, 8), f32), "y": jax.ShapeDtypeStruct((24, 8), f32)}
    args = (params, jax.eval_shape(tx.init, params), data)
    graph = trace(step, *args)
    traced = TracedStep.of(step, args, graph, split_step(graph.jaxpr))
    assert traced.at_microbatches(4) is not None and seen["traces"] == 2
    made = traced.at_microbatches(6)
    assert made is not None and seen["traces"] == 2 and traced.extrapolated == {6}
    truth = split_step(step_jaxpr(step, *traced.microbatch_args(6))[0])
    assert same_step(made, truth)
    assert [made.forward.avals[v].shape for v in made.forward.invars] == \
        [truth.forward.avals[v].shape for v in truth.forward.invars]


def test_scanned_stack_step_extrapolates_too():
    tx = optax.sgd(0.1)
    f32 = jnp.float32
    params = {"w": jax.ShapeDtypeStruct((4, 8, 8), f32)}
    data = {"x": jax.ShapeDtypeStruct((24, 8), f32), "y": jax.ShapeDtypeStruct((24, 8), f32)}
    args = (params, jax.eval_shape(tx.init, params), data)
    step = train_step(tx, scan_loss)
    full, small = step_jaxpr(step, *args)[0], step_jaxpr(step, *_cut(args, 24, 2))[0]
    assert str(extrapolate(full, small, 2, 3)) == str(step_jaxpr(step, *_cut(args, 24, 3))[0])
