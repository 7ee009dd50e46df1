"""Train steps with a ``cond`` (top level and inside a scan body) and with ``while`` loops (a counted one over
stacked layer weights, one with a data-dependent trip count), planned on (2, 4) and run sharded: 3 steps equal
to the same steps on one device (fp32, relative 1e-5).

The tracer flattens both (``ir/trace.py``); the runtime re-emits ``lax.switch`` / ``lax.while_loop`` with the
body's sharding constraints (``ir/graph.OpGraph.evaluate``). Two sharded compiles in all.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autoshard
from autoshard.ir.spec import Spec
from autoshard.passes.intra_op import IntraOpOptions
from compiled_examples import FAST_COMPILE

FAST = IntraOpOptions(time_limit_s=1.0)
# planned for 1x8-a100 under a per-device budget that replicated state overflows (~78 KiB replicated): the plans
# split parameters and activations, so the numerics cover sharded bodies and branches, not a replicated copy
PLAN = dict(mesh=(2, 4), cluster="1x8-a100", memory_budget=40 * 1024, num_stages=1, options=FAST,
            compiler_options=FAST_COMPILE)
LAYERS, WIDTH, BATCH = 3, 32, 16


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _params(seed: int = 0):
    rng = np.random.RandomState(seed)
    scale = 1.0 / np.sqrt(WIDTH)
    return {"w_in": (rng.standard_normal((WIDTH, 2 * WIDTH)) * scale).astype(np.float32),
            "w_out": (rng.standard_normal((2 * WIDTH, WIDTH)) * scale).astype(np.float32),
            "stack": (rng.standard_normal((LAYERS, WIDTH, WIDTH)) * scale).astype(np.float32)}


def _batch(flag: bool, seed: int = 1):
    rng = np.random.RandomState(seed)
    return {"x": rng.standard_normal((BATCH, WIDTH)).astype(np.float32),
            "y": rng.standard_normal((BATCH, WIDTH)).astype(np.float32),
            "flag": np.bool_(flag), "layer_flags": np.array([1, 0, 1], np.int32)}


def _cond_loss(params, batch):
    """A flag-selected activation (cond at the top level), then a scanned stack whose body picks one of two
    layer forms per layer (a cond inside the scan body)."""
    h = batch["x"] @ params["w_in"]
    h = jax.lax.cond(batch["flag"], jax.nn.relu, jnp.tanh, h)
    h = h @ params["w_out"]

    def layer(c, inp):
        w, f = inp
        c = jax.lax.cond(f > 0, lambda a: jnp.tanh(a @ w), lambda a: a + 0.5 * jnp.sin(a @ w), c)
        return c, None

    h, _ = jax.lax.scan(layer, h, (params["stack"], batch["layer_flags"]))
    return jnp.mean((h - batch["y"]) ** 2)


def _plain_loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["w_in"]) @ params["w_out"]
    for layer in range(LAYERS):
        h = jnp.tanh(h @ params["stack"][layer])
    return jnp.mean((h - batch["y"]) ** 2)


MAX_NORM, LR = 0.05, 0.1


def _while_step(params, opt_state, batch):
    """SGD with two while loops: the gradient halved until its global norm is below MAX_NORM (a data-dependent
    trip count), and a LARS-like per-layer update of the stacked weights by a counted while over the layers."""
    loss, grads = jax.value_and_grad(_plain_loss)(params, batch)
    grads = jax.lax.while_loop(lambda g: optax.tree.norm(g) > MAX_NORM,
                               lambda g: jax.tree.map(lambda t: 0.5 * t, g), grads)

    def per_layer(c):
        i, stack = c
        w = jax.lax.dynamic_index_in_dim(stack, i, keepdims=False)
        g = jax.lax.dynamic_index_in_dim(grads["stack"], i, keepdims=False)
        trust = jnp.linalg.norm(w) / (jnp.linalg.norm(g) + 1.0)
        return i + 1, jax.lax.dynamic_update_index_in_dim(stack, w - LR * trust * g, i, 0)

    _, stack = jax.lax.while_loop(lambda c: c[0] < LAYERS, per_layer, (0, params["stack"]))
    new = {"w_in": params["w_in"] - LR * grads["w_in"], "w_out": params["w_out"] - LR * grads["w_out"], "stack": stack}
    return new, opt_state, loss


def _sgd_step(loss_fn):
    tx = optax.sgd(0.1)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, tx


def _three_steps(step, sharded, params, opt_state, batches):
    reference = jax.jit(step, compiler_options=FAST_COMPILE)
    ref = (jax.tree.map(np.copy, params), jax.tree.map(np.copy, opt_state))
    state = (params, opt_state)
    for batch in batches:
        *ref, ref_loss = reference(*ref, batch)
        *state, loss = sharded(*state, batch)
        assert _rel(loss, ref_loss) <= 1e-5, f"loss {float(loss)} vs one device {float(ref_loss)}"
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(state[0]), jax.tree.leaves(ref[0])):
        assert _rel(got, want) <= 1e-5, f"{jax.tree_util.keystr(path)}: rel err {_rel(got, want):.2e}"


def test_cond_step_matches_one_device(devices8):
    step, tx = _sgd_step(_cond_loss)
    params = _params()
    sharded = autoshard.autoshard(step, **PLAN)
    _three_steps(step, sharded, params, tx.init(params), [_batch(True), _batch(False), _batch(True)])
    graph = sharded.spmd_step.graph
    assert any(not spec.is_replicated for k, spec in sharded.plan.input_specs.items() if "[0]" in k)
    assert "cond" not in graph.primitive_counts(), "a cond was left whole"
    conds = [r for r in graph.loops if r.kind == "cond"]
    assert len(conds) >= 3  # the top-level one, the one in the scan body, and their transposes
    scans = [r for r in graph.loops if r.kind == "scan"]
    assert any(s.body_start <= c.start and c.stop <= s.body_stop for s in scans for c in conds), \
        "no cond inside the scan body"
    text = sharded.lower(*jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
                                       (params, tx.init(params), _batch(True)))).as_text()
    assert "case" in text or "conditional" in text or "stablehlo.if" in text, "the cond was not re-emitted"


def test_while_step_matches_one_device(devices8):
    params = _params()
    # the stack stored split (flat input 0; at this size the planner would keep it whole): each iteration's
    # dynamic slice and update then runs on shards (tests/unit/test_cond_while.py: where it splits it itself)
    split_stack = IntraOpOptions(time_limit_s=1.0, pinned_inputs={0: Spec(((), ("x",), ("y",)))})
    sharded = autoshard.autoshard(_while_step, **{**PLAN, "options": split_stack}, while_trip_count=4)
    _three_steps(_while_step, sharded, params, (), [_batch(True, seed=s) for s in (1, 2, 3)])
    assert str(sharded.plan.input_specs["[0]['stack']"]) == "RS(x)S(y)"
    loops = {r.trip_source: r for r in sharded.spmd_step.graph.loops if r.kind == "while"}
    assert set(loops) == {"derived", "bound"}
    assert loops["derived"].length == LAYERS and loops["bound"].length == 4
    assert "while" not in sharded.spmd_step.graph.primitive_counts(), "a while loop was left whole"


def test_bad_while_trip_count_is_refused():
    for bad in (0, -2, 2.5, "8", True):
        with pytest.raises(ValueError, match="while_trip_count must be a positive integer"):
            autoshard.autoshard(_while_step, while_trip_count=bad)


def test_hlo_reader_counts_a_conditional_as_its_costliest_branch(devices8):
    """As the planner prices a cond (compiler/hlo.py): the cheap branch's all-reduce (a sum over the split rows)
    is not counted beside the costly elementwise branch; flipped, it is counted once."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from autoshard.compiler.hlo import read_hlo_collectives

    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = NamedSharding(mesh, P("x"))

    def costly(a):
        for _ in range(6):
            a = jnp.sin(a) * jnp.cos(a) + jnp.tanh(a)
        return a

    def cheap(a):
        return jnp.broadcast_to(jnp.sum(a, axis=0, keepdims=True), a.shape)

    def count(heavy):
        f = jax.jit(lambda p, a: jax.lax.cond(p, cheap, heavy, a), in_shardings=(None, rows), out_shardings=rows,
                    compiler_options=FAST_COMPILE)  # only its collectives are read
        text = f.lower(True, jnp.ones((64, 128))).compile().as_text()
        assert "conditional" in text
        return sum(c.count for c in read_hlo_collectives(text) if c.kind == "all-reduce")

    assert count(costly) == 0
    assert count(lambda a: a * 2.0) == 1


def test_nested_while_and_switch_re_emit_exactly(devices8):
    """A 3-way switch with a counted while in one branch and a cond in another, inside a while whose body has a
    cond: the flattened graph, run again (``OpGraph.evaluate``), equals the function for every branch index."""
    from autoshard.ir.trace import trace

    def f(i, x, w):
        def looped(a):
            return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, a))[1]

        y = jax.lax.switch(i, [looped, lambda a: jax.lax.cond(a.sum() > 0, jnp.sin, jnp.cos, a), lambda a: a], x)
        body = lambda c: (c[0] + 1, jax.lax.cond(c[0] > 0, lambda q: q * 2.0, lambda q: q - 1.0, c[1]))
        return jax.lax.while_loop(lambda c: c[0] < 2, body, (0, y))[1]

    spec = [jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((8, 8), jnp.float32),
            jax.ShapeDtypeStruct((8, 8), jnp.float32)]
    graph = trace(f, *spec)
    assert sorted(r.kind for r in graph.loops) == ["cond", "cond", "cond", "while", "while"]
    rng = np.random.RandomState(0)
    x, w = rng.standard_normal((8, 8)).astype(np.float32), (rng.standard_normal((8, 8)) / 3).astype(np.float32)
    again = jax.jit(lambda *a: graph.evaluate(list(a))[0], compiler_options=FAST_COMPILE)
    direct = jax.jit(f, compiler_options=FAST_COMPILE)
    for i in range(3):
        np.testing.assert_allclose(again(np.int32(i), x, w), direct(np.int32(i), x, w), rtol=1e-6, atol=1e-6)
