"""A value several ops read through one planned reshard is moved once (``runtime/spmd.SharedPins``).

XLA does not always merge equal reshards: one chain of ``with_sharding_constraint`` per reading op (here of
two steps, as planned chains often are; equal one-step constraints it merged) compiles to one collective per
reader (the control below), while the planner prices a value resharded to one layout once however many ops
read it there. Checked on the compiled HLO of a small program on 8 simulated devices.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autoshard.compiler.hlo import summarize_compiled
from autoshard.ir.spec import Spec
from autoshard.runtime.spmd import SharedPins, make_jax_mesh, named_sharding, pin, pin_op_inputs

pytestmark = pytest.mark.sim


def _compiled(shared: bool):
    mesh = make_jax_mesh((2, 4), ("x", "y"))
    rows = Spec.from_partition_spec(("x", "y"), 2)  # split by rows over both axes
    cols = Spec.from_partition_spec((None, ("x", "y")), 2)  # the same array split by columns: an all-to-all
    # a planned reshard of two steps (XLA merged equal one-step constraints here, not these)
    moves = {0: (Spec.from_partition_spec(("y", "x"), 2), cols)}

    def f(a, w1, w2, w3):
        a = pin(jnp.sin(a), (rows,), mesh)
        pins = SharedPins(mesh) if shared else None
        total = None
        for w in (w1, w2, w3):  # three readers, each planned to read ``a`` by columns, with work between them
            (moved,) = pin_op_inputs([a], moves, mesh, pins)
            y = jnp.tanh(moved) * w
            total = y if total is None else pin(total + y, (rows,), mesh)
        return total

    a = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=named_sharding(rows, mesh))
    w = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=named_sharding(cols, mesh))
    return summarize_compiled(jax.jit(f).lower(a, w, w, w).compile()), f


def test_a_value_read_by_several_ops_is_moved_once(devices8):
    shared, f = _compiled(shared=True)
    separate, _ = _compiled(shared=False)
    # the control: with one constraint per reader XLA moves ``a`` once per reader; shared, once
    moves_of_a = [c for c in separate.collectives if c.kind == "all-to-all"]
    assert len(moves_of_a) - len([c for c in shared.collectives if c.kind == "all-to-all"]) == 2
    assert sum(shared.bytes_by_kind.values()) < sum(separate.bytes_by_kind.values())
    rng = np.random.default_rng(0)  # and it computes the same thing
    a, w1, w2, w3 = (rng.standard_normal((64, 64)).astype(np.float32) for _ in range(4))
    expected = sum(np.tanh(np.sin(a)) * w for w in (w1, w2, w3))
    np.testing.assert_allclose(np.asarray(jax.jit(f)(a, w1, w2, w3)), expected, rtol=1e-5, atol=1e-5)
