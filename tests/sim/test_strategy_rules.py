"""Every strategy of every rule, checked against the unsharded op by simulating shards.

The idea of PyTorch DTensor's ``strategy_validation``: for each small concrete
case (one jax equation) and each strategy its rule offers on a (2, 4) mesh
(a few on (8,)), run the primitive under ``jax.shard_map`` on each device's
local input shards, with shape-carrying params localized, then apply exactly
the strategy's collectives (psum / pmax / pmin / psum_scatter ...) and read
the result with the strategy's output specs. It must equal the op on one
device. ``check_vma`` makes shard_map reject an output claimed replicated
that still varies across devices, so a strategy that forgets a reduction
fails too. ``test_simulation_catches_wrong_strategies`` keeps the checker
honest with hand-made wrong strategies.

All strategies of one case run in one jitted program, compiled once.
"""
from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend import core as jcore
try:  # jax 0.10 / 0.11; jax 0.12 keeps it private
    from jax._src.lax.parallel import all_gather_invariant
except ImportError:
    from jax._src.lax.parallel import _all_gather_invariant as all_gather_invariant
from jax.sharding import NamedSharding, PartitionSpec as P

from autoshard.ir.graph import Op, Role, Value
from autoshard.ir.primitives import INLINED_CALLS
from autoshard.ir.spec import Collective, Spec
from autoshard.meshes.cluster import get_cluster
from autoshard.meshes.logical import LogicalMesh, make_logical_mesh
from autoshard.passes.strategies import RULES, Strategy, localize_params, strategies_for
from autoshard.passes.strategies.base import UnsupportedPrimitiveWarning
from autoshard.passes.strategies.control import GLOBAL_INDEXED, LOCAL_IDENTITY, UNPLANNED_LOOPS
from autoshard.passes.strategies.indexing import SUMMING_SCATTERS
from compiled_examples import FAST_COMPILE  # the programs' results are only compared as numbers

CALLS = INLINED_CALLS  # walked into, as the tracer does
MESHES = {"2x4": ((2, 4), ("x", "y")), "8": ((8,), ("x",))}
# (XLA of jax 0.12 no longer knows the fusion-emitter switch; fast_compile() drops it there.)


@functools.cache
def fast_compile() -> dict[str, Any]:
    """FAST_COMPILE less the options this XLA does not know."""
    try:
        jax.jit(lambda x: x + 1).lower(np.float32(1)).compile(FAST_COMPILE)
        return FAST_COMPILE
    except jax.errors.JaxRuntimeError as err:
        if "No such compile option" not in str(err):
            raise
        return {k: v for k, v in FAST_COMPILE.items() if k != "xla_cpu_use_fusion_emitters"}


# ---- building one Op from a function -------------------------------------------------------------


@dataclass(frozen=True, eq=False)  # hashed by identity: build() caches per case
class Case:
    name: str
    prim: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    mesh: str = "2x4"
    check_vma: bool = True  # False only where jax's own impl of the primitive is not vma-typed


@dataclass(frozen=True)
class Built:
    op: Op
    ins: tuple[Value, ...]
    outs: tuple[Value, ...]
    in_vals: tuple[Any, ...]


def _bodies(eqn: Any) -> list[tuple[jcore.Jaxpr, Sequence[Any]]]:
    if eqn.primitive.name not in CALLS:
        return []
    out = []
    for v in eqn.params.values():
        if isinstance(v, jcore.ClosedJaxpr):
            out.append((v.jaxpr, v.consts))
        elif isinstance(v, jcore.Jaxpr):
            out.append((v, ()))
    return out


def _contains(jaxpr: jcore.Jaxpr, prim: str) -> bool:
    return any(e.primitive.name == prim or any(_contains(j, prim) for j, _ in _bodies(e)) for e in jaxpr.eqns)


def _find(jaxpr: jcore.Jaxpr, consts: Sequence[Any], args: Sequence[Any], prim: str) -> tuple[Any, list[Any]]:
    """The first equation of ``prim`` (looking into call bodies) and its concrete input values."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))

    def read(v: Any) -> Any:
        return np.asarray(v.val, dtype=v.aval.dtype) if isinstance(v, jcore.Literal) else env[v]

    for eqn in jaxpr.eqns:
        vals = [read(v) for v in eqn.invars]
        if eqn.primitive.name == prim:
            return eqn, vals
        for body, body_consts in _bodies(eqn):
            if _contains(body, prim):
                return _find(body, body_consts, vals, prim)
        outs = eqn.primitive.bind(*vals, **eqn.primitive.get_bind_params(eqn.params))
        env.update(zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs]))
    raise AssertionError(f"no {prim!r} equation in the jaxpr")


def _value(vid: int, aval: Any, role: Role) -> Value:
    try:
        dtype = np.dtype(aval.dtype).name
    except TypeError:  # PRNG key dtypes
        dtype = str(aval.dtype)
    return Value(vid, tuple(aval.shape), dtype, role)


@functools.cache
def build(case: Case) -> Built:
    closed = jax.make_jaxpr(case.fn)(*case.args)
    eqn, vals = _find(closed.jaxpr, closed.consts, case.args, case.prim)
    ins = tuple(_value(i, v.aval, Role.CONSTANT if isinstance(v, jcore.Literal) else Role.ACTIVATION)
                for i, v in enumerate(eqn.invars))
    outs = tuple(_value(len(ins) + k, v.aval, Role.ACTIVATION) for k, v in enumerate(eqn.outvars))
    op = Op(0, eqn.primitive.name, dict(eqn.params), tuple(v.id for v in ins), tuple(v.id for v in outs),
            flops=0.0, bytes_accessed=0.0, prim=eqn.primitive)
    return Built(op, ins, outs, tuple(vals))


@functools.cache
def logical_mesh(name: str) -> LogicalMesh:
    shape, axes = MESHES[name]
    return make_logical_mesh(get_cluster("cpu-8"), shape, axes)


@functools.cache
def device_mesh(name: str) -> jax.sharding.Mesh:
    shape, axes = MESHES[name]
    # Auto axes: with Explicit ones shard_map insists the arguments already carry the in_specs.
    return jax.make_mesh(shape, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


# ---- running one strategy on shards --------------------------------------------------------------


def _pspec(spec: Spec) -> P:
    return P(*spec.partition_entries())


def _scatter_dim(spec: Spec, axes: tuple[str, ...]) -> int:
    for d, dim_axes in enumerate(spec.dims):
        if dim_axes[len(dim_axes) - len(axes):] == axes and dim_axes:
            return d
    raise AssertionError(f"reduce-scatter over {axes} but no output dim of {spec} ends with them")


def _pre_collective_specs(strategy: Strategy) -> list[Spec]:
    """Output specs before the collectives: a reduce-scatter's axes are not on its operand yet."""
    specs = list(strategy.out_specs)
    for c in strategy.collectives:
        if c.kind == "reduce-scatter":
            d = _scatter_dim(specs[0], c.axes)
            dims = list(specs[0].dims)
            dims[d] = dims[d][: len(dims[d]) - len(c.axes)]
            specs[0] = Spec(tuple(dims))
    return specs


def _linear_index(axes: tuple[str, ...], sizes: dict[str, int]) -> Any:
    index = 0
    for a in axes:
        index = index * sizes[a] + lax.axis_index(a)
    return index


def _all_reduce(y: Any, axes: tuple[str, ...], reduction: str | None) -> Any:
    if reduction == "sum":
        return lax.psum(y, axes)
    if reduction == "max":
        return lax.pmax(y, axes)
    if reduction == "min":
        return lax.pmin(y, axes)
    # One slice per device along a new leading dim; the invariant flavour (public lax.all_gather
    # types its result as still varying, which check_vma rejects for a replicated out spec).
    stacked = all_gather_invariant(y, axes, axis=0, tiled=False)
    if reduction == "prod":
        return jnp.prod(stacked, axis=0, dtype=y.dtype)
    if reduction in ("and", "or", "xor"):
        prim = {"and": lax.reduce_and_p, "or": lax.reduce_or_p, "xor": lax.reduce_xor_p}[reduction]
        return prim.bind(stacked, axes=(0,))
    raise AssertionError(f"strategy reduces with unknown reduction {reduction!r}")


def _apply_collectives(ys: list[Any], strategy: Strategy, sizes: dict[str, int]) -> list[Any]:
    reduces = [c for c in strategy.collectives if c.kind == "all-reduce"]
    scatters = [c for c in strategy.collectives if c.kind == "reduce-scatter"]
    assert len(strategy.collectives) == len(reduces) + len(scatters), f"unexpected collectives in {strategy}"
    # one all-reduce per output for each split reduced factor, over its axes (XLA reduces each factor apart)
    groups = list(dict.fromkeys(c.axes for c in reduces))
    assert len(reduces) == len(ys) * len(groups), strategy
    assert len({a for g in groups for a in g}) == sum(len(g) for g in groups), strategy  # disjoint axes
    for axes in groups:
        ys = [_all_reduce(y, axes, strategy.reduction) for y in ys]
    for c in scatters:
        assert len(ys) == 1, strategy
        d = _scatter_dim(strategy.out_specs[0], c.axes)
        if strategy.reduction == "sum":
            ys = [lax.psum_scatter(ys[0], c.axes, scatter_dimension=d, tiled=True)]
        else:
            full = _all_reduce(ys[0], c.axes, strategy.reduction)
            chunk = full.shape[d] // int(np.prod([sizes[a] for a in c.axes]))
            ys = [lax.dynamic_slice_in_dim(full, _linear_index(c.axes, sizes) * chunk, chunk, d)]
    return ys


def _vma(x: Any) -> set[str]:
    """The manual axes ``x`` varies over (jax 0.10 keeps them on ``aval.mat.varying``)."""
    return set(jax.typeof(x).mat.varying)


def _same_vma(xs: Sequence[Any]) -> list[Any]:
    """Mark every input varying over the axes any input varies over (what jnp does before a bind)."""
    union = set().union(*(_vma(x) for x in xs)) if xs else set()
    out = []
    for x in xs:
        missing = tuple(sorted(union - _vma(x)))
        out.append(lax.pcast(x, missing, to="varying") if missing else x)
    return out


def _reduced_axes(strategy: Strategy) -> tuple[str, ...]:
    return tuple(dict.fromkeys(a for c in strategy.collectives for a in c.axes))


def _device_block(y: Any, spec: Spec, sizes: dict[str, int]) -> Any:
    """This device's block of the whole array ``y`` under ``spec`` (inside shard_map)."""
    starts = []
    for d, axes in enumerate(spec.dims):
        index = 0
        for a in axes:  # the first axis is the major one
            index = index * sizes[a] + lax.axis_index(a)
        starts.append(index * (y.shape[d] // int(np.prod([sizes[a] for a in axes], dtype=int))))
    local = spec.shard_shape(y.shape, sizes)
    return lax.dynamic_slice(y, starts, local) if y.ndim else y


def shard_fn(built: Built, strategy: Strategy, mesh_name: str, check_vma: bool = True) -> Callable[..., Any]:
    """``jax.shard_map`` of the primitive on local shards, then the strategy's collectives."""
    op, ins, outs = built.op, built.ins, built.outs
    sizes = dict(zip(*MESHES[mesh_name][::-1]))
    local_in = [s.shard_shape(v.shape, sizes) for s, v in zip(strategy.in_specs, ins)]
    local_out = [s.shard_shape(v.shape, sizes) for s, v in zip(_pre_collective_specs(strategy), outs)]
    params = localize_params(op, local_in, local_out)

    def local(*xs: Any) -> tuple[Any, ...]:
        xs = list(xs)
        if op.primitive in SUMMING_SCATTERS and strategy.collectives:
            # The partial-sum scatter contract: the operand counts on the first shard only.
            first = functools.reduce(jnp.logical_and, [lax.axis_index(a) == 0 for a in _reduced_axes(strategy)])
            xs[0] = jnp.where(first, xs[0], jnp.zeros_like(xs[0]))
        if op.primitive in LOCAL_IDENTITY:
            ys = xs
        elif op.primitive in GLOBAL_INDEXED:  # a shard is the slice of the whole result (the runtime binds it whole)
            whole = op.prim.bind(*xs, **op.params)
            ys = [_device_block(y, spec, sizes) for y, spec in zip(whole if op.prim.multiple_results else [whole],
                                                              _pre_collective_specs(strategy))]
        else:
            try:
                ys = op.prim.bind(*xs, **params)
            except ValueError as e:  # most lax ops want equal varying axes; jnp would have cast them
                if "varying manual axes" not in str(e):
                    raise
                ys = op.prim.bind(*_same_vma(xs), **params)
            ys = list(ys) if op.prim.multiple_results else [ys]
        for y, shape in zip(ys, local_out):
            assert tuple(y.shape) == tuple(shape), f"local result {y.shape}, expected {shape} under {strategy}"
        return tuple(_apply_collectives(ys, strategy, sizes))

    return jax.shard_map(local, mesh=device_mesh(mesh_name), in_specs=tuple(map(_pspec, strategy.in_specs)),
                         out_specs=tuple(map(_pspec, strategy.out_specs)), check_vma=check_vma)


def run_strategies(built: Built, strategies: Sequence[Strategy], mesh_name: str, check_vma: bool = True) -> list[Any]:
    """Outputs of every strategy (an exception object where tracing one failed), from one compile."""
    errors: dict[int, Exception] = {}

    def program(*args: Any) -> list[Any]:
        results = []
        for k, s in enumerate(strategies):
            try:
                results.append(shard_fn(built, s, mesh_name, check_vma)(*args))
            except Exception as e:  # noqa: BLE001  (reported by the test of that strategy)
                errors[k] = e
                results.append(None)
        return results

    compiled = jax.jit(program).lower(*built.in_vals).compile(fast_compile())
    results = compiled(*built.in_vals)
    return [errors.get(k, r) for k, r in enumerate(results)]


def reference(built: Built) -> list[Any]:
    ys = built.op.prim.bind(*built.in_vals, **built.op.params)
    return list(ys) if built.op.prim.multiple_results else [ys]


def _host(x: Any) -> np.ndarray:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def assert_same(got: Sequence[Any], want: Sequence[Any], what: str) -> None:
    assert len(got) == len(want), what
    for g, w in zip(got, want):
        g, w = _host(g), _host(w)
        assert g.shape == w.shape and g.dtype == w.dtype, f"{what}: {g.dtype}{g.shape} vs {w.dtype}{w.shape}"
        if jnp.issubdtype(w.dtype, jnp.inexact):
            tol = 2e-5 if jnp.finfo(w.dtype).bits >= 32 else 1e-2
            wide = np.complex128 if jnp.issubdtype(w.dtype, jnp.complexfloating) else np.float64
            np.testing.assert_allclose(g.astype(wide), w.astype(wide), rtol=tol, atol=tol, err_msg=what)
        else:
            np.testing.assert_array_equal(g, w, err_msg=what)


# ---- the cases: one small concrete equation each ---------------------------------------------------

_rng = np.random.default_rng(0)


def f32(*shape: int, lo: float = 0.1, hi: float = 0.9) -> np.ndarray:
    return _rng.uniform(lo, hi, shape).astype(np.float32)


def normal(*shape: int) -> np.ndarray:
    return _rng.normal(size=shape).astype(np.float32)


def ints(*shape: int, hi: int = 8, dtype: Any = np.int32) -> np.ndarray:
    return _rng.integers(0, hi, shape).astype(dtype)


def bools(*shape: int) -> np.ndarray:
    return _rng.uniform(size=shape) < 0.5


def c64(*shape: int) -> np.ndarray:
    return (normal(*shape) + 1j * normal(*shape)).astype(np.complex64)


def _conv(lhs: Any, rhs: Any, strides: tuple[int, ...] = (1, 1), padding: str = "SAME", groups: int = 1,
          dn: tuple[str, str, str] = ("NHWC", "HWIO", "NHWC")) -> Any:
    return lax.conv_general_dilated(lhs, rhs, strides, padding, dimension_numbers=dn, feature_group_count=groups)


def _max_pool(x: Any) -> Any:
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


UNARY_CASES = {  # primitive: (function, input)
    "abs": (lax.abs, normal(4)), "neg": (lax.neg, normal(4)), "sign": (lax.sign, normal(4)),
    "floor": (lax.floor, normal(4)), "ceil": (lax.ceil, normal(4)), "round": (lax.round, normal(4)),
    "is_finite": (lax.is_finite, normal(4)), "exp": (lax.exp, f32(4)), "exp2": (lax.exp2, f32(4)),
    "expm1": (lax.expm1, f32(4)), "log": (lax.log, f32(4)), "log1p": (lax.log1p, f32(4)),
    "sqrt": (lax.sqrt, f32(4)), "rsqrt": (lax.rsqrt, f32(4)), "cbrt": (lax.cbrt, f32(4)),
    "square": (lax.square, f32(4)), "integer_pow": (lambda x: lax.integer_pow(x, 3), f32(4)),
    "logistic": (lax.logistic, normal(4)), "sin": (lax.sin, f32(4)), "cos": (lax.cos, f32(4)),
    "tan": (lax.tan, f32(4)), "asin": (lax.asin, f32(4)), "acos": (lax.acos, f32(4)), "atan": (lax.atan, f32(4)),
    "sinh": (lax.sinh, f32(4)), "cosh": (lax.cosh, f32(4)), "tanh": (lax.tanh, normal(4)),
    "asinh": (lax.asinh, f32(4)), "acosh": (lax.acosh, 1 + f32(4)), "atanh": (lax.atanh, f32(4)),
    "erf": (lax.erf, normal(4)), "erfc": (lax.erfc, normal(4)), "erf_inv": (lax.erf_inv, f32(4)),
    "lgamma": (lax.lgamma, f32(4)), "digamma": (lax.digamma, f32(4)), "bessel_i0e": (lax.bessel_i0e, f32(4)),
    "bessel_i1e": (lax.bessel_i1e, f32(4)), "real": (lax.real, c64(4)), "imag": (lax.imag, c64(4)),
    "conj": (lax.conj, c64(4)), "not": (lax.bitwise_not, ints(4)), "population_count": (lax.population_count, ints(4)),
    "clz": (lax.clz, ints(4)), "stop_gradient": (lax.stop_gradient, normal(4)), "copy": (jnp.copy, normal(4)),
    "reduce_precision": (lambda x: lax.reduce_precision(x, 5, 10), normal(4)),
}
# primitives newer jax emits (log2, one_minus_square: 0.11; polynomial: 0.12), simulated where jax has them
NEWER_CASES = {
    "log2": (lambda: (lax.log2, (f32(4),))),
    "one_minus_square": (lambda: (lax.one_minus_square, (normal(4),))),
    "polynomial": (lambda: (lambda x: lax.polynomial(x, [1.0, -2.0, 0.5]), (normal(4),))),
}
BINARY_CASES = {
    "add": (lax.add, normal(2, 4), normal(2, 4)), "sub": (lax.sub, normal(2, 4), normal(2, 4)),
    "mul": (lax.mul, normal(2, 4), normal(2, 4)), "div": (lax.div, normal(2, 4), f32(2, 4)),
    "rem": (lax.rem, normal(2, 4), f32(2, 4)), "pow": (lax.pow, f32(2, 4), normal(2, 4)),
    "max": (lax.max, normal(2, 4), normal(2, 4)), "min": (lax.min, normal(2, 4), normal(2, 4)),
    "atan2": (lax.atan2, normal(2, 4), normal(2, 4)), "nextafter": (lax.nextafter, normal(2, 4), normal(2, 4)),
    "complex": (lax.complex, normal(2, 4), normal(2, 4)),
    "eq": (lax.eq, ints(2, 4, hi=3), ints(2, 4, hi=3)), "ne": (lax.ne, ints(2, 4, hi=3), ints(2, 4, hi=3)),
    "lt": (lax.lt, normal(2, 4), normal(2, 4)), "le": (lax.le, ints(2, 4, hi=3), ints(2, 4, hi=3)),
    "gt": (lax.gt, normal(2, 4), normal(2, 4)), "ge": (lax.ge, normal(2, 4), normal(2, 4)),
    "and": (lax.bitwise_and, bools(2, 4), bools(2, 4)), "or": (lax.bitwise_or, ints(2, 4), ints(2, 4)),
    "xor": (lax.bitwise_xor, ints(2, 4), ints(2, 4)),
    "shift_left": (lax.shift_left, ints(2, 4), ints(2, 4, hi=4)),
    "shift_right_logical": (lax.shift_right_logical, ints(2, 4, hi=1000), ints(2, 4, hi=4)),
    "shift_right_arithmetic": (lax.shift_right_arithmetic, ints(2, 4, hi=1000) - 500, ints(2, 4, hi=4)),
    "igamma": (lax.igamma, 1 + f32(2, 4), f32(2, 4)), "igammac": (lax.igammac, 1 + f32(2, 4), f32(2, 4)),
    "igamma_grad_a": (lax.igamma_grad_a, 1 + f32(2, 4), f32(2, 4)),
    "polygamma": (lax.polygamma, np.ones((2, 4), np.float32), 1 + f32(2, 4)),
    "zeta": (lax.zeta, 2 + f32(2, 4), f32(2, 4)),
}


def _cases() -> list[Case]:
    cases = [Case(p, p, fn, (x,)) for p, (fn, x) in UNARY_CASES.items()]
    cases += [Case(p, p, fn, (a, b)) for p, (fn, a, b) in BINARY_CASES.items()]
    cases += [Case(p, p, *make()) for p, make in NEWER_CASES.items() if hasattr(lax, p)]
    add_any = jax._src.ad_util.add_jaxvals_p  # the transpose's accumulator, no public constructor
    cases += [
        Case("add_any", "add_any", add_any.bind, (normal(4, 8), normal(4, 8))),
        Case("mul/scalar", "mul", lambda x: x * 2.0, (normal(2, 4),)),
        Case("add/size1-broadcast", "add", lax.add, (normal(1, 8), normal(4, 8))),
        Case("eq/one-hot", "eq", lambda i: jax.nn.one_hot(i, 8), (ints(4, hi=8),)),
        Case("clamp/scalar", "clamp", lambda x: lax.clamp(-0.5, x, 0.5), (normal(2, 4),)),
        Case("clamp/arrays", "clamp", lax.clamp, (normal(2, 4) - 1, normal(2, 4), normal(2, 4) + 1)),
        Case("regularized_incomplete_beta", "regularized_incomplete_beta", lax.betainc,  # its while_loop
             (1 + f32(2, 4), 1 + f32(2, 4), f32(2, 4)), check_vma=False),  # carry is not vma-typed in jax 0.10
        Case("select_n/array", "select_n", lax.select_n, (bools(2, 4), normal(2, 4), normal(2, 4))),
        Case("select_n/scalar-pred", "select_n", lax.select_n, (np.bool_(True), normal(2, 4), normal(2, 4))),
        Case("select_n/3-way", "select_n", lax.select_n, (ints(2, 4, hi=3), normal(2, 4), normal(2, 4), normal(2, 4))),
        Case("convert_element_type/int", "convert_element_type", lambda x: x.astype(jnp.int32), (normal(2, 4) * 9,)),
        Case("convert_element_type/bf16", "convert_element_type", lambda x: x.astype(jnp.bfloat16), (normal(2, 4),)),
        Case("bitcast_convert_type/same-width", "bitcast_convert_type",
             lambda x: lax.bitcast_convert_type(x, jnp.int32), (normal(2, 4),)),
        Case("bitcast_convert_type/narrow", "bitcast_convert_type",
             lambda x: lax.bitcast_convert_type(x, jnp.uint8), (normal(2, 4),)),
        Case("bitcast_convert_type/widen", "bitcast_convert_type",
             lambda x: lax.bitcast_convert_type(x, jnp.float32), (ints(2, 4, 4, hi=255, dtype=np.uint8),)),
        Case("exp/mesh8", "exp", lax.exp, (f32(8, 4),), mesh="8"),
        Case("select_n/shape-6x10", "select_n", lax.select_n, (bools(6, 10), normal(6, 10), normal(6, 10))),
    ]
    # dot_general and conv
    cases += [
        Case("dot_general/matmul", "dot_general", jnp.matmul, (normal(8, 16), normal(16, 8))),
        Case("dot_general/matvec", "dot_general", jnp.matmul, (normal(8, 16), normal(16))),
        Case("dot_general/inner", "dot_general", jnp.dot, (normal(16), normal(16))),
        Case("dot_general/attention-scores", "dot_general", lambda q, k: jnp.einsum("bthd,bshd->bhts", q, k),
             (normal(2, 4, 4, 2), normal(2, 4, 4, 2))),
        Case("dot_general/two-contracting", "dot_general", lambda a, b: jnp.einsum("bij,ijk->bk", a, b),
             (normal(2, 2, 4), normal(2, 4, 4))),
        Case("dot_general/moe-dispatch", "dot_general", lambda d, x: jnp.einsum("nec,nd->ecd", d, x),
             (normal(4, 2, 2), normal(4, 2))),
        Case("dot_general/bf16-to-f32", "dot_general",
             lambda a, b: lax.dot(a, b, preferred_element_type=jnp.float32),
             (normal(4, 4).astype(jnp.bfloat16), normal(4, 4).astype(jnp.bfloat16))),
        Case("dot_general/mesh8", "dot_general", jnp.matmul, (normal(8, 16), normal(16, 8)), mesh="8"),
        Case("dot_general/shape-6x10", "dot_general", jnp.matmul, (normal(6, 10), normal(10, 6))),
        Case("conv/nhwc", "conv_general_dilated", _conv, (normal(4, 5, 5, 2), normal(3, 3, 2, 4))),
        Case("conv/strided-valid", "conv_general_dilated", lambda x, w: _conv(x, w, (2, 2), "VALID"),
             (normal(4, 7, 7, 2), normal(3, 3, 2, 4))),
        Case("conv/nchw-1d", "conv_general_dilated", lambda x, w: _conv(x, w, (1,), "SAME", dn=("NCH", "OIH", "NCH")),
             (normal(2, 4, 6), normal(4, 4, 3))),
        Case("conv/grouped", "conv_general_dilated", lambda x, w: _conv(x, w, groups=4),
             (normal(2, 5, 5, 8), normal(3, 3, 2, 8))),
        Case("conv/depthwise", "conv_general_dilated", lambda x, w: _conv(x, w, groups=8),
             (normal(2, 5, 5, 8), normal(3, 3, 1, 8))),
        Case("conv/kernel-grad", "conv_general_dilated",
             lambda x, g: jax.linear_transpose(lambda w: _conv(x, w), jnp.zeros((3, 3, 2, 4)))(g)[0],
             (normal(4, 5, 5, 2), normal(4, 5, 5, 4))),
        Case("conv/input-grad", "conv_general_dilated",
             lambda w, g: jax.linear_transpose(lambda x: _conv(x, w), jnp.zeros((4, 5, 5, 2)))(g)[0],
             (normal(3, 3, 2, 4), normal(4, 5, 5, 4))),
        Case("conv/grouped-kernel-grad", "conv_general_dilated",
             lambda x, g: jax.linear_transpose(lambda w: _conv(x, w, groups=4), jnp.zeros((3, 3, 2, 8)))(g)[0],
             (normal(2, 5, 5, 8), normal(2, 5, 5, 8))),
    ]
    # reductions
    cases += [
        Case("reduce_sum/last", "reduce_sum", lambda x: x.sum(1), (normal(4, 8),)),
        Case("reduce_sum/all", "reduce_sum", lambda x: x.sum(), (normal(4, 8),)),
        Case("reduce_sum/middle-rank3", "reduce_sum", lambda x: x.sum(1), (normal(2, 8, 4),)),
        Case("reduce_max", "reduce_max", lambda x: x.max(0), (normal(4, 8),)),
        Case("reduce_min", "reduce_min", lambda x: x.min(1), (normal(4, 8),)),
        Case("reduce_prod", "reduce_prod", lambda x: x.prod(1), (1 + 0.1 * normal(4, 8),)),
        Case("reduce_and", "reduce_and", lambda x: x.all(1), (_rng.uniform(size=(4, 8)) < 0.9,)),
        Case("reduce_or", "reduce_or", lambda x: x.any(0), (_rng.uniform(size=(4, 8)) < 0.1,)),
        Case("reduce_xor", "reduce_xor", lambda x: lax.reduce_xor_p.bind(x, axes=(1,)), (ints(4, 8, hi=256),)),
        Case("reduce_sum/mesh8", "reduce_sum", lambda x: x.sum(0), (normal(8, 4),), mesh="8"),
        Case("argmax", "argmax", lambda x: jnp.argmax(x, 1), (normal(4, 8),)),
        Case("argmin", "argmin", lambda x: jnp.argmin(x, 0), (normal(4, 8),)),
        Case("cumsum", "cumsum", lambda x: jnp.cumsum(x, 0), (normal(4, 8),)),
        Case("cumsum/reverse", "cumsum", lambda x: lax.cumsum(x, 1, reverse=True), (normal(4, 8),)),
        Case("cumprod", "cumprod", lambda x: lax.cumprod(x, 1), (f32(4, 8),)),
        Case("cummax", "cummax", lambda x: lax.cummax(x, 0), (normal(4, 8),)),
        Case("cummin", "cummin", lambda x: lax.cummin(x, 1), (normal(4, 8),)),
        Case("cumlogsumexp", "cumlogsumexp", lambda x: lax.cumlogsumexp(x, 1), (normal(4, 8),)),
        Case("sort", "sort", lambda x: jnp.sort(x, 1), (normal(4, 8),)),
        Case("sort/argsort", "sort", lambda x: jnp.argsort(x, 0), (normal(4, 8),)),
        Case("top_k", "top_k", lambda x: lax.top_k(x, 2), (normal(4, 8),)),
        Case("top_k/axis0", "top_k", lambda x: lax.top_k(x, 2, axis=0), (normal(8, 4),)),
        Case("approx_top_k", "approx_top_k", lambda x: lax.approx_max_k(x, 2), (normal(4, 8),)),
        Case("reduce/variadic", "reduce",
             lambda x, y: lax.reduce((x, y), (0.0, 1.0), lambda a, b: (a[0] + b[0], a[1] * b[1]), (1,)),
             (normal(4, 8), f32(4, 8))),
        Case("reduce_window_max", "reduce_window_max", _max_pool, (normal(4, 4, 4, 8),)),
        Case("reduce_window_sum", "reduce_window_sum",
             lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "SAME"), (normal(4, 5, 5, 8),)),
        Case("reduce_window_min", "reduce_window_min",
             lambda x: lax.reduce_window(x, jnp.inf, lax.min, (1, 3), (1, 1), "SAME"), (normal(4, 8),)),
        Case("reduce_window/variadic", "reduce_window",
             lambda x, y: lax.reduce_window((x, y), (0.0, 0.0), lambda a, b: (a[0] + b[0], a[1] + b[1]),
                                            (1, 2), (1, 2), "VALID"), (normal(4, 8), normal(4, 8))),
        Case("select_and_scatter_add", "select_and_scatter_add",
             lambda x: jax.grad(lambda x: _max_pool(x).sum())(x), (normal(4, 4, 4, 8),)),
        Case("select_and_gather_add", "select_and_gather_add",
             lambda x, t: jax.jvp(_max_pool, (x,), (t,))[1], (normal(4, 4, 4, 8), normal(4, 4, 4, 8))),
    ]
    # shape
    cases += [
        Case("broadcast_in_dim/new-leading", "broadcast_in_dim",
             lambda x: lax.broadcast_in_dim(x, (4, 8), (1,)), (normal(8),)),
        Case("broadcast_in_dim/size1", "broadcast_in_dim",
             lambda x: lax.broadcast_in_dim(x, (4, 8), (0, 1)), (normal(4, 1),)),
        Case("broadcast_in_dim/scalar", "broadcast_in_dim",
             lambda x: lax.broadcast_in_dim(x, (4, 8), ()), (np.float32(3.0),)),
        Case("broadcast_in_dim/expand_dims", "broadcast_in_dim", lambda x: jnp.expand_dims(x, 1), (normal(4, 8),)),
        Case("reshape/merge", "reshape", lambda x: x.reshape(32), (normal(4, 8),)),
        Case("reshape/split", "reshape", lambda x: x.reshape(4, 8), (normal(32),)),
        Case("reshape/heads", "reshape", lambda x: x.reshape(2, 4, 4, 2), (normal(2, 4, 8),)),
        Case("reshape/regroup-gcd", "reshape", lambda x: x.reshape(4, 12), (normal(8, 6),)),
        Case("reshape/size1-dims", "reshape", lambda x: x.reshape(4, 8), (normal(4, 1, 8),)),
        Case("reshape/merge-minor", "reshape", lambda x: x.reshape(8, 8), (normal(8, 2, 4),)),
        Case("reshape/shape-6x10", "reshape", lambda x: x.reshape(60), (normal(6, 10),)),
        Case("reshape/mesh8", "reshape", lambda x: x.reshape(16, 4), (normal(8, 8),), mesh="8"),
        Case("transpose", "transpose", lambda x: x.transpose(2, 0, 1), (normal(2, 4, 8),)),
        Case("squeeze", "squeeze", lambda x: lax.squeeze(x, (1,)), (normal(4, 1, 8),)),
        Case("slice/rows", "slice", lambda x: x[1:3], (normal(4, 8),)),
        Case("slice/strided", "slice", lambda x: lax.slice(x, (0, 1), (4, 8), (1, 2)), (normal(4, 8),)),
        Case("pad", "pad", lambda x: lax.pad(x, 0.0, ((1, 1, 0), (0, 0, 0))), (normal(4, 8),)),
        Case("pad/interior", "pad", lambda x: lax.pad(x, 0.0, ((0, 0, 0), (0, -1, 1))), (normal(4, 8),)),
        Case("concatenate", "concatenate", lambda a, b: jnp.concatenate([a, b], 0), (normal(4, 8), normal(2, 8))),
        Case("split", "split", lambda x: jnp.split(x, 2, axis=1), (normal(4, 8),)),
        Case("rev", "rev", lambda x: lax.rev(x, (0,)), (normal(4, 8),)),
        Case("iota", "iota", lambda: lax.broadcasted_iota(jnp.int32, (4, 8), 0), ()),
        Case("iota/minor", "iota", lambda: lax.broadcasted_iota(jnp.float32, (4, 8), 1), ()),
        Case("tile", "tile", lambda x: jnp.tile(x, (1, 2)), (normal(4, 8),)),
        Case("stack", "stack", lambda a, b: jnp.stack([a, b], 1), (normal(4, 8), normal(4, 8))),
        Case("unstack", "unstack", lambda x: jnp.unstack(x, axis=1), (normal(4, 2, 8),)),
    ]
    # indexing
    table, ids = normal(16, 4), ints(2, 4, hi=16)
    cases += [
        Case("gather/take", "gather", lambda t, i: jnp.take(t, i, axis=0), (table, ids)),
        Case("gather/index", "gather", lambda t, i: t[i], (table, ids)),
        Case("gather/take-cols", "gather", lambda t, i: jnp.take(t, i, axis=1), (normal(8, 16), ints(4, hi=16))),
        Case("gather/take_along_axis", "gather", lambda t, i: jnp.take_along_axis(t, i, axis=1),
             (normal(4, 8), ints(4, 8, hi=8))),
        Case("gather/batched", "gather", jax.vmap(lambda t, i: t[i]), (normal(2, 16, 4), ints(2, 4, hi=16))),
        Case("gather/mesh8", "gather", lambda t, i: t[i], (table, ints(8, 4, hi=16)), mesh="8"),
        Case("scatter-add/embedding-grad", "scatter-add",
             lambda t, i, g: jax.vjp(lambda t: jnp.take(t, i, axis=0), t)[1](g)[0], (table, ids, normal(2, 4, 4))),
        Case("scatter-add/nonzero-operand", "scatter-add", lambda x, i, u: x.at[i].add(u),
             (normal(16, 4), ints(4, hi=16), normal(4, 4))),
        Case("scatter-add/batched", "scatter-add", jax.vmap(lambda x, i, u: x.at[i].add(u)),
             (normal(2, 16, 4), ints(2, 4, hi=16), normal(2, 4, 4))),
        Case("scatter-sub", "scatter-sub", lambda x, i, u: x.at[i].subtract(u),
             (normal(16, 4), ints(4, hi=16), normal(4, 4))),
        Case("scatter", "scatter", lambda x, i, u: x.at[i].set(u),
             (normal(16, 8), _rng.permutation(16)[:8].astype(np.int32), normal(8, 8))),
        Case("scatter-mul", "scatter-mul", lambda x, i, u: x.at[i].mul(u), (normal(16, 8), ints(8, hi=16), f32(8, 8))),
        Case("scatter-min", "scatter-min", lambda x, i, u: x.at[i].min(u),
             (normal(16, 8), ints(8, hi=16), normal(8, 8))),
        Case("scatter-max", "scatter-max", lambda x, i, u: x.at[i].max(u),
             (normal(16, 8), ints(8, hi=16), normal(8, 8))),
        Case("scatter-add/mesh8", "scatter-add", lambda x, i, u: x.at[i].add(u),
             (normal(16, 8), ints(8, hi=16), normal(8, 8)), mesh="8"),
        Case("dynamic_slice", "dynamic_slice", lambda x, i: lax.dynamic_slice(x, (i, 0), (2, 8)),
             (normal(4, 8), np.int32(1))),
        Case("dynamic_update_slice", "dynamic_update_slice",
             lambda x, u, i: lax.dynamic_update_slice(x, u, (0, i)), (normal(4, 8), normal(4, 2), np.int32(3))),
    ]
    # control flow, random, identities
    key = jax.random.key(0)
    cases += [
        Case("scan", "scan", lambda x: lax.scan(lambda c, r: (c + r, c * r), jnp.zeros(8), x), (normal(4, 8),)),
        Case("while", "while", lambda x: lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2), (0, x)),
             (normal(4, 8),)),
        Case("cond", "cond", lambda p, x: lax.cond(p, jnp.sin, jnp.cos, x), (np.bool_(True), normal(4, 8))),
        Case("platform_index", "platform_index",
             lambda x: lax.platform_dependent(x, cpu=jnp.sin, default=jnp.cos), (normal(4, 8),)),
        Case("random_seed", "random_seed", jax.random.key, (np.int32(3),)),
        Case("random_bits", "random_bits", lambda k: jax.random.bits(k, (4, 8)), (key,)),
        Case("random_split", "random_split", lambda k: jax.random.split(k, 4), (key,)),
        Case("random_fold_in", "random_fold_in", lambda k, d: jax.random.fold_in(k, d), (key, np.uint32(5))),
        Case("random_wrap", "random_wrap", jax.random.wrap_key_data, (np.array([0, 7], np.uint32),)),
        Case("random_unwrap", "random_unwrap", jax.random.key_data, (key,)),
        Case("random_clone", "random_clone", jax.random.clone, (key,)),
        Case("random_gamma", "random_gamma", lambda k, a: jax.random.gamma(k, a), (key, 1 + f32(8))),
        Case("threefry2x32", "threefry2x32", jax._src.random.threefry2x32.threefry_2x32,
             (np.array([0, 7], np.uint32), ints(8, hi=1000, dtype=np.uint32))),
        Case("iota_2x32_shape", "iota_2x32_shape", lambda: jax._src.random.prng.iota_2x32_shape((4, 8)), ()),
        *(Case(name, name, functools.partial(_random_bits_of(name), bit_width=32, shape=(4, 8)), (_raw_key(name),))
          for name in ("threefry4x32",)),
        Case("io_callback", "io_callback", lambda x: jax.experimental.io_callback(
            np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x, ordered=False), (normal(4, 8),)),
        Case("rng_bit_generator", "rng_bit_generator", lambda k: lax.rng_bit_generator(k, (4, 8)),
             (np.arange(4, dtype=np.uint32),)),
        # optimization_barrier types every result as varying over all its operands' axes (jax 0.10).
        Case("optimization_barrier", "optimization_barrier", lambda a, b: lax.optimization_barrier((a, b)),
             (normal(2, 4), normal(4, 2)), check_vma=False),
        Case("optimization_barrier/same-shapes", "optimization_barrier", lambda a, b: lax.optimization_barrier((a, b)),
             (normal(2, 4), normal(2, 4)), check_vma=False),
        Case("name", "name", lambda x: jax._src.ad_checkpoint.checkpoint_name(x, "h"), (normal(4, 8),)),
        Case("sharding_constraint", "sharding_constraint", lambda x: lax.with_sharding_constraint(
            x, jax.sharding.NamedSharding(_auto_mesh(), P("x"))), (normal(4, 8),)),
        Case("device_put", "device_put", lambda x: jax.device_put(
            x, jax.sharding.NamedSharding(_auto_mesh(), P(None, "x"))), (normal(4, 8),)),
        Case("pure_callback", "pure_callback", lambda x: jax.pure_callback(
            np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x), (normal(4, 8),)),
    ]
    return cases


def _random_bits_of(impl: str) -> Callable[..., Any]:
    """The raw-key random_bits of a non-default PRNG implementation (it binds that impl's primitive)."""
    import jax._src.random.threefry4x32 as threefry4x32

    return {"threefry4x32": threefry4x32.threefry4x32_random_bits}[impl]


def _raw_key(impl: str) -> np.ndarray:
    shape = jax._src.random.prng.prngs[impl].key_shape
    return np.arange(1, 1 + int(np.prod(shape)), dtype=np.uint32).reshape(shape)


@functools.cache
def _auto_mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])


CASES = {c.name: c for c in _cases()}


@functools.cache
def _strategies(case: Case) -> list[Strategy]:
    built = build(case)
    with warnings.catch_warnings():  # while / cond are planned replicated and say so (tests/unit/test_loops.py)
        warnings.simplefilter("ignore" if case.prim in UNPLANNED_LOOPS else "error", UnsupportedPrimitiveWarning)
        return strategies_for(built.op, built.ins, built.outs, logical_mesh(case.mesh))


def _params() -> list[Any]:
    params = []
    for case in CASES.values():
        for k, s in enumerate(_strategies(case)):
            params.append(pytest.param(case.name, k, id=f"{case.name}: {s}"))
    return params


@functools.cache
def simulated(name: str) -> tuple[list[Any], list[Any]]:
    """(outputs of every strategy of case ``name``, the unsharded outputs)."""
    case = CASES[name]
    built = build(case)
    return run_strategies(built, _strategies(case), case.mesh, case.check_vma), reference(built)


# ---- the tests -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "index"), _params())
def test_strategy_matches_unsharded_op(devices8: Any, name: str, index: int) -> None:
    strategy = _strategies(CASES[name])[index]
    results, want = simulated(name)
    got = results[index]
    if isinstance(got, Exception):
        raise AssertionError(f"{name}: strategy {strategy} cannot run on shards: {got}") from got
    assert_same(got, want, f"{name}: {strategy}")


# reductions split over two axes: two contracting (or reduced) dims split over x and y each, and one over both
SPLIT_REDUCTIONS = ("dot_general/two-contracting", "dot_general/matmul", "reduce_sum/all")


@pytest.mark.parametrize("name", SPLIT_REDUCTIONS)
def test_a_reduction_s_collectives_are_those_xla_compiles(devices8: Any, name: str) -> None:
    """Each strategy of the case that reduces to a replicated result over more than one axis names the
    all-reduces XLA compiles for it (kind, group size, bytes): XLA reduces each split reduced dim apart,
    the whole result over each dim's axes in turn (x and y for dims split over x and y, all of them
    again over x: the bytes cross that axis's links once more), and a dim split over both axes at once."""
    from autoshard.compiler.hlo import read_hlo_collectives

    case, mesh = CASES[name], logical_mesh(CASES[name].mesh)
    dmesh = device_mesh(case.mesh)
    checked = 0
    for strategy in _strategies(case):
        reduced = {a for c in strategy.collectives for a in c.axes}
        if (len(reduced) < 2 or any(c.kind != "all-reduce" for c in strategy.collectives)
                or any(s.used_axes for s in strategy.out_specs)):
            continue
        shardings = tuple(NamedSharding(dmesh, _pspec(spec)) for spec in strategy.in_specs)
        jitted = jax.jit(case.fn, in_shardings=shardings, out_shardings=NamedSharding(dmesh, P()))
        compiled = jitted.lower(*case.args).compile(fast_compile())
        got = sorted((c.kind, c.group_size, c.nbytes * c.count) for c in read_hlo_collectives(compiled.as_text()))
        want = sorted((c.kind, mesh.size_of(c.axes), c.nbytes) for c in strategy.collectives)
        assert got == want, f"{name}: {strategy}"
        checked += 1
    assert checked, f"{name}: no strategy reduces over two axes"


NO_CASE = {  # registered primitives without a simulation case, and why
    "reshard": "an identity on local shards; only made under Explicit mesh axes",
    "layout_constraint": "an identity on local shards; only made by the layout API",
    "mulhi": "XLA cannot lower it under shard_map's manual sharding (jax 0.10: 'mhlo.unknown' illegal)",
    "philox2x32": "replicated only; lowers through mulhi, which XLA cannot lower under shard_map",
    "philox4x32": "replicated only; lowers through mulhi, which XLA cannot lower under shard_map",
    "rng_uniform": "replicated only; stateful, so two runs never agree and there is nothing to compare",
    "select_and_scatter": "no public jax API emits the generic form (max-pool gradients use select_and_scatter_add)",
    "loop_carry": "a pseudo-op of a flattened scan (ir/trace.py), no jax primitive: identity strategies; the scan "
                  "is run end to end in tests/sim/test_scan_layers.py",
    "loop_final": "a pseudo-op of a flattened scan, no jax primitive: identity strategies (test_scan_layers.py)",
    "loop_slice": "a pseudo-op of a flattened scan, no jax primitive: the layer axis never splits "
                  "(tests/unit/test_loops.py; numerics in test_scan_layers.py)",
    "loop_stack": "a pseudo-op of a flattened scan, no jax primitive: the layer axis never splits "
                  "(tests/unit/test_loops.py; numerics in test_scan_layers.py)",
    "cond_merge": "a pseudo-op of a flattened cond, no jax primitive: every branch result in the result's layout "
                  "(tests/unit/test_cond_while.py; numerics in tests/sim/test_cond_while_numerics.py)",
    "empty": "replicated only; an uninitialized buffer, so there is nothing to compare",
    "empty2": "replicated only; an uninitialized buffer (cond's gradient pads residuals with it): nothing to compare",
}


def test_every_registered_primitive_has_a_case() -> None:
    covered = {c.prim for c in CASES.values()}
    absent = {p for p in NEWER_CASES if not hasattr(lax, p)}  # the installed jax does not have them yet
    missing = sorted(set(RULES) - covered - set(NO_CASE) - absent)
    assert not missing, f"registered primitives with no simulation case: {missing}"
    assert not covered & set(NO_CASE), "a primitive listed in NO_CASE has a case now: drop it from NO_CASE"


def test_no_strategy_splits_a_dim_it_does_not_divide() -> None:
    for case in CASES.values():
        built, mesh = build(case), logical_mesh(case.mesh)
        sizes = dict(zip(mesh.axis_names, mesh.shape))
        for s in _strategies(case):
            for spec, v in zip(s.in_specs + s.out_specs, built.ins + built.outs):
                assert spec.rank == v.rank and spec.divides(v.shape, sizes), f"{case.name}: {s} on {v}"
    # Odd sizes still get the splits that do divide: 6 and 10 split over x (2), never over y (4).
    for name in ("select_n/shape-6x10", "dot_general/shape-6x10", "reshape/shape-6x10"):
        used = {a for s in _strategies(CASES[name]) for spec in s.in_specs for a in spec.used_axes}
        assert used == {"x"}, f"{name}: axes used {used}"


def test_unregistered_primitive_is_replicated_with_one_warning() -> None:
    prim = jcore.Primitive("autoshard_test_unregistered")
    x, y = Value(0, (4, 8), "float32", Role.ACTIVATION), Value(1, (4, 8), "float32", Role.ACTIVATION)
    op = Op(0, prim.name, {}, (0,), (1,), flops=1.0, bytes_accessed=1.0, prim=prim)
    mesh = logical_mesh("2x4")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = strategies_for(op, (x,), (y,), mesh)
        second = strategies_for(op, (x,), (y,), mesh)
    ours = [w for w in caught if issubclass(w.category, UnsupportedPrimitiveWarning)]
    assert len(ours) == 1 and prim.name in str(ours[0].message)
    for found in (first, second):
        assert [(s.in_specs, s.out_specs) for s in found] == [((Spec.replicated(2),), (Spec.replicated(2),))]


def _wrong(case: str, ins: Sequence[Spec], outs: Sequence[Spec], collectives: Sequence[Collective] = (),
           reduction: str | None = None) -> tuple[str, Strategy]:
    return case, Strategy(tuple(ins), tuple(outs), 0.0, collectives=tuple(collectives), reduction=reduction)


def _s(text: str) -> Spec:
    """``"S(x)R"`` -> Spec; the inverse of Spec.__str__ for single-axis dims."""
    dims, i = [], 0
    while i < len(text):
        if text[i] == "R":
            dims.append(())
            i += 1
        else:
            j = text.index(")", i)
            dims.append(tuple(text[i + 2:j].split(",")))
            i = j + 1
    return Spec(tuple(dims))


WRONG = [  # each splits a dim whose shard-local result is not a shard of the global one
    _wrong("cumsum", [_s("S(x)R")], [_s("S(x)R")]),
    _wrong("sort", [_s("RS(y)")], [_s("RS(y)")]),
    _wrong("top_k", [_s("RS(y)")], [_s("RS(y)"), _s("RS(y)")]),
    _wrong("argmax", [_s("RS(y)")], [_s("R")], [Collective("all-reduce", ("y",), 16)], "max"),
    _wrong("reduce_sum/last", [_s("RS(y)")], [_s("R")]),  # forgot the all-reduce
    _wrong("reduce_sum/last", [_s("RS(y)")], [_s("S(y)")]),
    _wrong("reduce_max", [_s("S(x)R")], [_s("R")], [Collective("all-reduce", ("x",), 32)], "sum"),
    _wrong("reshape/merge-minor", [_s("RRS(y)")], [_s("RS(y)")]),
    _wrong("reshape/merge", [_s("RS(y)")], [_s("S(y)")]),
    _wrong("iota", [], [_s("S(x)R")]),
    _wrong("slice/rows", [_s("S(x)R")], [_s("S(x)R")]),
    _wrong("pad", [_s("S(x)R"), _s("")], [_s("S(x)R")]),
    _wrong("rev", [_s("S(x)R")], [_s("S(x)R")]),
    _wrong("concatenate", [_s("S(x)R"), _s("S(x)R")], [_s("S(x)R")]),
    _wrong("gather/take", [_s("S(x)R"), _s("RR")], [_s("RRR")]),  # vocab split without masking
    _wrong("gather/take", [_s("S(x)R"), _s("RR")], [_s("RRR")], [Collective("all-reduce", ("x",), 1)], "sum"),
    _wrong("scatter", [_s("RR"), _s("S(x)"), _s("S(x)R")], [_s("RR")], [Collective("all-reduce", ("x",), 1)],
           "sum"),
    _wrong("dot_general/matmul", [_s("RS(y)"), _s("S(y)R")], [_s("RR")]),
    _wrong("conv/nchw-1d", [_s("RRS(x)"), _s("RRR")], [_s("RRS(x)")]),  # spatial split
    _wrong("dynamic_slice", [_s("S(x)R"), _s(""), _s("")], [_s("S(x)R")]),
]


@pytest.mark.parametrize(("name", "strategy"), [pytest.param(n, s, id=f"{n}: {s}") for n, s in WRONG])
def test_simulation_catches_wrong_strategies(devices8: Any, name: str, strategy: Strategy) -> None:
    built = build(CASES[name])
    offered = {(s.in_specs, s.out_specs, s.collectives, s.reduction) for s in _strategies(CASES[name])}
    assert (strategy.in_specs, strategy.out_specs, strategy.collectives, strategy.reduction) not in offered
    (got,) = run_strategies(built, [strategy], CASES[name].mesh)
    if isinstance(got, Exception):  # caught while tracing: a local shape or replication claim is wrong
        assert "local result" in str(got) or "require replication" in str(got), got
        return
    with pytest.raises(AssertionError):
        assert_same(got, reference(built), f"{name}: {strategy}")


# ---- every primitive of real train steps has a rule -------------------------------------------------


def _gpt_step() -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """A small nnx GPT (embedding lookup, causal softmax attention, layernorm, gelu, dropout, tied
    logits) trained with adamw on integer-label cross-entropy."""
    import optax
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, d: int, heads: int, rngs: nnx.Rngs) -> None:
            self.ln1, self.ln2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
            self.qkv, self.proj = nnx.Linear(d, 3 * d, rngs=rngs), nnx.Linear(d, d, rngs=rngs)
            self.fc1, self.fc2 = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)
            self.heads = heads

        def __call__(self, x: Any) -> Any:
            b, t, d = x.shape
            q, k, v = (z.reshape(b, t, self.heads, d // self.heads) for z in jnp.split(self.qkv(self.ln1(x)), 3, -1))
            scores = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(d // self.heads)
            scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
            y = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, -1), v).reshape(b, t, d)
            x = x + self.proj(y)
            return x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x)), approximate=False))

    class GPT(nnx.Module):
        def __init__(self, vocab: int, d: int, rngs: nnx.Rngs) -> None:
            self.embed = nnx.Embed(vocab, d, rngs=rngs)
            self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (16, d)))
            self.blocks = nnx.List([Block(d, 2, rngs) for _ in range(2)])
            self.ln = nnx.LayerNorm(d, rngs=rngs)

        def __call__(self, ids: Any, key: Any) -> Any:
            x = self.embed(ids) + self.pos[None, : ids.shape[1]]
            x = jnp.where(jax.random.bernoulli(jax.random.fold_in(key, 1), 0.9, x.shape), x / 0.9, 0.0)
            for block in self.blocks:
                x = block(x)
            return self.embed.attend(self.ln(x))

    graphdef, params = nnx.split(nnx.eval_shape(lambda: GPT(64, 16, nnx.Rngs(0))))  # shapes only: no init work
    tx = optax.adamw(1e-3)

    def step(params: Any, opt_state: Any, batch: Any) -> Any:
        ids, labels, key_data = batch

        def loss_fn(p: Any) -> Any:
            logits = nnx.merge(graphdef, p)(ids, jax.random.wrap_key_data(key_data))
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    ids = jnp.zeros((4, 8), jnp.int32)
    return step, (params, jax.eval_shape(tx.init, params), (ids, ids, jax.random.key_data(jax.random.key(0))))


def _moe_step() -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """Top-2 gated mixture of experts: top_k, one_hot, cumsum positions, einsum dispatch/combine; adam."""
    import optax

    experts, capacity = 4, 8

    def moe(p: Any, x: Any) -> Any:
        probs = jax.nn.softmax(x @ p["gate"], -1)
        top_p, top_i = lax.top_k(probs, 2)
        choice = jax.nn.one_hot(top_i, experts)  # [tokens, 2, experts]
        position = (jnp.cumsum(choice.reshape(-1, experts), 0).reshape(choice.shape) - 1) * choice
        slot = jax.nn.one_hot(position.sum(-1).astype(jnp.int32), capacity)  # [tokens, 2, capacity]
        dispatch = jnp.einsum("tke,tkc->tec", choice, slot)
        combine = jnp.einsum("tke,tkc,tk->tec", choice, slot, top_p)
        h = jax.nn.relu(jnp.einsum("tec,td->ecd", dispatch, x) @ p["w1"])
        return jnp.einsum("tec,ecd->td", combine, h @ p["w2"])

    params = {"gate": normal(8, experts), "w1": normal(experts, 8, 16), "w2": normal(experts, 16, 8)}
    tx = optax.adam(1e-3)

    def step(params: Any, opt_state: Any, x: Any) -> Any:
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(moe(p, x) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, jax.eval_shape(tx.init, params), normal(16, 8))


def _convnet_step() -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """A linen conv net (conv, relu, avg and max pooling, dense) trained with sgd momentum."""
    import flax.linen as nn
    import optax

    class ConvNet(nn.Module):
        @nn.compact
        def __call__(self, x: Any) -> Any:
            x = nn.avg_pool(nn.relu(nn.Conv(8, (3, 3))(x)), (2, 2), (2, 2))
            x = nn.max_pool(nn.relu(nn.Conv(8, (3, 3), strides=2)(x)), (2, 2), (2, 2))
            return nn.Dense(10)(x.reshape(x.shape[0], -1))

    model, x = ConvNet(), normal(4, 16, 16, 3)
    params = jax.eval_shape(model.init, jax.random.key(0), x)
    tx = optax.sgd(0.1, momentum=0.9)

    def step(params: Any, opt_state: Any, batch: Any) -> Any:
        images, labels = batch

        def loss_fn(p: Any) -> Any:
            return optax.softmax_cross_entropy(model.apply(p, images), jax.nn.one_hot(labels, 10)).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, jax.eval_shape(tx.init, params), (x, ints(4, hi=10)))


def _equations(jaxpr: jcore.Jaxpr) -> list[Any]:
    """Every equation, call bodies inlined (as the tracer does) and control-flow bodies entered too."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name not in CALLS:
            out.append(eqn)
        for v in eqn.params.values():
            for sub in v if isinstance(v, tuple) else (v,):
                if isinstance(sub, (jcore.ClosedJaxpr, jcore.Jaxpr)):
                    out.extend(_equations(getattr(sub, "jaxpr", sub)))
    return out


def _op_of(eqn: Any) -> Built:
    ins = tuple(_value(i, v.aval, Role.ACTIVATION) for i, v in enumerate(eqn.invars))
    outs = tuple(_value(len(ins) + k, v.aval, Role.ACTIVATION) for k, v in enumerate(eqn.outvars))
    op = Op(0, eqn.primitive.name, dict(eqn.params), tuple(v.id for v in ins), tuple(v.id for v in outs),
            flops=1.0, bytes_accessed=1.0, prim=eqn.primitive)
    return Built(op, ins, outs, ())


@pytest.mark.parametrize("make_step", [_gpt_step, _moe_step, _convnet_step], ids=["gpt-adamw", "moe", "convnet-sgd"])
def test_train_step_primitives_all_have_rules(make_step: Callable[[], Any]) -> None:
    step, args = make_step()
    eqns = _equations(jax.make_jaxpr(step)(*args).jaxpr)
    missing = sorted({e.primitive.name for e in eqns} - set(RULES))
    assert not missing, f"primitives with no strategy rule: {missing}"
    mesh = logical_mesh("2x4")
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsupportedPrimitiveWarning)
        for eqn in eqns:
            built = _op_of(eqn)
            for s in strategies_for(built.op, built.ins, built.outs, mesh):
                for spec, v in zip(s.in_specs + s.out_specs, built.ins + built.outs):
                    assert spec.rank == v.rank and spec.divides(v.shape, sizes), f"{eqn}: {s}"
