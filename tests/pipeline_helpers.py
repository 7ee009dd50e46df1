"""What the pipeline numerics tests share: a train step with its loss marked, and leaf comparisons."""
from __future__ import annotations

import jax
import numpy as np
import optax

import autoshard


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
