"""How XLA (jax 0.10, GSPMD/Shardy) places the reduction of a scanned stack's weight gradient: the facts an
emission of "accumulate the partial sums in the loop, reduce once after it" (issue 25, item 1) rests on.

A weight gradient in a scan body is a contraction over the batch, and the batch is split over the mesh: each
device holds a partial sum. Stacked as a scan output, XLA reduces it inside the while body, once per
iteration, whether the body pins it replicated or leaves it unpinned: a loop-carried buffer holds only a plain
sharding, never a pending partial sum. Written with the partial sums on an explicit leading axis of the
mesh's size (each device's own partial sum, that axis sharded like the batch), the body runs no collective and
one all-reduce follows the loop: the layout that keeps the reduction out of the body.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from autoshard.compiler.hlo import summarize_compiled

LAYERS, BATCH, WIDTH = 4, 64, 256
DATA = ("x", "y")  # the batch split over the whole (2, 4) mesh


def _mesh() -> Mesh:
    return Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ("x", "y"),
                axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _stacked_gradients(form: str, mesh: Mesh):
    """A scan of ``LAYERS`` weight gradients ``x^T g`` (x, g batch-split), stacked, returned replicated."""
    def pin(v, *spec):
        return jax.lax.with_sharding_constraint(v, NamedSharding(mesh, P(*spec)))

    def step(x, w, g):
        def body(carry, w_layer):
            h = carry @ w_layer  # per layer: a carry that depends on the layer, so nothing hoists out
            if form == "explicit partial axis":
                n = mesh.size
                xs, gs = pin(carry.reshape(n, BATCH // n, WIDTH), DATA), pin((g * h).reshape(n, BATCH // n, WIDTH), DATA)
                dw = pin(jnp.einsum("nbi,nbj->nij", xs, gs), DATA)  # each device's partial sum, not reduced
            else:
                dw = jnp.einsum("bi,bj->ij", carry, g * h)
                if form == "pinned replicated":
                    dw = pin(dw)
            return jnp.tanh(h), dw

        _, stacked = jax.lax.scan(body, x, w)
        if form == "explicit partial axis":
            stacked = stacked.sum(axis=1)  # the one reduction, after the loop
        return pin(stacked)

    batch = NamedSharding(mesh, P(DATA))
    args = (jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32), jax.ShapeDtypeStruct((LAYERS, WIDTH, WIDTH), jnp.float32),
            jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32))
    jitted = jax.jit(step, in_shardings=(batch, NamedSharding(mesh, P()), batch))
    return jitted, summarize_compiled(jitted.lower(*args).compile())


def _reductions(summary) -> list:
    return [c for c in summary.collectives if c.kind in ("all-reduce", "reduce-scatter")]


@pytest.mark.parametrize("form", ["unpinned", "pinned replicated"])
def test_a_stacked_partial_sum_is_reduced_in_every_iteration(form, devices8):
    _, summary = _stacked_gradients(form, _mesh())
    runs = [c.count for c in _reductions(summary)]
    assert runs == [LAYERS], f"reductions and their runs per step: {runs}"


def test_an_explicit_partial_axis_is_reduced_once_after_the_loop(devices8):
    mesh = _mesh()
    jitted, summary = _stacked_gradients("explicit partial axis", mesh)
    reductions = _reductions(summary)
    assert [c.count for c in reductions] == [1], [str(c) for c in reductions]
    # the whole stack in one collective: LAYERS x WIDTH x WIDTH float32
    assert reductions[0].nbytes == LAYERS * WIDTH * WIDTH * 4
    rng = np.random.default_rng(0)
    x, g = (rng.standard_normal((BATCH, WIDTH), np.float32) for _ in range(2))
    w = rng.standard_normal((LAYERS, WIDTH, WIDTH), np.float32) / np.sqrt(WIDTH)
    got = np.asarray(jitted(x, w, g))
    h, want = x.astype(np.float64), []
    for layer in range(LAYERS):  # the same scan in numpy, float64
        out = h @ w[layer]
        want.append(h.T @ (g * out))
        h = np.tanh(out)
    np.testing.assert_allclose(got, np.stack(want), rtol=1e-4, atol=1e-4)
