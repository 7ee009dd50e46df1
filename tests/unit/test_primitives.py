"""Every primitive of the installed jax.lax is classified: a strategy rule, inlined by the tracer, or declared
replicated with a reason; and the primitives jax 0.11 / 0.12 added (log2, one_minus_square, polynomial) have
their rule, their liveness kind and their FLOPs, whether or not the installed jax has them.

A new jax that adds a primitive fails ``test_every_lax_primitive_is_classified`` until the primitive gets a rule
(passes/strategies/) or a declaration (passes/strategies/replicated.py).
"""
from __future__ import annotations

import importlib
import pkgutil
import warnings

import jax
import jax._src.lax
import jax.numpy as jnp
import pytest
from jax._src import core as jax_core

from autoshard.ir.flops import op_flops
from autoshard.ir.graph import Op, Role, Value
from autoshard.ir.spec import Spec
from autoshard.ir.trace import INLINED, trace
from autoshard.meshes.cluster import get_cluster
from autoshard.meshes.logical import make_logical_mesh
from autoshard.passes.liveness import OpKind, op_kind
from autoshard.passes.strategies import REPLICATED, RULES, UnsupportedPrimitiveWarning, strategies_for

NEW_IN_JAX_011 = ("log2", "one_minus_square", "polynomial")  # polynomial: 0.12


def lax_primitives() -> dict[str, str]:
    """Primitive name -> the module that defines it, over jax.lax and every jax._src.lax module."""
    modules = [jax.lax]
    for info in pkgutil.walk_packages(jax._src.lax.__path__, "jax._src.lax."):
        modules.append(importlib.import_module(info.name))
    found: dict[str, str] = {}
    for module in modules:
        for value in vars(module).values():
            if isinstance(value, jax_core.Primitive):
                found.setdefault(value.name, module.__name__)
    return found


def test_every_lax_primitive_is_classified():
    primitives = lax_primitives()
    assert len(primitives) > 150 and {"add", "dot_general", "psum", "cholesky"} <= set(primitives)
    loose = sorted(f"{name} ({module})" for name, module in primitives.items()
                   if name not in RULES and name not in REPLICATED and name not in INLINED)
    assert not loose, (f"jax {jax.__version__} has primitives autoshard does not classify: {loose}; give each a "
                       "strategy rule (passes/strategies/) or declare it in passes/strategies/replicated.py")
    assert not set(RULES) & set(REPLICATED)


def _mesh():
    return make_logical_mesh(get_cluster("cpu-8"), (2, 4))


def _op(primitive: str, in_shapes: list[tuple[int, ...]], out_shape: tuple[int, ...]) -> tuple[Op, list, list]:
    ins = [Value(i, shape, "float32", Role.ACTIVATION) for i, shape in enumerate(in_shapes)]
    out = Value(len(ins), out_shape, "float32", Role.ACTIVATION)
    flops = op_flops(primitive, {}, in_shapes, [out_shape])
    return Op(0, primitive, {}, tuple(v.id for v in ins), (out.id,), flops, 0.0), ins, [out]


@pytest.mark.parametrize("primitive", NEW_IN_JAX_011)
def test_the_new_elementwise_primitives_split_like_elementwise_ops(primitive):
    coefficients = [()] * 3 if primitive == "polynomial" else []  # polynomial(x, c0, c1, c2), scalar c
    op, ins, outs = _op(primitive, [(8, 16), *coefficients], (8, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsupportedPrimitiveWarning)
        found = strategies_for(op, ins, outs, _mesh())
    out_specs = {s.out_specs[0] for s in found}
    assert Spec((("x",), ("y",))) in out_specs and Spec((("y",), ("x",))) in out_specs
    for s in found:  # x follows the output; coefficients stay whole
        assert s.in_specs[0] == s.out_specs[0] and all(spec.used_axes == () for spec in s.in_specs[1:])
        assert not s.collectives
    assert op_kind(op) == OpKind.ELEMENTWISE


def test_flops_of_the_new_primitives_count_their_lowered_ops():
    assert op_flops("one_minus_square", {}, [(4, 8)], [(4, 8)]) == 3 * 32  # (1 + x) * (1 - x)
    assert op_flops("log2", {}, [(4, 8)], [(4, 8)]) == 2 * 32  # log(x) * (1 / ln 2)
    assert op_flops("polynomial", {}, [(4, 8), (), (), ()], [(4, 8)]) == 2 * 2 * 32  # two Horner steps
    assert op_flops("tanh", {}, [(4, 8)], [(4, 8)]) == 32


@pytest.mark.skipif(not hasattr(jax.lax, "one_minus_square"), reason="jax < 0.11 has no one_minus_square")
def test_tanh_gradient_traces_to_one_minus_square_and_plans_without_warning():
    def loss(w, x):
        return jnp.tanh(x @ w).sum()

    args = (jax.ShapeDtypeStruct((16, 32), jnp.float32), jax.ShapeDtypeStruct((8, 16), jnp.float32))
    graph = trace(jax.grad(loss), *args)
    assert "one_minus_square" in {op.primitive for op in graph.ops}
    mesh = _mesh()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsupportedPrimitiveWarning)
        for op in graph.ops:
            strategies_for(op, [graph.values[v] for v in op.inputs], [graph.values[v] for v in op.outputs], mesh)
