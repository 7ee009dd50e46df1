"""Random train steps (``fuzz_programs``): a step's jaxpr at a third batch size, extrapolated from its
jaxprs at two (``ir/rescale.py``), is either refused (None: the caller traces) or the jaxpr jax traces there,
printed the same; and most programs are extrapolated (a rule that refused everything would pass the first
half alone). Tracing only: nothing here compiles but the programs' PRNG keys."""
from __future__ import annotations

import dataclasses

import jax
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autoshard.ir.rescale import extrapolate
from autoshard.ir.trace import step_jaxpr
from fuzz_programs import build, programs

BATCH, RATIO = 24, 4
PROGRAMS = 40


def _shapes(tree, batch: int | None = None, count: int = 1):
    """ShapeDtypeStructs of ``tree``'s leaves; with ``batch``, leading dimensions of that size cut by ``count``."""
    def leaf(x):
        shape = tuple(x.shape)
        if batch is not None and shape[:1] == (batch,):
            shape = (batch // count, *shape[1:])
        return jax.ShapeDtypeStruct(shape, x.dtype)
    return jax.tree.map(leaf, tree)


def test_random_steps_extrapolate_to_their_trace():
    outcomes: list[bool] = []

    @settings(max_examples=PROGRAMS, derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(program=programs(3), count=st.sampled_from([2, 3, 6, 8]))
    def one(program, count):
        step, params, opt_state, batch = build(dataclasses.replace(program, batch=BATCH))
        state = (_shapes(params), _shapes(opt_state))
        full = step_jaxpr(step, *state, _shapes(batch))[0]
        small = step_jaxpr(step, *state, _shapes(batch, BATCH, RATIO))[0]
        made = extrapolate(full, small, RATIO, count)
        outcomes.append(made is not None)
        if made is not None:
            assert str(made) == str(step_jaxpr(step, *state, _shapes(batch, BATCH, count))[0]), program.describe()

    one()
    assert sum(outcomes) >= 0.8 * len(outcomes), f"only {sum(outcomes)} of {len(outcomes)} extrapolated"
