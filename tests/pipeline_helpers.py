"""What the pipeline numerics tests share: a train step with its loss marked, and leaf comparisons."""
from __future__ import annotations

import jax
import numpy as np
import optax

import autoshard
from compiled_examples import FAST_COMPILE


def marked_step(loss_fn, tx):
    """``(params, opt_state, batch) -> (params, opt_state, loss)`` with the loss marked for stage cuts."""
    def step(params, opt_state, batch):
        loss, grads = autoshard.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def assert_leaves_close(got_tree, want_tree, what: str) -> None:
    """Every leaf within 1e-5 relative, its scale floored at 1% of the largest leaf (tiny biases get only
    rounding noise as gradient)."""
    want_leaves = jax.tree.leaves(want_tree)
    floor = 1e-2 * max(float(np.max(np.abs(np.asarray(x)))) for x in want_leaves)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(got_tree), want_leaves):
        err = float(np.max(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))))
        scale = max(float(np.max(np.abs(np.asarray(want)))), floor)
        assert err / scale <= 1e-5, f"{what}{jax.tree_util.keystr(path)}: rel err {err / scale:.2e}"


def assert_adamw_steps_match(piped, step, params, opt_state, batch, steps: int = 3) -> None:
    """``steps`` AdamW steps of ``piped`` against ``jax.jit(step)`` on one device: the loss of every step within
    1e-5 relative, and the first moment after the first step leaf by leaf."""
    reference = jax.jit(step, compiler_options=FAST_COMPILE)
    ref, state = (params, opt_state), (params, opt_state)
    for k in range(steps):
        *ref, ref_loss = reference(*ref, batch)
        *state, loss = piped(*state, batch)
        assert rel(loss, ref_loss) <= 1e-5, f"step {k}: loss {loss} vs {ref_loss}"
        if k == 0:
            assert_leaves_close(state[1][0].mu, ref[1][0].mu, "mu")


def assert_dispatch_order(order, stages: int, micro: int) -> None:
    """Every forward and backward of every stage and microbatch once, each after what it reads."""
    import itertools

    assert sorted(order) == sorted((k, s, m) for k in "FB" for s in range(stages) for m in range(micro))
    at = {a: i for i, a in enumerate(order)}
    for s, m in itertools.product(range(stages), range(micro)):
        if s > 0:
            assert at[("F", s - 1, m)] < at[("F", s, m)]
        assert at[("F", s, m)] < at[("B", s, m)]
        if s + 1 < stages:
            assert at[("B", s + 1, m)] < at[("B", s, m)]


def peak_in_flight(order, holds) -> int:
    """The most microbatches (forwards without their backward yet) of the stages ``holds(stage)`` at once."""
    live = peak = 0
    for kind, stage, _ in order:
        if holds(stage):
            live += 1 if kind == "F" else -1
            peak = max(peak, live)
    return peak
