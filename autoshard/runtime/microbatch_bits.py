"""A pipeline's microbatch draws its slice of the whole batch's random bits, as one device draws them.

A pipeline runs the loss a microbatch at a time, so a ``random_bits`` over the batch (a dropout mask) is
bound at the microbatch's shape, and JAX's threefry counts each element from 0 over that shape: microbatch m
would draw the bits of microbatch 0's positions, not those of its own rows of the whole mask. Under
``jax_threefry_partitionable`` (JAX's default) an element's bits are threefry of its key and its linear index
in the whole array (``jax._src.random.threefry2x32._threefry_random_bits_partitionable``), so microbatch m's
slice is computed alone: the same threefry over the whole shape's linear indices of its own positions (the
microbatch's iota, shifted by ``m * rows`` along the batch axis, times the whole shape's strides, in two
32-bit words as JAX counts). :func:`sliced_bits` is that; it equals the slice bit for bit.

The stage programs bind their draws through :func:`drawn_bits`, which reads the microbatch index the runtime
passes with the stage's data (:func:`drawing`, set while a stage executable is traced): a train graph's ops
through ``OpGraph.run_ops``'s ``bind_op`` (:func:`bind_op`, loop bodies included), the ``jax.vjp`` path's
forward equations as :class:`DrawingEqn`, which re-emits a scan or a call (``jit``, ``checkpoint``) whose
body draws around its body evaluated equation by equation. :func:`find_draws` pairs the loss at the whole
batch with the loss at one microbatch and says which draws shrink, along which axis, and which cannot be
sliced (another key type, the flag off, a shape not cut along one axis by the microbatch count, two draws of
one microbatch shape cut differently, or a draw in a ``while`` or ``cond`` body, bound whole): those still
draw their own bits, and :func:`per_microbatch`, which both pipeline builders call, warns of them
(``MicrobatchRandomnessWarning``), and of a loss that couples the batch's examples (``MicrobatchCouplingWarning``).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.extend.random import threefry2x32_p

from autoshard.errors import MicrobatchRandomnessWarning
from autoshard.ir.batch_coupling import batch_statistics, warn_coupled
from autoshard.ir.primitives import CALLS
from autoshard.ir.split import FlatEqn, StepParts, bind_eqn
from autoshard.ir.trace import control_flow_bodies, eqn_source

__all__ = ["Draws", "DrawingEqn", "bind_op", "drawing", "drawn_bits", "find_draws", "mul_2x32", "per_microbatch",
           "sliced_bits"]

_U32 = jnp.uint32
_UINT = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}


@dataclass(frozen=True)
class Draw:
    """One draw over the batch: its whole shape, and the axis the microbatches cut."""

    whole: tuple[int, ...]
    axis: int


@dataclass(frozen=True)
class Draws:
    """The loss's draws that shrink with the microbatch: the sliceable ones by (microbatch shape, bit width),
    and where the others are (their source lines), which still draw their own bits."""

    sliced: Mapping[tuple[tuple[int, ...], int], Draw]
    unsliced: tuple[str, ...] = ()
    count: int = 0  # draws that shrink with the microbatch, sliced or not


# equations whose bodies :func:`_bind_drawing` re-emits, so that the draws inside are the microbatch's slices
_REEMITTED = ("scan", "checkpoint", *CALLS)


def _bodies(eqn: Any) -> list[Any]:
    """The jaxprs inside an equation: loop and branch bodies, and the bodies of calls (``jit``, ``checkpoint``)."""
    found = control_flow_bodies(eqn)
    if found:
        return found
    return [v for value in eqn.params.values() for v in (value if isinstance(value, (tuple, list)) else (value,))
            if isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr))]


def _eqns(jaxpr: Any) -> Sequence[Any]:
    return getattr(jaxpr, "jaxpr", jaxpr).eqns


def _random_bits_pairs(whole: Sequence[Any], small: Sequence[Any], reached: bool = True
                       ) -> Iterator[tuple[Any, Any, bool]]:
    """(whole, microbatch, reached) triples of ``random_bits`` equations, in bodies too; ``reached``: only
    inside bodies a stage re-emits (``_REEMITTED``; a ``while`` or ``cond`` is bound whole)."""
    for a, b in zip(whole, small):
        if a.primitive.name == "random_bits":
            yield a, b, reached
        for body_a, body_b in zip(_bodies(a), _bodies(b)):
            yield from _random_bits_pairs(_eqns(body_a), _eqns(body_b), reached and a.primitive.name in _REEMITTED)


def _cut_axis(whole: tuple[int, ...], small: tuple[int, ...], num_microbatches: int) -> int | None:
    """The one axis ``small`` cuts ``whole`` along into ``num_microbatches`` (None: not such a cut)."""
    differ = [d for d, (w, s) in enumerate(zip(whole, small)) if w != s]
    if len(whole) != len(small) or len(differ) != 1 or whole[differ[0]] != small[differ[0]] * num_microbatches:
        return None
    return differ[0]


def find_draws(whole: StepParts, small: StepParts, num_microbatches: int) -> Draws:
    """The draws of the loss whose shape shrinks from ``whole`` (the whole batch) to ``small`` (a microbatch)."""
    every = list(_random_bits_pairs([e.eqn for e in whole.forward.eqns], [e.eqn for e in small.forward.eqns]))
    pairs = [(a, b, reached) for a, b, reached in every if tuple(a.params["shape"]) != tuple(b.params["shape"])]
    sliced: dict[tuple[tuple[int, ...], int], Draw] = {}
    unsliced: list[str] = []
    # a draw that does not shrink (over a weight, say) binds at a shape a sliced draw's must not share
    clash = {(tuple(b.params["shape"]), int(b.params["bit_width"])) for a, b, _ in every
             if tuple(a.params["shape"]) == tuple(b.params["shape"])}
    for a, b, reached in pairs:
        key_type = b.invars[0].aval
        axis = _cut_axis(tuple(a.params["shape"]), tuple(b.params["shape"]), num_microbatches)
        threefry = getattr(key_type, "shape", None) == () and str(getattr(key_type, "dtype", "")) == "key<fry>"
        if axis is None or not threefry or not jax.config.jax_threefry_partitionable or not reached:
            unsliced.append(eqn_source(b))
            continue
        k = (tuple(b.params["shape"]), int(b.params["bit_width"]))
        draw = Draw(tuple(a.params["shape"]), axis)
        if sliced.get(k, draw) != draw:
            clash.add(k)
        sliced[k] = draw
    for k in clash & set(sliced):  # one microbatch shape, two whole shapes: a bind cannot tell them apart
        del sliced[k]
        unsliced += [eqn_source(b) for _, b, _ in pairs if (tuple(b.params["shape"]), int(b.params["bit_width"])) == k]
    return Draws(sliced, tuple(unsliced), len(pairs))


def mul_2x32(a: jax.Array, b: int) -> tuple[jax.Array, jax.Array]:
    """``a`` (uint32) times ``b`` (an int below 2**64), mod 2**64, as (high, low) uint32 words."""
    b_low, b_high = b & 0xFFFFFFFF, b >> 32
    a0, a1 = a & _U32(0xFFFF), a >> _U32(16)
    b0, b1 = _U32(b_low & 0xFFFF), _U32(b_low >> 16)
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = p01 + p10
    mid_carry = (mid < p01).astype(_U32)
    low = p00 + (mid << _U32(16))
    carry = (low < p00).astype(_U32)
    high = p11 + (mid >> _U32(16)) + (mid_carry << _U32(16)) + carry + a * _U32(b_high)
    return high, low


def sliced_bits(key: jax.Array, bit_width: int, whole: Sequence[int], shape: Sequence[int], axis: int,
                index: jax.Array | int) -> jax.Array:
    """Slice ``index`` (of ``shape``, cut along ``axis``) of ``jax.random.bits(key, whole)``'s bits, drawn alone
    (module docstring): the whole shape's linear indices of the slice's positions, threefry'd with the key."""
    whole, shape = tuple(int(x) for x in whole), tuple(int(x) for x in shape)
    high, low = jnp.zeros(shape, _U32), jnp.zeros(shape, _U32)
    for d in range(len(shape)):
        position = lax.broadcasted_iota(_U32, shape, d)
        if d == axis:
            position = position + jnp.asarray(index, _U32) * _U32(shape[d])
        term_high, term_low = mul_2x32(position, int(np.prod(whole[d + 1:], dtype=object)))
        low, low_before = low + term_low, low
        high = high + term_high + (low < low_before).astype(_U32)
    data = jax.random.key_data(key)
    bits1, bits2 = threefry2x32_p.bind(data[0], data[1], high, low)
    dtype = _UINT[bit_width]
    if bit_width == 64:
        return lax.shift_left(bits1.astype(dtype), jnp.asarray(32, dtype)) | bits2.astype(dtype)
    return (bits1 ^ bits2).astype(dtype)


_DRAWING: contextvars.ContextVar[tuple[Draws, Any] | None] = contextvars.ContextVar("microbatch_draws",
                                                                                    default=None)


@contextlib.contextmanager
def drawing(draws: Draws, index: Any) -> Iterator[None]:
    """Within: the sliceable draws bound through :func:`drawn_bits` draw microbatch ``index``'s slice."""
    token = _DRAWING.set((draws, index))
    try:
        yield
    finally:
        _DRAWING.reset(token)


def drawn_bits(params: Mapping[str, Any], key: Any) -> jax.Array | None:
    """The microbatch's slice for a ``random_bits`` bound with ``params`` (None: bind it as it is)."""
    current = _DRAWING.get()
    if current is None:
        return None
    draws, index = current
    shape, bit_width = tuple(params["shape"]), int(params["bit_width"])
    draw = draws.sliced.get((shape, bit_width))
    if draw is None:
        return None
    return sliced_bits(key, bit_width, draw.whole, shape, draw.axis, index)


def bind_op(op: Any, values: list[Any]) -> list[Any] | None:
    """``OpGraph.run_ops``'s ``bind_op``: a train graph's ``random_bits`` draws the microbatch's slice."""
    if op.primitive != "random_bits":
        return None
    bits = drawn_bits(op.params, values[0])
    return None if bits is None else [bits]


def _eval_drawing(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    """``jaxpr`` evaluated equation by equation, its draws through :func:`drawn_bits` and its scans re-emitted
    (:func:`_scan_drawing`), so the draws in their bodies are too."""
    env: dict[Any, Any] = {}

    def read(a: Any) -> Any:
        return a.val if isinstance(a, jcore.Literal) else env[a]

    for var, val in zip(jaxpr.constvars, consts):
        env[var] = val
    for var, val in zip(jaxpr.invars, args):
        env[var] = val
    for e in jaxpr.eqns:
        outs = _bind_drawing(e, [read(a) for a in e.invars])
        for var, val in zip(e.outvars, outs):
            env[var] = val
    return [read(a) for a in jaxpr.outvars]


def _bind_drawing(eqn: Any, values: Sequence[Any]) -> list[Any]:
    """One equation bound, a draw as the microbatch's slice and a scan re-emitted around its draws."""
    name = eqn.primitive.name
    if name == "random_bits":
        bits = drawn_bits(eqn.params, values[0])
        if bits is not None:
            return [bits]
    elif name in _REEMITTED and _draws_inside(eqn):
        return _reemitted(eqn, values)
    return bind_eqn(eqn, values)


def _draws_inside(eqn: Any) -> bool:
    return any(e.primitive.name == "random_bits" or _draws_inside(e) for body in _bodies(eqn) for e in _eqns(body))


def _reemitted(eqn: Any, values: Sequence[Any]) -> list[Any]:
    """A scan or call whose body draws, re-emitted around :func:`_eval_drawing` of its body (the ``jax.vjp``
    stage path binds an equation whole, where the draws in its body would count from 0): a scan as
    ``lax.scan``, a ``checkpoint`` as ``jax.checkpoint`` (its policy kept), a ``jit`` inline."""
    params, name = eqn.params, eqn.primitive.name
    if name == "scan":
        return _scan_drawing(params, values)
    body = params["call_jaxpr"] if "call_jaxpr" in params else params["jaxpr"]  # core_call / closed_call: call_
    jaxpr, consts = (body.jaxpr, body.consts) if isinstance(body, jcore.ClosedJaxpr) else (body, ())

    def run(*args: Any) -> list[Any]:
        return _eval_drawing(jaxpr, consts, args)

    if name == "checkpoint":
        return list(jax.checkpoint(run, prevent_cse=params.get("prevent_cse", True), policy=params.get("policy"))(
            *values))
    return run(*values)


def _scan_drawing(params: Mapping[str, Any], values: Sequence[Any]) -> list[Any]:
    """``lax.scan`` of a scan equation's body, evaluated by :func:`_eval_drawing`."""
    closed, n_consts, n_carry = params["jaxpr"], params["num_consts"], params["num_carry"]
    consts, init, xs = values[:n_consts], values[n_consts:n_consts + n_carry], values[n_consts + n_carry:]

    def body(carry: Sequence[Any], x: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        outs = _eval_drawing(closed.jaxpr, closed.consts, [*consts, *carry, *x])
        return outs[:n_carry], outs[n_carry:]

    carry, ys = lax.scan(body, list(init), list(xs), length=params["length"], reverse=params["reverse"],
                         unroll=params["unroll"])
    return [*carry, *ys]


@dataclass(frozen=True, eq=False)
class DrawingEqn(FlatEqn):
    """A forward equation that draws (``random_bits``, or a scan whose body does) bound through
    :func:`_bind_drawing`: the ``jax.vjp`` stage path's draws are the microbatch's slices too."""

    def bind(self, values: Sequence[Any]) -> list[Any]:
        if _DRAWING.get() is None:
            return super().bind(values)
        return _bind_drawing(self.eqn, values)


def per_microbatch(whole: StepParts, small: StepParts, num_microbatches: int, runs: StepParts | None = None
                   ) -> tuple[StepParts, Draws | None]:
    """The step a pipeline runs (``runs``, default ``small``: the step at one microbatch), its draws bound as
    the microbatch's slices of ``whole``'s, and those draws (None: none to slice). Where the microbatches
    cannot run as the whole batch does, it warns: a draw that cannot be sliced (``MicrobatchRandomnessWarning``:
    the microbatch draws its own there), a loss that couples the batch's examples (``MicrobatchCouplingWarning``,
    ``ir/batch_coupling.py``: each microbatch computes its own batch statistic)."""
    runs = small if runs is None else runs
    if num_microbatches <= 1:
        return runs, None
    coupled = batch_statistics(whole.forward, small.forward)
    if coupled:
        warn_coupled(coupled, num_microbatches, stacklevel=4)
    draws = find_draws(whole, small, num_microbatches)
    if draws.unsliced:
        sources = sorted({s for s in draws.unsliced if s})
        where = f" at {', '.join(sources[:3])}" if sources else ""
        warnings.warn(
            f"the loss draws random bits over the batch that a microbatch cannot draw its slice of "
            f"({len(draws.unsliced)} of {draws.count} draws{where}: a key other than threefry's, "
            "jax_threefry_partitionable off, a draw in a while or cond body, or a shape the microbatches do not "
            f"cut along one axis); the pipeline runs it {num_microbatches} microbatches at a time, each drawing "
            "its own bits there, so the step is not bit for bit one device's (its masks are as random, not the "
            "same). Plan with num_stages=1 (SPMD splits the bits and keeps them) to run it as one device would.",
            MicrobatchRandomnessWarning, stacklevel=4)
    if not draws.sliced:
        return runs, None
    eqns = tuple(DrawingEqn(**{f.name: getattr(e, f.name) for f in dataclasses.fields(e)})
                 if e.eqn.primitive.name == "random_bits" or _draws_inside(e.eqn) else e for e in runs.forward.eqns)
    return dataclasses.replace(runs, forward=dataclasses.replace(runs.forward, eqns=eqns)), draws
