"""How many times a ``while`` loop runs: derived from its counter, bound by the user, or guessed.

The planner prices a loop's body trip-count times (``Op.trip_count``). A scan's length is static. A
``while`` in the usual counted form (a ``fori_loop`` whose bounds are traced but constant, or a hand
written ``while_loop(lambda c: c[0] < n, ...)``) has one too, read off its jaxprs by
``counted_trip_count``:

- the cond_fun's result is ``lt(i, n)`` (or ``gt(n, i)``) of a carry ``i`` (integer dtype conversions
  of either side looked through),
- ``n`` is a constant: a literal, a constant the cond_fun closes over, or a carry the body passes
  through unchanged whose initial value is a constant,
- the body's carry out ``i`` is ``add(i, s)`` with ``s`` a positive constant,
- ``i``'s initial value is a constant;

then the trip count is ``max(0, ceil((n - i0) / s))``. Any other loop (a data-dependent stop) is priced
at the user's ``while_trip_count`` (``trip_count_option``, set by ``autoshard(..., while_trip_count=N)``)
or, without one, at ``DEFAULT_TRIP_GUESS`` with a ``TripCountGuessWarning`` naming the loop.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from jax.extend import core as jcore

from autoshard.errors import TripCountGuessWarning
from autoshard.ir.primitives import facts

DEFAULT_TRIP_GUESS = 8  # iterations a while loop with a data-dependent stop is priced at, absent an option

_OPTION: contextvars.ContextVar[int | None] = contextvars.ContextVar("autoshard_while_trip_count", default=None)


def scan_operand_counts(params: Any, num_operands: int) -> tuple[int, int]:
    """``(consts, carries)`` among a ``scan`` equation's operands (the rest are its xs). jax 0.10 names them
    in ``num_consts`` / ``num_carry``; jax 0.11 and 0.12 group the operands in an ``ft_in`` tree of
    (consts, carries, xs), whose group sizes its ``update``/``unpack`` give."""
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    consts, carries, _xs = params["ft_in"].update(list(range(num_operands))).unpack()
    return len(consts), len(carries)


def check_trip_count(value: Any) -> int | None:
    """``value`` as a trip count option (a positive int, or None); a clear error otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < 1:
        raise ValueError(f"while_trip_count must be a positive integer (the iterations autoshard prices a while "
                         f"loop whose trip count it cannot derive at), got {value!r}; pass e.g. "
                         f"while_trip_count=16, or None for the default guess of {DEFAULT_TRIP_GUESS}")
    return int(value)


@contextlib.contextmanager
def trip_count_option(value: int | None) -> Iterator[None]:
    """Within the block, tracing prices a while loop it cannot count at ``value`` iterations (None: a guess)."""
    token = _OPTION.set(check_trip_count(value))
    try:
        yield
    finally:
        _OPTION.reset(token)


def stated_trip_count(source: str) -> tuple[int, str]:
    """The trip count of a loop that could not be counted, and its kind: "bound" (the user's option) or
    "guess" (with a warning naming the loop by its source line)."""
    option = _OPTION.get()
    if option is not None:
        return option, "bound"
    warnings.warn(
        f"autoshard cannot derive the trip count of the while loop at {source or '?'} (its stop is not a counter "
        f"compared with a constant); its body is priced as running {DEFAULT_TRIP_GUESS} times, a guess. Pass "
        f"while_trip_count=N to autoshard(...) or autoshard.plan(...) to state how many times it runs.",
        TripCountGuessWarning, stacklevel=3)
    return DEFAULT_TRIP_GUESS, "guess"


def _const_int(atom: Any, known: Callable[[Any], Any]) -> int | None:
    """The integer value of a jaxpr atom when it is constant (a literal, or ``known(atom)`` not None)."""
    return _int_value(atom.val if isinstance(atom, jcore.Literal) else known(atom))


def _int_value(value: Any) -> int | None:
    """A constant's value as a Python int when it is an integer scalar, else None."""
    if value is None:
        return None
    try:
        arr = np.asarray(value)
    except Exception:  # noqa: BLE001 — a tracer or an extended dtype: not a constant we can read
        return None
    if arr.shape != () or not np.issubdtype(arr.dtype, np.integer):
        return None
    return int(arr)


def _producer(jaxpr: jcore.Jaxpr, var: Any) -> Any:
    return next((e for e in jaxpr.eqns if any(o is var for o in e.outvars)), None)


def _unconverted(jaxpr: jcore.Jaxpr, atom: Any) -> Any:
    """``atom`` before the integer dtype conversions applied to it (a weak-typed counter is converted)."""
    while not isinstance(atom, jcore.Literal):
        eqn = _producer(jaxpr, atom)
        if eqn is None or eqn.primitive.name != "convert_element_type" or not np.issubdtype(
                np.dtype(eqn.params["new_dtype"]), np.integer):
            break
        atom = eqn.invars[0]
    return atom


def counted_trip_count(params: dict, inputs: Sequence[Any]) -> int | None:
    """The trip count of a ``while`` equation in the counted form (module docstring), else None.

    ``inputs``: per operand of the equation (cond consts, body consts, initial carries) its constant
    value, or None when it is not a constant."""
    cond, body = params["cond_jaxpr"].jaxpr, params["body_jaxpr"].jaxpr
    cn, bn = int(params["cond_nconsts"]), int(params["body_nconsts"])
    cond_consts, body_consts, inits = inputs[:cn], inputs[cn:cn + bn], inputs[cn + bn:]
    test = _producer(cond, cond.outvars[0])
    order = facts(test.primitive.name).order if test is not None else None
    if order not in ("<", ">"):  # a strict comparison: counter < bound, or bound > counter
        return None
    counter, bound = (_unconverted(cond, a) for a in (test.invars if order == "<" else test.invars[::-1]))
    cond_in = list(cond.invars)
    if isinstance(counter, jcore.Literal) or not any(counter is v for v in cond_in[cn:]):
        return None
    k = next(i for i, v in enumerate(cond_in) if v is counter) - cn

    def cond_known(atom: Any) -> Any:
        for i, v in enumerate(cond_in):
            if v is atom:
                if i < cn:
                    return cond_consts[i]
                m = i - cn  # a carry: constant when the body passes it through unchanged
                return inits[m] if body.outvars[m] is body.invars[bn + m] else None
        return None

    def body_known(atom: Any) -> Any:
        return next((body_consts[i] for i, v in enumerate(body.invars[:bn]) if v is atom), None)

    n, start = _const_int(bound, cond_known), _int_value(inits[k])
    step_eqn = _producer(body, body.outvars[k])
    if n is None or start is None or step_eqn is None or step_eqn.primitive.name != "add":
        return None
    a, b = (_unconverted(body, x) for x in step_eqn.invars)
    other = b if a is body.invars[bn + k] else a if b is body.invars[bn + k] else None
    step = None if other is None else _const_int(other, body_known)
    if step is None or step <= 0:
        return None
    return max(0, math.ceil((n - start) / step))

